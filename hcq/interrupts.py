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
the signal delivered again a millisecond later (and again while a finalizer still runs, for up to 0.1 s: a finalizer
that hangs still takes a Ctrl-C), so it is raised after it.
Only the main thread ever receives KeyboardInterrupt, so sections on other threads cost one comparison. A
handler installed later replaces ours until the next section opens: `enter` puts ours back in front of it (one C call
to read the handler, about 40 ns, on the main thread only)."""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
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
_WEAKREF_FILE = os.path.splitext(os.path.abspath(weakref.__file__))[0] if weakref.__file__ else None
RESEND_S, RESEND_FOR_S = 0.001, 0.1  # an interrupt that lands in a finalizer comes again after RESEND_S, for up to RESEND_FOR_S
_resend_since: float | None = None  # when the interrupt now being sent again first landed in a finalizer
_resend_armed = False  # a resend is on its way (several presses meanwhile give one KeyboardInterrupt)
_resend_gen = 0  # bumped when an interrupt is raised: a resend still on its way for an earlier one is dropped


def _in_finalizer(frame: FrameType | None, depth: int = 12) -> bool:
    """Whether `frame` (or one of the `depth` frames it was called from) runs an hcq finalizer or a weakref.finalize."""
    while frame is not None and depth > 0:
        code = frame.f_code
        if code.co_name == "__del__" and code.co_filename.startswith(_HCQ_DIR): return True
        if code.co_name == "__call__" and os.path.splitext(code.co_filename)[0] == _WEAKREF_FILE: return True
        frame, depth = frame.f_back, depth - 1
    return False


def _resend(signum: int, gen: int) -> None:
    global _resend_armed
    if gen != _resend_gen or _main_ident is None: return
    _resend_armed = False
    signal.pthread_kill(_main_ident, signum)  # (a real signal, unlike _thread.interrupt_main, also ends a sleep)


def _defer_from_finalizer(signum: int, frame: FrameType | None) -> bool:
    """An interrupt that lands in a finalizer is sent again shortly, from another thread (tripping it from here would
    run the handler again at once), until it lands outside one; one that finalizers kept out for RESEND_FOR_S is raised
    where it lands. Whether it was deferred (else it is to be raised now, and a resend on its way is dropped)."""
    global _resend_since, _resend_armed, _resend_gen
    now = time.monotonic()
    if _in_finalizer(frame) and (_resend_since is None or now - _resend_since <= RESEND_FOR_S):
        if _resend_since is None: _resend_since = now
        if _resend_armed: return True
        _resend_armed = True  # (before the thread starts: a press while start() waits for it finds a resend armed)
        try:
            retry = threading.Timer(RESEND_S, _resend, (signum, _resend_gen))
            retry.daemon = True
            retry.start()
            return True
        except RuntimeError:  # (no thread can start: at interpreter exit)
            pass
    _resend_since, _resend_armed, _resend_gen = None, False, _resend_gen + 1
    return False


def _handler(signum: int, frame: FrameType | None) -> None:
    global _pending
    if _depth:
        _pending = (signum, frame)
        return
    if not _defer_from_finalizer(signum, frame): _call_wrapped(signum, frame)


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
        if not _defer_from_finalizer(signum, sys._getframe(1)): _call_wrapped(signum, frame)


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
    global _main_ident, _depth, _pending, _resend_since, _resend_armed
    _main_ident, _depth, _pending, _resend_since, _resend_armed = threading.get_ident(), 0, None, None, False


os.register_at_fork(after_in_child=_after_fork_in_child)
