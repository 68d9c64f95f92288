"""The stream model: queues for devices that do not run hcq packets (a driver called per command, as with CUDA
streams or OpenCL command queues). A command keeps its operands as queue words, so the core patches symbolic ones
as for any queue, and names the device call that carries it out. A submission hands the calls, with the words as
patched for it, to a host thread per queue (a `Stream`), which makes them in order and ends with the store of the
fence signal the core's lifetimes wait for.

A backend supplies the device calls (a `StreamOps`: `exec` at least; the memory calls default to host memory) and
its memory, programs and signals; `hcq.stream_device.StreamDevice` is the device side (failure, drain, ring states,
recovery, shutdown). docs/backends.md, "Without packets", walks through one.

Asynchronous devices (an OpenCL or CUDA queue runs what was enqueued on it in order, without the host waiting): the
calls named in `StreamOps.enqueues` may return a `Pending` instead of finishing first. The stream then goes on to
the next command at once, and a signal store after such work is made by the completion's callback (in stream order),
so the thread is not held to a finish per signal; a call not named there first waits for what is still queued.

Failures: a failed device drops every command but signal stores, and stores those poisoned (the signal's timestamp
word tagged POISON_TAG | the device's `poison_id` before the value, as a failed packet executor does), so a host wait
on them raises DeviceError and a stream wait they release fails its own device, naming the failed one.

Progress, for hang reports and the watchdog: a stream counts commands, not submissions (`RingState.rptr` / `wptr`
are commands issued / commands handed over), so a long submission whose commands complete is not taken for stuck."""
from __future__ import annotations

import ctypes
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Protocol, cast

from hcq.interfaces import COMPUTE, COPY
from hcq.lifetimes import Ring
from hcq.packets import (GUARD_DONE, GUARD_PENDING, GUARD_RUNNING, POISON_MASK, POISON_TAG, SIGNAL_SIZE, SIGNAL_TIMESTAMP_OFFSET,
                         PollCondition, poll_holds)
from hcq.program import HCQArgsState, HCQProgram
from hcq.queue import HWQueue
from hcq.signal import HCQSignal
from hcq.symbolic import sint


class DeviceFault(Exception):
    """Raised by a `StreamOps` call for a fault of the device (a bad address, a kernel that crashed): the device fails
    with this message, and its queues then store only signals, so nothing waits forever on dropped work."""


class StreamStopped(Exception):
    """Raised by a `StreamOps` call that noticed `stream.stopping` (the device is shutting down): the thread ends."""


class StreamOwner(Protocol):
    """What a stream needs of its device (`StreamDevice` is one)."""
    device: str

    def fail(self, message: str) -> None: ...

    def fail_by_peer(self, peer_id: int, addr: int, value: int) -> None: ...

    @property
    def failure(self) -> str | None: ...

    @property
    def poison_id(self) -> int: ...


class Pending(Protocol):
    """What a `StreamOps` call named in `enqueues` may return: work the device queued, finishing in order with the work
    queued after it on the same stream (an OpenCL event, a CUDA event)."""

    def then(self, fn: Callable[[BaseException | None], None]) -> None:
        """Call `fn(None)` once the work finished (at once if it has), `fn(error)` if it failed; from any thread."""

    def wait(self) -> None:
        """Return once the work finished (raise if it failed)."""


@dataclass
class Command:
    """One command of a submission: the `StreamOps` method to call, its operand words as patched for this submission,
    and what is not a word (an exec's program, a copy's guard signal)."""
    op: str
    words: list[int]
    obj: Any = None


