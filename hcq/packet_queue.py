"""Backends that run hcq packets (hcq.packets): the core encodes every command, and the backend supplies an
`Executor` that takes words into its rings (and reports their state and its failures). `PacketQueue` is the
queue of such devices, `publish` puts a submission into a ring whole (waiting for room with the progress-aware
timeout and Ctrl-C in mind), `BoundWords` holds a bound queue's words in device memory, run through one INDIRECT
packet, and `FastLauncher` is the launch hot path every packet backend gets: a program's launch packets encoded
once and patched per call, published with one executor call."""
from __future__ import annotations

import enum
import time
from abc import ABC, abstractmethod
from array import array
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

from hcq import hotpath, interrupts, packets
from hcq.errors import HCQError, HCQTimeoutError, WaitInterrupted
from hcq.helpers import wait_timeout_ms
from hcq.device_state import OPEN, TIMELINE_ADDRESS, TIMELINE_VALUE
from hcq.interfaces import COMPUTE, COPY
from hcq.lifetimes import Ring
from hcq.memory import RUNTIME_SPEC, HCQBuffer
from hcq.packets import (FLAG_B64, FLAG_GUARD, FLAG_SIGNAL, PACKET_WORDS, WORD_BYTES, Op, PollCondition, describe,
                         header)
from hcq.program import FALLBACK, HCQArgsState, HCQProgram, KernargsLayout
from hcq.queue import HWQueue
from hcq.signal import HCQSignal
from hcq.symbolic import Variable, sint

SUBMIT_SLICE_NS = 20_000_000  # a submission waiting for ring space comes back to Python this often (Ctrl-C, timeout)
hotpath.set_submit_slice(SUBMIT_SLICE_NS)  # (the extension's native submits too)

# Packets on signals carry FLAG_SIGNAL (poison propagation, see hcq.packets).
H_WAIT, H_SIGNAL = header(Op.WAIT, flags=FLAG_SIGNAL), header(Op.SIGNAL, flags=FLAG_SIGNAL)
H_TIMESTAMP, H_BARRIER, H_EXEC = header(Op.TIMESTAMP), header(Op.BARRIER), header(Op.EXEC)
H_COPY, H_GUARDED_COPY = header(Op.COPY), header(Op.COPY, flags=FLAG_GUARD)
H_WRITE32, H_WRITE64 = header(Op.WRITE), header(Op.WRITE, flags=FLAG_B64)


class SubmitStatus(enum.IntEnum):
    """What `Executor.try_submit` returns."""
    OK = 0          # the words are in the ring, and the executor was told
    FULL = 1        # no room for all of them within the time given; nothing was queued
    STOPPED = 2     # the ring was stopped (the device is shutting down)
    TOO_BIG = 3     # the submission can never fit the ring
    NO_THREAD = 4   # the executor could not start what runs the ring; nothing was queued


def c_header() -> str:
    """What native code that runs or forwards hcq packets shares with Python: the packet format (`packets.c_header()`)
    and the submit statuses (SUBMIT_OK, ...)."""
    return "\n".join([packets.c_header(), "enum { " + ", ".join(f"SUBMIT_{s.name} = {int(s)}" for s in SubmitStatus) + " };"])


@dataclass
class RingState:
    """What a ring is doing, for hang reports and `dev.queue_states()`: read and write positions (words), packets
    done, and the packet being run (its words, its ring word, its index inside an INDIRECT run) or None when idle.
    Backends that run no hcq packets describe the running command in `text` instead of `current`."""
    rptr: int
    wptr: int
    packets_done: int
    current: list[int] | None = None
    position: int | None = None
    indirect_index: int | None = None
    text: str | None = None


