"""Memory descriptors: `BufferSpec` (what to allocate), `HCQBuffer` (a device allocation or a view of
one, with a possibly symbolic device address) and `MMIOInterface` (a typed window onto host-visible
memory). Nothing here assumes a device address is a host pointer: host access goes through `view`."""
from __future__ import annotations

import ctypes
import struct
from dataclasses import dataclass
from typing import Any, Iterable

from hcq import validation
from hcq.interfaces import DeviceLike
from hcq.symbolic import sint


@dataclass(frozen=True)
class BufferSpec:
    """Allocation options. `host`: host memory the device can reach; `cpu_access`: must be host-visible;
    `uncached`: no CPU caching where the backend can offer it; `nolru`: never reuse through the LRU cache."""
    host: bool = False
    cpu_access: bool = False
    uncached: bool = False
    nolru: bool = False


PLACEHOLDER = 0xBADC0DED  # written where a symbolic word goes until its first submit resolves it
# Value ranges of the integer struct formats (kernargs, patched words).
FMT_RANGE = {f: ((-(1 << (8 * struct.calcsize(f) - 1)), (1 << (8 * struct.calcsize(f) - 1)) - 1) if f.islower()
                 else (0, (1 << (8 * struct.calcsize(f))) - 1)) for f in "bBhHiIlLqQ"}
RUNTIME_SPEC = BufferSpec(cpu_access=True, nolru=True)  # runtime state: kernargs, queue words (host-written, never LRU-cached)


class NotHostVisibleError(RuntimeError):
    """cpu_view() on memory the host cannot read."""


class MMIOInterface:
    """A typed window onto host-visible memory: `[i]`, `[a:b]`, slice assignment, `len()`, `view()`."""
    __slots__ = ("addr", "nbytes", "fmt", "mv", "raw")

    def __init__(self, addr: int, nbytes: int, fmt: str = "B", _raw: memoryview | None = None, keepalive: Any = None):
        itemsize = struct.calcsize(fmt)
        if nbytes % itemsize: raise ValueError(f"{nbytes} bytes is not a whole number of {fmt!r} items ({itemsize} bytes)")
        self.addr, self.nbytes, self.fmt = addr, nbytes, fmt
        if _raw is None:
            if nbytes:
                window = (ctypes.c_char * nbytes).from_address(addr)
                # Every view of these bytes (sub-windows, numpy arrays) holds `window`, and through it `keepalive`
                # (e.g. the mapping), so the memory stays mapped while anything can still read it.
                window._hcq_keepalive = keepalive  # type: ignore[attr-defined]
                _raw = memoryview(window).cast("B")
            else:
                _raw = memoryview(bytearray())
        self.raw = _raw  # the same bytes as a flat 'B' view; sub-views slice it instead of going through ctypes
        self.mv = _cast(_raw, fmt) if fmt != "B" else _raw

    def __len__(self) -> int:
        return len(self.mv)

    def __getitem__(self, k: int | slice) -> Any:
        if isinstance(k, slice): return bytes(self.mv[k]) if self.fmt == "B" else self.mv[k].tolist()
        return self.mv[k]

    def __setitem__(self, k: int | slice, v: Any) -> None:
        if isinstance(k, slice) and not isinstance(v, (bytes, bytearray, memoryview)):
            v, count = list(v), len(range(*k.indices(len(self))))
            if len(v) != count: raise ValueError(f"slice of {count} items assigned {len(v)} values")
            try:
                v = _cast(memoryview(struct.pack(f"{count}{self.fmt}", *v)), self.fmt)
            except struct.error as e:
                raise ValueError(f"values do not fit format {self.fmt!r}: {e}") from None
        elif isinstance(k, slice):
            v = _cast(memoryview(v).cast("B"), self.fmt)
        self.mv[k] = v

    def view(self, offset: int = 0, size: int | None = None, fmt: str | None = None) -> MMIOInterface:
        """A sub-window of `size` bytes (default: to the end) at byte `offset`, optionally retyped."""
        size = self.nbytes - offset if size is None else size
        if offset < 0 or size < 0 or offset + size > self.nbytes:
            raise ValueError(f"view [{offset}, {offset + size}) is outside this {self.nbytes}-byte window")
        return MMIOInterface(self.addr + offset, size, fmt or self.fmt, self.raw[offset:offset + size])

    def __repr__(self) -> str:
        return f"<MMIOInterface 0x{self.addr:x} {self.nbytes} bytes fmt={self.fmt!r}>"


def _cast(mv: memoryview, fmt: str) -> memoryview:
    """`mv.cast(fmt)` for a format known only at run time (typeshed types cast() by literal formats)."""
    return mv.cast(fmt)  # type: ignore[call-overload]


