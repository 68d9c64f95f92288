"""TOY: a backend written in pure Python, to prove the backend seam (hcq.packet_queue's Executor, the allocator
hooks, HCQProgram / CLikeArgsState, HCQSignal) carries a device that shares nothing with the CPU backend.

- Executor: one Python thread per ring decodes and runs hcq packets (hcq.packets), with a failure state that
  drains rings by storing poisoned SIGNALs, as the packet format asks.
- Memory: anonymous mmaps, host-visible, registered in a table of regions: every address a packet or a kernel
  touches is checked against it, so a bad address fails the device instead of crashing the process.
- Kernels: Python source. A kernel is a function whose parameters are annotated with their types:

      def fill(out: "u32*", value: "u32", n: "u32", *, gid):
          if gid < n: mem(out, n)[gid] = value

  pointers ("u32*", "f32*", "void*", ...) are 8-byte device addresses, scalars "u8" "i8" "u16" "i16" "u32" "i32"
  "u64" "i64" "f32" "f64"; the kernargs block is laid out like the C struct of the parameters. Keyword-only
  parameters ask for the thread's position: `gid` (the global id along x: block_x * local_x + thread_x) and/or
  `ctx` (a ThreadCtx). Kernels reach memory through `mem(addr, count, fmt="I")` (a memoryview of `count` items),
  `load(addr, fmt="I")` and `store(addr, value, fmt="I")`; `sleep`, `math` and `struct` are in scope too.

`register()` makes `hcq.Device("TOY")` / `"TOY:1"` open devices of this backend (all in peer group "TOY")."""
from __future__ import annotations

import bisect
import ctypes
import inspect
import itertools
import math
import mmap
import struct
import threading
import time
from typing import Any, Callable, Sequence

from hcq.allocator import HCQAllocator
from hcq.device import HCQCompiled
from hcq.errors import CompileError, HCQError
from hcq.interfaces import COMPUTE, COPY, Capabilities
from hcq.memory import BufferSpec, HCQBuffer, MMIOInterface
from hcq.packet_queue import Executor, PacketComputeQueue, PacketCopyQueue, RingState, SubmitStatus
from hcq.packets import (FLAG_B64, FLAG_GUARD, FLAG_SIGNAL, GUARD_DONE, GUARD_PENDING, GUARD_RUNNING, PACKET_WORDS,
                         POISON_MASK, POISON_TAG, SIGNAL_TIMESTAMP_OFFSET, WORD_MAX, Op, PollCondition, decode_header,
                         poll_holds)
from hcq.program import ArgSlot, CLikeArgsState, HCQProgram
from hcq.signal import HCQSignal

WRITE_DELAY_S = 0.0  # seconds each WRITE packet takes (a test slows the device with it)

RING_WORDS = 1 << 14
MAX_PACKET_WORDS = 16
_ATOMIC_LOCK = threading.Lock()  # every read-modify-write of a word (guard claims, host compare_exchange) holds it


# ------------------------------------------------------------------ memory regions
class ToyFault(Exception):
    """An access outside every live TOY allocation (the device fails with this text)."""


class _Region:
    """One anonymous mapping and the ctypes window that gives its address (kept alive by every host view)."""
    __slots__ = ("mm", "window", "addr", "size", "__weakref__")

    def __init__(self, size: int):
        self.mm = mmap.mmap(-1, size)
        self.window = (ctypes.c_char * size).from_buffer(self.mm)
        self.addr, self.size = ctypes.addressof(self.window), size


_region_lock = threading.Lock()
_region_starts: list[int] = []
_region_ends: list[int] = []


def _register_region(r: _Region) -> None:
    """Enter a fresh mapping in the table. An entry it overlaps is stale (a buffer dropped without `free` lost its
    mapping to the garbage collector, and the OS handed the addresses out again), so it goes: otherwise the stale,
    smaller entry would shadow the new one and a copy into the new mapping would fault."""
    with _region_lock:
        end = r.addr + r.size
        i = bisect.bisect_left(_region_starts, end)  # entries from i on start at or past the new end
        while i > 0 and _region_ends[i - 1] > r.addr: i -= 1; del _region_starts[i], _region_ends[i]
        _region_starts.insert(i, r.addr)
        _region_ends.insert(i, end)


