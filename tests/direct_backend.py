"""DIRECT: a backend on the other side of the seam, for hardware that does not run hcq packets (as a CUDA device
calls its driver per command). Its queues subclass `HWQueue` directly: each command keeps its operands as queue
words (so the core's symbolic patching applies) and a Python function that carries it out; a submission hands the
functions, with the words as patched for it, to a thread per queue (a "stream"), and ends with the fence signal
the core's lifetimes ask for. No executor, no packet format: the core's lifetimes, validation, graphs, profiling
and the conformance kit work on it all the same.

Memory, signals and kernels are the toy backend's (`toy_backend.py`); only the queues and the device differ.
"""
from __future__ import annotations

import ctypes
import functools
import queue
import threading
import time
from typing import Any, Callable

import toy_backend as toy
from hcq.device import HCQCompiled
from hcq.errors import HCQError
from hcq.interfaces import COMPUTE, COPY, Capabilities
from hcq.lifetimes import Ring
from hcq.memory import HCQBuffer
from hcq.packet_queue import RingState
from hcq.packets import GUARD_DONE, GUARD_PENDING, GUARD_RUNNING, PollCondition, poll_holds
from hcq.program import HCQArgsState, HCQProgram
from hcq.queue import HWQueue
from hcq.signal import HCQSignal
from hcq.symbolic import sint

Op = Callable[["Stream", list[int]], None]  # carries out one command, given its operands


class Stream:
    """The thread that runs one queue's submissions in order. A failed device keeps taking submissions but only
    stores their signals, so nothing waits forever; `idle()` says whether it has caught up."""

    def __init__(self, dev: DirectDevice, name: str):
        self.dev, self.name = dev, name
        self.jobs: queue.Queue[list[tuple[Op, list[int]]] | None] = queue.Queue()
        self.submitted = self.done = 0
        self.current: str | None = None
        self.stop = False
        self.thread = threading.Thread(target=self._run, name=f"{dev.device} {name}", daemon=True)
        self.thread.start()

    def put(self, ops: list[tuple[Op, list[int]]]) -> None:
        self.submitted += 1
        self.jobs.put(ops)

    def idle(self) -> bool:
        return self.done == self.submitted

    def _run(self) -> None:
        while (ops := self.jobs.get()) is not None:
            for fn, words in ops:
                self.current = f"{fn.__name__.lstrip('_')} {words}"
                if self.dev.failure is not None and fn is not _signal: continue  # a failed device only stores signals
                try:
                    fn(self, words)
                except toy._Stopped:
                    return
                except (toy.KernelError, toy.ToyFault) as e:
                    self.dev.fail(str(e))
                except Exception as e:  # noqa: BLE001 - a bug here must fail the device, not kill the stream
                    self.dev.fail(f"{fn.__name__} raised {type(e).__name__}: {e}")
            self.current = None
            self.done += 1

    def wait_until(self, holds: Callable[[], bool]) -> None:
        delay = 0.00002
        while not holds():
            if self.stop: raise toy._Stopped
            if self.dev.failure is not None: return
            time.sleep(delay)
            delay = min(delay * 2, 0.001)


def _u64(addr: int) -> Any:
    toy.check_range(addr, 8)
    return ctypes.c_uint64.from_address(addr)


def _signal(s: Stream, w: list[int]) -> None:
    _u64(w[0]).value = w[1]


def _wait(s: Stream, w: list[int]) -> None:
    word = _u64(w[0])
    s.wait_until(lambda: word.value >= w[1])


def _timestamp(s: Stream, w: list[int]) -> None:
    _u64(w[0]).value = time.perf_counter_ns()


def _barrier(s: Stream, w: list[int]) -> None:
    """One address space: stores are visible to every thread once made."""


def _exec(s: Stream, w: list[int]) -> None:
    toy.run_kernel(w[0], w[1], tuple(w[2:8]), lambda: s.stop)


def _copy(s: Stream, w: list[int]) -> None:
    dest, src, nbytes, guard_addr = w
    guard = _u64(guard_addr) if guard_addr else None
    if guard is not None:
        with toy._ATOMIC_LOCK:
            if guard.value != GUARD_PENDING: return  # cancelled by the host
            guard.value = GUARD_RUNNING
    try:
        toy.check_range(src, nbytes)
        toy.check_range(dest, nbytes)
        if nbytes: ctypes.memmove(dest, src, nbytes)
    finally:
        if guard is not None: guard.value = GUARD_DONE


def _write(b64: bool, s: Stream, w: list[int]) -> None:
    if b64: _u64(w[0]).value = w[1]
    else:
        toy.check_range(w[0], 4)
        ctypes.c_uint32.from_address(w[0]).value = w[1] & 0xFFFFFFFF


