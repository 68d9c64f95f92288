"""The NV device's kernel compiler: hcq's C kernel dialect (or PTX) -> an sm_90 cubin.

The dialect compiles as CUDA C with NVRTC (pip package nvidia-cuda-nvrtc, or a CUDA toolkit), through a prelude that
gives it what the CPU compiler's prelude gives C: fixed-width integer types, `HCQ_KERNEL`, the hcq_* built-ins (over
threadIdx / blockIdx / blockDim / gridDim) and the GCC atomics the dialect allows (__atomic_load_n, __atomic_store_n,
__atomic_fetch_add, __atomic_compare_exchange_n), so the same source builds for the CPU device and for NV. Functions
without an execution space are device functions (-default-device). `#pragma hcq` directives are blanked.

PTX (a text whose first line is a `//` comment or `.version` and that has a `.target` line) is assembled with
nvJitLink (pip package nvidia-nvjitlink) or, without it, `ptxas` on PATH.

Cubins are cached on disk (hcq.toolchain) by source, architecture, tool version and prelude; the source each cubin
came from is kept in memory (source_of), for the emulated GPU's CPU twins."""
from __future__ import annotations

import ctypes
import functools
import glob
import hashlib
import importlib.util
import os
import re
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Any

from hcq.errors import CompileError
from hcq.kernel_source import directives, find_kernels, without_directives
from hcq.toolchain import cached_build, run_compiler

