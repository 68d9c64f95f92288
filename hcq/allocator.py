"""`HCQAllocator`: allocation with an LRU cache of freed buffers and slabs for small buffers, and every copy
path built from queues: copyin / copyout (direct where the copy engine reaches host memory, else through a
staging ring of `batch_cnt` x `batch_size` buffers), transfers between devices of a peer group, mappings,
and reading a file region into a buffer through the staging ring. Backends implement `_alloc`, `_free`,
`_map_into`; releases of freed memory are deferred by the core until submitted work is past them."""
from __future__ import annotations

import bisect
import functools
import os
import stat
import weakref
from collections import defaultdict, deque
from typing import Any, Callable, Generic, TypeVar, cast

from hcq import hotpath, interrupts, profiler, recorder, validation
from hcq.errors import HCQError
from hcq.helpers import env_flag, getenv
from hcq.hostcopy import copy_bytes
from hcq.memory import BufferSpec, HCQBuffer, MMIOInterface, flat_bytes, host_address, iter_chunks, RUNTIME_SPEC
from hcq.interfaces import COPY, DeviceLike
from hcq.lifetimes import FREES, DeferredReleases
from hcq.packets import GUARD_CANCELLED, GUARD_DONE, GUARD_PENDING
from hcq.queue import HWQueue
from hcq.signal import HCQSignal
from hcq.symbolic import sint

DeviceType = TypeVar("DeviceType", bound=DeviceLike)

SLAB_SIZE = 1 << 20  # small allocations are cut from backend allocations of this size...
SMALL_MAX = 16 << 10  # ...when they are at most this big (a mapping each would exhaust vm.max_map_count)
MIN_BLOCK = 64  # and rounded up to a power of two of at least this (the alignment of every block)
# Host copies of at most this many bytes into or out of memory the host sees are a memmove by the host, once the device's
# earlier work finished: no queue round trip (about 2 us for 1 KiB instead of 25). Larger ones keep the copy engine,
# which can be cancelled in the middle and, for transfers, overlaps with the host. HCQ_HOST_COPY_MAX overrides it.
HOST_COPY_MAX = 1 << 20
WRAPPED = BufferSpec(host=True, cpu_access=True, nolru=True)  # the options of a buffer over host memory lent by its owner (wrap_host)


def _timed_copy(q: HWQueue, dev: DeviceLike, dest: sint, src: sint, nbytes: sint, name: str, guard: HCQSignal | None = None) -> HWQueue:
    """q.copy(...), bracketed by timestamps and reported to the profiler when one is collecting."""
    prof = profiler.active
    guarded = {"guard": guard} if guard is not None else {}  # backends without direct host copies need not take it
    if prof is None: return q.copy(dest, src, nbytes, **guarded)
    st, en = dev.new_signal(), dev.new_signal()
    q.timestamp(st).copy(dest, src, nbytes, **guarded).timestamp(en)
    prof.device_event("copy", name, dev, (q.kind, q.index), st, en, nbytes=nbytes if isinstance(nbytes, int) else None)
    return q


def _host(buf: HCQBuffer) -> MMIOInterface:
    """The host view of a buffer the runtime itself reads or fills once the work touching it is done (staging, and
    copies on devices without copy queues): `cpu_view()` without the user-facing stale-read check."""
    if buf.freed or buf.view is None: return buf.cpu_view()  # raises, saying why
    return buf.view


def _refuse_capture(what: str) -> None:
    if recorder.active() is not None:
        raise HCQError(f"{what} cannot be captured into a graph (the host memory would not be there at replay); do them outside the capture")


