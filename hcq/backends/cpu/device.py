"""The CPU device: memory from anonymous private mappings with guard pages, a native command processor
(cp.c) with one compute ring and `HCQ_CPU_COPY_ENGINES` copy rings, kernels compiled from C and run by a
worker pool."""
from __future__ import annotations

import ctypes
import os
import threading
import time
from array import array
from collections import deque
from typing import Any, Callable, Iterator, Mapping

from hcq import interrupts, profiler, recorder, validation
from hcq.allocator import HCQAllocator
from hcq.backends.cpu.compiler import CPUCompiler, load_library
from hcq.backends.cpu.native import (FLAG_B64, FLAG_GUARD, FLAG_SIGNAL, OP_BARRIER, OP_COPY, OP_EXEC, OP_INDIRECT, OP_NAMES, OP_POLL,
                                     OP_SIGNAL, OP_TIMESTAMP, OP_WAIT, OP_WRITE, POISON_MASK, POISON_TAG, QUEUE_COMPUTE, QUEUE_COPY,
                                     SUBMIT_NO_THREAD, SUBMIT_OK, SUBMIT_STOPPED, SUBMIT_TIMEOUT, SUBMIT_TOO_BIG, engine, header)
from hcq.device import HCQCompiled
from hcq.errors import DeviceError, HCQError, HCQTimeoutError, QueueKindError
from hcq.helpers import getenv, round_up, wait_timeout_ms
from hcq.memory import RUNTIME_SPEC, BufferSpec, HCQBuffer, MMIOInterface
from hcq.program import CLikeArgsState, HCQArgsState, HCQProgram
from hcq.queue import HCQSignal, HWQueue, WaitInterrupted
from hcq.symbolic import Expr, sint

RING_WORDS = 1 << 16
SUBMIT_SLICE_NS = 20_000_000  # a submission waiting for ring space comes back to Python this often (Ctrl-C, timeout)
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype, _libc.mmap.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.restype, _libc.munmap.argtypes = ctypes.c_int, [ctypes.c_void_p, ctypes.c_size_t]
_libc.mprotect.restype, _libc.mprotect.argtypes = ctypes.c_int, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
PROT_NONE, PROT_RW = 0, 0x1 | 0x2
MAP_PRIVATE_ANON, MAP_NORESERVE = 0x02 | 0x20, 0x4000
MAP_FAILED = ctypes.c_void_p(-1).value
PAGE = os.sysconf("SC_PAGE_SIZE")

_devices_by_id: dict[int, CPUDevice] = {}  # the command processor's device ids (named in poisoned signals)
# Devices that may have work in flight: a submission adds its device (after publishing), and a release that
# finds a device's work all done drops it, so a free looks at the devices in use, not at every device open.
_busy_devices: list[CPUDevice] = []
_exiting = False  # set at interpreter exit: mappings are left to the OS (a stuck queue thread may still hold them)


def _readable(addr: int) -> bool:
    """Whether the host may read 8 bytes at `addr` (inside a live allocation or signal page of any CPU device)."""
    return any(dev.allocator.owns(addr, 8) for dev in _cpu_devices())


class _Mapping:
    """An anonymous private mapping with a guard page on each side: a kernel running off the end (or start)
    of a buffer faults (a DeviceError) instead of reaching the runtime state mapped next to it. Unmapped
    once the allocator and every host view of it (numpy arrays included) have let go."""
    __slots__ = ("base", "length")

    def __init__(self, size: int, device: str):
        self.base, self.length = 0, round_up(size, PAGE) + 2 * PAGE
        base = _libc.mmap(None, self.length, PROT_NONE, MAP_PRIVATE_ANON | MAP_NORESERVE, -1, 0)
        if base is None or base == MAP_FAILED or _libc.mprotect(base + PAGE, self.length - 2 * PAGE, PROT_RW) != 0:
            err = ctypes.get_errno()
            if base is not None and base != MAP_FAILED: _libc.munmap(base, self.length)
            raise MemoryError(f"{device}: cannot allocate {size} bytes ({os.strerror(err)})")
        self.base = base

    @property
    def addr(self) -> int:
        return self.base + PAGE

    def __del__(self) -> None:
        if self.base and not _exiting: _libc.munmap(self.base, self.length)


