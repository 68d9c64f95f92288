"""Exceptions raised by hcq. Every one names what went wrong and, where it applies, what was waited for."""
from __future__ import annotations


class HCQError(RuntimeError):
    """Base class of hcq's runtime errors."""


class HCQTimeoutError(HCQError):
    """A wait made no progress for the whole timeout."""


class DeviceError(HCQError):
    """The device (its command processor) failed; the failure is sticky: every later wait and submission raises it until
    `dev.recover()` clears it (a remote device whose server was lost is reopened with `hcq.Device(name)` instead)."""


class QueueKindError(HCQError, TypeError):
    """A command was put on a queue kind that cannot run it (exec on a copy queue, copy on a compute queue)."""


class CompileError(HCQError):
    """A kernel failed to compile; the message carries the compiler's output."""


class WaitInterrupted(HCQError):
    """A wait inside a critical section was ended by a Ctrl-C (the section raises KeyboardInterrupt when it closes)."""
