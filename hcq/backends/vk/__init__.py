"""The Vulkan backend: `VK:n` is the n-th Vulkan device, driven through hcq packets by a native command processor
(vk.c) that records them into command buffers; kernels are GLSL compute shaders compiled by glslang. Needs a Vulkan
driver and `glslangValidator` (`unavailable()` says what is missing)."""
from __future__ import annotations

from typing import Any

DEVICE_HOST = "hcq.backends.vk.hosting:VKHost"  # what `hcq serve --devices VK:0` hosts (imported only by a server)


def unavailable() -> str | None:
    """Why VK devices cannot open here, or None (the registry leaves VK out of `available_backends()` then)."""
    from hcq.backends.vk.native import unavailable_reason
    return unavailable_reason()


def __getattr__(name: str) -> Any:  # the device module loads (and builds vk.c) only when a VK device is opened
    if name == "DEVICE_CLASS":
        from hcq.backends.vk.device import VKDevice
        return VKDevice
    raise AttributeError(name)
