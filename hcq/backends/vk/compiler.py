"""GLSL compute shaders to SPIR-V with glslang (`glslangValidator`, cached by content like C kernels), and what the
loader reads back from the SPIR-V: the kernel's argument block and its local size.

A kernel's arguments are a struct in device memory that the kernel reads through a buffer reference whose address
is the one push constant (see docs/kernels.md, "Vulkan"):

    layout(buffer_reference, std430) buffer U32 { uint v[]; };
    layout(buffer_reference, std430) readonly buffer Args { U32 out_; uint value; uint n; };
    layout(push_constant) uniform Push { Args args; };

The members of that struct are the kernel's parameters: buffer references are pointers (filled with buffer
addresses), integers and floats are values; their offsets are the struct's layout."""
from __future__ import annotations

import functools
import shutil
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path

from hcq.errors import CompileError
from hcq.program import ArgSlot
from hcq.toolchain import cached_build, run_compiler

GLSLANG = "glslangValidator"
GLSLANG_FLAGS = ("-V", "--target-env", "vulkan1.2", "-S", "comp")
SPIRV_MAGIC = 0x07230203

# SPIR-V opcodes, decorations and storage classes the reflection reads (SPIR-V 1.x specification).
OP_NAME, OP_MEMBER_NAME, OP_EXECUTION_MODE, OP_TYPE_INT, OP_TYPE_FLOAT = 5, 6, 16, 21, 22
OP_TYPE_STRUCT, OP_TYPE_POINTER, OP_VARIABLE, OP_DECORATE, OP_MEMBER_DECORATE = 30, 32, 59, 71, 72
OP_CONSTANT, OP_CONSTANT_COMPOSITE, OP_SPEC_CONSTANT, OP_SPEC_CONSTANT_COMPOSITE = 43, 44, 50, 51
DEC_SPEC_ID, DEC_BUILTIN, DEC_NON_WRITABLE, DEC_OFFSET = 1, 11, 24, 35
BUILTIN_WORKGROUP_SIZE = 25
MODE_LOCAL_SIZE = 17
SC_PUSH_CONSTANT, SC_PHYSICAL_STORAGE_BUFFER = 9, 5349


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
    """What the loader needs of a kernel: its parameters, the size of its argument block, and the local size it fixes
    (None: the launch's local size specialises constants 0, 1, 2, as `local_size_x_id = 0` etc. declare)."""
    arg_slots: list[ArgSlot]
    args_size: int
    fixed_local: tuple[int, int, int] | None


def _string(words: list[int]) -> str:
    raw = struct.pack(f"<{len(words)}I", *words)
    return raw.split(b"\0", 1)[0].decode(errors="replace")


