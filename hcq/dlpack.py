"""DLPack, the tensor exchange convention of numpy, PyTorch, JAX and CuPy, in ctypes: the C structures, dtype names,
and the two halves of the protocol. `export` wraps memory in a capsule a consumer's `from_dlpack` takes (versioned
`DLManagedTensorVersioned` for consumers that ask with `max_version >= (1, 0)`, the legacy `DLManagedTensor`
otherwise); `consume` takes a producer's capsule apart and owns it until the `Imported` it returns is dropped.

Ownership follows the protocol: an exported capsule holds its managed tensor, and through it the Python object that
keeps the memory alive, until the consumer renames the capsule ("used_dltensor") and calls the deleter, or until the
capsule is destroyed unconsumed. This layer knows nothing of devices (hcq.memory builds on it)."""
from __future__ import annotations

import ctypes
import functools
import math
import operator
from dataclasses import dataclass
from typing import Any

from hcq.toolchain import build_shared_object

# DLDeviceType (dlpack.h)
KDL_CPU, KDL_CUDA, KDL_CUDA_HOST, KDL_OPENCL, KDL_VULKAN, KDL_METAL, KDL_ROCM = 1, 2, 3, 4, 7, 8, 10
DEVICE_NAMES = {1: "CPU", 2: "CUDA", 3: "CUDA host", 4: "OpenCL", 7: "Vulkan", 8: "Metal", 9: "VPI", 10: "ROCm", 11: "ROCm host",
                12: "ext_dev", 13: "CUDA managed", 14: "oneAPI", 15: "WebGPU", 16: "Hexagon", 17: "MAIA"}
HOST_DEVICE_TYPES = (KDL_CPU, KDL_CUDA_HOST, 11)  # memory the host reads at its data pointer (pinned host memory included)
VERSION = (1, 1)  # the DLPack ABI these structures follow
FLAG_READ_ONLY, FLAG_IS_COPIED = 1, 2

# DLDataTypeCode: kDLInt 0, kDLUInt 1, kDLFloat 2, kDLBfloat 4, kDLComplex 5, kDLBool 6
_DTYPES: dict[str, tuple[int, int]] = {
    "bool": (6, 8), "int8": (0, 8), "int16": (0, 16), "int32": (0, 32), "int64": (0, 64),
    "uint8": (1, 8), "uint16": (1, 16), "uint32": (1, 32), "uint64": (1, 64),
    "float16": (2, 16), "float32": (2, 32), "float64": (2, 64), "bfloat16": (4, 16), "complex64": (5, 64), "complex128": (5, 128)}
_ALIASES = {"half": "float16", "float": "float32", "double": "float64", "bool_": "bool", "cfloat": "complex64", "cdouble": "complex128",
            "int": "int64", "long": "int64", "short": "int16", "uint": "uint64"}
_NAMES = {v: k for k, v in _DTYPES.items()}


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", DLDevice), ("ndim", ctypes.c_int32), ("dtype", DLDataType),
                ("shape", ctypes.POINTER(ctypes.c_int64)), ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]


class DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [("version", DLPackVersion), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p), ("flags", ctypes.c_uint64),
                ("dl_tensor", DLTensor)]


def dtype_code(dtype: Any) -> tuple[int, int]:
    """(DLDataTypeCode, bits) of a dtype given by name ("float32"), or as numpy, PyTorch or JAX spell it."""
    name = _ALIASES.get(n := _dtype_str(dtype), n)
    if name not in _DTYPES: raise TypeError(f"DLPack has no dtype {dtype!r}; use one of {', '.join(_DTYPES)}")
    return _DTYPES[name]


def _dtype_str(dtype: Any) -> str:
    if isinstance(dtype, str): return dtype
    for attr in ("name", "__name__"):  # numpy dtypes and JAX's; numpy's scalar types (np.float32)
        if isinstance(v := getattr(dtype, attr, None), str): return v
    return str(dtype).removeprefix("torch.")  # torch.float32


