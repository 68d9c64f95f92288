"""The backend contract, as a leaf module every layer may import: `Capabilities` (what a backend declares
instead of the core probing attributes) and the protocols lower layers use of a device and its
signals, so memory, signals, queues, the allocator and programs never import `hcq.device` (nor anything above
them: this module imports only the packet format)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Protocol

from hcq.packets import PollCondition

COMPUTE, COPY = "compute", "copy"  # the queue kinds


@dataclass(frozen=True)
class Capabilities:
    """What a backend's devices can do; the core asks this record and never probes for attributes.

    queues: queue kind -> how many queues of it ({"compute": 1, "copy": 2}); word_bits: width of a queue word
    (symbolic values must fit it); poll_conditions: the PollConditions `poll_bit` may ask for (poll_mask: whether
    an EQ poll takes a mask other than all-ones); recover: `dev.recover()` clears a failure; queue_states:
    `dev.queue_states()` reports what each queue is doing; host_visible_memory: device memory has a `cpu_view`;
    host_copies: the copy engine reaches host memory directly (cancellable guarded copies); timestamps: signals'
    timestamps hold device time; packets: queues are hcq packets run by an executor (see hcq.packet_queue)."""
    queues: Mapping[str, int] = field(default_factory=lambda: {COMPUTE: 1, COPY: 1})
    word_bits: int = 64
    poll_conditions: frozenset[PollCondition] = frozenset({PollCondition.EQ})
    poll_mask: bool = True
    recover: bool = False
    queue_states: bool = False
    host_visible_memory: bool = False
    host_copies: bool = False
    timestamps: bool = True
    packets: bool = False
    independent_copy: bool = True

    def __post_init__(self) -> None:
        if self.word_bits not in (32, 64): raise ValueError(f"word_bits must be 32 or 64, got {self.word_bits}")
        if self.queues.get(COMPUTE, 0) < 1: raise ValueError("a device needs at least one compute queue")
        if any(k not in (COMPUTE, COPY) or n < 0 for k, n in self.queues.items()):
            raise ValueError(f"queues must map 'compute'/'copy' to counts >= 0, got {dict(self.queues)}")

    def queue_count(self, kind: str) -> int:
        """How many queues of `kind` ("compute" or "copy") the device has."""
        return self.queues.get(kind, 0)

    def to_wire(self) -> dict[str, Any]:
        """This record as JSON-able values (what `hcq serve` tells a client of a device it hosts); `from_wire` reads it."""
        return {"queues": dict(self.queues), "word_bits": self.word_bits, "poll_conditions": sorted(c.name for c in self.poll_conditions),
                "poll_mask": self.poll_mask, "recover": self.recover, "queue_states": self.queue_states,
                "host_visible_memory": self.host_visible_memory, "host_copies": self.host_copies, "timestamps": self.timestamps,
                "packets": self.packets, "independent_copy": self.independent_copy}

    @classmethod
    def from_wire(cls, wire: Mapping[str, Any], **override: Any) -> Capabilities:
        """The record `to_wire` gave, with `override` (fields the reader knows better) replacing what it says; ValueError
        naming what is wrong with a malformed one."""
        try:
            fields = {**wire, "poll_conditions": frozenset(PollCondition[name] for name in wire["poll_conditions"]), **override}
            return cls(**fields)
        except (KeyError, TypeError) as e:
            raise ValueError(f"a malformed capability record ({e!r}): {wire!r}") from None


@dataclass(frozen=True)
class HostStores:
    """What a backend whose command processor runs its devices' stores as host stores (device addresses that are host
    addresses, as `cpu_view().addr == va_addr` says of a buffer) offers a backend that follows that memory from
    elsewhere: the remote backend forwards such stores to its servers and pushes a server's stores into such memory.
    The device class names it (`HCQCompiled.host_stores`); functions are C addresses, made at first use:
    - `set_hook(fn, ctx)`: every store of the backend's command processors (and host stores into its signals) is then
      handed to `void fn(void *ctx, uint64_t addr, uint64_t nbytes, uint32_t flags, uint64_t value)` after it is
      published (FLAG_SIGNAL in flags: a 16-byte signal, whose word the hook reads, or with HOOK_VALUE `value` is the
      value to forward: never one ahead of stores not handed over yet, nor older than one handed over already);
      `set_hook(None, None)` removes it (waiting for hooks under way);
    - `poison()`: `void poison(void *signal, uint64_t value, uint32_t id)`, a signal store poisoned in the name of `id`
      (a WAIT it releases fails its device, naming `id`);
    - `waker()`: `void wake(void *addr, uint64_t value)`, wakes the backend's threads asleep on the word at `addr`
      (called after a store made from outside the backend);
    - `name_feeder(why)`: a poison id that names no device of the backend: a WAIT released by it says `why`."""
    set_hook: Callable[[int | None, int | None], None]
    poison: Callable[[], int]
    waker: Callable[[], int]
    name_feeder: Callable[[str], int]


class HostedMemory(Protocol):
    """Device memory a `DeviceHost` hands out: `addr` its device address, `size` its usable bytes, `fd` a memfd that
    holds it (other servers on the host may map it; -1: none). With `host_visible` the host reaches it at `addr` too;
    without (device-local memory, given only where `memory` was asked for it with `host=False`), only the device's
    queues touch its bytes."""
    addr: int
    size: int
    fd: int
    host_visible: bool


class DeviceHost(Protocol):
    """What `hcq serve` needs of a backend to host its devices for clients, beyond the ordinary contract: the backend
    package names it `DEVICE_HOST` (`hcq.registry.device_host`); docs/backends.md, "Serving a backend", says more.
    The server's C handlers (serve.c) copy what clients submit into runtime memory and follow what its command
    processors store through `stores.set_hook`, so runtime memory (and windows, landing buffers) is host memory at its
    device address; user buffers may be device-local (`memory(host=False)`), and their bytes then move only through
    the device's own queues (staging and landing buffers)."""
    kind: str
    stores: HostStores
    queue_state_fields: tuple[str, ...]  # the words of `executor.ring_state` a client is told of
    # Whether its devices' stores are in memory before the store hook hears of them (a GPU's, handed over once their batch
    # finished). Clients on the server's host then get their runtime memory mirrored by messages, not shared: a signal the
    # device stores would be seen there before the bytes the hook pushes ahead of it (a window into a client's device).
    stores_before_hook: bool
    # Whether one client's devices of this host reach each other's memory, as the devices of one peer group do (the remote
    # backend makes a server's devices one peer group). False (GPUs without peer mappings): a client opens one at a time.
    devices_share_memory: bool

    def preload(self) -> None:
        """Load the native code the host needs (a worker does this before it is confined)."""

    def native_functions(self) -> tuple[int, int, int]:
        """C addresses serve.c calls: int submit(ring, words, nwords, timeout_ns) (a `SubmitStatus`), void
        store(signal, value) (a host store into a signal, not handed to the store hook), uint64_t rptr(ring)."""

    def set_idle_hook(self, fn: int | None, ctx: int | None) -> None:
        """`void fn(void *ctx)`, called by a queue thread about to go idle (it may take network work meanwhile)."""

    def queue_settings(self) -> tuple[int, int]:
        """(workers, copy engines) of each device served."""

    def now_ns(self) -> int:
        """The clock its signals' timestamps use, in ns."""

    def describe(self, executor: Any) -> dict[str, Any]:
        """What a client is told of the device `executor` is an instance of, besides its `kind`: capabilities (`Capabilities.to_wire`: the client
        keeps what it says of poll conditions and masks, recovery, queue states, timestamps, word bits and independent
        copies), max_grid, max_block, max_block_threads, timestamp_divider, language, compiler (a version line),
        conformance_kernels (hcq.conformance's table)."""

    def open_device(self, name: str, workers: int) -> Any:
        """A device instance for one client: an `Executor` with `device_id`, `handle`, `open_ring`, `ring_state`,
        `error` and `recover`."""

    def failed_flag(self, executor: Any) -> int:
        """The address of the 4-byte word that is nonzero while `executor`'s device is failed."""

    def stop_device(self, executor: Any, rings: list[Any]) -> bool:
        """Stop the device and its rings (freed once every thread is joined); True when no packet of it runs any more."""

    def memory(self, size: int, executor: Any, shareable: bool = False, fd: int | None = None, host: bool = True) -> HostedMemory:
        """`size` bytes of memory of `executor`'s device (guarded: a kernel that runs off either end faults). `shareable`:
        in a memfd if the host can (else `fd` -1); `fd`: the client's memory (a memfd sealed against shrinking), mapped
        here; `host`: memory the host must reach at its device address (False: a user buffer, which may be device-local
        memory, `host_visible` False, where the device keeps its buffers there); MemoryError when it cannot."""

    def load(self, source: str, name: str, executor: Any) -> tuple[int, int, list[Any], Any, Any]:
        """Compile kernel `name` of `source` and load it on `executor`'s device: (entry, kernargs size, arg slots, what
        keeps the code loaded, its `hcq.program.BufferBindings` or None)."""

    def cas64(self, addr: int, expected: int, desired: int) -> int:
        """Compare-and-swap of the 64-bit word at `addr` (seq_cst); returns the value found."""

    def poison(self, addr: int, value: int, poison_id: int) -> None:
        """Store `value` into the signal at `addr`, poisoned in the name of `poison_id` (`stores.name_feeder`)."""


