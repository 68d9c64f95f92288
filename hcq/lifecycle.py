"""Process life-cycle hooks, as a leaf module: what must run at interpreter exit while devices still work
(e.g. writing a profile), then the devices' shutdown. Layers register here instead of importing the device."""
from __future__ import annotations

import atexit
import sys
from typing import Any, Callable

exit_hooks: list[Callable[[], None]] = []  # run at exit, before devices shut down (e.g. the profiler's trace)
shutdown_hooks: list[Callable[[], None]] = []  # then these (the devices stop their command processors)
close_hooks: list[Callable[[Any], None]] = []  # called with each device `dev.close()` closed (the registry forgets it)
_registered = False


def run_exit_hooks() -> None:
    """Run (once) what must happen at exit while devices still work."""
    while exit_hooks:
        hook = exit_hooks.pop(0)
        try:
            hook()
        except Exception as e:  # noqa: BLE001 - report and go on shutting down
            print(f"hcq: exit hook {getattr(hook, '__name__', hook)} failed: {type(e).__name__}: {e}", file=sys.stderr)


def _at_exit() -> None:
    run_exit_hooks()
    while shutdown_hooks: shutdown_hooks.pop(0)()


def register() -> None:
    """Register the exit handler (once). Called when the first device opens, after the backends' imports, so it
    runs before their own atexit handlers; also callable earlier (the profiler does, for processes that open no device)."""
    global _registered
    if not _registered:
        atexit.register(_at_exit)
        _registered = True
