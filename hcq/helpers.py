"""Small shared helpers: environment lookup and rounding."""
from __future__ import annotations

import os
from typing import TypeVar

T = TypeVar("T", int, str, float)


def getenv(key: str, default: T) -> T:
    """Environment variable `key` converted to the type of `default`; a bad value raises naming the variable."""
    raw = os.environ.get(key)
    if raw is None or raw == "": return default
    try:
        return type(default)(raw)
    except ValueError:
        raise ValueError(f"environment variable {key}={raw!r} is not a valid {type(default).__name__}") from None


def round_up(x: int, a: int) -> int:
    return (x + a - 1) // a * a


def wait_timeout_ms() -> int:
    """HCQDEV_WAIT_TIMEOUT_MS (default 30000): how long a wait may go without progress."""
    value = getenv("HCQDEV_WAIT_TIMEOUT_MS", 30000)
    if value < 0: raise ValueError(f"environment variable HCQDEV_WAIT_TIMEOUT_MS={value} must be >= 0")
    return value
