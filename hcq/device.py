"""The device: `HCQCompiled` ties together an allocator, a compiler, queue kinds, the signal pool shared
by a peer group, the kernargs ring and the timeline signal (with its shadow for wrap-around)."""
from __future__ import annotations

import os
import threading
import time
from array import array
from typing import Any, Callable, ClassVar, Generic, Protocol, TypeVar, cast

from hcq import device_state, hotpath, interrupts, lifecycle, lifetimes
from hcq.allocator import HCQAllocator
from hcq.errors import DeviceError, HCQError, HCQTimeoutError, WaitInterrupted
from hcq.helpers import as_integer, wait_timeout_ms
from hcq.interfaces import COMPUTE, COPY, Capabilities, HostStores, SignalLike
from hcq.lifetimes import Ring
from hcq.memory import RUNTIME_SPEC, BufferSpec, HCQBuffer
from hcq.packet_queue import Executor, FastLauncher, RingState, describe_state
from hcq.packets import SIGNAL_SIZE, Op, decode_header
from hcq.program import Dims, HCQProgram, as_dims
from hcq.queue import HWQueue
from hcq.signal import HCQSignal, SignalReplica
from hcq.symbolic import Expr, sint
from hcq.timeline_ring import TimelineRing

SignalType = TypeVar("SignalType", bound=HCQSignal)
DeviceT = TypeVar("DeviceT", bound="HCQCompiled")

TIMELINE_WRAP = 1 << 31
MAX_GRID_BLOCKS = (1 << 63) - 1  # blocks in one launch (a 64-bit count that stays signed)


class Compiler(Protocol):
    """What a device needs from its compiler: source text in, a loadable binary out (cached by the compiler)."""

    def compile(self, source: str) -> bytes: ...


def _shutdown_all() -> None:
    for group in HCQCompiled.peer_groups.values():
        for dev in group: dev._shutdown()


def _after_fork_in_child() -> None:
    """A forked child has none of the parent's command-processor threads, and the parent's devices, signals
    and queues are copies it must not use: they fail clearly, and devices opened in the child start afresh."""
    for group in HCQCompiled.peer_groups.values():
        for dev in group:
            dev._close_lock, dev._closing, dev._closed_reason = threading.Lock(), False, None  # (a parent's thread may have been closing it)
            dev._close(f"was opened in the parent process before fork(); open a device in the child (hcq.Device({dev.device!r})) instead")
    HCQCompiled.peer_groups, HCQCompiled.signal_pages, HCQCompiled.signal_pool = {}, {}, {}


os.register_at_fork(after_in_child=_after_fork_in_child)


