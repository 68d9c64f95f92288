"""Queues and signals: `HWQueue` accumulates encoded command words (symbolic ones recorded for patching)
and `HCQSignal` is the 16-byte value + timestamp pair that queues and the host synchronise through."""
from __future__ import annotations

import struct
import time
from decimal import Decimal
from typing import TYPE_CHECKING, Any, Callable, Generic, Mapping, TypeVar

from hcq import interrupts, profiler, validation
from hcq.errors import HCQError, HCQTimeoutError
from hcq.helpers import wait_timeout_ms
from hcq.memory import HCQBuffer, MMIOInterface
from hcq.symbolic import Expr, sint

if TYPE_CHECKING:
    from hcq.device import HCQCompiled
    from hcq.program import HCQArgsState, HCQProgram

_MISSING = object()
PLACEHOLDER = 0xBADC0DED  # written where a symbolic word goes until its first submit resolves it
WORD_MAX = (1 << 64) - 1
# The guard word of a cancellable copy (`HWQueue.copy(..., guard=sig)`): the copy engine moves it from PENDING
# to RUNNING before it touches memory and to DONE after; the host cancels by moving it from PENDING to
# CANCELLED. Whoever moves it off PENDING first wins, so after a cancel or DONE the copy touches nothing.
GUARD_PENDING, GUARD_RUNNING, GUARD_CANCELLED, GUARD_DONE = range(4)
_FMT_RANGE = {f: ((-(1 << (8 * struct.calcsize(f) - 1)), (1 << (8 * struct.calcsize(f) - 1)) - 1) if f.islower()
                  else (0, (1 << (8 * struct.calcsize(f))) - 1)) for f in "bBhHiIlLqQ"}

DeviceType = TypeVar("DeviceType", bound="HCQCompiled")
SignalType = TypeVar("SignalType", bound="HCQSignal")
ProgramType = TypeVar("ProgramType", bound="HCQProgram")
ArgsStateType = TypeVar("ArgsStateType", bound="HCQArgsState")


