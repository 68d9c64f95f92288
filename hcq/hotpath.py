"""The optional CPython extension of the launch hot path (`hcq._hotpath`, built from hcq/_hotpath.c by the
package's build step). Where it is missing, or with HCQ_HOTPATH=0, hcq calls native code through ctypes."""
from __future__ import annotations

import importlib
from typing import Any, Callable

from hcq.helpers import getenv

_ext: Any = None
why_not = ""  # why the extension is not in use ("" when it is)
if getenv("HCQ_HOTPATH", 1) == 0:
    why_not = "disabled by HCQ_HOTPATH=0"
else:
    try:
        _ext = importlib.import_module("hcq._hotpath")
    except ImportError as e:  # not built: the ctypes path is the fallback
        why_not = f"not built ({e})"


def available() -> bool:
    """Whether the extension is in use."""
    return _ext is not None


def native_submitter(address: int) -> Callable[[Any, int, int, int], int] | None:
    """The native submit function at `address` (`int f(void *ring, const uint64_t *words, uint64_t n,
    int64_t timeout_ns)`) as a Python callable `f(ring, words_address, n, timeout_ns)`, or None without the
    extension."""
    return _ext.submitter(address) if _ext is not None else None
