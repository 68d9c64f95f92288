"""Loading relocatable kernel objects (what `cc -c -fPIC` writes: ELF64, x86-64) into this process without a linker
or the dynamic loader: the sections are laid out in one mapping, the relocations applied, and the code and constant
pages sealed read-only before anything runs. This skips the link step at build time (4-5 ms of `ld` for a kernel
without the C library, about 50 ms of the compiler driver's link for one with it) and `dlopen` at load time; an object this loader cannot take (thread-locals, constructors, other relocations or machines) is linked
into a shared object instead (`refusal` says why, at build time).

Symbols the object does not define are looked up in the process (as `dlopen` would: the C library, libm,
libgcc_s), and calls to them go through stubs placed next to the code, so they reach anywhere in the address space."""
from __future__ import annotations

import ctypes
import functools
import mmap
import os
import platform
import struct
from dataclasses import dataclass

from hcq.errors import CompileError

_EHDR = struct.Struct("<16sHHIQQQIHHHHHH")
_SHDR = struct.Struct("<IIQQQQIIQQ")
_SYM = struct.Struct("<IBBHQQ")
_RELA = struct.Struct("<QQq")
ET_REL, EM_X86_64 = 1, 62
SHT_PROGBITS, SHT_SYMTAB, SHT_RELA, SHT_NOBITS, SHT_REL = 1, 2, 4, 8, 9
SHT_INIT_ARRAY, SHT_FINI_ARRAY, SHT_PREINIT_ARRAY, SHT_GROUP = 14, 15, 16, 17
SHF_WRITE, SHF_ALLOC, SHF_EXECINSTR, SHF_TLS = 0x1, 0x2, 0x4, 0x400
SHN_UNDEF, SHN_ABS, SHN_COMMON, SHN_LORESERVE = 0, 0xFFF1, 0xFFF2, 0xFF00
STT_SECTION, STT_TLS = 3, 6
STB_LOCAL = 0
# x86-64 relocations: what each computes (S symbol, A addend, P place, G its GOT slot) and how many bytes it writes
R_NONE, R_64, R_PC32, R_PLT32, R_GOTPCREL, R_PC64, R_GOTPCRELX, R_REX_GOTPCRELX = 0, 1, 2, 4, 9, 24, 41, 42
_GOT_RELOCS = frozenset({R_GOTPCREL, R_GOTPCRELX, R_REX_GOTPCRELX})
_RELOC_NAMES = {R_64: "R_X86_64_64", R_PC32: "R_X86_64_PC32", R_PLT32: "R_X86_64_PLT32", R_GOTPCREL: "R_X86_64_GOTPCREL",
                R_PC64: "R_X86_64_PC64", R_GOTPCRELX: "R_X86_64_GOTPCRELX", R_REX_GOTPCRELX: "R_X86_64_REX_GOTPCRELX"}
STUB = bytes.fromhex("ff2500000000cccc")  # jmp *[rip + 0]: the 8-byte target follows in the GOT, patched per stub
PAGE = mmap.PAGESIZE
VERSION = "2"  # of what refusal() accepts: part of the compile cache's key for objects kept for this loader
SUPPORTED = platform.machine().lower() in ("x86_64", "amd64")  # (elsewhere kernels are linked and dlopen()ed)
WRONG_MACHINE = f"the loader handles x86-64 objects only (this is {platform.machine()})"


@dataclass(frozen=True)
class Section:
    index: int
    name: str
    type: int
    flags: int
    offset: int
    size: int
    link: int
    info: int
    align: int


@dataclass(frozen=True)
class Symbol:
    name: str
    value: int
    size: int
    bind: int
    type: int
    shndx: int