class Executor(ABC):
    """What a packet-running backend supplies: rings that take words, and their state. Everything else (encoding,
    fences, keep-alive, patching, binding, the launch hot path, recovery bookkeeping) is the core's.

    Addresses are device addresses; words to submit are always in host memory (`addr` is a host pointer to
    `nwords` 64-bit words that stay valid only for the call)."""
    ring_words: int = 1 << 16  # capacity of a ring: a submission of more words runs from memory through INDIRECT
    device_id: int = 0  # what a failed executor tags poisoned signals with (POISON_TAG | device_id); unique in the peer group

    @abstractmethod
    def open_ring(self, kind: str, index: int) -> Any:
        """Create the ring of queue `kind` number `index`; returns the handle passed back to the other calls."""

    @abstractmethod
    def try_submit(self, handle: Any, addr: int, nwords: int, timeout_ns: int) -> int:
        """Copy the words into the ring as one submission and start the ring on them, waiting at most
        `timeout_ns` for room; a SubmitStatus (all of it queued, or none)."""

    def native_submit_address(self) -> int | None:
        """Optional: the address of a C function `int submit(void *ring, const uint64_t *words, uint64_t n,
        int64_t timeout_ns)` that does what `try_submit` does. The core then calls it through its CPython
        extension (hcq.hotpath) on the hot paths, without a Python frame or ctypes."""
        return None

    def submit_function(self) -> Callable[[Any, int, int, int], int]:
        """What launches and queue submissions call instead of `try_submit` (same arguments and result): the
        native submit through the extension when there is one, else `try_submit`. Made once, then cached."""
        fn = self.__dict__.get("_submit_function")
        if fn is None:
            address = self.native_submit_address()
            fn = (hotpath.native_submitter(address) if address else None) or self.try_submit
            self.__dict__["_submit_function"] = fn
        return fn

    @abstractmethod
    def consumed(self, handle: Any) -> int:
        """Words of the ring the executor has consumed so far (grows while the ring makes progress)."""

    @abstractmethod
    def room(self, handle: Any) -> int:
        """Words free in the ring now."""

    @abstractmethod
    def ring_state(self, handle: Any) -> RingState:
        """The ring's state (see RingState)."""

    def failed_flag_address(self) -> int | None:
        """Optional: the host address of an aligned C int that turns nonzero when the executor fails (before `error`
        says so), read by the host-copy fast path (hcq.hotpath) instead of calling `error`."""
        return None

    @abstractmethod
    def error(self) -> str | None:
        """Why the device failed (a kernel fault, a bad packet), or None. A failed executor keeps draining its
        rings, storing the SIGNALs of signals poisoned (see hcq.packets), until `recover`."""

    def recover(self) -> None:
        """Clear the failure once the rings are drained (only for executors whose device declares `recover`)."""
        raise HCQError(f"{type(self).__name__} cannot recover from a failure")

    def submit_error(self, handle: Any, status: int) -> str:
        """Text for a submission refused with `status`."""
        return {SubmitStatus.STOPPED: "the ring was stopped", SubmitStatus.TOO_BIG: "the submission does not fit the ring",
                SubmitStatus.NO_THREAD: "the executor could not start"}.get(SubmitStatus(status), f"submission failed with status {status}")

    def close(self, handles: Sequence[Any], release: bool = False) -> bool:
        """Stop the rings (at exit, when opening the device failed part way, or at `dev.close()`); `release`: also give
        back what the rings and the executor hold natively (`dev.close()`). True when every thread they ran stopped
        (memory the work used may then be released); False when one still runs (a kernel that does not return)."""
        return True

    def abort(self, reason: str) -> None:
        """Fail the device now, saying `reason` (it is being closed with work that did not finish): waits are released and
        queued work is dropped with its signals poisoned, as after a fault. An executor without it leaves the work to
        `close`, which abandons it."""

    def bind_words(self, dev: Any, words: array) -> BoundWords:
        """Put packet words where the device runs them from memory (a bound queue, or a submission too large for
        the ring): by default runtime memory of `dev` the host writes directly. An executor whose runtime memory
        the host cannot view returns its own BoundWords (with a `view` that patches land in)."""
        return BoundWords(dev, words)


# ---- publishing
def publish(dev: Any, ring: Ring, words: array) -> None:
    """Put `words` into `ring` as one submission (whole or not at all)."""
    addr, n = words.buffer_info()
    if rc := dev.executor.submit_function()(ring.handle, addr, n, SUBMIT_SLICE_NS): publish_slow(dev, ring, addr, n, rc)