class StreamOps:
    """The device calls of a stream backend, made on a queue's stream thread, one per command and in order; each
    returns once its command is done (a later command may depend on it). Addresses are device addresses (`va_addr`s,
    `signal.value_addr`...). The memory calls default to host memory, for devices whose memory is host memory (the
    host reads and writes it, device addresses are host pointers); override them otherwise. `exec` has no default.
    Raise `DeviceFault` for a device fault; anything else a call raises fails the device too, named as a bug.

    `enqueues`: the calls that may return a `Pending` (queued on an in-order device queue, not finished yet) instead
    of finishing before they return; a call not named here runs only once everything queued before it finished."""
    enqueues: frozenset[str] = frozenset()

    def check(self, addr: int, nbytes: int) -> None:
        """Raise DeviceFault unless the device may touch [addr, addr + nbytes) (default: anything)."""

    def signal(self, stream: Stream, addr: int, value: int, poison: int = 0) -> None:
        """Store the 64-bit `value` at the signal `addr` (after everything before it on the stream). `poison`: a failed
        device's tag (POISON_TAG | its id), stored into the signal's timestamp word before the value; 0 (a healthy
        store) clears a tag left there first."""
        self.check(addr, SIGNAL_SIZE)
        ts = ctypes.c_uint64.from_address(addr + SIGNAL_TIMESTAMP_OFFSET)
        if poison or ts.value & POISON_MASK == POISON_TAG: ts.value = poison
        ctypes.c_uint64.from_address(addr).value = value

    def poisoned_by(self, stream: Stream, addr: int) -> int | None:
        """The id of the failed device that stored the signal at `addr` poisoned (the tag in its timestamp word), or
        None; read after a wait on it was released."""
        self.check(addr, SIGNAL_SIZE)
        ts = ctypes.c_uint64.from_address(addr + SIGNAL_TIMESTAMP_OFFSET).value
        return ts & 0xFFFFFFFF if ts & POISON_MASK == POISON_TAG else None

    def wait(self, stream: Stream, addr: int, value: int) -> None:
        """Return once the 64-bit signal at `addr` is >= `value` (`stream.wait_until` returns early on a failure)."""
        self.check(addr, 8)
        word = ctypes.c_uint64.from_address(addr)
        stream.wait_until(lambda: word.value >= value)

    def timestamp(self, stream: Stream, addr: int) -> None:
        """Store the device clock at `addr` (64 bits; the device's `timestamp_divider` units per microsecond: the
        default stores time.perf_counter_ns(), 1000 per microsecond)."""
        self.check(addr, 8)
        ctypes.c_uint64.from_address(addr).value = time.perf_counter_ns()

    def barrier(self, stream: Stream) -> None:
        """Make the stream's earlier stores visible to the device's other queues (host memory: they are)."""

    def exec(self, stream: Stream, prg: HCQProgram, kernargs_addr: int, global_size: tuple[int, ...], local_size: tuple[int, ...]) -> None:
        """Run kernel `prg` with the kernargs block at `kernargs_addr` over `global_size` blocks of `local_size`
        threads (counts of blocks, not threads, as hcq's EXEC), and return once it finished."""
        raise NotImplementedError(f"{type(self).__name__} must implement exec")

    def copy(self, stream: Stream, dest: int, src: int, nbytes: int) -> None:
        """Copy `nbytes` from `src` to `dest` (the guard protocol of cancellable copies is the stream's)."""
        self.check(src, nbytes)
        self.check(dest, nbytes)
        if nbytes: ctypes.memmove(dest, src, nbytes)

    def write(self, stream: Stream, addr: int, value: int, b64: bool) -> None:
        """Store `value` (64 or 32 bits) at `addr`."""
        self.check(addr, 8 if b64 else 4)
        (ctypes.c_uint64 if b64 else ctypes.c_uint32).from_address(addr).value = value

    def poll(self, stream: Stream, addr: int, value: int, mask: int, b64: bool, cond: PollCondition) -> None:
        """Return once the word at `addr` (64 or 32 bits), masked, meets `cond` against `value`."""
        self.check(addr, 8 if b64 else 4)
        word = (ctypes.c_uint64 if b64 else ctypes.c_uint32).from_address(addr)
        stream.wait_until(lambda: poll_holds(cond, word.value, value, mask, 64 if b64 else 32))


