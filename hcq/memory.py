"""Memory descriptors: `BufferSpec` (what to allocate), `HCQBuffer` (a device allocation or a view of
one, with a possibly symbolic device address) and `MMIOInterface` (a typed window onto host-visible
memory). Nothing here assumes a device address is a host pointer: host access goes through `view`."""
from __future__ import annotations

import ctypes
import math
import struct
import threading
from dataclasses import dataclass
from typing import Any, Iterable

from hcq import dlpack, validation
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
REAL_FORMATS = "fde"  # struct formats of floating parameters, which take any real number (the others take integers)
RUNTIME_SPEC = BufferSpec(cpu_access=True, nolru=True)  # runtime state: kernargs, queue words (host-written, never LRU-cached)


class NotHostVisibleError(RuntimeError):
    """cpu_view() on memory the host cannot read."""


class MMIOInterface:
    """A typed window onto host-visible memory: `[i]`, `[a:b]`, slice assignment, `len()`, `view()`. A window of memory
    lent `readonly` has read-only memoryviews (`raw`, `mv`; numpy arrays over them are not writeable) and refuses
    assignment, as do its sub-windows."""
    __slots__ = ("addr", "nbytes", "fmt", "mv", "raw")

    def __init__(self, addr: int, nbytes: int, fmt: str = "B", _raw: memoryview | None = None, keepalive: Any = None,
                 readonly: bool = False):
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
            if readonly: _raw = _raw.toreadonly()
        self.raw = _raw  # the same bytes as a flat 'B' view; sub-views slice it instead of going through ctypes
        self.mv = _cast(_raw, fmt) if fmt != "B" else _raw

    def __len__(self) -> int:
        return len(self.mv)

    def __getitem__(self, k: int | slice) -> Any:
        if isinstance(k, slice): return bytes(self.mv[k]) if self.fmt == "B" else self.mv[k].tolist()
        return self.mv[k]

    @property
    def readonly(self) -> bool:
        """Whether the window is of read-only memory (assignment refused)."""
        return self.raw.readonly

    def __setitem__(self, k: int | slice, v: Any) -> None:
        if self.readonly: raise ValueError(f"{self!r} is a window of read-only memory: it cannot be written")
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
    """A device allocation (or a view of one). `va_addr` may be symbolic (a placeholder patched at submit). It speaks
    DLPack as a flat array of bytes (`array` gives a typed view)."""
    _readonly = False  # (on the allocation) memory lent read-only, e.g. by a read-only DLPack producer
    _dlpack_holds = 0  # (on the allocation) DLPack consumers holding it: freeing it then waits for them (see _ExportHold)
    # (a mapping's) where what is written into the mapping lands on the mapped buffer's own device when that buffer is
    # memory no host can write (device-local memory of a served device): memory of that device, same size, from which
    # its own copy queue moves the bytes into place (HCQAllocator.transfer does). None: the writes reach the buffer.
    lands_in: HCQBuffer | None = None

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

    @property
    def readonly(self) -> bool:
        """Whether the memory was lent read-only (kernels may only read it through const pointers; copies refuse to write it)."""
        return self._root._readonly

    def check_writable(self, what: str, hint: str = "", error: type[Exception] = ValueError) -> None:
        """The one refusal of a write into read-only memory (see `readonly`): raises `error` ("{what}: {buffer} is read-only
        memory{hint}"). Every path that writes a buffer asks it; the native fast paths decline such buffers (they read
        `_readonly` on the allocation) and leave them to the checked paths that ask it."""
        if self._root._readonly: raise error(f"{what}: {self!r} is read-only memory{hint}")

    def array(self, dtype: Any, shape: tuple[int, ...] | int | None = None, strides: tuple[int, ...] | None = None, offset: int = 0,
              readonly: bool | None = None) -> ArrayView:
        """A typed view for DLPack consumers (`torch.from_dlpack(buf.array("float32", (n, m)))`): `dtype` by name or as numpy or
        torch spell it, `shape` (default: as many items as fit), `strides` in items (default row-major), `offset` in bytes."""
        return ArrayView(self, dtype, shape, strides, offset, readonly)

    def __dlpack__(self, stream: int | None = None, max_version: tuple[int, int] | None = None, dl_device: tuple[int, int] | None = None,
                   copy: bool | None = None) -> Any:
        """The buffer as a flat uint8 DLPack tensor; see `ArrayView.__dlpack__`."""
        return ArrayView(self, "uint8").__dlpack__(stream, max_version, dl_device, copy)

    def __dlpack_device__(self) -> tuple[int, int]:
        """(DLPack device type, device id); see `ArrayView.__dlpack_device__`."""
        return ArrayView(self, "uint8").__dlpack_device__()

    def __repr__(self) -> str:
        addr = f"0x{self.va_addr:x}" if isinstance(self.va_addr, int) else getattr(self.va_addr, "expr", self.va_addr)
        return f"<HCQBuffer {addr} size={self.size}{' on ' + self.owner.device if self.owner else ''}>"


