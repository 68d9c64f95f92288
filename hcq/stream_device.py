"""The device side of the stream model (hcq.stream_queue): a `StreamDevice` opens a `Stream` per ring and answers
the core's device hooks from them, so a backend without packets supplies only its device calls (`StreamOps`), its
allocator, compiler, program and signal classes, and its two queue classes."""
from __future__ import annotations

import itertools
from typing import Any, Callable, Generic

from hcq.allocator import HCQAllocator
from hcq.device import HCQCompiled, SignalType
from hcq.interfaces import Capabilities
from hcq.lifetimes import Ring
from hcq.packet_queue import RingState
from hcq.program import HCQProgram
from hcq.stream_queue import Stream, StreamOps, StreamQueue

# Poison ids of stream devices (what their failed streams tag signals with): from 2**31, clear of the small ids of
# packet executors (hcq.packets), should a peer group mix the two.
_poison_ids = itertools.count(1 << 31)


class StreamDevice(HCQCompiled[SignalType], Generic[SignalType]):
    """A device whose queues are streams (host threads making `ops`' device calls in order). Its failure is the first
    fault a stream reports (`fail`), sticky until `recover()` (declare `recover=True` in the capabilities to allow it);
    `queue_states()` and hang reports show each stream's command positions and the command it is making."""

    def __init__(self, device: str, ops: StreamOps, allocator: HCQAllocator, compiler: Any, runtime: Callable[[Any, str, bytes], HCQProgram],
                 signal_t: type[SignalType], compute_queue_t: type[StreamQueue], copy_queue_t: type[StreamQueue] | None, *,
                 capabilities: Capabilities, **kwargs: Any):
        self.ops = ops
        self._failure: str | None = None
        self._poison_id = next(_poison_ids)
        super().__init__(device, allocator, compiler, runtime, signal_t, compute_queue_t, copy_queue_t, capabilities=capabilities, **kwargs)

    @property
    def failure(self) -> str | None:
        """The device's failure (its first fault), or None."""
        return self._failure

    def fail(self, message: str) -> None:
        """Fail the device (the first failure is the one reported): its streams then make only signal stores, poisoned."""
        if self._failure is None: self._failure = message

    @property
    def poison_id(self) -> int:
        """The id this device's failed streams tag the signals they still store with (POISON_TAG | id)."""
        return self._poison_id

    def fail_by_peer(self, peer_id: int, addr: int, value: int) -> None:
        """Fail the device because a wait for the signal at `addr` to reach `value` was released by a value that the
        failed device `peer_id` (a poison id) stored: the work it waited for did not run."""
        peer = next((d for d in self.peers() if d.poison_id == peer_id), None)
        name = peer.device if peer is not None else f"device #{peer_id} of peer group {self.peer_group}"
        why = (peer._device_error() if peer is not None else None) or "(its failure was cleared since)"
        self.fail(f"a WAIT for signal 0x{addr:x} >= {value} was released by {name} after {name} failed, so the work it waited for "
                  f"did not run ({name}: {why}); recover both devices")

    def _open_ring(self, kind: str, index: int) -> Stream:
        return Stream(self, self.ops, f"{kind} queue {index}")

    def _device_error(self) -> str | None:
        return self._failure

    def _drained(self) -> bool:
        return all(r.handle.idle() for rings in self.rings.values() for r in rings)

    def _recover_hardware(self) -> None:
        for rings in self.rings.values():
            for r in rings: r.handle.recovered()
        self._failure = None

    def _ring_state(self, ring: Ring) -> RingState:
        s: Stream = ring.handle
        return RingState(s.done, s.submitted, s.done, text=s.running)  # positions count commands

    def _abort(self, reason: str) -> None:
        self.fail(reason)

    def _stop_rings(self) -> bool:
        streams: list[Stream] = self._ring_handles()
        for s in streams: s.stop()
        for s in streams: s.thread.join(timeout=1)
        return not any(s.thread.is_alive() for s in streams)

    def _shutdown(self) -> None:
        for s in self._ring_handles(): s.stop()
        super()._shutdown()
