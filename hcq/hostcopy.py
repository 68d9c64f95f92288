"""Copies between host buffers that the host does itself (the allocator's direct and staged copies), through
hcq/hostcopy.h's hcq_host_copy: memmove, save where libc's memmove would crawl on a 4K-aliased pair of buffers
(a copy out of page-aligned device memory into a numpy array, on CPUs whose libc uses `rep movsb`; see the header).
The hot-path extension runs it without a Python-level address lookup; without the extension, copies large enough
to be hit go through ctypes and a small library built on first use."""
from __future__ import annotations

import ctypes
import functools
from pathlib import Path
from typing import Callable

from hcq import hotpath
from hcq.memory import host_address
from hcq.toolchain import build_shared_object, inline_include

HEADER = Path(__file__).with_name("hostcopy.h")
ALIAS_MIN_BYTES = 1024  # as hostcopy.h's HCQ_ALIAS_MIN_BYTES: smaller copies are plain slice assignments

_SOURCE = '#include "hostcopy.h"\nvoid hcq_copy_bytes(void *dst, const void *src, size_t n) { hcq_host_copy(dst, src, n); }\n'


@functools.lru_cache(maxsize=None)
def _lib() -> ctypes.CDLL:
    lib = ctypes.CDLL(str(build_shared_object(inline_include(_SOURCE, "hostcopy.h", HEADER.read_text(), "hostcopy.c"),
                                              ("-O2", "-std=c11"), "hcq-hostcopy")))
    lib.hcq_copy_bytes.restype, lib.hcq_copy_bytes.argtypes = None, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    return lib


def _copy_ctypes(dst: memoryview, src: memoryview) -> None:
    if dst.nbytes != src.nbytes: raise ValueError(f"host copy: {src.nbytes} bytes do not fit {dst.nbytes}")
    if dst.nbytes < ALIAS_MIN_BYTES:
        dst[:] = src
        return
    if dst.readonly: raise TypeError("host copy: the destination is read-only")
    (d, n, keep_d), (s, _, keep_s) = host_address(dst), host_address(src)
    _lib().hcq_copy_bytes(d, s, n)
    del keep_d, keep_s


# copy_bytes(dst, src): copy the flat byte buffer `src` into `dst`, of the same length (memmove semantics).
copy_bytes: Callable[[memoryview, memoryview], None] = hotpath.host_copy_function() or _copy_ctypes