class CPUSignal(HCQSignal["CPUDevice"]):
    """A signal in host memory; host waits run natively (spin, then futex sleep) without the GIL."""

    @staticmethod
    def native_wait(addr: int, value: int, timeout_ns: int) -> int:
        return engine().hcq_wait_ge(addr, value, timeout_ns)

    @staticmethod
    def native_store(addr: int, value: int) -> None:
        engine().hcq_signal_store(addr, value)

    @staticmethod
    def native_cas(addr: int, expected: int, desired: int) -> int:
        return engine().hcq_cas64(addr, expected, desired)

    def failed_setter(self) -> CPUDevice | int | None:
        """The device (or its id, if no longer open) that stored the current value after it failed, if any."""
        ts = self._host()[1].mv[0]
        if ts & POISON_MASK != POISON_TAG: return None
        dev_id = ts & 0xFFFFFFFF
        return _devices_by_id.get(dev_id, dev_id)

    def _check_failed_setter(self, value: int) -> None:
        if self.timestamp_mv.mv[0] & POISON_MASK != POISON_TAG: return  # type: ignore[union-attr]
        setter = self.failed_setter()
        if setter is None: return
        if isinstance(setter, CPUDevice):
            setter._check_device_error(f"waiting for {self!r} to reach {value}")  # still failed: its own error says what
            name = setter.device
        else:
            name = f"CPU device #{setter}"
        raise DeviceError(f"{self!r} reached {value} through work of {name} that failed before it ran (the device was recovered since)")


class Ring:
    """One ring of the command processor and its submission fence: every queue submitted to the ring ends with
    a SIGNAL of `fence` to its number, so `fence.value >= n` means submission n (and all before it) ran. What
    a submission references (signals, args states) is held until then. `lock` makes taking the number,
    writing the ring and tracking one step when several threads submit."""

    def __init__(self, dev: CPUDevice, kind: int, index: int, handle: int):
        self.dev, self.kind, self.index, self.handle = dev, kind, index, handle
        self.name = "compute queue" if kind == QUEUE_COMPUTE else f"copy queue {index}"
        self.fence, self.count = dev.new_signal(value=0), 0
        self.inflight: deque[tuple[int, Any]] = deque()
        self.lock = threading.Lock()
        self.holder: int | None = None  # the thread inside a submission to this ring
        ptrs = (ctypes.c_uint64 * 2)()
        dev._lib.hcq_queue_pointers(handle, ptrs)
        self._wptr, self._rptr = ctypes.c_uint64.from_address(ptrs[0]), ctypes.c_uint64.from_address(ptrs[1])
        self.fence_packet = array("Q", (H_SIGNAL, self.fence.value_addr, 0))

    def room(self) -> int:
        """Words free in the ring right now (it only grows until this thread submits)."""
        return RING_WORDS - (self._wptr.value - self._rptr.value)

    def track(self, count: int, refs: Any) -> None:
        """Hold `refs` until submission `count` ran; drop what finished submissions held."""
        self.inflight.append((count, refs))
        self.retire()

    def retire(self) -> None:
        """Drop what finished submissions held (their args states, signals and spilled words may go)."""
        done = self.fence.value_mv[0]
        while self.inflight and self.inflight[0][0] <= done: self.inflight.popleft()


class _Words:
    """Packet words in runtime memory, run in place through one INDIRECT packet: a bound queue's, or those of a
    submission too large for the ring. Released (once submitted work is past it) when its owner lets go."""

    def __init__(self, dev: CPUDevice, words: array):
        self.dev, self.buf = dev, dev.allocator.alloc(max(8, len(words) * 8), RUNTIME_SPEC, internal=True)
        self.view = self.buf.cpu_view().view(0, len(words) * 8, "Q")
        if words: self.view.mv[:] = memoryview(words).cast("B").cast("Q")
        self.indirect = (header(OP_INDIRECT, 3), self.buf.va_addr, len(words))

    def __del__(self) -> None:
        try:
            self.dev.allocator.free_from_finalizer(self.buf, RUNTIME_SPEC)
        except Exception:  # noqa: BLE001 - a destructor must not raise (e.g. at interpreter exit)
            pass


