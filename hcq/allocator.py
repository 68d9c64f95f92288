"""`HCQAllocator`: allocation with an LRU cache of freed buffers, and every copy path built from queues:
copyin / copyout (direct where the copy engine reaches host memory, else through a staging ring of
`batch_cnt` x `batch_size` buffers), transfers between devices of a peer group, mappings, and reading a
file region into a buffer through the staging ring. Backends implement `_alloc`, `_free`, `_map_into`."""
from __future__ import annotations

import bisect
import os
from collections import defaultdict
from typing import TYPE_CHECKING, Generic, TypeVar

from hcq import profiler, recorder
from hcq.errors import HCQError
from hcq.helpers import getenv
from hcq.memory import BufferSpec, HCQBuffer, host_address, iter_chunks
from hcq.queue import HWQueue
from hcq.symbolic import sint

if TYPE_CHECKING:
    from hcq.device import HCQCompiled

DeviceType = TypeVar("DeviceType", bound="HCQCompiled")


def _timed_copy(q: HWQueue, dev: HCQCompiled, dest: sint, src: sint, nbytes: sint, name: str) -> HWQueue:
    """q.copy(...), bracketed by timestamps and reported to the profiler when one is collecting."""
    prof = profiler.active
    if prof is None: return q.copy(dest, src, nbytes)
    st, en = dev.new_signal(), dev.new_signal()
    q.timestamp(st).copy(dest, src, nbytes).timestamp(en)
    prof.device_event("copy", name, dev, ("copy", getattr(q, "queue_idx", 0)), st, en, nbytes=nbytes if isinstance(nbytes, int) else None)
    return q


def _refuse_capture(what: str) -> None:
    if recorder.active() is not None:
        raise HCQError(f"{what} cannot be captured into a graph (the host memory would not be there at replay); do them outside the capture")


