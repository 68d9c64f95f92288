"""The CPU device: memory from anonymous private mappings with guard pages, a native command processor (cp.c)
that executes hcq packets (the executor: one compute ring and `HCQ_CPU_COPY_ENGINES` copy rings), and kernels
compiled from C and run by a worker pool. Everything else (queues, fences, lifetimes, graphs, the launch hot
path) is the core's."""
from __future__ import annotations

import ctypes
import functools
import os
import threading
import weakref
from typing import Any, Callable, Sequence, cast

from hcq import hotpath
from hcq.allocator import HCQAllocator
from hcq.backends.cpu.compiler import CPUCompiler, load_library
from hcq.backends.cpu.native import FAULT, MAX_BLOCK_THREADS, POOL_INFO, QUEUE_KINDS, QUEUE_STATE, engine, function_address, queue_settings
from hcq.backends.cpu.kernels import CONFORMANCE_KERNELS
from hcq.device import HCQCompiled
from hcq.errors import HCQError
from hcq.helpers import env_flag, getenv, round_up
from hcq.hostmap import libc as _libc, MAP_FAILED, MAP_NORESERVE, MAP_PRIVATE_ANON, PAGE, PROT_NONE, PROT_RW
from hcq.interfaces import COMPUTE, COPY, Capabilities, HostStores
from hcq.memory import BufferSpec, HCQBuffer, MMIOInterface
from hcq.packet_queue import Executor, PacketComputeQueue, PacketCopyQueue, RingState, SubmitStatus
from hcq.packets import Op, PollCondition, first_packet
from hcq.program import CLikeArgsState, HCQProgram
from hcq.signal import HCQSignal

RING_WORDS = 1 << 16
STOP_NS = 1_000_000_000  # how long a closing device's threads get to stop (a kernel may still run past it)
NO_POSITION = 2**64 - 1

_devices_by_id: dict[int, CPUDevice] = {}  # the command processor's device ids (named in poisoned signals)
# ...and their executors, for devices that exist as executors only (the devices `hcq serve` runs for its clients)
_executors_by_id: weakref.WeakValueDictionary[int, CPUExecutor] = weakref.WeakValueDictionary()
lost_feeders: dict[int, str] = {}  # poison ids that name no device here: why a WAIT on them was released (see name_feeder)


def name_feeder(why: str) -> int:
    """A poison id for signals fed from elsewhere (a remote server): a WAIT released by a value poisoned with it fails
    its device saying it was released because `why`."""
    lost_id = 0xFFFF0000 + len(lost_feeders)
    lost_feeders[lost_id] = why
    return lost_id
_entry_names: dict[int, str] = {}  # kernel entry address -> kernel name, for fault reports
_exiting = False  # set at interpreter exit: mappings are left to the OS (a stuck queue thread may still hold them)


def _max_map_count() -> int:
    try:
        with open("/proc/sys/vm/max_map_count") as f: return int(f.read())
    except (OSError, ValueError):
        return 65530  # Linux's default


def _vma_count() -> int:
    """Memory mappings of this process now (lines of /proc/self/maps, read in chunks: no large buffer near the limit)."""
    with open("/proc/self/maps", "rb", buffering=0) as f:
        return sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 16), b""))


