"""A GPFIFO channel as the host drives it: submissions are copied into a pushbuffer ring in GPU memory, a GPFIFO
entry pointing at them is written, GP_PUT in the channel's USERD is advanced and the doorbell is rung with the
channel's work-submit token. Pushbuffer space and GPFIFO entries are reused only once the GPU is past them (the
ring fence of the submission that used them, and GP_GET)."""
from __future__ import annotations

import collections
import time
from array import array
from typing import Any, Callable, Sequence

from hcq.backends.nv import abi
from hcq.errors import HCQTimeoutError
from hcq.lifetimes import Ring
from hcq.memory import HCQBuffer
from hcq.symbolic import sint

GP_ENTRY_BYTES = 8


class Channel:
    """One channel: `entries` GPFIFO entries at `gpfifo` (host view 'Q'), GP_PUT/GP_GET words in USERD, and
    `pushbuffer` (host-visible GPU memory) for the words of unbound submissions."""

    def __init__(self, name: str, h: Any, gpfifo: HCQBuffer, entries: int, userd: HCQBuffer, pushbuffer: HCQBuffer, token: int,
                 doorbell: Callable[[int], None], check_error: Callable[[str], None]):
        self.name, self.h, self.entries, self.token = name, h, entries, token
        self.doorbell, self.check_error = doorbell, check_error
        view = gpfifo.cpu_view()
        self.ring = view.view(0, entries * GP_ENTRY_BYTES, "Q")
        control = h.AmpereAControlGPFifo
        self.gp_put = userd.cpu_view().view(control.GPPut.offset, 4, "I")
        self.gp_get = userd.cpu_view().view(control.GPGet.offset, 4, "I")
        self.pushbuffer, self.pb_words = pushbuffer, pushbuffer.size // 4
        self.pb_base = int(pushbuffer.va_addr)
        self.pb_view = pushbuffer.cpu_view().view(0, pushbuffer.size, "I")
        self.pb_head = 0  # next free word of the pushbuffer ring
        self.put = 0  # GPFIFO entries written
        self.pb_inflight: collections.deque[tuple[int, int, Ring, int]] = collections.deque()  # (start word, end word, ring, fence)
        self.entry_shift = abi.field(h, "NVC56F_GP_ENTRY1_LENGTH")[1]
        self.get_hi_mask = (1 << (abi.field(h, "NVC56F_GP_ENTRY1_GET_HI")[0] + 1)) - 1
        self.max_segment_words = (1 << (abi.field(h, "NVC56F_GP_ENTRY1_LENGTH")[0] - self.entry_shift + 1)) - 1

    def entry(self, address: int, nwords: int) -> int:
        """The 8-byte GPFIFO entry of a pushbuffer segment."""
        if address % 4: raise ValueError(f"a pushbuffer segment must be 4-byte aligned, got 0x{address:x}")
        if not 0 < nwords <= self.max_segment_words: raise ValueError(f"a pushbuffer segment holds 1 to {self.max_segment_words} words, got {nwords}")
        lo = address & 0xFFFFFFFC  # GP_ENTRY0_GET is address bits 31:2 in place
        hi = ((address >> 32) & self.get_hi_mask) | (nwords << self.entry_shift)  # (LEVEL_MAIN, SYNC_PROCEED: 0)
        return lo | (hi << 32)

    def submit(self, words: Sequence[sint], ring: Ring, fence: int, bound: tuple[int, int] | None = None) -> None:
        """Publish one submission: `bound` (address, words) of a bound queue's words first, if given, then `words`
        (copied into the pushbuffer); the last of them signal `ring`'s fence to `fence`."""
        segments = []
        if bound is not None:
            for off in range(0, bound[1], self.max_segment_words):
                segments.append((bound[0] + 4 * off, min(self.max_segment_words, bound[1] - off)))
        at = self._reserve(len(words))
        self.pb_view[at:at + len(words)] = array("I", words)
        segments.append((self.pb_base + 4 * at, len(words)))
        self.pb_inflight.append((at, at + len(words), ring, fence))
        for addr, n in segments:
            self._wait_entry()
            self.ring[self.put % self.entries] = self.entry(addr, n)
            self.put += 1
        # x86 keeps these stores in order: the pushbuffer words and entries are visible before GP_PUT, and GP_PUT before
        # the doorbell (an uncached MMIO store on hardware)
        self.gp_put[0] = self.put % self.entries
        self.doorbell(self.token)

    def _reserve(self, n: int) -> int:
        """The start word of `n` free pushbuffer words (waiting for the GPU to be past them)."""
        if n > self.pb_words: raise ValueError(f"{self.name}: a submission of {n} words exceeds the pushbuffer's {self.pb_words} (bind the queue)")
        at = self.pb_head if self.pb_head + n <= self.pb_words else 0
        while self.pb_inflight:
            start, end, ring, fence = self.pb_inflight[0]
            overlaps = start < at + n and at < end
            if ring.fence.load() >= fence: self.pb_inflight.popleft()
            elif overlaps: self._wait(lambda: ring.fence.load() >= fence, f"pushbuffer words {start}..{end} (fence {fence} of the {ring.name})")
            else: break
        self.pb_head = at + n
        return at

    def _wait_entry(self) -> None:
        """Wait until the GPU has fetched the GPFIFO entry that the next one would overwrite."""
        if self.put - self._fetched() < self.entries - 1: return
        self._wait(lambda: self.put - self._fetched() < self.entries - 1, f"a free GPFIFO entry ({self.entries} in flight)")

    def _fetched(self) -> int:
        """GPFIFO entries the GPU has fetched so far (GP_GET, unwrapped against what was put)."""
        get = self.gp_get[0] % self.entries
        return self.put - ((self.put - get) % self.entries)

    def _wait(self, done: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not done():
            self.check_error(f"waiting for {what} on {self.name}")
            if time.monotonic() > deadline: raise HCQTimeoutError(f"{self.name}: the GPU did not get past {what} in {timeout_s:.0f} s")
            time.sleep(0.0001)
