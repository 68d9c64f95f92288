"""Opening devices by name: `Device("CPU")` is `Device("CPU:0")`; `Device()` opens $DEV (default CPU).

Backends register under the entry-point group `hcq.backends` (name = device kind, value = `module:DeviceClass`),
so an out-of-tree backend plugs in with `pip install`; the backends shipped in `hcq.backends` are found even when
hcq runs from a source tree without being installed. The core never imports a backend until its kind is opened."""
from __future__ import annotations

import functools
import importlib
import os
import pkgutil
import re
import threading
from typing import Any

from hcq import lifecycle
from hcq.device import HCQCompiled
from hcq.errors import HCQError

ENTRY_POINT_GROUP = "hcq.backends"
_devices: dict[str, HCQCompiled] = {}
_lock = threading.Lock()
_extra: dict[str, str] = {}  # kinds registered at run time: kind -> "module:Class"
_classes: dict[str, type[HCQCompiled]] = {}  # ...and their classes, when registered as classes


_scanned: tuple[Any, dict[str, str]] | None = None  # (the scanning function, kind -> target of installed backends)


def entry_points(group: str) -> list[Any]:
    """The installed entry points of `group` (importlib.metadata is imported here, not with hcq: 13 ms)."""
    from importlib.metadata import entry_points as installed
    return list(installed(group=group))


def _installed_targets() -> dict[str, str]:
    """Kind -> target of the installed backends, scanned once per process (a scan reads every installed package's
    metadata: 7 ms); a backend installed later is found by the next process."""
    global _scanned
    if _scanned is None or _scanned[0] is not entry_points:
        _scanned = (entry_points, {ep.name.upper(): ep.value for ep in entry_points(group=ENTRY_POINT_GROUP)})
    return _scanned[1]


def _backend_targets() -> dict[str, str]:
    """Device kind -> "module:DeviceClass" of every backend: shipped ones, installed entry points, run-time ones."""
    return {**{kind: f"hcq.backends.{kind.lower()}:DEVICE_CLASS" for kind in _shipped()}, **_installed_targets(), **_extra}


def available_backends() -> list[str]:
    """The device kinds that can be opened (a shipped backend whose requirements this machine lacks is left out:
    `unavailable_backends()` says why)."""
    missing = unavailable_backends()
    return sorted(k for k in _backend_targets() if k not in missing)


def unavailable_backends() -> dict[str, str]:
    """Shipped backends that cannot open devices here, each with the reason (e.g. VK without a Vulkan driver). A
    backend package says so through a module-level `unavailable()` returning the reason or None."""
    found = {kind: unavailable_reason(kind) for kind in _shipped()}
    return {kind: why for kind, why in found.items() if why is not None}


@functools.cache
def _shipped() -> tuple[str, ...]:
    """The kinds of the backends in hcq.backends."""
    import hcq.backends
    return tuple(m.name.upper() for m in pkgutil.iter_modules(hcq.backends.__path__) if m.ispkg)


def unavailable_reason(kind: str) -> str | None:
    """Why the shipped backend `kind` ("VK") cannot open devices here, or None (also for kinds that are not shipped)."""
    if kind in _extra or kind not in _shipped(): return None
    check = getattr(importlib.import_module(f"hcq.backends.{kind.lower()}"), "unavailable", None)
    return check() if check is not None else None


def register_backend(kind: str, target: str | type[HCQCompiled]) -> None:
    """Make `kind` openable in this process: `target` is a device class or "module:DeviceClass" (what an entry point
    in group `hcq.backends` would hold). For tests and for backends that are not installed as packages."""
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", kind): raise ValueError(f"bad backend kind {kind!r}")
    if isinstance(target, type):
        _classes[kind.upper()] = target
        target = f"{target.__module__}:{target.__qualname__}"
    _extra[kind.upper()] = target



def _device_class(kind: str) -> Any:
    if kind in _classes: return _classes[kind]
    target = _backend_targets()[kind]
    module_name, _, attr = target.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split(".") if attr else ("DEVICE_CLASS",): obj = getattr(obj, part)
    if not (isinstance(obj, type) and issubclass(obj, HCQCompiled)):
        raise TypeError(f"backend {kind}: {target!r} is not an HCQCompiled subclass")
    return obj


def device_host(kind: str) -> Any:
    """A new `hcq.interfaces.DeviceHost` for backend `kind` ("CPU"), what `hcq serve` needs to host its devices: the
    backend's module names it `DEVICE_HOST = "module:Class"`. ValueError naming the backend and what it lacks otherwise."""
    return device_host_class(kind)()