def dtype_name(code: int, bits: int, lanes: int = 1) -> str:
    """The name of a DLPack dtype ("float32"); TypeError for ones hcq does not name (vector lanes, float8...)."""
    if lanes != 1 or (code, bits) not in _NAMES: raise TypeError(f"DLPack dtype (code {code}, {bits} bits, {lanes} lanes) is not supported")
    return _NAMES[(code, bits)]


def check_int64(what: str, values: tuple[int, ...]) -> None:
    """ValueError unless every value is an integer DLPack's int64 shapes and strides hold (ctypes would wrap a larger one)."""
    for v in values:
        try:
            n = operator.index(v)
        except TypeError:
            n = None
        if n is None or isinstance(v, bool) or not -(1 << 63) <= n < 1 << 63:
            raise ValueError(f"{what} {tuple(values)}: {v!r} is not an int64 (DLPack's shapes and strides are int64)")


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Row-major strides, in elements."""
    out, step = [], 1
    for n in reversed(shape):
        out.append(step)
        step *= max(n, 1)
    return tuple(reversed(out))


def extent(shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int) -> tuple[int, int]:
    """The byte range [lo, hi) relative to the first element that a strided tensor's elements cover."""
    if any(n == 0 for n in shape): return 0, 0
    lo = sum((n - 1) * s for n, s in zip(shape, strides) if s < 0) * itemsize
    hi = sum((n - 1) * s for n, s in zip(shape, strides) if s > 0) * itemsize + itemsize
    return lo, hi


def is_contiguous(shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """Row-major and compact (strides of dimensions of size 1 do not matter)."""
    return all(n == 1 or s == c for n, s, c in zip(shape, strides, contiguous_strides(shape)))


# ---- export
_py = ctypes.pythonapi
_py.PyCapsule_New.restype, _py.PyCapsule_New.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
_py.PyCapsule_IsValid.restype, _py.PyCapsule_IsValid.argtypes = ctypes.c_int, [ctypes.c_void_p, ctypes.c_char_p]
_py.PyCapsule_GetPointer.restype, _py.PyCapsule_GetPointer.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_char_p]
_py.PyCapsule_SetName.restype, _py.PyCapsule_SetName.argtypes = ctypes.c_int, [ctypes.py_object, ctypes.c_char_p]
_py.PyCapsule_GetName.restype, _py.PyCapsule_GetName.argtypes = ctypes.c_char_p, [ctypes.py_object]
_LEGACY, _VERSIONED = b"dltensor", b"dltensor_versioned"  # (module constants: a capsule keeps pointing at its name)
_USED_LEGACY, _USED_VERSIONED = b"used_dltensor", b"used_dltensor_versioned"

# managed tensor address -> what it holds (structures, shape, keepalive). One dict operation each way, atomic under the
# GIL: no lock, since dropping a keepalive may run a deleter that releases another of our tensors (hcq -> hcq -> numpy).
_exported: dict[int, tuple[Any, ...]] = {}


def _release(addr: int) -> None:
    _exported.pop(addr, None)  # (drops the keepalive: the producer's memory may go once nothing else holds it)


@ctypes.CFUNCTYPE(None, ctypes.c_void_p)
def _deleter(managed: int) -> None:
    """The managed tensors' deleter (through `_ASIDE`'s hcq_dlpack_deleter), called by the consumer."""
    _release(managed)


@ctypes.CFUNCTYPE(None, ctypes.c_void_p)
def _capsule_destructor(capsule: int) -> None:
    """A capsule destroyed before any consumer took it still owns its tensor (a consumed one was renamed)."""
    for name in (_LEGACY, _VERSIONED):
        if _py.PyCapsule_IsValid(capsule, name): _release(_py.PyCapsule_GetPointer(capsule, name))


