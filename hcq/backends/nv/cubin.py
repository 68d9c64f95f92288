"""Reader of the sm_90 cubins NVRTC produces (ELF64, EM_CUDA): each kernel's code, registers, shared memory, stack,
constant bank 0 layout and parameters, and the image the driver would load (sections laid out, relocations applied).

What a kernel needs is spread over the ELF: its code is `.text.<name>`, its static shared memory `.nv.shared.<name>`
(a NOBITS section: its size), its constant bank 0 `.nv.constant0.<name>`, and its attributes `.nv.info.<name>`
(parameters, where they sit in constant bank 0) and `.nv.info` (register count and stack, per function symbol).
An attribute record is (u8 format, u8 attribute, u16 value-or-size): format EIFMT_SVAL carries `size` bytes of
payload after the header, the others carry the u16 inline.

Malformed input raises CompileError, never IndexError or struct.error."""
from __future__ import annotations

import re
import struct
from dataclasses import dataclass, field
from typing import Iterator

from hcq.errors import CompileError

EM_CUDA = 190
ELFCLASS64, ELFDATA2LSB = 2, 1
SHT_PROGBITS, SHT_SYMTAB, SHT_NOBITS, SHT_RELA, SHT_REL = 1, 2, 8, 4, 9
SHF_ALLOC = 0x2
# Attribute formats, and the attributes read here (numbers confirmed against NVRTC 13's sm_90 cubins).
EIFMT_SVAL = 0x04
EIATTR_MAX_THREADS = 0x05  # SVAL u32 x, y, z (__launch_bounds__ / .maxntid)
EIATTR_PARAM_CBANK = 0x0A  # SVAL u32 symbol of .nv.constant0.<kernel>, u16 param offset, u16 param area size
EIATTR_REQNTID = 0x10  # SVAL u32 x, y, z (.reqntid)
EIATTR_FRAME_SIZE = 0x11  # SVAL u32 function symbol, u32 bytes (its own frame)
EIATTR_MIN_STACK_SIZE = 0x12  # SVAL u32 function symbol, u32 bytes (its stack, callees included)
EIATTR_KPARAM_INFO = 0x17  # SVAL u32 index, u16 ordinal, u16 offset, u32 flags (size in bits 31:18)
EIATTR_CBANK_PARAM_SIZE = 0x19  # HVAL param area size
EIATTR_MAXREG_COUNT = 0x1B  # HVAL register limit (0xff: none asked)
EIATTR_REGCOUNT = 0x2F  # SVAL u32 function symbol, u32 registers
# Relocations NVRTC emits for sm_90 (into constant banks: addresses of __device__ variables).
R_CUDA_64 = 0x02  # 64-bit address S + A
R_CUDA_ABS32_LO_32 = 0x38  # low 32 bits of S + A into bits 63:32 of the instruction word at the offset
R_CUDA_ABS32_HI_32 = 0x39  # high 32 bits of S + A into bits 63:32
RELOCATION_NAMES = {R_CUDA_64: "R_CUDA_64", R_CUDA_ABS32_LO_32: "R_CUDA_ABS32_LO_32", R_CUDA_ABS32_HI_32: "R_CUDA_ABS32_HI_32"}
TEXT_ALIGN, CONSTANT_ALIGN = 128, 256  # what the GPU needs of code and of constant-buffer addresses
IMAGE_ALIGN = max(TEXT_ALIGN, CONSTANT_ALIGN)  # base_va must be aligned so (the image's own offsets keep the rest)
MAX_SECTION_ALIGN, MAX_IMAGE_BYTES = 1 << 16, 1 << 28  # beyond these a cubin is refused (malformed, or too big to load)
_NOT_LOADED = (".nv.shared.", ".nv.local.")  # NOBITS windows the GPU provides per block / thread, not image memory
_CONSTANT_RE = re.compile(r"\.nv\.constant(\d+)(?:\.(.+))?")


