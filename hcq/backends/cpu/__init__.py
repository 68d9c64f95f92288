"""The CPU backend: a real HCQ device whose command processor is native code (cp.c)."""
from hcq.backends.cpu.device import CPUAllocator, CPUComputeQueue, CPUCopyQueue, CPUDevice, CPUProgram, CPUSignal

DEVICE_CLASS = CPUDevice
DEVICE_HOST = "hcq.backends.cpu.hosting:CPUHost"  # what `hcq serve` hosts (imported only by a server: hcq.registry.device_host)

__all__ = ["CPUAllocator", "CPUComputeQueue", "CPUCopyQueue", "CPUDevice", "CPUProgram", "CPUSignal", "DEVICE_CLASS", "DEVICE_HOST"]
