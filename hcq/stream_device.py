"""The device side of the stream model (hcq.stream_queue): a `StreamDevice` opens a `Stream` per ring and answers
the core's device hooks from them, so a backend without packets supplies only its device calls (`StreamOps`), its
allocator, compiler, program and signal classes, and its two queue classes."""
from __future__ import annotations

from typing import Any, Callable, Generic

from hcq.allocator import HCQAllocator
from hcq.device import HCQCompiled, SignalType
from hcq.interfaces import Capabilities
from hcq.lifetimes import Ring
from hcq.packet_queue import RingState
from hcq.program import HCQProgram
from hcq.stream_queue import Stream, StreamOps, StreamQueue


class StreamDevice(HCQCompiled[SignalType], Generic[SignalType]):
    """A device whose queues are streams (host threads making `ops`' device calls in order). Its failure is the first
    fault a stream reports (`fail`), sticky until `recover()` (declare `recover=True` in the capabilities to allow it);
    `queue_states()` and hang reports show each stream's command positions and the command it is making."""

    def __init__(self, device: str, ops: StreamOps, allocator: HCQAllocator, compiler: Any, runtime: Callable[[Any, str, bytes], HCQProgram],
                 signal_t: type[SignalType], compute_queue_t: type[StreamQueue], copy_queue_t: type[StreamQueue] | None, *,
                 capabilities: Capabilities, **kwargs: Any):
        self.ops = ops
        self._failure: str | None = None
        super().__init__(device, allocator, compiler, runtime, signal_t, compute_queue_t, copy_queue_t, capabilities=capabilities, **kwargs)

    @property
    def failure(self) -> str | None:
        """The device's failure (its first fault), or None."""
        return self._failure

    def fail(self, message: str) -> None:
        """Fail the device (the first failure is the one reported): its streams then make only signal stores."""
        if self._failure is None: self._failure = message

    def _open_ring(self, kind: str, index: int) -> Stream:
        return Stream(self, self.ops, f"{kind} queue {index}")

    def _device_error(self) -> str | None:
        return self._failure

    def _drained(self) -> bool:
        return all(r.handle.idle() for rings in self.rings.values() for r in rings)

    def _recover_hardware(self) -> None:
        self._failure = None

    def _ring_state(self, ring: Ring) -> RingState:
        s: Stream = ring.handle
        return RingState(s.done, s.submitted, s.done, text=s.running)  # positions count commands

    def _shutdown(self) -> None:
        for rings in self.rings.values():
            for r in rings: r.handle.stop()
        super()._shutdown()