class ObjectFile:
    """The parts of an ELF64 relocatable object the loader needs; malformed input raises CompileError."""

    def __init__(self, data: bytes):
        self.data = data
        try:
            self._parse()
        except (struct.error, IndexError, UnicodeDecodeError, ValueError) as e:
            raise CompileError(f"malformed kernel object: {e}") from e

    def _parse(self) -> None:
        (ident, self.type, self.machine, _, _, _, shoff, _, _, _, _, shentsize, shnum, shstrndx) = _EHDR.unpack_from(self.data, 0)
        if ident[:4] != b"\x7fELF" or ident[4] != 2 or ident[5] != 1: raise ValueError("not a little-endian ELF64 file")
        if shentsize != _SHDR.size: raise ValueError(f"section header size {shentsize}")
        raw = [_SHDR.unpack_from(self.data, shoff + i * shentsize) for i in range(shnum)]
        names = raw[shstrndx] if shnum else None
        self.sections = [Section(i, self._string(names[4], names[5], h[0]) if names else "", h[1], h[2], h[4], h[5], h[6], h[7], h[8])
                         for i, h in enumerate(raw)]
        for sec in self.sections:
            if sec.type != SHT_NOBITS and sec.offset + sec.size > len(self.data): raise ValueError(f"section {sec.name} runs past the end")
        self.symbols: list[Symbol] = []
        for sec in self.sections:
            if sec.type != SHT_SYMTAB: continue
            strtab = self.sections[sec.link]
            for off in range(sec.offset, sec.offset + sec.size, _SYM.size):
                name, info, _, shndx, value, size = _SYM.unpack_from(self.data, off)
                named = info >> 4 != STB_LOCAL or shndx == SHN_UNDEF  # (local symbols are found by index: their names are not read)
                self.symbols.append(Symbol(self._string(strtab.offset, strtab.size, name) if named else "", value, size, info >> 4, info & 0xF, shndx))
        self._relocations: dict[int, list[tuple[int, int, int, int]]] = {}

    def _string(self, table_offset: int, table_size: int, index: int) -> str:
        if index >= table_size: raise ValueError(f"string index {index} outside its table")
        end = self.data.index(b"\0", table_offset + index, table_offset + table_size)
        return self.data[table_offset + index:end].decode()

    def relocations(self, sec: Section) -> list[tuple[int, int, int, int]]:
        """(offset, type, symbol index, addend) of RELA section `sec`."""
        if (out := self._relocations.get(sec.index)) is None:
            out = self._relocations[sec.index] = [(r_offset, r_info & 0xFFFFFFFF, r_info >> 32, addend)
                                                  for r_offset, r_info, addend in _RELA.iter_unpack(self.data[sec.offset:sec.offset + sec.size])]
        return out


def _loaded_sections(obj: ObjectFile) -> list[Section]:
    return [s for s in obj.sections if s.flags & SHF_ALLOC and s.type in (SHT_PROGBITS, SHT_NOBITS) and s.name != ".eh_frame"]


def refusal(data: bytes) -> str | None:
    """Why this loader cannot load object `data` (None: it can). Checked at build time, where the answer decides
    between keeping the object and linking a shared object."""
    if not SUPPORTED: return WRONG_MACHINE
    try:
        obj = ObjectFile(data)
    except CompileError as e:
        return str(e)
    return _refusal(obj, check_symbols=True)


def _refusal(obj: ObjectFile, check_symbols: bool) -> str | None:
    if obj.type != ET_REL or obj.machine != EM_X86_64: return f"not an x86-64 relocatable object (type {obj.type}, machine {obj.machine})"
    for s in obj.sections:
        if s.flags & SHF_TLS: return f"section {s.name} holds thread-local variables"
        if s.type in (SHT_INIT_ARRAY, SHT_FINI_ARRAY, SHT_PREINIT_ARRAY): return f"section {s.name} holds constructors or destructors"
        if s.type in (SHT_REL, SHT_GROUP): return f"section {s.name} has type {s.type}"
    if any(sym.type == STT_TLS for sym in obj.symbols): return "it has thread-local symbols"
    sections = _loaded_sections(obj)
    loaded = {s.index: s for s in sections}
    for s in _relocation_sections(obj, sections):
        for offset, rtype, sym_index, _ in obj.relocations(s):
            if rtype == R_NONE: continue
            if rtype not in _RELOC_NAMES: return f"relocation type {rtype} in {s.name}"
            if sym_index >= len(obj.symbols) or offset + (8 if rtype in (R_64, R_PC64) else 4) > loaded[s.info].size:
                return f"malformed kernel object: a relocation in {s.name} points outside its section or symbol table"
    for name in _used_undefined(obj, sections) if check_symbols else ():
        if process_symbol(name) is None:  # (e.g. libgcc's __cpu_model, which only the static libgcc that the linker adds defines)
            return f"it uses {name}, which this process does not define"
    return None