class HCQSignal(Generic[DeviceType]):
    """A 16-byte signal: 64-bit value at +0, 64-bit raw timestamp at +8 (divided by `timestamp_divider`
    to get microseconds). A signal whose `base_buf.va_addr` is symbolic is virtual: queues can use it and
    its address is patched at submit, but the host cannot read it."""
    # Backends may set a native host-side wait: (host_addr, value, timeout_ns) -> 0 reached / 1 timed out.
    native_wait: Callable[[int, int, int], int] | None = None
    # ...and a native host-side store that also wakes queues sleeping on the signal: (host_addr, value).
    native_store: Callable[[int, int], None] | None = None
    # ...and a native atomic compare-and-swap: (host_addr, expected, desired) -> the value found.
    native_cas: Callable[[int, int, int], int] | None = None
    WAIT_SLICE_MS = 20  # waits run in slices so Ctrl-C and the progress-aware timeout get a look in
    _pool: list[HCQBuffer] | None = None  # where the slot returns when the signal is collected

    def __init__(self, base_buf: HCQBuffer, value: int = 0, owner: DeviceType | None = None, is_timeline: bool = False,
                 timestamp_divider: int = 1000):
        if base_buf.size < 16: raise ValueError(f"a signal needs 16 bytes, {base_buf!r} has {base_buf.size}")
        self.base_buf, self.owner, self.is_timeline, self.timestamp_divider = base_buf, owner, is_timeline, timestamp_divider
        self.value_addr: sint = base_buf.va_addr
        self.timestamp_addr: sint = base_buf.va_addr + 8
        if isinstance(base_buf.va_addr, int):
            view = base_buf.cpu_view()
            self.value_mv, self.timestamp_mv = view.view(0, 8, "Q"), view.view(8, 8, "Q")
            self.value = value
            self.timestamp_mv[0] = 0
        else:
            self.value_mv = self.timestamp_mv = None

    def _host(self) -> tuple[MMIOInterface, MMIOInterface]:
        if self.value_mv is None or self.timestamp_mv is None:
            raise HCQError(f"{self!r} is virtual (its address is symbolic); the host cannot read or write it")
        return self.value_mv, self.timestamp_mv

    @property
    def value(self) -> int:
        return self._host()[0][0]

    @value.setter
    def value(self, new_value: int) -> None:
        if type(new_value) is not int or not 0 <= new_value <= WORD_MAX: _check_word("signal value", new_value)
        value_mv = self._host()[0]
        if self.native_store is not None: type(self).native_store(value_mv.addr, new_value)  # type: ignore[misc]
        else: value_mv[0] = new_value

    @property
    def timestamp(self) -> Decimal:
        """The timestamp field in microseconds."""
        return Decimal(self._host()[1][0]) / Decimal(self.timestamp_divider)

    def compare_exchange(self, expected: int, desired: int) -> int:
        """Atomically set the value to `desired` if it is `expected`; returns the value found."""
        if self.native_cas is None: raise HCQError(f"{type(self).__name__} has no atomic compare-and-swap")
        return type(self).native_cas(self._host()[0].addr, expected, desired)  # type: ignore[misc]

    def wait(self, value: int, timeout: int | None = None, *, failed_ok: bool = False) -> None:
        """Wait until the signal is >= `value`. Raises HCQTimeoutError when it makes no progress for `timeout`
        ms (default HCQDEV_WAIT_TIMEOUT_MS, 30000); a value that moves restarts the timer. Raises DeviceError
        when the value was stored by work of a device that had failed (the work it stands for did not run);
        `failed_ok=True` accepts such a value (for waits that only need the queue to be past a point)."""
        if type(value) is not int or not 0 <= value <= WORD_MAX: _check_word("signal wait value", value)
        value_mv = self.value_mv if self.value_mv is not None else self._host()[0]
        if value_mv.mv[0] < value:
            timeout_ms = wait_timeout_ms() if timeout is None else timeout
            if not isinstance(timeout_ms, (int, float)) or timeout_ms < 0: raise ValueError(f"wait timeout must be >= 0 ms, got {timeout_ms!r}")
            t0 = time.perf_counter_ns() if profiler.active is not None else 0
            try:
                self._wait_progress(value_mv, value, timeout_ms)
            finally:
                if t0 and profiler.active is not None: profiler.active.host_event(f"wait {self!r} >= {value}", t0)
        if not failed_ok: self._check_failed_setter(value)

    def _check_failed_setter(self, value: int) -> None:
        """Backends whose failed devices still store signals (poisoned) raise DeviceError here for such a value."""

    def _wait_progress(self, value_mv: MMIOInterface, value: int, timeout_ms: int) -> None:
        last, last_change = value_mv[0], time.monotonic()
        while True:
            slice_ms = int(max(0, min(self.WAIT_SLICE_MS, timeout_ms)))
            if self._wait_slice(value, slice_ms): return
            if self.owner is not None: self.owner._check_device_error(f"waiting for {self!r} to reach {value}")
            if interrupts.interrupted(): raise WaitInterrupted(f"interrupted while waiting for {self!r} to reach {value}")
            cur, now = value_mv[0], time.monotonic()
            if cur >= value: return
            if cur != last: last, last_change = cur, now
            elif (now - last_change) * 1000 >= timeout_ms:
                report = self.owner._hang_report() if self.owner is not None else ""
                raise HCQTimeoutError(f"timed out after {timeout_ms} ms without progress waiting for {self!r} to reach "
                                      f"{value}; it is at {cur}" + (f"\nqueues:\n{report}" if report else ""))

    def _wait_slice(self, value: int, ms: int) -> bool:
        value_mv = self._host()[0]
        if self.native_wait is not None:
            return type(self).native_wait(value_mv.addr, value, ms * 1_000_000) == 0  # type: ignore[misc]
        end = time.monotonic() + ms / 1000
        while value_mv[0] < value:
            if time.monotonic() >= end: return False
            time.sleep(0)
        return True

    def __del__(self) -> None:
        if self._pool is not None: self._pool.append(self.base_buf)

    def __repr__(self) -> str:
        addr = f"0x{self.value_addr:x}" if isinstance(self.value_addr, int) else self.value_addr.expr  # type: ignore[union-attr]
        kind = "timeline signal" if self.is_timeline else "signal"
        return f"<{kind} {addr}{' of ' + self.owner.device if self.owner is not None else ''}>"


def _check_word(what: str, value: object) -> None:
    """Raise TypeError/ValueError unless `value` is an int that fits a 64-bit unsigned word."""
    if not isinstance(value, int) or isinstance(value, bool): raise TypeError(f"{what} must be an int, got {value!r}")
    if not 0 <= value <= WORD_MAX: raise ValueError(f"{what} {value} is outside [0, 2**64)")


class WaitInterrupted(HCQError):
    """A wait inside a critical section was ended by a Ctrl-C (the section raises KeyboardInterrupt when it closes)."""