def _unregister_region(r: _Region) -> None:
    with _region_lock:
        i = bisect.bisect_left(_region_starts, r.addr)
        if i < len(_region_starts) and (_region_starts[i], _region_ends[i]) == (r.addr, r.addr + r.size):
            del _region_starts[i], _region_ends[i]


def check_range(addr: int, nbytes: int) -> None:
    """Raise ToyFault unless [addr, addr + nbytes) lies inside one live TOY allocation."""
    if nbytes <= 0: return
    with _region_lock:
        i = bisect.bisect_right(_region_starts, addr) - 1
        ok = i >= 0 and addr + nbytes <= _region_ends[i]
    if not ok: raise ToyFault(f"access of {nbytes} bytes at address 0x{addr:x} is outside every TOY allocation")


def _u64(addr: int) -> Any:
    check_range(addr, 8)
    return ctypes.c_uint64.from_address(addr)


def _u32(addr: int) -> Any:
    check_range(addr, 4)
    return ctypes.c_uint32.from_address(addr)


# ---- what kernels use
_tls = threading.local()  # .views: memoryviews made during the current EXEC (cleared after it)


def mem(addr: int, count: int, fmt: str = "I") -> memoryview:
    """`count` items of struct format `fmt` at device address `addr`, as a writable memoryview."""
    cache = getattr(_tls, "views", None)
    key = (addr, count, fmt)
    if cache is not None and (mv := cache.get(key)) is not None: return mv
    nbytes = count * struct.calcsize(fmt)
    check_range(addr, nbytes)
    mv = memoryview((ctypes.c_char * nbytes).from_address(addr)).cast("B").cast(fmt) if nbytes else memoryview(b"").cast(fmt)  # type: ignore[call-overload]
    if cache is not None: cache[key] = mv
    return mv


def load(addr: int, fmt: str = "I") -> Any:
    return mem(addr, 1, fmt)[0]


def store(addr: int, value: Any, fmt: str = "I") -> None:
    mem(addr, 1, fmt)[0] = value


KERNEL_GLOBALS = {"mem": mem, "load": load, "store": store, "sleep": time.sleep, "math": math, "struct": struct}


# ------------------------------------------------------------------ the executor
class _Ring:
    """A ring of 64-bit words with read/write positions and a condition variable as doorbell."""

    def __init__(self, kind: str, index: int, capacity: int):
        self.kind, self.index, self.capacity = kind, index, capacity
        self.words = [0] * capacity
        self.rptr = self.wptr = self.packets_done = 0
        self.cond = threading.Condition()
        self.stop = False
        self.cur: tuple[list[int], int, int | None] | None = None  # (packet words, ring word, indirect word index)
        self.thread: threading.Thread | None = None

    def __repr__(self) -> str:
        return f"<toy ring {self.kind}{self.index} r={self.rptr} w={self.wptr}>"


class _Stopped(Exception):
    """The ring was told to stop while a packet was waiting."""


_executor_ids = itertools.count(1)
_devices_by_id: dict[int, "ToyDevice"] = {}
_programs: dict[int, "ToyProgram"] = {}  # EXEC entry word -> program (kept for good: an EXEC in flight may outlive the caller)
_program_ids = itertools.count(1)


