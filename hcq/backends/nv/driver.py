"""The NV backend's only way to the GPU: the kernel driver's device files, reached through a `DriverInterface`
(open, ioctl, mmap, doorbell), so that the emulated GPU (`HCQ_NV_EMULATE=1`, hcq.backends.nv.emulator) can stand
behind the same calls the real driver answers. `ResourceManager` is the client side of NVIDIA's resource manager
(RM_ALLOC / RM_CONTROL / RM_FREE, memory mappings) and of UVM, on top of an interface; its structures come from
hcq.backends.nv.abi."""
from __future__ import annotations

import ctypes
import errno
import mmap
import os
from types import ModuleType
from typing import Any, Protocol

from hcq.backends.nv.abi import NVDriverError

IOC_WRITE_READ = 3  # _IOWR: the kernel reads the structure and writes it back
DOORBELL_OFFSET = 0x90  # the usermode class's NV_USERMODE_NOTIFY_CHANNEL_PENDING register: takes a work-submit token


class DriverInterface(Protocol):
    """The calls the NV backend makes of the kernel driver (see the module docstring)."""

    def open(self, path: str, flags: int) -> int: ...

    def close(self, fd: int) -> None: ...

    def ioctl(self, fd: int, request: int, arg: Any) -> int: ...

    def mmap(self, addr: int | None, length: int, prot: int, flags: int, fd: int, offset: int) -> int: ...

    def munmap(self, addr: int, length: int) -> None: ...

    def doorbell(self, usermode_addr: int, token: int) -> None: ...

    def driver_version(self) -> str: ...


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype, _libc.mmap.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.restype, _libc.munmap.argtypes = ctypes.c_int, [ctypes.c_void_p, ctypes.c_size_t]
MAP_FAILED = ctypes.c_void_p(-1).value
MAP_FIXED = 0x10


def libc_mmap(addr: int | None, length: int, prot: int, flags: int, fd: int, offset: int) -> int:
    """mmap(2) returning the address (a fixed address needs libc: Python's mmap module cannot place a mapping)."""
    got = _libc.mmap(addr or None, length, prot, flags, fd, offset)
    if got in (None, MAP_FAILED):
        err = ctypes.get_errno()
        raise OSError(err, f"mmap of {length} bytes{f' at 0x{addr:x}' if addr else ''} failed: {os.strerror(err)}")
    return int(got)


def libc_munmap(addr: int, length: int) -> None:
    """munmap(2)."""
    if _libc.munmap(addr, length) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"munmap of 0x{addr:x} failed: {os.strerror(err)}")


class LinuxDriver:
    """The real kernel driver: /dev/nvidiactl, /dev/nvidiaN and /dev/nvidia-uvm."""

    def open(self, path: str, flags: int) -> int:
        return os.open(path, flags | os.O_CLOEXEC)

    def close(self, fd: int) -> None:
        os.close(fd)

    def ioctl(self, fd: int, request: int, arg: Any) -> int:
        import fcntl
        try:
            return fcntl.ioctl(fd, request, arg, True)  # (a ctypes object is a writable buffer: the kernel's reply lands in it)
        except OSError as e:
            return -(e.errno or errno.EIO)

    def mmap(self, addr: int | None, length: int, prot: int, flags: int, fd: int, offset: int) -> int:
        return libc_mmap(addr, length, prot, flags, fd, offset)

    def munmap(self, addr: int, length: int) -> None:
        libc_munmap(addr, length)

    def doorbell(self, usermode_addr: int, token: int) -> None:
        # (an uncached MMIO store: everything the host wrote before -- pushbuffer, GPFIFO entry, GP_PUT -- is visible
        # to the GPU first, as x86 orders stores, and the store to write-combined memory is flushed by the uncached one)
        ctypes.c_uint32.from_address(usermode_addr + DOORBELL_OFFSET).value = token

    def driver_version(self) -> str:
        for path in ("/sys/module/nvidia/version", "/proc/driver/nvidia/version"):
            try:
                with open(path) as f:
                    text = f.read()
            except OSError:
                continue
            for word in text.split():
                if word.count(".") >= 1 and word.split(".")[0].isdigit(): return word
        raise NVDriverError("cannot read the NVIDIA driver's version (/sys/module/nvidia/version): is the nvidia kernel module loaded?")


def ioc(nr: int, size: int, kind: int = ord("F"), direction: int = IOC_WRITE_READ) -> int:
    """An ioctl request number (_IOC): direction, structure size, type and number."""
    if not 0 <= size < 1 << 14: raise ValueError(f"an ioctl structure of {size} bytes does not fit the request's size field")
    return (direction << 30) | (size << 16) | (kind << 8) | nr


def status_text(h: ModuleType, status: int) -> str:
    """An NV_STATUS as its name ("NV_ERR_INVALID_CLASS (0x22)")."""
    return f"{h.nv_status_codes.get(status, 'unknown status')} (0x{status:x})"


