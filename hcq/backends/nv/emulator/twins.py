"""CPU twins: the emulated GPU runs a kernel as the same source compiled by hcq's CPU compiler. The backend registers
each kernel's code (as loaded into GPU memory) with its cubin information and source; a launch finds the twin whose code
is at the QMD's program address, checks the launch against the cubin, reads the parameters from constant bank 0 and
calls the twin's entry point over the grid."""
from __future__ import annotations

import ctypes
import signal
import struct
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hcq.backends.cpu.compiler import CPUCompiler, LoadedLibrary, load_library
from hcq.backends.cpu.native import engine
from hcq.backends.nv.emulator.memory import AddressSpace, GpuFault
from hcq.errors import CompileError
from hcq.program import ArgSlot

if TYPE_CHECKING:
    from hcq.backends.nv.cubin import CubinKernel

PREFIX = 64  # twins are indexed by this many leading bytes of their code


class LaunchError(Exception):
    """A launch the GPU refuses (no twin, a QMD that disagrees with the kernel's cubin): `address` is what it concerns."""

    def __init__(self, text: str, address: int) -> None:
        super().__init__(text)
        self.text, self.address = text, address


@dataclass(frozen=True)
class KernelLaunch:
    """What a QMD asks for, as the GPU read it."""
    qmd_va: int
    program_va: int
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    registers: int
    shared_bytes: int
    cbank0_valid: bool
    cbank0_va: int
    cbank0_size: int


class _LaunchDims(ctypes.Structure):
    _fields_ = [("ngrp", ctypes.c_uint64 * 3), ("lsz", ctypes.c_uint64 * 3)]  # compiler.PRELUDE's hcq_launch_t


_ENTRY = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_void_p)


@dataclass(frozen=True)
class Twin:
    """A registered kernel: its code as loaded, its cubin information and its CPU twin's entry point and argument slots."""
    text: bytes
    kernel: CubinKernel
    source: str
    slots: tuple[ArgSlot, ...]
    kargs_size: int
    entry: Any = field(repr=False, compare=False)  # the ctypes function of the entry point
    library: LoadedLibrary = field(repr=False, compare=False)  # keeps the code mapped


@dataclass
class PreparedLaunch:
    """A checked launch with its arguments built: `run(b0, b1)` runs blocks [b0, b1) of `nblocks`."""
    twin: Twin
    nblocks: int
    kargs: ctypes.Array
    dims: _LaunchDims

    def run(self, b0: int, b1: int) -> None:
        """Run blocks [b0, b1) on this thread through the CPU command processor's guard: a fault in the twin (a bad
        pointer it computed) is LaunchError naming the signal, address and block, not the end of the process.
        (ctypes releases the GIL for the call: other channels go on while a kernel runs.)"""
        fault = (ctypes.c_uint64 * 3)()
        rc = engine().hcq_run_entry_guarded(ctypes.cast(self.twin.entry, ctypes.c_void_p), ctypes.addressof(self.kargs),
                                            ctypes.addressof(self.dims), b0, b1, fault)
        if rc == -2: raise MemoryError("no memory for the fault context of an emulated GPU thread")
        if rc:
            sig, addr, block = fault
            raise LaunchError(f"kernel {self.twin.kernel.name} faulted in block {block}: {signal.Signals(sig).name} at address {addr:#x} "
                              "(the emulated GPU's CPU twin touched memory it may not)", addr)