class ToyExecutor(Executor):
    """A Python thread per ring running hcq packets; a failure is sticky until `recover()`."""
    ring_words = RING_WORDS

    def __init__(self, device: str):
        self.device, self.device_id = device, next(_executor_ids)
        self._error: str | None = None
        self._fail_lock = threading.Lock()

    # ---- the Executor interface
    def open_ring(self, kind: str, index: int) -> _Ring:
        r = _Ring(kind, index, self.ring_words)
        r.thread = threading.Thread(target=self._run, args=(r,), name=f"{self.device} {kind}{index}", daemon=True)
        try:
            r.thread.start()
        except RuntimeError as e:
            raise HCQError(f"{self.device}: cannot start the thread of its {kind} queue {index}: {e}") from None
        return r

    def try_submit(self, handle: Any, addr: int, nwords: int, timeout_ns: int) -> int:
        r: _Ring = handle
        if r.stop: return SubmitStatus.STOPPED
        if nwords > r.capacity: return SubmitStatus.TOO_BIG
        if r.thread is None or not r.thread.is_alive(): return SubmitStatus.NO_THREAD
        words = list((ctypes.c_uint64 * nwords).from_address(addr)) if nwords else []
        deadline = time.monotonic() + timeout_ns / 1e9
        with r.cond:
            while r.capacity - (r.wptr - r.rptr) < nwords:
                if r.stop: return SubmitStatus.STOPPED
                left = deadline - time.monotonic()
                if left <= 0: return SubmitStatus.FULL
                r.cond.wait(left)
            if r.stop: return SubmitStatus.STOPPED
            cap, w = r.capacity, r.wptr
            for i, word in enumerate(words): r.words[(w + i) % cap] = word
            r.wptr = w + nwords
            r.cond.notify_all()
        return SubmitStatus.OK

    def consumed(self, handle: Any) -> int:
        return handle.rptr

    def room(self, handle: Any) -> int:
        r: _Ring = handle
        return r.capacity - (r.wptr - r.rptr)

    def ring_state(self, handle: Any) -> RingState:
        r: _Ring = handle
        with r.cond:
            rptr, wptr, done, cur = r.rptr, r.wptr, r.packets_done, r.cur
        if cur is None: return RingState(rptr, wptr, done)
        return RingState(rptr, wptr, done, list(cur[0]), cur[1], cur[2])

    def error(self) -> str | None:
        return self._error

    def recover(self) -> None:
        with self._fail_lock:
            self._error = None

    def submit_error(self, handle: Any, status: int) -> str:
        if status == SubmitStatus.TOO_BIG: return f"the submission exceeds the ring's {handle.capacity} words"
        if status == SubmitStatus.NO_THREAD: return "the ring's thread is not running"
        return super().submit_error(handle, status)

    def close(self, handles: Sequence[Any], release: bool = False) -> bool:
        for r in handles:
            with r.cond:
                r.stop = True
                r.cond.notify_all()
        for r in handles:
            if r.thread is not None and r.thread is not threading.current_thread(): r.thread.join(timeout=1.0)
        return not any(r.thread is not None and r.thread.is_alive() for r in handles)

    # ---- failures
    def fail(self, msg: str) -> None:
        with self._fail_lock:
            if self._error is None: self._error = msg

    @property
    def failed(self) -> bool:
        return self._error is not None

    # ---- the ring thread
    def _run(self, r: _Ring) -> None:
        while True:
            with r.cond:
                while r.rptr == r.wptr and not r.stop: r.cond.wait(0.5)
                if r.stop: return
                rp, wp = r.rptr, r.wptr
                hdr = r.words[rp % r.capacity]
                n = (hdr >> 8) & 0xFF
                if n == 0 or n > MAX_PACKET_WORDS or n > wp - rp:
                    # Submissions are published whole, so this is garbage: drop all that was published.
                    self.fail(f"malformed packet header 0x{hdr:x} at ring word {rp}")
                    pkt = None
                else:
                    pkt = [r.words[(rp + i) % r.capacity] for i in range(n)]
                    r.cur = (pkt, rp, None)
            if pkt is not None:
                try:
                    self._exec_packet(r, pkt, rp, nested=False)
                except _Stopped:
                    return
                except Exception as e:  # noqa: BLE001 - a bug in the toy must fail the device, not kill the thread
                    self.fail(f"the TOY executor raised {type(e).__name__}: {e}")
            with r.cond:
                r.rptr = rp + n if pkt is not None else wp
                r.packets_done += 1
                r.cur = None
                r.cond.notify_all()  # submitters waiting for room

    def _wait_until(self, r: _Ring, holds: Any) -> bool:
        """Poll `holds()` with short sleeps; False when the device failed meanwhile (the packet is dropped)."""
        delay = 0.00002
        while not holds():
            if r.stop: raise _Stopped
            if self._error is not None: return False
            time.sleep(delay)
            delay = min(delay * 2, 0.001)
        return True

    def _exec_packet(self, r: _Ring, p: list[int], pos: int, nested: bool) -> None:
        op, n, flags, cond = decode_header(p[0])
        if not isinstance(op, Op):
            self.fail(f"unknown packet opcode {op} (header 0x{p[0]:x})")
            return
        need = PACKET_WORDS[op] + (1 if op == Op.COPY and flags & FLAG_GUARD else 0)
        if n < need:
            self.fail(f"malformed packet: opcode {int(op)} needs {need} words, its header says {n}")
            return
        if self._error is not None: return self._drain_packet(r, p, op, flags, pos, nested)
        try:
            if op == Op.WAIT:
                word = _u64(p[1])
                if not self._wait_until(r, lambda: word.value >= p[2]): return
                if flags & FLAG_SIGNAL:
                    ts = _u64(p[1] + SIGNAL_TIMESTAMP_OFFSET).value
                    if ts & POISON_MASK == POISON_TAG: self._fail_from_peer(ts & 0xFFFFFFFF, p[1], p[2])
            elif op == Op.SIGNAL:
                word = _u64(p[1])
                if flags & FLAG_SIGNAL:
                    ts = _u64(p[1] + SIGNAL_TIMESTAMP_OFFSET)
                    if ts.value & POISON_MASK == POISON_TAG: ts.value = 0
                word.value = p[2]
            elif op == Op.TIMESTAMP:
                _u64(p[1]).value = time.perf_counter_ns()
            elif op == Op.BARRIER:
                pass  # one address space, stores are visible to every thread once made
            elif op == Op.EXEC:
                self._exec_kernel(r, p)
            elif op == Op.COPY:
                self._exec_copy(p, flags)
            elif op == Op.WRITE:
                if WRITE_DELAY_S: time.sleep(WRITE_DELAY_S)  # a slow but in-order device (the kit must not race it)
                if flags & FLAG_B64: _u64(p[1]).value = p[2]
                else: _u32(p[1]).value = p[2] & 0xFFFFFFFF
            elif op == Op.POLL:
                if cond not in PollCondition._value2member_map_:
                    self.fail(f"POLL with unknown condition {cond}")
                    return
                bits = 64 if flags & FLAG_B64 else 32
                word = _u64(p[1]) if bits == 64 else _u32(p[1])
                c, value, mask = PollCondition(cond), p[2], p[3]
                self._wait_until(r, lambda: poll_holds(c, word.value, value, mask, bits))
            elif op == Op.INDIRECT:
                if nested:
                    self.fail(f"indirect packet inside an indirect buffer at 0x{p[1]:x} ({p[2]} words)")
                    return
                self._run_indirect(r, p[1], p[2], pos)
        except ToyFault as e:
            self.fail(f"{'an' if op.name[0] in 'AEIOU' else 'a'} {op.name} packet faulted: {e}")

    def _drain_packet(self, r: _Ring, p: list[int], op: Op, flags: int, pos: int, nested: bool) -> None:
        """A failed device: SIGNALs of signals are stored, poisoned; bound queues are walked for theirs."""
        try:
            if op == Op.INDIRECT and not nested: return self._run_indirect(r, p[1], p[2], pos)
            if op != Op.SIGNAL or not flags & FLAG_SIGNAL: return None
            ts, word = _u64(p[1] + SIGNAL_TIMESTAMP_OFFSET), _u64(p[1])
            ts.value = POISON_TAG | self.device_id
            word.value = p[2]
        except ToyFault:
            pass  # a bad signal address: nothing more to record on a failed device
        return None

    def _fail_from_peer(self, peer_id: int, addr: int, value: int) -> None:
        peer = _devices_by_id.get(peer_id)
        name = peer.device if peer is not None else f"TOY device #{peer_id}"
        why = (peer.executor.error() if peer is not None and peer.executor is not None else None) or "(its failure was cleared since)"
        self.fail(f"a WAIT for signal 0x{addr:x} >= {value} was released by {name} after {name} failed, so the work it waited for "
                  f"did not run ({name}: {why}); recover both devices")

    def _run_indirect(self, r: _Ring, addr: int, nwords: int, pos: int) -> None:
        check_range(addr, nwords * 8)
        words = list((ctypes.c_uint64 * nwords).from_address(addr)) if nwords else []
        i = 0
        while i < nwords:
            n = (words[i] >> 8) & 0xFF
            if n == 0 or n > MAX_PACKET_WORDS or n > nwords - i:
                self.fail(f"malformed packet header 0x{words[i]:x} at word {i} of an indirect buffer")
                return
            pkt = words[i:i + n]
            r.cur = (pkt, pos, i)
            self._exec_packet(r, pkt, pos, nested=True)
            i += n

    def _exec_copy(self, p: list[int], flags: int) -> None:
        dest, src, nbytes = p[1], p[2], p[3]
        guard = _u64(p[4]) if flags & FLAG_GUARD else None
        if guard is not None:
            with _ATOMIC_LOCK:
                if guard.value != GUARD_PENDING: return  # cancelled by the host
                guard.value = GUARD_RUNNING
        try:
            check_range(src, nbytes)
            check_range(dest, nbytes)
            if nbytes: ctypes.memmove(dest, src, nbytes)
        finally:
            if guard is not None: guard.value = GUARD_DONE

    def _exec_kernel(self, r: _Ring, p: list[int]) -> None:
        try:
            run_kernel(p[1], p[2], tuple(p[3:9]), lambda: r.stop)
        except KernelError as e:
            self.fail(str(e))


