"""Ctrl-C that cannot split a critical step. Python raises KeyboardInterrupt between any two bytecodes of the
main thread; a submission that took a ring's fence number but never reached the ring, a graph run with half
of its queues submitted, or a copy whose engine still writes host memory after the exception left would
wedge a device or corrupt memory. Critical sections defer the interrupt instead:

    entered = interrupts.enter()
    try:
        ...                      # the interrupt is recorded, not raised
        if interrupts.interrupted(): ...  # long waits inside poll for it and unwind cleanly
    finally:
        interrupts.leave(entered)  # raises the deferred KeyboardInterrupt, once the step is whole

This works by wrapping the SIGINT handler (in `install`, called when a device opens on the main thread): ours
records the interrupt while the main thread is inside a section and otherwise calls the wrapped handler. Finalizers
(hcq's `__del__` methods, `weakref.finalize` callbacks) are sections of their own, with nothing to open: an exception
in one is only printed, and what it releases (a mapping, a signal slot) would stay taken. While one runs, ours has
the signal delivered again a millisecond later (and again, while a finalizer still runs), so it is raised after.
Only the main thread ever receives KeyboardInterrupt, so sections on other threads cost one comparison. A
handler installed later replaces ours until the next section opens: `enter` puts ours back in front of it (one C call
to read the handler, about 40 ns, on the main thread only)."""
from __future__ import annotations

import os
import signal
import threading
import weakref

try:  # the C function: signal.getsignal wraps it in an enum lookup that costs microseconds
    from _signal import getsignal as _getsignal  # type: ignore[import-not-found]  # the C module has no stubs
except ImportError:  # pragma: no cover - other Pythons
    _getsignal = signal.getsignal
from types import FrameType
from typing import Any

_main_ident: int | None = threading.main_thread().ident
_depth = 0  # sections open on the main thread
_pending: tuple[int, FrameType | None] | None = None
_wrapped: Any = None  # the handler ours stands in front of
_SIGINT = int(signal.SIGINT)


_HCQ_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_WEAKREF_FILE = os.path.splitext(os.path.abspath(weakref.__file__ or ""))[0]


def _in_finalizer(frame: FrameType | None, depth: int = 12) -> bool:
    """Whether `frame` (or one of the `depth` frames it was called from) runs an hcq finalizer or a weakref.finalize."""
    while frame is not None and depth > 0:
        code = frame.f_code
        if code.co_name == "__del__" and code.co_filename.startswith(_HCQ_DIR): return True
        if code.co_name == "__call__" and os.path.splitext(code.co_filename)[0] == _WEAKREF_FILE: return True
        frame, depth = frame.f_back, depth - 1
    return False


def _handler(signum: int, frame: FrameType | None) -> None:
    global _pending
    if _depth:
        _pending = (signum, frame)
        return
    if _in_finalizer(frame):
        try:  # sent again a moment later, from another thread (tripping it from here would run this at once; a real
            # signal, unlike _thread.interrupt_main, also ends a sleep the main thread is in by then)
            retry = threading.Timer(0.001, signal.pthread_kill, (_main_ident, signum))
            retry.daemon = True
            retry.start()
            return
        except RuntimeError:  # (no thread can start: at interpreter exit)
            pass
    _call_wrapped(signum, frame)


def _call_wrapped(signum: int, frame: FrameType | None) -> None:
    handler = _wrapped if callable(_wrapped) and _wrapped is not _handler else signal.default_int_handler
    handler(signum, frame)


def install() -> None:
    """Stand in front of the current SIGINT handler (main thread only; a no-op when SIGINT is ignored or has
    its default action, which raise nothing in Python, or when ours is already there)."""
    global _wrapped
    if threading.get_ident() != _main_ident: return
    current = _getsignal(_SIGINT)
    if current is _handler or not callable(current): return
    _wrapped = current
    signal.signal(signal.SIGINT, _handler)


def enter() -> bool:
    """Open a critical section; returns whether this thread can be interrupted (pass it to `leave`)."""
    global _depth
    if threading.get_ident() != _main_ident: return False
    current = _getsignal(_SIGINT)
    if current is not _handler and callable(current): install()  # a handler set since: stand in front of it again (an
    # ignored or default SIGINT raises nothing in Python: nothing to stand in front of, and no call for it)
    _depth += 1
    return True


def leave(entered: bool) -> None:
    """Close a critical section; the outermost one raises the interrupt that arrived inside it."""
    global _depth, _pending
    if not entered: return
    _depth -= 1
    if _depth == 0 and _pending is not None:
        signum, frame = _pending
        _pending = None
        _call_wrapped(signum, frame)


def interrupted() -> bool:
    """Whether this thread is in a critical section that a Ctrl-C arrived in (long waits inside poll this and
    unwind; the section's `leave` then raises KeyboardInterrupt)."""
    return _pending is not None and threading.get_ident() == _main_ident


class deferred:
    """`with interrupts.deferred():` the context-manager form of enter/leave."""
    __slots__ = ("entered",)

    def __enter__(self) -> deferred:
        self.entered = enter()
        return self

    def __exit__(self, *exc: Any) -> None:
        leave(self.entered)


def _after_fork_in_child() -> None:
    global _main_ident, _depth, _pending
    _main_ident, _depth, _pending = threading.get_ident(), 0, None


os.register_at_fork(after_in_child=_after_fork_in_child)