def device_host_class(kind: str) -> type:
    """The class `device_host` makes an instance of (checking a backend without making one); ValueError as there."""
    targets = _backend_targets()
    if kind not in targets: raise ValueError(f"no backend {kind!r} here (there are {', '.join(sorted(targets))})")
    module = importlib.import_module(targets[kind].partition(":")[0])
    target = getattr(module, "DEVICE_HOST", None)
    if not isinstance(target, str) or ":" not in target:
        raise ValueError(f"the {kind} backend cannot be served: it names no DEVICE_HOST (an hcq.interfaces.DeviceHost: host memory "
                         "at its device addresses, a command processor whose stores go through a store hook, a kernel loader; "
                         "see docs/backends.md, 'Serving a backend')")
    host_module, _, attr = target.partition(":")
    cls = getattr(importlib.import_module(host_module), attr)
    if not isinstance(cls, type): raise ValueError(f"the {kind} backend's DEVICE_HOST {target!r} names {type(cls).__name__}, not a class")
    from hcq.interfaces import DeviceHost
    members = [*DeviceHost.__annotations__, *(n for n, v in vars(DeviceHost).items() if callable(v) and not n.startswith("_"))]
    missing = [name for name in members if not hasattr(cls, name)]
    if missing: raise ValueError(f"the {kind} backend's DEVICE_HOST {target!r} lacks {', '.join(missing)} (see hcq.interfaces.DeviceHost)")
    return cls


REMOTE_KIND = "REMOTE"  # the backend that opens devices named KIND:INDEX@HOST:PORT (served by another process)


def canonical_name(name: str) -> str:
    """'cpu' -> 'CPU:0', 'CPU:1' -> 'CPU:1', 'cpu@host:5555' -> 'CPU:0@host:5555'. Raises ValueError for a malformed name."""
    m = re.fullmatch(r"\s*([A-Za-z_][A-Za-z0-9_]*)\s*(?::\s*(\d+))?\s*(?:@\s*(\S+?)\s*)?", name)
    if not m or (m.group(3) is not None and not re.fullmatch(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):\d+", m.group(3))):
        raise ValueError(f"bad device name {name!r}; expected KIND, KIND:INDEX or KIND:INDEX@HOST:PORT, e.g. 'CPU', 'CPU:1' or "
                         "'CPU:0@127.0.0.1:5555'")
    return f"{m.group(1).upper()}:{int(m.group(2) or 0)}" + (f"@{m.group(3)}" if m.group(3) else "")


def _kind_of(key: str) -> str:
    """The backend kind that opens the device with canonical name `key`."""
    return REMOTE_KIND if "@" in key else key.split(":")[0]


def default_device_name() -> str:
    return os.environ.get("DEV") or "CPU"


def Device(name: str | None = None) -> HCQCompiled:  # noqa: N802 - reads like a constructor, as in the seeds
    """The device called `name` (opened once, then cached); with no name, the one $DEV names (default CPU)."""
    if name is None: name = default_device_name()
    if not isinstance(name, str): raise TypeError(f"device name must be a str, got {type(name).__name__}")
    key = canonical_name(name)
    if (dev := _devices.get(key)) is not None and not dev.closed and dev.lost() is None: return dev
    kind = _kind_of(key)
    if kind not in _backend_targets():
        raise ValueError(f"unknown device {name!r}; available backends: {', '.join(available_backends())}")
    if (why := unavailable_reason(kind)) is not None: raise HCQError(f"cannot open {name!r}: {kind} is unavailable here: {why}")
    with _lock:
        if (dev := _devices.get(key)) is not None and (why := dev.lost()) is not None:
            for peer in [p for p in dev.peers() if p.lost() is not None]:  # (its peers went with it: they leave together)
                peer.retire(f"was lost ({why}); hcq.Device({peer.device!r}) opens it again")
                _devices.pop(peer.device, None)
        if key not in _devices or _devices[key].closed: _devices[key] = _device_class(kind)(key)
        return _devices[key]


def _forget(dev: HCQCompiled) -> None:
    """A closed device: its name opens a new one."""
    if _devices.get(dev.device) is dev: del _devices[dev.device]


lifecycle.close_hooks.append(_forget)


def precompile(name: str, source: str) -> None:
    """Warm the compile cache of the backend of device `name` for `source`, without opening the device."""
    _device_class(_kind_of(canonical_name(name))).precompile(source)


def opened_devices() -> list[HCQCompiled]:
    """Devices opened so far, in order."""
    return list(_devices.values())


def _after_fork_in_child() -> None:
    """Devices of the parent are unusable in a forked child (see hcq.device): names open fresh ones there."""
    global _lock
    _devices.clear()
    _lock = threading.Lock()  # another thread may have held it at the fork


os.register_at_fork(after_in_child=_after_fork_in_child)