def _poll(b64: bool, cond: PollCondition, s: Stream, w: list[int]) -> None:
    toy.check_range(w[0], 8 if b64 else 4)
    word = (ctypes.c_uint64 if b64 else ctypes.c_uint32).from_address(w[0])
    s.wait_until(lambda: poll_holds(cond, word.value, w[1], w[2], 64 if b64 else 32))


class DirectQueue(HWQueue):
    """Commands as (function, operand words); the core patches the words, a submission snapshots them."""

    def __init__(self, index: int = 0, *, profile: bool | None = None) -> None:
        super().__init__(index, profile=profile)
        self._ops: list[tuple[Op, int, int]] = []  # (function, first word, word count)

    def _op(self, fn: Op, *operands: sint) -> None:
        self._ops.append((fn, len(self._q), len(operands)))
        self.q(*operands)

    def _signal(self, signal: HCQSignal, value: sint) -> None: self._op(_signal, signal.value_addr, value)
    def _wait(self, signal: HCQSignal, value: sint) -> None: self._op(_wait, signal.value_addr, value)
    def _timestamp(self, signal: HCQSignal) -> None: self._op(_timestamp, signal.timestamp_addr)
    def _memory_barrier(self) -> None: self._op(_barrier)

    def _exec(self, prg: HCQProgram, args_state: HCQArgsState, global_size: tuple[sint, ...], local_size: tuple[sint, ...]) -> None:
        self._op(_exec, prg.entry, args_state.buf.va_addr, *global_size, *local_size)

    def _copy(self, dest: sint, src: sint, copy_size: sint, guard: HCQSignal | None) -> None:
        self._op(_copy, dest, src, copy_size, guard.value_addr if guard is not None else 0)

    def _write(self, addr: sint, value: sint, b64: bool) -> None:
        self._op(functools.wraps(_write)(functools.partial(_write, b64)), addr, value)

    def _poll_bit(self, addr: sint, value: sint, mask: sint, b64: bool, cond: PollCondition) -> None:
        self._op(functools.wraps(_poll)(functools.partial(_poll, b64, cond)), addr, value, mask)

    def _submit(self, dev: Any, ring: Ring, fence_value: int) -> None:
        words = list(self._q)
        ops = [(fn, words[i:i + n]) for fn, i, n in self._ops]
        ring.handle.put(ops + [(_signal, [ring.fence.value_addr, fence_value])])


class DirectComputeQueue(DirectQueue):
    kind = COMPUTE


class DirectCopyQueue(DirectQueue):
    kind = COPY


class DirectAllocator(toy.ToyAllocator):
    def _map_into(self, buf: HCQBuffer) -> HCQBuffer:
        if buf.owner is not None and not isinstance(buf.owner, DirectDevice):
            raise HCQError(f"{self.dev.device} cannot map {buf!r}: it belongs to another peer group")
        return buf


class DirectDevice(HCQCompiled[toy.ToySignal]):
    """`DIRECT:n`: queues that call Python functions in order on a stream thread per queue; peer group "DIRECT"."""
    max_block_threads = 1024
    CONFORMANCE_KERNELS = toy.CONFORMANCE_KERNELS

    def __init__(self, device: str):
        self.failure: str | None = None
        caps = Capabilities(queues={COMPUTE: 1, COPY: 2}, word_bits=64, poll_conditions=frozenset({PollCondition.EQ, PollCondition.GEQ}),
                            poll_mask=False, recover=True, queue_states=True, host_visible_memory=True, host_copies=False,
                            timestamps=True, packets=False)
        super().__init__(device, DirectAllocator(self), toy.ToyCompiler(), toy.ToyProgram, toy.ToySignal, DirectComputeQueue,
                         DirectCopyQueue, capabilities=caps, kernargs_size=1 << 20, peer_group="DIRECT")

    def _open_ring(self, kind: str, index: int) -> Stream:
        return Stream(self, f"{kind} queue {index}")

    def fail(self, msg: str) -> None:
        if self.failure is None: self.failure = msg

    def _device_error(self) -> str | None:
        return self.failure

    def _drained(self) -> bool:
        return all(r.handle.idle() for rings in self.rings.values() for r in rings)

    def _recover_hardware(self) -> None:
        self.failure = None

    def _ring_state(self, ring: Ring) -> RingState:
        s: Stream = ring.handle
        return RingState(s.done, s.submitted, s.done, text=s.current)  # positions count submissions, not words

    def _shutdown(self) -> None:
        for rings in self.rings.values():
            for r in rings:
                r.handle.stop = True
                r.handle.jobs.put(None)
        super()._shutdown()


def register() -> None:
    """Make hcq.Device("DIRECT") / "DIRECT:n" open DIRECT devices in this process."""
    from hcq.registry import register_backend
    register_backend("DIRECT", DirectDevice)