class Stream:
    """The host thread that runs one queue's submissions in order, through the device's `StreamOps`. A failed device
    keeps taking submissions but makes only their signal stores, so nothing waits forever."""

    def __init__(self, dev: StreamOwner, ops: StreamOps, name: str):
        self.dev, self.ops, self.name = dev, ops, name
        self.jobs: queue.SimpleQueue[list[Command] | None] = queue.SimpleQueue()
        self.submitted = self.done = 0  # commands handed over / issued (the ring positions hang reports show)
        self.current: str | None = None  # the command being made, for hang reports
        self.stopping = False
        self._last: Pending | None = None  # the newest queued command not known to have finished
        self._after: deque[list[Any]] = deque()  # [finished, action]: actions run in order once their work finished
        self._after_lock = threading.Lock()
        self._queued: deque[str] = deque()  # what the device still runs of the queued commands (oldest first)
        self.thread = threading.Thread(target=self._run, name=f"{dev.device} {name}", daemon=True)
        self.thread.start()

    def put(self, commands: list[Command]) -> None:
        """Hand a submission over (called under the device's submission order; one caller at a time per queue)."""
        self.submitted += len(commands)
        self.jobs.put(commands)

    @property
    def running(self) -> str | None:
        """What the stream is doing, for hang reports: the command it makes, else the oldest queued one unfinished."""
        return self.current or (self._queued[0] if self._queued else None)

    def idle(self) -> bool:
        """Whether every command handed over was made (what was queued on the device included)."""
        return self.done == self.submitted and not self._after

    def recovered(self) -> None:
        """The device recovered (so the stream was drained): forget the newest queued work, finished by now, so that its
        failure, reported already, does not fail the device again through the next signal store or settle."""
        self._last = None

    def stop(self) -> None:
        """End the thread: at once if it is idle, else at its next `wait_until` look or once its command returns."""
        self.stopping = True
        self.jobs.put(None)

    def wait_until(self, holds: Callable[[], bool]) -> None:
        """Poll `holds` (backing off to 1 ms) until it is true or the device failed; StreamStopped once stopping."""
        delay = 0.00002
        while not holds():
            if self.stopping: raise StreamStopped
            if self.dev.failure is not None: return
            time.sleep(delay)
            delay = min(delay * 2, 0.001)

    def _run(self) -> None:
        while (commands := self.jobs.get()) is not None:
            for c in commands:
                self.current = f"{c.op} {c.words}"
                try:
                    if self.dev.failure is None or c.op == "signal": self._make(c)  # a failed device only stores signals
                except StreamStopped:
                    return
                except DeviceFault as e:
                    self.dev.fail(str(e))
                except Exception as e:  # noqa: BLE001 - a bug in a device call fails the device, not the stream
                    self.dev.fail(f"{c.op} raised {type(e).__name__}: {e}")
                self.done += 1
            self.current = None

    def _make(self, c: Command) -> None:
        w, ops = c.words, self.ops
        if c.op == "signal":
            self._after_queued(lambda: self._store_signal(w[0], w[1]))
        elif c.op == "copy":
            guard: HCQSignal | None = c.obj
            if guard is not None and guard.compare_exchange(GUARD_PENDING, GUARD_RUNNING) != GUARD_PENDING: return  # cancelled
            try:
                self._issue("copy", lambda: ops.copy(self, w[0], w[1], w[2]))
            finally:
                if guard is not None: self._after_queued(lambda: guard.store(GUARD_DONE, wake=False))
        elif c.op == "exec": self._issue("exec", lambda: ops.exec(self, c.obj, w[0], tuple(w[1:4]), tuple(w[4:7])))
        elif c.op == "wait": self._wait(w[0], w[1])
        elif c.op == "timestamp": self._issue("timestamp", lambda: ops.timestamp(self, w[0]))
        elif c.op == "barrier": self._issue("barrier", lambda: ops.barrier(self))
        elif c.op == "write": self._issue("write", lambda: ops.write(self, w[0], w[1], bool(w[2])))
        elif c.op == "poll": self._issue("poll", lambda: ops.poll(self, w[0], w[1], w[2], bool(w[3]), PollCondition(w[4])))
        else: raise DeviceFault(f"unknown command {c.op!r}")

    def _store_signal(self, addr: int, value: int) -> None:
        """A signal store: poisoned if the device has failed by now (the work it stands for was dropped)."""
        self.ops.signal(self, addr, value, poison=POISON_TAG | self.dev.poison_id if self.dev.failure is not None else 0)

    def _wait(self, addr: int, value: int) -> None:
        """A wait; a value a failed device stored (poisoned) fails this device too, once the wait is released."""
        pending = self._issue("wait", lambda: self.ops.wait(self, addr, value))
        if pending is None: self._check_poison(addr, value)
        else: pending.then(lambda error: self._check_poison(addr, value) if error is None else None)

    def _check_poison(self, addr: int, value: int) -> None:
        """After a released wait: fail the device if a failed one stored the value (the work waited for did not run)."""
        if self.dev.failure is not None: return
        try:
            peer = self.ops.poisoned_by(self, addr)
        except Exception as e:  # noqa: BLE001 - (also on the device's callback thread: the device fails instead)
            self.dev.fail(f"reading the poison tag of signal 0x{addr:x} raised {type(e).__name__}: {e}")
            return
        if peer is not None: self.dev.fail_by_peer(peer, addr, value)

    def _issue(self, op: str, call: Callable[[], Any]) -> Pending | None:
        """Make a device call: one the device queues (named in `enqueues`) at once, any other once the queued work
        finished. A Pending it returns is the newest queued work (and is returned)."""
        if op not in self.ops.enqueues: self._settle()
        pending: Pending | None = call()
        if pending is not None:
            self._last = pending
            with self._after_lock: self._queued.append(self.current or op)
            pending.then(self._dequeue)
        return pending

    def _dequeue(self, error: BaseException | None) -> None:
        with self._after_lock:
            if self._queued: self._queued.popleft()

    def _settle(self) -> None:
        """Wait until everything queued so far finished and its deferred actions ran."""
        if self._last is not None:
            last, self._last = self._last, None
            try:
                last.wait()
            except Exception as e:  # noqa: BLE001 - a failed queued command fails the device
                self.dev.fail(f"queued work of {self.name} failed: {e}")
        self.wait_until(lambda: not self._after)

    def _after_queued(self, action: Callable[[], None]) -> None:
        """Run `action` (a signal store) once everything queued so far finished: at once if nothing is queued, else from
        the newest queued work's completion, after the actions deferred before it."""
        if self._last is None and not self._after:
            action()
            return
        item: list[Any] = [False, action]
        with self._after_lock: self._after.append(item)
        if self._last is None: self._finished(item, None)
        else: self._last.then(lambda error: self._finished(item, error))

    def _finished(self, item: list[Any], error: BaseException | None) -> None:
        if error is not None: self.dev.fail(f"queued work of {self.name} failed: {error}")
        with self._after_lock:  # (in order: a callback that comes early waits for the actions before it)
            item[0] = True
            while self._after and self._after[0][0]:
                action = self._after.popleft()[1]
                try:
                    action()
                except Exception as e:  # noqa: BLE001 - (on the device's callback thread: the device fails instead)
                    self.dev.fail(f"a signal store of {self.name} raised {type(e).__name__}: {e}")



