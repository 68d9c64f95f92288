"""hcq: a runtime that drives compute devices through hardware command queues.

Layers: symbolic values (hcq.symbolic), memory (hcq.memory), queues and signals (hcq.queue), allocator
(hcq.allocator), programs (hcq.program), device (hcq.device), device registry (hcq.registry), then one
package per backend under hcq.backends."""
from hcq.allocator import HCQAllocator
from hcq.device import HCQCompiled, TimelineRing
from hcq.graph import Capture, CopyItem, ExecItem, GraphEntry, HCQGraph, capture, jit
from hcq.errors import CompileError, DeviceError, HCQError, HCQTimeoutError, QueueKindError
from hcq.memory import BufferSpec, HCQBuffer, MMIOInterface, NotHostVisibleError
from hcq.program import ArgSlot, CLikeArgsState, HCQArgsState, HCQProgram
from hcq.queue import HWQueue
from hcq.signal import HCQSignal
from hcq.profiler import Event, Profiler, profile
from hcq.registry import Device, available_backends, opened_devices
from hcq.validation import ValidationError
from hcq.symbolic import Expr, UnboundVariableError, Variable, sint

__version__ = "0.1.0"

from hcq import profiler as _profiler  # noqa: E402

_profiler.start_from_env()
__all__ = ["ValidationError", "Event", "Profiler", "profile", "Capture", "CopyItem", "ExecItem", "GraphEntry", "HCQGraph", "capture", "jit", "ArgSlot", "BufferSpec", "CLikeArgsState", "CompileError", "Device", "DeviceError", "Expr", "HCQAllocator", "HCQArgsState",
           "HCQBuffer", "HCQCompiled", "HCQError", "HCQProgram", "HCQSignal", "HCQTimeoutError", "HWQueue", "MMIOInterface",
           "NotHostVisibleError", "QueueKindError", "TimelineRing", "UnboundVariableError", "Variable", "available_backends",
           "opened_devices", "sint"]