def publish_slow(dev: Any, ring: Ring, addr: int, n: int, rc: int) -> None:
    """A submission the ring had no room for yet: retry in slices while the ring makes progress (Ctrl-C and the
    timeout are looked at between slices; nothing is published until all of it fits)."""
    ex, progress = dev.executor, ring_progress(dev, ring, n)
    while rc == SubmitStatus.FULL:
        next(progress)
        rc = ex.try_submit(ring.handle, addr, n, SUBMIT_SLICE_NS)
    if rc == SubmitStatus.OK: return
    if rc == SubmitStatus.STOPPED and dev._closed_reason is not None:  # (a launch that passed the open check as close() began)
        raise HCQError(f"{dev.device} {dev._closed_reason}: its {ring.name} was stopped; nothing was queued")
    raise HCQError(f"{dev.device} {ring.name}: {ex.submit_error(ring.handle, rc)}; nothing was queued")


def wait_for_room(dev: Any, ring: Ring, n: int) -> None:
    """Return once `ring` has room for `n` words (only this thread submitting to it can then fill it)."""
    ex = dev.executor
    if ex.room(ring.handle) >= n: return
    progress = ring_progress(dev, ring, n)
    while ex.room(ring.handle) < n:
        next(progress)
        time.sleep(0.0002)


def ring_progress(dev: Any, ring: Ring, n: int) -> Iterator[None]:
    """Steps of a wait for ring space: each raises on a pending Ctrl-C inside a critical section, or when the ring
    made no progress for the wait timeout."""
    ex, timeout_s = dev.executor, wait_timeout_ms() / 1000
    last, last_change = ex.consumed(ring.handle), time.monotonic()
    while True:
        if interrupts.interrupted(): raise WaitInterrupted(f"interrupted while waiting for room in {dev.device}'s {ring.name}")
        now_consumed, now = ex.consumed(ring.handle), time.monotonic()
        if now_consumed != last: last, last_change = now_consumed, now
        elif now - last_change >= timeout_s:
            report = dev.hang_report()
            raise HCQTimeoutError(f"{dev.device} {ring.name}: no room for a submission of {n} words for {int(timeout_s * 1000)} ms: the "
                                  "queue is stalled (most likely on a wait for a signal nobody sets); nothing of it was queued"
                                  + (f"\nqueues:\n{report}" if report else ""))
        yield


class BoundWords:
    """Packet words in runtime memory, run in place through one INDIRECT packet: a bound queue's, or those of a
    submission too large for the ring. Released (once submitted work is past it) when its owner lets go."""

    def __init__(self, dev: Any, words: array):
        self.dev, self.buf = dev, dev.allocator.alloc(max(WORD_BYTES, len(words) * WORD_BYTES), RUNTIME_SPEC, internal=True)
        self.view = self.buf.cpu_view().view(0, len(words) * WORD_BYTES, "Q")
        if words: self.view.mv[:] = memoryview(words).cast("B").cast("Q")
        self.indirect = (header(Op.INDIRECT), self.buf.va_addr, len(words))

    def __del__(self) -> None:
        try:
            self.dev.allocator.free_from_finalizer(self.buf, RUNTIME_SPEC)
        except Exception:  # noqa: BLE001 - a destructor must not raise (e.g. at interpreter exit)
            pass


