"""The CPU backend: a real HCQ device whose command processor is native code (cp.c)."""
from hcq.backends.cpu.device import CPUAllocator, CPUComputeQueue, CPUCopyQueue, CPUDevice, CPUProgram, CPUSignal

DEVICE_CLASS = CPUDevice

__all__ = ["CPUAllocator", "CPUComputeQueue", "CPUCopyQueue", "CPUDevice", "CPUProgram", "CPUSignal", "DEVICE_CLASS"]