class TwinRegistry:
    """The registered twins, looked up by code. Each source is compiled once; registering checks that the CPU twin's
    parameters agree with the cubin's (count and sizes)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._libraries: dict[str, LoadedLibrary] = {}
        self._by_prefix: dict[bytes, list[Twin]] = {}  # text[:PREFIX] -> twins, most recent first
        self._short: set[int] = set()  # lengths of texts shorter than PREFIX

    def register(self, text: bytes, kernel: CubinKernel, source: str) -> Twin:
        """Register kernel code `text` (as loaded into GPU memory), its cubin information and its source."""
        if not text: raise ValueError(f"kernel {kernel.name}: no code to register")
        with self._lock:
            lib = self._libraries.get(source)
            if lib is None: lib = self._libraries[source] = load_library(CPUCompiler().compile(source))
        if kernel.name not in lib.kernels:
            raise CompileError(f"the source registered for kernel {kernel.name!r} has no such kernel (it has {', '.join(sorted(lib.kernels))})")
        slots, kargs_size, entry = lib.kernels[kernel.name]
        params = sorted(kernel.params, key=lambda p: p.ordinal)
        if len(params) != len(slots):
            raise CompileError(f"kernel {kernel.name}: the cubin has {len(params)} parameters, its CPU twin {len(slots)}")
        for slot, p in zip(slots, params):
            if struct.calcsize(slot.fmt) != p.size:
                raise CompileError(f"kernel {kernel.name}: parameter {slot.name!r} is {p.size} bytes in the cubin, "
                                   f"{struct.calcsize(slot.fmt)} in the CPU twin ({slot.ctype})")
        twin = Twin(bytes(text), kernel, source, tuple(slots), kargs_size, _ENTRY(entry), lib)
        with self._lock:
            self._by_prefix.setdefault(twin.text[:PREFIX], []).insert(0, twin)
            if len(twin.text) < PREFIX: self._short.add(len(twin.text))
        return twin

    def unregister(self, twin: Twin) -> None:
        """Forget a twin (its program was freed)."""
        with self._lock:
            same = self._by_prefix.get(twin.text[:PREFIX], [])
            self._by_prefix[twin.text[:PREFIX]] = [t for t in same if t is not twin]
            if not self._by_prefix[twin.text[:PREFIX]]: del self._by_prefix[twin.text[:PREFIX]]

    def find(self, space: AddressSpace, program_va: int) -> Twin | None:
        """The twin whose code is at `program_va` (the most recently registered, if several have the same code)."""
        m = space.find(program_va)
        if m is None: raise GpuFault(program_va, "read", "the kernel's program address is not in mapped memory")
        avail = m.end - program_va
        head = space.read(program_va, min(PREFIX, avail))
        with self._lock:
            keys = ([head] if len(head) == PREFIX else []) + [head[:n] for n in sorted(self._short, reverse=True) if n <= len(head)]
            candidates = [t for key in keys for t in self._by_prefix.get(key, ())]
        for twin in candidates:
            if len(twin.text) <= avail and (len(twin.text) <= PREFIX or space.read(program_va, len(twin.text)) == twin.text): return twin
        return None

    def prepare(self, space: AddressSpace, launch: KernelLaunch) -> PreparedLaunch:
        """Find the twin, check the launch against its cubin and build its arguments; LaunchError or GpuFault if the
        GPU would refuse it."""
        twin = self.find(space, launch.program_va)
        if twin is None:
            raise LaunchError(f"no CPU twin for the kernel code at {launch.program_va:#x} (QMD at {launch.qmd_va:#x}): "
                              f"no kernel registered with the emulator has that code", launch.program_va)
        k = twin.kernel
        end = max((p.offset + p.size for p in k.params), default=0)

        def refuse(what: str) -> LaunchError:
            return LaunchError(f"QMD at {launch.qmd_va:#x} launching {k.name} disagrees with its cubin: {what}", launch.qmd_va)

        if launch.registers < k.registers: raise refuse(f"it gives {launch.registers} registers per thread, the kernel uses {k.registers}")
        if launch.shared_bytes < k.shared_bytes:
            raise refuse(f"it gives {launch.shared_bytes} bytes of shared memory, the kernel uses {k.shared_bytes}")
        if not launch.cbank0_valid: raise refuse("constant buffer 0 (the parameters) is not marked valid")
        need = max(k.cbank0_size, k.param_base + end)
        if launch.cbank0_size < need: raise refuse(f"constant buffer 0 is {launch.cbank0_size} bytes, the kernel reads {need}")
        if 0 in launch.grid or 0 in launch.block: raise refuse(f"grid {launch.grid} and block {launch.block} must have no zero dimension")
        threads = launch.block[0] * launch.block[1] * launch.block[2]
        if k.max_threads is not None and threads > k.max_threads:
            raise refuse(f"a block of {threads} threads, the kernel was built for at most {k.max_threads}")
        space.translate(launch.cbank0_va, launch.cbank0_size)  # the whole bank must be mapped
        kargs = (ctypes.c_uint8 * max(twin.kargs_size, 1))()
        for slot, p in zip(twin.slots, sorted(k.params, key=lambda p: p.ordinal)):
            raw = space.read(launch.cbank0_va + k.param_base + p.offset, p.size)
            if slot.is_pointer:
                ptr = int.from_bytes(raw, "little")
                try:
                    raw = space.translate(ptr, 1).to_bytes(8, "little")
                except GpuFault as e:
                    raise GpuFault(ptr, "read", f"kernel {k.name}'s pointer parameter {slot.name!r} = {ptr:#x} does not point into "
                                                f"GPU memory ({e.reason})") from None
            ctypes.memmove(ctypes.addressof(kargs) + slot.offset, raw, len(raw))
        dims = _LaunchDims((ctypes.c_uint64 * 3)(*launch.grid), (ctypes.c_uint64 * 3)(*launch.block))
        return PreparedLaunch(twin, launch.grid[0] * launch.grid[1] * launch.grid[2], kargs, dims)

    def launch(self, space: AddressSpace, launch: KernelLaunch) -> Twin:
        """Check and run a whole launch; returns the twin that ran."""
        prepared = self.prepare(space, launch)
        prepared.run(0, prepared.nblocks)
        return prepared.twin
