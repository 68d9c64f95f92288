"""The kernargs ring of fast launches: a wrapping bump allocator whose blocks are never handed out again while an
unfinished submission still reads them. How a block is taken is defined once, in C (hcq/timeline_ring.h), and run
from here and from the hot-path extension's launches alike; without the extension, through ctypes and a small
library built on first use."""
from __future__ import annotations

import ctypes
import functools
from array import array
from pathlib import Path
from typing import Callable

from hcq import hotpath
from hcq.toolchain import build_shared_object, inline_include

HEADER = Path(__file__).with_name("timeline_ring.h")
NEVER_FITS, WAIT = -1, -2  # the header's HCQ_TIMELINE_RING_NEVER_FITS and HCQ_TIMELINE_RING_WAIT (tests/test_signals.py)

_SOURCE = ('#include "timeline_ring.h"\n'
           'int64_t hcq_timeline_ring_take_at(int64_t *state, int64_t *tags, int64_t ntags, int64_t ring_size, int64_t seg_size,\n'
           '                                  int64_t *need, int64_t size, int64_t tag, int64_t alignment, int64_t waited) {\n'
           '  return hcq_timeline_ring_take(state, tags, ntags, ring_size, seg_size, size, tag, alignment, waited, need);\n'
           '}\n')

# take(state address, tags address, ntags, ring size, segment size, need address, size, tag, alignment, waited) -> offset,
# WAIT (first wait for the tag stored at `need`) or NEVER_FITS: hcq_timeline_ring_take on a ring's arrays
Take = Callable[[int, int, int, int, int, int, int, int, int, int], int]


@functools.lru_cache(maxsize=None)
def _ctypes_take() -> Take:
    # PyDLL: the GIL stays held, so one take is whole with respect to other threads' (as the extension's is)
    lib = ctypes.PyDLL(str(build_shared_object(inline_include(_SOURCE, "timeline_ring.h", HEADER.read_text(), "timeline_ring.c"),
                                               ("-O2", "-std=c11"), "hcq-timeline-ring")))
    fn = lib.hcq_timeline_ring_take_at
    fn.restype, fn.argtypes = ctypes.c_int64, [ctypes.c_void_p, ctypes.c_void_p, *[ctypes.c_int64] * 3, ctypes.c_void_p, *[ctypes.c_int64] * 4]
    return fn


def take_function() -> Take:
    """The extension's run of hcq_timeline_ring_take, or the ctypes one."""
    return hotpath.timeline_ring_take_function() or _ctypes_take()


class TimelineRing:
    """A wrapping bump allocator over `size` bytes that never hands out bytes an unfinished submission
    still reads. The ring is cut into segments; each remembers the newest tag (the timeline value of the
    submission that will read it) of what was handed out in it, and entering a segment again on a later
    lap first waits for that tag. Tags must not decrease.

    Its state lives in two arrays that hcq/timeline_ring.h's take advances in place (for `alloc` and for the native
    launches, which take their blocks without calling `alloc` unless a wait is due): `state` is (head, current segment,
    end of the current segment, lap) and `seg_tags` the segments' tags. Neither is ever rebound or resized."""
    ALIGNMENT = 16  # of a block, unless `alloc` is told otherwise (the native launches take it from here)

    def __init__(self, size: int, wait_tag: Callable[[int], None], segments: int = 256):
        if size <= 0 or segments <= 0: raise ValueError(f"a timeline ring needs a positive size and segment count, not {size} and {segments}")
        self.size, self._wait_tag = size, wait_tag
        self.seg_size = max(1, -(-size // segments))
        self.seg_tags = array("q", bytes(8 * -(-size // self.seg_size)))
        self.state = array("q", [0, 0, min(size, self.seg_size), 0])
        self._need = array("q", [0])
        self._take: Take | None = None  # (found at the first alloc: without the extension that builds a library)
        self._where = (self.state.buffer_info()[0], self.seg_tags.buffer_info()[0], len(self.seg_tags), size, self.seg_size,
                       self._need.buffer_info()[0])

    @property
    def head(self) -> int:
        """Where the next block is looked for (bytes)."""
        return self.state[0]

    @property
    def cur_seg(self) -> int:
        """The segment the head is in."""
        return self.state[1]

    @property
    def lap(self) -> int:
        """How often the ring wrapped."""
        return self.state[3]

    def alloc(self, size: int, tag: int, alignment: int = ALIGNMENT) -> int:
        """Offset of `size` free bytes, to be read by the submission that signals timeline value `tag`. Entering segments
        used on the previous lap first waits for their readers (nothing changes if that raises)."""
        if (size | alignment | tag) >> 63: start = NEVER_FITS  # (negative, or past the C take's int64: ctypes would wrap it)
        else:
            take, waited = self._take or self._find_take(), 0
            while (start := take(*self._where, size, tag, alignment, waited)) == WAIT:
                waited = self._need[0]
                self._wait_tag(waited)
        if start == NEVER_FITS:
            raise ValueError(f"cannot allocate {size} bytes aligned to {alignment} for tag {tag} from a {self.size}-byte ring")
        return start

    def _find_take(self) -> Take:
        self._take = take_function()
        return self._take

    def retag(self, start: int, size: int, lap: int, tag: int) -> bool:
        """Let the block handed out at `start` on lap `lap` be read again by the submission with `tag`.
        False when the ring has re-entered its segments since (its bytes may have been handed out again)."""
        first, last = start // self.seg_size, (start + size - 1) // self.seg_size
        now_lap, cur = self.state[3], self.state[1]
        if not (lap == now_lap or (lap == now_lap - 1 and first > cur)): return False
        tags = self.seg_tags
        for s in range(first, last + 1):
            if tags[s] < tag: tags[s] = tag
        return True

    def reset_tags(self) -> None:
        """Forget all tags (after a timeline wrap everything handed out has finished)."""
        self.seg_tags[:] = array("q", bytes(8 * len(self.seg_tags)))
