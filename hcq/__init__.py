"""hcq: a runtime that drives compute devices through hardware command queues.

`import hcq` is all a program needs (`from hcq import arrays` adds numpy helpers). Most programs touch three objects:

- `dev = hcq.Device("CPU")`: the device (`HCQCompiled`); `dev.compile(source, name)` gives a program (`HCQProgram`),
  `dev.synchronize()` waits for everything submitted, `dev.new_signal()` gives a signal (`HCQSignal`).
- `dev.allocator` (`HCQAllocator`): `alloc(nbytes, BufferSpec(...))`, `free(buf, nbytes, spec)`,
  `copyin(buf, memoryview)`, `copyout(memoryview, buf)`, `transfer(...)` between devices.
- `q = dev.hw_compute_queue_t()` (or `dev.hw_copy_queue_t(index)`) (`HWQueue`): chain commands (`wait`, `exec`,
  `copy`, `signal`, `timestamp`, ...), then `q.submit(dev, var_vals)`.

Backends import what they build on from `hcq.backend` (see docs/backends.md).

The core in layers (see docs/design.md): the packet format (hcq.packets), the backend contract
(hcq.interfaces), memory (hcq.memory), signals (hcq.signal), lifetimes (hcq.lifetimes), programs (hcq.program),
queues (hcq.queue, hcq.packet_queue), the allocator (hcq.allocator), the device (hcq.device), graphs
(hcq.graph) and the registry (hcq.registry); then one package per backend under hcq.backends, and the
conformance kit for backends (hcq.conformance)."""
from hcq.allocator import HCQAllocator
from hcq.device import HCQCompiled, TimelineRing
from hcq.graph import Capture, CopyItem, ExecItem, GraphEntry, HCQGraph, capture, jit
from hcq.errors import CompileError, DeviceError, HCQError, HCQTimeoutError, QueueKindError, WaitInterrupted
from hcq.interfaces import Capabilities
from hcq.memory import ArrayView, BufferSpec, HCQBuffer, MMIOInterface, NotHostVisibleError
from hcq.packets import PollCondition
from hcq.program import ArgSlot, CLikeArgsState, HCQArgsState, HCQProgram
from hcq.queue import HWQueue
from hcq.signal import HCQSignal
from hcq.profiler import Event, Profiler, profile
from hcq.registry import Device, available_backends, opened_devices, register_backend
from hcq.validation import ValidationError
from hcq.symbolic import Expr, UnboundVariableError, Variable, sint

__version__ = "0.1.0"

from hcq import profiler as _profiler  # noqa: E402

_profiler.start_from_env()
__all__ = ["ValidationError", "Event", "Profiler", "profile", "Capture", "CopyItem", "ExecItem", "GraphEntry", "HCQGraph", "capture", "jit", "ArgSlot", "ArrayView", "BufferSpec", "Capabilities", "PollCondition", "register_backend", "CLikeArgsState", "CompileError", "Device", "DeviceError", "Expr", "HCQAllocator", "HCQArgsState",
           "HCQBuffer", "HCQCompiled", "HCQError", "HCQProgram", "HCQSignal", "HCQTimeoutError", "HWQueue", "MMIOInterface",
           "NotHostVisibleError", "QueueKindError", "TimelineRing", "UnboundVariableError", "Variable", "WaitInterrupted", "available_backends",
           "opened_devices", "sint"]