@dataclass(frozen=True)
class CubinParam:
    """One kernel parameter: its ordinal, offset (relative to the kernel's param_base in constant bank 0) and size."""
    ordinal: int
    offset: int
    size: int


@dataclass(frozen=True)
class CubinKernel:
    """What launching a kernel needs to know of it."""
    name: str
    registers: int
    shared_bytes: int  # static shared memory: the size of .nv.shared.<name>, which (CUDA 12.9 and 13, sm_90) starts with
    #                    the 1 KiB the driver reserves per block when the kernel has __shared__ variables; 0 without
    local_bytes: int  # per-thread stack (EIATTR_MIN_STACK_SIZE, else FRAME_SIZE)
    cbank0_size: int  # size of its .nv.constant0 section
    param_base: int  # offset of the parameters in constant bank 0
    params: tuple[CubinParam, ...]  # by ordinal
    max_threads: int | None = None  # threads per block the kernel was built for (REQNTID, else MAX_THREADS), or None
    param_size: int = 0  # size of the parameter area (EIATTR_PARAM_CBANK / CBANK_PARAM_SIZE)
    max_registers: int | None = None  # EIATTR_MAXREG_COUNT's limit, when one was asked


@dataclass(frozen=True)
class LoadedImage:
    """A cubin laid out for GPU memory at a base address, relocations applied."""
    data: bytes
    text: dict[str, tuple[int, int]]  # kernel -> (offset, size) of its code in data
    constants: dict[tuple[str | None, int], tuple[int, int]] = field(default_factory=dict)  # (kernel or None, bank) -> (offset, size)


@dataclass(frozen=True)
class _Section:
    index: int
    name: str
    type: int
    flags: int
    offset: int
    size: int
    link: int
    info: int
    align: int
    entsize: int


@dataclass(frozen=True)
class _Symbol:
    name: str
    info: int
    other: int
    shndx: int
    value: int


@dataclass(frozen=True)
class Cubin:
    """A parsed cubin."""
    arch: int  # e.g. 90
    kernels: dict[str, CubinKernel]
    raw: bytes = field(repr=False, default=b"")
    _sections: tuple[_Section, ...] = field(repr=False, compare=False, default=())
    _symbols: tuple[_Symbol, ...] = field(repr=False, compare=False, default=())
    _placed: dict[int, int] = field(repr=False, compare=False, default_factory=dict)  # loaded section index -> image offset
    _size: int = field(repr=False, compare=False, default=0)

    def image(self, base_va: int) -> LoadedImage:
        """The image to copy to GPU memory at `base_va` (a multiple of IMAGE_ALIGN): the SHF_ALLOC sections one after
        another, each at its alignment (code at 128 bytes, constant banks at 256 at least; NOBITS ones such as
        .nv.global zero-filled; shared and local memory windows left out), with the relocations into them applied."""
        if base_va % IMAGE_ALIGN: raise ValueError(f"a cubin image must be loaded at a multiple of {IMAGE_ALIGN:#x}, not {base_va:#x}")
        image, placed = bytearray(self._size), self._placed
        for s in self._sections:
            if s.index in placed and s.type != SHT_NOBITS: image[placed[s.index]:placed[s.index] + s.size] = self.raw[s.offset:s.offset + s.size]
        for s in self._sections:
            if s.type in (SHT_RELA, SHT_REL) and s.info in placed: self._relocate(image, s, placed, base_va)
        text, constants = {}, {}
        for s in self._sections:
            if s.index not in placed: continue
            if s.name.startswith(".text.") and s.name[6:] in self.kernels: text[s.name[6:]] = (placed[s.index], s.size)
            elif m := _CONSTANT_RE.fullmatch(s.name): constants[(m.group(2), int(m.group(1)))] = (placed[s.index], s.size)
        return LoadedImage(bytes(image), text, constants)

    def _relocate(self, image: bytearray, rel: _Section, placed: dict[int, int], base_va: int) -> None:
        target = self._sections[rel.info]
        entsize = 24 if rel.type == SHT_RELA else 16
        for off in range(0, rel.size - rel.size % entsize, entsize):
            r_offset, r_info = struct.unpack_from("<QQ", self.raw, rel.offset + off)
            kind, sym_index = r_info & 0xFFFFFFFF, r_info >> 32
            width = 8 if kind == R_CUDA_64 else 4
            where = r_offset + (0 if kind == R_CUDA_64 else 4)
            if kind not in RELOCATION_NAMES:
                raise CompileError(f"cubin: unsupported relocation type {kind:#x} in {rel.name} (hcq applies "
                                   f"{', '.join(f'{n} ({t:#x})' for t, n in RELOCATION_NAMES.items())})")
            if where + width > target.size: raise CompileError(f"cubin: relocation at {r_offset:#x} lies outside {target.name}")
            at = placed[target.index] + where
            addend = struct.unpack_from("<q", self.raw, rel.offset + off + 16)[0] if rel.type == SHT_RELA else \
                int.from_bytes(image[at:at + width], "little")
            value = self._symbol_address(sym_index, placed, base_va, rel.name) + addend
            field_value = value if kind == R_CUDA_64 else value & 0xFFFFFFFF if kind == R_CUDA_ABS32_LO_32 else value >> 32
            image[at:at + width] = (field_value & ((1 << 8 * width) - 1)).to_bytes(width, "little")

    def _symbol_address(self, index: int, placed: dict[int, int], base_va: int, where: str) -> int:
        if not 0 < index < len(self._symbols): raise CompileError(f"cubin: a relocation in {where} names symbol {index}, which does not exist")
        sym = self._symbols[index]
        if sym.shndx not in placed:
            raise CompileError(f"cubin: a relocation in {where} refers to {sym.name or f'symbol {index}'!r}, which is not in the "
                               "loaded image (undefined, or in a section that is not loaded)")
        return base_va + placed[sym.shndx] + sym.value


