"""Signals: `HCQSignal`, the 16-byte value + timestamp pair that queues and the host synchronise through.
Everything reads and writes a signal through `load` / `store` / `load_timestamp` / `wait` (and
`compare_exchange`), so a backend whose signals are not plain host memory overrides those and nothing else."""
from __future__ import annotations

import time
from decimal import Decimal
from typing import Any

from hcq import atomics, interrupts, profiler
from hcq.errors import DeviceError, HCQError, HCQTimeoutError, WaitInterrupted
from hcq.helpers import wait_timeout_ms
from hcq.interfaces import DeviceLike
from hcq.memory import HCQBuffer
from hcq.packets import POISON_MASK, POISON_TAG, SIGNAL_SIZE, SIGNAL_TIMESTAMP_OFFSET, WORD_MAX
from hcq.symbolic import sint


class HCQSignal:
    """A 16-byte signal: 64-bit value at +0, 64-bit raw timestamp at +8 (divided by `timestamp_divider` to get
    microseconds). A signal whose `base_buf.va_addr` is symbolic is virtual: queues can use it and its address
    is patched at submit, but the host cannot read it.

    Backends whose signals are not host memory override `load`, `store`, `load_timestamp`, `compare_exchange`
    and `_wait_slice`; the defaults read and write the host view of the signal's memory (`compare_exchange` with a
    hardware compare-and-swap: atomic against devices that update the word atomically)."""
    WAIT_SLICE_MS = 20  # waits run in slices so Ctrl-C and the progress-aware timeout get a look in
    # Whether a store is a write of the host's view of the words (and a wake): native code (a graph run) may then
    # store into them itself. False for signals whose store must also travel (a remote device's).
    stores_in_host_memory = True
    _pool: list[HCQBuffer] | None = None  # where the slot returns when the signal is collected

    def __init__(self, base_buf: HCQBuffer, value: int = 0, owner: DeviceLike | None = None, is_timeline: bool = False,
                 timestamp_divider: int = 1000):
        if base_buf.size < SIGNAL_SIZE: raise ValueError(f"a signal needs {SIGNAL_SIZE} bytes, {base_buf!r} has {base_buf.size}")
        self.base_buf, self.owner, self.is_timeline, self.timestamp_divider = base_buf, owner, is_timeline, timestamp_divider
        self.value_addr: sint = base_buf.va_addr
        self.timestamp_addr: sint = base_buf.va_addr + SIGNAL_TIMESTAMP_OFFSET
        self._value_mv: Any = None  # the host's 'Q' views of the two words (None for virtual signals)
        self._ts_mv: Any = None  # (set together)
        if isinstance(base_buf.va_addr, int):
            self._attach_host_memory(base_buf)
            self.store(value, wake=False)

    def _attach_host_memory(self, base_buf: HCQBuffer) -> None:
        """Backends with signal memory the host cannot view override this (and the accessors)."""
        view = base_buf.cpu_view()
        self._value_mv, self._ts_mv = view.view(0, 8, "Q").mv, view.view(SIGNAL_TIMESTAMP_OFFSET, 8, "Q").mv
        self._host_value_addr = view.addr
        self._ts_mv[0] = 0

    @property
    def virtual(self) -> bool:
        """Whether the signal's address is symbolic (patched at submit; the host cannot read or write it)."""
        return not isinstance(self.value_addr, int)

    def _refuse_virtual(self) -> None:
        raise HCQError(f"{self!r} is virtual (its address is symbolic); the host cannot read or write it")

    # ---- the access interface
    def load(self) -> int:
        """The current value."""
        mv = self._value_mv
        if mv is None: self._refuse_virtual()
        return mv[0]

    def store(self, value: int, wake: bool = True) -> None:
        """Set the value (a host store carries no poison: a tag left by a failed device goes first); `wake`: also
        wake queues and host threads sleeping on the signal (False only where nothing can be waiting on it)."""
        if type(value) is not int or not 0 <= value <= WORD_MAX: check_word("signal value", value)
        if self._value_mv is None: self._refuse_virtual()
        if self._ts_mv[0] & POISON_MASK == POISON_TAG: self._ts_mv[0] = 0
        self._value_mv[0] = value

    def load_timestamp(self) -> int:
        """The raw timestamp word (device units; see `timestamp_divider`)."""
        if self._ts_mv is None: self._refuse_virtual()
        return self._ts_mv[0]

    def compare_exchange(self, expected: int, desired: int) -> int:
        """Atomically set the value to `desired` if it is `expected`; returns the value found. The default is a
        sequentially consistent compare-and-swap of the word in host memory (hcq.atomics)."""
        for what, v in (("expected", expected), ("desired", desired)):
            if type(v) is not int or not 0 <= v <= WORD_MAX: check_word(f"compare_exchange {what} value", v)
        if self._value_mv is None: self._refuse_virtual()
        return atomics.cas64(self._host_value_addr, expected, desired)

    def _wait_slice(self, value: int, ms: int) -> bool:
        """Wait up to `ms` for the value to reach `value`; True when it did."""
        end = time.monotonic() + ms / 1000
        while self.load() < value:
            if time.monotonic() >= end: return False
            time.sleep(0)
        return True

    # ---- built on the interface
    @property
    def value(self) -> int:
        """The current value (`load()`); setting it stores the value and wakes waiters (`store(v)`)."""
        return self.load()

    @value.setter
    def value(self, new_value: int) -> None:
        self.store(new_value)

    @property
    def timestamp(self) -> Decimal:
        """The timestamp field in microseconds."""
        return Decimal(self.load_timestamp()) / Decimal(self.timestamp_divider)

    def wait(self, value: int, timeout: int | None = None, *, failed_ok: bool = False) -> None:
        """Wait until the signal is >= `value`. Raises HCQTimeoutError when it makes no progress for `timeout`
        ms (default HCQDEV_WAIT_TIMEOUT_MS, 30000); a value that moves restarts the timer. Raises DeviceError
        when the value was stored by work of a device that had failed (the work it stands for did not run);
        `failed_ok=True` accepts such a value (for waits that only need the queue to be past a point)."""
        if type(value) is not int or not 0 <= value <= WORD_MAX: check_word("signal wait value", value)
        # Most waits end in the spin phase of a first zero-length slice: only a longer one reads the timeout and reports
        # itself to the profiler (a first slice is also where a wait with timeout=0 starts).
        if self.load() < value and (profiler.active is not None or not self._wait_slice(value, 0)):
            timeout_ms = wait_timeout_ms() if timeout is None else timeout
            if not isinstance(timeout_ms, (int, float)) or timeout_ms < 0: raise ValueError(f"wait timeout must be >= 0 ms, got {timeout_ms!r}")
            t0 = time.perf_counter_ns() if profiler.active is not None else 0
            try:
                self._wait_progress(value, timeout_ms)
            finally:
                if t0 and profiler.active is not None:  # named by kind (a few names in a trace), the details as args
                    where = f" {self.owner.device}" if self.owner is not None else ""
                    profiler.active.host_event(f"wait {'timeline' if self.is_timeline else 'signal'}{where}", t0,
                                               signal=f"0x{self.value_addr:x}" if isinstance(self.value_addr, int) else str(self.value_addr),
                                               value=value)
        if not failed_ok: self._check_failed_setter(value)

    def failed_setter(self) -> Any:
        """The device of the peer group (or its poison id, if none has it) that stored the current value after it
        had failed (hcq.packets: a failed executor tags the timestamp word with POISON_TAG | its id), else None."""
        if self._ts_mv is None: return None
        ts = self.load_timestamp()
        if ts & POISON_MASK != POISON_TAG: return None
        dev_id = ts & 0xFFFFFFFF
        for dev in self.owner.peers() if self.owner is not None else ():
            if dev.poison_id == dev_id: return dev
        return dev_id

    def _check_failed_setter(self, value: int) -> None:
        """Raise DeviceError when the value reached was stored by a failed device: the work it stands for did not run."""
        if self._ts_mv is None or self._ts_mv[0] & POISON_MASK != POISON_TAG: return
        setter = self.failed_setter()
        if setter is None: return
        if isinstance(setter, int):
            name = f"device #{setter} of peer group {self.owner.peer_group if self.owner is not None else '?'}"
        else:
            setter.check_error(f"waiting for {self!r} to reach {value}")  # still failed: its own error says what
            name = setter.device
        raise DeviceError(f"{self!r} reached {value} through work of {name} that failed before it ran (the device was recovered since)")

    def _wait_progress(self, value: int, timeout_ms: float) -> None:
        last, last_change = self.load(), time.monotonic()
        during = lambda: f"waiting for {self!r} to reach {value}"  # noqa: E731  (built only for a message)
        while True:
            slice_ms = int(max(0, min(self.WAIT_SLICE_MS, timeout_ms)))
            if self._wait_slice(value, slice_ms): return
            if self.owner is not None: self.owner.check_error(during)
            if interrupts.interrupted(): raise WaitInterrupted(f"interrupted while waiting for {self!r} to reach {value}")
            cur, now = self.load(), time.monotonic()
            if cur >= value: return
            if cur != last: last, last_change = cur, now
            elif (now - last_change) * 1000 >= timeout_ms:
                report = self.owner.hang_report() if self.owner is not None else ""
                raise HCQTimeoutError(f"timed out after {timeout_ms} ms without progress waiting for {self!r} to reach "
                                      f"{value}; it is at {cur}" + (f"\nqueues:\n{report}" if report else ""))

    def __del__(self) -> None:
        if self._pool is not None: self._pool.append(self.base_buf)

    def __repr__(self) -> str:
        addr = f"0x{self.value_addr:x}" if isinstance(self.value_addr, int) else getattr(self.value_addr, "expr", self.value_addr)
        kind = "timeline signal" if self.is_timeline else "signal"
        return f"<{kind} {addr}{' of ' + self.owner.device if self.owner is not None else ''}>"


