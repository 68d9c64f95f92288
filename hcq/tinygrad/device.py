"""tinygrad's `HCQ` device: renderer, compiler, program, allocator and device on top of an hcq device.
Registered by `hcq.tinygrad` as module `tinygrad.runtime.ops_hcq`."""
from __future__ import annotations

import os
import platform
import re
from collections import OrderedDict
from typing import Any

from tinygrad.device import BufferSpec as TinyBufferSpec, Compiled, Compiler, LRUAllocator, Program, TinyELF
from tinygrad.dtype import AddrSpace, dtypes
from tinygrad.helpers import Target
from tinygrad.renderer.cstyle import ClangRenderer
from tinygrad.uop.ops import Ops, UOp

import hcq
from hcq import toolchain
from hcq.registry import precompile

DEVICES_VAR = "HCQ_TINYGRAD_DEVICES"
RECENT_PROGRAMS = 32  # loaded programs each HCQ device keeps for reuse (HCQDevice.load)
# Directives for hcq's CPU compiler: tinygrad's C needs no C library (as tinygrad's own CPU device builds it),
# uses clang's vector extensions, and __fp16 needs the host's instruction set; the kernel's work is in its
# noinline body, so the entry point needs no optimizing (a quarter of the compile time).
DIRECTIVES = "#pragma hcq freestanding\n#pragma hcq clang\n#pragma hcq native\n#pragma hcq plain-entry\n"


def hcq_device_name(tinygrad_name: str) -> str:
    """`HCQ` -> `CPU:0`, `HCQ:n` -> `CPU:n`, unless $HCQ_TINYGRAD_DEVICES lists hcq device names (the n-th for HCQ:n)."""
    index = int(tinygrad_name.split(":")[1]) if ":" in tinygrad_name else 0
    if (listed := os.environ.get(DEVICES_VAR, "").strip()):
        names = [n.strip() for n in listed.split(",")]
        if index >= len(names) or not names[index]:
            raise RuntimeError(f"{tinygrad_name}: {DEVICES_VAR}={listed!r} names {len(names)} device(s), none for index {index}")
        return names[index]
    return f"CPU:{index}"


# ---------------------------------------------------------------- kernels

def is_core_id(u: UOp) -> bool:
    return u.op is Ops.PARAM and u.addrspace == AddrSpace.ALU and u.expr == "core_id"


def wrap_kernel(source: str, function_name: str, bufs: list[tuple[str, tuple[UOp, bool]]]) -> str:
    """tinygrad's C for one kernel made an hcq kernel: the function becomes `static <name>_body` and an
    `HCQ_KERNEL <name>` with the same parameters, less `core_id`, calls it with core_id = the block index."""
    header = re.search(rf"\bvoid\s+{re.escape(function_name)}\s*\(([^)]*)\)\s*\{{", source)
    if header is None: raise hcq.CompileError(f"cannot find the definition of {function_name} in tinygrad's C source")
    decls = [d.strip() for d in header.group(1).split(",") if d.strip()]
    names = [re.search(r"(\w+)\s*$", d).group(1) for d in decls]  # type: ignore[union-attr]
    core = {name for name, (u, _) in bufs if is_core_id(u)}
    params = ", ".join(d for d, n in zip(decls, names) if n not in core) or "void"
    args = ", ".join("(int)hcq_group_id(0)" if n in core else n for n in names)
    # static noinline: compiled once, optimized on its own (the entry point that loops over blocks is not)
    body = source[:header.start()] + "static __attribute__((noinline)) " + header.group(0).replace(function_name, f"{function_name}_body", 1) + source[header.end():]
    return f"{DIRECTIVES}{body}\nHCQ_KERNEL void {function_name}({params}) {{ {function_name}_body({args}); }}\n"


