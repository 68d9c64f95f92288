"""GLSL compute shaders to SPIR-V with glslang (`glslangValidator`, cached by content like C kernels), and what the
loader reads back from the SPIR-V: the kernel's argument block and its local size.

A kernel's arguments are a struct in device memory that the kernel reads through a buffer reference whose address
is the one push constant (see docs/kernels.md, "Vulkan"):

    layout(buffer_reference, std430) buffer U32 { uint v[]; };
    layout(buffer_reference, std430) readonly buffer Args { U32 out_; uint value; uint n; };
    layout(push_constant) uniform Push { Args args; };

The members of that struct are the kernel's parameters: buffer references are pointers (filled with buffer
addresses), integers and floats are values; their offsets are the struct's layout.

Or, as most Vulkan compute code is written, buffers are storage-buffer bindings of descriptor set 0 and values are
push constants:

    layout(std430, binding = 0) buffer Out { uint out_[]; };
    layout(push_constant) uniform Push { uint value; uint n; };

The bindings are then the buffer parameters, in binding order, and the push constant members the values, in order."""
from __future__ import annotations

import dataclasses
import functools
import shutil
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path

from hcq.errors import CompileError
from hcq.helpers import round_up
from hcq.program import ArgSlot
from hcq.toolchain import cached_build, run_compiler

GLSLANG = "glslangValidator"
GLSLANG_FLAGS = ("-V", "--target-env", "vulkan1.2", "-S", "comp")
SPIRV_MAGIC = 0x07230203

# SPIR-V opcodes, decorations and storage classes the reflection reads (SPIR-V 1.x specification).
OP_NAME, OP_MEMBER_NAME, OP_EXECUTION_MODE, OP_TYPE_BOOL, OP_TYPE_INT, OP_TYPE_FLOAT = 5, 6, 16, 20, 21, 22
OP_TYPE_VECTOR, OP_TYPE_MATRIX, OP_TYPE_IMAGE, OP_TYPE_SAMPLER, OP_TYPE_SAMPLED_IMAGE = 23, 24, 25, 26, 27
OP_TYPE_ARRAY, OP_TYPE_RUNTIME_ARRAY, OP_TYPE_STRUCT, OP_TYPE_POINTER = 28, 29, 30, 32
OP_CONSTANT, OP_CONSTANT_COMPOSITE, OP_SPEC_CONSTANT, OP_SPEC_CONSTANT_COMPOSITE = 43, 44, 50, 51
OP_VARIABLE, OP_DECORATE, OP_MEMBER_DECORATE = 59, 71, 72
DEC_SPEC_ID, DEC_BLOCK, DEC_BUFFER_BLOCK, DEC_BUILTIN, DEC_NON_WRITABLE, DEC_BINDING, DEC_DESCRIPTOR_SET, DEC_OFFSET = 1, 2, 3, 11, 24, 33, 34, 35
BUILTIN_WORKGROUP_SIZE = 25
MODE_LOCAL_SIZE = 17
SC_UNIFORM_CONSTANT, SC_UNIFORM, SC_PUSH_CONSTANT, SC_STORAGE_BUFFER, SC_PHYSICAL_STORAGE_BUFFER = 0, 2, 9, 12, 5349
RESOURCE_CLASSES = (SC_UNIFORM_CONSTANT, SC_UNIFORM, SC_STORAGE_BUFFER)  # variables that take descriptors
TYPE_WORDS = {OP_TYPE_BOOL: "a bool", OP_TYPE_VECTOR: "a vector", OP_TYPE_MATRIX: "a matrix", OP_TYPE_ARRAY: "an array",
              OP_TYPE_RUNTIME_ARRAY: "an array", OP_TYPE_STRUCT: "a struct", OP_TYPE_POINTER: "a pointer"}
FIX_PUSH = ("push constant parameters must be integer or float scalars: pass buffers as storage-buffer bindings "
            "(layout(std430, binding = N) buffer), or every parameter through an argument struct (see docs/kernels.md)")


@functools.lru_cache(maxsize=None)
def glslang() -> tuple[str, str]:
    """(path, version line) of glslangValidator, or CompileError saying how to install it."""
    path = shutil.which(GLSLANG)
    if path is None: raise CompileError(f"{GLSLANG} is not installed (apt-get install glslang-tools)")
    rc, out = run_compiler([path, "--version"], "the version query")
    return path, (out.splitlines() or ["unknown"])[0]


class VKCompiler:
    """GLSL compute shader source -> SPIR-V bytes (one kernel per source, entry point `main`)."""

    def compile(self, source: str) -> bytes:
        path, version = glslang()
        return cached_build("vk-spirv", (source, " ".join(GLSLANG_FLAGS), version), ".spv", lambda: _run_glslang(path, source))


