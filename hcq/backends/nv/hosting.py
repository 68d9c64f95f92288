"""The NV backend as `hcq serve` hosts it (`DEVICE_HOST`, an `hcq.interfaces.DeviceHost`): an NV device of its own per
client, whose hcq packets are translated into the GPU's methods on the server.

A client's packets reach a ring of feed.c (serve.c submits there in C, as it does to cp.c's rings); one thread per
ring takes them out and encodes each as the NV queues encode the same command locally (host semaphores, QMD launches,
copy-engine copies), and submits the result through the device's channel in segments (one ends after each SIGNAL,
WRITE and signal WAIT, and before each WAIT and POLL). Each segment ends with its ring's fence, so once the fence
passes, every store the segment made is in memory: a completion thread then hands those stores to the store hook
(serve.c pushes them to the client) in each ring's order. That is why `stores_before_hook` holds: the GPU stores
before the hook hears of them. GPUs reach no memory of each other here (`devices_share_memory` is False), so a client
opens one NV device of a server at a time.

A GPU cannot fail itself on a poisoned signal. A WAIT whose signal turns out poisoned once it passed fails the device:
every signal still to be handed over (and every later one) is stored poisoned, never as its value. A channel fault fails the
device the same way. NV devices do not recover, served or not.

Memory: runtime memory (and windows, landing buffers) is device memory the CPU maps at its GPU address; user buffers
are device memory the CPU does not see (`host_visible` False), moved by the copy queues. Every allocation has an
unmapped page on either side. The server's own reads and writes of client memory (kernargs, INDIRECT words, poison
tags, poisoned stores) happen only inside this client's host-visible allocations, under the lock freeing takes; a
launch's constant bank and QMD are built in memory of the server's own (`_LaunchArena`)."""
from __future__ import annotations

import bisect
import collections
import ctypes
import functools
import itertools
import threading
import time
from array import array
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, cast

from hcq import atomics, packets
from hcq.backends.nv.compiler import NVCompiler
from hcq.backends.nv.device import NVDevice, NVProgram
from hcq.backends.nv.kernels import CONFORMANCE_KERNELS
from hcq.backends.nv.queues import NVComputeQueue, NVCopyQueue, NVQueue
from hcq.errors import HCQError
from hcq.interfaces import COMPUTE, COPY, HostStores
from hcq.memory import HCQBuffer, MMIOInterface
from hcq.packet_queue import RingState, c_header
from hcq.packets import (EXEC_DIMS_AT, FLAG_B64, FLAG_GUARD, FLAG_SIGNAL, POISON_MASK, POISON_TAG, SIGNAL_SIZE, SIGNAL_TIMESTAMP_OFFSET, Op,
                         PollCondition, decode_header)
from hcq.program import ArgSlot
from hcq.toolchain import build_shared_object, inline_include

FEED_SOURCE = Path(__file__).with_name("feed.c")
FEED_FLAGS = ("-O2", "-std=c11", "-pthread", "-fvisibility=hidden")
FEED_WORDS = 1 << 16  # a served ring's words (what clients assume of every server: hcq.backends.remote.protocol.RING_WORDS)
STOP_S = 1.0  # how long a closing device's GPU gets to finish what it runs
LAUNCH_ARENA_BYTES = 4 << 20  # the server's memory for launches in flight (constant banks and QMDs)
SEGMENT_WORDS = 1 << 16  # a segment is submitted once it holds this many words (a channel's pushbuffer holds 512K)
VA_BITS = 49  # the GPU's virtual address space (what a copy can span at most)
POLL_S, POLL_MAX_S = 0.00005, 0.002  # how often the completion thread looks at fences while batches are in flight (backing off)
_ACQUIRE_OPS = {PollCondition.EQ: "acquire", PollCondition.GEQ: "acq_strict_geq", PollCondition.AND: "acq_and", PollCondition.NOR: "acq_nor"}