PRELUDE = r"""#line 1 "hcq-nv-prelude"
typedef signed char int8_t; typedef unsigned char uint8_t; typedef short int16_t; typedef unsigned short uint16_t;
typedef int int32_t; typedef unsigned int uint32_t; typedef long long int64_t; typedef unsigned long long uint64_t;
typedef long intptr_t; typedef unsigned long uintptr_t; typedef long ssize_t; typedef bool _Bool;
#define restrict __restrict__
#define INFINITY __int_as_float(0x7f800000)
#define NAN __int_as_float(0x7fffffff)
#define __builtin_trap() __trap()
#define HCQ_KERNEL extern "C" __global__
__device__ __forceinline__ int64_t __hcq_pick(unsigned x, unsigned y, unsigned z, int d) { return d == 0 ? x : d == 1 ? y : z; }
#define hcq_local_id(d) __hcq_pick(threadIdx.x, threadIdx.y, threadIdx.z, (d))
#define hcq_group_id(d) __hcq_pick(blockIdx.x, blockIdx.y, blockIdx.z, (d))
#define hcq_local_size(d) __hcq_pick(blockDim.x, blockDim.y, blockDim.z, (d))
#define hcq_num_groups(d) __hcq_pick(gridDim.x, gridDim.y, gridDim.z, (d))
#define hcq_global_id(d) (hcq_group_id(d) * hcq_local_size(d) + hcq_local_id(d))
/* GCC's atomics, as the CPU dialect has them: volatile accesses ordered by fences (acquire: fence after the load;
   release: fence before the store), read-modify-writes with CUDA's atomics. */
#define __ATOMIC_RELAXED 0
#define __ATOMIC_CONSUME 1
#define __ATOMIC_ACQUIRE 2
#define __ATOMIC_RELEASE 3
#define __ATOMIC_ACQ_REL 4
#define __ATOMIC_SEQ_CST 5
template <class T> struct __hcq_bare { typedef T type; };
template <class T> struct __hcq_bare<const T> { typedef T type; };
template <class T> struct __hcq_bare<volatile T> { typedef T type; };
template <class T> struct __hcq_bare<const volatile T> { typedef T type; };
template <class T> __device__ __forceinline__ typename __hcq_bare<T>::type __atomic_load_n(T *p, int order) {
  typename __hcq_bare<T>::type v = *(const volatile typename __hcq_bare<T>::type *)p;
  if (order != __ATOMIC_RELAXED) __threadfence();
  return v;
}
template <class T, class U> __device__ __forceinline__ void __atomic_store_n(T *p, U v, int order) {
  if (order != __ATOMIC_RELAXED) __threadfence();
  *(volatile typename __hcq_bare<T>::type *)p = (typename __hcq_bare<T>::type)v;
  if (order == __ATOMIC_SEQ_CST) __threadfence();
}
__device__ __forceinline__ int __hcq_add(int *p, int v) { return atomicAdd(p, v); }
__device__ __forceinline__ unsigned __hcq_add(unsigned *p, unsigned v) { return atomicAdd(p, v); }
__device__ __forceinline__ unsigned long long __hcq_add(unsigned long long *p, unsigned long long v) { return atomicAdd(p, v); }
__device__ __forceinline__ long long __hcq_add(long long *p, long long v) { return (long long)atomicAdd((unsigned long long *)p, (unsigned long long)v); }
__device__ __forceinline__ long __hcq_add(long *p, long v) { return (long)atomicAdd((unsigned long long *)p, (unsigned long long)v); }
__device__ __forceinline__ unsigned long __hcq_add(unsigned long *p, unsigned long v) { return (unsigned long)atomicAdd((unsigned long long *)p, (unsigned long long)v); }
__device__ __forceinline__ float __hcq_add(float *p, float v) { return atomicAdd(p, v); }
__device__ __forceinline__ double __hcq_add(double *p, double v) { return atomicAdd(p, v); }
template <class T, class U> __device__ __forceinline__ typename __hcq_bare<T>::type __atomic_fetch_add(T *p, U v, int order) {
  typedef typename __hcq_bare<T>::type B;
  if (order != __ATOMIC_RELAXED) __threadfence();
  B old = __hcq_add((B *)p, (B)v);
  if (order != __ATOMIC_RELAXED) __threadfence();
  return old;
}
__device__ __forceinline__ unsigned __hcq_cas(unsigned *p, unsigned e, unsigned d) { return atomicCAS(p, e, d); }
__device__ __forceinline__ int __hcq_cas(int *p, int e, int d) { return atomicCAS(p, e, d); }
__device__ __forceinline__ unsigned long long __hcq_cas(unsigned long long *p, unsigned long long e, unsigned long long d) { return atomicCAS(p, e, d); }
__device__ __forceinline__ long long __hcq_cas(long long *p, long long e, long long d) { return (long long)atomicCAS((unsigned long long *)p, (unsigned long long)e, (unsigned long long)d); }
__device__ __forceinline__ long __hcq_cas(long *p, long e, long d) { return (long)atomicCAS((unsigned long long *)p, (unsigned long long)e, (unsigned long long)d); }
__device__ __forceinline__ unsigned long __hcq_cas(unsigned long *p, unsigned long e, unsigned long d) { return (unsigned long)atomicCAS((unsigned long long *)p, (unsigned long long)e, (unsigned long long)d); }
template <class T, class E, class U> __device__ __forceinline__ bool __atomic_compare_exchange_n(T *p, E *expected, U desired, bool weak, int success, int failure) {
  typedef typename __hcq_bare<T>::type B;
  (void)weak; (void)success; (void)failure;
  __threadfence();
  B want = (B)*expected, seen = __hcq_cas((B *)p, want, (B)desired);
  __threadfence();
  if (seen == want) return true;
  *expected = seen;
  return false;
}
"""
SOURCE_NAME = "kernel.cu"  # what compile errors name the user's source (its line numbers are the user's own)
OPTIONS = ("-default-device", "--std=c++17")  # (plus --gpu-architecture=<arch>)
_PTX_TARGET_RE = re.compile(r"^\s*\.target\s", re.M)
_ARCH_RE = re.compile(r"sm_(\d+)[af]?")
NVRTC_INSTALL = "pip install nvidia-cuda-nvrtc (or hcq[nv]), or set CUDA_HOME to a CUDA toolkit"
PTX_INSTALL = "pip install nvidia-nvjitlink, or put the CUDA toolkit's ptxas on PATH"

_sources: dict[bytes, str] = {}  # sha256 of a cubin this process returned -> the source it was built from
_sources_lock = threading.Lock()


def source_of(cubin: bytes) -> str | None:
    """The source a cubin NVCompiler returned in this process was built from (the user's text, before translation),
    or None for a cubin it did not return."""
    with _sources_lock: return _sources.get(hashlib.sha256(cubin).digest())


def _remember(cubin: bytes, source: str) -> bytes:
    with _sources_lock: _sources[hashlib.sha256(cubin).digest()] = source
    return cubin


def is_ptx(source: str) -> bool:
    """Whether `source` is PTX rather than the C dialect: it opens with a `//` comment or `.version`, and has a `.target` line."""
    return source.lstrip().startswith(("//", ".version")) and _PTX_TARGET_RE.search(source) is not None


