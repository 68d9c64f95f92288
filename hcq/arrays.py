"""numpy interop, a convenience layer over the core (numpy is optional for hcq itself).

    view(buf, np.float32, (n,))   -> zero-copy ndarray over a host-visible buffer
    upload(dev, arr)              -> new HCQBuffer holding a copy of arr
    download(buf, np.float32, (n,)) -> new ndarray with the buffer's bytes (after earlier work finished)
    copyin(buf, arr) / copyout(arr, buf) -> copies between existing arrays and buffers
    from_dlpack(dev, tensor)      -> an HCQBuffer over a numpy/torch/JAX host array's memory (no copy on the CPU device)

The other way needs no helper: buffers and their typed views (`buf.array(dtype, shape)`) speak DLPack, so
`np.from_dlpack(buf.array("float32"))` and `torch.from_dlpack(...)` read host-visible device memory in place.
"""
from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING, Any, cast

from hcq import dlpack
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
    """A zero-copy ndarray over a host-visible buffer (not writeable where the memory is read-only, e.g. lent by a read-only
    DLPack producer). Reads see device writes only after a synchronize."""
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


def from_dlpack(dev: HCQCompiled, obj: Any, *, copy: bool | None = None) -> HCQBuffer:
    """An hcq buffer of `dev` holding the bytes of a DLPack producer's host array (numpy, torch, JAX...): the producer's
    own memory, used in place, where `dev` reaches host memory (the CPU device does) and `copy` is not True; the buffer
    then keeps the producer alive until it is freed or collected. Elsewhere (or with `copy=True`) a new buffer with a
    copy, in row-major order; `copy=False` refuses to copy. In place, the array must be C-contiguous; a read-only array
    gives a read-only buffer. Versioned DLPack (1.x) is asked for first, the legacy capsule taken from producers that
    only have that."""
    if not hasattr(obj, "__dlpack__"):
        raise TypeError(f"from_dlpack needs an object with __dlpack__ (numpy, torch, JAX...), got {type(obj).__name__}")
    where = tuple(obj.__dlpack_device__()) if hasattr(obj, "__dlpack_device__") else (dlpack.KDL_CPU, 0)
    if where[0] not in dlpack.HOST_DEVICE_TYPES:
        raise BufferError(f"from_dlpack: the array is on {dlpack.device_name(where)} (DLPack), which {dev.device} cannot read; "
                          "move it to the host first")
    try:
        capsule = obj.__dlpack__(stream=None, max_version=dlpack.VERSION)
    except TypeError:  # a producer of the legacy protocol only
        capsule = obj.__dlpack__()
    t = dlpack.consume(capsule)
    if copy is not True and t.contiguous and t.nbytes and (buf := dev.allocator.wrap_host(t.data, t.nbytes, t, readonly=t.readonly)):
        return buf
    if copy is False:
        why = "it is not C-contiguous" if not t.contiguous else "it is empty" if not t.nbytes else f"{dev.device} cannot use host memory in place"
        raise BufferError(f"from_dlpack: the array cannot be used without a copy ({why}) and copy=False")
    return _upload(dev, t)


def _upload(dev: HCQCompiled, t: dlpack.Imported) -> HCQBuffer:
    """A new buffer with the items of a host tensor in row-major order."""
    buf = dev.allocator.alloc(max(t.nbytes, 1))
    if not t.nbytes: return buf
    lo, hi = dlpack.extent(t.shape, t.strides, t.itemsize)
    span = (ctypes.c_char * (hi - lo)).from_address(t.data + lo)
    if t.contiguous:
        dev.allocator.copyin(buf, memoryview(span).cast("B"))
        return buf
    np = _np()  # (gathering strided items is numpy's job)
    if t.dtype == "bfloat16": raise TypeError("from_dlpack: copying a strided bfloat16 array needs numpy's bfloat16, which it lacks; pass a contiguous one")
    src = np.ndarray(t.shape, dtype=np.dtype(t.dtype), buffer=span, offset=-lo, strides=tuple(s * t.itemsize for s in t.strides))
    dev.allocator.copyin(buf, memoryview(np.ascontiguousarray(src)).cast("B"))
    return buf
