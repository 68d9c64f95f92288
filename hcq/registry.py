"""Opening devices by name: `Device("CPU")` is `Device("CPU:0")`; `Device()` opens $DEV (default CPU).
Backends are found by name under hcq.backends, so the core never imports one."""
from __future__ import annotations

import importlib
import os
import pkgutil
import re
import threading

from hcq.device import HCQCompiled

_devices: dict[str, HCQCompiled] = {}
_lock = threading.Lock()


def available_backends() -> list[str]:
    import hcq.backends
    return sorted(m.name.upper() for m in pkgutil.iter_modules(hcq.backends.__path__) if m.ispkg)


def canonical_name(name: str) -> str:
    """'cpu' -> 'CPU:0', 'CPU:1' -> 'CPU:1'. Raises ValueError for a malformed name."""
    m = re.fullmatch(r"\s*([A-Za-z_][A-Za-z0-9_]*)\s*(?::\s*(\d+))?\s*", name)
    if not m: raise ValueError(f"bad device name {name!r}; expected KIND or KIND:INDEX, e.g. 'CPU' or 'CPU:1'")
    return f"{m.group(1).upper()}:{int(m.group(2) or 0)}"


def default_device_name() -> str:
    if os.environ.get("HCQ_VISIBLE_DEVICES"):
        raise RuntimeError("HCQ_VISIBLE_DEVICES is no longer supported; choose the device with DEV instead, e.g. DEV=CPU:1")
    return os.environ.get("DEV") or "CPU"


def Device(name: str | None = None) -> HCQCompiled:  # noqa: N802 - reads like a constructor, as in the seeds
    """The device called `name` (opened once, then cached); with no name, the one $DEV names (default CPU)."""
    if name is None: name = default_device_name()
    elif os.environ.get("HCQ_VISIBLE_DEVICES"): default_device_name()  # refuse the deprecated variable everywhere
    if not isinstance(name, str): raise TypeError(f"device name must be a str, got {type(name).__name__}")
    key = canonical_name(name)
    if (dev := _devices.get(key)) is not None: return dev
    kind = key.split(":")[0]
    if kind not in available_backends():
        raise ValueError(f"unknown device {name!r}; available backends: {', '.join(available_backends())}")
    with _lock:
        if key not in _devices:
            module = importlib.import_module(f"hcq.backends.{kind.lower()}")
            _devices[key] = module.DEVICE_CLASS(key)
        return _devices[key]


def opened_devices() -> list[HCQCompiled]:
    """Devices opened so far, in order."""
    return list(_devices.values())


def _after_fork_in_child() -> None:
    """Devices of the parent are unusable in a forked child (see hcq.device): names open fresh ones there."""
    global _lock
    _devices.clear()
    _lock = threading.Lock()  # another thread may have held it at the fork


os.register_at_fork(after_in_child=_after_fork_in_child)