# ---- the queue
class PacketQueue(HWQueue):
    """A queue of hcq packets (see hcq.packets for the format)."""

    def __init__(self, index: int = 0, *, profile: bool | None = None) -> None:
        super().__init__(index, profile=profile)
        self._indirect: array | None = None  # bound: [INDIRECT addr n] + the fence packet at submit
        self._words: BoundWords | None = None

    def _signal(self, signal: HCQSignal, value: sint) -> None:
        self.q(H_SIGNAL, signal.value_addr, value)

    def _wait(self, signal: HCQSignal, value: sint) -> None:
        self.q(H_WAIT, signal.value_addr, value)

    def _timestamp(self, signal: HCQSignal) -> None:
        self.q(H_TIMESTAMP, signal.timestamp_addr)

    def _memory_barrier(self) -> None:
        self.q(H_BARRIER)

    def _exec(self, prg: HCQProgram, args_state: HCQArgsState, global_size: tuple[sint, ...], local_size: tuple[sint, ...]) -> None:
        self.q(H_EXEC, prg.entry, args_state.buf.va_addr, *global_size, *local_size)

    def _copy(self, dest: sint, src: sint, copy_size: sint, guard: HCQSignal | None) -> None:
        if guard is None: self.q(H_COPY, dest, src, copy_size)
        else: self.q(H_GUARDED_COPY, dest, src, copy_size, guard.value_addr)

    def _write(self, addr: sint, value: sint, b64: bool) -> None:
        self.q(H_WRITE64 if b64 else H_WRITE32, addr, value)

    def _poll_bit(self, addr: sint, value: sint, mask: sint, b64: bool, cond: PollCondition) -> None:
        self.q(header(Op.POLL, flags=FLAG_B64 if b64 else 0, cond=cond), addr, value, mask)

    def _bind(self, dev: Any) -> None:
        self._words = dev.executor.bind_words(dev, array("Q", self._q))  # type: ignore[arg-type]
        self._q = self._words.view
        self._indirect = array("Q", [*self._words.indirect, 0, 0, 0])
        self._words_in_memory = True

    def _submit(self, dev: Any, ring: Ring, fence_value: int) -> Any:
        fence = (H_SIGNAL, ring.fence.value_addr, fence_value)
        spilled = None
        if (words := self._indirect) is not None:  # bound: [INDIRECT addr n, SIGNAL fence value]
            words[3], words[4], words[5] = fence
        else:
            words = array("Q", self._q)  # type: ignore[arg-type]
            if len(words) + len(fence) <= dev.executor.ring_words:
                words.extend(fence)
            else:
                spilled = dev.executor.bind_words(dev, words)
                words = array("Q", (*spilled.indirect, *fence))
        publish(dev, ring, words)
        return spilled

    def _native_resubmit(self, dev: Any) -> Any:
        """The native re-submit (hcq/_hotpath.c's Resubmit) of an unbound queue whose symbols are plain Variables in its
        words, built without validation or profiling, that fits the ring; None otherwise (or without the extension)."""
        if not hotpath.available() or self._indirect is not None or self._notes is not None or self._prof_items or self._unchecked or self.mv_sints: return None
        if not isinstance(self._q, list) or len(self._q) + PACKET_WORDS[Op.SIGNAL] > dev.executor.ring_words: return None
        if any(type(e) is not Variable or e.vmin < 0 or e.vmax >= 1 << 63 for _, e in self.q_sints): return None
        if not (address := dev.executor.native_submit_address()): return None
        ring = dev.ring(self.kind, self.index)
        symbols = tuple((idx, e.name, e.vmin, e.vmax) for idx, e in self.q_sints)  # type: ignore[attr-defined]
        return hotpath.resubmitter(dev.native_state(), ring, address, (*self._q, H_SIGNAL, ring.fence.value_addr, 0), symbols, self._keepalive, self._q, self._fence_word)

    def _wait_for_room(self, dev: Any) -> None:
        n = len(self._indirect) if self._indirect is not None else len(self._q) + PACKET_WORDS[Op.SIGNAL]
        wait_for_room(dev, dev.ring(self.kind, self.index), n if n <= dev.executor.ring_words else PACKET_WORDS[Op.INDIRECT] + 3)


class PacketComputeQueue(PacketQueue):
    """Compute queue of a packet device."""
    kind = COMPUTE


class PacketCopyQueue(PacketQueue):
    """Copy queue number `index` of a packet device."""
    kind = COPY