class _MapBudget:
    """Keeps hcq's allocations from using the process's last memory mappings (vm.max_map_count): Python itself (its
    object arenas), loading a compiled kernel, a new signal page or another device all need some, and so does freeing
    (unmapping a buffer whose guard pages merged with a neighbour's splits a mapping). Each new allocation adds at most
    3 mappings, so the real count is read only when the allocations since the last look could have used up what was
    left above the reserve; allocations that would go below it raise MemoryError, which the allocator answers by
    freeing what it caches and retrying. Runtime state (signal pages, kernargs, staging) may use half the reserve, so
    signals, copies and launches still work when user buffers took all they may. `HCQ_CPU_MAP_RESERVE` sets the
    reserve (default 1/16 of the limit, at least 1024)."""

    def __init__(self) -> None:
        self.limit = _max_map_count()
        self.reserve = getenv("HCQ_CPU_MAP_RESERVE", max(1024, self.limit // 16), lo=0, hi=self.limit)
        self.live = 0  # hcq mappings now
        self.next_look = 0  # look at the real count when `live` reaches this (user buffers)...
        self.next_look_runtime = 0  # ...and this (runtime state, which may use half the reserve)
        self.lock = threading.Lock()

    def take(self, device: str, size: int, runtime: bool) -> None:
        with self.lock:
            if self.live >= (self.next_look_runtime if runtime else self.next_look):
                used = _vma_count()
                room = self.limit - self.reserve - used  # for user buffers (runtime state may go half the reserve further)
                if (room + self.reserve // 2 if runtime else room) < 3:
                    raise MemoryError(f"{device}: cannot allocate {size} bytes{' of runtime memory' if runtime else ''}: the process has "
                                      f"{used} of its {self.limit} memory mappings (vm.max_map_count), and hcq keeps {self.reserve} for "
                                      "the runtime (HCQ_CPU_MAP_RESERVE); free buffers, or raise vm.max_map_count")
                self.next_look = self.live + max(room, 0) // 3
                self.next_look_runtime = self.live + (room + self.reserve // 2) // 3
            self.live += 1

    def give(self) -> None:
        with self.lock: self.live -= 1


_budget = _MapBudget()
os.register_at_fork(after_in_child=lambda: setattr(_budget, "lock", threading.Lock()))  # (a parent's thread may have held it)
_MADV_DONTNEED = 4


class _Mapping:
    """An anonymous private mapping with a guard page on each side: a kernel running off the end (or start)
    of a buffer faults (a DeviceError) instead of reaching the runtime state mapped next to it. Unmapped
    once the allocator and every host view of it (numpy arrays included) have let go."""
    __slots__ = ("base", "length")

    def __init__(self, size: int, device: str, runtime: bool = False):
        self.base, self.length = 0, round_up(size, PAGE) + 2 * PAGE
        _budget.take(device, size, runtime)
        base = _libc.mmap(None, self.length, PROT_NONE, MAP_PRIVATE_ANON | MAP_NORESERVE, -1, 0)
        if base is None or base == MAP_FAILED or _libc.mprotect(base + PAGE, self.length - 2 * PAGE, PROT_RW) != 0:
            err = ctypes.get_errno()
            if base is not None and base != MAP_FAILED: _unmap(base, self.length)
            _budget.give()
            raise MemoryError(f"{device}: cannot allocate {size} bytes ({os.strerror(err)})")
        self.base = base

    @property
    def addr(self) -> int:
        return self.base + PAGE

    def __del__(self) -> None:
        if self.base and not _exiting:
            _unmap(self.base, self.length)
            _budget.give()


_unmapped_later: list[tuple[int, int]] = []  # ranges munmap refused (see _unmap), unmapped at a later release


def _unmap(base: int, length: int) -> None:
    """Unmap a guarded mapping; never fails. munmap can refuse (ENOMEM) at the mapping limit, when the range cuts a
    mapping that merged with a neighbour's guard page in two: then the range is made PROT_NONE (which merges it with
    its guards: fewer mappings) and its memory dropped (MADV_DONTNEED), and it is unmapped at a later release."""
    if _libc.munmap(base, length) != 0:
        _libc.mprotect(base, length, PROT_NONE)
        _libc.madvise(base, length, _MADV_DONTNEED)
        _unmapped_later.append((base, length))
        return
    while _unmapped_later:  # a release worked: retry the ranges that could not go before
        b, n = _unmapped_later.pop()
        if _libc.munmap(b, n) != 0:
            _unmapped_later.append((b, n))
            return


class CPUSignal(HCQSignal):
    """A signal in host memory; host waits run natively (spin, then futex sleep) without the GIL, and stores wake
    queues and host threads sleeping on it."""

    def store(self, value: int, wake: bool = True) -> None:
        if not wake: return super().store(value, wake=False)
        if type(value) is not int or not 0 <= value < 2**64: super().store(value)  # raises, naming the problem
        if self._value_mv is None: self._refuse_virtual()
        engine().hcq_signal_store(self.value_addr, value)

    def compare_exchange(self, expected: int, desired: int) -> int:
        if self._value_mv is None: self._refuse_virtual()
        return engine().hcq_cas64(self.value_addr, expected, desired)

    def _wait_slice(self, value: int, ms: int) -> bool:
        if self._value_mv is None: self._refuse_virtual()
        return _native_wait()(self.value_addr, value, ms * 1_000_000) == 0  # type: ignore[arg-type]  # not virtual: an int


@functools.lru_cache(maxsize=None)
def _native_wait() -> Callable[[int, int, int], int]:
    """cp.c's host wait: through the CPython extension when it is there, else ctypes."""
    lib = engine()
    return hotpath.native_waiter(ctypes.cast(lib.hcq_wait_ge, ctypes.c_void_p).value) or lib.hcq_wait_ge  # type: ignore[arg-type]


class CPUExecutor(Executor):
    """The command processor (cp.c): a native thread per ring consuming packets, a worker pool for kernels."""
    ring_words = RING_WORDS

    def __init__(self, device: str, num_workers: int):
        self.device, self.lib = device, engine()
        err = ctypes.c_int(0)
        handle = self.lib.hcq_dev_create(num_workers, ctypes.byref(err))
        if not handle: raise HCQError(f"{device}: cannot create its command processor: {os.strerror(err.value)}")
        self.handle = handle
        self._pointers: dict[int, tuple[ctypes.c_uint64, ctypes.c_uint64]] = {}
        self._err_buf = ctypes.create_string_buffer(512)
        self._failed_flag = ctypes.c_int.from_address(self.lib.hcq_dev_failed_flag(handle))
        self.device_id = int(self.lib.hcq_dev_id(handle))
        _executors_by_id[self.device_id] = self

    def forget(self) -> None:
        """Its command-processor device was destroyed: its id may name another one from now on."""
        if _executors_by_id.get(self.device_id) is self: del _executors_by_id[self.device_id]

    def open_ring(self, kind: str, index: int) -> int:
        out = ctypes.c_void_p()
        eager = kind == COMPUTE  # copy engines start their threads with their first submission
        rc = self.lib.hcq_queue_create(self.handle, QUEUE_KINDS[kind], index, RING_WORDS, int(eager), ctypes.byref(out))
        if rc:
            what = "compute queue thread" if eager else f"copy queue {index}"
            raise HCQError(f"{self.device}: cannot start its {what}: {os.strerror(rc)} (out of memory, or at the limit of threads "
                           "per process or user: see ulimit -u)")
        ptrs = (ctypes.c_uint64 * 2)()
        self.lib.hcq_queue_pointers(out.value, ptrs)
        self._pointers[out.value] = (ctypes.c_uint64.from_address(ptrs[0]), ctypes.c_uint64.from_address(ptrs[1]))  # type: ignore[index]
        return out.value  # type: ignore[return-value]

    def try_submit(self, handle: Any, addr: int, nwords: int, timeout_ns: int) -> int:
        return self.lib.hcq_queue_submit(handle, addr, nwords, timeout_ns)

    def native_submit_address(self) -> int | None:
        return function_address("hcq_queue_submit")

    def submit_function(self) -> Callable[[Any, int, int, int], int]:
        fn = super().submit_function()
        return self.lib.hcq_queue_submit if fn == self.try_submit else fn  # without the extension: the bare ctypes call

    def consumed(self, handle: Any) -> int:
        return self.lib.hcq_queue_rptr(handle)

    def room(self, handle: Any) -> int:
        wptr, rptr = self._pointers[handle]
        return RING_WORDS - (wptr.value - rptr.value)

    def ring_state(self, handle: Any) -> RingState:
        raw = (ctypes.c_uint64 * len(QUEUE_STATE))()
        self.lib.hcq_queue_state(handle, raw)
        st = dict(zip(QUEUE_STATE, raw))
        base = RingState(st["rptr"], st["wptr"], st["packets_done"])
        if st["position"] == NO_POSITION: return base
        pkt = list(raw[QUEUE_STATE.index("pkt0"):])
        base.current, base.position = first_packet(pkt), st["position"]
        base.indirect_index = None if st["indirect_index"] == NO_POSITION else st["indirect_index"]
        return base

    def failed_flag_address(self) -> int | None:
        return ctypes.addressof(self._failed_flag)

    def error(self) -> str | None:
        if not self._failed_flag.value: return None
        self.lib.hcq_dev_error(self.handle, self._err_buf, len(self._err_buf))
        msg = self._err_buf.value.decode(errors="replace")
        raw = (ctypes.c_uint64 * len(FAULT))()
        if not self.lib.hcq_dev_fault(self.handle, raw): return msg
        fault = dict(zip(FAULT, raw))
        addr, entry, block, op, peer = fault["addr"], fault["entry"], fault["block"], fault["op"], fault["peer"]
        if peer and peer - 1 in lost_feeders:
            return (f"a WAIT for signal 0x{addr:x} >= {block} was released because {lost_feeders[peer - 1]}, so the work it waited "
                    "for did not run; recover the device")
        if peer:
            peer_dev, peer_ex = _devices_by_id.get(peer - 1), _executors_by_id.get(peer - 1)
            name = peer_dev.device if peer_dev is not None else peer_ex.device if peer_ex is not None else f"CPU device #{peer - 1}"
            if peer_dev is not None and peer_dev.executor is not self: msg = peer_dev._device_error() or msg  # it names the kernel
            elif peer_dev is None and peer_ex is not None and peer_ex is not self: msg = peer_ex.error() or msg
            return (f"a WAIT for signal 0x{addr:x} >= {block} was released by {name} after {name} failed, so the work it waited "
                    f"for did not run ({name}: {msg}); recover both devices")
        if entry: return f"kernel {_entry_names.get(entry, hex(entry))!r} faulted in block {block}: {msg}"
        name = Op(op).name if op in Op._value2member_map_ else str(op)
        return f"{'an' if name[0] in 'AEIOU' else 'a'} {name} packet faulted: {msg}"

    def recover(self) -> None:
        self.lib.hcq_dev_recover(self.handle)

    def submit_error(self, handle: Any, status: int) -> str:
        if status == SubmitStatus.NO_THREAD:
            return (f"cannot start its thread: {os.strerror(self.lib.hcq_queue_start_error(handle))} (out of memory, or at the limit "
                    "of threads per process or user: see ulimit -u)")
        if status == SubmitStatus.TOO_BIG: return f"the submission exceeds the ring's {RING_WORDS} words"
        return super().submit_error(handle, status)

    def close(self, handles: Sequence[Any], release: bool = False) -> bool:
        stopped = [self.lib.hcq_queue_stop(h, STOP_NS) == 0 for h in handles]
        self.lib.hcq_dev_stop(self.handle)  # (its id may name another device from now on)
        self.forget()
        if not release: return all(stopped)
        retired = [ok and self.lib.hcq_queue_retire(h, STOP_NS) == 0 for h, ok in zip(handles, stopped)]
        return all(retired) and self.lib.hcq_dev_retire(self.handle, STOP_NS) == 0

    def abort(self, reason: str) -> None:
        self.lib.hcq_dev_abort(self.handle, reason.encode(errors="replace"))

    def _pool_info(self) -> dict[str, int]:
        raw = (ctypes.c_int * len(POOL_INFO))()
        self.lib.hcq_dev_pool_info(self.handle, raw)
        return dict(zip(POOL_INFO, raw))

    def threads(self, handles: Sequence[Any]) -> dict[str, int]:
        info = self._pool_info()
        return {"queues": sum(self.lib.hcq_queue_started(h) for h in handles), "workers": info["started"], "workers_wanted": info["wanted"]}

    def pool_counts(self) -> dict[str, int]:
        """How many grids of several blocks the worker pool was woken for ("woken") and how many the queue thread ran
        alone because their blocks were measured tiny ("inline"); counts since the device opened."""
        info = self._pool_info()
        return {"woken": info["woken"], "inline": info["inline"]}


class CPUProgram(HCQProgram):
    """A kernel of a compiled C library, entered through its generated trampoline (the EXEC packet's entry word)."""

    def __init__(self, dev: CPUDevice, name: str, lib: bytes):
        loaded = load_library(lib)
        if name not in loaded.kernels:
            raise ValueError(f"no HCQ_KERNEL named {name!r} in the source; it defines: {', '.join(sorted(loaded.kernels))}")
        self.arg_slots, size, self.entry = loaded.kernels[name]
        self._image = loaded.image  # keeps the library loaded while the program lives
        _entry_names[self.entry] = name
        super().__init__(CLikeArgsState, dev, name, kernargs_alloc_size=max(size, 8), lib=lib, base=self.entry)


class CPUAllocator(HCQAllocator["CPUDevice"]):
    """Private anonymous mappings with guard pages (small buffers share slabs). The copy engine reads and writes
    host memory directly unless HCQ_CPU_DIRECT_COPY=0 (then copies go through the staging ring, as on devices
    without host access)."""

    def __init__(self, dev: CPUDevice):
        super().__init__(dev)
        self.direct_copy = env_flag("HCQ_CPU_DIRECT_COPY", True)

    def _alloc(self, size: int, options: BufferSpec) -> HCQBuffer:
        mapping = _Mapping(size, self.dev.device, self.for_runtime)
        return HCQBuffer(mapping.addr, size, meta=options, view=MMIOInterface(mapping.addr, size, keepalive=mapping), owner=self.dev)

    def _free(self, buf: HCQBuffer, options: BufferSpec) -> None:
        buf.view = None  # the mapping goes with the last host view of it

    def _map_into(self, buf: HCQBuffer) -> HCQBuffer:
        if buf.owner is not None and not isinstance(buf.owner, CPUDevice):
            raise HCQError(f"{self.dev.device} cannot map {buf!r}: it belongs to another peer group")
        return buf  # every CPU device shares the process's address space

    def _host_copy_address(self, host_addr: int, nbytes: int) -> int | None:
        return host_addr if self.direct_copy else None

    def _use_host(self, host_addr: int, nbytes: int) -> int | None:
        return host_addr  # (kernels run in this process)


class CPUComputeQueue(PacketComputeQueue):
    """Compute queue of a CPU device (hcq packets, run by its command processor)."""


class CPUCopyQueue(PacketCopyQueue):
    """Copy queue `index` of a CPU device (one of its copy engines)."""


def _set_store_hook(fn: int | None, ctx: int | None) -> None:
    engine().hcq_set_store_hook(fn, ctx)


def _c_function(name: str) -> Callable[[], int]:
    return functools.partial(function_address, name)


class CPUDevice(HCQCompiled[CPUSignal]):
    """`CPU:n`: its own command processor threads and worker pool; all CPU devices form one peer group."""
    max_block_threads = MAX_BLOCK_THREADS
    host_stores = HostStores(_set_store_hook, _c_function("hcq_signal_poison"), _c_function("hcq_wake_sleepers"), name_feeder)
    CONFORMANCE_KERNELS = CONFORMANCE_KERNELS

    @staticmethod
    def device_capabilities(copy_engines: int) -> Capabilities:
        """What a CPU device with `copy_engines` copy queues can do (hcq serve tells its clients this too)."""
        return Capabilities(queues={COMPUTE: 1, COPY: copy_engines}, word_bits=64, poll_conditions=frozenset(PollCondition), poll_mask=True,
                            recover=True, queue_states=True, host_visible_memory=True, host_copies=True, timestamps=True, packets=True)

    def __init__(self, device: str):
        self.num_workers, self.num_copy_engines = queue_settings()
        executor = CPUExecutor(device, self.num_workers)
        caps = self.device_capabilities(self.num_copy_engines)
        _devices_by_id[executor.device_id] = self
        try:
            super().__init__(device, CPUAllocator(self), CPUCompiler(), CPUProgram, CPUSignal, CPUComputeQueue, CPUCopyQueue,
                             capabilities=caps, executor=executor, peer_group="CPU")
            self.clock_domain = "host"  # (every CPU device stamps this process's monotonic clock)
        except BaseException:
            _devices_by_id.pop(executor.device_id, None)
            executor.close([])
            raise

    @classmethod
    def precompile(cls, source: str) -> None:
        """Build `source` into the on-disk cache (no device needed)."""
        CPUCompiler().compile(source)

    def queue_stats(self) -> dict[str, tuple[int, int]]:
        """Per ring: (words written by the host, words consumed by the command processor)."""
        lib = engine()
        return {f"{r.kind}{r.index}": (int(lib.hcq_queue_wptr(r.handle)), int(lib.hcq_queue_rptr(r.handle)))
                for rings in self.rings.values() for r in rings}

    def threads(self) -> dict[str, int]:
        """Native threads running for this device: queues started, workers started (and wanted)."""
        return self.executor.threads(self._ring_handles())  # type: ignore[union-attr]

    def describe(self) -> list[str]:
        t = self.threads()
        return super().describe() + [f"worker threads: {self.num_workers} ({t['workers'] + 1} running: they start with the first grid worth "
                                     f"splitting); queue threads running: {t['queues']}"]

    def _release(self, stopped: bool) -> None:
        device_id = cast(CPUExecutor, self.executor).device_id
        if _devices_by_id.get(device_id) is self: del _devices_by_id[device_id]
        super()._release(stopped)

    def _shutdown(self) -> None:
        """Stop the command processor threads (at exit; queued work is abandoned, memory is left mapped)."""
        global _exiting
        if self.closed: return
        _exiting = True
        super()._shutdown()


def _after_fork_in_child() -> None:
    _devices_by_id.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)
