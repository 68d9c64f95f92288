"""VEC: a complete hcq backend in one file, on the core's stream model (docs/backends.md). Its memory is host memory,
its kernels are Python functions over numpy views, run once per launch for the whole grid (vectorised), and its two
queues are host threads making the device calls in order. Run the conformance kit on it:

    python -c "import sys; sys.path.insert(0, 'docs/examples'); import vec_backend; vec_backend.register(); \
               from hcq.conformance.__main__ import main; sys.exit(main(['VEC']))"

A kernel declares its parameters with annotations: 'u32*' (a buffer, given as a numpy uint32 view from the pointer
to the end of its allocation), 'u64*', or 'u32' / 'u64' (a scalar); keyword `threads` gets the launch's thread count.
"""
from __future__ import annotations

import bisect
import ctypes
import inspect
import mmap
import struct
import threading
from math import prod
from typing import Any

import numpy as np

from hcq.backend import (COMPUTE, COPY, ArgSlot, BufferSpec, Capabilities, CLikeArgsState, CompileError, DeviceFault, HCQAllocator,
                         HCQBuffer, HCQProgram, HCQSignal, MMIOInterface, PollCondition, Stream, StreamComputeQueue, StreamCopyQueue,
                         StreamDevice, StreamOps, register_backend)

TYPES = {"u32": ("I", np.uint32), "u64": ("Q", np.uint64)}
_lock, _starts, _regions = threading.Lock(), [], {}  # live allocations: start address -> (end, mmap)


def region_end(addr: int, nbytes: int = 1) -> int:
    """The end of the live allocation holding [addr, addr + nbytes); DeviceFault outside every one."""
    with _lock:
        i = bisect.bisect_right(_starts, addr) - 1
        end = _regions[_starts[i]][0] if i >= 0 else 0
    if addr + nbytes > end: raise DeviceFault(f"an access to 0x{addr:x} (+{nbytes}) outside every VEC allocation")
    return end


class VecAllocator(HCQAllocator["VecDevice"]):
    def _alloc(self, size: int, options: BufferSpec) -> HCQBuffer:
        mm = mmap.mmap(-1, size)
        addr = ctypes.addressof(ctypes.c_char.from_buffer(mm))
        with _lock:
            bisect.insort(_starts, addr)
            _regions[addr] = (addr + size, mm)
        return HCQBuffer(addr, size, meta=options, view=MMIOInterface(addr, size, keepalive=mm), owner=self.dev)

    def _free(self, buf: HCQBuffer, options: BufferSpec) -> None:
        with _lock:
            _starts.remove(buf.va_addr)
            del _regions[buf.va_addr]  # (the mapping goes with the last host view of it)

    def _map_into(self, buf: HCQBuffer) -> HCQBuffer:
        return buf  # one address space for every VEC device


class VecCompiler:
    def compile(self, source: str) -> bytes:
        try:
            compile(source, "<vec kernel>", "exec", dont_inherit=True)
        except SyntaxError as e:
            raise CompileError(f"VEC kernel source does not parse: {e}") from None
        return source.encode()


class VecProgram(HCQProgram):
    def __init__(self, dev: VecDevice, name: str, lib: bytes):
        ns: dict[str, Any] = {"np": np, "DeviceFault": DeviceFault}
        exec(compile(lib.decode(), f"<vec kernel {name}>", "exec", dont_inherit=True), ns)  # noqa: S102 - kernels are Python by design
        self.fn = ns.get(name)
        if not inspect.isfunction(self.fn): raise CompileError(f"no kernel function {name!r} in the source")
        self.arg_slots, off = [], 0
        for p in inspect.signature(self.fn).parameters.values():
            if p.kind == p.KEYWORD_ONLY: continue  # (threads)
            t = str(p.annotation).replace(" ", "")
            if t.rstrip("*") not in TYPES: raise CompileError(f"kernel {name}: parameter {p.name} needs a type: u32, u64, u32*, u64*")
            fmt = "Q" if t.endswith("*") else TYPES[t][0]
            off = -(-off // struct.calcsize(fmt)) * struct.calcsize(fmt)
            self.arg_slots.append(ArgSlot(p.name, t, t.endswith("*"), off, fmt))
            off += struct.calcsize(fmt)
        super().__init__(CLikeArgsState, dev, name, kernargs_alloc_size=max(8, off), lib=lib)

    def run(self, kernargs: int, threads: int) -> None:
        args = []
        for s in self.arg_slots:
            (v,) = struct.unpack_from("=" + s.fmt, (ctypes.c_char * 8).from_address(kernargs + s.offset))
            if s.is_pointer:
                dtype = TYPES[s.ctype[:-1]][1]
                count = (region_end(v, np.dtype(dtype).itemsize) - v) // np.dtype(dtype).itemsize
                v = np.ctypeslib.as_array((ctypes.c_byte * (count * np.dtype(dtype).itemsize)).from_address(v)).view(dtype)
            args.append(v)
        self.fn(*args, threads=threads)


class VecOps(StreamOps):
    check = staticmethod(region_end)  # (the host-memory calls check their addresses with it)

    def exec(self, stream: Stream, prg: VecProgram, kernargs_addr: int, global_size: tuple[int, ...], local_size: tuple[int, ...]) -> None:
        prg.run(kernargs_addr, prod(global_size) * prod(local_size))


class VecComputeQueue(StreamComputeQueue): ...
class VecCopyQueue(StreamCopyQueue): ...


KERNELS = '''
def fill(out: "u32*", value: "u32", n: "u32", *, threads): out[:min(n, threads)] = value
def add(out: "u32*", a: "u32*", b: "u32*", n: "u32", *, threads): k = min(n, threads); out[:k] = a[:k] + b[:k]
def spin(flag: "u64*", out: "u32*", *, threads):
    while flag[0] == 0: pass
    out[0] = 1
def fault(out: "u32*", *, threads): raise DeviceFault("kernel 'fault' faults on purpose")
'''


class VecDevice(StreamDevice[HCQSignal]):
    """`VEC:n`; peer group "VEC"."""
    CONFORMANCE_KERNELS = {name: (KERNELS, name) for name in ("fill", "add", "spin", "fault")}
    timestamp_divider = 1000  # the default timestamps are time.perf_counter_ns()

    def __init__(self, device: str):
        caps = Capabilities(queues={COMPUTE: 1, COPY: 1}, word_bits=64, poll_conditions=frozenset(PollCondition), poll_mask=True,
                            recover=True, queue_states=True, host_visible_memory=True, host_copies=False, timestamps=True, packets=False)
        super().__init__(device, VecOps(), VecAllocator(self), VecCompiler(), VecProgram, HCQSignal, VecComputeQueue, VecCopyQueue,
                         capabilities=caps, peer_group="VEC")


def register() -> None:
    """Make hcq.Device("VEC") / "VEC:n" open VEC devices in this process (an installed package uses an entry point)."""
    register_backend("VEC", VecDevice)