class HCQCompiled(Generic[SignalType]):
    """Base class of HCQ devices. Subclasses pass their allocator, compiler, program class, signal class, queue
    classes and `Capabilities`; a backend that runs hcq packets also passes its `Executor` (and gets the packet
    queues and the launch hot path from the core). `timeline_value` is the next value to signal on
    `timeline_signal`: waiting for `timeline_value - 1` waits for everything submitted so far."""
    max_grid: tuple[int, int, int] = (2**32 - 1, 2**32 - 1, 2**32 - 1)  # launch limits (checked at every launch)
    max_block: tuple[int, int, int] = (2**20, 2**20, 2**20)
    max_block_threads: int = 2**20
    timestamp_divider: int = 1000  # device timestamp units per microsecond (signals of the device get it)
    host_stores: ClassVar[HostStores | None] = None  # backends whose command processors store to host memory (interfaces.HostStores)
    peer_groups: ClassVar[dict[str, list[HCQCompiled]]] = {}
    signal_pages: ClassVar[dict[str, list[HCQBuffer]]] = {}
    signal_pool: ClassVar[dict[str, list[HCQBuffer]]] = {}

    def __init__(self, device: str, allocator: HCQAllocator, compiler: Compiler, runtime: Callable[[Any, str, bytes], HCQProgram],
                 signal_t: type[SignalType],
                 comp_queue_t: type[HWQueue], copy_queue_t: type[HWQueue] | None = None, *,
                 capabilities: Capabilities, executor: Executor | None = None, kernargs_size: int = 16 << 20,
                 sigalloc_size: int = 4096, peer_group: str | None = None):
        self.device, self.allocator, self.compiler, self.runtime = device, allocator, compiler, runtime
        self.signal_t, self.hw_compute_queue_t, self.hw_copy_queue_t = signal_t, comp_queue_t, copy_queue_t
        self.capabilities, self.executor = capabilities, executor
        self.sigalloc_size, self.kernargs_size = sigalloc_size, kernargs_size
        if (copy_queue_t is None) != (capabilities.queue_count(COPY) == 0):
            raise ValueError(f"{device}: a copy queue class goes with copy queues in the capabilities, and only then")
        for qt in (comp_queue_t, copy_queue_t):
            if qt is not None and qt.word_bits != capabilities.word_bits:
                raise ValueError(f"{device}: {qt.__name__} has {qt.word_bits}-bit words, the capabilities say {capabilities.word_bits}")
        self.peer_group = peer_group if peer_group is not None else device.split(":")[0]
        self._busy_set = lifetimes.busy_set(self.peer_group)  # where its submissions list it (see hcq.lifetimes)
        self.clock_domain: str = device  # devices whose timestamps come from one clock share it (the profiler calibrates each once)
        self.error_state: Exception | None = None
        self.kernel_names: dict[int, str] = {}  # EXEC entry word -> kernel name, for hang reports
        # the state words native code reads in place (hcq.device_state): the timeline value, open, the timeline's address
        self._state = array("Q", bytes(8 * device_state.WORDS))
        self._closed_reason = None  # set: new work is refused (closed, or closing: see `close`)
        self._closing = False  # close() is waiting for the work in flight
        self._close_lock = threading.Lock()
        self._replicas: dict[int, SignalReplica] = {}  # id(signal of another peer group) -> its replica here
        interrupts.install()
        lifecycle.register()
        if _shutdown_all not in lifecycle.shutdown_hooks: lifecycle.shutdown_hooks.append(_shutdown_all)
        group = HCQCompiled.peer_groups.setdefault(self.peer_group, [])
        for page in HCQCompiled.signal_pages.get(self.peer_group, []): self.allocator.map(page)
        group.append(self)
        self.rings: dict[str, list[Ring]] = {}
        self._ring_list: tuple[Ring, ...] = ()  # (the rings of `rings` in one tuple, for synchronize)
        try:
            self.timeline_value = 1
            self.timeline_signal: SignalType = self.new_signal(value=0, is_timeline=True)
            self._note_timeline_address()
            self._shadow_timeline_signal: SignalType = self.new_signal(value=0, is_timeline=True)
            self.rings = self._open_rings()
            self._ring_list = tuple(r for rings in self.rings.values() for r in rings)
            self.kernargs_buf = self.allocator.alloc(kernargs_size, RUNTIME_SPEC, internal=True)
            self.kernargs_raw = self.kernargs_buf.cpu_view().raw  # host bytes of the kernargs buffer
            self.kernargs_allocator = TimelineRing(kernargs_size, self._wait_for_tag)
            self.fast_launch: FastLauncher | None = FastLauncher(self) if executor is not None else None
            self.allocator._fast_host_copies(executor.failed_flag_address() if executor is not None else None, self._copy_checks_overridden())
        except BaseException:  # a half-opened device leaves no member in the peer group and no running ring behind
            group.remove(self)
            if executor is not None: executor.close(self._ring_handles())
            raise

    def _copy_checks_overridden(self) -> list[str]:
        """The checks a native small copy stands in for (HCQAllocator._fast_host_copies) that this device's classes
        override ("Class.method"): a backend that overrides one keeps the Python copies, which call its override, and
        `allocator.native_copies_why_not` names them."""
        core = ((type(self.allocator), HCQAllocator, ("_check_size", "_host_window")),
                (type(self), HCQCompiled, ("wait_timeline", "check_error", "_device_error")),
                (type(self.timeline_signal), HCQSignal, ("load", "wait", "_check_failed_setter")))
        return [f"{cls.__name__}.{m}" for cls, base, names in core for m in names if getattr(cls, m) is not getattr(base, m)]

    def _open_rings(self) -> dict[str, list[Ring]]:
        rings: dict[str, list[Ring]] = {}
        handles: list[Any] = []
        try:
            for kind, count in self.capabilities.queues.items():
                for i in range(count):
                    handle = self._open_ring(kind, i)
                    if self.executor is not None: handles.append(handle)
                    rings.setdefault(kind, []).append(Ring(self, kind, i, handle, self.new_signal(value=0)))
        except BaseException:
            if self.executor is not None: self.executor.close(handles)
            raise
        return rings

    def _open_ring(self, kind: str, index: int) -> Any:
        """The handle of the ring of queue `index` of `kind` (`Ring.handle`): the executor's; a backend without one
        returns what its queues' `_submit` publishes to."""
        return self.executor.open_ring(kind, index) if self.executor is not None else None

    # ---- queues and rings
    def ring(self, kind: str, index: int = 0) -> Ring:
        """The ring that queue `index` of `kind` submits to."""
        rings = self.rings.get(kind, ())
        if not 0 <= index < len(rings):
            raise HCQError(f"{self.device} has {len(rings)} {kind} queue{'s' if len(rings) != 1 else ''}; {kind} queue {index} does not exist")
        return rings[index]

    def check_queue(self, q: HWQueue) -> None:
        """Raise unless `q` is a queue of this device's kind that may be submitted here."""
        if not isinstance(q, (self.hw_compute_queue_t, self.hw_copy_queue_t or self.hw_compute_queue_t)):
            raise HCQError(f"a {type(q).__name__} cannot be submitted to {self.device} (it takes "
                           f"{self.hw_compute_queue_t.__name__}{' and ' + self.hw_copy_queue_t.__name__ if self.hw_copy_queue_t else ''})")
        self.check_open()
        self.ring(q.kind, q.index)

    def mark_busy(self) -> None:
        """Note that work was submitted, once it is counted in `progress_marks` (releases of memory then wait for it)."""
        lifetimes.mark_busy(self)

    def progress_marks(self) -> list[tuple[SignalLike, int]]:
        """Signal values that, once all reached, mean everything submitted to this device so far ran."""
        if self.closed: return []
        marks: list[tuple[SignalLike, int]] = [(self.timeline_signal, self.timeline_value - 1)]
        return marks + [(r.fence, r.count) for rings in self.rings.values() for r in rings]

    # ---- signals
    def new_signal(self, **kwargs: Any) -> SignalType:
        """A signal from the peer group's pool (16-byte slots mapped to every device of the group)."""
        pool = HCQCompiled.signal_pool.setdefault(self.peer_group, [])
        if not pool: self._grow_signal_pool(pool)
        slot = pool.pop()
        try:
            sig = self.signal_t(base_buf=slot, owner=self, **{"timestamp_divider": self.timestamp_divider, **kwargs})
        except BaseException:
            pool.append(slot)
            raise
        sig._pool = pool
        return sig

    def _grow_signal_pool(self, pool: list[HCQBuffer]) -> None:
        page = self.allocator.alloc(self.sigalloc_size, BufferSpec(host=True, uncached=True, cpu_access=True, nolru=True), internal=True)
        HCQCompiled.signal_pages.setdefault(self.peer_group, []).append(page)
        for dev in HCQCompiled.peer_groups[self.peer_group]: dev.allocator.map(page)
        pool.extend(page.offset(off, SIGNAL_SIZE) for off in range(page.size - SIGNAL_SIZE, -1, -SIGNAL_SIZE))

    # ---- timeline
    @property
    def _closed_reason(self) -> str | None:
        """Why the device takes no new work (closed, closing, failed at fork), or None; the OPEN state word follows it."""
        return self._closed_text

    @_closed_reason.setter
    def _closed_reason(self, reason: str | None) -> None:
        entered = interrupts.enter()  # (a Ctrl-C between the two would leave Python's and the native paths' views apart)
        try:
            self._closed_text = reason
            self._state[device_state.OPEN] = reason is None
        finally:
            interrupts.leave(entered)

    @property
    def timeline_value(self) -> int:
        """The next value the timeline signal is signalled to (a state word native code steps in place)."""
        return self._state[device_state.TIMELINE_VALUE]

    @timeline_value.setter
    def timeline_value(self, value: int) -> None:
        self._state[device_state.TIMELINE_VALUE] = value

    def native_state(self) -> Any:
        """What the extension's native paths need of this device (hcq/_hotpath.c's DeviceState over `_state`), made once;
        None without the extension."""
        if (ds := self.__dict__.get("_native_state", False)) is False:
            ds = self.__dict__["_native_state"] = hotpath.device_state(self, self._state, self._busy_set)
        return ds

    def _note_timeline_address(self) -> None:
        addr = self.timeline_signal.value_addr
        self._state[device_state.TIMELINE_ADDRESS] = addr if isinstance(addr, int) else 0

    def next_timeline(self) -> int:
        """Return the value the next submission signals, and advance `timeline_value`."""
        state = self._state
        value = state[device_state.TIMELINE_VALUE]
        state[device_state.TIMELINE_VALUE] = value + 1
        return value

    def submit_timeline(self, q: HWQueue, var_vals: Any = None) -> int:
        """Submit `q`, which signals `timeline_value`, and advance the timeline, as one step a Ctrl-C cannot
        split (a timeline that advanced without its submission, or the reverse, would wedge or race later
        waits). Returns the value the submission signals."""
        entered = interrupts.enter()
        try:
            q.submit(self, var_vals)
            return self.next_timeline()
        finally:
            interrupts.leave(entered)

    def _forfeit_timeline(self, value: int, give_back: bool = False) -> bool:
        """Timeline `value`, taken (`next_timeline()`) for a submission that was refused, is reached all the same: a stand-in
        submission waits for `value - 1` and signals it, so later waits on the timeline do not stall on the hole; where the
        ring refuses that too, the value is given back if it is the last one taken. `give_back`: give it back first where
        it is the last one (the caller took it just now: nothing computed since waits for it). False when there is nothing
        to do (a value not taken, or reached already; a closed device, whose waits raise) or neither could be done."""
        tl = self.timeline_signal
        if self.closed or not 0 < value < self.timeline_value or tl.load() >= value: return False
        if give_back and value == self.timeline_value - 1:
            self.timeline_value = value
            return True
        try:
            q = self.hw_compute_queue_t(profile=False).wait(tl, value - 1).signal(tl, value)
            if not self._closing: q._prepare(self, None)  # (a closing device refuses work, but the hole must be filled for its close to finish)
            q._submit_to_ring(self)
        except Exception:  # noqa: BLE001 - the refusal the caller raises says what went wrong
            if value != self.timeline_value - 1: return False
            self.timeline_value = value
        return True

    @property
    def closed(self) -> bool:
        """The device can no longer run work (it was closed, the process is exiting, or it was inherited across fork())."""
        return self._closed_reason is not None and not self._closing

    def _close(self, reason: str) -> None:
        """Mark the device unusable: every later wait, submission and allocation raises, saying why."""
        if self._closed_reason is None:
            self._closed_reason = reason
            self.error_state = DeviceError(f"{self.device} {reason}")

    def close(self, timeout: int | None = None) -> None:
        """Close the device: wait for the work submitted to it (up to `timeout` ms in all, default HCQDEV_WAIT_TIMEOUT_MS),
        then stop its queues and threads and release its runtime memory and native state. Work that did not finish in
        time is failed first (its waits are released and the signals it would store are poisoned, so nothing waits on it
        forever), and once the device is closed HCQTimeoutError says what was abandoned; where a kernel still runs, the
        memory it may use stays mapped. A failed device closes without raising. Afterwards every use of the device raises
        HCQError, its buffers' memory goes when they are dropped, and `hcq.Device(name)` opens the device anew. Closing a
        closed device does nothing; `with hcq.Device("CPU") as dev:` closes it at the end of the block. A Ctrl-C during the
        wait leaves the device open and usable."""
        # One Ctrl-C critical section: a Ctrl-C ends the waits inside (WaitInterrupted) and is raised once the device is
        # whole again, open or closed and released; a lock taken and given back inside it cannot be left held.
        entered, abandoned, stopped = interrupts.enter(), None, True
        try:
            if not self._take_close_lock(): return  # (interrupted while another close() ran: `leave` raises it)
            try:
                if self._closed_reason is not None: return
                self._closed_reason, self._closing = f"was closed (dev.close()); hcq.Device({self.device!r}) opens it anew", True  # no new work
                try:
                    abandoned = self._finish_for_close(timeout)
                except BaseException:
                    self._closed_reason, self._closing = None, False
                    raise
                self._closing = False
                self.error_state = DeviceError(f"{self.device} {self._closed_reason}")
                stopped = self.executor.close(self._ring_handles(), release=True) if self.executor is not None else self._stop_rings()
                self._release(stopped)
            finally:
                self._close_lock.release()
        finally:
            interrupts.leave(entered)
        if abandoned is not None:
            raise HCQTimeoutError(f"{self.device} was closed with work that did not finish in time; it was failed and dropped"
                                  f"{'' if stopped else ' (a kernel still runs: the memory it may use stays mapped)'}:\n{abandoned}")

    def _take_close_lock(self) -> bool:
        """Wait for another thread's close() of this device to end and take the close lock; inside a Ctrl-C critical
        section, a Ctrl-C stops the wait (False: the section's end raises it)."""
        while not self._close_lock.acquire(timeout=0.05):
            if interrupts.interrupted(): return False
        return True

    def __enter__(self: DeviceT) -> DeviceT:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _finish_for_close(self, timeout: int | None) -> str | None:
        """Wait for everything submitted (a failed device's queues drain, skipping its work); past the deadline, fail the
        device so that its queues drain at once. Returns None, or what was still running when the time was up."""
        deadline = time.monotonic() + (wait_timeout_ms() if timeout is None else timeout) / 1000

        def left_ms() -> int:
            return max(0, int((deadline - time.monotonic()) * 1000))
        try:
            for sig, value in self.progress_marks(): sig.wait(value, timeout=left_ms(), failed_ok=True)
            if self._drain_by(deadline): return None
        except HCQTimeoutError:
            pass
        except DeviceError:  # the device failed meanwhile: its queues drain, skipping the rest, or (hardware) stopped
            if self._failed_queues_stop() or self._drain_by(deadline): return None
        report = self.hang_report() or (f"nothing in its queues signals timeline value {self.timeline_value - 1} (it is at "
                                        f"{self.timeline_signal.load()}): a value taken with next_timeline() was never submitted"
                                        if self._drained() else "its queues had not drained")
        self._abort(f"{self.device} was closed with this work still running")
        grace = time.monotonic() + 1
        while not self._drained() and time.monotonic() < grace: time.sleep(0.001)  # (failed queues skip what is left)
        return report

    def _drain_by(self, deadline: float) -> bool:
        """Whether the queues drained before `deadline` (time.monotonic()); a Ctrl-C in a critical section ends the wait."""
        while not self._drained():
            if time.monotonic() >= deadline: return False
            if interrupts.interrupted(): raise WaitInterrupted(f"interrupted while waiting for {self.device}'s queues to drain")
            time.sleep(0.001)
        return True

    def _failed_queues_stop(self) -> bool:
        """Backends: whether a failed device's queues stop where they are instead of draining (a GPU channel the hardware
        stopped): closing it then waits for nothing more."""
        return False

    def _abort(self, reason: str) -> None:
        """Fail the device now (see `close`); backends without an executor override."""
        if self.executor is not None: self.executor.abort(reason)

    def _ring_handles(self) -> list[Any]:
        """The handle of every ring of the device (`Ring.handle`: the executor's, or what the backend's queues publish to)."""
        return [r.handle for rings in self.rings.values() for r in rings]

    def _stop_rings(self) -> bool:
        """Stop the queues of a device without an executor (backends override); True when every thread they ran stopped."""
        return True

    def _release(self, stopped: bool) -> None:
        """After the queues stopped (`stopped`: and every thread they ran): give back what the device holds and leave the
        peer group. Memory a thread that still runs may use is kept."""
        for r in list(self._replicas.values()): r.release()
        self._replicas.clear()
        self._busy_set.discard(self)
        self.allocator._close(stopped, [self.kernargs_buf])
        heir = self.allocator._heir()
        for page in HCQCompiled.signal_pages.get(self.peer_group, []):  # the group's signals live on: its other devices hold them
            page._mappings.pop(self, None)
            if heir is not None and (page.owner is self or getattr(page.owner, "closed", False)):
                page.owner = heir
                if isinstance(page.va_addr, int) and heir.allocator.owns(page.va_addr, page.size) is None:
                    heir.allocator._index(page.va_addr, page)  # (validation finds the group's signals in its allocations)
        self.retire(cast(str, self._closed_reason))
        for hook in lifecycle.close_hooks: hook(self)

    def lost(self) -> str | None:
        """Backends: why the device cannot be reached any more (e.g. the process serving it is gone), else None.
        `hcq.Device(name)` then retires it and opens the device anew."""
        return None

    def retire(self, reason: str) -> None:
        """Mark the device closed for good and leave its peer group; a group left empty forgets its signal pages (memory
        of hardware that is gone), so a device opened anew in that group starts afresh."""
        self._close(reason)
        group = HCQCompiled.peer_groups.get(self.peer_group, [])
        if self in group: group.remove(self)
        if not group:
            for table in (HCQCompiled.peer_groups, HCQCompiled.signal_pages, HCQCompiled.signal_pool): table.pop(self.peer_group, None)

    def check_open(self) -> None:
        """Raise HCQError if the device was closed (by `close()`, at exit, or inherited across fork())."""
        if self._closed_reason is not None: raise HCQError(f"{self.device} {self._closed_reason}")

    def synchronize(self, timeout: int | None = None) -> None:
        """Wait for the work on this device's timeline: everything the runtime submitted (launches, copies, transfers,
        graphs) and queues that signal `timeline_signal`. A raw queue that does not signal it is not waited for: wait on a
        signal it stores (timeout in ms, default HCQDEV_WAIT_TIMEOUT_MS)."""
        self.wait_timeline("synchronize", timeout)
        for ring in self._ring_list:
            if ring.inflight: ring.retire_unlocked()
        if self._state[device_state.TIMELINE_VALUE] > TIMELINE_WRAP: self._wrap_timeline_signal()

    def wait_timeline(self, during: str, timeout: int | None = None) -> None:
        """Wait for the work submitted on this device's timeline so far and raise if the device failed (`during` says
        what was being done): synchronize without its bookkeeping, for host copies that only need the earlier work
        done."""
        try:
            self.timeline_signal.wait(self._state[device_state.TIMELINE_VALUE] - 1, timeout=timeout)  # (timeline_value, without a property call)
        except HCQTimeoutError as e:
            self.error_state = e
            raise
        self.check_error(during)

    def _wrap_timeline_signal(self) -> None:
        entered = interrupts.enter()  # one step: a Ctrl-C part way would leave the signal, its address word and the value apart
        try:
            self.timeline_signal, self._shadow_timeline_signal = self._shadow_timeline_signal, self.timeline_signal
            self._note_timeline_address()
            HCQCompiled.drop_replicas(self.timeline_signal)
            self.timeline_signal.store(0)
            self.timeline_value = 1
            self.allocator._timeline_wrapped()
            self.kernargs_allocator.reset_tags()
        finally:
            interrupts.leave(entered)

    def _wait_for_tag(self, tag: int) -> None:
        # A region tagged with a value not yet submitted can only be waited on as far as work was submitted.
        self.timeline_signal.wait(min(tag, self.timeline_value - 1))

    # ---- failures
    def check_error(self, during: str | Callable[[], str]) -> None:
        """Raise DeviceError if the device failed (sticky until `recover()`, where the device can). `during` says what
        was being done; a callable is called only to build the message (a wait checks every 20 ms slice)."""
        if not isinstance(self.error_state, DeviceError):  # none yet, or only an earlier timeout
            msg = self._device_error()
            if msg is not None:
                then = ("dev.recover() clears it (work queued since the failure was dropped)" if self.capabilities.recover
                        else "this device cannot recover: open it again in a new process")
                if self.lost() is not None:
                    self.error_state = DeviceError(f"{self.device} failed: {msg}. Its memory and queues are gone; hcq.Device({self.device!r}) "
                                                   "opens it again once it can be reached")
                else:
                    self.error_state = DeviceError(f"{self.device} failed: {msg}. The failure is sticky: {then}")
        if isinstance(self.error_state, DeviceError): raise DeviceError(f"{self.error_state} (during {during if isinstance(during, str) else during()})")

    def _device_error(self) -> str | None:
        """Why the device failed, or None (an executor says; other backends override)."""
        return self.executor.error() if self.executor is not None else None

    @property
    def poison_id(self) -> int | None:
        """The id this device's failed executor tags the signals it still stores with (see hcq.packets)."""
        return self.executor.device_id if self.executor is not None else None

    @property
    def can_recover(self) -> bool:
        """Whether `recover()` can clear a failure of this device."""
        return self.capabilities.recover

    def recover(self, timeout: int | None = None) -> None:
        """Clear a sticky failure (kernel fault, bad packet, a wait released by a failed peer). Work queued when
        the device failed was dropped (its signals were still set, poisoned, so nothing waits forever), and
        memory the failed kernel wrote is whatever it left; the timeline and the ring fences restart as if all
        earlier work had finished. Waits (up to `timeout` ms) for the queues to drain first."""
        if not self.capabilities.recover: raise HCQError(f"{self.device} cannot recover from a failure; reopen the process")
        self.check_open()
        if self._device_error() is None:
            self.error_state = None
            return
        deadline = time.monotonic() + (wait_timeout_ms() if timeout is None else timeout) / 1000
        while not self._drained():
            if time.monotonic() > deadline: raise HCQTimeoutError(f"{self.device}: queues did not drain for recovery:\n{self.hang_report()}")
            time.sleep(0.001)
        self._recover_hardware()
        self.error_state = None
        self.timeline_signal.store(self.timeline_value - 1)  # a host store: clears the poison, wakes waiters
        for rings in self.rings.values():
            for r in rings: r.restart()

    def _drained(self) -> bool:
        """Whether every queue consumed all it was given (backends without an executor override)."""
        if self.executor is None: return True
        return all((st := self.executor.ring_state(r.handle)).rptr == st.wptr for rings in self.rings.values() for r in rings)

    def _recover_hardware(self) -> None:
        """Clear the failure in the hardware (an executor does; other backends override)."""
        if self.executor is not None: self.executor.recover()

    def queue_states(self) -> list[dict[str, Any]]:
        """Each queue: read/write positions, packets done, and the packet it is running (None when idle). A queue finishes
        a packet a moment after the packet's signal lands, so right after `synchronize()` it may still show that packet."""
        if not self.capabilities.queue_states: raise HCQError(f"{self.device} does not report queue states")
        out = []
        for rings in self.rings.values():
            for r in rings:
                st = self._ring_state(r)
                out.append({"device": self.device, "queue": "compute" if r.kind == COMPUTE else f"copy{r.index}", "rptr": st.rptr, "wptr": st.wptr,
                            "packets_done": st.packets_done, "current": describe_state(self, st)})
        return out

    def _ring_state(self, ring: Ring) -> RingState:
        """What `ring` is doing (backends without an executor override): positions that move while work progresses,
        and the running command (`current` words, or `text`) or None when idle."""
        if self.executor is None: raise HCQError(f"{type(self).__name__} must override _ring_state to report queue states")
        return self.executor.ring_state(ring.handle)

    def hang_report(self) -> str:
        """What the queues of this device's peer group are stuck on, and which peers failed (added to timeouts)."""
        lines = []
        for dev in self.peers():
            if dev.capabilities.queue_states and not dev.closed:
                for st in dev.queue_states():
                    cur = st["current"]
                    if cur is None:
                        if st["wptr"] != st["rptr"]: lines.append(f"{st['device']} {st['queue']}: {st['wptr'] - st['rptr']} words queued, not started")
                        continue
                    where = "" if cur["ring_word"] is None else f" at ring word {cur['ring_word']}" + \
                        (f", indirect packet {cur['indirect_index']}" if cur["indirect_index"] is not None else "")
                    lines.append(f"{st['device']} {st['queue']} is stuck{where}: {cur['text']}{self._current_value(cur['words'])}")
            if dev is not self and not dev.closed and (err := dev._device_error()) is not None:
                lines.append(f"{dev.device} has failed: {err}")
        return "\n".join(lines)

    def _current_value(self, words: list[int]) -> str:
        """', it is V' for a WAIT or POLL whose word the host can read."""
        if len(words) < 2 or decode_header(words[0])[0] not in (Op.WAIT, Op.POLL): return ""
        for dev in self.peers():
            buf = dev.allocator.owns(words[1], 8)
            if buf is not None and buf.view is not None and not buf.freed and isinstance(buf.va_addr, int):
                off = words[1] - buf.va_addr
                return f", it is {buf.view.view(off, 8, 'Q')[0]}"
        return ", its value is not readable by the host"

    def describe(self) -> list[str]:
        """Lines about the device for `hcq info` and the demo: its capabilities, then what the backend adds (e.g.
        its threads)."""
        c = self.capabilities
        optional = [f for f in ("recover", "queue_states", "host_visible_memory", "host_copies", "timestamps", "packets") if getattr(c, f)]
        return [f"queues {dict(c.queues)}, {c.word_bits}-bit words, poll {'/'.join(p.name for p in sorted(c.poll_conditions))}"
                f"{' (EQ under a mask)' if c.poll_mask else ''}; {', '.join(optional) or 'no optional capabilities'}"]

    def _shutdown(self) -> None:
        """Stop the device at interpreter exit (backends stop their command processors, then call this)."""
        if self.executor is not None and self._closed_reason is None:
            self.executor.close(self._ring_handles())
        self._close("was shut down (the interpreter is exiting)")

    # ---- kernargs and programs
    def check_launch_dims(self, global_size: Dims, local_size: Dims) -> tuple[tuple[sint, ...], tuple[sint, ...]]:
        """Launch dims (an int n is (n, 1, 1)) padded to 3, each concrete one an integer (an int or a numpy integer,
        returned as an int; never a bool) within this device's limits (the grid at most 2^63 - 1 blocks in all, a block
        at most `max_block_threads` threads), so nothing reaches the device that would run nothing or overflow.
        Symbolic dims are left to the device when they are resolved."""
        out = []
        for what, given, limits in (("global_size", global_size, self.max_grid), ("local_size", local_size, self.max_block)):
            dims = as_dims(given)
            if not isinstance(dims, tuple) or not 1 <= len(dims) <= 3:
                raise ValueError(f"{what} must be an int or a tuple of 1 to 3 dimensions, e.g. 256 or (256, 1, 1); got {given!r}")
            padded: list[sint] = []
            for i, (d, lim) in enumerate(zip(tuple(dims) + (1,) * (3 - len(dims)), limits)):
                if isinstance(d, Expr):
                    padded.append(d)
                    continue
                if (n := as_integer(d)) is None: raise ValueError(f"{what} dimensions must be positive ints, got {dims!r}")
                if not 1 <= n <= lim: raise ValueError(f"{what} dimensions must be in [1, {lim}] on {self.device}; {what}[{i}] is {n}")
                padded.append(n)
            out.append(tuple(padded))
        gs, ls = out
        if all(isinstance(d, int) for d in gs) and gs[0] * gs[1] * gs[2] > MAX_GRID_BLOCKS:  # type: ignore[operator]
            raise ValueError(f"global_size {gs} has more than 2^63 - 1 blocks")
        if all(isinstance(d, int) for d in ls) and (threads := ls[0] * ls[1] * ls[2]) > self.max_block_threads:  # type: ignore[operator]
            raise ValueError(f"local_size {ls} has {threads} threads; a block holds at most {self.max_block_threads} on {self.device}")
        return gs, ls

    @classmethod
    def precompile(cls, source: str) -> None:
        """Compile `source` ahead of time without opening a device (e.g. in a worker process), so that a later
        `compile` of it is a cache hit. Backends whose compiler runs elsewhere keep this no-op."""

    def compile(self, source: str, name: str) -> HCQProgram:
        """Compile `source` and load the kernel `name` on this device."""
        if not isinstance(source, str) or not isinstance(name, str): raise TypeError("compile(source: str, name: str)")
        self.check_open()
        return self.runtime(self, name, self.compiler.compile(source))

    def peers(self) -> list[HCQCompiled]:
        """Devices in this device's peer group (itself included, while it is open)."""
        return list(HCQCompiled.peer_groups.get(self.peer_group, ()))

    # ---- signals of other peer groups
    def replica(self, signal: HCQSignal) -> HCQSignal:
        """A signal this device's queues can wait on that follows `signal`: `signal` itself within the peer group,
        else a `SignalReplica` in this device's reach, made (once) by this device's backend or the owner's. Raises
        HCQError when neither can."""
        owner = cast("HCQCompiled | None", signal.owner)
        if owner is None or owner.peer_group == self.peer_group or signal.virtual: return signal
        r = self._replicas.get(id(signal))
        if r is not None and r.source is signal: return r
        r = self._import_signal(signal) or owner._export_signal(signal, self)
        if r is None:
            raise HCQError(f"{self.device} cannot wait on {signal!r}: neither {type(self).__name__} nor {type(owner).__name__} makes "
                           f"replicas of signals across peer groups ({owner.peer_group!r} -> {self.peer_group!r})")
        self._replicas[id(signal)] = r
        return r

    @staticmethod
    def drop_replicas(signal: HCQSignal) -> None:
        """Release every replica of `signal` (before its value goes down: a replica only ever catches up)."""
        for group in HCQCompiled.peer_groups.values():
            for dev in group:
                r = dev._replicas.get(id(signal))
                if r is not None and r.source is signal:
                    del dev._replicas[id(signal)]
                    r.release()

    def _import_signal(self, signal: HCQSignal) -> SignalReplica | None:
        """Backends: a replica of `signal` (of another peer group) in this device's memory, or None."""
        return None

    @staticmethod
    def mapped_replica(signal: HCQSignal, waiter: HCQCompiled) -> SignalReplica | None:
        """A replica of `signal` (of another peer group) that is its own memory, mapped where `waiter` reaches it (by
        either backend: `HCQAllocator.map`), or None where neither maps it. Backends whose signals live in memory both
        sides reach answer `_import_signal` / `_export_signal` with this."""
        try:
            waiter.allocator.map(signal.base_buf)
        except HCQError:
            return None
        return SignalReplica(signal, waiter.allocator.address_for(signal.base_buf), waiter)

    def _export_signal(self, signal: HCQSignal, waiter: HCQCompiled) -> SignalReplica | None:
        """Backends: a replica of this device's `signal` that `waiter` (of another peer group) reaches, or None."""
        return None

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.device}>"