def _layout(sections: tuple[_Section, ...]) -> tuple[dict[int, int], int]:
    """Where each loaded section goes in the image ({section index: offset}), and the image's size."""
    placed, size = {}, 0
    for s in sections:
        if not s.flags & SHF_ALLOC or s.name.startswith(_NOT_LOADED) or s.type not in (SHT_PROGBITS, SHT_NOBITS): continue
        align = max(s.align, 1, TEXT_ALIGN if s.name.startswith(".text.") else CONSTANT_ALIGN if _CONSTANT_RE.fullmatch(s.name) else 1)
        if align > MAX_SECTION_ALIGN or align & (align - 1): raise CompileError(f"cubin: section {s.name} has alignment {s.align:#x}")
        placed[s.index] = size = size + -size % align
        size += s.size
        if size > MAX_IMAGE_BYTES:
            raise CompileError(f"cubin: the loaded sections come to more than {MAX_IMAGE_BYTES >> 20} MiB (malformed, or __device__ "
                               "variables too large to load with the code; allocate such memory as buffers instead)")
    return placed, size


def _cstr(data: bytes, start: int, what: str) -> str:
    end = data.find(b"\0", start)
    if start < 0 or start >= len(data) or end < 0: raise CompileError(f"cubin: a name in {what} runs past its table")
    return data[start:end].decode(errors="replace")


def _unpack(fmt: str, data: bytes, offset: int, what: str) -> tuple[int, ...]:
    if offset < 0 or offset + struct.calcsize(fmt) > len(data): raise CompileError(f"cubin: {what} is truncated")
    return struct.unpack_from(fmt, data, offset)


def _section_data(data: bytes, s: _Section) -> bytes:
    if s.type == SHT_NOBITS: return b""
    if s.offset + s.size > len(data): raise CompileError(f"cubin: section {s.name or s.index} runs past the end of the file")
    return data[s.offset:s.offset + s.size]