class SignalLike(Protocol):
    """What lower layers use of a signal (`hcq.signal.HCQSignal` implements it)."""
    value_addr: Any

    def load(self) -> int: ...

    def store(self, value: int, wake: bool = True) -> None: ...

    def wait(self, value: int, timeout: int | None = None, *, failed_ok: bool = False) -> None: ...


class DeviceLike(Protocol):
    """What the layers below the device use of one (`hcq.device.HCQCompiled` implements it)."""
    device: str
    peer_group: str
    capabilities: Capabilities
    timeline_value: int
    max_grid: tuple[int, int, int]
    max_block: tuple[int, int, int]
    max_block_threads: int
    hw_compute_queue_t: Any
    kernel_names: dict[int, str]
    hw_copy_queue_t: Any

    @property
    def allocator(self) -> Any: ...

    @property
    def timeline_signal(self) -> Any: ...

    @property
    def closed(self) -> bool: ...

    @property
    def poison_id(self) -> int | None: ...

    def check_open(self) -> None: ...

    def check_error(self, during: str | Callable[[], str]) -> None: ...

    def hang_report(self) -> str: ...

    def native_state(self) -> Any: ...

    def new_signal(self, **kwargs: Any) -> Any: ...

    def peers(self) -> list[Any]: ...

    def replica(self, signal: Any) -> Any: ...

    def synchronize(self, timeout: int | None = None) -> None: ...

    def wait_timeline(self, during: str, timeout: int | None = None) -> None: ...

    def submit_timeline(self, q: Any, var_vals: Any = None) -> int: ...
