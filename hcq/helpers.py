"""Small shared helpers: environment lookup, rounding, and what counts as an integer or a real number."""
from __future__ import annotations

import math
import numbers
import operator
import os
import signal
import subprocess
from typing import TypeVar

T = TypeVar("T", int, str, float)


def getenv(key: str, default: T, lo: float | None = None, hi: float | None = None) -> T:
    """Environment variable `key` (unset or empty: `default`) converted to the type of `default`. Every hcq setting is
    read through here: a value that does not convert, a float that is not finite, or a number outside [lo, hi] raises
    ValueError naming the variable and its value."""
    raw = os.environ.get(key)
    if raw is None or raw == "": return default
    try:
        value = type(default)(raw)
    except ValueError:
        raise ValueError(f"environment variable {key}={raw!r} is not a valid {type(default).__name__}") from None
    if isinstance(value, float) and not math.isfinite(value): raise ValueError(f"environment variable {key}={raw!r} is not a finite number")
    if isinstance(value, (int, float)) and ((lo is not None and value < lo) or (hi is not None and value > hi)):
        want = f"in [{lo}, {hi}]" if lo is not None and hi is not None else f">= {lo}" if lo is not None else f"<= {hi}"
        raise ValueError(f"environment variable {key}={raw!r} must be {want}")
    return value


def env_flag(key: str, default: bool) -> bool:
    """A 0/1 switch from the environment (unset or empty: `default`); any other value raises ValueError naming it."""
    return getenv(key, int(default), 0, 1) == 1


def round_up(x: int, a: int) -> int:
    return (x + a - 1) // a * a


def wait_timeout_ms() -> int:
    """HCQDEV_WAIT_TIMEOUT_MS (default 30000): how long a wait may go without progress."""
    return getenv("HCQDEV_WAIT_TIMEOUT_MS", 30000, lo=0)


def as_integer(v: object) -> int | None:
    """`v` as an int if it is an integer: an int or an integral number type (numpy's integers), never a bool (True is
    not a count). None for anything else, including an integral type whose `__index__` fails."""
    if type(v) is int: return v
    if isinstance(v, bool) or not isinstance(v, numbers.Integral): return None
    try:
        return operator.index(v)
    except Exception:  # noqa: BLE001 - refused as "not an integer" by the caller, which names the parameter
        return None


def as_real(v: object) -> int | float | None:
    """`v` as a Python number if it is a real number (int, float, numpy's), never a bool; else None."""
    if type(v) is int or type(v) is float: return v
    if isinstance(v, bool) or not isinstance(v, numbers.Real): return None
    if (i := as_integer(v)) is not None: return i
    try:
        return float(v)
    except Exception:  # noqa: BLE001 - as above
        return None


def kill_process_group(proc: subprocess.Popen, wait_s: float | None = None) -> None:
    """SIGKILL the process group that `proc` leads (its children too) and reap `proc`, waiting up to `wait_s` seconds
    (None: as long as it takes; past `wait_s` subprocess reaps it later)."""
    if proc.returncode is None:  # not reaped yet, so the group id is still this process's
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        proc.wait(timeout=wait_s)
    except subprocess.TimeoutExpired:
        pass