class KernelError(Exception):
    """A launch the device refuses, or a kernel that faulted or raised: the device's failure."""


def run_kernel(entry: int, kernargs: int, dims: tuple[int, ...], stopped: Callable[[], bool]) -> None:
    """Run the kernel `entry` over its grid: the body of an EXEC (raises KernelError, or _Stopped when `stopped()`)."""
    gx, gy, gz, lx, ly, lz = dims
    if not all(d >= 1 for d in dims) or lx * ly * lz > ToyDevice.max_block_threads:
        raise KernelError(f"EXEC of a grid of {(gx, gy, gz)} blocks of {(lx, ly, lz)} threads: every dimension must be >= 1 and a "
                          f"block at most {ToyDevice.max_block_threads} threads")
    prg = _programs.get(entry)
    if prg is None: raise KernelError(f"EXEC of unknown kernel entry {entry}")
    try:
        check_range(kernargs, prg.kernargs_alloc_size)
    except ToyFault as e:
        raise KernelError(f"kernel {prg.name!r}: its kernargs are out of bounds: {e}") from None
    args = prg.unpacker.unpack_from((ctypes.c_char * prg.unpacker.size).from_address(kernargs)) if prg.unpacker.size else ()
    fn, want_gid, want_ctx = prg.fn, prg.want_gid, prg.want_ctx
    _tls.views = {}
    block = 0
    try:
        for bz in range(gz):
            for by in range(gy):
                for bx in range(gx):
                    block = bx + gx * (by + gy * bz)
                    if stopped(): raise _Stopped
                    for tz in range(lz):
                        for ty in range(ly):
                            for tx in range(lx):
                                kw: dict[str, Any] = {}
                                if want_gid: kw["gid"] = bx * lx + tx
                                if want_ctx: kw["ctx"] = ThreadCtx((bx * lx + tx, by * ly + ty, bz * lz + tz), (tx, ty, tz), (bx, by, bz),
                                                                   (gx * lx, gy * ly, gz * lz), (lx, ly, lz))
                                fn(*args, **kw)
    except (_Stopped, KernelError):
        raise
    except ToyFault as e:
        raise KernelError(f"kernel {prg.name!r} faulted in block {block}: {e}") from None
    except Exception as e:  # noqa: BLE001 - the kernel's exception is the device's failure
        raise KernelError(f"kernel {prg.name!r} raised {type(e).__name__} in block {block}: {e}") from None
    finally:
        _tls.views = None


