"""Where a capture (hcq.graph.Capture) listens: program calls and transfers check `active()` and, while a
capture records on this thread, hand it their work instead of running it. Kept apart from the graph layer
so programs and the allocator need not import it."""
from __future__ import annotations

import threading
from typing import Any, Protocol


class Recorder(Protocol):
    def on_exec(self, prg: Any, bufs: tuple, vals: tuple, global_size: tuple, local_size: tuple) -> None: ...

    def on_copy(self, dest: Any, src: Any, nbytes: Any) -> None: ...


_state = threading.local()
capturing = 0  # captures open on any thread: lets hot paths skip the thread-local lookup when zero


def active() -> Recorder | None:
    """The recorder capturing on this thread, if any."""
    return getattr(_state, "recorder", None) if capturing else None


def set_active(rec: Recorder | None) -> None:
    global capturing
    prev = getattr(_state, "recorder", None)
    capturing += (rec is not None) - (prev is not None)
    _state.recorder = rec