def _used_undefined(obj: ObjectFile, sections: list[Section]) -> list[str]:
    """The symbols the loaded sections' relocations use but the object does not define (gcc also lists
    _GLOBAL_OFFSET_TABLE_ as undefined without using it)."""
    return sorted({obj.symbols[sym].name for rs in _relocation_sections(obj, sections)
                   for _, rtype, sym, _ in obj.relocations(rs) if rtype != R_NONE and obj.symbols[sym].shndx == SHN_UNDEF})


def _relocation_sections(obj: ObjectFile, sections: list[Section]) -> list[Section]:
    """The RELA sections of `obj` that relocate one of `sections` (those loaded)."""
    loaded = {s.index for s in sections}
    return [s for s in obj.sections if s.type == SHT_RELA and s.info in loaded]


@functools.cache
def _process_libraries() -> tuple[ctypes.CDLL, ...]:
    """Where undefined symbols are looked up: the process's global scope, then libm and libgcc_s (compiler helpers
    such as half-precision conversions), loaded if they are not already."""
    libs = [ctypes.CDLL(None)]
    for name in ("libm.so.6", "libgcc_s.so.1"):
        try:
            libs.append(ctypes.CDLL(name))
        except OSError:
            pass
    return tuple(libs)


@functools.lru_cache(maxsize=4096)
def process_symbol(name: str) -> int | None:
    """The address of `name` in this process (as the dynamic loader would find it), or None."""
    for lib in _process_libraries():
        try:
            return ctypes.cast(getattr(lib, name), ctypes.c_void_p).value
        except AttributeError:
            continue
    return None


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mprotect.argtypes, _libc.mprotect.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int


def _round_up(x: int, align: int) -> int:
    return (x + align - 1) // align * align


@dataclass
class _Layout:
    """Where everything of an object goes in its mapping (offsets): three page-aligned regions, code (+ stubs that
    jump to the process's functions), read-only data (+ GOT slots) and writable data (+ common symbols)."""
    place: dict[int, int]  # section index -> offset
    bounds: dict[str, tuple[int, int]]  # region -> (start, end)
    stubs_at: int
    got_at: int
    common_at: dict[str, int]
    size: int


def _lay_out(sections: list[Section], undefined: list[str], common: list[Symbol], ngot: int) -> _Layout:
    kinds = {"code": [s for s in sections if s.flags & SHF_EXECINSTR],
             "const": [s for s in sections if not s.flags & (SHF_EXECINSTR | SHF_WRITE)],
             "data": [s for s in sections if s.flags & SHF_WRITE and not s.flags & SHF_EXECINSTR]}
    place: dict[int, int] = {}
    bounds: dict[str, tuple[int, int]] = {}
    common_at: dict[str, int] = {}
    offset = stubs_at = got_at = 0
    for kind, secs in kinds.items():
        start = offset
        for s in secs:
            offset = _round_up(offset, max(1, s.align))
            place[s.index], offset = offset, offset + s.size
        if kind == "code":
            stubs_at = _round_up(offset, 8)
            offset = stubs_at + len(STUB) * len(undefined)
        elif kind == "const":
            got_at = _round_up(offset, 8)
            offset = got_at + 8 * (ngot + len(undefined))
        else:
            for sym in common:
                offset = _round_up(offset, max(1, sym.value))
                common_at[sym.name], offset = offset, offset + sym.size
        bounds[kind] = (start, offset)
        offset = _round_up(offset, PAGE)
    return _Layout(place, bounds, stubs_at, got_at, common_at, max(offset, PAGE))


