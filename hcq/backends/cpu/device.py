"""The CPU device: memory from anonymous shared mappings, a native command processor (cp.c) with one
compute ring and `HCQ_CPU_COPY_ENGINES` copy rings, kernels compiled from C and run by a worker pool."""
from __future__ import annotations

import ctypes
import os
import time
from collections import deque
from array import array
from typing import Any, Mapping

from hcq import profiler, recorder, validation
from hcq.allocator import HCQAllocator
from hcq.backends.cpu.compiler import CPUCompiler, load_library
from hcq.backends.cpu.native import (FLAG_B64, OP_BARRIER, OP_NAMES, OP_COPY, OP_EXEC, OP_INDIRECT, OP_POLL, OP_SIGNAL, OP_TIMESTAMP, OP_WAIT,
                                     OP_WRITE, QUEUE_COMPUTE, QUEUE_COPY, engine, header)
from hcq.device import HCQCompiled
from hcq.errors import HCQError, HCQTimeoutError, QueueKindError
from hcq.helpers import getenv, wait_timeout_ms
from hcq.memory import BufferSpec, HCQBuffer, MMIOInterface
from hcq.program import CLikeArgsState, HCQArgsState, HCQProgram
from hcq.queue import HCQSignal, HWQueue
from hcq.symbolic import Expr, sint

RING_WORDS = 1 << 16
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype, _libc.mmap.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.restype, _libc.munmap.argtypes = ctypes.c_int, [ctypes.c_void_p, ctypes.c_size_t]
PROT_RW, MAP_SHARED_ANON = 0x1 | 0x2, 0x01 | 0x20
MAP_FAILED = ctypes.c_void_p(-1).value


def _readable(addr: int) -> bool:
    """Whether the host may read 8 bytes at `addr` (inside a live allocation or signal page of any CPU device)."""
    return any(dev.allocator.owns(addr, 8) for group in HCQCompiled.peer_groups.values() for dev in group if isinstance(dev, CPUDevice))


class CPUSignal(HCQSignal["CPUDevice"]):
    """A signal in host memory; host waits run natively (spin, then futex sleep) without the GIL."""

    def __init__(self, base_buf: HCQBuffer, value: int = 0, owner: CPUDevice | None = None, is_timeline: bool = False,
                 timestamp_divider: int = 1000):
        super().__init__(base_buf, value, owner, is_timeline, timestamp_divider)

    @staticmethod
    def native_wait(addr: int, value: int, timeout_ns: int) -> int:
        return engine().hcq_wait_ge(addr, value, timeout_ns)

    @staticmethod
    def native_store(addr: int, value: int) -> None:
        engine().hcq_signal_store(addr, value)


def _dims(what: str, dims: tuple[sint, ...]) -> tuple[sint, sint, sint]:
    if not isinstance(dims, (tuple, list)) or not 1 <= len(dims) <= 3:
        raise ValueError(f"{what} must be a tuple of 1 to 3 dimensions, got {dims!r}")
    out = tuple(dims) + (1,) * (3 - len(dims))
    for d in out:
        if isinstance(d, Expr): continue
        if not isinstance(d, int) or isinstance(d, bool) or d <= 0: raise ValueError(f"{what} dimensions must be positive ints, got {dims!r}")
    return out  # type: ignore[return-value]