@functools.lru_cache(maxsize=None)
def feed() -> ctypes.CDLL:
    """feed.c, built with the machine's C compiler on first use (cached on disk like cp.c)."""
    source = inline_include(FEED_SOURCE.read_text(), "hcq_shared.h", c_header(), "feed.c")
    source = inline_include(source, "ring.h", packets.RING_HEADER.read_text(), "feed.c")
    lib = ctypes.CDLL(str(build_shared_object(source, FEED_FLAGS, "hcq-nv-feed")))
    vp, u64, i64, i32 = ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int64, ctypes.c_int
    for name, res, args in (("hcq_feed_create", vp, [u64]), ("hcq_feed_destroy", None, [vp]), ("hcq_feed_words", vp, [vp]),
                            ("hcq_feed_submit", i32, [vp, vp, u64, i64]), ("hcq_feed_rptr", u64, [vp]), ("hcq_feed_wptr", u64, [vp]),
                            ("hcq_feed_wait", u64, [vp, u64, i64]), ("hcq_feed_consumed", None, [vp, u64]), ("hcq_feed_stop", None, [vp]),
                            ("hcq_feed_stopped", i32, [vp]), ("hcq_feed_signal_store", None, [vp, u64]),
                            ("hcq_feed_signal_poison", None, [vp, u64, ctypes.c_uint32]), ("hcq_feed_wake", None, [vp, u64])):
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = res, args
    return lib


def _address(name: str) -> int:
    return ctypes.cast(getattr(feed(), name), ctypes.c_void_p).value  # type: ignore[return-value]


# ---- the store hook and poison ids (one per process, as a backend's command processors share one)
_HOOK_TYPE = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint64)
_hook_lock = threading.RLock()  # held while a hook runs: set_hook(None, None) waits for hooks under way
_hook: tuple[Any, int] | None = None
_feeders: dict[int, str] = {}  # poison id -> why (ids of no device)
_feeder_ids = itertools.count(1 << 24)
_device_ids = itertools.count(1)
_devices: dict[int, str] = {}  # device id -> its name (for a WAIT released by a signal it poisoned)
_open_lock = threading.Lock()
_open_gpus: dict[int, NVServedDevice] = {}  # GPU index -> the served device that has it open in this process


def _set_hook(fn: int | None, ctx: int | None) -> None:
    global _hook
    with _hook_lock: _hook = None if fn is None else (_HOOK_TYPE(fn), ctx or 0)


def _stored(addr: int, nbytes: int, flags: int) -> None:
    """Hand a store that is in memory to the hook (it reads the bytes itself)."""
    with _hook_lock:
        if _hook is not None: _hook[0](_hook[1], addr, nbytes, flags, 0)


def _name_feeder(why: str) -> int:
    poison_id = next(_feeder_ids)
    _feeders[poison_id] = why
    return poison_id


def poisoner_text(poison_id: int) -> str:
    """Who stored a poisoned signal: a device of this host, or what a feeder id names."""
    if poison_id in _devices: return f"{_devices[poison_id]}, which failed"
    return _feeders.get(poison_id, f"a failed device (poison id {poison_id})")


HOST_STORES = HostStores(set_hook=_set_hook, poison=lambda: _address("hcq_feed_signal_poison"), waker=lambda: _address("hcq_feed_wake"),
                         name_feeder=_name_feeder)


# ---- memory
class NVMemory:
    """Memory of one served NV device at `addr` (its GPU address), between unmapped guard pages: CPU-mapped at the same
    address (`host_visible`), or device memory only the GPU reaches. Freed with this object; a closed device goes once
    the last of its memory has (`NVServedDevice.close`). `fd` -1: in no memfd (nothing the GPU maps can be another
    process's)."""
    __slots__ = ("addr", "size", "fd", "host_visible", "_executor", "_buf")

    def __init__(self, executor: NVServedDevice, size: int, host_visible: bool):
        self._executor, self.fd, self.host_visible = executor, -1, host_visible
        self._buf: HCQBuffer | None = None  # (first: what __del__ looks at should the allocation fail)
        buf = executor.alloc(max(size, 1), host_visible)
        self._buf, self.addr, self.size = buf, int(cast(int, buf.va_addr)), buf.size
        if host_visible: executor.host_ranges.add(self.addr, self.size)

    def __del__(self) -> None:
        ex, buf = getattr(self, "_executor", None), getattr(self, "_buf", None)
        if ex is None or buf is None: return
        self._buf = None
        if self.host_visible: ex.host_ranges.remove(self.addr)
        ex.free(buf)