class ResourceManager:
    """A client of NVIDIA's resource manager and of UVM over `driver`, with the structures of headers `h`: objects
    (alloc/control/free) under one root client, CPU mappings of memory objects, and UVM calls."""

    def __init__(self, driver: DriverInterface, h: ModuleType):
        self.driver, self.h = driver, h
        self.ctl = driver.open("/dev/nvidiactl", os.O_RDWR)
        self.uvm_fd = -1
        self.root = 0
        try:
            self.root = self.alloc(0, h.NV01_ROOT_CLIENT, None, root=0)
        except BaseException:
            driver.close(self.ctl)
            raise

    def _ioctl(self, fd: int, nr: int, arg: Any, what: str) -> None:
        rc = self.driver.ioctl(fd, ioc(nr, ctypes.sizeof(arg)), arg)
        if rc < 0: raise NVDriverError(f"{what}: the driver refused the request ({os.strerror(-rc)})")

    def _check(self, status: int, what: str) -> None:
        if status == self.h.NV_ERR_NO_MEMORY: raise MemoryError(f"{what}: {status_text(self.h, status)}")
        if status != 0: raise NVDriverError(f"{what}: {status_text(self.h, status)}")

    def alloc(self, parent: int, cls: int, params: Any = None, root: int | None = None, handle: int = 0) -> int:
        """A new object of class `cls` under `parent` (its allocation parameters `params`); returns its handle."""
        h = self.h
        made = h.NVOS21_PARAMETERS(hRoot=self.root if root is None else root, hObjectParent=parent, hObjectNew=handle, hClass=cls,
                                   pAllocParms=ctypes.addressof(params) if params is not None else 0,
                                   paramsSize=ctypes.sizeof(params) if params is not None else 0)
        self._ioctl(self.ctl, h.NV_ESC_RM_ALLOC, made, f"allocating an object of class 0x{cls:x}")
        self._check(made.status, f"allocating an object of class 0x{cls:x}")
        return int(made.hObjectNew)

    def control(self, obj: int, cmd: int, params: Any = None) -> Any:
        """Run control `cmd` on object `obj`; returns `params` as the driver filled them."""
        h = self.h
        made = h.NVOS54_PARAMETERS(hClient=self.root, hObject=obj, cmd=cmd, params=ctypes.addressof(params) if params is not None else 0,
                                   paramsSize=ctypes.sizeof(params) if params is not None else 0)
        self._ioctl(self.ctl, h.NV_ESC_RM_CONTROL, made, f"control 0x{cmd:x}")
        self._check(made.status, f"control 0x{cmd:x} on object 0x{obj:x}")
        return params

    def free(self, obj: int, parent: int) -> None:
        """Free object `obj` (and everything under it)."""
        h = self.h
        made = h.NVOS00_PARAMETERS(hRoot=self.root, hObjectParent=parent, hObjectOld=obj)
        self._ioctl(self.ctl, h.NV_ESC_RM_FREE, made, f"freeing object 0x{obj:x}")
        self._check(made.status, f"freeing object 0x{obj:x}")

    def open_uvm(self) -> None:
        """Open /dev/nvidia-uvm and initialize this process's UVM state."""
        h = self.h
        self.uvm_fd = self.driver.open("/dev/nvidia-uvm", os.O_RDWR)
        self.uvm(h.UVM_INITIALIZE, h.UVM_INITIALIZE_PARAMS())
        second = self.driver.open("/dev/nvidia-uvm", os.O_RDWR)
        try:  # (the driver answers this for every process; CUDA makes the same call and ignores a refusal)
            self.uvm(h.UVM_MM_INITIALIZE, h.UVM_MM_INITIALIZE_PARAMS(uvmFd=self.uvm_fd), fd=second)
        except NVDriverError:
            pass
        self.uvm_mm_fd = second

    def uvm(self, cmd: int, params: Any, fd: int | None = None) -> Any:
        """A UVM ioctl (`cmd` is its full request number); returns `params` as the driver filled them."""
        rc = self.driver.ioctl(self.uvm_fd if fd is None else fd, cmd, params)
        if rc < 0: raise NVDriverError(f"UVM call 0x{cmd:x}: the driver refused the request ({os.strerror(-rc)})")
        self._check(params.rmStatus, f"UVM call 0x{cmd:x}")
        return params

    def gpu_fd(self, minor: int) -> int:
        """A new fd of /dev/nvidia<minor>, registered with the control fd."""
        h = self.h
        fd = self.driver.open(f"/dev/nvidia{minor}", os.O_RDWR)
        try:
            self._ioctl(fd, h.NV_ESC_REGISTER_FD, h.nv_ioctl_register_fd_t(ctl_fd=self.ctl), f"registering /dev/nvidia{minor}")
        except BaseException:
            self.driver.close(fd)
            raise
        return fd

    def map_to_cpu(self, device: int, memory: int, size: int, target: int | None, minor: int, flags: int = 0, system: bool = False) -> tuple[int, int]:
        """Map memory object `memory` into this process (at `target` when given); returns (address, the fd it holds)."""
        h = self.h
        fd = self.driver.open("/dev/nvidiactl", os.O_RDWR) if system else self.gpu_fd(minor)
        try:
            made = h.nv_ioctl_nvos33_parameters_with_fd(fd=fd, params=h.NVOS33_PARAMETERS(hClient=self.root, hDevice=device, hMemory=memory,
                                                                                          length=size, flags=flags))
            self._ioctl(self.ctl, h.NV_ESC_RM_MAP_MEMORY, made, "mapping memory to the CPU")
            self._check(made.params.status, "mapping memory to the CPU")
            addr = self.driver.mmap(target, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED | (MAP_FIXED if target is not None else 0), fd, 0)
        except BaseException:
            self.driver.close(fd)
            raise
        return addr, fd

    def close(self) -> None:
        """Free the root client (and with it every object) and close the fds."""
        for fd in (self.uvm_fd, getattr(self, "uvm_mm_fd", -1)):
            if fd >= 0: self.driver.close(fd)
        self.uvm_fd = -1
        if self.root:
            try:
                self.free(self.root, 0)
            except NVDriverError:
                pass
            self.root = 0
        self.driver.close(self.ctl)