class ThreadCtx:
    """Where a kernel thread is: global id, id in its block, block id (each (x, y, z)), and the sizes."""
    __slots__ = ("global_id", "local_id", "group_id", "global_size", "local_size")

    def __init__(self, global_id: tuple, local_id: tuple, group_id: tuple, global_size: tuple, local_size: tuple):
        self.global_id, self.local_id, self.group_id, self.global_size, self.local_size = global_id, local_id, group_id, global_size, local_size

    @property
    def gid(self) -> int:
        return self.global_id[0]


# ------------------------------------------------------------------ memory, signals
class ToyAllocator(HCQAllocator["ToyDevice"]):
    """Host memory (anonymous mmaps), host-visible; every TOY device shares the process's address space.
    Copies go through the core's staging ring (the toy declares no direct host copies)."""

    def __init__(self, dev: ToyDevice):
        super().__init__(dev, batch_size=1 << 20, batch_cnt=4)

    def _alloc(self, size: int, options: BufferSpec) -> HCQBuffer:
        try:
            region = _Region(size)
        except (OSError, ValueError) as e:
            raise MemoryError(f"{self.dev.device}: cannot allocate {size} bytes ({e})") from None
        _register_region(region)
        buf = HCQBuffer(region.addr, size, meta=options, view=MMIOInterface(region.addr, size, keepalive=region), owner=self.dev)
        buf._toy_region = region  # type: ignore[attr-defined]
        return buf

    def _free(self, buf: HCQBuffer, options: BufferSpec) -> None:
        region = getattr(buf, "_toy_region", None)
        if region is not None: _unregister_region(region)  # the device may no longer touch it
        buf.view = None  # the mapping goes with the last host view of it

    def _map_into(self, buf: HCQBuffer) -> HCQBuffer:
        if buf.owner is not None and not isinstance(buf.owner, ToyDevice):
            raise HCQError(f"{self.dev.device} cannot map {buf!r}: it belongs to another peer group")
        return buf