class _ExportHold:
    """Held by an exported DLPack capsule (and dropped when its consumer is done): the allocation counts it, and a free
    of it waits until no consumer holds it (its memory is neither reused nor unmapped while one may read it)."""
    _lock = threading.Lock()  # (the consumer's deleter may run on any thread)

    def __init__(self, buf: HCQBuffer):
        self.root, self.view = buf.base, buf.view  # (the host window keeps the mapping, whatever happens to the allocation)
        with self._lock: self.root._dlpack_holds += 1

    def __del__(self) -> None:
        with self._lock: self.root._dlpack_holds -= 1


class ArrayView:
    """A typed, strided view of an HCQBuffer that DLPack consumers (`np.from_dlpack`, `torch.from_dlpack`,
    `jax.dlpack.from_dlpack`) take without a copy where its memory is host-visible."""

    def __init__(self, buf: HCQBuffer, dtype: Any, shape: tuple[int, ...] | int | None = None, strides: tuple[int, ...] | None = None,
                 offset: int = 0, readonly: bool | None = None):
        code, bits = dlpack.dtype_code(dtype)
        self.buf, self.dtype, self.itemsize = buf, dlpack.dtype_name(code, bits), max(bits // 8, 1)
        if not isinstance(offset, int) or offset < 0 or offset % self.itemsize:
            raise ValueError(f"offset {offset!r} must be a non-negative multiple of the {self.dtype} item size ({self.itemsize} bytes)")
        if shape is None: shape = ((buf.size - offset) // self.itemsize,)
        self.shape = (shape,) if isinstance(shape, int) else tuple(shape)
        self.strides = dlpack.contiguous_strides(self.shape) if strides is None else tuple(strides)
        if any(not isinstance(n, int) or n < 0 for n in self.shape) or len(self.strides) != len(self.shape):
            raise ValueError(f"shape {self.shape} and strides {self.strides} must be non-negative ints of one length")
        dlpack.check_int64("shape", self.shape)
        dlpack.check_int64("strides", self.strides)
        lo, hi = dlpack.extent(self.shape, self.strides, self.itemsize)
        if offset + lo < 0 or offset + hi > buf.size:
            raise ValueError(f"a {self.dtype} view of shape {self.shape}, strides {self.strides} at byte {offset} reaches bytes "
                             f"[{offset + lo}, {offset + hi}) of {buf!r} ({buf.size} bytes)")
        self.offset, self.readonly = offset, buf.readonly if readonly is None else (readonly or buf.readonly)

    def __repr__(self) -> str:
        return f"<ArrayView {self.dtype}{list(self.shape)} at byte {self.offset} of {self.buf!r}>"

    def _in_place(self) -> tuple[int, int] | None:
        """Where a consumer can read the memory in place: the host, or the owner's own DLPack device type; else None."""
        if self.buf.view is not None: return (dlpack.KDL_CPU, 0)
        return getattr(self.buf.owner, "dlpack_device", None)

    def __dlpack_device__(self) -> tuple[int, int]:
        """(kDLCPU, 0) for host-visible memory; a device whose memory the host cannot see answers with its own DLPack device
        type where it has one, else BufferError (export a host copy with `__dlpack__(copy=True)`)."""
        if (where := self._in_place()) is None: raise BufferError(self._not_reachable())
        return where

    def _not_reachable(self) -> str:
        return (f"{self.buf!r} is not host-visible and its device has no DLPack device type: export a host copy "
                "(`__dlpack__(copy=True)`, e.g. np.from_dlpack(x, copy=True)) or copy it out with hcq.arrays.download")

    def __dlpack__(self, stream: int | None = None, max_version: tuple[int, int] | None = None, dl_device: tuple[int, int] | None = None,
                   copy: bool | None = None) -> Any:
        """A DLPack capsule (versioned when `max_version >= (1, 0)`, else legacy) that holds the buffer until its consumer
        is done; freeing the buffer meanwhile waits for that. Ordering: with `stream=None` every device that owns or maps
        the buffer is synchronized first, so work submitted before the export has finished when the consumer reads;
        `stream=-1` skips that (the consumer orders it). `copy=True` (or a `dl_device` other than where the memory is)
        exports a host copy made after that work; `copy=False` refuses to copy."""
        buf = self.buf
        if buf.freed: raise BufferError(f"{buf!r} was freed")
        if stream is not None and stream != -1:
            raise BufferError(f"stream={stream!r}: hcq memory is exported to the host, which has no streams; pass None (hcq waits for "
                              "the work submitted before the export) or -1 (the consumer orders it)")
        versioned = max_version is not None and int(max_version[0]) >= 1
        where, want = self._in_place(), None if dl_device is None else (int(dl_device[0]), int(dl_device[1]))
        if stream is None: self._synchronize()
        if copy is not True and where is not None and want in (None, where):
            data = buf.view.addr + self.offset if where == (dlpack.KDL_CPU, 0) else buf.va_addr + self.offset  # type: ignore[union-attr]
            return dlpack.export(int(data), where, self.dtype, self.shape, self.strides, _ExportHold(buf), versioned=versioned,
                                 readonly=self.readonly)
        if copy is False:
            raise BufferError(f"{self!r} cannot be exported in place{'' if want is None else ' to ' + dlpack.device_name(want)} and copy=False")
        if want not in (None, (dlpack.KDL_CPU, 0)): raise BufferError(f"hcq exports copies to the host (CPU:0), not {dlpack.device_name(want)}")
        if where is None and copy is None: raise BufferError(self._not_reachable())
        return self._export_copy(versioned)

    def _synchronize(self) -> None:
        for dev in dict.fromkeys([self.buf.owner, *self.buf.mapped_devs]):
            if dev is not None: dev.synchronize()

    def _export_copy(self, versioned: bool) -> Any:
        lo, hi = dlpack.extent(self.shape, self.strides, self.itemsize)
        host = bytearray(max(hi - lo, 1))
        if hi > lo:
            owner = self.buf.owner
            if owner is None: raise BufferError(f"{self.buf!r} has no owning device to copy it out")
            owner.allocator.copyout(memoryview(host)[:hi - lo], self.buf.offset(self.offset + lo, hi - lo))
        window = (ctypes.c_char * len(host)).from_buffer(host)  # (holds `host`)
        return dlpack.export(ctypes.addressof(window) - lo, (dlpack.KDL_CPU, 0), self.dtype, self.shape, self.strides, window,
                             versioned=versioned, copied=True)

    @property
    def nbytes(self) -> int:
        """Bytes of the items (not of the span they cover)."""
        return math.prod(self.shape) * self.itemsize


def flat_bytes(obj: Any) -> memoryview:
    """A contiguous host buffer (anything with the buffer protocol) as a flat memoryview of bytes."""
    mv = memoryview(obj)
    if not mv.c_contiguous: raise ValueError("host buffer must be C-contiguous")
    return mv.cast("B") if mv.ndim != 1 or mv.format != "B" else mv


def host_address(mv: memoryview | bytes | bytearray) -> tuple[int, int, Any]:
    """(address, nbytes, keepalive) of a contiguous host buffer, read-only ones included."""
    mv = flat_bytes(mv)
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