def reflect(spirv: bytes) -> KernelInfo:
    """Read the argument block (the struct the push constant's buffer reference points to) and the local size."""
    if len(spirv) < 20 or len(spirv) % 4: raise CompileError("not a SPIR-V module (its size is not a whole number of words)")
    words = list(struct.unpack(f"<{len(spirv) // 4}I", spirv))
    if words[0] != SPIRV_MAGIC: raise CompileError("not a SPIR-V module (bad magic number)")
    names: dict[tuple[int, int], str] = {}
    offsets: dict[tuple[int, int], int] = {}
    non_writable: set[tuple[int, int]] = set()
    ints: dict[int, tuple[int, bool]] = {}
    floats: dict[int, int] = {}
    structs: dict[int, list[int]] = {}
    pointers: dict[int, tuple[int, int]] = {}
    push_var_type: int | None = None
    spec_ids: dict[int, int] = {}
    constants: dict[int, int] = {}
    workgroup_size_id: int | None = None
    composites: dict[int, list[int]] = {}
    local_size: tuple[int, int, int] | None = None
    i = 5
    while i < len(words):
        n, op = words[i] >> 16, words[i] & 0xFFFF
        if n == 0 or i + n > len(words): raise CompileError("a malformed SPIR-V module (an instruction runs past its end)")
        a = words[i + 1:i + n]
        if op == OP_MEMBER_NAME: names[(a[0], a[1])] = _string(a[2:])
        elif op == OP_MEMBER_DECORATE and a[2] == DEC_OFFSET: offsets[(a[0], a[1])] = a[3]
        elif op == OP_MEMBER_DECORATE and a[2] == DEC_NON_WRITABLE: non_writable.add((a[0], a[1]))
        elif op == OP_DECORATE and a[1] == DEC_SPEC_ID: spec_ids[a[0]] = a[2]
        elif op == OP_DECORATE and a[1] == DEC_BUILTIN and a[2] == BUILTIN_WORKGROUP_SIZE: workgroup_size_id = a[0]
        elif op == OP_TYPE_INT: ints[a[0]] = (a[1], bool(a[2]))
        elif op == OP_TYPE_FLOAT: floats[a[0]] = a[1]
        elif op == OP_TYPE_STRUCT: structs[a[0]] = list(a[1:])
        elif op == OP_TYPE_POINTER: pointers[a[0]] = (a[1], a[2])
        elif op == OP_VARIABLE and a[2] == SC_PUSH_CONSTANT: push_var_type = a[0]
        elif op in (OP_CONSTANT, OP_SPEC_CONSTANT) and len(a) >= 3: constants[a[1]] = a[2]
        elif op in (OP_CONSTANT_COMPOSITE, OP_SPEC_CONSTANT_COMPOSITE): composites[a[1]] = list(a[2:])
        elif op == OP_EXECUTION_MODE and a[1] == MODE_LOCAL_SIZE: local_size = (a[2], a[3], a[4])
        i += n
    fixed = local_size
    if workgroup_size_id is not None and workgroup_size_id in composites:
        parts = composites[workgroup_size_id]
        if any(p in spec_ids for p in parts): fixed = None  # specialised by the launch
        elif len(parts) == 3: fixed = (constants.get(parts[0], 1), constants.get(parts[1], 1), constants.get(parts[2], 1))
    slots, size = _argument_block(push_var_type, pointers, structs, ints, floats, names, offsets, non_writable)
    return KernelInfo(slots, size, fixed)


def _argument_block(push_var_type: int | None, pointers: dict[int, tuple[int, int]], structs: dict[int, list[int]],
                    ints: dict[int, tuple[int, bool]], floats: dict[int, int], names: dict[tuple[int, int], str],
                    offsets: dict[tuple[int, int], int], non_writable: set[tuple[int, int]]) -> tuple[list[ArgSlot], int]:
    """The parameters: members of the struct behind the push constant block's first member (a buffer reference)."""
    if push_var_type is None: return [], 0  # a kernel without arguments
    block = structs.get(pointers.get(push_var_type, (0, 0))[1])
    if not block:
        raise CompileError("the kernel's push constant block must hold one buffer reference to its argument struct (see docs/kernels.md)")
    ref = pointers.get(block[0])
    args_t = ref[1] if ref is not None and ref[0] == SC_PHYSICAL_STORAGE_BUFFER else None
    if args_t not in structs:
        raise CompileError("the first member of the kernel's push constant block must be a buffer reference to its argument struct "
                           "(layout(buffer_reference) ... Args; layout(push_constant) uniform Push { Args args; })")
    slots, size = [], 0
    for m, t in enumerate(structs[args_t]):
        name = names.get((args_t, m), f"arg{m}")
        off = offsets.get((args_t, m), size)
        if t in pointers and pointers[t][0] == SC_PHYSICAL_STORAGE_BUFFER:
            target = pointers[t][1]
            ro = target in structs and all((target, k) in non_writable for k in range(len(structs[target])))
            slot = ArgSlot(name, "buffer_reference", True, off, "Q", read_only=ro)
        elif t in ints:
            bits, signed = ints[t]
            fmt = {8: "b", 16: "h", 32: "i", 64: "q"}[bits]
            slot = ArgSlot(name, f"{'' if signed else 'u'}int{bits}_t", False, off, fmt if signed else fmt.upper())
        elif t in floats:
            slot = ArgSlot(name, {16: "float16_t", 32: "float", 64: "double"}[floats[t]], False, off, {16: "e", 32: "f", 64: "d"}[floats[t]])
        else:
            raise CompileError(f"argument {name!r} of the kernel's argument struct is neither a buffer reference nor a scalar")
        slots.append(slot)
        size = max(size, off + struct.calcsize(slot.fmt))
    return slots, size