class CPUQueue(HWQueue[CPUSignal, "CPUDevice", "CPUProgram", HCQArgsState]):
    """Commands both CPU queue kinds run. Packets are 64-bit words: a header (opcode, length, flags) then operands."""
    kind = QUEUE_COMPUTE
    queue_idx = 0

    def __init__(self) -> None:
        super().__init__()
        self._keepalive: list[Any] = []
        self._indirect: array | None = None
        self._bound_buf: HCQBuffer | None = None
        self._last_fence: tuple[RingFence, int] | None = None

    def signal(self, signal: CPUSignal, value: sint) -> CPUQueue:
        self._note("signal", [("signal", signal.value_addr, 8)])
        self._keepalive.append(signal)  # its slot must not return to the pool while a submission writes it
        self.q(header(OP_SIGNAL, 3), signal.value_addr, value)
        return self

    def wait(self, signal: CPUSignal, value: sint) -> CPUQueue:
        self._note("wait", [("signal", signal.value_addr, 8)])
        self._keepalive.append(signal)
        self.q(header(OP_WAIT, 3), signal.value_addr, value)
        return self

    def timestamp(self, signal: CPUSignal) -> CPUQueue:
        self._note("timestamp", [("signal timestamp", signal.timestamp_addr, 8)])
        self._keepalive.append(signal)
        self.q(header(OP_TIMESTAMP, 2), signal.timestamp_addr)
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
        words = array("Q", self._q)  # type: ignore[arg-type]
        buf = dev.allocator.alloc(max(8, len(words) * 8), BufferSpec(cpu_access=True, nolru=True))
        view = buf.cpu_view().view(0, len(words) * 8, "Q")
        view.mv[:] = memoryview(words).cast("B").cast("Q") if words else view.mv
        self._q, self._bound_buf, self._bound_dev = view, buf, dev
        self._indirect = array("Q", [header(OP_INDIRECT, 3), buf.va_addr, len(words), 0, 0, 0])  # + the fence packet at submit

    def _prepare(self, dev: CPUDevice, var_vals: Mapping[str, int] | None, previous_run_done: bool = False) -> None:
        # Words that live in memory (a bound queue's, kernargs) are patched in place: the previous run of this
        # queue must have finished reading them first.
        if not previous_run_done and self._last_fence is not None and (self._indirect is not None or self.mv_sints):
            fence, count = self._last_fence
            if fence.sig.value_mv[0] < count:
                try:
                    fence.sig.wait(count)
                except HCQTimeoutError as e:
                    raise HCQTimeoutError(f"re-submitting a queue whose words or kernargs live in memory waits for its previous "
                                          f"run, which did not finish: {e}") from None
        super()._prepare(dev, var_vals, previous_run_done)

    def _submit(self, dev: CPUDevice) -> None:
        _check_device(self, dev)
        fence = dev._fences[(self.kind, self.queue_idx)]
        fence.count += 1
        if self._indirect is not None:  # bound: [INDIRECT addr n, SIGNAL fence count], only the count changes
            words = self._indirect
            words[3:6] = array("Q", (H_SIGNAL, fence.sig.value_addr, fence.count))
        else:
            words = array("Q", self._q)  # type: ignore[arg-type]
            words.extend((H_SIGNAL, fence.sig.value_addr, fence.count))
        dev._submit_raw(self.kind, self.queue_idx, words)
        self._last_fence = (fence, fence.count)
        fence.track(fence.count, self._keepalive)  # signals, kernargs and programs stay alive until it ran

    def __del__(self) -> None:
        buf, self._bound_buf = getattr(self, "_bound_buf", None), None
        if buf is None or buf.freed: return
        try:  # the unmap itself waits until submitted work (this queue's runs included) is past it
            self._bound_dev.allocator.free(buf, buf.size, BufferSpec(cpu_access=True, nolru=True))
        except Exception:  # noqa: BLE001 - a destructor must not raise (e.g. at interpreter exit)
            pass


class CPUComputeQueue(CPUQueue):
    """Compute queue: adds memory_barrier and exec."""
    kind = QUEUE_COMPUTE

    def memory_barrier(self) -> CPUComputeQueue:
        self.q(header(OP_BARRIER, 1))
        return self

    def exec(self, prg: CPUProgram, args_state: HCQArgsState, global_size: tuple[sint, ...], local_size: tuple[sint, ...]) -> CPUComputeQueue:
        if not isinstance(prg, CPUProgram): raise TypeError(f"exec needs a program compiled for the CPU device, got {prg!r}")
        if not isinstance(args_state, HCQArgsState): raise TypeError(f"exec needs an HCQArgsState (from prg.fill_kernargs), got {args_state!r}")
        gs, ls = _dims("global_size", global_size), _dims("local_size", local_size)
        self._note("exec", [("kernargs", args_state.buf.va_addr, prg.kernargs_alloc_size)] +
                   [(f"buffer for {s.name!r}", b.va_addr, b.size) for s, b in zip([s for s in prg.arg_slots if s.is_pointer], args_state.bufs)],
                   (prg, args_state, gs, ls))
        self.bind_args_state(args_state)
        self._keepalive.append(args_state)
        self.q(header(OP_EXEC, 9), prg.entry_addr, args_state.buf.va_addr, *gs, *ls)
        return self

    def copy(self, dest: sint, src: sint, copy_size: int) -> CPUComputeQueue:
        raise QueueKindError("copy runs on copy queues; use dev.hw_copy_queue_t()")