class CPUQueue(HWQueue[CPUSignal, "CPUDevice", "CPUProgram", HCQArgsState]):
    """Commands both CPU queue kinds run. Packets are 64-bit words: a header (opcode, length, flags) then operands."""
    kind = QUEUE_COMPUTE
    queue_idx = 0

    def __init__(self) -> None:
        super().__init__()
        self._keepalive: list[Any] = []
        self._indirect: array | None = None
        self._words: _Words | None = None  # where a bound queue's words live
        self._last_fence: tuple[Ring, int] | None = None

    def signal(self, signal: CPUSignal, value: sint) -> CPUQueue:
        self._note("signal", [("signal", signal.value_addr, 8)])
        self._keepalive.append(signal)  # its slot must not return to the pool while a submission writes it
        self.q(H_SIGNAL, signal.value_addr, value)
        return self

    def wait(self, signal: CPUSignal, value: sint) -> CPUQueue:
        self._note("wait", [("signal", signal.value_addr, 8)])
        self._keepalive.append(signal)
        self.q(H_WAIT, signal.value_addr, value)
        return self

    def timestamp(self, signal: CPUSignal) -> CPUQueue:
        self._note("timestamp", [("signal timestamp", signal.timestamp_addr, 8)])
        self._keepalive.append(signal)
        self.q(H_TIMESTAMP, signal.timestamp_addr)
        return self

    def write(self, buf: HCQBuffer | sint, value: sint, b64: bool = False) -> CPUQueue:
        bits = 64 if b64 else 32
        if isinstance(value, Expr) and not (0 <= value.vmin and value.vmax < (1 << bits)):
            raise ValueError(f"write of {value.expr} (range [{value.vmin}, {value.vmax}]) may not fit in {bits} bits; "
                             f"narrow the variable's range{'' if b64 else ' or use b64=True'}")
        if isinstance(value, int) and not 0 <= value < (1 << bits):
            raise ValueError(f"write of {value} does not fit in {bits} bits")
        self._note("write", [("destination", self._addr(buf), bits // 8)])
        self.q(header(OP_WRITE, 3, FLAG_B64 if b64 else 0), self._addr(buf), value)
        return self

    def poll_bit(self, buf: HCQBuffer | sint, value: sint, mask: sint, b64: bool = False) -> CPUQueue:
        self._note("poll_bit", [("polled address", self._addr(buf), 8 if b64 else 4)])
        self.q(header(OP_POLL, 4, FLAG_B64 if b64 else 0), self._addr(buf), value, mask)
        return self

    def _bind(self, dev: CPUDevice) -> None:
        _check_device(self, dev)
        self._words = _Words(dev, array("Q", self._q))  # type: ignore[arg-type]
        self._q = self._words.view
        self._indirect = array("Q", [*self._words.indirect, 0, 0, 0])  # + the fence packet at submit

    def _prepare(self, dev: CPUDevice, var_vals: Mapping[str, int] | None, previous_run_done: bool = False) -> None:
        # Words that live in memory (a bound queue's, kernargs) are patched in place: the previous run of this
        # queue must have finished reading them first (or have been dropped by a failed device).
        if not previous_run_done and self._last_fence is not None and (self._indirect is not None or self.mv_sints):
            ring, count = self._last_fence
            if ring.fence.value_mv[0] < count:
                try:
                    ring.fence.wait(count, failed_ok=True)
                except HCQTimeoutError as e:
                    raise HCQTimeoutError(f"re-submitting a queue whose words or kernargs live in memory waits for its previous "
                                          f"run, which did not finish: {e}") from None
        super()._prepare(dev, var_vals, previous_run_done)

    def _submit(self, dev: CPUDevice) -> None:
        _check_device(self, dev)
        ring = dev._rings[self.kind][self.queue_idx]
        me = threading.get_ident()
        if ring.holder == me:  # a finalizer run by the garbage collector in the middle of a submission
            raise HCQError(f"a submission to {dev.device}'s {ring.name} was started while this thread was inside another one "
                           "(from a __del__ or weakref callback?); submit from ordinary code instead")
        entered = interrupts.enter()  # number, ring write and tracking happen together or not at all
        try:
            with ring.lock:
                ring.holder = me
                try:
                    count = ring.count + 1
                    words, spilled = self._submission(dev, ring, count)
                    dev._publish(ring, words)
                    ring.count = count
                    if not dev._busy: dev._mark_busy()
                    self._last_fence = (ring, count)
                    ring.track(count, self._keepalive if spilled is None else (self._keepalive, spilled))
                finally:
                    ring.holder = None
        finally:
            interrupts.leave(entered)

    def _wait_for_room(self, dev: CPUDevice) -> None:
        words = len(self._indirect) if self._indirect is not None else len(self._q) + 3
        dev._wait_for_room(dev._rings[self.kind][self.queue_idx], words if words <= RING_WORDS else 6)

    def _submission(self, dev: CPUDevice, ring: Ring, count: int) -> tuple[array, _Words | None]:
        """The words that go into the ring: the queue's (or one INDIRECT packet to them when the queue is bound,
        or too large for the ring), then the fence packet."""
        ring.fence_packet[2] = count
        if self._indirect is not None:  # bound: [INDIRECT addr n, SIGNAL fence count], only the count changes
            self._indirect[3:6] = ring.fence_packet
            return self._indirect, None
        words = array("Q", self._q)  # type: ignore[arg-type]
        if len(words) + 3 <= RING_WORDS:
            words.extend(ring.fence_packet)
            return words, None
        spilled = _Words(dev, words)
        return array("Q", spilled.indirect) + ring.fence_packet, spilled


class CPUComputeQueue(CPUQueue):
    """Compute queue: adds memory_barrier and exec."""
    kind = QUEUE_COMPUTE

    def memory_barrier(self) -> CPUComputeQueue:
        self.q(H_BARRIER)
        return self

    def exec(self, prg: CPUProgram, args_state: HCQArgsState, global_size: tuple[sint, ...], local_size: tuple[sint, ...]) -> CPUComputeQueue:
        if not isinstance(prg, CPUProgram): raise TypeError(f"exec needs a program compiled for the CPU device, got {prg!r}")
        if not isinstance(args_state, HCQArgsState): raise TypeError(f"exec needs an HCQArgsState (from prg.fill_kernargs), got {args_state!r}")
        gs, ls = prg.dev.check_launch_dims(global_size, local_size)
        self._note("exec", [("kernargs", args_state.buf.va_addr, prg.kernargs_alloc_size)] +
                   [(f"buffer for {s.name!r}", b.va_addr, b.size) for s, b in zip([s for s in prg.arg_slots if s.is_pointer], args_state.bufs)],
                   (prg, args_state, gs, ls))
        self.bind_args_state(args_state)
        self._keepalive.append(args_state)
        self.q(H_EXEC, prg.entry_addr, args_state.buf.va_addr, *gs, *ls)
        return self

    def copy(self, dest: sint, src: sint, copy_size: int, guard: HCQSignal | None = None) -> CPUComputeQueue:
        raise QueueKindError("copy runs on copy queues; use dev.hw_copy_queue_t()")


class CPUCopyQueue(CPUQueue):
    """Copy queue on copy engine `queue_idx`: adds copy."""
    kind = QUEUE_COPY

    def __init__(self, queue_idx: int = 0) -> None:
        super().__init__()
        self.queue_idx = queue_idx

    def copy(self, dest: sint | HCQBuffer, src: sint | HCQBuffer, copy_size: sint, guard: HCQSignal | None = None) -> CPUCopyQueue:
        if isinstance(copy_size, int) and copy_size < 0: raise ValueError(f"copy size must be >= 0, got {copy_size}")
        for b in (dest, src):
            if isinstance(b, HCQBuffer) and isinstance(copy_size, int) and copy_size > b.size:
                raise ValueError(f"copy of {copy_size} bytes overruns {b!r}")
        self._note("copy", [("copy destination", self._addr(dest), copy_size), ("copy source", self._addr(src), copy_size)])
        if guard is None:
            self.q(H_COPY, self._addr(dest), self._addr(src), copy_size)
        else:
            self._keepalive.append(guard)
            self.q(H_GUARDED_COPY, self._addr(dest), self._addr(src), copy_size, guard.value_addr)
        return self

    def memory_barrier(self) -> CPUCopyQueue:
        raise QueueKindError("memory_barrier runs on compute queues; use dev.hw_compute_queue_t()")

    def exec(self, prg: Any, args_state: Any, global_size: Any, local_size: Any) -> CPUCopyQueue:
        raise QueueKindError("exec runs on compute queues; use dev.hw_compute_queue_t()")


def _cpu_devices() -> list[CPUDevice]:
    return [d for group in HCQCompiled.peer_groups.values() for d in group if isinstance(d, CPUDevice) and hasattr(d, "_rings")]


def _check_device(q: CPUQueue, dev: Any) -> None:
    if not isinstance(dev, CPUDevice): raise HCQError(f"a CPU queue cannot be submitted to {dev!r}")
    dev._check_open()
    if q.kind == QUEUE_COPY and not 0 <= q.queue_idx < len(dev._rings[QUEUE_COPY]):
        raise HCQError(f"{dev.device} has {len(dev._rings[QUEUE_COPY])} copy engines, queue_idx {q.queue_idx} does not exist")


# Packets on signals carry FLAG_SIGNAL: a failed device still stores such SIGNALs (poisoned), and a WAIT
# released by a poisoned value fails its device too (see cp.c).
H_WAIT, H_SIGNAL, H_BARRIER, H_EXEC, H_TIMESTAMP = (header(OP_WAIT, 3, FLAG_SIGNAL), header(OP_SIGNAL, 3, FLAG_SIGNAL), header(OP_BARRIER, 1),
                                                    header(OP_EXEC, 9), header(OP_TIMESTAMP, 2))
H_COPY, H_GUARDED_COPY = header(OP_COPY, 4), header(OP_COPY, 5, FLAG_GUARD)


_entry_names: dict[int, str] = {}  # kernel entry address -> kernel name, for fault reports


class CPUProgram(HCQProgram["CPUDevice"]):
    """A kernel of a compiled C library, launched through its generated trampoline. A plain call packs
    the kernargs with a prepared struct and submits a prepared packet template in one native call."""

    def __init__(self, dev: CPUDevice, name: str, lib: bytes):
        loaded = load_library(lib)
        if name not in loaded.kernels:
            raise ValueError(f"no HCQ_KERNEL named {name!r} in the source; it defines: {', '.join(sorted(loaded.kernels))}")
        self.arg_slots, size, self.entry_addr = loaded.kernels[name]
        self._handle = loaded.handle  # keeps the library loaded while the program lives
        _entry_names[self.entry_addr] = name
        super().__init__(CLikeArgsState, dev, name, kernargs_alloc_size=max(size, 8), lib=lib, base=self.entry_addr)
        self._templates: dict[bool, list | None] = {False: None, True: None}  # launch packets, plain and timed

    def _make_template(self, timed: bool) -> list:
        """The packets of a plain launch, encoded once; a launch patches timeline values, kernargs and (when
        they change) dims, then copies them into the ring. [words, kernargs index, dims index, last dims, address]"""
        if timed:
            if self._timing_signals is None: self._timing_signals = (self.dev.new_signal(), self.dev.new_signal())
            st, en = self._timing_signals
            head = [H_WAIT, 0, 0, H_BARRIER, H_TIMESTAMP, st.timestamp_addr, H_EXEC, self.entry_addr, 0]
            tail = [H_TIMESTAMP, en.timestamp_addr, H_SIGNAL, 0, 0]
        else:
            head, tail = [H_WAIT, 0, 0, H_BARRIER, H_EXEC, self.entry_addr, 0], [H_SIGNAL, 0, 0]
        words = array("Q", head + [1] * 6 + tail)
        t = [words, len(head) - 1, len(head), ((1, 1, 1), (1, 1, 1)), words.buffer_info()[0]]
        self._templates[timed] = t
        return t

    def __call__(self, *bufs: HCQBuffer, global_size: tuple[sint, sint, sint] = (1, 1, 1), local_size: tuple[sint, sint, sint] = (1, 1, 1),
                 vals: tuple[sint, ...] = (), wait: bool = False) -> float | None:
        dev = self.dev
        if recorder.capturing or profiler.active is not None or validation.enabled or dev._closed_reason is not None:
            return super().__call__(*bufs, global_size=global_size, local_size=local_size, vals=vals, wait=wait)
        t = self._templates[wait] or self._make_template(wait)
        dims = (global_size, local_size)
        if dims != t[3]:  # new dims: checked (a bad one takes the checked path, which says what is wrong) and patched
            try:
                gs, ls = dev.check_launch_dims(global_size, local_size)
                t[0][t[2]:t[2] + 6] = array("Q", (*gs, *ls))
            except (ValueError, TypeError, OverflowError):
                return super().__call__(*bufs, global_size=global_size, local_size=local_size, vals=vals, wait=wait)
            t[3] = dims
        tv = dev.timeline_value
        kernargs = self._fast_kernargs(bufs, vals, tv)
        if kernargs is None: return super().__call__(*bufs, global_size=global_size, local_size=local_size, vals=vals, wait=wait)
        words = t[0]
        tl = dev.timeline_signal.value_addr  # the timeline signal changes when it wraps
        words[1] = words[-2] = tl
        words[2], words[t[1]], words[-1] = tv - 1, kernargs, tv
        entered = interrupts.enter()  # the submission and the timeline step go together
        try:
            if rc := dev._native_submit(dev._compute_handle, t[4], len(words), SUBMIT_SLICE_NS):
                dev._publish_slow(dev._rings[QUEUE_COMPUTE][0], t[4], len(words), rc)
            dev.timeline_value = tv + 1
            if not dev._busy: dev._mark_busy()
        finally:
            interrupts.leave(entered)
        if not wait: return None
        dev.synchronize()
        st, en = self._timing_signals  # type: ignore[misc]
        return (en.timestamp_mv[0] - st.timestamp_mv[0]) / (en.timestamp_divider * 1e6)


class CPUAllocator(HCQAllocator["CPUDevice"]):
    """Private anonymous mappings with guard pages (small buffers share slabs). The copy engine reads and
    writes host memory directly unless HCQ_CPU_DIRECT_COPY=0 (then copies go through the staging ring, as
    on devices without host access). Releases wait, without blocking anyone, until the work submitted
    before them has run."""

    def __init__(self, dev: CPUDevice):
        super().__init__(dev)
        self.direct_copy = getenv("HCQ_CPU_DIRECT_COPY", 1) != 0
        self._pending: deque[tuple[list[tuple[HCQSignal, int]], Callable[[], None]]] = deque()

    def _alloc(self, size: int, options: BufferSpec) -> HCQBuffer:
        mapping = _Mapping(size, self.dev.device)
        return HCQBuffer(mapping.addr, size, meta=options, view=MMIOInterface(mapping.addr, size, keepalive=mapping), owner=self.dev)

    def _free(self, buf: HCQBuffer, options: BufferSpec) -> None:
        buf.view = None  # the mapping goes with the last host view of it

    def _when_unused(self, buf: HCQBuffer, release: Callable[[], None]) -> None:
        # Released once everything submitted so far to any CPU device ran (its rings' fences and its timeline
        # passed their current values), so no packet can touch the memory; nothing waits for that here.
        marks = [mark for dev in list(_busy_devices) for mark in dev._outstanding()]
        if not marks and not self._pending: return release()
        self._pending.append((marks, release))
        self._reap()

    def _reap(self) -> None:
        # Later entries' marks are at or past earlier ones', so the first one not ready ends the scan.
        pending = self._pending
        while pending and all(sig.value_mv[0] >= v for sig, v in pending[0][0]): pending.popleft()[1]()

    def _poll_releases(self) -> None:
        if self._pending: self._reap()

    def _flush_releases(self) -> None:
        for dev in _cpu_devices():
            try:
                dev.synchronize()
            except DeviceError:
                pass  # a failed device still drains its rings
        self._reap()

    def _map_into(self, buf: HCQBuffer) -> HCQBuffer:
        if buf.owner is not None and not isinstance(buf.owner, CPUDevice):
            raise HCQError(f"{self.dev.device} cannot map {buf!r}: it belongs to another peer group")
        return buf  # every CPU device shares the process's address space

    def _host_copy_address(self, host_addr: int, nbytes: int) -> int | None:
        return host_addr if self.direct_copy else None


class CPUDevice(HCQCompiled[CPUSignal]):
    """`CPU:n`: its own command processor threads and worker pool; all CPU devices form one peer group."""

    def __init__(self, device: str):
        lib = engine()
        self.num_workers = getenv("HCQ_CPU_WORKERS", int(lib.hcq_num_cpus()))
        self.num_copy_engines = self.num_copy_queues = getenv("HCQ_CPU_COPY_ENGINES", 2)
        if not 1 <= self.num_workers <= 4096: raise ValueError(f"HCQ_CPU_WORKERS must be in [1, 4096], got {self.num_workers}")
        if not 1 <= self.num_copy_engines <= 64: raise ValueError(f"HCQ_CPU_COPY_ENGINES must be in [1, 64], got {self.num_copy_engines}")
        self._lib = lib
        err = ctypes.c_int(0)
        handle = lib.hcq_dev_create(self.num_workers, ctypes.byref(err))
        if not handle: raise HCQError(f"{device}: cannot create its command processor: {os.strerror(err.value)}")
        self._handle = handle
        handles: list[tuple[int, int, int]] = []
        try:
            for kind, count in ((QUEUE_COMPUTE, 1), (QUEUE_COPY, self.num_copy_engines)):
                for i in range(count): handles.append((kind, i, self._create_ring(device, kind, i)))
            self._err_buf = ctypes.create_string_buffer(512)
            self._failed_flag = ctypes.c_int.from_address(lib.hcq_dev_failed_flag(handle))
            self._native_submit = lib.hcq_queue_submit
            self._compute_handle = handles[0][2]
            self._ring_timeout_ns = min(wait_timeout_ms(), 1 << 40) * 1_000_000
            _devices_by_id[lib.hcq_dev_id(handle)] = self
            super().__init__(device, CPUAllocator(self), CPUCompiler(), CPUProgram, CPUSignal, CPUComputeQueue, CPUCopyQueue,  # type: ignore[arg-type]
                             peer_group="CPU")
            self._rings = {QUEUE_COMPUTE: [], QUEUE_COPY: []}
            for kind, i, h in handles: self._rings[kind].append(Ring(self, kind, i, h))
        except BaseException:
            self._stop_native([h for _, _, h in handles])
            raise

    def _create_ring(self, device: str, kind: int, index: int) -> int:
        out = ctypes.c_void_p()
        eager = kind == QUEUE_COMPUTE  # copy engines start their threads with their first submission
        rc = self._lib.hcq_queue_create(self._handle, kind, index, RING_WORDS, int(eager), ctypes.byref(out))
        if rc:
            what = "compute queue thread" if eager else f"copy queue {index}"
            raise HCQError(f"{device}: cannot start its {what}: {os.strerror(rc)} (out of memory, or at the limit of threads "
                           "per process or user: see ulimit -u)")
        return out.value  # type: ignore[return-value]

    def _stop_native(self, handles: list[int]) -> None:
        for h in handles: self._lib.hcq_queue_stop(h, 1_000_000_000)
        self._lib.hcq_dev_stop(self._handle)

    _busy = False  # listed in _busy_devices

    def _progress_marks(self) -> list[tuple[HCQSignal, int]]:
        """Signal values that, once all reached, mean everything submitted to this device so far ran."""
        if self._closed_reason is not None: return []
        return [(self.timeline_signal, self.timeline_value - 1)] + [(r.fence, r.count) for rings in self._rings.values() for r in rings]

    def _outstanding(self) -> list[tuple[HCQSignal, int]]:
        """The progress marks not reached yet; a device found idle leaves the busy list. (A submission that
        races with this sees `_busy` still set and stays unlisted, so the marks are looked at once more after
        clearing it: either that look sees the new submission, or the submission sees `_busy` cleared.)"""
        marks = [(sig, v) for sig, v in self._progress_marks() if sig.value_mv[0] < v]
        if not marks:
            self._busy = False
            marks = [(sig, v) for sig, v in self._progress_marks() if sig.value_mv[0] < v]
            if marks: self._busy = True
            elif self in _busy_devices: _busy_devices.remove(self)
        return marks

    def _mark_busy(self) -> None:
        self._busy = True
        _busy_devices.append(self)

    def _publish(self, ring: Ring, words: array) -> None:
        """Copy encoded packets into a ring as one submission and ring its doorbell (one native call)."""
        addr, n = words.buffer_info()
        if rc := self._native_submit(ring.handle, addr, n, SUBMIT_SLICE_NS): self._publish_slow(ring, addr, n, rc)

    def _publish_slow(self, ring: Ring, addr: int, n: int, rc: int) -> None:
        """A submission the ring had no room for yet: retry in slices while the queue makes progress (Ctrl-C
        and the timeout are looked at between slices; nothing is published until all of it fits)."""
        progress = self._ring_progress(ring, n)
        while rc == SUBMIT_TIMEOUT:
            next(progress)
            rc = self._native_submit(ring.handle, addr, n, SUBMIT_SLICE_NS)
        if rc == SUBMIT_OK: return
        if rc == SUBMIT_STOPPED: raise HCQError(f"{self.device} {ring.name} was stopped")
        if rc == SUBMIT_TOO_BIG: raise HCQError(f"{self.device} {ring.name}: a submission of {n} words exceeds the ring's {RING_WORDS}")
        if rc == SUBMIT_NO_THREAD:
            err = self._lib.hcq_queue_start_error(ring.handle)
            raise HCQError(f"{self.device} {ring.name}: cannot start its thread: {os.strerror(err)} (out of memory, or at the limit "
                           "of threads per process or user: see ulimit -u); nothing was queued")
        raise HCQError(f"{self.device} {ring.name}: submission failed with code {rc}")

    def _wait_for_room(self, ring: Ring, n: int) -> None:
        """Return once `ring` has room for `n` words (only this thread submitting to it can then fill it)."""
        if ring.room() >= n: return
        progress = self._ring_progress(ring, n)
        while ring.room() < n:
            next(progress)
            time.sleep(0.0002)

    def _ring_progress(self, ring: Ring, n: int) -> Iterator[None]:
        """Steps of a wait for ring space: each raises on a pending Ctrl-C inside a critical section, or when the
        ring made no progress for the wait timeout."""
        last_rptr, last_change = self._lib.hcq_queue_rptr(ring.handle), time.monotonic()
        while True:
            if interrupts.interrupted(): raise WaitInterrupted(f"interrupted while waiting for room in {self.device}'s {ring.name}")
            rptr, now = self._lib.hcq_queue_rptr(ring.handle), time.monotonic()
            if rptr != last_rptr: last_rptr, last_change = rptr, now
            elif (now - last_change) * 1e9 >= self._ring_timeout_ns:
                report = self._hang_report()
                raise HCQTimeoutError(f"{self.device} {ring.name}: no room for a submission of {n} words for "
                                      f"{self._ring_timeout_ns // 1_000_000} ms: the command processor is stalled (most likely on a "
                                      "wait for a signal nobody sets); nothing of it was queued" + (f"\nqueues:\n{report}" if report else ""))
            yield

    can_recover = True  # after a fault or a bad packet: dev.recover() (see its docstring)

    def _device_error(self) -> str | None:
        if not self._failed_flag.value: return None
        self._lib.hcq_dev_error(self._handle, self._err_buf, len(self._err_buf))
        msg = self._err_buf.value.decode(errors="replace")
        fault = (ctypes.c_uint64 * 6)()
        if self._lib.hcq_dev_fault(self._handle, fault):
            _, addr, entry, block, op, peer = fault
            if peer:
                peer_dev = _devices_by_id.get(peer - 1)
                name = peer_dev.device if peer_dev is not None else f"CPU device #{peer - 1}"
                if peer_dev is not None and peer_dev is not self: msg = peer_dev._device_error() or msg  # it names the kernel
                return (f"a WAIT for signal 0x{addr:x} >= {block} was released by {name} after {name} failed, so the work it waited "
                        f"for did not run ({name}: {msg}); recover both devices")
            if entry: return f"kernel {_entry_names.get(entry, hex(entry))!r} faulted in block {block}: {msg}"
            name = OP_NAMES.get(op, str(op))
            return f"{'an' if name[0] in 'AEIOU' else 'a'} {name} packet faulted: {msg}"
        return msg

    def recover(self, timeout: int | None = None) -> None:
        """Clear a sticky failure (kernel fault, bad packet, a wait released by a failed peer). Work queued when
        the device failed was dropped (its signals were still set, poisoned, so nothing waits forever), and
        memory the failed kernel wrote is whatever it left; the timeline and the ring fences restart as if all
        earlier work had finished. Waits (up to `timeout` ms) for the rings to drain first."""
        self._check_open()
        if not self._failed_flag.value:
            self.error_state = None
            return
        deadline = time.monotonic() + (wait_timeout_ms() if timeout is None else timeout) / 1000
        while any(w != r for w, r in self.queue_stats().values()):
            if time.monotonic() > deadline: raise HCQTimeoutError(f"{self.device}: rings did not drain for recovery: {self.queue_stats()}")
            time.sleep(0.001)
        self._lib.hcq_dev_recover(self._handle)
        self.error_state = None
        self.timeline_signal.value = self.timeline_value - 1  # a host store: clears the poison, wakes waiters
        for rings in self._rings.values():
            for r in rings: r.fence.value = max(r.count, r.fence.value_mv[0])

    def queue_states(self) -> list[dict[str, Any]]:
        """Each ring: read/write pointers, packets done, and the packet it is running (None when idle)."""
        out = []
        for rings in self._rings.values():
            for r in rings:
                st = (ctypes.c_uint64 * 9)()
                self._lib.hcq_queue_state(r.handle, st)
                rptr, wptr, done, pos, sub, *pkt = list(st)
                cur = None
                if pos != 2**64 - 1:
                    op = pkt[0] & 0xFF
                    cur = {"ring_word": pos, "indirect_index": None if sub == 2**64 - 1 else sub, "op": OP_NAMES.get(op, str(op)),
                           "words": pkt[:max(1, min(4, (pkt[0] >> 8) & 0xFF))]}
                out.append({"device": self.device, "queue": "compute" if r.kind == QUEUE_COMPUTE else f"copy{r.index}", "rptr": rptr, "wptr": wptr,
                            "packets_done": done, "current": cur})
        return out

    def _hang_report(self) -> str:
        lines = []
        for dev in self.peers():
            for st in getattr(dev, "queue_states", list)():
                cur = st["current"]
                if cur is None:
                    if st["wptr"] != st["rptr"]: lines.append(f"{st['device']} {st['queue']}: {st['wptr'] - st['rptr']} words queued, not started")
                    continue
                where = f"ring word {cur['ring_word']}" + (f", indirect packet {cur['indirect_index']}" if cur["indirect_index"] is not None else "")
                lines.append(f"{st['device']} {st['queue']} is stuck at {where}: {_describe_packet(cur)}")
            if dev is not self and isinstance(dev, CPUDevice) and (err := dev._device_error()) is not None:
                lines.append(f"{dev.device} has failed: {err}")
        return "\n".join(lines)

    def queue_stats(self) -> dict[str, tuple[int, int]]:
        """Per ring: (words written by the host, words consumed by the command processor)."""
        return {f"{'compute' if r.kind == QUEUE_COMPUTE else 'copy'}{r.index}": (int(self._lib.hcq_queue_wptr(r.handle)), int(self._lib.hcq_queue_rptr(r.handle)))
                for rings in self._rings.values() for r in rings}

    def threads(self) -> dict[str, int]:
        """Native threads running for this device: queues started, workers started (and wanted)."""
        info = (ctypes.c_int * 3)()
        self._lib.hcq_dev_pool_info(self._handle, info)
        queues = sum(self._lib.hcq_queue_started(r.handle) for rings in self._rings.values() for r in rings)
        return {"queues": queues, "workers": info[1], "workers_wanted": info[0]}

    def _shutdown(self) -> None:
        """Stop the command processor threads (at exit; queued work is abandoned, memory is left mapped)."""
        global _exiting
        if self.closed: return
        _exiting = True
        self._stop_native([r.handle for rings in self._rings.values() for r in rings])
        super()._shutdown()


def _describe_packet(cur: dict[str, Any]) -> str:
    if cur["op"] not in ("WAIT", "POLL") or len(cur["words"]) < 3: return cur["op"]
    addr, want = cur["words"][1], cur["words"][2]
    have = ctypes.c_uint64.from_address(addr).value if _readable(addr) else "unreadable"
    if cur["op"] == "POLL": return f"POLL of 0x{addr:x} (mask 0x{cur['words'][3]:x}) for {want}, it is {have}"
    return f"WAIT for 0x{addr:x} >= {want}, it is {have}"


def _after_fork_in_child() -> None:
    _devices_by_id.clear()
    _busy_devices.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)