# The deleter and the capsule destructor are called from C, and may be called with a Python exception set: a consumer that
# refuses a capsule (numpy, of a dtype it lacks) destroys it while raising, and an array that dies while an exception
# unwinds calls the deleter. Python code run then would lose that exception (and the callback would fail, leaving its
# hold forever), so C functions keep it aside, holding the GIL (a deleter may be called without it), around the Python
# callbacks. The C API is reached through pointers handed over at init (nothing is linked against libpython).
_ASIDE = r"""
typedef struct _object PyObject;
typedef void (*callback_t)(void *);
static int (*gil_ensure)(void);
static void (*gil_release)(int);
static void (*err_fetch)(PyObject **, PyObject **, PyObject **);
static void (*err_restore)(PyObject *, PyObject *, PyObject *);
static callback_t on_deleter, on_destructor;

void hcq_dlpack_init(int (*ensure)(void), void (*release)(int), void (*fetch)(PyObject **, PyObject **, PyObject **),
                     void (*restore)(PyObject *, PyObject *, PyObject *), callback_t deleter, callback_t destructor) {
  gil_ensure = ensure; gil_release = release; err_fetch = fetch; err_restore = restore;
  on_deleter = deleter; on_destructor = destructor;
}

static void call_aside(callback_t fn, void *arg) {
  int gil = gil_ensure();
  PyObject *type, *value, *tb;
  err_fetch(&type, &value, &tb);
  fn(arg);
  err_restore(type, value, tb);
  gil_release(gil);
}

void hcq_dlpack_deleter(void *managed) { call_aside(on_deleter, managed); }
void hcq_dlpack_capsule_destructor(void *capsule) { call_aside(on_destructor, capsule); }
"""


@functools.lru_cache(maxsize=None)
def _callbacks() -> tuple[int, int, ctypes.CDLL]:
    """(deleter, capsule destructor) addresses for exported tensors: `_ASIDE`'s, built on first use (and its library)."""
    lib = ctypes.CDLL(str(build_shared_object(_ASIDE, ("-O2", "-std=c11"), "hcq-dlpack")))
    lib.hcq_dlpack_init.restype, lib.hcq_dlpack_init.argtypes = None, [ctypes.c_void_p] * 6
    api = [ctypes.cast(getattr(_py, name), ctypes.c_void_p) for name in ("PyGILState_Ensure", "PyGILState_Release", "PyErr_Fetch", "PyErr_Restore")]
    lib.hcq_dlpack_init(*api, ctypes.cast(_deleter, ctypes.c_void_p), ctypes.cast(_capsule_destructor, ctypes.c_void_p))
    deleter, destructor = (ctypes.cast(f, ctypes.c_void_p).value or 0 for f in (lib.hcq_dlpack_deleter, lib.hcq_dlpack_capsule_destructor))
    return deleter, destructor, lib


def export(data: int, device: tuple[int, int], dtype: Any, shape: tuple[int, ...], strides: tuple[int, ...], keepalive: Any,
           *, versioned: bool, readonly: bool = False, copied: bool = False) -> Any:
    """A DLPack capsule for the tensor at `data` (its first element; strides in elements), holding `keepalive` until the
    consumer is done with it. A legacy capsule cannot say read-only: BufferError for `readonly` ones."""
    if readonly and not versioned:
        raise BufferError("a read-only tensor can only be exported to consumers of DLPack >= 1.0 (the legacy capsule has no read-only "
                          "flag); pass max_version=(1, 0) or export a copy")
    code, bits = dtype_code(dtype)
    check_int64("shape", shape)
    check_int64("strides", strides)
    deleter, destructor, _ = _callbacks()
    ndim = len(shape)
    shape_arr, strides_arr = (ctypes.c_int64 * max(ndim, 1))(*shape), (ctypes.c_int64 * max(ndim, 1))(*strides)
    managed: DLManagedTensor | DLManagedTensorVersioned = DLManagedTensorVersioned() if versioned else DLManagedTensor()
    t = managed.dl_tensor
    t.data, t.device, t.ndim, t.dtype = data or None, DLDevice(*device), ndim, DLDataType(code, bits, 1)
    t.shape, t.strides, t.byte_offset = shape_arr, strides_arr, 0
    managed.deleter = deleter
    if isinstance(managed, DLManagedTensorVersioned):
        managed.version = DLPackVersion(*VERSION)
        managed.flags = (FLAG_READ_ONLY if readonly else 0) | (FLAG_IS_COPIED if copied else 0)
    addr = ctypes.addressof(managed)
    _exported[addr] = (managed, shape_arr, strides_arr, keepalive)
    try:
        return _py.PyCapsule_New(addr, _VERSIONED if versioned else _LEGACY, destructor)
    except BaseException:
        _release(addr)
        raise