class CPUCopyQueue(CPUQueue):
    """Copy queue on copy engine `queue_idx`: adds copy."""
    kind = QUEUE_COPY

    def __init__(self, queue_idx: int = 0) -> None:
        super().__init__()
        self.queue_idx = queue_idx

    def copy(self, dest: sint | HCQBuffer, src: sint | HCQBuffer, copy_size: sint) -> CPUCopyQueue:
        if isinstance(copy_size, int) and copy_size < 0: raise ValueError(f"copy size must be >= 0, got {copy_size}")
        for b in (dest, src):
            if isinstance(b, HCQBuffer) and isinstance(copy_size, int) and copy_size > b.size:
                raise ValueError(f"copy of {copy_size} bytes overruns {b!r}")
        self._note("copy", [("copy destination", self._addr(dest), copy_size), ("copy source", self._addr(src), copy_size)])
        self.q(header(OP_COPY, 4), self._addr(dest), self._addr(src), copy_size)
        return self

    def memory_barrier(self) -> CPUCopyQueue:
        raise QueueKindError("memory_barrier runs on compute queues; use dev.hw_compute_queue_t()")

    def exec(self, prg: Any, args_state: Any, global_size: Any, local_size: Any) -> CPUCopyQueue:
        raise QueueKindError("exec runs on compute queues; use dev.hw_compute_queue_t()")


def _cpu_devices() -> list[CPUDevice]:
    return [d for group in HCQCompiled.peer_groups.values() for d in group if isinstance(d, CPUDevice) and hasattr(d, "_fences")]


class RingFence:
    """A ring's submission counter: every queue submitted to the ring ends with a SIGNAL of `sig` to its
    number, so `sig.value >= n` means submission n (and all before it on that ring) finished. What a
    submission references (signals, args states) is held here until then."""

    def __init__(self, dev: CPUDevice):
        self.sig, self.count = dev.new_signal(value=0), 0
        self.inflight: deque[tuple[int, Any]] = deque()

    def track(self, count: int, refs: Any) -> None:
        """Hold `refs` until submission `count` ran; drop what finished submissions held."""
        self.inflight.append((count, refs))
        done = self.sig.value_mv[0]
        while self.inflight and self.inflight[0][0] <= done: self.inflight.popleft()


def _check_device(q: CPUQueue, dev: Any) -> None:
    if not isinstance(dev, CPUDevice): raise HCQError(f"a CPU queue cannot be submitted to {dev!r}")
    if q.kind == QUEUE_COPY and not 0 <= q.queue_idx < len(dev._rings[QUEUE_COPY]):
        raise HCQError(f"{dev.device} has {len(dev._rings[QUEUE_COPY])} copy engines, queue_idx {q.queue_idx} does not exist")
    if dev._closed: raise HCQError(f"{dev.device} is closed")


H_WAIT, H_SIGNAL, H_BARRIER, H_EXEC, H_TIMESTAMP = (header(OP_WAIT, 3), header(OP_SIGNAL, 3), header(OP_BARRIER, 1),
                                                    header(OP_EXEC, 9), header(OP_TIMESTAMP, 2))


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
        if (recorder.capturing or profiler.active is not None or validation.enabled or dev._closed or len(global_size) != 3
                or len(local_size) != 3 or 0 in global_size or 0 in local_size):
            return super().__call__(*bufs, global_size=global_size, local_size=local_size, vals=vals, wait=wait)
        tv = dev.timeline_value
        kernargs = self._fast_kernargs(bufs, vals, tv)
        if kernargs is None: return super().__call__(*bufs, global_size=global_size, local_size=local_size, vals=vals, wait=wait)
        t = self._templates[wait] or self._make_template(wait)
        words, i_kargs, i_dims = t[0], t[1], t[2]
        dims = (global_size, local_size)
        if dims != t[3]:
            try:
                words[i_dims:i_dims + 6] = array("Q", (*global_size, *local_size))
            except (TypeError, OverflowError):  # symbolic or negative dims: the checked path says what is wrong
                return super().__call__(*bufs, global_size=global_size, local_size=local_size, vals=vals, wait=wait)
            t[3] = dims
        tl = dev.timeline_signal.value_addr  # the timeline signal changes when it wraps
        words[1] = words[-2] = tl
        words[2], words[i_kargs], words[-1] = tv - 1, kernargs, tv
        if rc := dev._native_submit(dev._compute_ring, t[4], len(words), dev._ring_timeout_ns):
            dev._raise_submit_error(rc, QUEUE_COMPUTE, 0)
        dev.timeline_value = tv + 1
        if not wait: return None
        dev.synchronize()
        st, en = self._timing_signals  # type: ignore[misc]
        return (en.timestamp_mv[0] - st.timestamp_mv[0]) / (en.timestamp_divider * 1e6)