class HCQKernelCompiler(Compiler):
    """tinygrad's compile step for HCQ: the 'binary' is the hcq kernel source (devices compile it when the
    program loads, so a device in another process compiles it there); the local backend's cache is warmed
    here, where tinygrad may run compiles in parallel worker processes. `device_class`: the backend's device
    class, when known, warms it directly (it travels to the workers by name); else the registry looks the backend
    up, which scans the installed packages' entry points on every call (about 7 ms a compile)."""

    def __init__(self, backend: str = "CPU:0", device_class: type[hcq.HCQCompiled] | None = None):
        super().__init__(None)  # hcq caches builds itself
        self.backend, self.device_class = backend, device_class

    def compile(self, src: str) -> bytes:
        if self.device_class is not None: self.device_class.precompile(src)
        else: precompile(self.backend, src)
        return src.encode()

    def __getstate__(self) -> dict[str, Any]:
        """Pickled with the C compiler this process found: a worker (tinygrad starts a new one every 16 compiles) then
        need not ask the compiler for its version again (about 30 ms)."""
        return {**self.__dict__, "found_compiler": toolchain.found_compiler()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        if (found := state.pop("found_compiler", None)) is not None: toolchain.adopt_compiler(found)
        self.__dict__.update(state)


BF16_PROBE = DIRECTIVES + "HCQ_KERNEL void hcq_bf16_probe(__bf16 *p) { __bf16 v = p[0]; p[1] = v; }\n"
_bf16_compiles: dict[str, bool] = {}


def bf16_compiles(device: str) -> bool:
    """Whether hcq device `device`'s C compiler takes `__bf16` (clang 14 on x86 does not; 15 and later do). Asked once
    per device and process, by compiling a probe kernel there."""
    if device not in _bf16_compiles:
        try:
            hcq.Device(device).compile(BF16_PROBE, "hcq_bf16_probe")
            _bf16_compiles[device] = True
        except hcq.CompileError:
            _bf16_compiles[device] = False
    return _bf16_compiles[device]


class HCQRenderer(ClangRenderer):
    """tinygrad's C renderer, each kernel wrapped as an hcq kernel (see wrap_kernel)."""
    compiler: HCQKernelCompiler  # (tinygrad's Renderer declares a Compiler: this renderer always has hcq's)

    def __init__(self, target: Target, compiler: HCQKernelCompiler | None = None):
        super().__init__(target)
        self.compiler = compiler or HCQKernelCompiler()

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled (tinygrad sends it to its compile workers) with its compiler, the device's: the workers then warm
        the device's own backend (nothing for a remote one), found without the registry."""
        return type(self), (self.target, self.compiler)

    def supported_dtypes(self) -> set:
        """tinygrad's C dtypes, bfloat16 only where the device's compiler has `__bf16` (tinygrad's tests then skip
        bfloat16 instead of failing to compile it)."""
        supported = super().supported_dtypes()
        if dtypes.bfloat16 in supported and not bf16_compiles(self.compiler.backend): supported.discard(dtypes.bfloat16)
        return supported

    def render_kernel(self, function_name: str, kernel: list[str], bufs: list[tuple[str, tuple[UOp, bool]]], uops: list[UOp],
                      prefix: list[str] | None = None) -> str:
        return wrap_kernel(super().render_kernel(function_name, kernel, bufs, uops, prefix), function_name, bufs)


class HCQTinyProgram(Program["HCQDevice"]):
    """A tinygrad kernel loaded on the hcq device; called as tinygrad calls programs."""

    def __init__(self, dev: HCQDevice, obj: TinyELF):
        self.dev, self.name = dev, obj.name
        self.prg = dev.load(obj.lib.decode(), obj.name)
        self.threaded = any(name == "core_id" for name, *_ in obj.signature)

    def launch_args(self, vals: tuple[Any, ...]) -> tuple[Any, ...]:
        """`vals` as the hcq kernel takes them: tinygrad passes None where core_id goes; the grid supplies it."""
        return tuple(v for v in vals if v is not None) if self.threaded else vals

    def __call__(self, *bufs: hcq.HCQBuffer, global_size: tuple[int, ...] = (1, 1, 1), local_size: tuple[int, ...] | None = (1, 1, 1),
                 vals: tuple[Any, ...] = (), wait: bool = False, timeout: int | None = None) -> float | None:
        """Launch as tinygrad launches: a `timeout` (ms) is a deadline on a waited run, and 0 means none, as in
        tinygrad's own HCQ devices (BEAM passes int(3 x the best time so far in ms), which is 0 for any candidate
        faster than 333 us)."""
        return self.prg(*bufs, global_size=(int(global_size[0]), 1, 1), local_size=(1, 1, 1), vals=self.launch_args(vals), wait=wait,
                        timeout=timeout or None)


# ---------------------------------------------------------------- memory

def hcq_spec(options: TinyBufferSpec) -> hcq.BufferSpec:
    return hcq.BufferSpec(host=options.host, cpu_access=options.cpu_access, uncached=options.uncached, nolru=options.nolru or options.zero)


class HCQTinyAllocator(LRUAllocator["HCQDevice"]):
    """tinygrad's allocator interface on hcq's allocator. tinygrad's LRU cache sits on top, as on tinygrad's own
    devices: its JIT frees buffers while views of them may still be used, which reuse through the LRU allows."""

    def __init__(self, dev: HCQDevice):
        super().__init__(dev, supports_copy_from_disk=True, supports_transfer=True)
        self.hdev = dev.hdev
        # tinygrad reads and fills host memory in place through `_as_buffer` where an allocator has one (it looks with
        # hasattr): only devices whose memory the host sees get it
        if self.hdev.capabilities.host_visible_memory: self._as_buffer = self._host_view

    def _host_view(self, buf: hcq.HCQBuffer) -> memoryview:
        """`buf`'s memory as a writable memoryview of bytes, without a copy (tinygrad synchronizes the device first)."""
        return buf.cpu_view().raw

    def _alloc(self, size: int, options: TinyBufferSpec) -> hcq.HCQBuffer:
        if options.external_ptr is not None:
            return hcq.HCQBuffer(options.external_ptr, size, view=hcq.MMIOInterface(options.external_ptr, size), owner=self.hdev)
        buf = self.hdev.allocator.alloc(size, hcq_spec(options))
        if options.zero: self.hdev.allocator.copyin(buf, memoryview(bytes(size)))
        return buf

    def _free(self, opaque: hcq.HCQBuffer, options: TinyBufferSpec) -> None:
        # tinygrad frees from Buffer.__del__, i.e. from the garbage collector: hand it over safely
        if options.external_ptr is None: self.hdev.allocator.free_from_finalizer(opaque, hcq_spec(options))

    def _copyin(self, dest: hcq.HCQBuffer, src: memoryview) -> None:
        self.hdev.allocator.copyin(dest, src)

    def _copyout(self, dest: memoryview, src: hcq.HCQBuffer) -> None:
        self.hdev.allocator.copyout(dest, src)

    def _transfer(self, dest: hcq.HCQBuffer, src: hcq.HCQBuffer, sz: int, src_dev: HCQDevice, dest_dev: HCQDevice) -> None:
        src_dev.hdev.allocator.transfer(dest, src, sz, src_dev.hdev, dest_dev.hdev)

    def _offset(self, buf: hcq.HCQBuffer, size: int, offset: int) -> hcq.HCQBuffer:
        return buf.offset(offset, size)

    def _map(self, buf: hcq.HCQBuffer) -> hcq.HCQBuffer:
        self.hdev.allocator.map(buf)
        return buf

    def copy_from_disk(self, dest: hcq.HCQBuffer, src: Any, size: int) -> None:
        """tinygrad's DISK buffer -> `dest` through hcq's staging ring (the file is opened again without O_DIRECT)."""
        self.hdev.allocator.copy_from_disk(dest, (src.device.device[len("disk:"):], src.offset), size)


# ---------------------------------------------------------------- device

def cpu_arch() -> str:
    machine = platform.machine().lower()
    return {"amd64": "x86_64", "aarch64": "arm64"}.get(machine, machine) + ",native"


class HCQDevice(Compiled):
    """tinygrad device `HCQ[:n]`, backed by the hcq device `hcq_device_name(name)`."""

    def __init__(self, device: str):
        from hcq.tinygrad.graph import HCQTinyGraph
        self.hdev = hcq.Device(hcq_device_name(device))
        super().__init__(device, HCQTinyAllocator(self), [HCQRenderer], HCQTinyProgram, HCQTinyGraph, arch=cpu_arch())
        self.renderer.compiler = HCQKernelCompiler(self.hdev.device, type(self.hdev))
        self.recent: OrderedDict[tuple[str, str], hcq.HCQProgram] = OrderedDict()  # (source, name) -> program, newest last

    def load(self, source: str, name: str) -> hcq.HCQProgram:
        """Kernel `name` of `source` loaded on the hcq device. The last RECENT_PROGRAMS loads are reused: tinygrad
        makes a new program for every timed run of a BEAM candidate (three each), and a load looks its build up in
        hcq's disk cache (reading and hashing the library and its sidecar), or asks a remote server to load it."""
        key = (source, name)
        if (prg := self.recent.get(key)) is not None:
            self.recent.move_to_end(key)
            return prg
        prg = self.recent[key] = self.hdev.compile(source, name)
        while len(self.recent) > RECENT_PROGRAMS: self.recent.popitem(last=False)
        return prg

    def synchronize(self) -> None:
        self.hdev.synchronize()