class HostRanges:
    """The host-visible allocations of one served device: what the server itself may read or write for a client."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._starts: list[int] = []
        self._ends: list[int] = []

    def add(self, addr: int, size: int) -> None:
        with self._lock:
            i = bisect.bisect_left(self._starts, addr)
            self._starts.insert(i, addr)
            self._ends.insert(i, addr + size)

    def remove(self, addr: int) -> None:
        with self._lock:
            i = bisect.bisect_left(self._starts, addr)
            if i < len(self._starts) and self._starts[i] == addr: del self._starts[i], self._ends[i]

    def _covers(self, addr: int, nbytes: int) -> bool:
        i = bisect.bisect_right(self._starts, addr) - 1
        return i >= 0 and addr + nbytes <= self._ends[i]

    def access(self, addr: int, nbytes: int, fn: Callable[[], Any]) -> bool:
        """Run `fn` (which touches [addr, addr + nbytes) from the host) if that lies in one of the allocations, holding
        the lock that `remove` takes before the memory goes: a client freeing it meanwhile cannot unmap it under `fn`.
        Whether it ran."""
        with self._lock:
            if not self._covers(addr, nbytes): return False
            fn()
            return True

    def words(self, addr: int, nwords: int) -> list[int] | None:
        """A copy of the 64-bit words at `addr` if they lie in one of the allocations, else None."""
        out: list[list[int]] = []
        return out[0] if self.access(addr, 8 * nwords, lambda: out.append(list((ctypes.c_uint64 * nwords).from_address(addr)))) else None


# ---- translation
class _Fault(Exception):
    """A packet the device cannot run: the device fails with this text."""


@dataclass
class _Batch:
    """One submission's stores, handed to the hook once `fence` (ring, value) passed; None: nothing runs on the GPU."""
    fence: tuple[Any, int] | None
    stores: list[tuple[int, int, int]] = field(default_factory=list)  # (addr, nbytes, flags)
    signals: list[tuple[int, int]] = field(default_factory=list)  # (addr, value) of FLAG_SIGNAL SIGNALs, poisoned if the device failed
    waits: list[int] = field(default_factory=list)  # FLAG_SIGNAL WAITs' signals: poisoned ones fail the device