def exported_count() -> int:
    """Capsules exported whose consumers still hold them (for tests and leak checks)."""
    return len(_exported)


# ---- import
@dataclass
class Imported:
    """A consumed DLPack tensor: host-readable or device memory at `data` (its first element), shape and strides in
    elements. It owns the producer's managed tensor: dropping it (or `release()`) calls the producer's deleter."""
    data: int
    device: tuple[int, int]
    dtype: str
    itemsize: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    readonly: bool
    _managed: int
    _deleter: Any

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize

    @property
    def contiguous(self) -> bool:
        return is_contiguous(self.shape, self.strides)

    def release(self) -> None:
        """Hand the tensor back to its producer (at most once)."""
        deleter, self._deleter = self._deleter, None
        if deleter is not None: deleter(self._managed)

    def __del__(self) -> None:
        self.release()


_DELETER_T = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


def consume(capsule: Any) -> Imported:
    """Take ownership of a producer's capsule (renamed "used_...", as the protocol asks) and read its tensor."""
    try:
        name = _py.PyCapsule_GetName(capsule)
    except (ValueError, TypeError, ctypes.ArgumentError):
        name = None
    if name not in (_LEGACY, _VERSIONED):
        raise BufferError(f"not a DLPack capsule (name {name!r}), or one another consumer already took")
    ptr = _py.PyCapsule_GetPointer(ctypes.c_void_p(id(capsule)), name)
    if not ptr: raise BufferError("the DLPack capsule holds no tensor")
    flags = 0
    if name == _VERSIONED:
        mv = DLManagedTensorVersioned.from_address(ptr)
        if mv.version.major != 1: raise BufferError(f"DLPack {mv.version.major}.{mv.version.minor} is not supported (hcq reads 1.x)")
        t, deleter_addr, flags = mv.dl_tensor, mv.deleter, mv.flags
    else:
        m = DLManagedTensor.from_address(ptr)
        t, deleter_addr = m.dl_tensor, m.deleter
    ndim, dt = t.ndim, t.dtype
    name_ = dtype_name(dt.code, dt.bits, dt.lanes)
    itemsize = max(dt.bits // 8, 1)
    shape = tuple(t.shape[i] for i in range(ndim))
    strides = tuple(t.strides[i] for i in range(ndim)) if t.strides else contiguous_strides(shape)
    if t.byte_offset % itemsize: raise BufferError(f"the tensor's byte offset {t.byte_offset} is not a whole number of {name_} items")
    data = (t.data or 0) + t.byte_offset
    if _py.PyCapsule_SetName(capsule, _USED_VERSIONED if name == _VERSIONED else _USED_LEGACY) != 0: raise BufferError("cannot claim the capsule")
    deleter = _DELETER_T(deleter_addr) if deleter_addr else None
    return Imported(data, (t.device.device_type, t.device.device_id), name_, itemsize, shape, strides, bool(flags & FLAG_READ_ONLY), ptr,
                    deleter)


def device_name(device: tuple[int, int]) -> str:
    """A DLPack device as people say it ("CUDA:0")."""
    return f"{DEVICE_NAMES.get(device[0], f'device type {device[0]}')}:{device[1]}"