def _run_glslang(path: str, source: str) -> bytes:
    with tempfile.TemporaryDirectory(prefix="hcq-glsl-") as tmp:
        src, out = Path(tmp) / "kernel.comp", Path(tmp) / "kernel.spv"
        src.write_text(source)
        rc, output = run_compiler([path, *GLSLANG_FLAGS, "-o", str(out), str(src)], "a GLSL kernel")
        if rc != 0 or not out.exists():
            lines = [ln for ln in output.replace(str(src), "<kernel>").splitlines() if ln.strip() not in ("", "<kernel>")]  # (the file name)
            raise CompileError(f"{GLSLANG} failed to compile the kernel:\n" + "\n".join(lines))
        return out.read_bytes()


@dataclass(frozen=True)
class KernelInfo:
    """What the loader needs of a kernel: its parameters, the size of its argument block, the local size it fixes
    (None: the launch's local size specialises constants 0, 1, 2, as `local_size_x_id = 0` etc. declare), and, for a
    kernel whose parameters are storage-buffer bindings and push constants, the binding numbers (in the order of its
    buffer parameters) and the size of its push constant block.

    Kernargs block of such a kernel: the bindings' buffer addresses (8 bytes each, in binding order), the push constant
    block (`push_size` bytes, pushed as it is), then from `sizes_offset` the bindings' buffer sizes (8 bytes each),
    which bound what each descriptor covers. The command processor reads it when it records the launch."""
    arg_slots: list[ArgSlot]
    args_size: int
    fixed_local: tuple[int, int, int] | None
    bindings: tuple[int, ...] = ()
    push_size: int = 0
    sizes_offset: int = 0

    @property
    def pushed(self) -> bool:
        """Whether the parameters are bindings and push constants (else an argument struct, or none)."""
        return bool(self.bindings) or self.push_size > 0


def _string(words: list[int]) -> str:
    raw = struct.pack(f"<{len(words)}I", *words)
    return raw.split(b"\0", 1)[0].decode(errors="replace")


