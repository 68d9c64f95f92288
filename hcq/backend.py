"""Everything a backend imports, in one place (docs/backends.md walks through using it):

    from hcq.backend import Capabilities, COMPUTE, COPY, HCQAllocator, HCQBuffer, HCQCompiled, ...

The names live in the core's layers (their modules are listed in docs/backends.md); importing them from there
keeps working."""
from __future__ import annotations

from hcq.allocator import HCQAllocator
from hcq.device import HCQCompiled
from hcq.errors import CompileError, DeviceError, HCQError
from hcq.interfaces import COMPUTE, COPY, Capabilities
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

__all__ = ["HCQAllocator", "HCQCompiled", "CompileError", "DeviceError", "HCQError", "COMPUTE", "COPY", "Capabilities", "Ring",
           "BufferSpec", "HCQBuffer", "MMIOInterface", "Executor", "PacketComputeQueue", "PacketCopyQueue", "RingState", "SubmitStatus",
           "GUARD_CANCELLED", "GUARD_DONE", "GUARD_PENDING", "GUARD_RUNNING", "POISON_MASK", "POISON_TAG", "PollCondition", "ArgSlot",
           "CLikeArgsState", "HCQArgsState", "HCQProgram", "HWQueue", "register_backend", "HCQSignal", "StreamDevice", "DeviceFault",
           "Pending", "Stream", "StreamComputeQueue", "StreamCopyQueue", "StreamOps", "StreamStopped"]
