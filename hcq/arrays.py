"""numpy interop, a convenience layer over the core (numpy is optional for hcq itself).

    view(buf, np.float32, (n,))   -> zero-copy ndarray over a host-visible buffer
    upload(dev, arr)              -> new HCQBuffer holding a copy of arr
    download(buf, np.float32, (n,)) -> new ndarray with the buffer's bytes (after earlier work finished)
    copyin(buf, arr) / copyout(arr, buf) -> copies between existing arrays and buffers
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

from hcq.device import HCQCompiled
from hcq.memory import BufferSpec, HCQBuffer

if TYPE_CHECKING:
    import numpy as np


def _np() -> Any:
    try:
        import numpy
    except ImportError:
        raise ImportError("hcq.arrays needs numpy: pip install numpy") from None
    return numpy


def _shape_bytes(dtype: Any, shape: tuple[int, ...] | int | None, buf: HCQBuffer) -> tuple[Any, tuple[int, ...]]:
    np = _np()
    dt = np.dtype(dtype)
    if shape is None:
        if buf.size % dt.itemsize: raise ValueError(f"{buf!r} of {buf.size} bytes is not a whole number of {dt} items")
        shape = (buf.size // dt.itemsize,)
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    nbytes = dt.itemsize * int(np.prod(shape, dtype=np.int64))
    if nbytes > buf.size: raise ValueError(f"an array of shape {shape} and dtype {dt} needs {nbytes} bytes; {buf!r} has {buf.size}")
    return dt, shape


def view(buf: HCQBuffer, dtype: Any, shape: tuple[int, ...] | int | None = None) -> np.ndarray:
    """A zero-copy ndarray over a host-visible buffer. Reads see device writes only after a synchronize."""
    dt, shape = _shape_bytes(dtype, shape, buf)
    return _np().frombuffer(buf.cpu_view().raw, dtype=dt, count=int(_np().prod(shape, dtype=_np().int64))).reshape(shape)


def upload(dev: HCQCompiled, arr: Any, options: BufferSpec | None = None) -> HCQBuffer:
    """A new buffer on `dev` holding a copy of `arr`."""
    a = _np().ascontiguousarray(arr)
    buf = dev.allocator.alloc(max(a.nbytes, 1), options)
    if a.nbytes: dev.allocator.copyin(buf, memoryview(a).cast("B"))
    return buf


def copyin(buf: HCQBuffer, arr: Any) -> None:
    """Copy `arr` into the start of `buf` (ordered after earlier work on its device)."""
    a = _np().ascontiguousarray(arr)
    _owner(buf).allocator.copyin(buf, memoryview(a).cast("B"))


def copyout(arr: Any, buf: HCQBuffer) -> None:
    """Fill the contiguous array `arr` from the start of `buf` once earlier work on its device finished."""
    np = _np()
    if not isinstance(arr, np.ndarray) or not arr.flags.c_contiguous or not arr.flags.writeable:
        raise ValueError("copyout needs a writeable C-contiguous ndarray")
    _owner(buf).allocator.copyout(memoryview(arr).cast("B"), buf)


def download(buf: HCQBuffer, dtype: Any, shape: tuple[int, ...] | int | None = None) -> np.ndarray:
    """A new ndarray with `buf`'s contents."""
    dt, shape = _shape_bytes(dtype, shape, buf)
    out = _np().empty(shape, dtype=dt)
    if out.nbytes: copyout(out, buf)
    return out


def _owner(buf: HCQBuffer) -> HCQCompiled:
    if buf.owner is None: raise ValueError(f"{buf!r} has no owning device; allocate it with dev.allocator.alloc")
    return cast(HCQCompiled, buf.owner)  # owners are devices; memory.py knows them only as DeviceLike
