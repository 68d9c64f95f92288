"""Remote devices: hcq devices served by another process (`hcq serve`), reached over the network engine (net.c,
UCX). `hcq.Device("CPU:0@HOST:PORT")` opens one (see device.py); `hcq.backends.remote.net` is the engine; it needs
UCX: pip install 'hcq[remote]'."""
from hcq.backends.remote.device import RemoteDevice

DEVICE_CLASS = RemoteDevice

__all__ = ["RemoteDevice", "DEVICE_CLASS"]
