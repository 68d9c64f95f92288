"""The producer side of a submission ring (room, copy-in, publish) has one definition, hcq/ring.h: cp.c and vk.c take
it from there (inlined at build, so the build cache keys on it) and restate none of it; and its rules mean what they
say."""
import ctypes
import pathlib
import re

import hcq
from hcq import packets
from hcq.backends.cpu import native as cpu_native
from hcq.backends.vk import native as vk_native

ROOT = pathlib.Path(hcq.__file__).parent
SOURCES = {"cp.c": ROOT / "backends" / "cpu" / "cp.c", "vk.c": ROOT / "backends" / "vk" / "vk.c"}
HELPERS = ("hcq_ring_too_big", "hcq_ring_own_wptr", "hcq_ring_rptr", "hcq_ring_fits", "hcq_ring_copy_in", "hcq_ring_publish")


def test_c_files_restate_no_rule_of_the_ring_producer():
    """Neither C file copies words into its ring at a masked index, stores its write pointer, sizes the room or refuses
    an oversized submission itself: each includes ring.h (once) and calls its helpers."""
    for name, path in SOURCES.items():
        text = path.read_text()
        assert len(re.findall(r'^#include "ring\.h"', text, re.M)) == 1, f"{name} must include ring.h once"
        assert not re.search(r"\[\s*\(\s*\w+\s*\+\s*\w+\s*\)\s*&[^\]]*\]\s*=\s*\w+\[", text), \
            f"{name} copies words into its ring itself (use hcq_ring_copy_in)"
        assert not re.search(r"atomic_(store|exchange)(_explicit)?\s*\(\s*&\s*\w+->wptr\b", text), \
            f"{name} stores its write pointer itself (use hcq_ring_publish)"
        assert not re.search(r"\bn\s*>\s*(\w+->)?cap\b|->cap\s*-\s*\(\s*\w+\s*-|\+\s*n\s*-\s*cap\b", text), \
            f"{name} restates the ring's room (use hcq_ring_too_big / hcq_ring_fits / hcq_ring_rptr_needed)"
        for helper in HELPERS: assert helper + "(" in text, f"{name} does not use {helper}"
        assert not re.search(r"static\s+inline\s+\w+\s+hcq_ring_", text), f"{name} defines a ring.h helper itself"


def test_ring_header_is_inlined_into_both_builds():
    """The built sources carry ring.h's text (so a change to it changes the build cache key) and no include line."""
    header = packets.RING_HEADER.read_text()
    assert packets.RING_HEADER == ROOT / "ring.h"
    for source in (cpu_native.cp_source(), vk_native.vk_source()):
        assert header.rstrip() in source
        assert not re.search(r'^#include "ring\.h"', source, re.M)


def test_the_ring_rules_mean_what_they_say():
    """hcq_ring_fits / hcq_ring_rptr_needed agree, at the edges of a full ring, and copy-in wraps at the mask."""
    from hcq.toolchain import build_shared_object
    src = packets.RING_HEADER.read_text() + """
int fits(uint64_t cap, uint64_t w, uint64_t r, uint64_t n) { return hcq_ring_fits(cap, w, r, n); }
int too_big(uint64_t cap, uint64_t n) { return hcq_ring_too_big(cap, n); }
uint64_t needed(uint64_t cap, uint64_t w, uint64_t n) { return hcq_ring_rptr_needed(cap, w, n); }
uint64_t put(uint64_t *ring, uint64_t mask, uint64_t w, const uint64_t *words, uint64_t n) {
  _Atomic uint64_t wptr = w;
  hcq_ring_copy_in(ring, mask, hcq_ring_own_wptr(&wptr), words, n);
  hcq_ring_publish(&wptr, w + n);
  return hcq_ring_own_wptr(&wptr);
}
"""
    lib = ctypes.CDLL(str(build_shared_object(src, ("-O2", "-std=c11"), "hcq-ring-rule-test")))
    u64 = ctypes.c_uint64
    lib.fits.restype, lib.fits.argtypes = ctypes.c_int, [u64] * 4
    lib.too_big.restype, lib.too_big.argtypes = ctypes.c_int, [u64] * 2
    lib.needed.restype, lib.needed.argtypes = u64, [u64] * 3
    lib.put.restype, lib.put.argtypes = u64, [ctypes.c_void_p, u64, u64, ctypes.c_void_p, u64]
    cap = 16
    assert lib.too_big(cap, cap + 1) and not lib.too_big(cap, cap) and not lib.too_big(cap, 0)
    for base in (0, 5, 2**40 + 3):
        for used in range(cap + 1):
            w, r = base + used, base
            for n in range(cap + 1):
                assert bool(lib.fits(cap, w, r, n)) == (used + n <= cap), (w, r, n)
                if used + n > cap:  # waiting: rptr must reach needed(), and then it fits, one word short it does not
                    need = lib.needed(cap, w, n)
                    assert lib.fits(cap, w, need, n) and not lib.fits(cap, w, need - 1, n)
    ring = (u64 * cap)(*([0xAA] * cap))
    words = (u64 * 6)(*range(1, 7))
    assert lib.put(ring, cap - 1, 13, words, 6) == 19
    assert list(ring) == [4, 5, 6] + [0xAA] * 10 + [1, 2, 3]
