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
