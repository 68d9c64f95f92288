"""Lifetimes, done once for every backend: submission rings with their fences (what a submission references is
held until its fence passes), the devices that may have work in flight, and releases of memory deferred until
all work submitted before them has run.

A *progress mark* is (signal, value): once every mark of a device is reached, everything submitted to it so far
has run. A device's marks are its timeline and the fence of each of its rings."""
from __future__ import annotations

import os
import weakref
from array import array
from collections import deque
from typing import Any, Callable, Iterable

from hcq import hotpath, interrupts
from hcq.errors import DeviceError
from hcq.interfaces import COMPUTE, SignalLike

Mark = tuple[SignalLike, int]

# How many buffers were freed in this process so far, bumped by every `free`. Queues and graphs hold the buffers their
# commands use and look at their `freed` flags again only when this moved since their last look, so a re-submit or a
# replay refuses a freed buffer at the cost of one comparison.
FREES = [0]


class Ring:
    """One submission ring of a device and its fence: every submission to the ring ends with a signal of `fence`
    to its number, so `fence.load() >= n` means submission n (and all before it) ran. What a submission references
    (signals, args states, spilled words) is held until then. `lock` makes taking the number, writing the ring and
    tracking one step when several threads submit; `handle` is the backend's (e.g. its executor's ring).

    The ring's count and each queue's last fence are words (`state`, `HWQueue._fence_word`) that the native runs
    (hcq/_hotpath.c's Resubmit and GraphRun) advance in place; those runs hold what their submissions reference
    themselves, and hand it to the ring when they go (`held_by`)."""

    def __init__(self, dev: Any, kind: str, index: int, handle: Any, fence: SignalLike):
        self.dev, self.kind, self.index, self.handle, self.fence = dev, kind, index, handle, fence
        self.name = "compute queue" if kind == COMPUTE else f"{kind} queue {index}"
        self.state = array("Q", [0])  # [the fence value of the latest submission]; never rebound or resized
        self.inflight: deque[tuple[int, Any]] = deque()
        self.lock = hotpath.ring_lock()
        self.holder: int | None = None  # the thread inside a submission to this ring

    @property
    def count(self) -> int:
        """The fence value of the latest submission (the number of submissions so far)."""
        return self.state[0]

    def note(self, queue: Any, count: int, refs: Any) -> None:
        """The bookkeeping of submission `count` of `queue` (with `lock` held): the ring's count, the queue's last fence,
        and `refs` held until the fence passes `count`. The submitter then lists its device busy, then `retire`s."""
        self.state[0] = queue._fence_word[0] = count
        queue._fence_ring = self
        self.inflight.append((count, refs))

    def held_by(self, run: Any, last: array, refs: Any) -> None:
        """`run`, a native run of a queue that writes the number of each of its submissions to this ring into its own word
        `last`, holds `refs` itself: when it goes, the ring holds them until the fence passes that number (the queue may
        be gone by then while its last submissions still run)."""
        weakref.finalize(run, self._hold, last, refs).atexit = False

    def _hold(self, last: array, refs: Any) -> None:
        if (count := last[0]) > self.fence.load(): self.inflight.append((count, refs))  # (out of order: retired no earlier)

    def retire(self) -> None:
        """Drop what finished submissions held (their args states, signals and spilled words may go)."""
        self._take_finished()

    def _take_finished(self) -> list[tuple[int, Any]]:
        """Take the entries of finished submissions off the ring; what they held goes with the returned list."""
        done, finished = self.fence.load(), []
        while self.inflight and self.inflight[0][0] <= done: finished.append(self.inflight.popleft())
        return finished

    def retire_unlocked(self) -> None:
        """`retire` from outside a submission (after a synchronize: what the finished work held may go now rather than at
        the next submission); skipped while a submission holds the ring, which retires itself. A Ctrl-C waits for the
        lock to be given back (a KeyboardInterrupt between taking and releasing it would leave the ring locked), and what
        the finished work held is dropped after that (its finalizers run outside the lock)."""
        finished: list[tuple[int, Any]] = []
        entered = interrupts.enter()
        try:
            if self.lock.acquire(blocking=False):
                try:
                    finished = self._take_finished()
                finally:
                    self.lock.release()
        finally:
            interrupts.leave(entered)
        del finished

    def restart(self) -> None:
        """After a recovery: the fence says every submission so far ran (they were run or dropped)."""
        self.fence.store(max(self.count, self.fence.load()))
        self.retire()

    def __repr__(self) -> str:
        return f"<Ring {self.name} of {getattr(self.dev, 'device', self.dev)} at {self.count}>"