def _library_candidates(wheel_globs: tuple[str, ...], names: tuple[str, ...]) -> list[str]:
    """Paths where a CUDA library may be: the pip wheels' folders under the `nvidia` namespace package (newest version
    first), $CUDA_HOME/lib64, /usr/local/cuda/lib64."""
    found: list[str] = []
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec is not None else []:
        for pattern in wheel_globs:
            found += sorted(glob.glob(os.path.join(root, pattern)), key=_version_key, reverse=True)
    for folder in filter(None, (os.path.join(os.environ["CUDA_HOME"], "lib64") if os.environ.get("CUDA_HOME") else None, "/usr/local/cuda/lib64")):
        found += [os.path.join(folder, n) for n in names if os.path.exists(os.path.join(folder, n))]
    return found


def _version_key(path: str) -> tuple[int, ...]:
    return tuple(int(n) for n in re.findall(r"\d+", os.path.basename(path).partition(".so")[2]))


class _Nvrtc:
    """libnvrtc through ctypes."""

    def __init__(self, path: str) -> None:
        self.path, lib = path, ctypes.CDLL(path)
        self.lib = lib
        P, S, I, C, CP = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_char_p, ctypes.POINTER(ctypes.c_char_p)
        for name, args in {"nvrtcVersion": [ctypes.POINTER(I), ctypes.POINTER(I)], "nvrtcCreateProgram": [ctypes.POINTER(P), C, C, I, CP, CP],
                           "nvrtcCompileProgram": [P, I, CP], "nvrtcDestroyProgram": [ctypes.POINTER(P)],
                           "nvrtcGetProgramLogSize": [P, ctypes.POINTER(S)], "nvrtcGetProgramLog": [P, C],
                           "nvrtcGetCUBINSize": [P, ctypes.POINTER(S)], "nvrtcGetCUBIN": [P, C],
                           "nvrtcGetNumSupportedArchs": [ctypes.POINTER(I)], "nvrtcGetSupportedArchs": [ctypes.POINTER(I)]}.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, I
        lib.nvrtcGetErrorString.argtypes, lib.nvrtcGetErrorString.restype = [I], C
        major, minor = I(), I()
        self._check(lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
        self.version = f"NVRTC {major.value}.{minor.value}"
        count = I()
        self._check(lib.nvrtcGetNumSupportedArchs(ctypes.byref(count)), "nvrtcGetNumSupportedArchs")
        archs = (I * count.value)()
        self._check(lib.nvrtcGetSupportedArchs(archs), "nvrtcGetSupportedArchs")
        self.archs = frozenset(archs)

    def _check(self, status: int, what: str) -> None:
        if status != 0: raise CompileError(f"{what} failed: {(self.lib.nvrtcGetErrorString(status) or b'?').decode()} ({self.path})")

    def compile(self, source: str, options: tuple[str, ...]) -> bytes:
        """Compile CUDA C `source` to a cubin; CompileError with NVRTC's log when it fails."""
        prog = ctypes.c_void_p()
        self._check(self.lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), SOURCE_NAME.encode(), 0, None, None), "nvrtcCreateProgram")
        try:
            opts = (ctypes.c_char_p * len(options))(*(o.encode() for o in options))
            status = self.lib.nvrtcCompileProgram(prog, len(options), opts)
            if status != 0:
                raise CompileError(f"{self.version} failed to compile the kernel ({' '.join(options)}):\n{self._log(prog)}")
            size = ctypes.c_size_t()
            self._check(self.lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "nvrtcGetCUBINSize")
            if size.value == 0: raise CompileError(f"{self.version} produced no cubin (options {' '.join(options)}; a virtual architecture?)")
            out = ctypes.create_string_buffer(size.value)
            self._check(self.lib.nvrtcGetCUBIN(prog, out), "nvrtcGetCUBIN")
            return out.raw
        finally:
            self.lib.nvrtcDestroyProgram(ctypes.byref(prog))

    def _log(self, prog: ctypes.c_void_p) -> str:
        return _library_log(self.lib.nvrtcGetProgramLogSize, self.lib.nvrtcGetProgramLog, prog, "NVRTC")


