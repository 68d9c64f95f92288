"""The emulated NVIDIA GPU that stands in for hardware when none is present (`HCQ_NV_EMULATE=1`, and CI): its GPU
address space (memory.py), the GPU that decodes and runs what the backend submits (gpu.py), the CPU twins that run its
kernels (twins.py) and the driver model (driver.py)."""