class CPUAllocator(HCQAllocator["CPUDevice"]):
    """Anonymous shared mappings. The copy engine reads and writes host memory directly unless
    HCQ_CPU_DIRECT_COPY=0 (then copies go through the staging ring, as on devices without host access)."""

    def __init__(self, dev: CPUDevice):
        super().__init__(dev)
        self.direct_copy = getenv("HCQ_CPU_DIRECT_COPY", 1) != 0
        self._pending_unmaps: list[tuple[HCQBuffer, list[tuple[HCQSignal, int]]]] = []

    def _alloc(self, size: int, options: BufferSpec) -> HCQBuffer:
        if self._pending_unmaps: self._reap_unmaps()
        addr = _libc.mmap(None, size, PROT_RW, MAP_SHARED_ANON, -1, 0)
        if addr is None or addr == MAP_FAILED:
            err = ctypes.get_errno()
            raise MemoryError(f"{self.dev.device}: cannot allocate {size} bytes ({os.strerror(err)})")
        return HCQBuffer(addr, size, meta=options, view=MMIOInterface(addr, size), owner=self.dev)

    def _free(self, buf: HCQBuffer, options: BufferSpec) -> None:
        # Unmapped only once everything submitted so far to any CPU device ran (its rings' fences and its
        # timeline passed their current values), so no packet can touch it; nothing waits for that here.
        marks = [(sig, v) for dev in _cpu_devices() for sig, v in dev._progress_marks()]
        self._pending_unmaps.append((buf, marks))
        self._reap_unmaps()

    def _reap_unmaps(self) -> None:
        keep = []
        for buf, marks in self._pending_unmaps:
            if all(sig.value_mv[0] >= v for sig, v in marks): _libc.munmap(buf.va_addr, buf.size)
            else: keep.append((buf, marks))
        self._pending_unmaps = keep

    def _wait_unused(self, buf: HCQBuffer) -> None:
        pass  # _free defers the unmap until submitted work is past it

    def _free_now(self, buf: HCQBuffer, options: BufferSpec) -> None:
        if self.dev._closed: return  # the command processors may still hold it; the process is ending anyway
        super()._free_now(buf, options)

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
        if self.num_workers < 1: raise ValueError(f"HCQ_CPU_WORKERS must be >= 1, got {self.num_workers}")
        if self.num_copy_engines < 1: raise ValueError(f"HCQ_CPU_COPY_ENGINES must be >= 1, got {self.num_copy_engines}")
        self._closed = False
        self._lib = lib
        self._handle = lib.hcq_dev_create(self.num_workers)
        self._rings = {QUEUE_COMPUTE: [lib.hcq_queue_create(self._handle, QUEUE_COMPUTE, 0, RING_WORDS)],
                       QUEUE_COPY: [lib.hcq_queue_create(self._handle, QUEUE_COPY, i, RING_WORDS) for i in range(self.num_copy_engines)]}
        if not self._handle or not all(all(r) for r in self._rings.values()): raise MemoryError(f"{device}: cannot start the command processor")
        self._err_buf = ctypes.create_string_buffer(512)
        self._failed_flag = ctypes.c_int.from_address(lib.hcq_dev_failed_flag(self._handle))
        self._native_submit = lib.hcq_queue_submit
        self._compute_ring = self._rings[QUEUE_COMPUTE][0]
        self._ring_timeout_ns = wait_timeout_ms() * 1_000_000
        super().__init__(device, CPUAllocator(self), CPUCompiler(), CPUProgram, CPUSignal, CPUComputeQueue, CPUCopyQueue,  # type: ignore[arg-type]
                         peer_group="CPU")
        self._fences = {(kind, i): RingFence(self) for kind, rings in self._rings.items() for i in range(len(rings))}

    def _progress_marks(self) -> list[tuple[HCQSignal, int]]:
        """Signal values that, once all reached, mean everything submitted to this device so far ran."""
        if self._closed: return []
        return [(self.timeline_signal, self.timeline_value - 1)] + [(f.sig, f.count) for f in self._fences.values()]

    def _submit_raw(self, kind: int, queue_idx: int, words: array) -> None:
        """Copy encoded packets into a ring and ring its doorbell (one native call)."""
        if not words: return
        rc = self._native_submit(self._rings[kind][queue_idx], words.buffer_info()[0], len(words), self._ring_timeout_ns)
        if rc: self._raise_submit_error(rc, kind, queue_idx)

    def _raise_submit_error(self, rc: int, kind: int, queue_idx: int) -> None:
        name = "compute queue" if kind == QUEUE_COMPUTE else f"copy queue {queue_idx}"
        if rc == 2: raise HCQError(f"{self.device} {name} was stopped")
        raise HCQTimeoutError(f"{self.device} {name}: its ring stayed full for {self._ring_timeout_ns // 1_000_000} ms; the command "
                                  "processor is stalled (most likely on a wait for a signal nobody sets)")

    can_recover = True  # after a fault or a bad packet: dev.recover() (see its docstring)

    def _device_error(self) -> str | None:
        if not self._failed_flag.value: return None
        self._lib.hcq_dev_error(self._handle, self._err_buf, len(self._err_buf))
        msg = self._err_buf.value.decode(errors="replace")
        fault = (ctypes.c_uint64 * 5)()
        if self._lib.hcq_dev_fault(self._handle, fault):
            _, _, entry, block, op = fault
            if entry: return f"kernel {_entry_names.get(entry, hex(entry))!r} faulted in block {block}: {msg}"
            return f"a {OP_NAMES.get(op, op)} packet faulted: {msg}"
        return msg

    def recover(self, timeout: int | None = None) -> None:
        """Clear a sticky failure (kernel fault, bad packet). Work queued when the device failed was dropped,
        and memory the failed kernel wrote is whatever it left; the timeline restarts as if all earlier work
        had finished. Waits (up to `timeout` ms) for the rings to drain first."""
        if not self._failed_flag.value:
            self.error_state = None
            return
        deadline = time.monotonic() + (wait_timeout_ms() if timeout is None else timeout) / 1000
        while any(w != r for w, r in self.queue_stats().values()):
            if time.monotonic() > deadline: raise HCQTimeoutError(f"{self.device}: rings did not drain for recovery: {self.queue_stats()}")
            time.sleep(0.001)
        self._lib.hcq_dev_recover(self._handle)
        self.error_state = None
        self.timeline_signal.value = self.timeline_value - 1

    def queue_states(self) -> list[dict[str, Any]]:
        """Each ring: read/write pointers, packets done, and the packet it is running (None when idle)."""
        out = []
        for kind, rings in self._rings.items():
            for i, r in enumerate(rings):
                st = (ctypes.c_uint64 * 9)()
                self._lib.hcq_queue_state(r, st)
                rptr, wptr, done, pos, sub, *pkt = list(st)
                cur = None
                if pos != 2**64 - 1:
                    op = pkt[0] & 0xFF
                    cur = {"ring_word": pos, "indirect_index": None if sub == 2**64 - 1 else sub, "op": OP_NAMES.get(op, str(op)),
                           "words": pkt[:max(1, min(4, (pkt[0] >> 8) & 0xFF))]}
                out.append({"device": self.device, "queue": "compute" if kind == QUEUE_COMPUTE else f"copy{i}", "rptr": rptr, "wptr": wptr,
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
                desc = cur["op"]
                if cur["op"] in ("WAIT", "POLL") and len(cur["words"]) >= 3:
                    addr, want = cur["words"][1], cur["words"][2]
                    have = ctypes.c_uint64.from_address(addr).value if _readable(addr) else "unreadable"
                    desc = f"WAIT for 0x{addr:x} >= {want}, it is {have}" if cur["op"] == "WAIT" else \
                           f"POLL of 0x{addr:x} (mask 0x{cur['words'][3]:x}) for {want}, it is {have}"
                lines.append(f"{st['device']} {st['queue']} is stuck at {where}: {desc}")
        return "\n".join(lines)

    def queue_stats(self) -> dict[str, tuple[int, int]]:
        """Per ring: (words written by the host, words consumed by the command processor)."""
        return {f"{'compute' if kind == QUEUE_COMPUTE else 'copy'}{i}": (int(self._lib.hcq_queue_wptr(r)), int(self._lib.hcq_queue_rptr(r)))
                for kind, rings in self._rings.items() for i, r in enumerate(rings)}

    def _shutdown(self) -> None:
        """Stop the command processor threads (at exit; queued work is abandoned, memory is left mapped)."""
        if self._closed: return
        self._closed = True
        for rings in self._rings.values():
            for r in rings: self._lib.hcq_queue_stop(r, 1_000_000_000)
        self._lib.hcq_dev_stop(self._handle)