class _NvJitLink:
    """libnvJitLink through ctypes (PTX -> cubin)."""
    INPUT_PTX = 2

    def __init__(self, path: str) -> None:
        self.path, lib = path, ctypes.CDLL(path)
        self.lib = lib
        P, S, I, C = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_char_p
        for name, args in {"nvJitLinkVersion": [ctypes.POINTER(ctypes.c_uint), ctypes.POINTER(ctypes.c_uint)],
                           "nvJitLinkCreate": [ctypes.POINTER(P), ctypes.c_uint32, ctypes.POINTER(C)], "nvJitLinkDestroy": [ctypes.POINTER(P)],
                           "nvJitLinkAddData": [P, I, C, S, C], "nvJitLinkComplete": [P],
                           "nvJitLinkGetLinkedCubinSize": [P, ctypes.POINTER(S)], "nvJitLinkGetLinkedCubin": [P, C],
                           "nvJitLinkGetErrorLogSize": [P, ctypes.POINTER(S)], "nvJitLinkGetErrorLog": [P, C]}.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, I
        major, minor = ctypes.c_uint(), ctypes.c_uint()
        if lib.nvJitLinkVersion(ctypes.byref(major), ctypes.byref(minor)) != 0: raise CompileError(f"nvJitLinkVersion failed ({path})")
        self.version = f"nvJitLink {major.value}.{minor.value}"

    def assemble(self, ptx: str, arch: str) -> bytes:
        handle = ctypes.c_void_p()
        opts = (ctypes.c_char_p * 1)(f"-arch={arch}".encode())
        if (status := self.lib.nvJitLinkCreate(ctypes.byref(handle), 1, opts)) != 0:
            raise CompileError(f"{self.version} could not start (status {status}; is {arch} supported?)")
        try:
            data = ptx.encode()
            status = self.lib.nvJitLinkAddData(handle, self.INPUT_PTX, data, len(data), b"kernel.ptx")
            if status == 0: status = self.lib.nvJitLinkComplete(handle)
            if status != 0: raise CompileError(f"{self.version} failed to assemble the PTX for {arch} (status {status}):\n{self._log(handle)}")
            size = ctypes.c_size_t()
            self.lib.nvJitLinkGetLinkedCubinSize(handle, ctypes.byref(size))
            out = ctypes.create_string_buffer(size.value)
            if self.lib.nvJitLinkGetLinkedCubin(handle, out) != 0: raise CompileError(f"{self.version} gave no cubin")
            return out.raw
        finally:
            self.lib.nvJitLinkDestroy(ctypes.byref(handle))

    def _log(self, handle: ctypes.c_void_p) -> str:
        return _library_log(self.lib.nvJitLinkGetErrorLogSize, self.lib.nvJitLinkGetErrorLog, handle, "nvJitLink")


def _library_log(get_size: Any, get: Any, handle: ctypes.c_void_p, who: str) -> str:
    """A compile log read the way NVRTC and nvJitLink both hand it out: its size, then the text."""
    size = ctypes.c_size_t()
    if get_size(handle, ctypes.byref(size)) != 0 or size.value <= 1: return f"({who} gave no log)"
    buf = ctypes.create_string_buffer(size.value)
    get(handle, buf)
    return buf.value.decode(errors="replace").strip()


def _load_first(kind: type, candidates: list[str]) -> tuple[object | None, str]:
    """The first candidate library that loads as `kind`, or (None, why none did)."""
    problems = []
    for path in candidates:
        try:
            return kind(path), ""
        except (OSError, AttributeError, CompileError) as e:
            problems.append(f"{path}: {e}")
    return None, "; ".join(problems)


@functools.lru_cache(maxsize=None)
def nvrtc() -> _Nvrtc | str:
    """The NVRTC library (loaded once), or why it cannot be had."""
    candidates = _library_candidates(("cu*/lib/libnvrtc.so.*", "cuda_nvrtc/lib/libnvrtc.so.*"), ("libnvrtc.so", "libnvrtc.so.13", "libnvrtc.so.12"))
    lib, problems = _load_first(_Nvrtc, candidates)
    if isinstance(lib, _Nvrtc): return lib
    return f"NVRTC {'could not be loaded (' + problems + ')' if problems else 'was not found'}; {NVRTC_INSTALL}"