class HCQBuffer:
    """A device allocation (or a view of one). `va_addr` may be symbolic (a placeholder patched at submit)."""

    def __init__(self, va_addr: sint, size: int, meta: Any = None, _base: HCQBuffer | None = None,
                 view: MMIOInterface | None = None, owner: DeviceLike | None = None):
        if not isinstance(size, int) or size < 0: raise ValueError(f"buffer size must be a non-negative int, got {size!r}")
        self.va_addr, self.size, self.meta, self._base, self.view, self.owner = va_addr, size, meta, _base, view, owner
        self._mappings: dict[DeviceLike, HCQBuffer] = {}
        self._freed = False
        self._slab: Any = None  # (slab, block index, heap key) when cut from a slab of small buffers
        self._root: HCQBuffer = _base.base if _base is not None else self  # the allocation (for cheap freed checks)
        self.on_release: Any = None  # a mapping's: called when the buffer it maps is released (a backend frees the mapping)

    @property
    def base(self) -> HCQBuffer:
        """The allocation this buffer is a view of (itself for an allocation)."""
        return self._root

    @property
    def freed(self) -> bool:
        """Whether the allocation was freed (a view reports its allocation's state)."""
        return self.base._freed

    @property
    def mappings(self) -> dict[DeviceLike, HCQBuffer]:
        """Devices this allocation is mapped into, with the buffer as each sees it."""
        return self.base._mappings

    @property
    def mapped_devs(self) -> list[DeviceLike]:
        """The devices this allocation is mapped into."""
        return list(self.base._mappings)

    def offset(self, offset: int = 0, size: int | None = None) -> HCQBuffer:
        """A view of `size` bytes (default: the rest) starting `offset` bytes in."""
        size = self.size - offset if size is None else size
        if offset < 0 or size < 0 or offset + size > self.size:
            raise ValueError(f"offset view [{offset}, {offset + size}) is outside the {self.size}-byte buffer")
        view = self.view.view(offset, size) if self.view is not None else None
        return HCQBuffer(self.va_addr + offset, size, meta=self.meta, _base=self._root, view=view, owner=self.owner)

    def cpu_view(self) -> MMIOInterface:
        """Host access to the buffer's bytes, as they are now: work submitted and not finished may still write them
        (synchronize first; validation mode warns). Raises NotHostVisibleError for device-only memory."""
        if self.freed: raise RuntimeError(f"{self!r} was freed")
        if self.view is None:
            raise NotHostVisibleError(f"{self!r} is not host-visible; allocate with BufferSpec(cpu_access=True) "
                                      "or copy it out with the allocator")
        if validation.enabled and isinstance(self.va_addr, int): validation.check_host_read(self.va_addr, self.size, repr(self))
        return self.view

    def __repr__(self) -> str:
        addr = f"0x{self.va_addr:x}" if isinstance(self.va_addr, int) else getattr(self.va_addr, "expr", self.va_addr)
        return f"<HCQBuffer {addr} size={self.size}{' on ' + self.owner.device if self.owner else ''}>"


def host_address(mv: memoryview | bytes | bytearray) -> tuple[int, int, Any]:
    """(address, nbytes, keepalive) of a contiguous host buffer, read-only ones included."""
    mv = memoryview(mv)
    if not mv.c_contiguous: raise ValueError("host buffer must be C-contiguous")
    mv = mv.cast("B") if mv.ndim != 1 or mv.format != "B" else mv
    if not mv.readonly:
        arr = (ctypes.c_char * mv.nbytes).from_buffer(mv) if mv.nbytes else None
        return (ctypes.addressof(arr) if arr is not None else 0), mv.nbytes, (arr, mv)
    return _readonly_address(mv), mv.nbytes, mv


class _PyBuffer(ctypes.Structure):
    _fields_ = [("buf", ctypes.c_void_p), ("obj", ctypes.py_object), ("len", ctypes.c_ssize_t), ("itemsize", ctypes.c_ssize_t),
                ("readonly", ctypes.c_int), ("ndim", ctypes.c_int), ("format", ctypes.c_char_p), ("shape", ctypes.c_void_p),
                ("strides", ctypes.c_void_p), ("suboffsets", ctypes.c_void_p), ("internal", ctypes.c_void_p)]


def _readonly_address(mv: memoryview) -> int:
    pb = _PyBuffer()
    ctypes.pythonapi.PyObject_GetBuffer(ctypes.py_object(mv), ctypes.byref(pb), 0)
    try:
        return pb.buf or 0
    finally:
        ctypes.pythonapi.PyBuffer_Release(ctypes.byref(pb))


def iter_chunks(total: int, chunk: int) -> Iterable[tuple[int, int]]:
    """(offset, size) pairs covering `total` bytes in pieces of at most `chunk`."""
    for off in range(0, total, chunk):
        yield off, min(chunk, total - off)