# ---- the launch hot path
@dataclass(frozen=True)
class LaunchPlan:
    """A program's plain launch on its device, resolved once by the checked Python path: the launch packets
    (`[WAIT tl tv-1] [BARRIER] [TIMESTAMP start]? [EXEC entry kernargs grid block] [TIMESTAMP end]? [SIGNAL tl tv]`), the
    words each call patches, and where its arguments go. A run of the plan (`FastLauncher.__call__` in Python,
    hcq/_hotpath.c's Launchable natively) checks what can change between calls (the arguments, the dims, the device
    open), writes the kernargs block, patches `timeline_at` with the timeline signal's address, `wait_at` / `signal_at`
    with `timeline_value - 1` / `timeline_value`, `kernargs_at` with the block's address and, for new dims, the six
    words at `dims_at`; then submits and steps the timeline. `native`: the native run may take it (untimed, and the
    backend writes nothing else per launch)."""
    words: tuple[int, ...]
    timeline_at: tuple[int, int]
    wait_at: int
    signal_at: int
    kernargs_at: int
    dims_at: int
    layout: KernargsLayout
    native: bool

    def __post_init__(self) -> None:
        n = len(self.words)
        inside = (*self.timeline_at, self.wait_at, self.signal_at, self.kernargs_at)
        if len(self.timeline_at) != 2 or not all(0 <= i < n for i in inside) or not 0 <= self.dims_at <= n - 6:
            raise ValueError(f"launch plan of {n} words patches words outside them: timeline_at={self.timeline_at}, wait_at={self.wait_at}, "
                             f"signal_at={self.signal_at}, kernargs_at={self.kernargs_at}, dims_at={self.dims_at}")

    @staticmethod
    def build(prg: HCQProgram, timed: bool) -> LaunchPlan | None:
        """`prg`'s plan (timed: with its timing signals' timestamps around the EXEC), or None when its launches always
        take the checked path (a kernargs layout the plan cannot write, a block size fixed at compile time)."""
        if (layout := prg.kernargs_layout()) is None or prg.fixed_local_size is not None: return None
        head = [H_WAIT, 0, 0, H_BARRIER]
        if timed: head += [H_TIMESTAMP, prg.timing_signals()[0].timestamp_addr]
        head += [H_EXEC, prg.entry, 0]
        tail = [H_TIMESTAMP, prg.timing_signals()[1].timestamp_addr] if timed else []
        words = (*head, 1, 1, 1, 1, 1, 1, *tail, H_SIGNAL, 0, 0)
        n = len(words)
        return LaunchPlan(words, (1, n - 2), 2, n - 1, len(head) - 1, len(head), layout, not timed and prg.native_launch)


class _PlanRun:
    """The Python run's working copy of a plan: its words (patched in place per call) and the dims they hold."""
    __slots__ = ("plan", "words", "address", "dims")

    def __init__(self, plan: LaunchPlan):
        self.plan, self.words = plan, array("Q", plan.words)
        self.address = self.words.buffer_info()[0]
        self.dims: tuple[Any, Any] = ((1, 1, 1), (1, 1, 1))  # (global_size, local_size) as last given