class LoadedObject:
    """An object's sections mapped into this process and relocated: `symbols` maps every defined, named symbol to its
    address. The mapping lives as long as this object."""

    def __init__(self, data: bytes):
        obj = ObjectFile(data)
        if (why := _refusal(obj, check_symbols=False) if SUPPORTED else WRONG_MACHINE) is not None:  # (symbols: checked below)
            raise CompileError(f"cannot load this kernel object in-process: {why}")
        sections = _loaded_sections(obj)
        undefined = _used_undefined(obj, sections)
        gotted = sorted({sym for rs in _relocation_sections(obj, sections) for _, t, sym, _ in obj.relocations(rs) if t in _GOT_RELOCS})
        lay = _lay_out(sections, undefined, [s for s in obj.symbols if s.shndx == SHN_COMMON], len(gotted))
        self._map = mmap.mmap(-1, lay.size, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        self.base = base = ctypes.addressof(ctypes.c_char.from_buffer(self._map))
        self.size = lay.size
        for s in sections:
            if s.type == SHT_PROGBITS: self._map[lay.place[s.index]:lay.place[s.index] + s.size] = obj.data[s.offset:s.offset + s.size]
        in_process, stubs = self._link_process_symbols(undefined, lay, len(gotted))

        def address(sym: Symbol) -> int:
            if sym.shndx == SHN_UNDEF: return stubs[sym.name]
            if sym.shndx == SHN_ABS: return sym.value
            if sym.shndx == SHN_COMMON: return base + lay.common_at[sym.name]
            if sym.shndx >= SHN_LORESERVE or sym.shndx not in lay.place:
                raise CompileError(f"kernel object: symbol {sym.name!r} lies in section {sym.shndx}, which is not loaded")
            return base + lay.place[sym.shndx] + (0 if sym.type == STT_SECTION else sym.value)

        got_slot = {sym: lay.got_at + 8 * i for i, sym in enumerate(gotted)}
        for sym_index, slot in got_slot.items():
            sym = obj.symbols[sym_index]  # (an undefined one's slot holds the symbol itself, data or function, not its stub)
            struct.pack_into("<Q", self._map, slot, in_process[sym.name] if sym.shndx == SHN_UNDEF else address(sym))
        for rs in _relocation_sections(obj, sections):
            for r_offset, rtype, sym_index, addend in obj.relocations(rs):
                if rtype == R_NONE: continue
                at = lay.place[rs.info] + r_offset
                p = base + at
                if rtype in _GOT_RELOCS: value, size = base + got_slot[sym_index] + addend - p, 4
                else:
                    target = address(obj.symbols[sym_index])
                    value, size = {R_64: (target + addend, 8), R_PC64: (target + addend - p, 8)}.get(rtype, (target + addend - p, 4))
                if size == 4 and not -2**31 <= value < 2**31:
                    raise CompileError(f"kernel object: {_RELOC_NAMES[rtype]} to {obj.symbols[sym_index].name!r} is out of range")
                struct.pack_into("<Q" if size == 8 else "<i", self._map, at, value & (2**64 - 1) if size == 8 else value)
        self.symbols = {s.name: address(s) for s in obj.symbols if s.name and s.bind != STB_LOCAL and s.shndx != SHN_UNDEF}
        self._seal(lay)

    def _link_process_symbols(self, undefined: list[str], lay: _Layout, ngot: int) -> tuple[dict[str, int], dict[str, int]]:
        """Look the object's undefined symbols up in the process: ({name: address}, {name: its stub's address}); each
        stub jumps through a GOT slot, so calls reach anywhere in the address space."""
        in_process, stubs = {}, {}
        for i, name in enumerate(undefined):
            if (addr := process_symbol(name)) is None:
                raise CompileError(f"kernel code refers to {name!r}, which neither the kernel nor this process defines")
            slot, stub = lay.got_at + 8 * (ngot + i), lay.stubs_at + len(STUB) * i
            struct.pack_into("<Q", self._map, slot, addr)
            self._map[stub:stub + len(STUB)] = STUB
            struct.pack_into("<i", self._map, stub + 2, slot - (stub + 6))
            in_process[name], stubs[name] = addr, self.base + stub
        return in_process, stubs

    def _seal(self, lay: _Layout) -> None:
        """Code pages read+execute, constant pages read-only, before anything runs."""
        for kind, prot in (("code", mmap.PROT_READ | mmap.PROT_EXEC), ("const", mmap.PROT_READ)):
            start, end = lay.bounds[kind]
            if end > start and _libc.mprotect(self.base + start, _round_up(end, PAGE) - start, prot) != 0:
                raise CompileError(f"cannot make loaded kernel {kind} pages {'executable' if kind == 'code' else 'read-only'}: "
                                   f"{os.strerror(ctypes.get_errno())} (a security policy against executable anonymous memory, such as "
                                   "SELinux's deny_execmem?); set HCQ_CPU_DLOPEN=1 to load kernels as shared objects instead")