@functools.lru_cache(maxsize=None)
def nvjitlink() -> _NvJitLink | str:
    """The nvJitLink library (loaded once), or why it cannot be had."""
    candidates = _library_candidates(("cu*/lib/libnvJitLink.so.*", "nvjitlink/lib/libnvJitLink.so.*"),
                                     ("libnvJitLink.so", "libnvJitLink.so.13", "libnvJitLink.so.12"))
    lib, problems = _load_first(_NvJitLink, candidates)
    if isinstance(lib, _NvJitLink): return lib
    return f"nvJitLink {'could not be loaded (' + problems + ')' if problems else 'was not found'}"


class NVCompiler:
    """hcq's C kernel dialect (or PTX) -> an sm_90 cubin (cached on disk); see the module's docstring."""

    def __init__(self, arch: str = "sm_90") -> None:
        if _ARCH_RE.fullmatch(arch) is None: raise CompileError(f"NV architecture {arch!r} is not of the form sm_NN (e.g. sm_90)")
        self.arch = arch

    @staticmethod
    def unavailable_reason() -> str | None:
        """Why C kernels cannot be compiled here (NVRTC missing or unloadable), or None."""
        lib = nvrtc()
        return lib if isinstance(lib, str) else None

    source_of = staticmethod(source_of)

    def version(self) -> str:
        """The NVRTC version that compiles C kernels."""
        return self._nvrtc().version

    def _nvrtc(self) -> _Nvrtc:
        lib = nvrtc()
        if isinstance(lib, str): raise CompileError(lib)
        return lib

    def translate(self, source: str) -> str:
        """The CUDA C translation unit for dialect `source` (checked as the CPU compiler checks it)."""
        directives(source)  # (an unknown directive is an error on every backend)
        body = without_directives(source)
        find_kernels(body)
        return f'{PRELUDE}#line 1 "{SOURCE_NAME}"\n{body}'

    def compile(self, source: str) -> bytes:
        """The cubin for `source` (C dialect or PTX), from the cache when it holds one."""
        if is_ptx(source): return _remember(self._assemble(source), source)
        lib = self._nvrtc()
        arch_number = int(_ARCH_RE.fullmatch(self.arch).group(1))  # type: ignore[union-attr]  # (checked in __init__)
        if arch_number not in lib.archs:
            raise CompileError(f"{lib.version} cannot build for {self.arch} (it supports sm_{', sm_'.join(map(str, sorted(lib.archs)))})")
        unit, options = self.translate(source), (f"--gpu-architecture={self.arch}", *OPTIONS)
        cubin = cached_build("hcq-nv", (unit, self.arch, lib.version, " ".join(options), PRELUDE), ".cubin", lambda: lib.compile(unit, options))
        return _remember(cubin, source)

    def _assemble(self, ptx: str) -> bytes:
        """PTX -> cubin with nvJitLink, else ptxas on PATH."""
        jit = nvjitlink()
        if isinstance(jit, _NvJitLink):
            return cached_build("hcq-nv-ptx", (ptx, self.arch, jit.version), ".cubin", lambda: jit.assemble(ptx, self.arch))
        if (ptxas := shutil.which("ptxas")) is None:
            raise CompileError(f"cannot compile PTX: {jit}, and no ptxas is on PATH; {PTX_INSTALL}")
        rc, out = run_compiler([ptxas, "--version"], "the ptxas version")
        if rc != 0: raise CompileError(f"cannot compile PTX: {jit}, and {ptxas} --version failed:\n{out.strip()}\n{PTX_INSTALL}")
        return cached_build("hcq-nv-ptx", (ptx, self.arch, out.strip().splitlines()[-1] if out.strip() else ptxas), ".cubin",
                            lambda: self._ptxas(ptxas, ptx))

    def _ptxas(self, ptxas: str, ptx: str) -> bytes:
        with tempfile.TemporaryDirectory(prefix="hcq-ptx-") as tmp:
            src, out = Path(tmp) / "kernel.ptx", Path(tmp) / "kernel.cubin"
            src.write_text(ptx)
            rc, output = run_compiler([ptxas, f"-arch={self.arch}", "-o", str(out), str(src)], "kernel.ptx")
            if rc != 0 or not out.exists(): raise CompileError(f"ptxas failed to assemble the PTX for {self.arch}:\n{output.replace(str(src), 'kernel.ptx').strip()}")
            return out.read_bytes()