class HCQAllocator(Generic[DeviceType]):
    """Allocator of an HCQ device. `alloc`/`free` go through an LRU cache unless `BufferSpec(nolru=True)`
    or `HCQ_LRU=0`; copies are queue submissions ordered by the device timeline."""

    def __init__(self, dev: DeviceType, batch_size: int = 2 << 20, batch_cnt: int = 32, copy_bufs: list[HCQBuffer] | None = None,
                 max_copyout_size: int | None = None):
        self.dev, self.batch_size, self.batch_cnt, self.max_copyout_size = dev, batch_size, batch_cnt, max_copyout_size
        self._b: list[HCQBuffer] | None = copy_bufs
        self.b_timeline = [0] * (len(copy_bufs) if copy_bufs else batch_cnt)
        self.b_next = 0
        self.cache: dict[tuple[int, BufferSpec], list[HCQBuffer]] = defaultdict(list)
        self.lru = getenv("HCQ_LRU", 1) != 0
        self._host_ranges: list[tuple[int, int]] = []  # host memory lent to in-flight direct copies (for validation)
        self._starts: list[int] = []  # sorted start addresses of mapped allocations, parallel to _live
        self._live: list[HCQBuffer] = []

    # ---- allocation
    def alloc(self, size: int, options: BufferSpec | None = None) -> HCQBuffer:
        """`size` bytes of device memory as an HCQBuffer."""
        if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
            raise ValueError(f"allocation size must be a positive int, got {size!r}")
        options = options if options is not None else BufferSpec()
        if not isinstance(options, BufferSpec): raise TypeError(f"options must be a BufferSpec, got {type(options).__name__}")
        if self.lru and not options.nolru and (cached := self.cache.get((size, options))):
            buf = cached.pop()
            buf._freed = False
            return buf
        try:
            buf = self._alloc(size, options)
        except MemoryError:
            self.free_cache()
            buf = self._alloc(size, options)
        buf.owner = self.dev
        buf._mappings[self.dev] = buf
        if isinstance(buf.va_addr, int):
            i = bisect.bisect_left(self._starts, buf.va_addr)
            self._starts.insert(i, buf.va_addr)
            self._live.insert(i, buf)
        return buf

    def owns_host_range(self, addr: int, size: int) -> bool:
        """Whether [addr, addr + size) is host memory a direct copy of this allocator is using right now."""
        return any(a <= addr and addr + size <= a + n for a, n in self._host_ranges)

    def owns(self, addr: int, size: int = 1) -> HCQBuffer | None:
        """The mapped allocation of this device holding [addr, addr + size), if any (LRU-cached ones count)."""
        i = bisect.bisect_right(self._starts, addr) - 1
        if i >= 0 and addr + size <= self._starts[i] + self._live[i].size: return self._live[i]
        return None

    def free(self, buf: HCQBuffer, size: int, options: BufferSpec | None = None) -> None:
        """Free `buf` (allocated with the same `size` and `options`)."""
        options = options if options is not None else BufferSpec()
        if buf._base is not None: raise ValueError(f"{buf!r} is a view; free the allocation it came from")
        if buf._freed: raise ValueError(f"{buf!r} was already freed")
        if size != buf.size: raise ValueError(f"free of {buf!r} with size {size}, but it was allocated with {buf.size}")
        buf._freed = True
        if self.lru and not options.nolru:
            self.cache[(size, options)].append(buf)
            return
        self._free_now(buf, options)

    def free_cache(self) -> None:
        """Release every buffer the LRU cache holds."""
        for (_, options), bufs in self.cache.items():
            for buf in bufs: self._free_now(buf, options)
        self.cache.clear()

    def _free_now(self, buf: HCQBuffer, options: BufferSpec) -> None:
        self._wait_unused(buf)
        self._free(buf, options)
        if isinstance(buf.va_addr, int) and (i := bisect.bisect_left(self._starts, buf.va_addr)) < len(self._starts) and self._live[i] is buf:
            del self._starts[i], self._live[i]

    def _wait_unused(self, buf: HCQBuffer) -> None:
        """Before `_free`: nothing submitted may still use `buf`. Backends that defer the release override it."""
        for dev in buf.mapped_devs: dev.synchronize()

    def _alloc(self, size: int, options: BufferSpec) -> HCQBuffer:
        raise NotImplementedError

    def _free(self, buf: HCQBuffer, options: BufferSpec) -> None:
        raise NotImplementedError

    def _map_into(self, buf: HCQBuffer) -> HCQBuffer:
        """Backends: make `buf` (of another device of the peer group) reachable by this device."""
        raise NotImplementedError(f"{type(self).__name__} cannot map buffers of other devices")

    def _host_copy_address(self, host_addr: int, nbytes: int) -> int | None:
        """Backends: the device address at which this device's copy engine reads/writes the given host
        memory directly, or None (copies then go through the staging ring)."""
        return None

    def _map(self, buf: HCQBuffer) -> None:
        """Make `buf` reachable by this device (a no-op once done; mappings are shared by views)."""
        if self.dev not in buf.mappings: buf.base._mappings[self.dev] = self._map_into(buf.base)

    map = _map  # the seeds' name

    # ---- staging ring
    @property
    def b(self) -> list[HCQBuffer]:
        """The staging buffers (allocated on first use)."""
        if self._b is None:
            self._b = [self.alloc(self.batch_size, BufferSpec(host=True, cpu_access=True, nolru=True)) for _ in range(self.batch_cnt)]
        return self._b

    def _next_staging(self) -> HCQBuffer:
        """The next staging buffer, once the submission that last used it finished."""
        idx = self.b_next
        self.dev.timeline_signal.wait(self.b_timeline[idx])
        self.b_next = (idx + 1) % len(self.b)
        return self.b[idx]

    def _submit_copy(self, dest: int, src: int, nbytes: int, name: str = "copy") -> int:
        """Copy on the copy queue after all earlier work; returns the timeline value that marks it done."""
        dev = self.dev
        q = dev.hw_copy_queue_t().wait(dev.timeline_signal, dev.timeline_value - 1)
        _timed_copy(q, dev, dest, src, nbytes, name).signal(dev.timeline_signal, dev.timeline_value).submit(dev)
        return dev.next_timeline()

    def _direct_copy(self, dest: int, src: int, nbytes: int, name: str) -> None:
        """A copy between device memory and host memory the copy engine reaches directly; returns when done
        (the host memory is only lent for the copy)."""
        host = (src if name == "copyin" else dest, nbytes)
        self._host_ranges.append(host)
        try:
            self.dev.timeline_signal.wait(self._submit_copy(dest, src, nbytes, name))
        finally:
            self._host_ranges.remove(host)

    def _check_size(self, what: str, nbytes: int, buf: HCQBuffer) -> None:
        if buf.freed: raise ValueError(f"{what}: {buf!r} was freed")
        if nbytes > buf.size: raise ValueError(f"{what}: {nbytes} bytes do not fit in {buf!r} ({buf.size} bytes)")

    # ---- copies
    @profiler.traced("copyin")
    def _copyin(self, dest: HCQBuffer, src: memoryview) -> None:
        """Copy host memory `src` into `dest` (after earlier work on the device)."""
        _refuse_capture("host copies")
        addr, nbytes, keep = host_address(src)
        self._check_size("copyin", nbytes, dest)
        if nbytes == 0: return
        if self.dev.hw_copy_queue_t is None:
            self.dev.synchronize()
            dest.cpu_view().view(0, nbytes)[:] = memoryview(src).cast("B")
        elif (dev_addr := self._host_copy_address(addr, nbytes)) is not None:
            self._direct_copy(dest.va_addr, dev_addr, nbytes, "copyin")
        else:
            self._copyin_staged(dest, memoryview(src).cast("B"))
        del keep

    def _copyin_staged(self, dest: HCQBuffer, src: memoryview) -> None:
        for off, size in iter_chunks(src.nbytes, self.batch_size):
            idx = self.b_next
            stage = self._next_staging()
            stage.cpu_view().view(0, size)[:] = src[off:off + size]
            self.b_timeline[idx] = self._submit_copy(dest.va_addr + off, stage.va_addr, size, "copyin (staged)")

    @profiler.traced("copyout")
    def _copyout(self, dest: memoryview, src: HCQBuffer) -> None:
        """Copy `src` into host memory `dest` once all earlier work on the device finished."""
        _refuse_capture("host copies")
        addr, nbytes, keep = host_address(dest)
        if memoryview(dest).readonly: raise ValueError("copyout destination is read-only")
        self._check_size("copyout", nbytes, src)
        if nbytes == 0: return
        self.dev.synchronize()
        if self.dev.hw_copy_queue_t is None:
            memoryview(dest).cast("B")[:] = src.cpu_view().view(0, nbytes).mv
        elif (dev_addr := self._host_copy_address(addr, nbytes)) is not None:
            self._direct_copy(dev_addr, src.va_addr, nbytes, "copyout")
        else:
            self._copyout_staged(memoryview(dest).cast("B"), src)
        del keep

    def _copyout_staged(self, dest: memoryview, src: HCQBuffer) -> None:
        chunk = min(self.batch_size, self.max_copyout_size or self.batch_size)
        inflight: list[tuple[int, int, HCQBuffer, int]] = []
        for off, size in iter_chunks(dest.nbytes, chunk):  # keep the copy engine ahead of the host's reads
            idx = self.b_next
            stage = self._next_staging()
            self.b_timeline[idx] = done = self._submit_copy(stage.va_addr, src.va_addr + off, size, "copyout (staged)")
            inflight.append((off, size, stage, done))
            if len(inflight) == len(self.b): self._drain_one(dest, inflight)
        while inflight: self._drain_one(dest, inflight)

    def _drain_one(self, dest: memoryview, inflight: list[tuple[int, int, HCQBuffer, int]]) -> None:
        off, size, stage, done = inflight.pop(0)
        self.dev.timeline_signal.wait(done)
        dest[off:off + size] = stage.cpu_view().view(0, size).mv

    @profiler.traced("transfer")
    def _transfer(self, dest: HCQBuffer, src: HCQBuffer, sz: int, src_dev: HCQCompiled, dest_dev: HCQCompiled) -> None:
        """Copy `sz` bytes from `src` (on src_dev) to `dest` (on dest_dev) with src_dev's copy engine, ordered
        after earlier work on both devices; later work on dest_dev waits for it."""
        if (rec := recorder.active()) is not None:
            rec.on_copy(dest, src, sz)
            return
        if src_dev.peer_group != dest_dev.peer_group:
            raise ValueError(f"transfer between peer groups {src_dev.peer_group!r} and {dest_dev.peer_group!r} is not supported")
        self._check_size("transfer destination", sz, dest)
        self._check_size("transfer source", sz, src)
        src_dev.allocator._map(dest)
        dest_dev.allocator._map(src)
        if src_dev.hw_copy_queue_t is None: raise ValueError(f"{src_dev.device} has no copy queue for transfers")
        q = src_dev.hw_copy_queue_t().wait(src_dev.timeline_signal, src_dev.timeline_value - 1) \
            .wait(dest_dev.timeline_signal, dest_dev.timeline_value - 1)
        _timed_copy(q, src_dev, dest.va_addr, src.va_addr, sz, f"transfer {src_dev.device}->{dest_dev.device}") \
            .signal(src_dev.timeline_signal, src_dev.timeline_value).submit(src_dev)
        src_dev.next_timeline()
        dest_dev.hw_compute_queue_t().wait(src_dev.timeline_signal, src_dev.timeline_value - 1) \
            .signal(dest_dev.timeline_signal, dest_dev.timeline_value).submit(dest_dev)
        dest_dev.next_timeline()

    @profiler.traced("copy_from_disk")
    def copy_from_disk(self, dest: HCQBuffer, src: str | os.PathLike | int | tuple, size: int) -> None:
        """Read `size` bytes of a file into `dest` through the staging ring (preadv into staging buffers,
        the copy engine moves them on). `src` is a path, an open fd, or (path_or_fd, offset)."""
        target, offset = src if isinstance(src, tuple) else (src, 0)
        self._check_size("copy_from_disk", size, dest)
        fd = target if isinstance(target, int) else os.open(target, os.O_RDONLY)
        try:
            for off, chunk in iter_chunks(size, self.batch_size):
                idx = self.b_next
                stage = self._next_staging()
                got = os.preadv(fd, [stage.cpu_view().view(0, chunk).mv], offset + off)
                if got != chunk: raise ValueError(f"copy_from_disk: file ended {offset + off + got} bytes in, {size} were asked from offset {offset}")
                self.b_timeline[idx] = self._submit_copy(dest.va_addr + off, stage.va_addr, chunk, "copy_from_disk")
        finally:
            if not isinstance(target, int): os.close(fd)
