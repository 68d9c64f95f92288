"""Queues: `HWQueue` accumulates a device's command words, records where symbolic values went, and owns what
every backend would otherwise re-invent: argument checks, queue-kind refusals, validation notes, keeping alive
what a submission references until its fence passes, waiting for a queue's previous run before patching words
that live in memory, and the submission step itself (fence number, ring write and tracking as one).

Backends encode: `_signal`, `_wait`, `_timestamp`, `_memory_barrier`, `_exec`, `_copy`, `_write`, `_poll_bit`,
and publish: `_submit(dev, ring, fence_value)` (the queue's words, then a signal of `ring.fence` to the value),
plus `_bind` when queues can live in device memory. Backends that run hcq packets need none of this: they use
`hcq.packet_queue.PacketQueue` and supply an executor."""
from __future__ import annotations

import struct
import threading
import time
from array import array
from dataclasses import dataclass
from typing import Any, ClassVar, Mapping, Sequence

from hcq import interrupts, profiler, validation
from hcq.errors import HCQError, HCQTimeoutError, QueueKindError, WaitInterrupted
from hcq.interfaces import COMPUTE, COPY
from hcq.lifetimes import FREES, Ring
from hcq.memory import FMT_RANGE, PLACEHOLDER, HCQBuffer, MMIOInterface
from hcq.packets import POISON_MASK, POISON_TAG, PollCondition
from hcq.program import Dims, HCQArgsState, HCQProgram
from hcq.signal import HCQSignal, SignalReplica
from hcq.symbolic import Expr, resolve, sint

_MISSING = object()


@dataclass
class _ProfItem:
    """An exec or copy between two timestamps, reported to the profiler after each run of its queue."""
    kind: str
    name: str
    dev: Any  # whose clock (None: the device the queue is submitted to)
    st: HCQSignal
    en: HCQSignal | None
    nbytes: int | None
    args: dict[str, Any]
    auto: bool  # the queue added the timestamps (profiling was on when it was built)