class HWQueue(Generic[SignalType, DeviceType, ProgramType, ArgsStateType]):
    """A hardware command queue under construction: methods append encoded packets and return self, so
    they chain; `submit` resolves symbols and hands the words to a device. Backends implement the commands.

    Symbolic values (`Expr`) may go anywhere a value, address, size or grid dim goes: the word gets the
    0xbadc0ded placeholder and its position is recorded, and every submit rewrites only the words whose
    resolved value changed since the previous submit."""

    def __init__(self) -> None:
        self._q: list[int] | MMIOInterface = []
        self.q_sints: list[tuple[int, Expr]] = []  # (word index, expression) for words in the queue
        self.mv_sints: list[tuple[MMIOInterface, int, Expr]] = []  # symbols living in memory (kernargs)
        self._prev_q: list[int | None] = []
        self._prev_mv: list[int | None] = []
        self.binded_device: DeviceType | None = None
        self._notes: list[validation.Note] | None = [] if validation.enabled else None
        self._groups: list[tuple[tuple[str, ...], list[int], list[int]]] = []
        self._groups_key: tuple[int, int] = (-1, -1)
        self._last_var_vals: dict[str, int] | None = None

    # ---- building
    def q(self, *values: sint) -> None:
        """Append raw words (ints or symbolic expressions) to the queue."""
        if self.binded_device is not None:
            raise HCQError("this queue is bound to a device; its packets are fixed, build a new queue to add commands")
        q = self._q
        for v in values:
            if type(v) is int:
                if not 0 <= v <= WORD_MAX: raise ValueError(f"queue word {v} does not fit in 64 bits unsigned")
                q.append(v)  # type: ignore[union-attr]
            elif isinstance(v, Expr):
                self.q_sints.append((len(q), v))
                self._prev_q.append(None)
                q.append(PLACEHOLDER)  # type: ignore[union-attr]
            else:
                raise TypeError(f"queue values must be int or a symbolic expression, got {type(v).__name__}: {v!r}")

    def _note(self, command: str, ranges: list[tuple[str, sint, sint]] | None = None, launch: tuple | None = None) -> None:
        """Backends describe each command for validation mode (a no-op when it is off)."""
        if self._notes is not None: self._notes.append(validation.Note(len(self._notes), command, ranges or [], launch))

    def bind_sints_to_mem(self, *vals: sint, mem: MMIOInterface, fmt: str, offset: int = 0) -> None:
        """Record symbols that live in memory (e.g. kernargs) so submit patches them there."""
        mv = mem.view(offset, len(vals) * struct.calcsize(fmt), fmt)
        for i, v in enumerate(vals):
            if isinstance(v, Expr):
                self.mv_sints.append((mv, i, v))
                self._prev_mv.append(None)

    def bind_args_state(self, args_state: ArgsStateType) -> None:
        for vals, mem, fmt in args_state.bind_data: self.bind_sints_to_mem(*vals, mem=mem, fmt=fmt)

    # ---- commands (backends implement them)
    def signal(self, signal: SignalType, value: sint) -> HWQueue:
        """Set `signal` to `value` once all previous commands completed."""
        raise NotImplementedError(f"{type(self).__name__} does not implement signal")

    def wait(self, signal: SignalType, value: sint) -> HWQueue:
        """Halt the queue until `signal` >= `value` (64-bit)."""
        raise NotImplementedError(f"{type(self).__name__} does not implement wait")

    def timestamp(self, signal: SignalType) -> HWQueue:
        """Record the current device time in `signal`'s timestamp once all previous commands completed."""
        raise NotImplementedError(f"{type(self).__name__} does not implement timestamp")

    def memory_barrier(self) -> HWQueue:
        """Make earlier writes visible to every agent. Compute queues only."""
        raise NotImplementedError(f"{type(self).__name__} does not implement memory_barrier")

    def exec(self, prg: ProgramType, args_state: ArgsStateType, global_size: tuple[sint, ...], local_size: tuple[sint, ...]) -> HWQueue:
        """Run `prg` over a grid of `global_size` blocks of `local_size` threads. Compute queues only."""
        raise NotImplementedError(f"{type(self).__name__} does not implement exec")

    def copy(self, dest: sint, src: sint, copy_size: sint, guard: HCQSignal | None = None) -> HWQueue:
        """Copy `copy_size` bytes between device addresses (buffers give their address). Copy queues only.
        With `guard` (a signal at GUARD_PENDING), the copy is cancellable: see GUARD_PENDING."""
        raise NotImplementedError(f"{type(self).__name__} does not implement copy")

    def write(self, buf: HCQBuffer | sint, value: sint, b64: bool = False) -> HWQueue:
        """Write a 32-bit (or 64-bit) value to device memory after previous commands completed."""
        raise NotImplementedError(f"{type(self).__name__} does not implement write")

    def poll_bit(self, buf: HCQBuffer | sint, value: sint, mask: sint, b64: bool = False) -> HWQueue:
        """Halt the queue until (mem & mask) == value."""
        raise NotImplementedError(f"{type(self).__name__} does not implement poll_bit")

    # ---- binding and submission
    def bind(self, dev: DeviceType) -> HWQueue:
        """Move the queue's words into `dev`'s memory: later submits only patch changed words there and
        ring one indirect packet. Submit a bound queue again only after its previous run finished."""
        self._bind(dev)
        self.binded_device = dev
        return self

    def _bind(self, dev: DeviceType) -> None:
        pass  # optional for backends

    def submit(self, dev: DeviceType, var_vals: Mapping[str, int] | None = None) -> HWQueue:
        """Resolve symbols with `var_vals` (rewriting only changed words) and hand the queue to `dev`. A Ctrl-C
        arriving meanwhile is raised once the submission is in (or, if it arrives while the submission waits
        for its previous run or for ring space, once it is certain nothing was queued)."""
        t0 = time.perf_counter_ns() if profiler.active is not None else 0
        entered = interrupts.enter()
        try:
            self._prepare(dev, var_vals)
            self._submit(dev)
        finally:
            interrupts.leave(entered)
        if t0 and profiler.active is not None: profiler.active.host_event(f"submit {type(self).__name__}", t0, device=dev.device, words=len(self._q))
        return self

    def _prepare(self, dev: DeviceType, var_vals: Mapping[str, int] | None, previous_run_done: bool = False) -> None:
        """Everything of a submit that can refuse (device, validation, symbols); nothing reaches the device.
        `previous_run_done`: the caller knows this queue's last submission finished (backends may skip a check)."""
        if self.binded_device is not None and self.binded_device is not dev:
            raise HCQError(f"queue is bound to {self.binded_device.device}, cannot submit it to {dev.device}")
        if self._notes is not None: validation.check(type(self).__name__, self._notes, dev, var_vals if var_vals is not None else {})
        if self.q_sints or self.mv_sints: self._apply_var_vals(var_vals if var_vals is not None else {})

    def _submit(self, dev: DeviceType) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not implement _submit")

    def _wait_for_room(self, dev: DeviceType) -> None:
        """Backends: return once a `_submit` of this queue to `dev` would not have to wait for ring space (so a
        group of submissions, like a graph run, cannot stall half way)."""

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
        prev_q, prev_mv = self._prev_q, self._prev_mv
        for names, q_idx, mv_idx in groups:
            if last is not None:
                if len(names) == 1:
                    if var_vals.get(names[0], _MISSING) == last.get(names[0], _MISSING): continue
                elif all(var_vals.get(n, _MISSING) == last.get(n, _MISSING) for n in names): continue
            for i in q_idx:
                idx, e = self.q_sints[i]
                if (v := cache.get(id(e))) is None: v = cache[id(e)] = e.resolve(var_vals)
                if v != prev_q[i]:
                    if not 0 <= v <= WORD_MAX: raise ValueError(f"{e.expr} = {v} does not fit in a 64-bit queue word")
                    q[idx] = prev_q[i] = v
            for i in mv_idx:
                mv, idx, e = self.mv_sints[i]
                if (v := cache.get(id(e))) is None: v = cache[id(e)] = e.resolve(var_vals)
                if v != prev_mv[i]:
                    lo, hi = _FMT_RANGE.get(mv.fmt, (None, None))
                    if lo is not None and not lo <= v <= hi: raise ValueError(f"{e.expr} = {v} does not fit in format {mv.fmt!r}")
                    mv[idx] = prev_mv[i] = v
        self._last_var_vals = dict(var_vals)

    def __len__(self) -> int:
        return len(self._q)

    def words(self) -> list[int]:
        """The queue's words as they stand (symbolic words hold their last resolved value or the placeholder)."""
        return list(self._q)

    @staticmethod
    def _addr(x: Any) -> sint:
        if isinstance(x, HCQBuffer):
            if x.freed: raise ValueError(f"{x!r} was freed; a queue cannot use it")
            return x.va_addr
        return x
