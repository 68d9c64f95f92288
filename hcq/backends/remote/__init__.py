"""Remote devices: hcq devices served by another process (`hcq serve`), reached over the network engine (net.c,
UCX). `hcq.Device("CPU:0@HOST:PORT")` opens one (see device.py); `hcq.backends.remote.net` is the engine; it needs
UCX: pip install 'hcq[remote]'."""
import importlib.util

from hcq.backends.remote.device import RemoteDevice
from hcq.backends.remote.net import INSTALL_HINT

DEVICE_CLASS = RemoteDevice

__all__ = ["RemoteDevice", "DEVICE_CLASS"]


def unavailable() -> str | None:
    """Why remote devices (and `hcq serve`) cannot run here, or None: UCX is not installed (looked for, not loaded)."""
    return None if importlib.util.find_spec("libucx") is not None else f"remote devices need UCX, which is not installed: {INSTALL_HINT}"