class ToySignal(HCQSignal):
    """A signal in host memory; compare_exchange shares the executor's lock for read-modify-writes (its timestamp
    divider comes from the device, `ToyDevice.timestamp_divider`)."""

    def compare_exchange(self, expected: int, desired: int) -> int:
        if self._value_mv is None: self._refuse_virtual()
        if type(desired) is not int or not 0 <= desired <= WORD_MAX: raise ValueError(f"compare_exchange of {desired!r}")
        with _ATOMIC_LOCK:
            cur: int = self._value_mv[0]
            if cur == expected: self._value_mv[0] = desired
        return cur

    def _wait_slice(self, value: int, ms: int) -> bool:
        end, delay = time.monotonic() + ms / 1000, 0.00002
        while self.load() < value:
            if time.monotonic() >= end: return False
            time.sleep(delay)  # a real sleep: the executor threads need the GIL to make progress
            delay = min(delay * 2, 0.0005)
        return True


# ------------------------------------------------------------------ programs
SCALARS = {"u8": "B", "i8": "b", "u16": "H", "i16": "h", "u32": "I", "i32": "i", "u64": "Q", "i64": "q", "f32": "f", "f64": "d"}
POSITION_PARAMS = ("gid", "ctx")


def kernel_layout(fn: Any) -> tuple[list[ArgSlot], int, bool, bool]:
    """(arg slots, kernargs size, wants gid, wants ctx) of a kernel function from its annotations."""
    slots, off, want = [], 0, set()
    for prm in inspect.signature(fn).parameters.values():
        if prm.kind == prm.KEYWORD_ONLY:
            if prm.name not in POSITION_PARAMS:
                raise ValueError(f"kernel {fn.__name__}: keyword-only parameter {prm.name!r} is not one of {POSITION_PARAMS}")
            want.add(prm.name)
            continue
        if prm.kind not in (prm.POSITIONAL_ONLY, prm.POSITIONAL_OR_KEYWORD):
            raise ValueError(f"kernel {fn.__name__}: parameter {prm.name!r} must be a plain positional parameter")
        ann = prm.annotation
        if not isinstance(ann, str):
            raise ValueError(f"kernel {fn.__name__}: parameter {prm.name!r} needs a type annotation string like 'u32*' or 'f32', got {ann!r}")
        t = ann.replace(" ", "")
        if t.endswith("*"):
            if t[:-1] not in SCALARS and t[:-1] != "void": raise ValueError(f"kernel {fn.__name__}: unknown pointer type {ann!r}")
            fmt, ptr = "Q", True
        elif t in SCALARS:
            fmt, ptr = SCALARS[t], False
        else:
            raise ValueError(f"kernel {fn.__name__}: unknown parameter type {ann!r} (scalars: {', '.join(SCALARS)}; pointers end with '*')")
        size = struct.calcsize("=" + fmt)
        off = -(-off // size) * size
        slots.append(ArgSlot(prm.name, t, ptr, off, fmt))
        off += size
    return slots, -(-off // 8) * 8, "gid" in want, "ctx" in want


class ToyCompiler:
    """'Compiles' Python source: checks its syntax; the binary is the source."""

    def compile(self, source: str) -> bytes:
        try:
            compile(source, "<toy kernel>", "exec", dont_inherit=True)
        except SyntaxError as e:
            raise CompileError(f"TOY kernel source does not parse: {e}") from None
        return source.encode()


class ToyProgram(HCQProgram):
    """A Python kernel function; its EXEC entry word is a small id in the module's program table."""

    def __init__(self, dev: ToyDevice, name: str, lib: bytes):
        ns: dict[str, Any] = dict(KERNEL_GLOBALS)
        try:
            exec(compile(lib.decode(), f"<toy kernel {name}>", "exec", dont_inherit=True), ns)  # noqa: S102 - kernels are Python by design
        except Exception as e:  # noqa: BLE001
            raise CompileError(f"TOY kernel source failed to load: {type(e).__name__}: {e}") from None
        fn = ns.get(name)
        if not inspect.isfunction(fn):
            defined = sorted(k for k, v in ns.items() if inspect.isfunction(v) and k not in KERNEL_GLOBALS)
            raise ValueError(f"no kernel function named {name!r} in the source; it defines: {', '.join(defined)}")
        self.fn = fn
        self.arg_slots, size, self.want_gid, self.want_ctx = kernel_layout(fn)
        fmt, pos = "=", 0
        for s in self.arg_slots:
            fmt += "x" * (s.offset - pos) + s.fmt
            pos = s.offset + struct.calcsize("=" + s.fmt)
        self.unpacker = struct.Struct(fmt)
        self.entry = next(_program_ids)
        _programs[self.entry] = self
        super().__init__(CLikeArgsState, dev, name, kernargs_alloc_size=max(size, 8), lib=lib, base=self.entry)


# ------------------------------------------------------------------ the device
class ToyComputeQueue(PacketComputeQueue):
    """Compute queue of a TOY device."""


class ToyCopyQueue(PacketCopyQueue):
    """Copy queue of a TOY device."""


CONFORMANCE_KERNELS: dict[str, tuple[str, str]] = {
    "fill": ('def fill(out: "u32*", value: "u32", n: "u32", *, gid):\n'
             '    if gid < n: mem(out, n)[gid] = value\n', "fill"),
    "add": ('def add(out: "u32*", a: "u32*", b: "u32*", n: "u32", *, gid):\n'
            '    if gid < n: mem(out, n)[gid] = (mem(a, n)[gid] + mem(b, n)[gid]) & 0xFFFFFFFF\n', "add"),
    "spin": ('def spin(flag: "u64*", out: "u32*", *, gid):\n'
             '    if gid != 0: return\n'
             '    while load(flag, "Q") == 0: sleep(0.0002)\n'
             '    store(out, 1)\n', "spin"),
    "fault": ('def fault(out: "u32*", *, gid):\n'
              '    raise RuntimeError("the fault kernel faults on purpose")\n', "fault"),
}


class ToyDevice(HCQCompiled[ToySignal]):
    """`TOY:n`: a pure-Python packet executor (a thread per ring); all TOY devices form peer group "TOY"."""
    max_block_threads = 1024
    timestamp_divider = 1000  # perf_counter_ns -> microseconds (the signals' default divider)
    CONFORMANCE_KERNELS = CONFORMANCE_KERNELS

    def __init__(self, device: str):
        executor = ToyExecutor(device)
        caps = Capabilities(queues={COMPUTE: 1, COPY: 1}, word_bits=64, poll_conditions=frozenset(PollCondition), poll_mask=True,
                            recover=True, queue_states=True, host_visible_memory=True, host_copies=False, timestamps=True, packets=True)
        _devices_by_id[executor.device_id] = self
        try:
            super().__init__(device, ToyAllocator(self), ToyCompiler(), ToyProgram, ToySignal, ToyComputeQueue, ToyCopyQueue,
                             capabilities=caps, executor=executor, kernargs_size=1 << 20, peer_group="TOY")
        except BaseException:
            _devices_by_id.pop(executor.device_id, None)
            raise


DEVICE_CLASS = ToyDevice


def register() -> None:
    """Make hcq.Device("TOY") / "TOY:n" open TOY devices in this process."""
    from hcq.registry import register_backend
    register_backend("TOY", ToyDevice)