class SignalReplica(HCQSignal):
    """A copy of `source` (a signal of another peer group) in memory the queues of `owner` read: the backends keep it
    following the source's value (stores by queues and host stores that wake), so `owner`'s queues can wait on it.
    The host reads and waits on the source; `release` (a backend's) stops the following and frees the memory."""

    def __init__(self, source: HCQSignal, addr: sint, owner: DeviceLike, release: Any = None):
        self.base_buf, self.owner, self.is_timeline, self.timestamp_divider = HCQBuffer(addr, SIGNAL_SIZE, owner=owner), owner, False, source.timestamp_divider
        self.value_addr, self.timestamp_addr = addr, addr + SIGNAL_TIMESTAMP_OFFSET
        self._value_mv = self._ts_mv = None
        self.source, self._release = source, release

    def load(self) -> int:
        return self.source.load()

    def load_timestamp(self) -> int:
        return self.source.load_timestamp()

    def store(self, value: int, wake: bool = True) -> None:
        raise HCQError(f"{self!r} follows {self.source!r}: store into the source")

    def _wait_slice(self, value: int, ms: int) -> bool:
        return self.source._wait_slice(value, ms)

    def wait(self, value: int, timeout: int | None = None, *, failed_ok: bool = False) -> None:
        self.source.wait(value, timeout, failed_ok=failed_ok)

    def release(self) -> None:
        """Stop following the source (the backend frees the replica's memory)."""
        release, self._release = self._release, None
        if release is not None: release()

    def __repr__(self) -> str:
        return f"<replica on {self.owner.device if self.owner is not None else '?'} of {self.source!r}>"


def check_word(what: str, value: object) -> None:
    """Raise TypeError/ValueError unless `value` is an int that fits a 64-bit unsigned word."""
    if not isinstance(value, int) or isinstance(value, bool): raise TypeError(f"{what} must be an int, got {value!r}")
    if not 0 <= value <= WORD_MAX: raise ValueError(f"{what} {value} is outside [0, 2**64)")