class HWQueue:
    """A hardware command queue under construction: commands append encoded words and return self, so they
    chain; `submit` resolves symbols and hands the words to a device.

    Symbolic values (`Expr`) may go anywhere a value, address, size or grid dim goes: the word gets a
    placeholder and its position is recorded, and every submit rewrites only the words whose resolved value
    changed since the previous submit. `kind` is "compute" or "copy"; `index` picks one of several queues of
    that kind on a device (e.g. copy engines)."""
    kind: ClassVar[str] = COMPUTE
    word_bits: ClassVar[int] = 64

    def __init__(self, index: int = 0, *, profile: bool | None = None) -> None:
        """`index`: which queue of the kind (e.g. copy engine); `profile`: record every exec and copy as a profiler
        event (default: whether profiling is on when the queue is made; the runtime's own queues record theirs)."""
        if not isinstance(index, int) or isinstance(index, bool) or index < 0: raise ValueError(f"queue index must be an int >= 0, got {index!r}")
        self.index = index
        self._profile = profiler.active is not None if profile is None else profile
        self._prof_items: list[_ProfItem] = []  # exec/copy commands bracketed by timestamps, reported at each submit
        self._prof_open: _ProfItem | None = None  # an exec/copy right after a timestamp, waiting for the closing one
        self._last_ts: HCQSignal | None = None  # the timestamp command just before, if the last command was one
        self._prof_owed: tuple[Any, Any, Ring, int] | None = None  # (profiler, device, ring, fence) of a run not reported yet
        self._q: list[int] | MMIOInterface = []
        self.q_sints: list[tuple[int, Expr]] = []  # (word index, expression) for words in the queue
        self.mv_sints: list[tuple[MMIOInterface, int, Expr]] = []  # symbols living in memory (kernargs)
        self._prev_q: list[int | None] = []
        self._prev_mv: list[int | None] = []
        self.binded_device: Any = None
        self._notes: list[validation.Note] | None = [] if validation.enabled else None
        self._groups: list[tuple[tuple[str, ...], list[int], list[int]]] = []
        self._groups_key: tuple[int, int] = (-1, -1)
        self._last_var_vals: dict[str, int] | None = None
        self._keepalive: list[Any] = []  # what submissions reference (signals, args states): held until their fence passes
        self._fence_ring: Ring | None = None  # the ring of the last submission, and its fence value (`_last_fence`), a word
        self._fence_word = array("Q", [0])    # the native re-submit advances in place
        self._words_in_memory = False  # set by `_bind` when the device reads the words from memory at run time
        self._polls: list[tuple[PollCondition, bool]] = []  # (condition, masked) of every poll_bit, checked at submit
        self._writes: list[validation.Write] = []  # validation mode: what the submission being made writes
        self._unchecked: list[tuple[str, int, int, bool]] = []  # copies and writes given raw addresses: checked at the first submit
        self._native: Any = None  # the native re-submit (see _native_resubmit), remade after every checked submit
        self._bufs: list[HCQBuffer] = []  # the allocations its commands use: a submit refuses the queue once one is freed
        self._bufs_seen = -1  # lifetimes.FREES when they were last looked at (see _check_usable)
        self._timeline: list[tuple[HCQSignal, sint]] = []  # (device timeline signal, value) of its signal commands
        self._timeline_symbolic = False  # one of those values is symbolic: each submit that goes in notes its var_vals
        self._sent_vals: dict[str, int] | None = None  # (then) the var_vals of the last submission that went in
        self._given_up: dict[int, int] = {}  # index into _timeline -> the value a refused submit gave up (see _forfeit_timeline)

    # ---- building
    def q(self, *values: sint) -> None:
        """Append raw words (ints or symbolic expressions) to the queue."""
        if self.binded_device is not None:
            raise HCQError("this queue is bound to a device; its packets are fixed, build a new queue to add commands")
        q, top = self._q, (1 << self.word_bits) - 1
        for v in values:
            if type(v) is int:
                if not 0 <= v <= top: raise ValueError(f"queue word {v} does not fit in {self.word_bits} bits unsigned")
                q.append(v)  # type: ignore[union-attr]
            elif isinstance(v, Expr):
                self.q_sints.append((len(q), v))
                self._prev_q.append(None)
                q.append(PLACEHOLDER & top)  # type: ignore[union-attr]
            else:
                raise TypeError(f"queue values must be int or a symbolic expression, got {type(v).__name__}: {v!r}")

    def _note(self, command: str, ranges: Sequence[tuple[str, sint, sint]] = (), launch: tuple | None = None,
              writes: Sequence[tuple[sint, sint]] = (), sets: tuple[HCQSignal, sint] | None = None) -> None:
        if self._notes is not None: self._notes.append(validation.Note(len(self._notes), command, list(ranges), launch, list(writes), sets))

    def bind_sints_to_mem(self, *vals: sint, mem: MMIOInterface, fmt: str, offset: int = 0) -> None:
        """Record symbols that live in memory (e.g. kernargs) so submit patches them there."""
        mv = mem.view(offset, len(vals) * struct.calcsize(fmt), fmt)
        for i, v in enumerate(vals):
            if isinstance(v, Expr):
                self.mv_sints.append((mv, i, v))
                self._prev_mv.append(None)

    def bind_args_state(self, args_state: HCQArgsState) -> None:
        """Record the symbolic values of an args state's kernargs, so each submit patches them in its memory."""
        for vals, mem, fmt in args_state.bind_data: self.bind_sints_to_mem(*vals, mem=mem, fmt=fmt)

    def _only(self, kind: str, command: str) -> None:
        if self.kind != kind:
            factory = "hw_compute_queue_t" if kind == COMPUTE else "hw_copy_queue_t"
            raise QueueKindError(f"{command} runs on {kind} queues; use dev.{factory}()")

    # ---- commands
    def signal(self, signal: HCQSignal, value: sint) -> HWQueue:
        """Set `signal` to `value` once all previous commands completed (its timestamp is not touched: a `timestamp`
        command records time)."""
        self._check_signal(signal, "signal")
        if self._profile: self._prof_other()
        self._note("signal", [("signal", signal.value_addr, 8)], sets=(signal, value))
        self._keepalive.append(signal)  # its slot must not return to the pool while a submission writes it
        if signal.is_timeline:
            self._timeline.append((signal, value))
            self._timeline_symbolic |= isinstance(value, Expr)
        self._signal(signal, value)
        return self

    def wait(self, signal: HCQSignal, value: sint) -> HWQueue:
        """Halt the queue until `signal` >= `value` (64-bit)."""
        self._check_signal(signal, "wait")
        if self._profile: self._prof_other()
        # (a replica is memory of this device that no allocation holds: its backend made it)
        self._note("wait", [] if isinstance(signal, SignalReplica) else [("signal", signal.value_addr, 8)])
        self._keepalive.append(signal)
        self._wait(signal, value)
        return self

    def timestamp(self, signal: HCQSignal) -> HWQueue:
        """Record the current device time in `signal`'s timestamp once all previous commands completed."""
        self._check_signal(signal, "timestamp")
        self._note("timestamp", [("signal timestamp", signal.timestamp_addr, 8)])
        self._keepalive.append(signal)
        self._timestamp(signal)
        if self._profile: self._prof_timestamp(signal)
        return self

    def memory_barrier(self) -> HWQueue:
        """Make earlier writes visible to every agent. Compute queues only."""
        self._only(COMPUTE, "memory_barrier")
        if self._profile: self._prof_other()
        self._memory_barrier()
        return self

    def exec(self, prg: HCQProgram, args_state: HCQArgsState, global_size: Dims, local_size: Dims) -> HWQueue:
        """Run `prg` over a grid of `global_size` blocks of `local_size` threads (each an int n, meaning (n, 1, 1),
        or a tuple of 1 to 3 dims). Compute queues only."""
        self._only(COMPUTE, "exec")
        if not isinstance(prg, HCQProgram): raise TypeError(f"exec needs an HCQProgram, got {prg!r}")
        if not isinstance(args_state, HCQArgsState): raise TypeError(f"exec needs an HCQArgsState (from prg.fill_kernargs), got {args_state!r}")
        gs, ls = prg.dev.check_launch_dims(global_size, local_size)
        if prg.fixed_local_size is not None and ls != prg.fixed_local_size:
            raise ValueError(f"kernel {prg.name!r} fixes its local size to {prg.fixed_local_size} when compiled; it cannot run with {ls}")
        if self._notes is not None:  # (validation mode only: the notes are not built otherwise)
            ptrs = list(zip([s for s in prg.arg_slots if s.is_pointer], args_state.bufs))
            self._note("exec", [("kernargs", args_state.buf.va_addr, prg.kernargs_alloc_size)] +
                       [(f"buffer for {s.name!r}", b.va_addr, b.size) for s, b in ptrs], (prg, args_state, gs, ls),
                       [(b.va_addr, b.size) for s, b in ptrs if not s.read_only])  # a kernel may write what it does not take as const
        self.bind_args_state(args_state)
        self._bufs.extend(b.base for b in args_state.bufs if isinstance(b, HCQBuffer))
        self._keepalive.append(args_state)
        if self._profile: self._prof_command("kernel", prg.name, prg.dev, None, global_size=str(gs), local_size=str(ls))
        self._exec(prg, args_state, gs, ls)
        if self._profile: self._prof_close(prg.dev)
        return self

    def copy(self, dest: sint | HCQBuffer, src: sint | HCQBuffer, copy_size: sint, guard: HCQSignal | None = None) -> HWQueue:
        """Copy `copy_size` bytes between device addresses (buffers give their address). Copy queues only.
        With `guard` (a signal at GUARD_PENDING), the copy is cancellable: see hcq.packets.GUARD_PENDING."""
        self._only(COPY, "copy")
        if isinstance(copy_size, int) and not isinstance(copy_size, bool):
            if copy_size < 0: raise ValueError(f"copy size must be >= 0, got {copy_size}")
            for b in (dest, src):
                if isinstance(b, HCQBuffer) and copy_size > b.size: raise ValueError(f"copy of {copy_size} bytes overruns {b!r}")
        if isinstance(dest, HCQBuffer): dest.check_writable("copy destination")
        d, s = self._addr(dest), self._addr(src)
        if type(copy_size) is int:
            for what, given, addr, written in (("copy destination", dest, d, True), ("copy source", src, s, False)):
                if type(addr) is int and not isinstance(given, HCQBuffer): self._unchecked.append((what, addr, copy_size, written))
        self._note("copy", [("copy destination", d, copy_size), ("copy source", s, copy_size)], writes=[(d, copy_size)])
        if guard is not None:
            self._check_signal(guard, "copy guard")
            self._keepalive.append(guard)
        owner = next((b.owner for b in (src, dest) if isinstance(b, HCQBuffer) and b.owner is not None), None)
        if self._profile: self._prof_command("copy", f"copy {copy_size if isinstance(copy_size, int) else 'n'} bytes", owner,
                                             copy_size if isinstance(copy_size, int) else None)
        self._copy(d, s, copy_size, guard)
        if self._profile: self._prof_close(owner)
        return self

    def write(self, buf: HCQBuffer | sint, value: sint, b64: bool = False) -> HWQueue:
        """Store the 32-bit (64-bit with b64) `value` at `buf` (a buffer or device address) once all previous
        commands completed."""
        bits = 64 if b64 else 32
        if isinstance(value, Expr) and not (0 <= value.vmin and value.vmax < (1 << bits)):
            raise ValueError(f"write of {value.expr} (range [{value.vmin}, {value.vmax}]) may not fit in {bits} bits; "
                             f"narrow the variable's range{'' if b64 else ' or use b64=True'}")
        if isinstance(value, int) and not 0 <= value < (1 << bits): raise ValueError(f"write of {value} does not fit in {bits} bits")
        if isinstance(buf, HCQBuffer): buf.check_writable("write destination")
        addr = self._addr(buf)
        if type(addr) is int and not isinstance(buf, HCQBuffer): self._unchecked.append(("write destination", addr, bits // 8, True))
        if self._profile: self._prof_other()
        self._note("write", [("destination", addr, bits // 8)], writes=[(addr, bits // 8)])
        self._write(addr, value, b64)
        return self

    def poll_bit(self, buf: HCQBuffer | sint, value: sint, mask: sint | None = None, b64: bool = False,
                 cond: PollCondition = PollCondition.EQ) -> HWQueue:
        """Halt the queue until the 32-bit (64-bit with b64) word at `buf` satisfies `cond` (see PollCondition:
        EQ is `(word & mask) == value`, mask defaulting to all ones; GEQ, AND and NOR take no mask). Devices
        offer the conditions in `dev.capabilities.poll_conditions`; submit refuses others."""
        if not isinstance(cond, PollCondition): raise TypeError(f"poll_bit condition must be a PollCondition, got {cond!r}")
        full = (1 << (64 if b64 else 32)) - 1
        if mask is None: mask = full
        elif cond != PollCondition.EQ and not (isinstance(mask, int) and mask == full):
            raise ValueError(f"poll_bit with {cond.name} takes no mask (only EQ compares under a mask)")
        for what, v in (("value", value), ("mask", mask)):
            if isinstance(v, int) and not 0 <= v <= full: raise ValueError(f"poll_bit {what} {v} does not fit in {64 if b64 else 32} bits")
        addr = self._addr(buf)
        if self._profile: self._prof_other()
        self._note("poll_bit", [("polled address", addr, 8 if b64 else 4)])
        self._polls.append((cond, not (isinstance(mask, int) and mask == full)))
        self._poll_bit(addr, value, mask, b64, cond)
        return self

    # ---- profiling of the queue's own commands
    def _prof_other(self) -> None:
        self._last_ts = self._prof_open = None  # a command between a timestamp and an exec/copy: no bracket

    def _prof_timestamp(self, sig: HCQSignal) -> None:
        if self._prof_open is not None and not self._prof_open.auto:  # closes "timestamp, exec/copy, timestamp"
            self._prof_open.en = sig
            self._prof_items.append(self._prof_open)
            self._prof_open = None
        self._last_ts = sig

    def _prof_command(self, kind: str, name: str, dev: Any, nbytes: int | None, **args: Any) -> None:
        """Before an exec/copy: bracket it with the user's timestamp just before (and the one that will follow), or
        with timestamps of its own (signals from its device, or the owner of a buffer it copies)."""
        if self._last_ts is not None: self._prof_open = _ProfItem(kind, name, dev, self._last_ts, None, nbytes, args, auto=False)
        elif dev is not None:
            st = dev.new_signal()
            self._keepalive.append(st)
            self._timestamp(st)
            self._prof_open = _ProfItem(kind, name, dev, st, None, nbytes, args, auto=True)
        else: self._prof_open = None
        self._last_ts = None

    def _prof_close(self, dev: Any) -> None:
        item = self._prof_open
        if item is None or not item.auto: return
        item.en = en = dev.new_signal()
        self._keepalive.append(en)
        self._timestamp(en)
        self._prof_items.append(item)
        self._prof_open = None

    def _collect_profile(self) -> None:
        """Report the last run's exec/copy times to the profiler that was on when it was submitted (before the next run
        overwrites its timestamps). Waits for the run; a run dropped by a failed device reports nothing."""
        if self._prof_owed is None: return
        prof, dev, ring, value = self._prof_owed
        self._prof_owed = None
        ring.fence.wait(value, failed_ok=True)
        for it in self._prof_items:
            assert it.en is not None
            st, en = it.st.load_timestamp(), it.en.load_timestamp()
            if (st | en) & POISON_MASK == POISON_TAG or en < st: continue  # the command did not run
            div = it.st.timestamp_divider
            prof.device_event(it.kind, it.name, it.dev if it.dev is not None else dev, (self.kind, self.index), st / div, en / div,
                              it.nbytes, **it.args)

    def _check_signal(self, signal: object, what: str) -> None:
        if not isinstance(signal, HCQSignal): raise TypeError(f"{what} needs an HCQSignal, got {type(signal).__name__}")

    def _addr(self, x: Any) -> sint:
        if isinstance(x, HCQBuffer):
            if x.freed: raise ValueError(f"{x!r} was freed; a queue cannot use it")
            self._bufs.append(x.base)
            return x.va_addr
        if isinstance(x, (int, Expr)) and not isinstance(x, bool): return x
        raise TypeError(f"expected an HCQBuffer or a device address, got {type(x).__name__}: {x!r}")

    # ---- encoders (backends)
    def _signal(self, signal: HCQSignal, value: sint) -> None:
        """Backends: encode store `value` into `signal` (release: after everything before it on the queue)."""
        raise NotImplementedError(f"{type(self).__name__} does not implement signal")

    def _wait(self, signal: HCQSignal, value: sint) -> None:
        """Backends: encode wait until `signal`'s value is >= `value` (64-bit, unsigned)."""
        raise NotImplementedError(f"{type(self).__name__} does not implement wait")

    def _timestamp(self, signal: HCQSignal) -> None:
        """Backends: encode store the device clock into `signal`'s timestamp word (`timestamp_divider` units per microsecond)."""
        raise NotImplementedError(f"{type(self).__name__} does not implement timestamp")

    def _memory_barrier(self) -> None:
        """Backends: encode make the queue's earlier stores visible to the device's other queues and the host."""
        raise NotImplementedError(f"{type(self).__name__} does not implement memory_barrier")

    def _exec(self, prg: HCQProgram, args_state: HCQArgsState, global_size: tuple[sint, ...], local_size: tuple[sint, ...]) -> None:
        """Backends: encode run `prg` with the kernargs in `args_state.buf` over `global_size` blocks of `local_size` threads."""
        raise NotImplementedError(f"{type(self).__name__} does not implement exec")

    def _copy(self, dest: sint, src: sint, copy_size: sint, guard: HCQSignal | None) -> None:
        """Backends: encode copy `copy_size` bytes from `src` to `dest`; with `guard`, move it PENDING -> RUNNING first (skip the
        copy if the host moved it to CANCELLED) and to DONE after."""
        raise NotImplementedError(f"{type(self).__name__} does not implement copy")

    def _write(self, addr: sint, value: sint, b64: bool) -> None:
        """Backends: encode store `value` (64 bits if `b64`, else 32) at `addr`."""
        raise NotImplementedError(f"{type(self).__name__} does not implement write")

    def _poll_bit(self, addr: sint, value: sint, mask: sint, b64: bool, cond: PollCondition) -> None:
        """Backends: encode wait until the word at `addr` (64 or 32 bits), masked with `mask`, meets `cond` against `value`."""
        raise NotImplementedError(f"{type(self).__name__} does not implement poll_bit")

    # ---- binding and submission
    def bind(self, dev: Any) -> HWQueue:
        """Fix the queue to `dev`: backends that can, move its words into device memory, so a re-submit
        only patches the changed words in place and hands the device a pointer."""
        if self.binded_device is not None: raise HCQError(f"queue is already bound to {self.binded_device.device}")
        dev.check_queue(self)
        self._bind(dev)
        self.binded_device = dev
        return self

    def _bind(self, dev: Any) -> None:
        """Backends: move the words where `dev` reads them at run time (set `_words_in_memory`)."""

    def submit(self, dev: Any, var_vals: Mapping[str, int] | None = None) -> HWQueue:
        """Resolve symbols with `var_vals` (rewriting only changed words) and hand the queue to `dev`. A Ctrl-C
        arriving meanwhile is raised once the submission is in (or, if it arrives while the submission waits
        for its previous run or for ring space, once it is certain nothing was queued)."""
        if self._bufs_seen != FREES[0] or self._given_up: self._check_usable(dev, var_vals)
        if (native := self._native) is not None:  # (see _native_resubmit)
            if native(self, dev, var_vals):
                if self._timeline_symbolic: self._sent_vals = dict(var_vals)  # type: ignore[arg-type]
                return self
            # a native re-submit runs only after the checked submit that made it (on that submit's ring); it goes now,
            # and the ring takes what it held (Ring.held_by)
            self._native = native = None
        prof = profiler.active
        t0 = time.perf_counter_ns() if prof is not None else 0
        entered = interrupts.enter()
        try:
            try:
                if self._prof_owed is not None: self._collect_profile()
                self._prepare(dev, var_vals)
                self._submit_to_ring(dev)
            except Exception as e:  # refused: nothing of it went in
                self._refused(e, var_vals)
                raise
            if self._timeline_symbolic: self._sent_vals = dict(var_vals) if var_vals else {}
            if prof is not None and self._prof_items:
                assert self._last_fence is not None
                self._prof_owed = (prof, dev, *self._last_fence)
                prof.track_queue(self)
        finally:
            interrupts.leave(entered)
        if t0 and prof is not None: prof.host_event(f"submit {type(self).__name__}", t0, device=dev.device, words=len(self._q))
        self._native = self._native_resubmit(dev)
        return self

    @property
    def _last_fence(self) -> tuple[Ring, int] | None:
        """(ring, fence value) of the last submission, or None before the first."""
        return None if self._fence_ring is None else (self._fence_ring, self._fence_word[0])

    def _check_usable(self, dev: Any, var_vals: Mapping[str, int] | None) -> None:
        """Refuse a submit that would use a buffer freed since the queue was built (its memory may be another allocation's
        by now), or signal a timeline value an earlier refused submit of this queue gave up (later work no longer waits
        for it). The buffers are looked at again only when something was freed since the last look."""
        seen = FREES[0]
        try:
            if (freed := next((b for b in self._bufs if b._freed), None)) is not None:
                # validating: its report names the command, where the memory is not another allocation's yet
                if self._notes is not None: validation.check(type(self).__name__, self._notes, dev, var_vals if var_vals is not None else {})
                raise ValueError(f"{freed!r} was freed after this queue was built; a re-submit would write whatever memory took its place "
                                 "(build the queue again with live buffers)")
            for i, v in self._given_up.items():
                sig, value = self._timeline[i]
                owner: Any = sig.owner
                if resolve(value, var_vals) == v:
                    raise HCQError(f"this queue signals timeline value {v} of {owner.device}, which was given up when an earlier submit of "
                                   "it was refused (later work no longer waits for it); build the queue again with a new "
                                   "dev.next_timeline(), or give the value through a Variable")
        except Exception as e:
            self._refused(e, var_vals)
            raise
        self._bufs_seen = seen

    def _refused(self, error: Exception, var_vals: Mapping[str, int] | None) -> None:
        """A submit was refused with `error`, nothing of it queued: its timeline values are forfeited (see below), unless
        a Ctrl-C ended it (then the caller may submit it again, as if it had not been called)."""
        if self._timeline and not isinstance(error, WaitInterrupted): self._forfeit_timeline(var_vals)

    def _forfeit_timeline(self, var_vals: Mapping[str, int] | None) -> None:
        """After a refused submit: each value of a device's timeline this queue would have signalled, taken for it (below
        `timeline_value`) and not signalled by an earlier submission of it, goes back to its device, which has it reached
        in its place (`HCQCompiled._forfeit_timeline`), so later waits on the timeline do not stall on it. The queue then
        refuses to signal that value itself."""
        for i, (sig, value) in enumerate(self._timeline):
            dev: Any = sig.owner
            if dev is None or getattr(dev, "timeline_signal", None) is not sig: continue  # (a timeline swapped at a wrap since)
            try:
                v = resolve(value, var_vals)
                sent = self._last_fence is not None if isinstance(value, int) else \
                    self._sent_vals is not None and resolve(value, self._sent_vals) == v
            except Exception:  # noqa: BLE001 - no value was given for it, so none was taken
                continue
            if not sent and self._given_up.get(i) != v and dev._forfeit_timeline(v): self._given_up[i] = v

    def _native_resubmit(self, dev: Any) -> Any:
        """Backends: after a submit to `dev` went through, a native callable `f(queue, dev, var_vals) -> bool` that
        re-submits the queue as this submit did (True) or declines, having submitted nothing (False); or None."""
        return None

    def _prepare(self, dev: Any, var_vals: Mapping[str, int] | None, previous_run_done: bool = False) -> None:
        """Everything of a submit that can refuse (device, validation, symbols); nothing reaches the device.
        `previous_run_done`: the caller knows this queue's last submission finished."""
        if self.binded_device is not None and self.binded_device is not dev:
            raise HCQError(f"queue is bound to {self.binded_device.device}, cannot submit it to {dev.device}")
        dev.check_queue(self)
        if self._notes is not None: self._writes = validation.check(type(self).__name__, self._notes, dev, var_vals if var_vals is not None else {})
        if self._polls: self._check_polls(dev)
        if self._unchecked: self._check_bounds(dev)
        if self.q_sints or self.mv_sints:
            if not previous_run_done and (self._words_in_memory or self.mv_sints): self._wait_previous_run()
            self._apply_var_vals(var_vals if var_vals is not None else {})

    def _check_bounds(self, dev: Any) -> None:
        """Copies and writes given raw addresses: one that starts inside an allocation of `dev` must end inside it too, the
        allocation must be live, and writable where it is written (checked once, at the first submit; buffers given as such
        are checked when built)."""
        for what, addr, n, written in self._unchecked:
            buf = dev.allocator.owns(addr, 1) if n else None
            if buf is None: continue  # not memory of this device (a peer's, or host memory lent to a copy): validation mode looks
            if buf.freed: raise ValueError(f"{what} 0x{addr:x} is inside {buf!r}, which was freed")
            if written: buf.check_writable(f"{what} 0x{addr:x}")
            end = buf.va_addr + buf.size
            if addr + n > end:
                raise ValueError(f"{what} 0x{addr:x} ({n} bytes) is {addr - buf.va_addr} bytes into {buf!r}, so it runs "
                                 f"{addr + n - end} bytes past the end")
        self._unchecked.clear()

    def _check_polls(self, dev: Any) -> None:
        caps = dev.capabilities
        for cond, masked in self._polls:
            if cond not in caps.poll_conditions:
                raise ValueError(f"{dev.device} cannot poll with {cond.name}; it offers {', '.join(sorted(c.name for c in caps.poll_conditions))}")
            if masked and not caps.poll_mask: raise ValueError(f"{dev.device} cannot poll under a mask; use a full mask")

    def _wait_previous_run(self) -> None:
        """Words that live in memory (a bound queue's, kernargs) are patched in place: the previous run of this
        queue must have finished reading them first (or have been dropped by a failed device)."""
        if self._last_fence is None: return
        ring, value = self._last_fence
        if ring.fence.load() >= value: return
        try:
            ring.fence.wait(value, failed_ok=True)
        except HCQTimeoutError as e:
            raise HCQTimeoutError(f"re-submitting a queue whose words or kernargs live in memory waits for its previous run, "
                                  f"which did not finish: {e}") from None

    def _submit_to_ring(self, dev: Any) -> None:
        """Publish to the device's ring for this queue with the next fence value, and hold what the submission
        references until the fence passes it: taking the number, writing the ring and tracking are one step."""
        ring: Ring = dev.ring(self.kind, self.index)
        me = threading.get_ident()
        if ring.holder == me:  # a finalizer run by the garbage collector in the middle of a submission
            raise HCQError(f"a submission to {dev.device}'s {ring.name} was started while this thread was inside another one "
                           "(from a __del__ or weakref callback?); submit from ordinary code instead")
        entered = interrupts.enter()
        try:
            with ring.lock:
                ring.holder = me
                try:
                    value = ring.count + 1
                    extra = self._submit(dev, ring, value)
                    ring.note(self, value, self._keepalive if extra is None else (self._keepalive, extra))
                    dev.mark_busy()  # (after the count: see hcq.lifetimes' busy-device rule; before what finished goes)
                    ring.retire()
                    if self._notes is not None: validation.note_writes(ring.fence, value, self._writes)
                finally:
                    ring.holder = None
        finally:
            interrupts.leave(entered)

    def _submit(self, dev: Any, ring: Ring, fence_value: int) -> Any:
        """Backends: publish the queue's words and then a signal of `ring.fence` to `fence_value`, whole or not at
        all. Returns anything more the submission needs kept alive until the fence passes (or None)."""
        raise NotImplementedError(f"{type(self).__name__} does not implement _submit")

    def _wait_for_room(self, dev: Any) -> None:
        """Backends: return once a submit of this queue to `dev` would not have to wait for ring space (so a
        group of submissions, like a graph run, cannot stall half way)."""

    # ---- symbols
    def _sym_groups(self) -> list[tuple[tuple[str, ...], list[int], list[int]]]:
        """Symbol positions grouped by the variables they depend on: (names, q_sints indices, mv_sints indices)."""
        key = (len(self.q_sints), len(self.mv_sints))
        if self._groups_key != key:
            groups: dict[frozenset[str], tuple[list[int], list[int]]] = {}
            for i, (_, e) in enumerate(self.q_sints): groups.setdefault(e.variables, ([], []))[0].append(i)
            for i, (_, _, e) in enumerate(self.mv_sints): groups.setdefault(e.variables, ([], []))[1].append(i)
            self._groups, self._groups_key, self._last_var_vals = [(tuple(sorted(k)), a, b) for k, (a, b) in groups.items()], key, None
        return self._groups

    def _apply_var_vals(self, var_vals: Mapping[str, int]) -> None:
        """Resolve symbols and rewrite the words whose value changed. Positions whose variables all kept
        their values since the last successful submit are not even looked at, so the cost follows what
        changed, not the queue's length."""
        groups, last = self._sym_groups(), self._last_var_vals
        self._last_var_vals = None  # if anything below raises, the next submit re-checks every position
        cache: dict[int, int] = {}
        q = self._q.mv if isinstance(self._q, MMIOInterface) else self._q  # bound: write the words in place
        prev_q, prev_mv, top = self._prev_q, self._prev_mv, (1 << self.word_bits) - 1
        for names, q_idx, mv_idx in groups:
            if last is not None:
                if len(names) == 1:
                    if var_vals.get(names[0], _MISSING) == last.get(names[0], _MISSING): continue
                elif all(var_vals.get(n, _MISSING) == last.get(n, _MISSING) for n in names): continue
            for i in q_idx:
                idx, e = self.q_sints[i]
                if (v := cache.get(id(e))) is None: v = cache[id(e)] = e.resolve(var_vals)
                if v != prev_q[i]:
                    if not 0 <= v <= top: raise ValueError(f"{e.expr} = {v} does not fit in a {self.word_bits}-bit queue word")
                    q[idx] = prev_q[i] = v
            for i in mv_idx:
                mv, idx, e = self.mv_sints[i]
                if (v := cache.get(id(e))) is None: v = cache[id(e)] = e.resolve(var_vals)
                if v != prev_mv[i]:
                    lo, hi = FMT_RANGE.get(mv.fmt, (None, None))
                    if lo is not None and not lo <= v <= hi: raise ValueError(f"{e.expr} = {v} does not fit in format {mv.fmt!r}")  # type: ignore[operator]
                    mv[idx] = prev_mv[i] = v
        self._last_var_vals = dict(var_vals)

    def __len__(self) -> int:
        return len(self._q)