class StreamQueue(HWQueue):
    """Commands as (device call, operand words); the core patches the words, a submission snapshots them. Subclass
    `StreamComputeQueue` / `StreamCopyQueue` once per backend, so the core tells your device's queues apart."""

    def __init__(self, index: int = 0, *, profile: bool | None = None) -> None:
        super().__init__(index, profile=profile)
        self._commands: list[tuple[str, int, int, Any]] = []  # (op, first word, word count, Command.obj)

    def _op(self, op: str, *operands: sint, obj: Any = None) -> None:
        self._commands.append((op, len(self._q), len(operands), obj))
        self.q(*operands)

    def _signal(self, signal: HCQSignal, value: sint) -> None: self._op("signal", signal.value_addr, value)
    def _wait(self, signal: HCQSignal, value: sint) -> None: self._op("wait", signal.value_addr, value)
    def _timestamp(self, signal: HCQSignal) -> None: self._op("timestamp", signal.timestamp_addr)
    def _memory_barrier(self) -> None: self._op("barrier")

    def _exec(self, prg: HCQProgram, args_state: HCQArgsState, global_size: tuple[sint, ...], local_size: tuple[sint, ...]) -> None:
        self._op("exec", args_state.buf.va_addr, *global_size, *local_size, obj=prg)

    def _copy(self, dest: sint, src: sint, copy_size: sint, guard: HCQSignal | None) -> None:
        self._op("copy", dest, src, copy_size, obj=guard)

    def _write(self, addr: sint, value: sint, b64: bool) -> None: self._op("write", addr, value, int(b64))

    def _poll_bit(self, addr: sint, value: sint, mask: sint, b64: bool, cond: PollCondition) -> None:
        self._op("poll", addr, value, mask, int(b64), int(cond))

    def _submit(self, dev: Any, ring: Ring, fence_value: int) -> None:
        words = [int(w) for w in cast(list, self._q)]  # (stream queues are never bound: their words stay a list)
        commands = [Command(op, words[i:i + n], obj) for op, i, n, obj in self._commands]
        ring.handle.put(commands + [Command("signal", [ring.fence.value_addr, fence_value])])


class StreamComputeQueue(StreamQueue):
    """A stream backend's compute queue."""
    kind = COMPUTE


class StreamCopyQueue(StreamQueue):
    """A stream backend's copy queue (`index` picks which)."""
    kind = COPY