def attributes(info: bytes, where: str) -> Iterator[tuple[int, int, bytes | int]]:
    """The (format, attribute, payload bytes or inline u16) records of an .nv.info section's contents."""
    at = 0
    while at + 4 <= len(info):
        fmt, attr, size = struct.unpack_from("<BBH", info, at)
        at += 4
        if fmt == EIFMT_SVAL:
            if at + size > len(info): raise CompileError(f"cubin: attribute {attr:#x} in {where} is truncated")
            yield fmt, attr, info[at:at + size]
            at += size
        else:
            yield fmt, attr, size
    if at != len(info): raise CompileError(f"cubin: {where} ends inside an attribute header")


def _payload(value: bytes | int, n: int, attr: int, where: str) -> tuple[int, ...]:
    if not isinstance(value, bytes) or len(value) < 4 * n: raise CompileError(f"cubin: attribute {attr:#x} in {where} has the wrong form")
    return struct.unpack_from(f"<{n}I", value)


def read_cubin(data: bytes) -> Cubin:
    """Parse a cubin; CompileError when it is not a well-formed EM_CUDA ELF64 (little-endian)."""
    data = bytes(data)
    if data[:4] != b"\x7fELF": raise CompileError("cubin: not an ELF file (no \\x7fELF magic)")
    if len(data) < 64: raise CompileError(f"cubin: truncated ELF header ({len(data)} bytes)")
    if data[4] != ELFCLASS64: raise CompileError(f"cubin: ELF class {data[4]} is not ELFCLASS64; an sm_90 cubin is 64-bit")
    if data[5] != ELFDATA2LSB: raise CompileError("cubin: not a little-endian ELF")
    machine, = _unpack("<H", data, 18, "the ELF header")
    if machine != EM_CUDA: raise CompileError(f"cubin: ELF machine {machine} is not EM_CUDA ({EM_CUDA}); not an NVIDIA GPU binary")
    e_flags, = _unpack("<I", data, 48, "the ELF header")
    # ABI version 8 (CUDA 13) keeps the SM in bits 15:8 of e_flags, older ones in bits 7:0
    arch = (e_flags >> 8) & 0xFF if data[8] >= 8 else e_flags & 0xFF
    phoff, shoff = _unpack("<QQ", data, 32, "the ELF header")
    phentsize, phnum, shentsize, shnum, shstrndx = _unpack("<HHHHH", data, 54, "the ELF header")
    if phnum and phoff + phnum * phentsize > len(data): raise CompileError("cubin: the program header table runs past the end of the file (truncated?)")
    if shnum == 0 or shentsize != 64: raise CompileError(f"cubin: unexpected section table ({shnum} entries of {shentsize} bytes)")
    headers = [_unpack("<IIQQQQIIQQ", data, shoff + i * 64, "the section table") for i in range(shnum)]
    if shstrndx >= shnum: raise CompileError("cubin: the section-name table index is out of range")
    shstr_h = headers[shstrndx]
    shstr = _section_data(data, _Section(shstrndx, ".shstrtab", shstr_h[1], 0, shstr_h[4], shstr_h[5], 0, 0, 1, 0))
    sections = tuple(_Section(i, _cstr(shstr, h[0], ".shstrtab") if h[1] else "", h[1], h[2], h[4], h[5], h[6], h[7], h[8], h[9])
                     for i, h in enumerate(headers))
    for s in sections: _section_data(data, s)  # (checks every section lies inside the file)
    for s in sections:
        if s.type in (SHT_REL, SHT_RELA) and s.info >= shnum: raise CompileError(f"cubin: {s.name} relocates section {s.info}, which does not exist")
    symbols = _read_symbols(data, sections)
    by_name = {s.name: s for s in sections}

    # .nv.info: per-function register counts and stack sizes, keyed by symbol index
    per_symbol: dict[int, dict[int, int]] = {}
    if (info := by_name.get(".nv.info")) is not None:
        for _, attr, value in attributes(_section_data(data, info), ".nv.info"):
            if attr in (EIATTR_REGCOUNT, EIATTR_FRAME_SIZE, EIATTR_MIN_STACK_SIZE):
                sym, amount = _payload(value, 2, attr, ".nv.info")
                per_symbol.setdefault(sym, {})[attr] = amount
    by_symbol_name = {sym.name: i for i, sym in enumerate(symbols) if sym.name}

    kernels = {}
    for s in sections:
        if not s.name.startswith(".text.") or (kinfo := by_name.get(".nv.info." + s.name[6:])) is None: continue
        name = s.name[6:]
        sym_attrs = per_symbol.get(by_symbol_name.get(name, s.info & 0xFFFFFF), {})
        registers = sym_attrs.get(EIATTR_REGCOUNT, s.info >> 24)  # (older cubins keep it in sh_info 31:24 too)
        local = sym_attrs.get(EIATTR_MIN_STACK_SIZE, sym_attrs.get(EIATTR_FRAME_SIZE, 0))
        shared = by_name[f".nv.shared.{name}"].size if f".nv.shared.{name}" in by_name else 0
        cbank0 = by_name[f".nv.constant0.{name}"].size if f".nv.constant0.{name}" in by_name else 0
        params, param_base, param_size, cbank_param_size = [], None, None, None
        max_threads, reqntid, maxreg = None, None, None
        where = kinfo.name
        for fmt, attr, value in attributes(_section_data(data, kinfo), where):
            if attr == EIATTR_KPARAM_INFO:
                _, ordinal_offset, flags = _payload(value, 3, attr, where)
                params.append(CubinParam(ordinal_offset & 0xFFFF, ordinal_offset >> 16, flags >> 18))
            elif attr == EIATTR_PARAM_CBANK:
                _, base_size = _payload(value, 2, attr, where)
                param_base, param_size = base_size & 0xFFFF, base_size >> 16
            elif attr == EIATTR_CBANK_PARAM_SIZE and isinstance(value, int):
                cbank_param_size = value
            elif attr in (EIATTR_REQNTID, EIATTR_MAX_THREADS):
                x, y, z = _payload(value, 3, attr, where)
                if attr == EIATTR_REQNTID: reqntid = x * y * z
                else: max_threads = x * y * z
            elif attr == EIATTR_MAXREG_COUNT and isinstance(value, int) and value != 0xFF:
                maxreg = value
        params.sort(key=lambda p: p.ordinal)
        if [p.ordinal for p in params] != list(range(len(params))):
            raise CompileError(f"cubin: kernel {name!r} has parameter ordinals {[p.ordinal for p in params]}, not 0..{len(params) - 1}")
        size = param_size if param_size is not None else cbank_param_size if cbank_param_size is not None else \
            max((p.offset + p.size for p in params), default=0)
        base = param_base if param_base is not None else cbank0 - size
        if params and (base < 0 or base + max(p.offset + p.size for p in params) > cbank0):
            raise CompileError(f"cubin: kernel {name!r}'s parameters do not fit its constant bank 0 ({cbank0} bytes)")
        kernels[name] = CubinKernel(name, registers, shared, local, cbank0, base, tuple(params),
                                    reqntid if reqntid is not None else max_threads, size, maxreg)
    cubin = Cubin(arch, kernels, data, sections, symbols, *_layout(sections))
    cubin.image(0)  # (so relocations that cannot be applied are refused now, not at a launch)
    return cubin


def _read_symbols(data: bytes, sections: tuple[_Section, ...]) -> tuple[_Symbol, ...]:
    symtab = next((s for s in sections if s.type == SHT_SYMTAB), None)
    if symtab is None: return ()
    if symtab.link >= len(sections): raise CompileError("cubin: the symbol table names a string table that does not exist")
    strtab, raw = _section_data(data, sections[symtab.link]), _section_data(data, symtab)
    out = []
    for at in range(0, len(raw) - len(raw) % 24, 24):
        name, info, other, shndx, value, _ = struct.unpack_from("<IBBHQQ", raw, at)
        out.append(_Symbol(_cstr(strtab, name, "the symbol names") if name else "", info, other, shndx, value))
    return tuple(out)