class _Module:
    """The parts of a SPIR-V module the loader reads: names, decorations, types, global variables and the local size."""

    def __init__(self, spirv: bytes):
        if len(spirv) < 20 or len(spirv) % 4: raise CompileError("not a SPIR-V module (its size is not a whole number of words)")
        words = list(struct.unpack(f"<{len(spirv) // 4}I", spirv))
        if words[0] != SPIRV_MAGIC: raise CompileError("not a SPIR-V module (bad magic number)")
        self.names: dict[int, str] = {}
        self.member_names: dict[tuple[int, int], str] = {}
        self.decorations: dict[int, dict[int, list[int]]] = {}  # id -> decoration -> its literals
        self.offsets: dict[tuple[int, int], int] = {}
        self.non_writable: set[tuple[int, int]] = set()
        self.types: dict[int, tuple[int, list[int]]] = {}  # id -> (opcode, operands after the result id)
        self.variables: list[tuple[int, int, int]] = []  # (id, pointer type, storage class), in module order
        self.constants: dict[int, int] = {}
        self.composites: dict[int, list[int]] = {}
        self.local_size: tuple[int, int, int] | None = None
        i = 5
        while i < len(words):
            n, op = words[i] >> 16, words[i] & 0xFFFF
            if n == 0 or i + n > len(words): raise CompileError("a malformed SPIR-V module (an instruction runs past its end)")
            a = words[i + 1:i + n]
            if len(a) >= 2: self._read(op, a)
            i += n

    def _read(self, op: int, a: list[int]) -> None:
        if op == OP_NAME: self.names[a[0]] = _string(a[1:])
        elif op == OP_MEMBER_NAME and len(a) >= 3: self.member_names[(a[0], a[1])] = _string(a[2:])
        elif op == OP_MEMBER_DECORATE and len(a) >= 3 and a[2] == DEC_OFFSET and len(a) >= 4: self.offsets[(a[0], a[1])] = a[3]
        elif op == OP_MEMBER_DECORATE and len(a) >= 3 and a[2] == DEC_NON_WRITABLE: self.non_writable.add((a[0], a[1]))
        elif op == OP_DECORATE: self.decorations.setdefault(a[0], {})[a[1]] = list(a[2:])
        elif OP_TYPE_BOOL <= op <= OP_TYPE_POINTER: self.types[a[0]] = (op, list(a[1:]))
        elif op == OP_VARIABLE and len(a) >= 3: self.variables.append((a[1], a[0], a[2]))
        elif op in (OP_CONSTANT, OP_SPEC_CONSTANT) and len(a) >= 3: self.constants[a[1]] = a[2]
        elif op in (OP_CONSTANT_COMPOSITE, OP_SPEC_CONSTANT_COMPOSITE): self.composites[a[1]] = list(a[2:])
        elif op == OP_EXECUTION_MODE and a[1] == MODE_LOCAL_SIZE and len(a) >= 5: self.local_size = (a[2], a[3], a[4])

    def op(self, t: int) -> int:
        """The opcode of type `t` (0: not a type)."""
        return self.types.get(t, (0, []))[0]

    def pointee(self, t: int) -> tuple[int, int] | None:
        """(storage class, pointee type) of pointer type `t`, else None."""
        op, a = self.types.get(t, (0, []))
        return (a[0], a[1]) if op == OP_TYPE_POINTER and len(a) >= 2 else None

    def members(self, t: int) -> list[int]:
        """The member types of struct `t` (empty: not a struct)."""
        op, a = self.types.get(t, (0, []))
        return a if op == OP_TYPE_STRUCT else []

    def is_reference(self, t: int) -> bool:
        """Whether `t` is a buffer reference (a pointer to physical storage buffer memory)."""
        p = self.pointee(t)
        return p is not None and p[0] == SC_PHYSICAL_STORAGE_BUFFER

    def read_only(self, block: int) -> bool:
        """Whether every member of struct `block` is readonly (the kernel only reads the buffer)."""
        return bool(self.members(block)) and all((block, k) in self.non_writable for k in range(len(self.members(block))))

    def scalar_slot(self, name: str, t: int, offset: int) -> ArgSlot | None:
        """The parameter an integer or float of type `t` at `offset` is, else None."""
        op, a = self.types.get(t, (0, []))
        if op == OP_TYPE_INT and a[0] in (8, 16, 32, 64):
            fmt = {8: "b", 16: "h", 32: "i", 64: "q"}[a[0]]
            return ArgSlot(name, f"{'' if a[1] else 'u'}int{a[0]}_t", False, offset, fmt if a[1] else fmt.upper())
        if op == OP_TYPE_FLOAT and a[0] in (16, 32, 64):
            return ArgSlot(name, {16: "float16_t", 32: "float", 64: "double"}[a[0]], False, offset, {16: "e", 32: "f", 64: "d"}[a[0]])
        return None

    def describe(self, t: int) -> str:
        """What type `t` is, for messages."""
        return "a buffer reference" if self.is_reference(t) else TYPE_WORDS.get(self.op(t), "not a scalar")

    def fixed_local(self) -> tuple[int, int, int] | None:
        """The local size the kernel fixes, or None when the launch's local size specialises it."""
        wg = next((v for v, d in self.decorations.items() if d.get(DEC_BUILTIN) == [BUILTIN_WORKGROUP_SIZE]), None)
        if wg is not None and wg in self.composites:
            parts = self.composites[wg]
            if any(DEC_SPEC_ID in self.decorations.get(p, {}) for p in parts): return None  # specialised by the launch
            if len(parts) == 3: return (self.constants.get(parts[0], 1), self.constants.get(parts[1], 1), self.constants.get(parts[2], 1))
        return self.local_size


def reflect(spirv: bytes) -> KernelInfo:
    """The kernel's parameters: the members of the argument struct its push constant's buffer reference points to, or
    its storage-buffer bindings (in binding order) followed by its push constant members. Whatever a launch could not
    fill (other resources, other descriptor sets, members after an argument struct) raises CompileError saying what
    to write instead. Also the local size it fixes."""
    mod = _Module(spirv)
    push = next((t for _, t, sc in mod.variables if sc == SC_PUSH_CONSTANT), None)
    pointee = mod.pointee(push) if push is not None else None
    block_t = pointee[1] if pointee is not None else 0
    block = mod.members(block_t)
    if push is not None and not block: raise CompileError("the kernel's push constant block is not a struct")
    bindings = _bindings(mod)
    if block and mod.is_reference(block[0]):  # an argument struct (docs/kernels.md)
        first = mod.member_names.get((block_t, 0), "args")
        if len(block) > 1:
            raise CompileError(f"push constant member {mod.member_names.get((block_t, 1), 'arg1')!r} follows the argument struct reference "
                               f"{first!r}: a kernel with an argument struct takes every parameter through it, so move the member into "
                               "the struct (or write the kernel with storage-buffer bindings and push constant scalars)")
        if bindings:
            raise CompileError("the kernel has both storage-buffer bindings and an argument struct: take buffers either as bindings (with "
                               "push constant scalars) or as buffer references in the argument struct")
        slots, size = _argument_struct(mod, block[0])
        return KernelInfo(slots, size, mod.fixed_local())
    slots = [slot for _, slot in bindings]
    nb = 8 * len(slots)
    push_size = 0
    for m, t in enumerate(block):
        name = mod.member_names.get((block_t, m), f"arg{m}")
        off = mod.offsets.get((block_t, m), push_size)
        slot = mod.scalar_slot(name, t, nb + off)
        if slot is None: raise CompileError(f"push constant member {name!r} is {mod.describe(t)}: {FIX_PUSH}")
        slots.append(slot)
        push_size = max(push_size, off + struct.calcsize(slot.fmt))
    push_size = round_up(push_size, 4)
    sizes_offset = nb + round_up(push_size, 8)
    return KernelInfo(slots, sizes_offset + nb if slots else 0, mod.fixed_local(), tuple(b for b, _ in bindings), push_size, sizes_offset)


