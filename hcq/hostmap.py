"""Host memory mappings through libc (mmap, munmap, mprotect, madvise), for backends and servers that lay out memory
themselves: the C library's functions with their signatures declared, and the flags they take (Linux values)."""
from __future__ import annotations

import ctypes
import fcntl
import os

libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype, libc.mmap.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
libc.munmap.restype, libc.munmap.argtypes = ctypes.c_int, [ctypes.c_void_p, ctypes.c_size_t]
libc.mprotect.restype, libc.mprotect.argtypes = ctypes.c_int, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
libc.madvise.restype, libc.madvise.argtypes = ctypes.c_int, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
PROT_NONE, PROT_RW = 0, 0x1 | 0x2
MAP_SHARED, MAP_FIXED = 0x01, 0x10
MAP_PRIVATE_ANON, MAP_NORESERVE = 0x02 | 0x20, 0x4000
MAP_FAILED = ctypes.c_void_p(-1).value
PAGE = os.sysconf("SC_PAGE_SIZE")


def check_sealed_memfd(fd: int, size: int) -> None:
    """Memory another process gave (a memfd) may be mapped only when it cannot shrink under us (a store past its end
    would kill this process with SIGBUS): sealed against shrinking, and at least `size` bytes."""
    try:
        sealed = fcntl.fcntl(fd, fcntl.F_GET_SEALS) & fcntl.F_SEAL_SHRINK
    except OSError:
        sealed = 0
    if not sealed: raise PermissionError("the client's memory is not sealed against shrinking (memfd with F_SEAL_SHRINK)")
    if os.fstat(fd).st_size < size: raise ValueError(f"the client's memory holds {os.fstat(fd).st_size} bytes, not {size}")
