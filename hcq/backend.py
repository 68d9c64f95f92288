"""Everything a backend imports, in one place (docs/backends.md walks through using it):

    from hcq.backend import Capabilities, COMPUTE, COPY, HCQAllocator, HCQBuffer, HCQCompiled, ...

The names live in the core's layers (their modules are listed in docs/backends.md); importing them from there
keeps working."""
from __future__ import annotations

from hcq.allocator import HCQAllocator
from hcq.device import HCQCompiled
from hcq.errors import CompileError, DeviceError, HCQError
from hcq.interfaces import COMPUTE, COPY, Capabilities, DeviceHost, HostedMemory, HostStores
from hcq.lifetimes import Ring
from hcq.memory import BufferSpec, HCQBuffer, MMIOInterface
from hcq.packet_queue import Executor, PacketComputeQueue, PacketCopyQueue, RingState, SubmitStatus
from hcq.packets import GUARD_CANCELLED, GUARD_DONE, GUARD_PENDING, GUARD_RUNNING, POISON_MASK, POISON_TAG, PollCondition
from hcq.program import ArgSlot, CLikeArgsState, HCQArgsState, HCQProgram
from hcq.queue import HWQueue
from hcq.registry import register_backend
from hcq.signal import HCQSignal
from hcq.stream_device import StreamDevice
from hcq.stream_queue import DeviceFault, Pending, Stream, StreamComputeQueue, StreamCopyQueue, StreamOps, StreamStopped

__all__ = ["HCQAllocator", "HCQCompiled", "CompileError", "DeviceError", "HCQError", "COMPUTE", "COPY", "Capabilities", "DeviceHost", "HostedMemory", "HostStores", "Ring",
           "BufferSpec", "HCQBuffer", "MMIOInterface", "Executor", "PacketComputeQueue", "PacketCopyQueue", "RingState", "SubmitStatus",
           "GUARD_CANCELLED", "GUARD_DONE", "GUARD_PENDING", "GUARD_RUNNING", "POISON_MASK", "POISON_TAG", "PollCondition", "ArgSlot",
           "CLikeArgsState", "HCQArgsState", "HCQProgram", "HWQueue", "register_backend", "HCQSignal", "StreamDevice", "DeviceFault",
           "Pending", "Stream", "StreamComputeQueue", "StreamCopyQueue", "StreamOps", "StreamStopped", "contract_problems"]


# The encoders every queue class of a backend without packets implements (besides `_exec` / `_copy` by kind).
_QUEUE_ENCODERS = ("_signal", "_wait", "_timestamp", "_memory_barrier", "_write", "_poll_bit", "_submit")


def _overrides(cls: type, base: type, name: str) -> bool:
    return getattr(cls, name, None) is not getattr(base, name, None)


def contract_problems(dev: HCQCompiled) -> list[str]:
    """What the backend of `dev` leaves unimplemented of the hooks the core calls, each named with its owner (empty when
    nothing is missing). The conformance kit reports these first; docs/backends.md says what each hook does.
    - the allocator: `_alloc`, `_free` and `_map_into`;
    - without an executor (`capabilities.packets` False): the queue encoders of both queue classes (`_exec` on the
      compute queue, `_copy` on the copy queue, `_submit` on both), and the device's `_open_ring`, `_device_error`,
      `_drained`, `_recover_hardware` (if it declares `recover`) and `_ring_state` (if it declares `queue_states`);
    - with packets: an `Executor`."""
    problems: list[str] = []
    alloc_t = type(dev.allocator)
    problems += [f"{alloc_t.__name__}.{h}" for h in ("_alloc", "_free", "_map_into") if not _overrides(alloc_t, HCQAllocator, h)]
    caps, dev_t = dev.capabilities, type(dev)
    if caps.packets:
        if dev.executor is None: problems.append(f"{dev_t.__name__}: declares packets but passes no Executor")
        return problems
    queues = [(dev.hw_compute_queue_t, "_exec")] + ([(dev.hw_copy_queue_t, "_copy")] if dev.hw_copy_queue_t is not None and caps.queue_count(COPY) else [])
    for q_t, own in queues:
        problems += [f"{q_t.__name__}.{h}" for h in (*_QUEUE_ENCODERS, own) if not _overrides(q_t, HWQueue, h)]
    hooks = ["_open_ring", "_device_error", "_drained"] + (["_recover_hardware"] if caps.recover else []) + (["_ring_state"] if caps.queue_states else [])
    problems += [f"{dev_t.__name__}.{h}" for h in hooks if not _overrides(dev_t, HCQCompiled, h)]
    return problems