# Devices that may have work in flight, per peer group. The rule that keeps a free from missing work, whatever the
# threads interleave: a submitter adds its device *after* the submission is counted (ring.count, timeline_value), and
# a look that finds a device idle removes it, looks again, and puts it back if it is busy after all. Each step is one
# set operation (atomic under the GIL), so a submission counted before the removal is seen by the second look, and
# one counted after it is followed by its own add. (A flag read before submitting, to skip the add, cannot work:
# a look may remove the device between that read and the count.)
_busy: dict[str, set[Any]] = {}


def busy_set(peer_group: str) -> set[Any]:
    """The set of busy devices of `peer_group`, which a device holds as `_busy_set` (native submits add to it)."""
    return _busy.setdefault(peer_group, set())


def mark_busy(dev: Any) -> None:
    """Note that `dev` has submitted work; call once the submission is counted in its progress marks."""
    dev._busy_set.add(dev)


def _unreached(dev: Any) -> list[Mark]:
    return [(sig, v) for sig, v in dev.progress_marks() if sig.load() < v]


def outstanding(dev: Any) -> list[Mark]:
    """The progress marks of `dev` not reached yet; a device found idle leaves the busy set (see above)."""
    marks = _unreached(dev)
    if not marks:
        dev._busy_set.discard(dev)
        if marks := _unreached(dev): dev._busy_set.add(dev)
    return marks


def busy_devices(peer_group: str) -> list[Any]:
    return list(_busy.get(peer_group, ()))


class DeferredReleases:
    """Releases that wait, without blocking anyone, until the work submitted before them has run on every busy
    device of a peer group. Later entries' marks are at or past earlier ones', so they run in order."""

    def __init__(self, dev: Any):
        self.dev = dev  # whose peer group's busy devices to look at
        self._pending: deque[tuple[list[Mark], Callable[[], None]]] = deque()

    def __len__(self) -> int:
        return len(self._pending)

    def defer(self, release: Callable[[], None]) -> None:
        """Call `release` once all work submitted so far (to any device of the peer group) has run."""
        marks = [mark for dev in busy_devices(self.dev.peer_group) for mark in outstanding(dev)]
        if not marks and not self._pending: return release()
        self._pending.append((marks, release))
        self.poll()

    def poll(self) -> None:
        """Carry out the releases whose work has passed (no waiting)."""
        pending = self._pending
        while pending and all(sig.load() >= v for sig, v in pending[0][0]): pending.popleft()[1]()

    def adopt(self, other: DeferredReleases, gone: Any) -> None:
        """Take over `other`'s pending releases: its device `gone` was closed, so they wait for the marks of the peer
        group's other devices only (its own work finished, or was dropped when it closed)."""
        for marks, release in other._pending: self._pending.append(([m for m in marks if getattr(m[0], "owner", None) is not gone], release))
        other._pending.clear()
        self.poll()

    def run_all(self) -> None:
        """Carry out every pending release now (nothing that could still use the memory runs any more)."""
        while self._pending: self._pending.popleft()[1]()

    def flush(self, devices: Iterable[Any]) -> None:
        """Wait for `devices` (a failed device counts as drained) and carry out what that allows."""
        for dev in devices:
            if dev.closed or getattr(dev, "timeline_signal", None) is None: continue  # (closed, or still opening: nothing to wait for)
            try:
                dev.synchronize()
            except DeviceError:
                pass  # a failed device still drains (or dropped) its work
        self.poll()


os.register_at_fork(after_in_child=_busy.clear)  # the parent's devices are unusable in a child (see hcq.device)
