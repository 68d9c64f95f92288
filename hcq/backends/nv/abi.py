"""NVIDIA's published interface, as the NV backend and its emulator read it: resource-manager structures and
controls, UVM ioctls, class numbers, method offsets and fields, launch-descriptor (QMD) fields. None of it is typed in
here: it comes from the modules tinygrad generates from the headers of NVIDIA's open GPU kernel modules and open GPU
documentation, one per driver branch (`tinygrad.runtime.autogen.nv_570`, `nv_580`, `nv_610`), so a layout is the
one of the branch the driver reports.

Field constants are (high bit, low bit) pairs, as the headers' DRF ranges: `NVC56F_SEM_EXECUTE_OPERATION = (2, 0)`;
QMD fields use the same form over the whole descriptor (`NVC6C0_QMDV03_00_CTA_RASTER_WIDTH = (415, 384)`)."""
from __future__ import annotations

import functools
import importlib
from types import ModuleType
from typing import Any

from hcq.errors import HCQError

# driver branch (major version) -> the generated module with that branch's layouts
BRANCHES: dict[int, str] = {570: "nv_570", 575: "nv_570", 580: "nv_580", 610: "nv_610"}
EMULATED_DRIVER_VERSION = "580.95.05"  # what the emulated driver reports (a 580 driver, as on the machines that may be lent)


class NVDriverError(HCQError):
    """The NVIDIA driver refused a request, or is one hcq does not know."""


def unavailable_reason() -> str | None:
    """Why the headers cannot be had here (they ship with tinygrad: `pip install hcq[nv]`), or None."""
    import importlib.util
    try:
        found = importlib.util.find_spec("tinygrad.runtime.autogen.nv_580") is not None
    except ImportError:  # (tinygrad itself is missing)
        found = False
    if not found: return "the NV backend reads NVIDIA's interface from tinygrad's generated headers, and tinygrad is not installed: pip install 'hcq[nv]'"
    return None


def branch_of(driver_version: str) -> int:
    """The branch (major version) of a driver version string such as "580.95.05"; unknown branches are refused."""
    try:
        major = int(driver_version.strip().split(".")[0])
    except ValueError:
        raise NVDriverError(f"the NVIDIA driver reports a version hcq cannot read: {driver_version!r}") from None
    if major not in BRANCHES:
        known = ", ".join(str(b) for b in sorted(BRANCHES))
        raise NVDriverError(f"NVIDIA driver {driver_version} is not supported: hcq knows the interface of driver branches {known}")
    return major


@functools.cache
def headers(driver_version: str = EMULATED_DRIVER_VERSION) -> ModuleType:
    """The generated headers of the branch of `driver_version`."""
    module = BRANCHES[branch_of(driver_version)]
    try:
        return importlib.import_module(f"tinygrad.runtime.autogen.{module}")
    except ImportError as e:
        raise NVDriverError(unavailable_reason() or str(e)) from e


_active: list[ModuleType] = []  # the headers of the driver this process talks to, once an NV device opened it
_semaphore_bits = [64]  # the widest semaphore address every open NV device's host class takes


def use(h: ModuleType, semaphore_bits: int) -> None:
    """Make `h` the headers queues encode with (the process's driver's); `semaphore_bits`: the width of semaphore
    addresses the device's host class takes (queues refuse wider ones rather than have them truncated)."""
    _active[:] = [h]
    _semaphore_bits[0] = min(_semaphore_bits[0], semaphore_bits)


def semaphore_bits() -> int:
    """The width of the semaphore addresses NV queues may use (see `use`)."""
    return _semaphore_bits[0]


def active() -> ModuleType:
    """The headers of the driver this process talks to (NV queues encode with them)."""
    if not _active: raise NVDriverError("no NV device is open in this process: open one (hcq.Device('NV')) before building NV queues")
    return _active[0]


def field(h: ModuleType, name: str) -> tuple[int, int]:
    """The (high bit, low bit) range of a field constant."""
    rng = getattr(h, name)
    if not (isinstance(rng, tuple) and len(rng) == 2): raise KeyError(f"{name} is not a bit range in the headers")
    return rng


def fields(h: ModuleType, reg: str, **values: Any) -> int:
    """A register or method word built from named fields: `fields(h, "NVC56F_SEM_EXECUTE", operation="release",
    payload_size="64bit")`; a value is a number or the name of one of the field's defined values. (Cached: queues
    build the same words at every launch.)"""
    return _fields(h, reg, tuple(sorted(values.items())))


@functools.lru_cache(maxsize=4096)
def _fields(h: ModuleType, reg: str, values: tuple[tuple[str, Any], ...]) -> int:
    word = 0
    for name, value in values:
        hi, lo = field(h, f"{reg}_{name.upper()}")
        v = getattr(h, f"{reg}_{name.upper()}_{value.upper()}") if isinstance(value, str) else int(value)
        if not 0 <= v < 1 << (hi - lo + 1): raise ValueError(f"{reg}.{name} = {v:#x} does not fit bits {hi}:{lo}")
        word |= v << lo
    return word


def get_field(h: ModuleType, reg: str, name: str, word: int) -> int:
    """A field's value in a register or method word."""
    hi, lo = field(h, f"{reg}_{name.upper()}")
    return (word >> lo) & ((1 << (hi - lo + 1)) - 1)