class Slab:
    """One backend allocation (`chunk`) cut into blocks of `block` bytes, for small buffers."""
    __slots__ = ("chunk", "block", "free", "users")

    def __init__(self, chunk: HCQBuffer, block: int):
        self.chunk, self.block = chunk, block
        count = chunk.size // block
        self.free = list(range(count - 1, -1, -1))
        self.users: list[HCQBuffer | None] = [None] * count  # the buffer each block was last handed out as

    def find(self, addr: int, size: int) -> HCQBuffer | None:
        """The buffer holding [addr, addr + size) in this slab (freed ones included), if any."""
        buf = self.users[(addr - self.chunk.va_addr) // self.block]
        if buf is not None and addr + size <= buf.va_addr + buf.size: return buf  # type: ignore[operator]
        return None


class HCQAllocator(Generic[DeviceType]):
    """Allocator of an HCQ device. `alloc`/`free` go through an LRU cache unless `BufferSpec(nolru=True)`
    or `HCQ_LRU=0`; buffers of at most 16 KiB are cut from 1 MiB slabs; copies are queue submissions
    ordered by the device timeline. Freed memory is reused or released only once no submitted work can
    still use it."""

    def __init__(self, dev: DeviceType, batch_size: int = 2 << 20, batch_cnt: int = 32, copy_bufs: list[HCQBuffer] | None = None,
                 max_copyout_size: int | None = None, suballocate: bool = True):
        """`suballocate` False: every buffer is an `_alloc` of its own, small ones included (by default buffers of up to
        SMALL_MAX bytes are cut from SLAB_SIZE `_alloc`s: for devices whose addresses allow no arithmetic across
        allocations; views (`buf.offset`) and signal slots still add offsets inside one allocation)."""
        self.dev, self.batch_size, self.batch_cnt, self.max_copyout_size = dev, batch_size, batch_cnt, max_copyout_size
        self.suballocate = suballocate
        self._b: list[HCQBuffer] | None = copy_bufs
        self.b_timeline = [0] * (len(copy_bufs) if copy_bufs else batch_cnt)
        self.b_next = 0
        self.cache: dict[tuple[int, BufferSpec], list[HCQBuffer]] = defaultdict(list)
        self.lru = env_flag("HCQ_LRU", True)
        self.host_copy_max = getenv("HCQ_HOST_COPY_MAX", HOST_COPY_MAX, lo=0)  # see HOST_COPY_MAX (0: every copy takes the queues)
        self.native_copies_why_not = "the device has not opened"  # why small host copies are not one native call ("": they are)
        self._host_ranges: list[tuple[int, int]] = []  # host memory lent to in-flight direct copies (for validation)
        self._starts: list[int] = []  # sorted start addresses of the backend allocations, parallel to _entries
        self._entries: list[HCQBuffer | Slab] = []  # each a buffer, or a slab of small buffers
        self._open_slabs: dict[tuple[bool, int, BufferSpec], list[Slab]] = defaultdict(list)  # slabs with free blocks
        self._live = 0
        self._from_finalizers: deque[tuple[HCQBuffer, BufferSpec]] = deque()  # see free_from_finalizer
        self._wrapped: dict[int, weakref.ref[HCQBuffer]] = {}  # id -> buffers over lent host memory (wrap_host), not in _starts
        self._wrapped_gone: deque[tuple[int, Any]] = deque()  # (id, what kept the memory) of wrapped buffers collected unfreed
        self._held: list[tuple[HCQBuffer, BufferSpec]] = []  # freed buffers a DLPack consumer still holds (see _free_checked)
        self._releases = DeferredReleases(dev)
        self.for_runtime = False  # set while `_alloc` runs for runtime state (signal pages, kernargs, queue words, staging)
        self._released_on_free = False  # the device was closed and its threads stopped: a buffer freed now is released

    # ---- allocation
    def alloc(self, size: int, options: BufferSpec | None = None, *, internal: bool = False) -> HCQBuffer:
        """`size` bytes of device memory as an HCQBuffer. `internal`: runtime state (signals, kernargs, queue
        words), never cut from the slabs that hold user buffers, so a kernel overrunning a user buffer cannot
        reach it."""
        if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
            raise ValueError(f"allocation size must be a positive int, got {size!r}")
        options = options if options is not None else BufferSpec()
        if not isinstance(options, BufferSpec): raise TypeError(f"options must be a BufferSpec, got {type(options).__name__}")
        self.dev.check_open()
        if self._from_finalizers or self._wrapped_gone: self._free_finalized()
        self._poll_releases()
        if not internal and self.lru and not options.nolru and (cached := self.cache.get((size, options))):
            buf = self._reissue(cached.pop())
        else:
            try:
                buf = self._alloc_new(size, options, internal)
            except MemoryError:
                self._flush_releases()
                self.free_cache()
                self._flush_releases()
                buf = self._alloc_new(size, options, internal)
        self._live += 1
        return buf

    @property
    def live(self) -> int:
        """Buffers allocated and not freed (LRU-cached ones, and ones a finalizer queued a free for, count as freed)."""
        return self._live - len(self._from_finalizers) - len(self._wrapped_gone)

    def wrap_host(self, addr: int, size: int, keepalive: Any, *, readonly: bool = False) -> HCQBuffer | None:
        """A buffer over `size` bytes of host memory at `addr` that this device uses in place (no copy), or None where it
        cannot. `keepalive` (what owns the memory) is held until the buffer is freed or garbage-collected and no submitted
        work uses it any more; `readonly`: kernels may only read it (const pointers) and copies refuse to write it."""
        if not isinstance(size, int) or size <= 0: raise ValueError(f"wrap_host: size must be a positive int, got {size!r}")
        self.dev.check_open()
        if self._from_finalizers or self._wrapped_gone: self._free_finalized()
        if (dev_addr := self._use_host(addr, size)) is None: return None
        view = MMIOInterface(addr, size, keepalive=keepalive, readonly=readonly)  # (host views of read-only memory are read-only)
        buf = self._adopt(HCQBuffer(dev_addr, size, meta=WRAPPED, view=view, owner=self.dev))
        buf._readonly = readonly
        key = id(buf)
        self._wrapped[key] = weakref.ref(buf)
        buf._collected = weakref.finalize(buf, self._wrapped_gone.append, (key, keepalive))  # type: ignore[attr-defined]
        self._live += 1
        return buf

    def _alloc_new(self, size: int, options: BufferSpec, internal: bool) -> HCQBuffer:
        # Ctrl-C waits for the allocation to be whole: one split between the backend's steps (a remote device registers
        # its runtime memory in two tables) or before the index would leak memory nobody can free
        with interrupts.deferred():
            self.for_runtime = internal
            try:
                if size <= SMALL_MAX and self.suballocate: return self._alloc_block(size, options, internal)
                buf = self._adopt(self._alloc(size, options))
            finally:
                self.for_runtime = False
            self._index(buf.va_addr, buf)  # type: ignore[arg-type]
            return buf

    def _reissue(self, old: HCQBuffer) -> HCQBuffer:
        """A new buffer object over the memory of a freed, cached one. The freed object stays freed for good, so queues and
        graphs that still hold it refuse to run instead of writing the new allocation; the index, its slab and its
        mappings (a peer's mapping of the same address space is the buffer itself) name the new object from now on."""
        buf = object.__new__(type(old))
        buf.__dict__.update(old.__dict__)
        buf._root, buf._freed = buf, False
        buf._mappings = {dev: buf if m is old else m for dev, m in old._mappings.items()}
        if buf._slab is not None:
            slab, i, _ = buf._slab
            slab.users[i] = buf
        else:
            i = bisect.bisect_left(self._starts, cast(int, buf.va_addr))
            if i < len(self._starts) and self._entries[i] is old: self._entries[i] = buf
        old.view = None  # (its host view goes with the new object: a stale handle does not keep the memory mapped)
        return buf

    def _adopt(self, buf: HCQBuffer) -> HCQBuffer:
        buf.owner = self.dev
        buf._mappings[self.dev] = buf
        return buf

    def _alloc_block(self, size: int, options: BufferSpec, internal: bool) -> HCQBuffer:
        block = max(MIN_BLOCK, 1 << (size - 1).bit_length())
        open_slabs = self._open_slabs[(internal, block, options)]
        if not open_slabs:
            chunk = self._adopt(self._alloc(SLAB_SIZE, options))
            open_slabs.append(slab := Slab(chunk, block))
            self._index(chunk.va_addr, slab)  # type: ignore[arg-type]
        slab = open_slabs[-1]
        i = slab.free.pop()
        if not slab.free: open_slabs.pop()
        off, chunk = i * block, slab.chunk
        buf = self._adopt(HCQBuffer(chunk.va_addr + off, size, meta=options, view=chunk.view.view(off, size) if chunk.view is not None else None))
        buf._slab = (slab, i, (internal, block, options))
        slab.users[i] = buf
        return buf

    def _index(self, addr: int, entry: HCQBuffer | Slab) -> None:
        i = bisect.bisect_left(self._starts, addr)
        self._starts.insert(i, addr)
        self._entries.insert(i, entry)

    def owns_host_range(self, addr: int, size: int) -> bool:
        """Whether [addr, addr + size) is host memory a direct copy of this allocator is using right now."""
        return any(a <= addr and addr + size <= a + n for a, n in self._host_ranges)

    def owns(self, addr: int, size: int = 1) -> HCQBuffer | None:
        """The allocation of this device holding [addr, addr + size), if any (freed ones whose memory was not
        released or reused yet count, with `freed` set)."""
        i = bisect.bisect_right(self._starts, addr) - 1
        entry = self._entries[i] if i >= 0 else None
        if isinstance(entry, Slab):
            if addr + size <= entry.chunk.va_addr + entry.chunk.size: return entry.find(addr, size)  # type: ignore[operator]
        elif entry is not None and addr + size <= self._starts[i] + entry.size:
            return entry
        for ref in self._wrapped.values():  # (wrapped host memory: concrete addresses)
            if (b := ref()) is not None and cast(int, b.va_addr) <= addr and addr + size <= cast(int, b.va_addr) + b.size: return b
        return None

    def free(self, buf: HCQBuffer, size: int, options: BufferSpec | None = None) -> None:
        """Free `buf` (allocated with the same `size` and `options`). Its memory is reused or released only
        once no submitted work can still use it; host views of it keep the memory mapped."""
        if not isinstance(buf, HCQBuffer): raise TypeError(f"free needs an HCQBuffer, got {type(buf).__name__}")
        options = WRAPPED if buf.meta is WRAPPED else options if options is not None else BufferSpec()
        if buf._base is not None: raise ValueError(f"{buf!r} is a view; free the allocation it came from")
        if buf._freed: raise ValueError(f"{buf!r} was already freed")
        if size != buf.size: raise ValueError(f"free of {buf!r} with size {size}, but it was allocated with {buf.size}")
        if self._from_finalizers or self._wrapped_gone: self._free_finalized()
        self._free_checked(buf, size, options)

    def _free_checked(self, buf: HCQBuffer, size: int, options: BufferSpec) -> None:
        buf._freed = True
        FREES[0] += 1
        self._live -= 1
        if self.dev.closed:  # exiting, or inherited across fork(): the command processor may still hold it; after close(), released
            if self._released_on_free: self._release(buf, options)
            return
        if buf._dlpack_holds:  # a DLPack consumer still reads it: neither reused nor released before it lets go
            self._held.append((buf, options))
            return
        self._recycle(buf, options)

    def _recycle(self, buf: HCQBuffer, options: BufferSpec) -> None:
        if self.lru and not options.nolru:  # reusable once no submitted work can still use it
            self._when_unused(buf, functools.partial(self.cache[(buf.size, options)].append, buf))
            return
        self._release(buf, options)

    def free_from_finalizer(self, buf: HCQBuffer, options: BufferSpec) -> None:
        """`free` for a __del__: the garbage collector may run it on any thread, or in the middle of an allocator
        call, so it only queues the buffer (an atomic append); the next allocator call, on whichever thread
        makes it (under the caller's lock, if there is one), frees it."""
        self._from_finalizers.append((buf, options))

    def _free_finalized(self) -> None:
        while self._from_finalizers:
            buf, options = self._from_finalizers.popleft()
            if not buf._freed: self._free_checked(buf, buf.size, options)
        while self._wrapped_gone:
            key, keepalive = self._wrapped_gone.popleft()
            self._wrapped.pop(key, None)
            self._live -= 1
            self._releases.defer(functools.partial(_drop, keepalive))  # (kernels submitted before may still use the memory)

    def free_cache(self) -> None:
        """Release every buffer the LRU cache holds."""
        if self._from_finalizers or self._wrapped_gone: self._free_finalized()
        for (_, options), bufs in self.cache.items():
            for buf in bufs: self._release(buf, options)
        self.cache.clear()

    def _release(self, buf: HCQBuffer, options: BufferSpec) -> None:
        self._when_unused(buf, functools.partial(self._release_now, buf, options))

    def _release_now(self, buf: HCQBuffer, options: BufferSpec) -> None:
        for m in list(buf._mappings.values()):
            if m.on_release is not None: m.on_release()
        if options is WRAPPED and self._wrapped.pop(id(buf), None) is not None:  # lent memory: give it back to its owner
            buf._collected.detach()  # type: ignore[attr-defined]
            buf.view = None
            return
        if buf._slab is not None:
            slab, i, key = buf._slab
            if not slab.free: self._open_slabs[key].append(slab)
            slab.free.append(i)
            buf.view = None
            return
        addr = buf.va_addr
        if not isinstance(addr, int): raise TypeError(f"{buf!r} has a symbolic address; only allocations can be released")
        i = bisect.bisect_left(self._starts, addr)
        if i < len(self._starts) and self._entries[i] is buf: del self._starts[i], self._entries[i]
        self._free(buf, options)

    def _close(self, stopped: bool, runtime: list[HCQBuffer]) -> None:
        """The device was closed and its queues stopped (`stopped`: every thread they ran too): give back its `runtime`
        buffers, the staging ring and the cached buffers, and forget the index (buffers still held go when they are dropped; freeing them
        does nothing now). Releases that wait for work of the peer group's other devices go to one of them; where a
        thread still runs, nothing is released (it may use any of it)."""
        for name in ("copyin", "copyout"): self.__dict__.pop(name, None)  # (the native host copies)
        if not stopped:
            _kept.append(self)
            return
        if self._from_finalizers or self._wrapped_gone: self._free_finalized()
        for (_, options), bufs in self.cache.items():
            for buf in bufs: self._release_now(buf, options)
        for buf in runtime + (self._b or []):
            self._release_now(buf, RUNTIME_SPEC)
        self.cache.clear()
        self._b = None
        self._releases.poll()
        if self._releases:
            heir = self._heir()
            if heir is not None: heir.allocator._releases.adopt(self._releases, self.dev)
            else: self._releases.run_all()  # (the group has no other device: no work is left that could use the memory)
        self._released_on_free = True

    def _heir(self) -> Any:
        """An open device of the closed device's peer group, whose releases wait for the group's work (None: none is open)."""
        return next((d for d in self.dev.peers() if d is not self.dev and not d.closed), None)

    def _when_unused(self, buf: HCQBuffer, release: Callable[[], None]) -> None:
        """Call `release` once no submitted work can still use `buf`: at once when the peer group is idle, else
        when every busy device's progress marks pass their current values (nothing waits for that here). A closed
        device's releases wait with an open peer's."""
        heir = self._heir() if self._released_on_free else None
        (heir.allocator._releases if heir is not None else self._releases).defer(release)

    def _poll_releases(self) -> None:
        """Carry out the deferred releases whose work has passed (no waiting), and recycle freed buffers that DLPack
        consumers no longer hold."""
        if self._held: self._recycle_unheld()
        if self._releases: self._releases.poll()

    def _recycle_unheld(self) -> None:
        held, self._held = self._held, []
        for buf, options in held:
            if buf._dlpack_holds: self._held.append((buf, options))
            else: self._recycle(buf, options)

    def _flush_releases(self) -> None:
        """Carry out deferred releases now, waiting for the work they wait for (e.g. before retrying an allocation
        that ran out of memory)."""
        self._releases.flush(self.dev.peers())

    def _alloc(self, size: int, options: BufferSpec) -> HCQBuffer:
        """Backends: `size` bytes of device memory. `self.for_runtime` says whether it holds runtime state (signal pages,
        kernargs, queue words, staging) rather than a user buffer: a backend may keep a reserve for those."""
        raise NotImplementedError

    def _free(self, buf: HCQBuffer, options: BufferSpec) -> None:
        """Backends: release `buf`'s memory (no submitted work uses it; keep it mapped while host views exist)."""
        raise NotImplementedError

    def _map_into(self, buf: HCQBuffer) -> HCQBuffer:
        """Backends: make `buf` (of another device of the peer group) reachable by this device."""
        raise NotImplementedError(f"{type(self).__name__} cannot map buffers of other devices")

    def _use_host(self, host_addr: int, nbytes: int) -> int | None:
        """Backends: the device address at which this device's kernels and copy engine use the given host memory in
        place, or None (then `wrap_host` refuses and DLPack imports copy)."""
        return None

    def _host_copy_address(self, host_addr: int, nbytes: int) -> int | None:
        """Backends: the device address at which this device's copy engine reads/writes the given host
        memory directly, or None (copies then go through the staging ring). A backend that returns an
        address must support cancellable copies (`HWQueue.copy(..., guard=)`)."""
        return None

    def _import(self, buf: HCQBuffer) -> HCQBuffer | None:
        """Backends: a mapping of `buf` (of a device of another peer group) that this device's copy engine writes into,
        or None. What is written there reaches `buf` before the copy's later signals (the mapping may be a window
        whose bytes the backend forwards)."""
        return None

    def _export_to(self, buf: HCQBuffer, dev: DeviceLike) -> HCQBuffer | None:
        """Backends: a mapping of this device's `buf` that `dev` (of another peer group) writes into, or None."""
        return None

    def map(self, buf: HCQBuffer) -> None:
        """Make `buf` reachable by this device (a no-op once done; mappings are shared by views). Across peer groups
        either backend may provide the mapping (see `_import` / `_export_to`); it is released with `buf`."""
        if self.dev in buf.mappings: return
        base, owner = buf.base, buf.base.owner
        if owner is None or owner is self.dev or owner.peer_group == self.dev.peer_group:
            base._mappings[self.dev] = self._map_into(base)
            return
        m = owner.allocator._export_to(base, self.dev) or self._import(base)
        if m is None:
            raise HCQError(f"{self.dev.device} cannot reach {buf!r} of {owner.device}: neither backend maps memory across peer groups "
                           f"({owner.peer_group!r} -> {self.dev.peer_group!r})")
        base._mappings[self.dev] = m
        if isinstance(m.va_addr, int) and self.owns(m.va_addr, m.size) is None: self._adopt_mapping(m)

    def _adopt_mapping(self, m: HCQBuffer) -> None:
        """Index a mapping of another group's memory with this device's allocations (validation finds the copies
        into it in bounds) until it is released."""
        self._index(cast(int, m.va_addr), m)
        release = m.on_release

        def unindex() -> None:
            i = bisect.bisect_left(self._starts, cast(int, m.va_addr))
            if i < len(self._starts) and self._entries[i] is m: del self._starts[i], self._entries[i]
            if release is not None: release()
        m.on_release = unindex

    def address_for(self, buf: HCQBuffer) -> sint:
        """`buf`'s address as this device's queues use it (a mapping's, across peer groups; call `map` first)."""
        m = buf.base._mappings.get(self.dev)
        if m is None or m is buf.base or buf.base.owner is None or buf.base.owner.peer_group == self.dev.peer_group: return buf.va_addr
        return m.va_addr + (buf.va_addr - buf.base.va_addr)


    # ---- staging ring
    @property
    def b(self) -> list[HCQBuffer]:
        """The staging buffers (allocated on first use)."""
        if self._b is None:
            with interrupts.deferred():  # the whole ring or nothing (a Ctrl-C between its buffers would leak the first ones)
                self._b = [self.alloc(self.batch_size, BufferSpec(host=True, cpu_access=True, nolru=True), internal=True) for _ in range(self.batch_cnt)]
        return self._b

    def _timeline_wrapped(self) -> None:
        """The device's timeline started again from 0 (its work so far finished): tags of older values mean nothing now."""
        self.b_timeline = [0] * len(self.b_timeline)

    def _next_staging(self) -> tuple[int, HCQBuffer]:
        """The next staging buffer and its index, once the submission that last used it finished."""
        idx = self.b_next
        self.dev.timeline_signal.wait(self.b_timeline[idx])
        self.b_next = (idx + 1) % len(self.b)
        return idx, self.b[idx]

    def _staged_copy(self, idx: int, dest: sint, src: sint, nbytes: int, name: str) -> int:
        """Copy through staging buffer `idx` and tag it with the copy's timeline value, as one step."""
        return self._tagged_copy(self.b_timeline, idx, dest, src, nbytes, name)

    def _tagged_copy(self, tags: list[int], idx: int, dest: sint, src: sint, nbytes: int, name: str) -> int:
        """A copy on the copy queue that tags `tags[idx]` (the buffer it reads or writes, reused once that value passed)
        with its timeline value, as one step."""
        with interrupts.deferred():
            tags[idx] = done = self._submit_copy(dest, src, nbytes, name)
        return done

    def _submit_copy(self, dest: sint, src: sint, nbytes: int, name: str = "copy", guard: HCQSignal | None = None) -> int:
        """Copy on the copy queue after all earlier work; returns the timeline value that marks it done."""
        dev = self.dev
        q = dev.hw_copy_queue_t(profile=False).wait(dev.timeline_signal, dev.timeline_value - 1)  # _timed_copy times it
        _timed_copy(q, dev, dest, src, nbytes, name, guard).signal(dev.timeline_signal, dev.timeline_value)
        return dev.submit_timeline(q)

    def _direct_copy(self, dest: sint, src: sint, nbytes: int, name: str) -> None:
        """A copy between device memory and host memory the copy engine reaches directly; returns when done.
        The host memory is only lent for the copy: if the wait ends early (Ctrl-C, timeout, device error),
        the copy is cancelled before it starts or waited for if it started, so the engine never touches
        the caller's memory after this returns or raises."""
        dev = self.dev
        host = (src if name == "copyin" else dest, nbytes)
        guard = dev.new_signal(value=GUARD_PENDING)
        entered = interrupts.enter()
        try:
            self._host_ranges.append(host)  # type: ignore[arg-type]
            done = self._submit_copy(dest, src, nbytes, name, guard)
            try:
                dev.timeline_signal.wait(done)
            except BaseException:
                _cancel_or_finish(guard)
                raise
        finally:
            if host in self._host_ranges: self._host_ranges.remove(host)
            interrupts.leave(entered)

    def _check_size(self, what: str, nbytes: int, buf: HCQBuffer) -> None:
        if not isinstance(buf, HCQBuffer): raise TypeError(f"{what}: needs an HCQBuffer, got {type(buf).__name__}")
        if buf.freed: raise ValueError(f"{what}: {buf!r} was freed")
        if nbytes > buf.size: raise ValueError(f"{what}: {nbytes} bytes do not fit in {buf!r} ({buf.size} bytes)")

    def _check_owned(self, what: str, nbytes: int, buf: HCQBuffer) -> None:
        """`_check_size`, and `buf` must be memory of this allocator's device (or of none): a host copy is ordered after
        this device's work only, so one into or out of another device's buffer would race with that device's kernels."""
        self._check_size(what, nbytes, buf)
        if (owner := buf.owner) is not None and owner is not self.dev:
            raise ValueError(f"{what}: {buf!r} is memory of {owner.device}, and {self.dev.device}'s allocator orders copies after "
                             f"{self.dev.device}'s work only; copy with its own allocator (hcq.Device({owner.device!r}).allocator.{what})")

    def _host_window(self, buf: HCQBuffer, nbytes: int) -> memoryview | None:
        """`buf`'s bytes for a copy of `nbytes` that the host does itself (memory it sees; a small copy, or a device
        without copy queues; no profiler or validation, which follow copies as queue commands), else None."""
        if buf.view is None: return None
        if self.dev.capabilities.queue_count(COPY) and (nbytes > self.host_copy_max or profiler.active is not None or validation.enabled): return None
        return buf.view.raw

    # ---- copies
    def _fast_host_copies(self, failed_flag: int | None, overridden: list[str]) -> None:
        """With the hot-path extension and an executor that shows its failure in memory (`failed_flag`, see
        Executor.failed_flag_address), `self.copyin` and `self.copyout` become native callables: a small host copy on an
        idle device (nothing in flight, no failure, no profiler, capture or validation) is one call, with these methods'
        checks; anything else calls the methods. Where a backend overrides one of the checks the native call stands in
        for (`overridden`), or its own copyin/copyout, the methods stay; `native_copies_why_not` says why."""
        dev, own = self.dev, [f"{type(self).__name__}.{n}" for n in ("copyin", "copyout") if getattr(type(self), n) is not getattr(HCQAllocator, n)]
        why = ("" if hotpath.available() else f"the hot-path extension is not in use ({hotpath.why_not})") or \
              ("" if failed_flag else f"{type(dev).__name__} shows no failure flag in host memory (Executor.failed_flag_address)") or \
              ("" if not overridden else f"{', '.join(overridden)} override the core's checks the native copy stands in for")
        self.native_copies_why_not = why or (f"{' and '.join(own)} {'is' if len(own) == 1 else 'are'} the backend's own" if own else "")
        if why: return
        for name in ("copyin", "copyout"):
            if getattr(type(self), name) is not getattr(HCQAllocator, name): continue  # a backend's own copy
            fast = hotpath.host_copier(dev.native_state(), self, HCQBuffer, getattr(self, name), name == "copyin", bool(dev.capabilities.queue_count(COPY)),
                                       failed_flag)  # type: ignore[arg-type]
            if fast is not None: self.__dict__[name] = fast

    @profiler.traced("copyin")
    def copyin(self, dest: HCQBuffer, src: memoryview) -> None:
        """Copy host memory `src` into `dest`, after earlier work on the device and before later work (it is
        ordered on the device's timeline). Returns once `src` may be reused: a staged copy may still be landing
        (synchronize, or queue work after the timeline, before reading `dest` from the host)."""
        _refuse_capture("host copies")
        data = flat_bytes(src)
        nbytes = data.nbytes
        self._check_owned("copyin", nbytes, dest)
        dest.check_writable("copyin")
        if nbytes == 0: return
        if (window := self._host_window(dest, nbytes)) is not None:
            self.dev.wait_timeline("copyin")  # the earlier work first (a Ctrl-C or a failure ends the wait before anything is copied)
            copy_bytes(window[:nbytes], data)
            return
        if not self.dev.capabilities.queue_count(COPY): _host(dest)  # no copy engine and no host view: raises, saying why
        addr, nbytes, keep = host_address(data)
        if (dev_addr := self._host_copy_address(addr, nbytes)) is not None:
            self._direct_copy(dest.va_addr, dev_addr, nbytes, "copyin")
        else:
            self._copyin_staged(dest, data)
        del keep

    def _copyin_staged(self, dest: HCQBuffer, src: memoryview) -> None:
        for off, size in iter_chunks(src.nbytes, self.batch_size):
            idx, stage = self._next_staging()
            copy_bytes(_host(stage).view(0, size).raw, src[off:off + size])
            self._staged_copy(idx, dest.va_addr + off, stage.va_addr, size, "copyin (staged)")

    @profiler.traced("copyout")
    def copyout(self, dest: memoryview, src: HCQBuffer) -> None:
        """Copy `src` into host memory `dest` once all earlier work on the device finished."""
        _refuse_capture("host copies")
        out = flat_bytes(dest)
        if out.readonly: raise ValueError("copyout destination is read-only")
        nbytes = out.nbytes
        self._check_owned("copyout", nbytes, src)
        if nbytes == 0: return
        self.dev.wait_timeline("copyout")
        if (window := self._host_window(src, nbytes)) is not None:
            copy_bytes(out, window[:nbytes])
            return
        if not self.dev.capabilities.queue_count(COPY): _host(src)  # no copy engine and no host view: raises, saying why
        addr, nbytes, keep = host_address(out)
        if (dev_addr := self._host_copy_address(addr, nbytes)) is not None:
            self._direct_copy(dev_addr, src.va_addr, nbytes, "copyout")
        else:
            self._copyout_staged(out, src)
        del keep

    def _copyout_staged(self, dest: memoryview, src: HCQBuffer) -> None:
        chunk = min(self.batch_size, self.max_copyout_size or self.batch_size)
        inflight: list[tuple[int, int, HCQBuffer, int]] = []
        for off, size in iter_chunks(dest.nbytes, chunk):  # keep the copy engine ahead of the host's reads
            idx, stage = self._next_staging()
            done = self._staged_copy(idx, stage.va_addr, src.va_addr + off, size, "copyout (staged)")
            inflight.append((off, size, stage, done))
            if len(inflight) == len(self.b): self._drain_one(dest, inflight)
        while inflight: self._drain_one(dest, inflight)

    def _drain_one(self, dest: memoryview, inflight: list[tuple[int, int, HCQBuffer, int]]) -> None:
        off, size, stage, done = inflight.pop(0)
        self.dev.timeline_signal.wait(done)
        copy_bytes(dest[off:off + size], _host(stage).view(0, size).raw)

    @profiler.traced("transfer")
    def transfer(self, dest: HCQBuffer, src: HCQBuffer, sz: int, src_dev: DeviceLike, dest_dev: DeviceLike) -> None:
        """Copy `sz` bytes from `src` (on src_dev) to `dest` (on dest_dev), ordered after earlier work on both devices;
        later work on both waits for it. The copy runs on src_dev's copy engine; across peer groups it writes a mapping
        the backends provide, or, where src_dev cannot reach `dest` but dest_dev can reach `src` (device memory the host
        cannot map), dest_dev's copy engine reads a mapping of `src` instead (see `copy_engine`)."""
        if (rec := recorder.active()) is not None:
            rec.on_copy(dest, src, sz)
            return
        self._check_size("transfer destination", sz, dest)
        dest.check_writable("transfer destination")
        self._check_size("transfer source", sz, src)
        if self._transfer_by_host(dest, src, sz, src_dev, dest_dev): return
        if not src_dev.capabilities.queue_count(COPY) and not dest_dev.capabilities.queue_count(COPY):
            raise ValueError(f"{src_dev.device} has no copy queue for transfers")
        engine = copy_engine(src_dev, dest_dev, dest, src)
        other = dest_dev if engine is src_dev else src_dev
        if src_dev.peer_group == dest_dev.peer_group: other.allocator.map(src if engine is src_dev else dest)
        landing = landed_view(dest, engine) if engine is src_dev else None
        other_tl, engine_tl = engine.replica(other.timeline_signal), other.replica(engine.timeline_signal)
        q = engine.hw_copy_queue_t(profile=False).wait(engine.timeline_signal, engine.timeline_value - 1) \
            .wait(other_tl, other.timeline_value - 1)
        name = f"transfer {src_dev.device}->{dest_dev.device}"
        _timed_copy(q, engine, engine.allocator.address_for(dest), engine.allocator.address_for(src), sz, name) \
            .signal(engine.timeline_signal, engine.timeline_value)
        # the other half, made before either goes in (what making it may raise leaves nothing submitted): it waits for the
        # value the copy signals; where the bytes landed in memory of dest's device its host writes, its own queue moves
        # them into place
        if landing is None:
            other_q = other.hw_compute_queue_t(profile=False).wait(engine_tl, engine.timeline_value)
        else:
            other_q = (other.hw_copy_queue_t if other.capabilities.queue_count(COPY) else other.hw_compute_queue_t)(profile=False) \
                .wait(engine_tl, engine.timeline_value)
            _timed_copy(other_q, other, dest.va_addr, landing.va_addr, sz, f"{name} (landed)")
        with interrupts.deferred():  # both halves or neither: the other device's later work must wait for the copy
            engine.submit_timeline(q)
            other.submit_timeline(other_q.signal(other.timeline_signal, other.timeline_value))

    def _transfer_by_host(self, dest: HCQBuffer, src: HCQBuffer, sz: int, src_dev: DeviceLike, dest_dev: DeviceLike) -> bool:
        """A small transfer between memory the host sees, done by the host when both devices are idle now (then
        nothing earlier must run first, and later work on either is submitted after it). Whether it was done."""
        if (src_win := self._host_window(src, sz)) is None or (dest_win := self._host_window(dest, sz)) is None: return False
        for dev in (src_dev, dest_dev):
            if dev.timeline_signal.load() < dev.timeline_value - 1: return False  # busy: the engine orders it, the host goes on
            dev.check_error("transfer")
        copy_bytes(dest_win[:sz], src_win[:sz])
        return True

    # The seeds' names for the copy API (tinygrad's allocator interface), kept as thin aliases.
    _copyin, _copyout, _transfer, _map = copyin, copyout, transfer, map

    @profiler.traced("copy_from_disk")
    def copy_from_disk(self, dest: HCQBuffer, src: str | os.PathLike | int | tuple, size: int) -> None:
        """Read `size` bytes of a file into `dest` through the staging ring (preadv into staging buffers,
        the copy engine moves them on). `src` is a path, an open fd, or (path_or_fd, offset). The source
        must be a regular file or a block device holding the whole range; that is checked before `dest`
        is touched (a file shrinking meanwhile still ends the copy with an error, `dest` partly written)."""
        target, offset = src if isinstance(src, tuple) else (src, 0)
        for what, v in (("size", size), ("offset", offset)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 0: raise ValueError(f"copy_from_disk: {what} must be an int >= 0, got {v!r}")
        self._check_owned("copy_from_disk", size, dest)
        dest.check_writable("copy_from_disk")
        # O_NONBLOCK: opening a FIFO must not wait for a writer (it is refused below anyway).
        fd = target if isinstance(target, int) else os.open(target, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            end = _readable_extent(fd, target)
            if offset + size > end:
                raise ValueError(f"copy_from_disk: {target!r} holds {end} bytes; {size} bytes from offset {offset} run past its end")
            for off, chunk in iter_chunks(size, self.batch_size):
                idx, stage = self._next_staging()
                got = os.preadv(fd, [_host(stage).view(0, chunk).mv], offset + off)
                if got != chunk: raise ValueError(f"copy_from_disk: file ended {offset + off + got} bytes in, {size} were asked from offset {offset}")
                self._staged_copy(idx, dest.va_addr + off, stage.va_addr, chunk, "copy_from_disk")
        finally:
            if not isinstance(target, int): os.close(fd)


def _readable_extent(fd: int, target: object) -> int:
    """Size of the regular file or block device behind `fd`; anything that could block a read forever (a FIFO,
    a socket, a terminal) is refused."""
    st = os.fstat(fd)
    if stat.S_ISREG(st.st_mode): return st.st_size
    if stat.S_ISBLK(st.st_mode): return os.lseek(fd, 0, os.SEEK_END)
    kind = "a directory" if stat.S_ISDIR(st.st_mode) else "a FIFO" if stat.S_ISFIFO(st.st_mode) else \
           "a socket" if stat.S_ISSOCK(st.st_mode) else "a character device" if stat.S_ISCHR(st.st_mode) else "not a regular file"
    raise ValueError(f"copy_from_disk: {target!r} is {kind}; it reads regular files and block devices only")


_kept: list[HCQAllocator] = []  # allocators of devices closed while a kernel still ran: their memory stays mapped


def _drop(keepalive: Any) -> None:
    """A deferred release that only lets go of `keepalive` (lent memory whose buffer is gone)."""


def _cancel_or_finish(guard: HCQSignal) -> None:
    """After a cancellable copy's wait ended early: cancel it if it has not started, else wait (without
    giving up: a started copy is a bounded memcpy) until it is done."""
    if guard.compare_exchange(GUARD_PENDING, GUARD_CANCELLED) == GUARD_PENDING: return
    while guard.value < GUARD_DONE:
        if guard.owner is not None and guard.owner.closed: return  # its command processor is gone
        guard._wait_slice(GUARD_DONE, HCQSignal.WAIT_SLICE_MS)


def landed_view(dest: HCQBuffer, engine: Any) -> HCQBuffer | None:
    """Where a copy by `engine` into `dest` lands when dest's device's host cannot write `dest` (its mapping's
    `lands_in`, at dest's offset: dest's own device then moves the bytes into place), or None (straight into `dest`)."""
    m = dest.base.mappings.get(engine)
    if m is None or m.lands_in is None: return None
    return m.lands_in.offset(cast(int, dest.va_addr) - cast(int, dest.base.va_addr), dest.size)


def copy_engine(src_dev: DeviceLike, dest_dev: DeviceLike, dest: HCQBuffer, src: HCQBuffer) -> DeviceLike:
    """The device whose copy engine moves `src` (of src_dev) into `dest` (of dest_dev): src_dev's, which writes a
    mapping of `dest` (a push); across peer groups, when src_dev cannot reach `dest` but dest_dev has a copy queue and
    reaches `src`, dest_dev's, which reads a mapping of `src` (a pull). Makes the mapping; raises HCQError when neither
    can."""
    try:
        if not src_dev.capabilities.queue_count(COPY): raise HCQError(f"{src_dev.device} has no copy queue")
        src_dev.allocator.map(dest)
        return src_dev
    except HCQError as push_error:
        if src_dev.peer_group == dest_dev.peer_group or not dest_dev.capabilities.queue_count(COPY): raise
        try:
            dest_dev.allocator.map(src)
        except HCQError:
            raise push_error from None
        return dest_dev