class _Feed:
    """One ring: feed.c's words, and the thread that translates them."""

    def __init__(self, device: NVServedDevice, kind: str, index: int):
        self.device, self.kind, self.index = device, kind, index
        self.handle = feed().hcq_feed_create(FEED_WORDS)
        if not self.handle: raise MemoryError(f"{device.name}: no memory for a {FEED_WORDS}-word ring")
        self.words = (ctypes.c_uint64 * FEED_WORDS).from_address(feed().hcq_feed_words(self.handle))
        self.packets_done = 0
        self.thread = threading.Thread(target=self._run, name=f"{device.name} {kind}{index} feed", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self._translate_all()
        except BaseException as e:  # (a bug here fails the device rather than leave its ring unread)
            self.device.fail(f"the server's thread of {self.kind} queue {self.index} stopped: {e!r}")
            raise

    def _translate_all(self) -> None:
        lib, rptr = feed(), 0
        while True:
            wptr = lib.hcq_feed_wait(self.handle, rptr, 50_000_000)
            if wptr == rptr:
                if lib.hcq_feed_stopped(self.handle): return
                continue
            words = [self.words[k % FEED_WORDS] for k in range(rptr, wptr)]
            self.device.run_words(self, words)
            rptr = wptr
            lib.hcq_feed_consumed(self.handle, rptr)


class _LaunchArena:
    """Memory of the server's own for launches: each EXEC's constant bank 0 (the client's arguments copied in, then the
    driver's words) and its QMD. The client's kernargs block is only read: what a client keeps of its runtime memory may
    be pushed to the server again at any time (a mirror of it), which would overwrite anything the server wrote there.
    Blocks are taken in order around the arena and reused once the segment that launched them passed its fence; only
    the compute ring's thread takes them."""

    def __init__(self, device: NVServedDevice):
        self.device = device
        with device.dev._memory_lock: buf = device.dev.alloc_device(LAUNCH_ARENA_BYTES, cpu_access=True)
        self.base, self.size, self.head = int(cast(int, buf.va_addr)), buf.size, 0
        self.inflight: collections.deque[tuple[int, int, tuple[Any, int]]] = collections.deque()  # (start, end, fence) in order
        self.building: list[tuple[int, int]] = []  # blocks of the segment being built (no fence yet)

    def take(self, nbytes: int) -> int:
        """The address of `nbytes` (a multiple of 256) for a launch of the segment being built, once the GPU is past
        whatever used them; _Fault when the device fails or closes meanwhile."""
        at = self.head if self.head + nbytes <= self.size else 0
        if any(s < at + nbytes and at < e for s, e in self.building):
            raise _Fault(f"a segment's launches need more than the {self.size}-byte launch arena")
        delay = POLL_S
        while self.inflight:
            start, end, (ring, value) = self.inflight[0]
            if ring.fence.load() >= value: self.inflight.popleft()
            elif start < at + nbytes and at < end:
                if self.device._error is not None or self.device._stopping_feeds: raise _Fault("the device failed or closed while a launch waited for room")
                time.sleep(delay)
                delay = min(delay * 2, POLL_MAX_S)
            else: break
        self.head = at + nbytes
        self.building.append((at, at + nbytes))
        return self.base + at

    def building_bytes(self) -> int:
        return sum(e - s for s, e in self.building)

    def settle(self, fence: tuple[Any, int] | None) -> None:
        """The segment being built was submitted with `fence` (its blocks stay until it passes), or not (None: free now)."""
        if fence is not None: self.inflight.extend((s, e, fence) for s, e in self.building)
        self.building = []


class NVServedDevice:
    """One client's NV device: an `NVDevice` of this process whose queues run the client's packets (an Executor as
    hcq serve uses one: `device_id`, `handle`, `open_ring`, `ring_state`, `error`, `recover`)."""

    def __init__(self, name: str, index: int):
        self.name, self.index = name, index
        with _open_lock:
            if (other := _open_gpus.get(index)) is not None:
                raise HCQError(f"{name}: GPU {index} is open for {other.name} in this server process, and a process opens a GPU once "
                               "(the driver allows one device object per GPU and client): serve with a worker per client (the default "
                               "isolation), not --isolation none, for several clients of one GPU")
            self.dev = NVDevice(f"NV:{index}")
            _open_gpus[index] = self
        self.device_id = next(_device_ids)
        _devices[self.device_id] = name
        self.handle = self.device_id
        self.host_ranges = HostRanges()
        self.programs: dict[int, NVProgram] = {}
        self.feeds: list[_Feed] = []
        self._failed = ctypes.c_int32(0)
        self._error: str | None = None
        self._lock = threading.Lock()  # the batches in flight and the failure
        self._fail_lock = threading.Lock()  # one failure at a time
        self._cond = threading.Condition(self._lock)
        self._pending: dict[tuple[str, int], collections.deque[_Batch]] = collections.defaultdict(collections.deque)  # per ring
        self._stopping = False
        self._stopping_feeds = False  # (set when the rings are told to stop: a translator waiting for room gives up)
        try:
            self.arena = _LaunchArena(self)
        except BaseException:
            self._close_now()
            raise
        self._closing, self._memories = False, 0  # (closing: once the last memory went)
        self._mem_lock = threading.RLock()  # (re-entrant: a collection inside it may finalize another NVMemory of this device)
        self._completer = threading.Thread(target=self._complete, name=f"{name} completions", daemon=True)
        self._completer.start()

    # ---- what hcq serve calls
    def open_ring(self, kind: str, index: int) -> int:
        f = _Feed(self, kind, index)  # (a queue opened twice is refused by hcq serve, for every backend)
        self.feeds.append(f)
        return int(f.handle)

    def _feed_of(self, handle: int) -> _Feed:
        return next(f for f in self.feeds if f.handle == handle)

    def ring_state(self, handle: Any) -> RingState:
        f, lib = self._feed_of(handle), feed()
        return RingState(int(lib.hcq_feed_rptr(f.handle)), int(lib.hcq_feed_wptr(f.handle)), f.packets_done)

    def error(self) -> str | None:
        return self._error

    def recover(self) -> None:
        raise HCQError(f"{self.name} cannot recover from a failure (NV devices do not)")

    def failed_flag(self) -> int:
        return ctypes.addressof(self._failed)

    def load(self, source: str, name: str) -> tuple[int, int, list[ArgSlot], NVProgram]:
        prg = NVProgram(self.dev, name, NVCompiler(self.dev.sm_name).compile(source))
        self.programs[prg.program_address] = prg
        # (a client lays arguments out from the block's start: the parameters' offsets include the bank's driver words)
        slots = [ArgSlot(s.name, s.ctype, s.is_pointer, prg.args_offset + s.offset, s.fmt, read_only=s.read_only) for s in prg.arg_slots]
        return prg.program_address, prg.block_size, slots, prg

    # ---- translating packets
    def run_words(self, f: _Feed, words: list[int]) -> None:
        """Translate one ring's new words and submit them in segments (or, once the device failed, store their signals
        poisoned). A segment ends after each SIGNAL, WRITE and signal WAIT, and before each WAIT and POLL: a store is
        handed over as soon as the GPU made it, never held back behind a wait that only a later host step releases, and
        a wait's poison is looked at as soon as it passed."""
        q, batch = self._segment(f)
        try:
            for op, flags, cond, p in self._packets(words):
                f.packets_done += 1
                if self._error is None and op is not None:
                    if op in (Op.WAIT, Op.POLL) and q._q: q, batch = self._flush(f, q, batch)
                    try:
                        self._packet(f, q, op, flags, cond, p, batch)
                        if op in (Op.SIGNAL, Op.WRITE) or (op == Op.WAIT and flags & FLAG_SIGNAL) or len(q._q) > SEGMENT_WORDS or \
                                (op == Op.EXEC and self.arena.building_bytes() > LAUNCH_ARENA_BYTES // 2):
                            q, batch = self._flush(f, q, batch)
                        continue
                    except Exception as e:  # noqa: BLE001 - any packet that cannot be run fails the device, which drains on
                        self.fail(f"{f.kind} queue {f.index}: {e if isinstance(e, (_Fault, HCQError)) else repr(e)}")
                elif op is None and self._error is None:
                    self.fail(f"{f.kind} queue {f.index}: {p[0]}")
                if op == Op.SIGNAL and flags & FLAG_SIGNAL: batch.signals.append((p[1], p[2]))
        except _Fault as e:  # (words that do not decode: what follows cannot be read)
            self.fail(f"{f.kind} queue {f.index}: {e}")
        self._flush(f, q, batch)

    def _segment(self, f: _Feed) -> tuple[NVQueue, _Batch]:
        return (NVComputeQueue() if f.kind == COMPUTE else NVCopyQueue(f.index)), _Batch(None)

    def _flush(self, f: _Feed, q: NVQueue, batch: _Batch) -> tuple[NVQueue, _Batch]:
        """Submit a segment (unless the device failed) and queue its stores for the completion thread; a new segment."""
        if self._error is None and q._q and self._channel_room(f, q):
            try:
                q.submit(self.dev)
                batch.fence = q._last_fence
            except Exception as e:  # noqa: BLE001 - as in run_words
                self.fail(f"{f.kind} queue {f.index}: {e if isinstance(e, HCQError) else repr(e)}")
        if f.kind == COMPUTE: self.arena.settle(batch.fence)
        if batch.fence is not None or batch.stores or batch.signals:
            with self._cond:
                self._pending[(f.kind, f.index)].append(batch)
                self._cond.notify_all()
        return self._segment(f)

    def _channel_room(self, f: _Feed, q: NVQueue) -> bool:
        """Wait, for as long as it takes, until q's channel has a GPFIFO entry free (its earlier segments may wait on the
        GPU for a long time; the channel's own wait gives up after seconds). False: the device failed or the ring stops."""
        ch = self.dev.channel(q.kind, q.index)
        delay = POLL_S
        while ch.put - ch._fetched() >= ch.entries - 2:
            if self._error is not None: return False
            if feed().hcq_feed_stopped(f.handle):
                self.fail(f"{f.kind} queue {f.index}: the device was closed while its queue waited")
                return False
            time.sleep(delay)
            delay = min(delay * 2, POLL_MAX_S)
        return True

    def _packets(self, words: list[int], depth: int = 0) -> Any:
        """(op, flags, poll condition, packet words) of each packet, INDIRECT runs read in; (None, 0, 0, [why]) for an
        INDIRECT that cannot be run (the next packet follows); _Fault where the words do not decode."""
        i = 0
        while i < len(words):
            op, n, flags, cond = decode_header(words[i])
            if not isinstance(op, Op): raise _Fault(f"unknown opcode {op} at word {i}")
            want = packets.PACKET_WORDS[op] + (1 if op == Op.COPY and flags & FLAG_GUARD else 0)
            if n != want or i + n > len(words): raise _Fault(f"a {op.name} packet of {n} words (it has {want})")
            p = words[i:i + n]
            i += n
            if op != Op.INDIRECT:
                yield op, flags, cond, p
                continue
            addr, nwords = p[1], p[2]
            inner = None if depth else self.host_ranges.words(addr, nwords)
            if inner is None:
                why = "an INDIRECT inside an INDIRECT" if depth else f"INDIRECT of {nwords} words at 0x{addr:x}: not in this device's runtime memory"
                yield None, 0, 0, [why]
                continue
            try:
                yield from self._packets(inner, depth + 1)
            except _Fault as e:
                yield None, 0, 0, [f"in the INDIRECT run at 0x{addr:x}: {e}"]

    def _packet(self, f: _Feed, q: NVQueue, op: Op, flags: int, cond: int, p: list[int], batch: _Batch) -> None:
        if op == Op.WAIT:
            q.semaphore(p[1], p[2], operation="acq_strict_geq", payload_size="64bit")
            if flags & FLAG_SIGNAL: batch.waits.append(p[1])
        elif op == Op.SIGNAL:
            q.semaphore(p[1], p[2], operation="release", release_wfi="en", payload_size="64bit")
            if flags & FLAG_SIGNAL:
                batch.signals.append((p[1], p[2]))
                batch.stores.append((p[1], SIGNAL_SIZE, FLAG_SIGNAL))
            else: batch.stores.append((p[1], 8, 0))
        elif op == Op.TIMESTAMP:
            # the GPU stores its time 8 bytes past a semaphore: one that adds 0 to the word before the address
            if p[1] % 8 or p[1] < 8: raise _Fault(f"TIMESTAMP at 0x{p[1]:x}: not a signal's timestamp word")
            q.semaphore(p[1] - SIGNAL_TIMESTAMP_OFFSET, 0, operation="reduction", reduction="iadd", reduction_format="unsigned",
                        release_wfi="en", payload_size="64bit", release_timestamp="en")
            batch.stores.append((p[1], 8, 0))
        elif op == Op.BARRIER:
            if f.kind == COMPUTE: q._memory_barrier()  # (a copy channel runs its copies in order: nothing to flush)
        elif op == Op.EXEC:
            if f.kind != COMPUTE: raise _Fault("EXEC on a copy queue")
            self._exec(q, p)
        elif op == Op.COPY:
            if flags & FLAG_GUARD: raise _Fault("a cancellable COPY (NV copy engines run none)")
            if f.kind != COPY: raise _Fault("COPY on a compute queue (NV copies run on copy queues)")
            if p[3] >= 1 << VA_BITS or max(p[1], p[2]) + p[3] > 1 << 64:
                raise _Fault(f"COPY of {p[3]} bytes 0x{p[2]:x} -> 0x{p[1]:x}: past the GPU's {VA_BITS}-bit address space")
            if p[3]:
                q._copy(p[1], p[2], p[3], None)
                batch.stores.append((p[1], p[3], 0))
        elif op == Op.WRITE:
            b64 = bool(flags & FLAG_B64)
            q.semaphore(p[1], p[2] & ((1 << 64) - 1 if b64 else 0xFFFFFFFF), operation="release", release_wfi="en",
                        payload_size="64bit" if b64 else "32bit")
            batch.stores.append((p[1], 8 if b64 else 4, 0))
        elif op == Op.POLL:
            b64 = bool(flags & FLAG_B64)
            full = (1 << 64) - 1 if b64 else 0xFFFFFFFF
            if cond not in _ACQUIRE_OPS: raise _Fault(f"POLL with unknown condition {cond}")
            if cond == PollCondition.EQ and p[3] & full != full: raise _Fault("a masked POLL (NV semaphore acquires take no mask)")
            q.semaphore(p[1], p[2] & full, operation=_ACQUIRE_OPS[PollCondition(cond)], payload_size="64bit" if b64 else "32bit")
        else:
            raise _Fault(f"{op.name} packets are not run here")

    def _exec(self, q: NVQueue, p: list[int]) -> None:
        prg = self.programs.get(p[1])
        if prg is None: raise _Fault(f"EXEC of an entry 0x{p[1]:x} that no kernel loaded on this device has")
        kernargs = p[2]
        dims = p[EXEC_DIMS_AT:EXEC_DIMS_AT + 6]
        if any(d <= 0 for d in dims): raise _Fault(f"EXEC over {tuple(dims[:3])} x {tuple(dims[3:])}: every dimension must be positive")
        block = self.arena.take(prg.block_size)  # (the launch's bank and QMD: the client's block is only read, see _LaunchArena)
        if not self.host_ranges.access(kernargs, prg.bank_size, functools.partial(ctypes.memmove, block, kernargs, prg.bank_size)):
            raise _Fault(f"EXEC with {prg.bank_size} bytes of kernargs at 0x{kernargs:x}: not in this device's runtime memory")
        view = MMIOInterface(block, prg.block_size)
        view.view(0, 4 * len(prg.driver_words), "I")[:] = array("I", prg.driver_words)
        try:
            q._exec(prg, _Kernargs(HCQBuffer(block, prg.block_size, view=view)), tuple(dims[:3]), tuple(dims[3:]))  # type: ignore[arg-type]
        except ValueError as e:
            raise _Fault(str(e)) from None

    # ---- completions, failure
    def _complete(self) -> None:
        try:
            self._completions()
        except BaseException as e:  # (a bug here must not leave the client waiting on stores nobody hands over)
            self.fail(f"the server's completion thread stopped: {e!r}")
            with self._cond: self._stopping = True
            for batches in list(self._pending.values()):
                for batch in list(batches): self._hand_over(batch)
            raise

    def _completions(self) -> None:
        """Hand each batch's stores to the hook once its fence passed, in each ring's submission order (rings wait for
        each other only through signals: a batch blocked on one ring holds back no other ring's); notice faults."""
        since = time.monotonic()  # when the oldest head still waited for began to
        while True:
            with self._cond:
                while not any(self._pending.values()) and not self._stopping:
                    self._cond.wait(0.05)
                    since = time.monotonic()
                if not any(self._pending.values()) and self._stopping: return
                heads = [(key, batches[0]) for key, batches in self._pending.items() if batches]
            progressed = False
            for key, batch in heads:
                if batch.fence is not None and self._error is None and not self._finished(batch): continue
                self._hand_over(batch)
                with self._cond: self._pending[key].popleft()
                progressed = True
            if progressed:
                since = time.monotonic()
            elif (why := self._gpu_error()) is not None:
                self.fail(why)
            else:  # (a tenth of the time waited so far: a short kernel is seen at once, a long wait costs few looks)
                time.sleep(min(max(POLL_S, (time.monotonic() - since) / 10), POLL_MAX_S))

    def _finished(self, batch: _Batch) -> bool:
        """Whether the GPU ran `batch` (then a poisoned signal that released one of its WAITs fails the device)."""
        ring, value = batch.fence  # type: ignore[misc]
        if ring.fence.load() < value: return False
        for addr in batch.waits:
            tag = self.host_ranges.words(addr + SIGNAL_TIMESTAMP_OFFSET, 1)  # (None: memory only the GPU sees, which nothing here poisons)
            if tag is not None and tag[0] & POISON_MASK == POISON_TAG:
                self.fail(f"a WAIT for the signal at 0x{addr:x} was released by a poisoned value (stored by {poisoner_text(tag[0] & 0xFFFFFFFF)})")
                break
        return True

    def _hand_over(self, batch: _Batch) -> None:
        """The batch's stores to the hook; once the device failed, its signals stored poisoned instead."""
        if self._error is None:
            for addr, nbytes, flags in batch.stores: _stored(addr, nbytes, flags)
            return
        for addr, value in batch.signals:  # (the server stores only into this client's runtime memory)
            if self.host_ranges.access(addr, SIGNAL_SIZE, functools.partial(feed().hcq_feed_signal_poison, addr, value, self.device_id)):
                _stored(addr, SIGNAL_SIZE, FLAG_SIGNAL)

    def _gpu_error(self) -> str | None:
        try:
            return self.dev._device_error()
        except Exception as e:  # noqa: BLE001 - reading the notifier of a closing device
            return f"the device's state cannot be read ({e})"

    def fail(self, why: str) -> None:
        """Fail the device for good. Its failure word is set and handed to the hook (the client's copy of it) before the
        failure shows here, so every poisoned store comes after it: a client that sees one sees the failure."""
        with self._fail_lock:
            if self._error is not None: return
            self._failed.value = 1
            _stored(ctypes.addressof(self._failed), 4, 0)
            with self._lock: self._error = why

    def stop(self) -> bool:
        """Stop the rings and the threads; True once nothing it was given runs on the GPU any more (it all ran, or the GPU
        stopped the channels); False when something still runs after STOP_S (the device and its memory are left)."""
        self._stopping_feeds = True
        for f in self.feeds: feed().hcq_feed_stop(f.handle)
        for f in self.feeds: f.thread.join()
        deadline = time.monotonic() + STOP_S
        while not self.dev._drained():  # (every ring's fence at its last submission's count)
            if self._gpu_error() is not None: break  # (a stopped channel runs nothing more)
            if time.monotonic() > deadline: return False
            time.sleep(0.001)
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._completer.join()
        return True

    # ---- memory, and closing once the last of it went
    def alloc(self, size: int, host_visible: bool) -> HCQBuffer:
        with self._mem_lock:
            if self._closing: raise MemoryError(f"{self.name} is closing")
            with self.dev._memory_lock: buf = self.dev.alloc_device(size, cpu_access=host_visible, guarded=True)
            self._memories += 1
            return buf

    def free(self, buf: HCQBuffer) -> None:
        with self._mem_lock:
            with self.dev._memory_lock: self.dev.free_memory(buf)
            self._memories -= 1
            last = self._closing and not self._memories
        if last: self._close_now()

    def close(self) -> None:
        """The client closed the device: it goes once the last of its memory has (the client's mappings of it may
        outlive the device, and its addresses must not be handed out again meanwhile)."""
        for f in self.feeds: feed().hcq_feed_destroy(f.handle)
        self.feeds = []
        with self._mem_lock:
            self._closing = True
            last = not self._memories
        if last: self._close_now()

    def _close_now(self) -> None:
        if self._error is not None: self.dev._abort(f"{self.name} failed: {self._error}")  # (closing does not wait for queues then)
        try:
            self.dev.close()
        finally:
            with _open_lock:
                if _open_gpus.get(self.index) is self: del _open_gpus[self.index]
        _devices.pop(self.device_id, None)


@dataclass
class _Kernargs:
    """What NVComputeQueue._exec reads of an args state: the kernargs block."""
    buf: HCQBuffer


class NVHost:
    """Hosts NV devices: one NV device of this process per client, its packets translated into the GPU's methods."""
    kind = "NV"
    stores = HOST_STORES
    queue_state_fields = ("rptr", "wptr", "packets_done")
    stores_before_hook = True  # (a batch's stores are handed over once its fence passed)
    devices_share_memory = False  # (each GPU has its own address space, and hcq maps no memory between GPUs)

    def preload(self) -> None:
        feed()

    def native_functions(self) -> tuple[int, int, int]:
        return _address("hcq_feed_submit"), _address("hcq_feed_signal_store"), _address("hcq_feed_rptr")

    def set_idle_hook(self, fn: int | None, ctx: int | None) -> None:
        """The feed threads lend no idle time: the server's progress thread takes every message."""

    def queue_settings(self) -> tuple[int, int]:
        from hcq.backends.nv.device import COPY_CHANNELS
        return 1, COPY_CHANNELS

    def now_ns(self) -> int:
        return time.monotonic_ns()

    def describe(self, executor: Any) -> dict[str, Any]:
        dev: NVDevice = executor.dev
        # (the client's queues are 64-bit packets; their words become 64-bit semaphore payloads and 32-bit QMD fields here)
        caps = {**dev.capabilities.to_wire(), "word_bits": 64}
        return {"capabilities": caps, "max_grid": list(dev.max_grid), "max_block": list(dev.max_block),
                "max_block_threads": dev.max_block_threads, "timestamp_divider": dev.timestamp_divider, "language": "c",
                "compiler": NVCompiler(dev.sm_name).version(), "conformance_kernels": CONFORMANCE_KERNELS, "memory_host_visible": False}

    def open_device(self, name: str, workers: int) -> NVServedDevice:
        kind, _, index = name.partition("@")[0].partition(":")
        return NVServedDevice(name, int(index or 0))

    def failed_flag(self, executor: Any) -> int:
        return executor.failed_flag()

    def stop_device(self, executor: Any, rings: list[Any]) -> bool:
        if not executor.stop(): return False  # the GPU still runs something: the device and its memory stay
        executor.close()
        return True

    def memory(self, size: int, executor: Any, shareable: bool = False, fd: int | None = None, host: bool = True) -> NVMemory:
        if fd is not None: raise MemoryError(f"{executor.name}: NV servers map no client memory (their devices store before the hook)")
        return NVMemory(executor, size, host_visible=host)

    def load(self, source: str, name: str, executor: Any) -> tuple[int, int, list[Any], Any, None]:
        entry, size, slots, prg = executor.load(source, name)
        return entry, size, slots, prg, None

    def cas64(self, addr: int, expected: int, desired: int) -> int:
        return atomics.cas64(addr, expected, desired)

    def poison(self, addr: int, value: int, poison_id: int) -> None:
        feed().hcq_feed_signal_poison(addr, value, poison_id)
        _stored(addr, SIGNAL_SIZE, FLAG_SIGNAL)