def _bindings(mod: _Module) -> list[tuple[int, ArgSlot]]:
    """The kernel's storage-buffer bindings as (binding, parameter), in binding order (the parameters' offsets are their
    places in the kernargs block); any other descriptor raises CompileError."""
    out: dict[int, ArgSlot] = {}
    for var, t, sc in mod.variables:
        if sc not in RESOURCE_CLASSES: continue
        dec = mod.decorations.get(var, {})
        binding, dset = dec.get(DEC_BINDING, [0])[0], dec.get(DEC_DESCRIPTOR_SET, [0])[0]
        p = mod.pointee(t)
        inner = p[1] if p is not None else 0
        block = inner if mod.op(inner) == OP_TYPE_STRUCT else 0
        single = mod.member_names.get((block, 0), "") if len(mod.members(block)) == 1 else ""
        name = mod.names.get(var) or single or mod.names.get(block) or f"binding{binding}"
        where = f"binding {binding} ({name!r})"
        if dset != 0:
            raise CompileError(f"descriptor set {dset} ({name!r}): hcq binds descriptor set 0 only; declare every buffer with "
                               f"layout(set = 0, binding = N) (the default set)")
        if mod.op(inner) in (OP_TYPE_ARRAY, OP_TYPE_RUNTIME_ARRAY):
            if mod.op(mod.types[inner][1][0]) == OP_TYPE_STRUCT:
                raise CompileError(f"{where} is an array of buffers: declare one buffer block per binding")
            inner = mod.types[inner][1][0]
        if mod.op(inner) in (OP_TYPE_IMAGE, OP_TYPE_SAMPLER, OP_TYPE_SAMPLED_IMAGE):
            raise CompileError(f"{where} is an image or sampler: hcq's Vulkan kernels take storage buffers (layout(std430, binding = N) "
                               "buffer) and push constant scalars only")
        block_dec = mod.decorations.get(block, {})
        if sc == SC_UNIFORM and DEC_BUFFER_BLOCK not in block_dec:
            raise CompileError(f"{where} is a uniform block: hcq binds storage buffers only; declare it layout(std430, binding = "
                               f"{binding}) readonly buffer, or pass its values as push constants")
        if not block or sc == SC_UNIFORM_CONSTANT:
            raise CompileError(f"{where} is a resource hcq does not bind: its Vulkan kernels take storage buffers and push constant scalars")
        if binding in out:
            raise CompileError(f"binding {binding} is declared twice ({out[binding].name!r} and {name!r}): give each buffer a binding of its own")
        ro = mod.read_only(block) or DEC_NON_WRITABLE in dec
        out[binding] = ArgSlot(name, f"layout(binding={binding}){' readonly' if ro else ''} buffer", True, 0, "Q", read_only=ro)
    return [(b, dataclasses.replace(out[b], offset=8 * i)) for i, b in enumerate(sorted(out))]


def _argument_struct(mod: _Module, ref: int) -> tuple[list[ArgSlot], int]:
    """The parameters of an argument-struct kernel: the members of the struct its push constant's buffer reference points to."""
    p = mod.pointee(ref)
    args_t = p[1] if p is not None else 0
    if not mod.members(args_t):
        raise CompileError("the first member of the kernel's push constant block must be a buffer reference to its argument struct "
                           "(layout(buffer_reference) ... Args; layout(push_constant) uniform Push { Args args; })")
    slots: list[ArgSlot] = []
    size = 0
    for m, t in enumerate(mod.members(args_t)):
        name = mod.member_names.get((args_t, m), f"arg{m}")
        off = mod.offsets.get((args_t, m), size)
        target = mod.pointee(t)
        if mod.is_reference(t) and target is not None:
            slot: ArgSlot | None = ArgSlot(name, "buffer_reference", True, off, "Q", read_only=mod.read_only(target[1]))
        else:
            slot = mod.scalar_slot(name, t, off)
        if slot is None: raise CompileError(f"argument {name!r} of the kernel's argument struct is neither a buffer reference nor a scalar")
        slots.append(slot)
        size = max(size, off + struct.calcsize(slot.fmt))
    return slots, size
