"""Atomic operations on host memory that Python lacks, for the core's defaults (a signal's compare-and-swap): a few
C functions built on first use through hcq.toolchain and called through ctypes."""
from __future__ import annotations

import ctypes
import functools

from hcq.toolchain import build_shared_object

_SOURCE = r"""
#include <stdint.h>
// Compare-and-swap of the 64-bit word at p, sequentially consistent (a lock cmpxchg on x86, ldaxr/stlxr loops or
// casal on arm64): atomic against any other agent that updates the word atomically. Returns the value found.
uint64_t hcq_cas64(uint64_t *p, uint64_t expected, uint64_t desired) {
  __atomic_compare_exchange_n(p, &expected, desired, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
  return expected;
}
"""


@functools.lru_cache(maxsize=None)
def _lib() -> ctypes.CDLL:
    lib = ctypes.CDLL(str(build_shared_object(_SOURCE, ("-O2", "-std=c11"), "hcq-atomics")))
    lib.hcq_cas64.restype, lib.hcq_cas64.argtypes = ctypes.c_uint64, [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64]
    return lib


def cas64(addr: int, expected: int, desired: int) -> int:
    """Atomically store `desired` at the 8-byte-aligned host address `addr` if it holds `expected`; returns the value
    found there (== expected when the store happened)."""
    if addr % 8: raise ValueError(f"cas64 needs an 8-byte aligned address, got 0x{addr:x}")
    return int(_lib().hcq_cas64(addr, expected, desired))