class FastLauncher:
    """Plain launches (`prg(*bufs, ...)`) with concrete buffers and values run a program's `LaunchPlan`: made once per
    program, patched per call, published with one executor call. Anything unusual returns FALLBACK and takes the
    checked path.

    With the CPython extension and an executor with a native submit, `native` runs the untimed plans in C
    (hcq/_hotpath.c reads each program's plan once, through `native_plan`, and checks new dims through `dims_words`);
    this class runs the calls that C leaves to `prg.launch` (timed ones, a full ring, a new kernargs segment), and all
    of them without the extension."""

    def __init__(self, dev: Any):
        self.dev, self.ring, self.state = dev, dev.ring(COMPUTE, 0), dev._state
        self.try_submit, self.handle = dev.executor.submit_function(), self.ring.handle
        self.native: Any = None
        kernargs, address = dev.kernargs_buf, dev.executor.native_submit_address()
        if address and kernargs.view is not None and isinstance(kernargs.va_addr, int):
            self.native = hotpath.launcher(dev.native_state(), self, HCQBuffer, address, self.handle, kernargs.view.addr, kernargs.va_addr,
                                           dev.kernargs_allocator)

    def plan_run(self, prg: HCQProgram, timed: bool) -> _PlanRun | None:
        """The Python run of `prg`'s plan (made at its first call), or None when it has none."""
        runs = prg._launch_runs
        if timed not in runs: runs[timed] = _PlanRun(plan) if (plan := LaunchPlan.build(prg, timed)) is not None else None
        return runs[timed]

    def native_plan(self, prg: HCQProgram) -> tuple[Any, LaunchPlan] | None:
        """What the native launcher runs for `prg`: (launcher, its untimed plan); None leaves its launches to Python."""
        run = self.plan_run(prg, False) if self.native is not None else None
        return (self.native, run.plan) if run is not None and run.plan.native else None

    def dims_words(self, global_size: Any, local_size: Any) -> tuple[int, ...] | None:
        """The six dims words of a launch (grid, then block), checked; None for dims the checked path must see (it
        says what is wrong with bad ones) or symbolic ones."""
        try:
            gs, ls = self.dev.check_launch_dims(global_size, local_size)
        except (ValueError, TypeError, OverflowError):
            return None
        dims = (*gs, *ls)
        return dims if all(type(d) is int for d in dims) else None

    def __call__(self, prg: HCQProgram, bufs: tuple, global_size: Any, local_size: Any, vals: tuple, wait: bool) -> Any:
        dev, state = self.dev, self.state  # (the device's state words: hcq.device_state)
        if not state[OPEN] or not state[TIMELINE_ADDRESS] or (run := prg._launch_runs.get(wait, False) or self.plan_run(prg, wait)) is None:
            return FALLBACK
        plan, words = run.plan, run.words
        # lists are copied: a caller may change one in place between launches
        gs = tuple(global_size) if type(global_size) is list else global_size
        ls = tuple(local_size) if type(local_size) is list else local_size
        if gs is not run.dims[0] or ls is not run.dims[1]:  # (the same objects as last time: tuples and ints do not change)
            # only plain ints compare as dims here (True == 1, and numpy's integers compare as arrays): the rest, and
            # new dims that are bad, take the checked path, which converts or says what is wrong
            if not (_plain_dims(gs) and _plain_dims(ls)): return FALLBACK
            if (gs, ls) != run.dims:  # new dims: checked and patched
                if (six := self.dims_words(gs, ls)) is None: return FALLBACK
                words[plan.dims_at:plan.dims_at + 6] = array("Q", six)
            run.dims = (gs, ls)
        tv = state[TIMELINE_VALUE]
        kernargs = prg._fast_kernargs(bufs, vals, tv)
        if kernargs is None: return FALLBACK
        tl = state[TIMELINE_ADDRESS]  # the timeline signal changes when it wraps
        words[plan.timeline_at[0]] = words[plan.timeline_at[1]] = tl
        words[plan.wait_at], words[plan.kernargs_at], words[plan.signal_at] = tv - 1, kernargs, tv
        entered = interrupts.enter()  # the submission and the timeline step go together
        try:
            if rc := self.try_submit(self.handle, run.address, len(words), SUBMIT_SLICE_NS): publish_slow(dev, self.ring, run.address, len(words), rc)
            state[TIMELINE_VALUE] = tv + 1
            dev.mark_busy()
        finally:
            interrupts.leave(entered)
        if not wait: return None
        dev.synchronize()
        st, en = prg.timing_signals()
        return (en.load_timestamp() - st.load_timestamp()) / (en.timestamp_divider * 1e6)


def _plain_dims(d: Any) -> bool:
    """Launch dims the fast launchers compare as they are: an int, or a tuple of ints (bools are not ints here)."""
    return type(d) is int or (type(d) is tuple and all(type(x) is int for x in d))


def describe_state(dev: Any, state: RingState) -> dict[str, Any] | None:
    """The command a ring is running, as `queue_states()` reports it (None when idle)."""
    if state.current is None and state.text is None: return None
    text = state.text if state.text is not None else describe(state.current or [], dev.kernel_names)
    return {"ring_word": state.position, "indirect_index": state.indirect_index, "words": state.current or [],
            "op": text.split(" ")[0], "text": text}

