"""The NVIDIA backend: `NV:n` is the n-th NVIDIA GPU, driven through its own command queues (GPFIFO channels,
pushbuffers, semaphores, QMD launches) over the kernel driver's interface, with no CUDA in between; kernels are hcq's C
dialect compiled as CUDA C to sm_90 cubins by NVRTC. `HCQ_NV_EMULATE=1` puts an emulated GPU behind the same driver
calls (hcq.backends.nv.emulator), so NV runs, and is tested, on machines without one."""
from __future__ import annotations

import os
from typing import Any


def unavailable() -> str | None:
    """Why NV devices cannot open here, or None (the registry leaves NV out of `available_backends()` then)."""
    from hcq.backends.nv.abi import unavailable_reason
    from hcq.helpers import env_flag
    if not env_flag("HCQ_NV_EMULATE", False) and not os.path.exists("/dev/nvidiactl"):
        return "no NVIDIA driver here (/dev/nvidiactl is missing); HCQ_NV_EMULATE=1 opens an emulated GPU"
    return unavailable_reason()


def __getattr__(name: str) -> Any:  # the device module loads only when an NV device is opened
    if name == "DEVICE_CLASS":
        from hcq.backends.nv.device import NVDevice
        return NVDevice
    raise AttributeError(name)


DEVICE_HOST = "hcq.backends.nv.hosting:NVHost"  # what `hcq serve` hosts NV devices with (an hcq.interfaces.DeviceHost)
