"""The emulated NVIDIA kernel driver: the other side of the calls the NV backend makes (`DriverInterface` in
hcq.backends.nv.driver), modelled on what NVIDIA's open kernel modules (580 branch) do with them.

- Device files: /dev/nvidiactl, /dev/nvidia-uvm and /dev/nvidiaN (one per emulated GPU). Their fds are real file
  descriptors (duplicates of /dev/null), so they never collide with the process's own.
- nvidia ioctls are decoded as nvidia.ko does: the `_IOC` size is checked against the escape's structure and an
  unknown number refused (nv_validate_ioctl_data: both -EINVAL); the emulator also wants type 'F' and _IOWR, which
  the driver does not check, and an argument shorter than the request says is -EFAULT. The resource-manager escapes
  (RM_ALLOC/CONTROL/FREE, memory mappings) report their outcome in the structure's status, as escape.c does; an
  escape on the wrong device file is -EINVAL. UVM ioctls use UVM's raw command numbers and report in rmStatus; an
  unknown command is -EINVAL (uvm.c).
- Resource manager: clients, driver-made or caller-chosen handles, a parent/child tree (RM_FREE frees a subtree), the
  Hopper classes, and the controls the backend uses. Anything else is NV_ERR_INVALID_CLASS / NV_ERR_NOT_SUPPORTED.
- Memory: device and system memory are memfds (zeroed), mapped privately by the driver (what the GPU accesses) and,
  after NV_ESC_RM_MAP_MEMORY, into the process by `mmap` on the fd the request named. Host memory
  (NV01_MEMORY_SYSTEM_OS_DESCRIPTOR) wraps the process's own pages. UVM external ranges and mappings put memory into
  the emulated GPU's address space (one per GPU). A memory object stays alive while a UVM mapping, a CPU mapping or a
  channel uses it (the driver's references), and `stats()` counts what is alive, so tests can check nothing leaks.
- Channels: a GPFIFO channel joins the emulated GPU (`add_channel`) when its channel group is scheduled; the work
  submit token is the channel id; `doorbell` kicks it. A GPU fault writes the channel's error notifier and is reported
  by the debugger's controls.

Every pointer and size a caller passes is checked before it is used: structures are copied in and out through
process_vm_readv/writev, so a bad address is an error status, never a crash of the process."""
from __future__ import annotations

import collections
import ctypes
import errno
import hashlib
import mmap
import os
import re
import threading
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Callable, Iterator

from hcq.backends.nv import abi

# ---- numbers the generated headers do not carry (cited where they come from)
# nverror.h: the codes an error notifier's info32 gets
ROBUST_CHANNEL_GR_EXCEPTION = 13
ROBUST_CHANNEL_FIFO_ERROR_MMU_ERR_FLT = 31
RC_NOTIFIER_STATUS = 0xFFFF  # kernel_rc_notification.c: the status krcErrorSetNotifier writes
NOTIFICATION_BYTES = 16  # nvos.h NvNotification: timeStamp (8), info32 (4), info16 (2), status (2)
# nv_uvm_user_types.h: UvmGpuMappingType (Default, ReadWriteAtomic, ReadWrite, ReadOnly) and UvmGpuCachingType
UVM_MAPPING_TYPES, UVM_MAPPING_READ_ONLY, UVM_CACHING_TYPES = 4, 3, 3
UVM_MAX_GPUS = 256  # uvm.h, 580: NV_MAX_DEVICES * UVM_PARENT_ID_MAX_SUB_PROCESSORS
RS_CLIENT_HANDLE_BASE, RS_UNIQUE_HANDLE_BASE = 0xC1D00000, 0xCAF00000  # resserv: handles the driver makes
PARAM_COPY_MAX = 1 << 20  # param_copy.h RMAPI_PARAM_COPY_MAX_PARAMS_SIZE: the largest embedded buffer copied

# ---- the emulated board: an H100 SXM5 80GB
PCI_VENDOR, PCI_DEVICE = 0x10DE, 0x2330
GR_INFO = {"SM_VERSION": 0x900, "LITTER_NUM_GPCS": 8, "LITTER_NUM_TPC_PER_GPC": 9, "LITTER_NUM_SM_PER_TPC": 2, "MAX_WARPS_PER_SM": 64,
           "MAX_THREADS_PER_WARP": 32, "MAX_SP_PER_SM": 128, "MAX_SUBCONTEXT_COUNT": 64, "TIMESLICE_ENABLED": 1,
           "LITTER_NUM_TPCS_PER_PES": 3, "TENSOR_CORE_COUNT": 528}
ENABLED_SMS = 132
USERMODE_BYTES = 0x10000  # the usermode class's register window (the doorbell is at 0x90)
DOORBELL_OFFSET = 0x90
GPU_VA_LIMIT = 1 << 49  # the VA the emulated GPU gives user mappings (FERMI_VASPACE_A clients use 49 bits)
USERD_VA_BASE, USERD_SLOT = 1 << 49, 0x2000  # where the driver maps each channel's USERD for the GPU (above user VA)
MAX_CHANNELS, MAX_SUBCONTEXTS = 2048, 64
PAGE = mmap.PAGESIZE
MAP_FIXED = getattr(mmap, "MAP_FIXED", 0x10)
DEFAULT_DEVICE_MEMORY = 80 << 30

_GPU_FAULT = re.compile(r"GPU (read|write) fault at (0x[0-9a-fA-F]+): (.*)")  # memory.GpuFault's message


class _Status(Exception):
    """A resource-manager / UVM refusal: `code` is the NV_STATUS that goes into the structure."""

    def __init__(self, code: int, why: str) -> None:
        super().__init__(why)
        self.code = code


class _Errno(Exception):
    """An ioctl refused before the resource manager sees it: the call returns -`code`."""

    def __init__(self, code: int, why: str) -> None:
        super().__init__(why)
        self.code = code


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


class _UserMemory:
    """copy_from_user / copy_to_user for this process: process_vm_readv/writev fail with EFAULT on memory that is not
    mapped (or not writable), where touching it directly would crash the process."""

    class _Iovec(ctypes.Structure):
        _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]

    def __init__(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        self._calls: list[Any] = []
        for name in ("process_vm_readv", "process_vm_writev"):
            fn = getattr(libc, name)
            fn.restype = ctypes.c_ssize_t
            fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]
            self._calls.append(fn)

    def _move(self, write: bool, local: int, remote: int, n: int) -> bool:
        if n == 0: return True
        if remote <= 0 or remote + n > 1 << 64: return False
        lo, re_ = self._Iovec(local, n), self._Iovec(remote, n)
        return bool(self._calls[write](os.getpid(), ctypes.addressof(lo), 1, ctypes.addressof(re_), 1, 0) == n)

    def read(self, addr: int, n: int) -> bytes | None:
        """`n` bytes at `addr`, or None if they cannot all be read."""
        buf = ctypes.create_string_buffer(n)
        return buf.raw if self._move(False, ctypes.addressof(buf), addr, n) else None

    def write(self, addr: int, data: bytes) -> bool:
        """Store `data` at `addr`; False if it cannot all be written."""
        buf = ctypes.create_string_buffer(data, len(data))
        return self._move(True, ctypes.addressof(buf), addr, len(data))


class _Libc:
    """The libc calls the driver needs with raw addresses (mmap at a fixed address, mremap)."""

    MREMAP_MAYMOVE = 1

    def __init__(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        self.mmap_ = libc.mmap
        self.mmap_.restype, self.mmap_.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        self.munmap_ = libc.munmap
        self.munmap_.restype, self.munmap_.argtypes = ctypes.c_int, [ctypes.c_void_p, ctypes.c_size_t]
        self.mremap_ = libc.mremap
        self.mremap_.restype, self.mremap_.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int]
        self.failed = ctypes.c_void_p(-1).value

    def mmap(self, addr: int | None, length: int, prot: int, flags: int, fd: int, offset: int) -> int:
        got = self.mmap_(addr or None, length, prot, flags, fd, offset)
        if got in (None, self.failed):
            err = ctypes.get_errno()
            raise OSError(err, f"mmap of {length:#x} bytes{f' at {addr:#x}' if addr else ''} failed: {os.strerror(err)}")
        return int(got)

    def munmap(self, addr: int, length: int) -> None:
        if self.munmap_(addr, length) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"munmap of {length:#x} bytes at {addr:#x} failed: {os.strerror(err)}")

    def alias(self, addr: int, length: int) -> int | None:
        """A second mapping of the shared pages at [addr, addr + length) (mremap with old size 0), or None."""
        got = self.mremap_(addr, 0, length, self.MREMAP_MAYMOVE)
        return None if got in (None, self.failed) else int(got)


def _process_mappings(addr: int, size: int) -> list[tuple[int, int, str]]:
    """The process's mappings (start, end, permissions) that overlap [addr, addr + size), from /proc/self/maps."""
    found = []
    with open("/proc/self/maps") as f:
        for line in f:
            span, perms = line.split()[:2]
            start, end = (int(x, 16) for x in span.split("-"))
            if start < addr + size and addr < end: found.append((start, end, perms))
    return found


# ---- driver state

@dataclass(eq=False)
class _Gpu:
    """One emulated GPU: its identity, address space, the EmulatedGpu, device memory in use and channel ids."""
    index: int
    uuid: bytes
    gpu_id: int
    space: Any
    emu: Any = None
    used_bytes: int = 0
    next_phys: int = 0x1_0000_0000
    channels: dict[int, _Channel] = field(default_factory=dict)


@dataclass(eq=False)
class _Backing:
    """Memory behind a memory object: `host` is the driver's own address of it (what the GPU accesses). Each user (the
    RM object, UVM mappings, CPU mappings, pending mmap contexts, channels) holds a reference."""
    kind: str  # "device", "system", "host", "usermode"
    size: int
    host: int
    gpu: _Gpu | None
    fd: int = -1  # the memfd (device, system, usermode)
    unmap_host: bool = True  # whether `host` is the driver's own mapping (released with it)
    refs: int = 1


@dataclass(eq=False)
class _Client:
    handle: int
    fd: int  # the control fd that allocated it (closing that fd frees the client, as nvidia.ko does)
    objects: dict[int, _Object] = field(default_factory=dict)
    next_handle: int = RS_UNIQUE_HANDLE_BASE


@dataclass(eq=False)
class _DmaMapping:
    """A resource-manager DMA mapping (NV_ESC_RM_MAP_MEMORY_DMA) of `memory` into `space` at `va`."""
    va: int
    size: int
    memory: _Object
    space: _Object


@dataclass(eq=False)
class _Channel:
    chid: int
    gpu: _Gpu
    group: _Object
    gpfifo_va: int
    entries: int
    userd: _Backing
    userd_va: int
    userd_map: int  # the start of the driver's GPU mapping of the USERD pages
    notifier: _Backing | None
    engine_type: int
    classes: set[int] = field(default_factory=set)  # the GPFIFO class and the engine classes allocated on it
    on_gpu: bool = False  # added to the GPU (its group is scheduled)
    rung: bool = False  # a doorbell reached it (before that, the GPU may be given its classes anew)
    pending: bool = False  # a doorbell rang before it was on the GPU: kick it once it is


@dataclass(eq=False)
class _Object:
    """A resource-manager object. Per kind: memory (`backing`, `dma`: its DMA mappings), vaspace / virtual memory
    (`va_range`, `dma`: mappings into it), channel group (`engine_type`, `scheduled`, `subcontexts`), channel
    (`channel`), context share (`subcontext`), debugger (`target`: the engine object it debugs)."""
    handle: int
    cls: int
    kind: str
    client: _Client
    parent: _Object | None
    gpu: _Gpu | None = None
    children: dict[int, _Object] = field(default_factory=dict)
    backing: _Backing | None = None
    dma: list[_DmaMapping] = field(default_factory=list)
    va_range: tuple[int, int] = (0, 0)
    next_va: int = 0
    engine_type: int = 0
    scheduled: bool = False
    subcontexts: set[int] = field(default_factory=set)
    subcontext: int = -1
    channel: _Channel | None = None
    target: _Object | None = None


@dataclass(eq=False)
class _MmapContext:
    """What NV_ESC_RM_MAP_MEMORY left on an fd for the next mmap of it."""
    backing: _Backing
    offset: int
    length: int
    writable: bool


@dataclass(eq=False)
class _CpuMapping:
    """A CPU mapping of a memory object made by `mmap`: the pieces still mapped (munmap may cut it)."""
    backing: _Backing
    pieces: list[tuple[int, int]]


@dataclass(eq=False)
class _GpuMap:
    """A UVM mapping of memory into a GPU's address space."""
    gpu: _Gpu
    va: int
    size: int
    backing: _Backing
    host: int
    writable: bool
    what: str


@dataclass(eq=False)
class _UvmRange:
    base: int
    length: int
    kind: str  # "external" or "channel"
    maps: list[_GpuMap] = field(default_factory=list)
    channel: tuple[int, int] | None = None  # (client, channel) for a channel range


@dataclass(eq=False)
class _UvmSpace:
    """One UVM va_space (an initialized /dev/nvidia-uvm fd)."""
    flags: int
    gpus: dict[bytes, _Gpu] = field(default_factory=dict)
    vaspaces: dict[bytes, tuple[int, int]] = field(default_factory=dict)
    ranges: list[_UvmRange] = field(default_factory=list)
    peers: set[frozenset[bytes]] = field(default_factory=set)


@dataclass(eq=False)
class _File:
    fd: int
    kind: str  # "ctl", "gpu", "uvm"
    gpu: _Gpu | None = None
    ctl_fd: int = -1  # the control fd NV_ESC_REGISTER_FD linked this fd to (-1: none)
    context: _MmapContext | None = None
    uvm_state: str = "new"  # "new", "va_space", "mm"
    uvm: _UvmSpace | None = None


@dataclass
class _Fault:
    """A channel fault as the debugger reports it."""
    text: str
    mmu: bool
    address: int | None
    access: str | None
    fault_type: int


@dataclass(frozen=True)
class _ClassInfo:
    kind: str
    parents: tuple[str, ...]
    params: str | None  # the allocation-parameter structure in the headers
    required: bool


@dataclass(frozen=True)
class _Escape:
    types: tuple[Any, ...]  # the structures the escape accepts (the element, for an array escape)
    array: bool
    where: str  # "ctl", "gpu" or "any": the device file the escape is for
    handler: Callable[[_File, Any], None]


@dataclass(frozen=True)
class _Control:
    kinds: tuple[str, ...]
    params: str | None
    handler: Callable[[_Object, Any], None]


def _default_gpu_factory(space: Any, headers: ModuleType, seed: int | None, on_fault: Callable[[int, str, int], None]) -> Any:
    from hcq.backends.nv.emulator.gpu import EmulatedGpu
    return EmulatedGpu(space, headers, seed=seed, on_fault=on_fault)


def _default_space_factory() -> Any:
    from hcq.backends.nv.emulator.memory import AddressSpace
    return AddressSpace()


class EmulatedDriver:
    """The NVIDIA kernel driver of `gpus` emulated Hopper GPUs (minors 0..gpus-1), each with `device_memory_bytes` of
    device memory. `gpu_factory(space, headers, seed=, on_fault=)` makes each GPU (default: emulator.gpu.EmulatedGpu;
    GPU i gets seed + i, or None: the GPU's own choice), `space_factory()` each GPU address space (default:
    emulator.memory.AddressSpace).

    Beyond the DriverInterface: `close()` with no fd closes the whole driver, `gpu(minor)` is the GPU behind
    /dev/nvidia<minor>, `stats()` counts what is held, `messages` says why recent requests were refused (the driver's
    dmesg), `stray_doorbells` counts doorbells with an unknown token, `class_list()` is what the GPU offers."""

    def __init__(self, gpus: int = 1, device_memory_bytes: int = DEFAULT_DEVICE_MEMORY, seed: int | None = None,
                 gpu_factory: Callable[..., Any] | None = None, space_factory: Callable[[], Any] | None = None) -> None:
        if not 1 <= gpus <= 32: raise ValueError(f"an emulated driver has 1 to 32 GPUs, not {gpus}")
        if device_memory_bytes <= 0: raise ValueError(f"device memory must be positive, not {device_memory_bytes}")
        self.h = h = abi.headers(abi.EMULATED_DRIVER_VERSION)
        self.device_memory_bytes = device_memory_bytes
        self.messages: collections.deque[str] = collections.deque(maxlen=200)  # why requests were refused (the driver's dmesg)
        self.stray_doorbells = 0
        self._lock = threading.RLock()
        self._fault_lock = threading.Lock()
        self._user = _UserMemory()
        self._libc = _Libc()
        self._files: dict[int, _File] = {}
        self._clients: dict[int, _Client] = {}
        self._next_client = RS_CLIENT_HANDLE_BASE
        self._uvm_channels: dict[tuple[int, int], _UvmSpace] = {}
        self._cpu_maps: dict[int, _CpuMapping] = {}  # start of the original mapping -> it
        self._backings: set[_Backing] = set()
        self._faults: dict[tuple[int, int], list[_Fault]] = {}
        self._notifiers: dict[tuple[int, int], tuple[_Backing, int]] = {}  # (gpu, chid) -> (notifier, engine type)
        self._closed = False
        make_space = space_factory or _default_space_factory
        make_gpu = gpu_factory or _default_gpu_factory
        self._gpus: list[_Gpu] = []
        try:
            for i in range(gpus):
                uuid = hashlib.sha1(f"hcq emulated NVIDIA H100 {i}".encode()).digest()[:16]
                gpu = _Gpu(i, uuid, (i + 1) << 8, make_space())
                gpu.emu = make_gpu(gpu.space, h, seed=None if seed is None else seed + i, on_fault=self._fault_callback(gpu))
                self._gpus.append(gpu)
        except BaseException:
            for gpu in self._gpus: gpu.emu.close()
            raise
        self._classes = self._class_table()
        self._escapes = self._escape_table()
        self._controls = self._control_table()
        self._uvm_calls = self._uvm_table()

    # ---- the DriverInterface
    def driver_version(self) -> str:
        return abi.EMULATED_DRIVER_VERSION

    def gpu(self, minor: int) -> Any:
        """The EmulatedGpu behind /dev/nvidia<minor>."""
        if not 0 <= minor < len(self._gpus): raise ValueError(f"there is no emulated GPU with minor number {minor}")
        return self._gpus[minor].emu

    def open(self, path: str, flags: int) -> int:
        """Open one of the driver's device files; any other path is FileNotFoundError, as os.open says."""
        kind, gpu = self._device_file(path)
        with self._lock:
            if self._closed: raise OSError(errno.ENODEV, f"{path}: the emulated driver is closed")
            fd = os.open("/dev/null", os.O_RDWR | os.O_CLOEXEC)
            self._files[fd] = _File(fd, kind, gpu)
            return fd

    def _device_file(self, path: str) -> tuple[str, _Gpu | None]:
        if path == "/dev/nvidiactl": return "ctl", None
        if path == "/dev/nvidia-uvm": return "uvm", None
        m = re.fullmatch(r"/dev/nvidia(\d+)", path)
        if m and int(m.group(1)) < len(self._gpus): return "gpu", self._gpus[int(m.group(1))]
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path)

    def close(self, fd: int | None = None) -> None:
        """Close device file `fd`: what it holds goes with it (a control fd's clients, a UVM fd's va_space, a pending
        mapping). With no fd, close the driver: every fd, the GPUs, and all the memory the driver still holds (what
        the process mapped with `mmap` stays mapped until it unmaps it, as after the real driver's fds close)."""
        if fd is None: return self._shutdown()
        with self._lock:
            f = self._files.pop(fd, None)
            if f is None: raise OSError(errno.EBADF, f"fd {fd} is not an open emulated NVIDIA device file")
            self._drop_context(f)
            if f.kind == "ctl":
                for client in [c for c in self._clients.values() if c.fd == fd]: self._free_client(client)
            if f.uvm is not None: self._destroy_uvm(f.uvm)
            os.close(fd)

    def ioctl(self, fd: int, request: int, arg: Any) -> int:
        """An ioctl on one of the driver's fds: 0, or -errno. `arg` (a ctypes object or writable buffer) is read and
        written in place, as copy_from_user / copy_to_user would."""
        addr, avail = self._buffer(arg)
        with self._lock:
            f = self._files.get(fd)
            if f is None: return -errno.EBADF
            try:
                if f.kind == "uvm": self._uvm_ioctl(f, request, addr, avail)
                else: self._nv_ioctl(f, request, addr, avail)
            except _Errno as e:
                self._say(f"ioctl 0x{request:x} on fd {fd}: {e}")
                return -e.code
            return 0

    def mmap(self, addr: int | None, length: int, prot: int, flags: int, fd: int, offset: int) -> int:
        """mmap(2). On a device file it maps the memory NV_ESC_RM_MAP_MEMORY left pending on that fd (at `addr`
        exactly, when given); any other fd (or none: anonymous memory) goes to the system's mmap."""
        with self._lock:
            f = self._files.get(fd)
            if f is None: return self._libc.mmap(addr, length, prot, flags, fd, offset)
            ctx = f.context
            if f.kind == "uvm": raise OSError(errno.EINVAL, "mmap of /dev/nvidia-uvm (managed memory) is not emulated")
            if ctx is None: raise OSError(errno.EINVAL, f"mmap of fd {fd}: no mapping is pending on it (NV_ESC_RM_MAP_MEMORY names the fd first)")
            if offset != 0: raise OSError(errno.EINVAL, f"mmap of fd {fd}: the offset must be 0, not {offset:#x}")
            if not flags & mmap.MAP_SHARED or flags & mmap.MAP_PRIVATE: raise OSError(errno.EINVAL, f"mmap of fd {fd}: the mapping must be MAP_SHARED")
            if length <= 0: raise OSError(errno.EINVAL, f"mmap of fd {fd}: length {length}")
            if f.kind == "gpu" and length != ctx.length:
                raise OSError(errno.ENXIO, f"mmap of fd {fd}: {length:#x} bytes, but the pending mapping is {ctx.length:#x} bytes")
            if f.kind == "ctl" and _round_up(length, PAGE) > _round_up(ctx.length, PAGE):
                raise OSError(errno.ERANGE, f"mmap of fd {fd}: {length:#x} bytes, but the pending mapping is {ctx.length:#x} bytes")
            if prot & mmap.PROT_WRITE and not ctx.writable: prot &= ~mmap.PROT_WRITE  # (the driver drops VM_WRITE for a read-only mapping)
            flags = mmap.MAP_SHARED | flags & ~(mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS) | (MAP_FIXED if addr else 0)
            start = self._libc.mmap(addr, length, prot, flags, ctx.backing.fd, ctx.offset)
            ctx.backing.refs += 1
            self._cpu_maps[start] = _CpuMapping(ctx.backing, [(start, start + _round_up(length, PAGE))])
            return start

    def munmap(self, addr: int, length: int) -> None:
        """munmap(2); CPU mappings of memory objects it removes release their memory."""
        with self._lock:
            self._libc.munmap(addr, length)
            end = addr + _round_up(length, PAGE)
            for start, cpu in list(self._cpu_maps.items()):
                left = [(a, b) for lo, hi in cpu.pieces for a, b in ((lo, min(hi, addr)), (max(lo, end), hi)) if a < b]
                cpu.pieces = left
                if not left:
                    del self._cpu_maps[start]
                    self._release(cpu.backing)

    def doorbell(self, mapped_usermode_addr: int, token: int) -> None:
        """Ring a GPU's doorbell: `mapped_usermode_addr` is where the usermode object is mapped, `token` a channel's
        work-submit token. The store lands at +0x90 as on hardware; an unknown token is ignored (counted)."""
        with self._lock:
            cpu = self._cpu_maps.get(mapped_usermode_addr)
            if cpu is None or cpu.backing.kind != "usermode" or cpu.backing.gpu is None or \
                    not any(lo <= mapped_usermode_addr + DOORBELL_OFFSET < hi for lo, hi in cpu.pieces):
                raise ValueError(f"doorbell at {mapped_usermode_addr:#x}: no usermode object is mapped there")
            gpu = cpu.backing.gpu
            ctypes.c_uint32.from_address(cpu.backing.host + DOORBELL_OFFSET).value = token & 0xFFFFFFFF
            channel = gpu.channels.get(token)
            if channel is None:
                self.stray_doorbells += 1
                return
            if not channel.on_gpu:
                channel.pending = True
                return
            channel.rung = True
            gpu.emu.kick(channel.chid)  # (under the lock: a concurrent RM_FREE cannot take the channel away meanwhile)

    def _shutdown(self) -> None:
        with self._lock:
            if self._closed: return
            for fd in list(self._files): self.close(fd)
            for client in list(self._clients.values()): self._free_client(client)
            for start, cpu in list(self._cpu_maps.items()):  # (the process's own mappings stay: their pages live on with them)
                del self._cpu_maps[start]
                self._release(cpu.backing)
            self._closed = True
        for gpu in self._gpus: gpu.emu.close()
        with self._lock:
            for backing in list(self._backings):
                backing.refs = 1
                self._release(backing)

    def stats(self) -> dict[str, int]:
        """What the driver holds: open fds, clients, objects, channels, memory objects and their bytes by kind, GPU
        mappings, CPU mappings (all zero once everything is freed)."""
        with self._lock:
            kinds = collections.Counter(b.kind for b in self._backings)
            nbytes: collections.Counter[str] = collections.Counter()
            for b in self._backings: nbytes[b.kind] += b.size
            return {"fds": len(self._files), "clients": len(self._clients), "objects": sum(len(c.objects) for c in self._clients.values()),
                    "channels": sum(len(g.channels) for g in self._gpus), "memory_objects": sum(kinds.values()),
                    "device_bytes": nbytes["device"], "system_bytes": nbytes["system"], "host_bytes": nbytes["host"],
                    "usermode_objects": kinds["usermode"], "gpu_mappings": sum(len(g.space.mappings()) for g in self._gpus),
                    "cpu_mappings": len(self._cpu_maps)}

    # ---- helpers
    def _say(self, text: str) -> None:
        self.messages.append(text)

    @staticmethod
    def _buffer(arg: Any) -> tuple[int, int]:
        """The address and size of the caller's argument (a ctypes object or any writable buffer)."""
        if isinstance(arg, (ctypes.Structure, ctypes.Union, ctypes.Array, ctypes._SimpleCData)):
            return ctypes.addressof(arg), ctypes.sizeof(arg)
        view = memoryview(arg)
        if view.readonly: raise TypeError("an ioctl argument must be writable (the driver writes its reply into it)")
        raw = (ctypes.c_char * view.nbytes).from_buffer(arg)
        return ctypes.addressof(raw), view.nbytes

    def _copy_in(self, addr: int, size: int, what: str) -> bytes:
        """copy_from_user of an embedded buffer: NULL -> NV_ERR_INVALID_ARGUMENT, unreadable -> NV_ERR_INVALID_ADDRESS."""
        h = self.h
        if size > PARAM_COPY_MAX: raise _Status(h.NV_ERR_INVALID_ARGUMENT, f"{what}: {size} bytes is over the {PARAM_COPY_MAX}-byte limit")
        if not addr: raise _Status(h.NV_ERR_INVALID_ARGUMENT, f"{what}: NULL pointer for {size} bytes")
        data = self._user.read(addr, size)
        if data is None: raise _Status(h.NV_ERR_INVALID_ADDRESS, f"{what}: {size} bytes at {addr:#x} cannot be read")
        return data

    def _copy_out(self, addr: int, data: bytes, what: str) -> None:
        if not self._user.write(addr, data): raise _Status(self.h.NV_ERR_INVALID_ADDRESS, f"{what}: {len(data)} bytes at {addr:#x} cannot be written")

    def _new_backing(self, kind: str, size: int, gpu: _Gpu | None) -> _Backing:
        """Zeroed memory of `size` bytes in a memfd, mapped by the driver."""
        fd = os.memfd_create(f"hcq-nv-{kind}", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            host = self._libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
        except BaseException:
            os.close(fd)
            raise
        backing = _Backing(kind, size, host, gpu, fd=fd)
        self._backings.add(backing)
        if kind == "device" and gpu is not None: gpu.used_bytes += size
        return backing

    def _release(self, backing: _Backing) -> None:
        """Drop one reference; the last one gives the memory back."""
        backing.refs -= 1
        if backing.refs > 0 or backing not in self._backings: return
        self._backings.discard(backing)
        if backing.kind == "device" and backing.gpu is not None: backing.gpu.used_bytes -= backing.size
        if backing.unmap_host: self._libc.munmap(backing.host, backing.size)
        if backing.fd >= 0: os.close(backing.fd)

    def _drop_context(self, f: _File) -> None:
        if f.context is not None:
            self._release(f.context.backing)
            f.context = None

    def _client(self, handle: int, f: _File | None = None) -> _Client:
        """Client `handle`; when the request came through fd `f`, the client must be that fd's (or, for a device fd,
        the control fd it is registered with), as the resource manager checks the caller's file."""
        client = self._clients.get(handle)
        if client is None: raise _Status(self.h.NV_ERR_INVALID_CLIENT, f"no client 0x{handle:x}")
        if f is not None and client.fd != (f.ctl_fd if f.ctl_fd >= 0 else f.fd):
            raise _Status(self.h.NV_ERR_INVALID_CLIENT, f"client 0x{handle:x} belongs to fd {client.fd}, not to fd {f.fd}")
        return client

    def _client_of_fd(self, handle: int, fd: int) -> _Client:
        """Client `handle` as a UVM call names it (with the control fd rmCtrlFd it was made on)."""
        ctl = self._files.get(fd)
        if ctl is None or ctl.kind != "ctl": raise _Status(self.h.NV_ERR_INVALID_ARGUMENT, f"rmCtrlFd {fd} is not a /dev/nvidiactl fd")
        return self._client(handle, ctl)

    def _object(self, client: _Client, handle: int, status: int | None = None, kinds: tuple[str, ...] = ()) -> _Object:
        """Object `handle` of `client` (of one of `kinds` when given); else `status` (NV_ERR_INVALID_OBJECT_HANDLE)."""
        obj = client.objects.get(handle)
        if obj is None or kinds and obj.kind not in kinds:
            what = f"a {'/'.join(kinds)} object" if kinds else "an object"
            raise _Status(self.h.NV_ERR_INVALID_OBJECT_HANDLE if status is None else status, f"0x{handle:x} is not {what} of client 0x{client.handle:x}")
        return obj

    def _subtree(self, obj: _Object) -> Iterator[_Object]:
        """`obj` and everything under it, children first."""
        for child in list(obj.children.values()): yield from self._subtree(child)
        yield obj

    # ---- nvidia.ko ioctls
    def _escape_table(self) -> dict[int, _Escape]:
        h = self.h
        return {
            h.NV_ESC_CARD_INFO: _Escape((h.nv_ioctl_card_info_t,), True, "ctl", self._esc_card_info),
            h.NV_ESC_CHECK_VERSION_STR: _Escape((h.nv_ioctl_rm_api_version_t,), False, "ctl", self._esc_check_version),
            h.NV_ESC_ATTACH_GPUS_TO_FD: _Escape((ctypes.c_uint32,), True, "ctl", self._esc_attach_gpus),
            h.NV_ESC_REGISTER_FD: _Escape((h.nv_ioctl_register_fd_t,), False, "any", self._esc_register_fd),
            h.NV_ESC_RM_ALLOC: _Escape((h.NVOS21_PARAMETERS, h.NVOS64_PARAMETERS), False, "ctl", self._esc_rm_alloc),
            h.NV_ESC_RM_FREE: _Escape((h.NVOS00_PARAMETERS,), False, "ctl", self._esc_rm_free),
            h.NV_ESC_RM_CONTROL: _Escape((h.NVOS54_PARAMETERS,), False, "ctl", self._esc_rm_control),
            h.NV_ESC_RM_ALLOC_MEMORY: _Escape((h.nv_ioctl_nvos02_parameters_with_fd,), False, "gpu", self._esc_alloc_memory),
            h.NV_ESC_RM_MAP_MEMORY: _Escape((h.nv_ioctl_nvos33_parameters_with_fd,), False, "ctl", self._esc_map_memory),
            h.NV_ESC_RM_UNMAP_MEMORY: _Escape((h.NVOS34_PARAMETERS,), False, "ctl", self._esc_unmap_memory),
            h.NV_ESC_RM_MAP_MEMORY_DMA: _Escape((h.NVOS46_PARAMETERS,), False, "ctl", self._esc_map_memory_dma),
            h.NV_ESC_RM_UNMAP_MEMORY_DMA: _Escape((h.NVOS47_PARAMETERS,), False, "ctl", self._esc_unmap_memory_dma),
        }

    def _nv_ioctl(self, f: _File, request: int, addr: int, avail: int) -> None:
        h = self.h
        direction, size, kind, nr = request >> 30 & 3, request >> 16 & 0x3FFF, request >> 8 & 0xFF, request & 0xFF
        if kind != ord(h.NV_IOCTL_MAGIC) or direction != 3 or not 0 <= request < 1 << 32:
            raise _Errno(errno.EINVAL, f"not an NVIDIA ioctl (_IOWR('{h.NV_IOCTL_MAGIC}', nr, size)): dir {direction}, type {kind:#x}")
        esc = self._escapes.get(nr)
        if esc is None: raise _Errno(errno.EINVAL, f"unknown NVRM ioctl command 0x{nr:x}")
        sizes = [ctypes.sizeof(t) for t in esc.types]
        if not (size and size % sizes[0] == 0 if esc.array else size in sizes):
            raise _Errno(errno.EINVAL, f"ioctl 0x{nr:x}: structure size {size}, expected {'a multiple of ' if esc.array else ''}{' or '.join(map(str, sizes))}")
        if avail < size: raise _Errno(errno.EFAULT, f"ioctl 0x{nr:x}: the request says {size} bytes but the argument has {avail}")
        if esc.where == "ctl" and f.kind != "ctl" or esc.where == "gpu" and f.kind != "gpu":
            raise _Errno(errno.EINVAL, f"ioctl 0x{nr:x} is for {'/dev/nvidiactl' if esc.where == 'ctl' else '/dev/nvidiaN'}, not this {f.kind} fd")
        arg_t = esc.types[0] * (size // sizes[0]) if esc.array else esc.types[sizes.index(size)]
        params = arg_t.from_buffer_copy(ctypes.string_at(addr, size))
        try:
            esc.handler(f, params)
        finally:
            ctypes.memmove(addr, ctypes.addressof(params), size)  # (copied out whatever the outcome, as nvidia_ioctl does)

    def _with_status(self, holder: Any, what: str, fn: Callable[[], None]) -> None:
        """Run a resource-manager request; its outcome goes into holder.status (the ioctl itself succeeds)."""
        try:
            fn()
            holder.status = self.h.NV_OK
        except _Status as e:
            holder.status = e.code
            self._say(f"{what}: {self.h.nv_status_codes.get(e.code, hex(e.code))}: {e}")

    def _esc_card_info(self, f: _File, cards: Any) -> None:
        for i, card in enumerate(cards):
            if i >= len(self._gpus):
                ctypes.memset(ctypes.addressof(card), 0, ctypes.sizeof(card))
                continue
            gpu = self._gpus[i]
            card.valid = 1
            card.pci_info.domain, card.pci_info.bus, card.pci_info.slot, card.pci_info.function = 0, gpu.gpu_id >> 8, 0, 0
            card.pci_info.vendor_id, card.pci_info.device_id = PCI_VENDOR, PCI_DEVICE
            card.gpu_id, card.interrupt_line, card.minor_number = gpu.gpu_id, 0, gpu.index
            card.reg_address, card.reg_size = 0xF000_0000 + (gpu.index << 24), 16 << 20
            card.fb_address, card.fb_size = 0x20_0000_0000 * (gpu.index + 1), self.device_memory_bytes

    def _esc_check_version(self, f: _File, p: Any) -> None:
        h = self.h
        ours = abi.EMULATED_DRIVER_VERSION.encode()
        theirs = bytes(p.versionString).split(b"\0")[0]
        cmd = p.cmd
        query, relaxed = ord(h.NV_RM_API_VERSION_CMD_QUERY), ord(h.NV_RM_API_VERSION_CMD_RELAXED)
        ok = cmd == query or theirs == ours or cmd == relaxed and theirs.split(b".")[:2] == ours.split(b".")[:2]
        p.versionString = ours
        p.reply = h.NV_RM_API_VERSION_REPLY_RECOGNIZED if ok else h.NV_RM_API_VERSION_REPLY_UNRECOGNIZED
        if not ok: raise _Errno(errno.EINVAL, f"API version mismatch: the client is {theirs.decode(errors='replace')}, the driver {ours.decode()}")

    def _esc_attach_gpus(self, f: _File, ids: Any) -> None:
        known = {g.gpu_id for g in self._gpus}
        if any(i and i not in known for i in ids): raise _Errno(errno.EINVAL, f"attach: unknown GPU id in {list(ids)}")

    def _esc_register_fd(self, f: _File, p: Any) -> None:
        ctl = self._files.get(p.ctl_fd)
        if f.ctl_fd >= 0: raise _Errno(errno.EINVAL, "this fd is already registered with a control fd (NV_ERR_INVALID_STATE)")
        if ctl is None or ctl.kind != "ctl" or ctl is f or ctl.ctl_fd >= 0:
            raise _Errno(errno.EINVAL, f"fd {p.ctl_fd} is not another open, unlinked /dev/nvidiactl fd")
        f.ctl_fd = ctl.fd

    # ---- RM_ALLOC / RM_FREE
    def _class_table(self) -> dict[int, _ClassInfo]:
        h = self.h
        memory, channel, engine = ("device", "subdevice"), ("channel", ("group",), "NV_CHANNELGPFIFO_ALLOCATION_PARAMETERS", True), ("engine", ("channel",))
        table = {
            h.NV01_ROOT_CLIENT: _ClassInfo("client", (), "NV0000_ALLOC_PARAMETERS", False),
            h.NV01_DEVICE_0: _ClassInfo("device", ("client",), "NV0080_ALLOC_PARAMETERS", False),
            h.NV20_SUBDEVICE_0: _ClassInfo("subdevice", ("device",), "NV2080_ALLOC_PARAMETERS", False),
            h.HOPPER_USERMODE_A: _ClassInfo("usermode", ("subdevice",), "NV_HOPPER_USERMODE_A_PARAMS", False),
            h.NV01_MEMORY_VIRTUAL: _ClassInfo("virtual", ("device",), "NV_MEMORY_VIRTUAL_ALLOCATION_PARAMS", False),
            h.FERMI_VASPACE_A: _ClassInfo("vaspace", memory, "NV_VASPACE_ALLOCATION_PARAMETERS", False),
            h.KEPLER_CHANNEL_GROUP_A: _ClassInfo("group", memory, "NV_CHANNEL_GROUP_ALLOCATION_PARAMETERS", False),
            h.FERMI_CONTEXT_SHARE_A: _ClassInfo("ctxshare", ("group",), "NV_CTXSHARE_ALLOCATION_PARAMETERS", True),
            h.HOPPER_CHANNEL_GPFIFO_A: _ClassInfo(*channel), h.AMPERE_CHANNEL_GPFIFO_A: _ClassInfo(*channel),
            h.HOPPER_COMPUTE_A: _ClassInfo(*engine, "NV_GR_ALLOCATION_PARAMETERS", False),
            h.HOPPER_DMA_COPY_A: _ClassInfo(*engine, None, False),  # (NVB0B5_ALLOCATION_PARAMETERS: not in the generated headers)
            h.GT200_DEBUGGER: _ClassInfo("debugger", ("device",), "NV83DE_ALLOC_PARAMETERS", True),
            h.NV1_MEMORY_USER: _ClassInfo("memory", memory, "NV_MEMORY_ALLOCATION_PARAMS", True),
            h.NV1_MEMORY_SYSTEM: _ClassInfo("memory", memory, "NV_MEMORY_ALLOCATION_PARAMS", True),
            h.NV01_MEMORY_SYSTEM_OS_DESCRIPTOR: _ClassInfo("memory", memory, None, False),
        }
        return table

    def class_list(self) -> list[int]:
        """The classes NV0080_CTRL_CMD_GPU_GET_CLASSLIST reports (those a device's objects can be)."""
        return [c for c, info in self._classes.items() if info.kind != "client"]

    def _esc_rm_alloc(self, f: _File, p: Any) -> None:
        h = self.h
        if p.hClass in (h.NV01_ROOT, h.NV01_ROOT_NON_PRIV): p.hClass = h.NV01_ROOT_CLIENT  # (escape.c: user clients are _CLIENT)

        def run() -> None:
            p.hObjectNew = self._alloc(f, p.hRoot, p.hObjectParent, p.hObjectNew, p.hClass, p.pAllocParms or 0, p.paramsSize)
        self._with_status(p, f"RM_ALLOC class 0x{p.hClass:x}", run)

    def _alloc(self, f: _File, h_client: int, h_parent: int, h_new: int, cls: int, p_params: int, params_size: int) -> int:
        h = self.h
        info = self._classes.get(cls)
        if info is None: raise _Status(h.NV_ERR_INVALID_CLASS, f"class 0x{cls:x} is not one this GPU has")
        params_t = getattr(h, info.params) if info.params else None
        params = None
        if params_t is not None:
            if not p_params:
                if info.required: raise _Status(h.NV_ERR_INVALID_ARGUMENT, f"class 0x{cls:x} needs allocation parameters")
            else:
                if params_size not in (0, ctypes.sizeof(params_t)):
                    raise _Status(h.NV_ERR_INVALID_PARAM_STRUCT, f"class 0x{cls:x}: paramsSize {params_size}, the parameters are {ctypes.sizeof(params_t)} bytes")
                params = params_t.from_buffer_copy(self._copy_in(p_params, ctypes.sizeof(params_t), f"class 0x{cls:x} parameters"))
        if info.kind == "client": return self._new_client(f, h_new)
        client = self._client(h_client, f)
        parent = client.objects.get(h_parent)
        if parent is None: raise _Status(h.NV_ERR_INVALID_OBJECT_PARENT, f"no object 0x{h_parent:x} in client 0x{h_client:x}")
        if parent.kind not in info.parents:
            raise _Status(h.NV_ERR_INVALID_OBJECT_PARENT, f"class 0x{cls:x} goes under a {' or '.join(info.parents)}, not a {parent.kind} (0x{h_parent:x})")
        handle = self._new_handle(client, h_new)
        obj = _Object(handle, cls, info.kind, client, parent, parent.gpu)
        try:
            getattr(self, f"_make_{info.kind}")(obj, params)
            if params is not None: self._copy_out(p_params, bytes(params), f"class 0x{cls:x} parameters")
        except BaseException:
            self._teardown(obj)
            raise
        parent.children[handle] = client.objects[handle] = obj
        return handle

    def _new_client(self, f: _File, h_new: int) -> int:
        h = self.h
        if h_new:
            if h_new in self._clients: raise _Status(h.NV_ERR_INSERT_DUPLICATE_NAME, f"client handle 0x{h_new:x} is taken")
            handle = h_new
        else:
            while self._next_client in self._clients: self._next_client += 1
            handle, self._next_client = self._next_client, self._next_client + 1
        client = _Client(handle, f.fd)
        client.objects[handle] = _Object(handle, h.NV01_ROOT_CLIENT, "client", client, None)
        self._clients[handle] = client
        return handle

    def _new_handle(self, client: _Client, h_new: int) -> int:
        if h_new:
            if h_new in client.objects or h_new in self._clients:
                raise _Status(self.h.NV_ERR_INSERT_DUPLICATE_NAME, f"handle 0x{h_new:x} is taken in client 0x{client.handle:x}")
            return h_new
        while client.next_handle in client.objects: client.next_handle += 1
        client.next_handle += 1
        return client.next_handle - 1

    def _make_device(self, obj: _Object, params: Any) -> None:
        h = self.h
        index = params.deviceId if params is not None else 0
        if index >= len(self._gpus): raise _Status(h.NV_ERR_INVALID_ARGUMENT, f"device instance {index}: there are {len(self._gpus)} GPUs")
        if any(o.kind == "device" and o.gpu is self._gpus[index] for o in obj.client.objects.values()):
            raise _Status(h.NV_ERR_STATE_IN_USE, f"client 0x{obj.client.handle:x} already has a device for GPU {index}")
        obj.gpu = self._gpus[index]

    def _make_subdevice(self, obj: _Object, params: Any) -> None:
        h = self.h
        assert obj.parent is not None
        if params is not None and params.subDeviceId != 0: raise _Status(h.NV_ERR_INVALID_ARGUMENT, f"subdevice {params.subDeviceId}: each GPU has one")
        if any(c.kind == "subdevice" for c in obj.parent.children.values()):
            raise _Status(h.NV_ERR_STATE_IN_USE, f"device 0x{obj.parent.handle:x} already has its subdevice")

    def _make_usermode(self, obj: _Object, params: Any) -> None:
        if params is not None and params.bPriv: raise _Status(self.h.NV_ERR_INSUFFICIENT_PERMISSIONS, "the privileged usermode region is for the kernel")
        obj.backing = self._new_backing("usermode", USERMODE_BYTES, obj.gpu)

    def _make_virtual(self, obj: _Object, params: Any) -> None:
        offset, limit = (params.offset, params.limit) if params is not None else (0, 0)
        obj.va_range = (offset, limit + 1 if limit else GPU_VA_LIMIT)
        obj.next_va = max(offset, 1 << 32)

    def _make_vaspace(self, obj: _Object, params: Any) -> None:
        base, size = (params.vaBase, params.vaSize) if params is not None else (0, 0)
        obj.va_range = (base or PAGE, (base or PAGE) + size if size else GPU_VA_LIMIT)
        obj.next_va = max(obj.va_range[0], 1 << 32)

    def _make_group(self, obj: _Object, params: Any) -> None:
        h = self.h
        engine = params.engineType if params is not None else h.NV2080_ENGINE_TYPE_GRAPHICS
        if engine not in (h.NV2080_ENGINE_TYPE_GRAPHICS, *range(h.NV2080_ENGINE_TYPE_COPY0, h.NV2080_ENGINE_TYPE_COPY0 + 10)):
            raise _Status(h.NV_ERR_INVALID_ARGUMENT, f"channel group engine type {engine}: graphics or a copy engine")
        if params is not None and params.hVASpace: self._vaspace_of(obj, params.hVASpace)
        obj.engine_type = engine

    def _vaspace_of(self, obj: _Object, handle: int) -> _Object:
        space = self._object(obj.client, handle, kinds=("vaspace",))
        if space.gpu is not obj.gpu: raise _Status(self.h.NV_ERR_INVALID_OBJECT_HANDLE, f"VA space 0x{handle:x} is another GPU's")
        return space

    def _make_ctxshare(self, obj: _Object, params: Any) -> None:
        h = self.h
        group = obj.parent
        assert group is not None and params is not None
        if params.hVASpace: self._vaspace_of(obj, params.hVASpace)
        mode = abi.get_field(h, "NV_CTXSHARE_ALLOCATION_FLAGS", "SUBCONTEXT", params.flags)
        if mode == h.NV_CTXSHARE_ALLOCATION_FLAGS_SUBCONTEXT_SPECIFIED:
            wanted = params.subctxId
            if not 0 <= wanted < MAX_SUBCONTEXTS or wanted in group.subcontexts:
                raise _Status(h.NV_ERR_INVALID_ARGUMENT, f"subcontext {wanted} is taken or out of range")
        else:
            wanted = next((i for i in range(MAX_SUBCONTEXTS) if i not in group.subcontexts), -1)
            if wanted < 0: raise _Status(h.NV_ERR_INSUFFICIENT_RESOURCES, f"channel group 0x{group.handle:x} has all {MAX_SUBCONTEXTS} subcontexts")
        group.subcontexts.add(wanted)
        obj.subcontext = params.subctxId = wanted

    def _memory_object(self, client: _Client, handle: int, what: str) -> _Object:
        obj = client.objects.get(handle)
        if obj is None or obj.backing is None or obj.kind != "memory":
            raise _Status(self.h.NV_ERR_INVALID_OBJECT_HANDLE, f"{what}: 0x{handle:x} is not a memory object of client 0x{client.handle:x}")
        return obj

    def _make_channel(self, obj: _Object, p: Any) -> None:
        h = self.h
        group, gpu, client = obj.parent, obj.gpu, obj.client
        assert group is not None and gpu is not None
        entries = p.gpFifoEntries
        if entries < 2 or entries & (entries - 1): raise _Status(h.NV_ERR_INVALID_ARGUMENT, f"gpFifoEntries {entries} is not a power of two")
        ring = gpu.space.find(p.gpFifoOffset)
        if ring is None or p.gpFifoOffset + entries * 8 > ring.end or p.gpFifoOffset % 8:
            raise _Status(h.NV_ERR_INVALID_ADDRESS, f"GPFIFO [{p.gpFifoOffset:#x}, +{entries * 8:#x}) is not inside memory mapped in the GPU")
        if p.hObjectBuffer and (p.hObjectBuffer not in client.objects or client.objects[p.hObjectBuffer].kind not in ("memory", "virtual")):
            raise _Status(h.NV_ERR_INVALID_OBJECT_HANDLE, f"hObjectBuffer 0x{p.hObjectBuffer:x} is not memory")
        if p.hContextShare and self._object(client, p.hContextShare, kinds=("ctxshare",)).parent is not group:
            raise _Status(h.NV_ERR_INVALID_OBJECT_HANDLE, f"context share 0x{p.hContextShare:x} belongs to another channel group")
        notifier = None
        if p.hObjectError:
            notifier = self._memory_object(client, p.hObjectError, "hObjectError").backing
            assert notifier is not None
            if notifier.size < NOTIFICATION_BYTES * h.NV_CHANNELGPFIFO_NOTIFICATION_TYPE__SIZE_1:
                raise _Status(h.NV_ERR_INVALID_LIMIT, f"the error notifier is {notifier.size} bytes, under {NOTIFICATION_BYTES * h.NV_CHANNELGPFIFO_NOTIFICATION_TYPE__SIZE_1}")
        if not p.hUserdMemory[0]: raise _Status(h.NV_ERR_NOT_SUPPORTED, "the emulated driver needs the USERD in a client's memory object (hUserdMemory[0])")
        userd = self._memory_object(client, p.hUserdMemory[0], "hUserdMemory[0]").backing
        assert userd is not None
        offset, userd_bytes = p.userdOffset[0], ctypes.sizeof(h.HopperAControlGPFifo)
        if offset % userd_bytes or offset + userd_bytes > userd.size:
            raise _Status(h.NV_ERR_INVALID_OFFSET, f"USERD at offset {offset:#x} of {userd.size:#x} bytes (it is {userd_bytes} bytes, aligned)")
        chid = next((i for i in range(MAX_CHANNELS) if i not in gpu.channels), -1)
        if chid < 0: raise _Status(h.NV_ERR_INSUFFICIENT_RESOURCES, f"all {MAX_CHANNELS} channels of GPU {gpu.index} are in use")
        page = offset - offset % PAGE
        slot = USERD_VA_BASE + chid * USERD_SLOT  # (the GPU reads USERD where the driver maps it, as hardware reads it by address)
        gpu.space.map(slot, PAGE, userd.host + page, f"USERD of channel {chid}")
        channel = _Channel(chid, gpu, group, p.gpFifoOffset, entries, userd, slot + offset - page, slot, notifier, group.engine_type, {obj.cls})
        userd.refs += 1
        if notifier is not None:
            notifier.refs += 1
            with self._fault_lock: self._notifiers[(gpu.index, chid)] = (notifier, group.engine_type)
        gpu.channels[chid] = obj.channel = channel  # (from here a failure is undone by _teardown)
        if group.scheduled: self._run_channel(channel)

    def _run_channel(self, channel: _Channel) -> None:
        if channel.on_gpu: return
        channel.gpu.emu.add_channel(channel.chid, channel.gpfifo_va, channel.entries, channel.userd_va, set(channel.classes))
        channel.on_gpu = True
        if channel.pending:  # (a doorbell rang before the group was scheduled: the scheduler finds the work now)
            channel.pending, channel.rung = False, True
            channel.gpu.emu.kick(channel.chid)

    def _stop_channel(self, channel: _Channel) -> None:
        if not channel.on_gpu: return
        channel.on_gpu = False
        channel.gpu.emu.remove_channel(channel.chid)

    def _class_added(self, channel: _Channel) -> None:
        """The GPU takes a channel's classes when it is added: before any doorbell it is added anew with the new set.
        (A class freed later stays known to the GPU: nothing a correct client notices.)"""
        if not channel.on_gpu: return
        if channel.rung:
            self._say(f"channel {channel.chid}: classes {sorted(hex(c) for c in channel.classes)} changed after it ran; the GPU keeps the old set")
            return
        self._stop_channel(channel)
        self._run_channel(channel)

    def _make_engine(self, obj: _Object, params: Any) -> None:
        assert obj.parent is not None and obj.parent.channel is not None
        obj.parent.channel.classes.add(obj.cls)
        self._class_added(obj.parent.channel)

    def _make_debugger(self, obj: _Object, params: Any) -> None:
        h = self.h
        app = self._client(params.hAppClient)
        obj.target = self._object(app, params.hClass3dObject, kinds=("engine",))
        if obj.target.gpu is not obj.gpu: raise _Status(h.NV_ERR_INVALID_ARGUMENT, "the debugged object is on another GPU")

    def _make_memory(self, obj: _Object, p: Any) -> None:
        h = self.h
        gpu = obj.gpu
        assert gpu is not None
        if obj.cls == h.NV01_MEMORY_SYSTEM_OS_DESCRIPTOR:
            raise _Status(h.NV_ERR_NOT_SUPPORTED, "host memory is registered with NV_ESC_RM_ALLOC_MEMORY on /dev/nvidiaN")
        if p.size == 0: raise _Status(h.NV_ERR_INVALID_ARGUMENT, "a memory allocation of 0 bytes")
        if p.alignment & (p.alignment - 1): raise _Status(h.NV_ERR_INVALID_ARGUMENT, f"alignment {p.alignment:#x} is not a power of two")
        huge = abi.get_field(h, "NVOS32_ATTR", "PAGE_SIZE", p.attr) == h.NVOS32_ATTR_PAGE_SIZE_HUGE or \
            abi.get_field(h, "NVOS32_ATTR2", "PAGE_SIZE_HUGE", p.attr2) == h.NVOS32_ATTR2_PAGE_SIZE_HUGE_2MB
        size = _round_up(p.size, max(2 << 20 if huge else PAGE, p.alignment or 1))
        device = obj.cls == h.NV1_MEMORY_USER
        if device and gpu.used_bytes + size > self.device_memory_bytes:
            raise _Status(h.NV_ERR_NO_MEMORY, f"{size:#x} bytes of device memory: GPU {gpu.index} has {self.device_memory_bytes - gpu.used_bytes:#x} of {self.device_memory_bytes:#x} free")
        try:
            obj.backing = self._new_backing("device" if device else "system", size, gpu)
        except OSError as e:
            raise _Status(h.NV_ERR_NO_MEMORY, f"{size:#x} bytes of memory: {e}") from None
        p.size, p.limit, p.offset = size, size - 1, gpu.next_phys
        gpu.next_phys += size

    def _esc_alloc_memory(self, f: _File, p: Any) -> None:
        self._with_status(p.params, "RM_ALLOC_MEMORY", lambda: self._alloc_os_descriptor(f, p.params))

    def _alloc_os_descriptor(self, f: _File, p: Any) -> None:
        """NV01_MEMORY_SYSTEM_OS_DESCRIPTOR: the process's own pages at pMemory (RmAllocOsDescriptor's checks)."""
        h = self.h
        if p.hClass != h.NV01_MEMORY_SYSTEM_OS_DESCRIPTOR:
            raise _Status(h.NV_ERR_NOT_SUPPORTED, f"NV_ESC_RM_ALLOC_MEMORY of class 0x{p.hClass:x}: the emulated driver takes host memory (0x71) here")
        flag = lambda name: abi.get_field(h, "NVOS02_FLAGS", name, p.flags)
        if flag("LOCATION") != h.NVOS02_FLAGS_LOCATION_PCI or flag("MAPPING") != h.NVOS02_FLAGS_MAPPING_NO_MAP or \
                flag("COHERENCY") not in (h.NVOS02_FLAGS_COHERENCY_CACHED, h.NVOS02_FLAGS_COHERENCY_WRITE_BACK, h.NVOS02_FLAGS_COHERENCY_UNCACHED):
            raise _Status(h.NV_ERR_INVALID_FLAGS, f"host memory flags {p.flags:#x}: location PCI, mapping NO_MAP, a cached/uncached coherency")
        addr = p.pMemory or 0
        if addr % PAGE: raise _Status(h.NV_ERR_NOT_SUPPORTED, f"host memory at {addr:#x} is not page-aligned")
        if p.limit + 1 >= 1 << 64: raise _Status(h.NV_ERR_INVALID_LIMIT, f"limit {p.limit:#x} overflows")
        size = _round_up(p.limit + 1, PAGE)
        writable = not flag("ALLOC_USER_READ_ONLY")
        vmas = _process_mappings(addr, size)
        covered = addr
        for start, end, perms in sorted(vmas):
            if start > covered or "r" not in perms or writable and "w" not in perms: break
            covered = end
        if not addr or covered < addr + size:
            raise _Status(h.NV_ERR_INVALID_ADDRESS, f"host memory [{addr:#x}, +{size:#x}) is not all mapped {'read-write' if writable else 'readable'} in the process")
        client = self._client(p.hRoot, f)
        parent = client.objects.get(p.hObjectParent)
        if parent is None or parent.kind not in ("device", "subdevice"):
            raise _Status(h.NV_ERR_INVALID_OBJECT_PARENT, f"host memory goes under a device, not 0x{p.hObjectParent:x}")
        if parent.gpu is not f.gpu: raise _Status(h.NV_ERR_INVALID_ARGUMENT, f"device 0x{p.hObjectParent:x} is not the GPU of this fd")
        handle = self._new_handle(client, p.hObjectNew)
        # pin the pages: a second mapping of shared pages keeps them for the GPU after the process unmaps its own
        alias = self._libc.alias(addr, size) if len(vmas) == 1 and vmas[0][2][3] == "s" and vmas[0][1] >= addr + size else None
        backing = _Backing("host", size, alias or addr, parent.gpu, unmap_host=alias is not None)
        self._backings.add(backing)
        obj = _Object(handle, p.hClass, "memory", client, parent, parent.gpu, backing=backing)
        parent.children[handle] = client.objects[handle] = obj
        p.hObjectNew = handle

    def _esc_rm_free(self, f: _File, p: Any) -> None:
        self._with_status(p, f"RM_FREE 0x{p.hObjectOld:x}", lambda: self._free(f, p.hRoot, p.hObjectOld))

    def _free(self, f: _File, h_client: int, handle: int) -> None:
        client = self._client(h_client, f)
        if handle == h_client: return self._free_client(client)
        self._destroy(self._object(client, handle))

    def _free_client(self, client: _Client) -> None:
        self._destroy(client.objects[client.handle])
        self._clients.pop(client.handle, None)

    def _destroy(self, top: _Object) -> None:
        """Free `top` and its subtree (children first)."""
        for obj in list(self._subtree(top)):
            self._teardown(obj)
            obj.client.objects.pop(obj.handle, None)
            if obj.parent is not None: obj.parent.children.pop(obj.handle, None)

    def _teardown(self, obj: _Object) -> None:
        """Undo what `obj` holds (also of a half-made object whose construction failed)."""
        for m in list(obj.dma): self._drop_dma(m)
        if obj.channel is not None:
            ch, obj.channel = obj.channel, None
            self._stop_channel(ch)
            with self._fault_lock:
                self._notifiers.pop((ch.gpu.index, ch.chid), None)
                self._faults.pop((ch.gpu.index, ch.chid), None)
            ch.gpu.space.unmap(ch.userd_map)
            ch.gpu.channels.pop(ch.chid, None)
            self._release(ch.userd)
            if ch.notifier is not None: self._release(ch.notifier)
        if obj.kind == "engine" and obj.parent is not None and obj.parent.channel is not None:
            if not any(o is not obj and o.cls == obj.cls for o in obj.parent.children.values()): obj.parent.channel.classes.discard(obj.cls)
        if obj.kind == "ctxshare" and obj.parent is not None: obj.parent.subcontexts.discard(obj.subcontext)
        if obj.backing is not None:
            backing, obj.backing = obj.backing, None
            self._release(backing)

    # ---- memory mappings
    def _esc_map_memory(self, f: _File, p: Any) -> None:
        self._with_status(p.params, "RM_MAP_MEMORY", lambda: self._map_memory(f, p.params, p.fd))

    def _map_memory(self, f: _File, p: Any, fd: int) -> None:
        h = self.h
        client = self._client(p.hClient, f)
        device = self._object(client, p.hDevice, kinds=("device", "subdevice"))
        obj = client.objects.get(p.hMemory)
        if obj is None or obj.backing is None: raise _Status(h.NV_ERR_INVALID_OBJECT_HANDLE, f"0x{p.hMemory:x} is not memory the CPU can map")
        backing = obj.backing
        if obj.gpu is not device.gpu: raise _Status(h.NV_ERR_INVALID_OBJECT_HANDLE, f"memory 0x{p.hMemory:x} is another device's")
        if backing.kind == "host": raise _Status(h.NV_ERR_NOT_SUPPORTED, "host memory is the process's already (its mapping is NO_MAP)")
        if p.length == 0 or p.offset + p.length > backing.size:
            raise _Status(h.NV_ERR_INVALID_LIMIT, f"[{p.offset:#x}, +{p.length:#x}) is not inside the {backing.size:#x} bytes of 0x{p.hMemory:x}")
        if p.offset % PAGE: raise _Status(h.NV_ERR_INVALID_OFFSET, f"offset {p.offset:#x} is not page-aligned")
        target = self._files.get(fd)
        want = "ctl" if backing.kind == "system" else "gpu"
        if target is None or target.kind != want or want == "gpu" and target.gpu is not backing.gpu:
            raise _Status(h.NV_ERR_INVALID_ARGUMENT, f"fd {fd} is not {'a /dev/nvidiactl' if want == 'ctl' else f'a /dev/nvidia{device.gpu.index if device.gpu else 0}'} fd")
        if target.context is not None: raise _Status(h.NV_ERR_STATE_IN_USE, f"fd {fd} already has a mapping pending")
        writable = abi.get_field(h, "NVOS33_FLAGS", "ACCESS", p.flags) != h.NVOS33_FLAGS_ACCESS_READ_ONLY
        backing.refs += 1
        target.context = _MmapContext(backing, p.offset, p.length, writable)
        p.pLinearAddress = 0x1000_0000_0000 + p.offset  # (a cookie: the mapping itself is the fd's mmap)

    def _esc_unmap_memory(self, f: _File, p: Any) -> None:
        def run() -> None:
            client = self._client(p.hClient, f)
            self._object(client, p.hDevice, kinds=("device", "subdevice"))
            if client.objects.get(p.hMemory) is None or client.objects[p.hMemory].backing is None:
                raise _Status(self.h.NV_ERR_INVALID_OBJECT_HANDLE, f"0x{p.hMemory:x} is not memory")
        self._with_status(p, "RM_UNMAP_MEMORY", run)

    def _esc_map_memory_dma(self, f: _File, p: Any) -> None:
        self._with_status(p, "RM_MAP_MEMORY_DMA", lambda: self._map_dma(f, p))

    def _map_dma(self, f: _File, p: Any) -> None:
        """A resource-manager mapping of memory into a VA space object (bookkeeping: the GPU sees memory through UVM)."""
        h = self.h
        client = self._client(p.hClient, f)
        device = self._object(client, p.hDevice, kinds=("device",))
        space = self._object(client, p.hDma, kinds=("vaspace", "virtual"))
        memory = self._memory_object(client, p.hMemory, "RM_MAP_MEMORY_DMA")
        assert memory.backing is not None
        if space.gpu is not device.gpu or memory.gpu is not device.gpu: raise _Status(h.NV_ERR_INVALID_DEVICE, "the objects belong to different GPUs")
        length = p.length or memory.backing.size - p.offset
        if p.offset + length > memory.backing.size or length <= 0:
            raise _Status(h.NV_ERR_INVALID_LIMIT, f"[{p.offset:#x}, +{length:#x}) is not inside the {memory.backing.size:#x} bytes of 0x{p.hMemory:x}")
        page = {h.NVOS46_FLAGS_PAGE_SIZE_BIG: 64 << 10, h.NVOS46_FLAGS_PAGE_SIZE_HUGE: 2 << 20}.get(abi.get_field(h, "NVOS46_FLAGS", "PAGE_SIZE", p.flags), PAGE)
        lo, hi = space.va_range
        if abi.get_field(h, "NVOS46_FLAGS", "DMA_OFFSET_FIXED", p.flags) == h.NVOS46_FLAGS_DMA_OFFSET_FIXED_TRUE:
            va = p.dmaOffset
            if va % page: raise _Status(h.NV_ERR_INVALID_OFFSET, f"dmaOffset {va:#x} is not aligned to the {page:#x}-byte pages")
        else:
            va = space.next_va = _round_up(space.next_va, page)
        if va < lo or va + length > hi: raise _Status(h.NV_ERR_INVALID_LIMIT, f"[{va:#x}, +{length:#x}) is outside VA space 0x{p.hDma:x}")
        if any(m.va < va + length and va < m.va + m.size for m in space.dma):
            raise _Status(h.NV_ERR_INVALID_OFFSET, f"[{va:#x}, +{length:#x}) overlaps a mapping in VA space 0x{p.hDma:x}")
        mapping = _DmaMapping(va, length, memory, space)
        space.dma.append(mapping)
        memory.dma.append(mapping)
        space.next_va = max(space.next_va, va + length)
        p.dmaOffset = va

    def _esc_unmap_memory_dma(self, f: _File, p: Any) -> None:
        def run() -> None:
            client = self._client(p.hClient, f)
            space = self._object(client, p.hDma, kinds=("vaspace", "virtual"))
            m = next((m for m in space.dma if m.va == p.dmaOffset and m.memory.handle == p.hMemory), None)
            if m is None: raise _Status(self.h.NV_ERR_INVALID_ARGUMENT, f"memory 0x{p.hMemory:x} is not mapped at {p.dmaOffset:#x} in 0x{p.hDma:x}")
            self._drop_dma(m)
        self._with_status(p, "RM_UNMAP_MEMORY_DMA", run)

    @staticmethod
    def _drop_dma(m: _DmaMapping) -> None:
        for owner in (m.space, m.memory):
            if m in owner.dma: owner.dma.remove(m)

    # ---- RM_CONTROL
    def _control_table(self) -> dict[int, _Control]:
        h = self.h
        return {
            h.NV0000_CTRL_CMD_SYSTEM_GET_BUILD_VERSION_V2: _Control(("client",), "NV0000_CTRL_SYSTEM_GET_BUILD_VERSION_V2_PARAMS", self._ctrl_build_version),
            h.NV0000_CTRL_CMD_GPU_GET_ID_INFO_V2: _Control(("client",), "NV0000_CTRL_GPU_GET_ID_INFO_V2_PARAMS", self._ctrl_id_info),
            h.NV0080_CTRL_CMD_GPU_GET_CLASSLIST: _Control(("device",), "NV0080_CTRL_GPU_GET_CLASSLIST_PARAMS", self._ctrl_classlist),
            h.NV2080_CTRL_CMD_GPU_GET_GID_INFO: _Control(("subdevice",), "NV2080_CTRL_GPU_GET_GID_INFO_PARAMS", self._ctrl_gid_info),
            h.NV2080_CTRL_CMD_GR_GET_INFO: _Control(("subdevice",), "NV2080_CTRL_GR_GET_INFO_PARAMS", self._ctrl_gr_info),
            h.NV2080_CTRL_CMD_TIMER_GET_TIME: _Control(("subdevice",), "NV2080_CTRL_TIMER_GET_TIME_PARAMS", self._ctrl_time),
            h.NV2080_CTRL_CMD_PERF_BOOST: _Control(("subdevice",), "NV2080_CTRL_PERF_BOOST_PARAMS", lambda obj, p: None),
            h.NV2080_CTRL_CMD_FB_FLUSH_GPU_CACHE: _Control(("subdevice",), "NV2080_CTRL_FB_FLUSH_GPU_CACHE_PARAMS", self._ctrl_flush),
            h.NVC36F_CTRL_CMD_GPFIFO_GET_WORK_SUBMIT_TOKEN: _Control(("channel",), "NVC36F_CTRL_CMD_GPFIFO_GET_WORK_SUBMIT_TOKEN_PARAMS", self._ctrl_token),
            h.NVA06C_CTRL_CMD_GPFIFO_SCHEDULE: _Control(("group",), "NVA06C_CTRL_GPFIFO_SCHEDULE_PARAMS", self._ctrl_schedule),
            h.NV83DE_CTRL_CMD_DEBUG_READ_ALL_SM_ERROR_STATES: _Control(("debugger",), "NV83DE_CTRL_DEBUG_READ_ALL_SM_ERROR_STATES_PARAMS", self._ctrl_sm_errors),
            h.NV83DE_CTRL_CMD_DEBUG_READ_MMU_FAULT_INFO: _Control(("debugger",), "NV83DE_CTRL_DEBUG_READ_MMU_FAULT_INFO_PARAMS", self._ctrl_mmu_faults),
        }

    def _esc_rm_control(self, f: _File, p: Any) -> None:
        self._with_status(p, f"RM_CONTROL 0x{p.cmd:x}", lambda: self._control(f, p))

    def _control(self, f: _File, p: Any) -> None:
        h = self.h
        client = self._client(p.hClient, f)
        obj = self._object(client, p.hObject)
        addr = p.params or 0
        if bool(addr) != bool(p.paramsSize): raise _Status(h.NV_ERR_INVALID_ARGUMENT, f"params {addr:#x} with paramsSize {p.paramsSize}")
        ctl = self._controls.get(p.cmd)
        if ctl is None or obj.kind not in ctl.kinds: raise _Status(h.NV_ERR_NOT_SUPPORTED, f"control 0x{p.cmd:x} on a {obj.kind} (class 0x{obj.cls:x})")
        params_t = getattr(h, ctl.params) if ctl.params else None
        size = ctypes.sizeof(params_t) if params_t is not None else 0
        if p.paramsSize != size: raise _Status(h.NV_ERR_INVALID_PARAM_STRUCT, f"control 0x{p.cmd:x}: paramsSize {p.paramsSize}, the parameters are {size} bytes")
        params = params_t.from_buffer_copy(self._copy_in(addr, size, f"control 0x{p.cmd:x} parameters")) if params_t is not None else None
        ctl.handler(obj, params)
        if params is not None: self._copy_out(addr, bytes(params), f"control 0x{p.cmd:x} parameters")

    def _ctrl_build_version(self, obj: _Object, p: Any) -> None:
        version = abi.EMULATED_DRIVER_VERSION.encode()
        p.driverVersionBuffer = p.versionBuffer = version
        p.driverBranch = b"r" + version.split(b".")[0] + b"_00"
        p.titleBuffer = b"NVIDIA UNIX Open Kernel Module for x86_64  " + version + b"  (hcq emulated)"
        p.changelistNumber = p.officialChangelistNumber = 0

    def _ctrl_id_info(self, obj: _Object, p: Any) -> None:
        gpu = next((g for g in self._gpus if g.gpu_id == p.gpuId), None)
        if gpu is None: raise _Status(self.h.NV_ERR_INVALID_ARGUMENT, f"no GPU with id {p.gpuId:#x}")
        p.gpuFlags, p.deviceInstance, p.subDeviceInstance, p.sliStatus = 0, gpu.index, 0, 0
        p.boardId, p.gpuInstance, p.numaId = gpu.gpu_id, gpu.index, -1

    def _ctrl_classlist(self, obj: _Object, p: Any) -> None:
        classes = self.class_list()
        if p.classList:
            if p.numClasses < len(classes): raise _Status(self.h.NV_ERR_INVALID_PARAM_STRUCT, f"room for {p.numClasses} classes, there are {len(classes)}")
            self._copy_out(p.classList, bytes((ctypes.c_uint32 * len(classes))(*classes)), "the class list")
        p.numClasses = len(classes)

    def _ctrl_gid_info(self, obj: _Object, p: Any) -> None:
        h = self.h
        assert obj.gpu is not None
        uuid = obj.gpu.uuid
        if abi.get_field(h, "NV2080_GPU_CMD_GPU_GET_GID_FLAGS", "TYPE", p.flags) != h.NV2080_GPU_CMD_GPU_GET_GID_FLAGS_TYPE_SHA1:
            raise _Status(h.NV_ERR_INVALID_ARGUMENT, f"GID flags {p.flags:#x}: the GID is SHA-1")
        fmt = abi.get_field(h, "NV2080_GPU_CMD_GPU_GET_GID_FLAGS", "FORMAT", p.flags)
        if fmt == h.NV2080_GPU_CMD_GPU_GET_GID_FLAGS_FORMAT_BINARY: data = uuid
        elif fmt == h.NV2080_GPU_CMD_GPU_GET_GID_FLAGS_FORMAT_ASCII:
            x = uuid.hex()
            data = f"GPU-{x[:8]}-{x[8:12]}-{x[12:16]}-{x[16:20]}-{x[20:]}".encode() + b"\0"
        else: raise _Status(h.NV_ERR_INVALID_ARGUMENT, f"GID flags {p.flags:#x}: unknown format")
        ctypes.memmove(ctypes.addressof(p.data), data, len(data))
        p.length = len(data)

    def _ctrl_gr_info(self, obj: _Object, p: Any) -> None:
        h = self.h
        n = p.grInfoListSize
        if not 0 < n <= h.NV2080_CTRL_GR_INFO_MAX_SIZE: raise _Status(h.NV_ERR_INVALID_ARGUMENT, f"grInfoListSize {n} (1 to {h.NV2080_CTRL_GR_INFO_MAX_SIZE})")
        entries = (h.NV2080_CTRL_GR_INFO * n).from_buffer_copy(self._copy_in(p.grInfoList or 0, n * ctypes.sizeof(h.NV2080_CTRL_GR_INFO), "grInfoList"))
        values = {getattr(h, f"NV2080_CTRL_GR_INFO_INDEX_{name}"): v for name, v in GR_INFO.items()}
        for e in entries:
            if e.index >= h.NV2080_CTRL_GR_INFO_MAX_SIZE: raise _Status(h.NV_ERR_INVALID_ARGUMENT, f"GR info index {e.index}")
            e.data = values.get(e.index, 0)
        self._copy_out(p.grInfoList, bytes(entries), "grInfoList")

    def _ctrl_time(self, obj: _Object, p: Any) -> None:
        assert obj.gpu is not None
        p.time_nsec = obj.gpu.emu.time_ns()

    def _ctrl_flush(self, obj: _Object, p: Any) -> None:
        if p.addressArraySize > len(p.addressArray): raise _Status(self.h.NV_ERR_INVALID_ARGUMENT, f"addressArraySize {p.addressArraySize}")

    def _ctrl_token(self, obj: _Object, p: Any) -> None:
        h = self.h
        channel = obj.channel
        assert channel is not None
        p.workSubmitToken = channel.chid
        if channel.notifier is not None:  # (the driver also posts the token in the notifier's WORK_SUBMIT_TOKEN slot)
            self._notify(channel.notifier, h.NV_CHANNELGPFIFO_NOTIFICATION_TYPE_WORK_SUBMIT_TOKEN, channel.gpu.emu.time_ns(), channel.chid, 0, 0)

    def _ctrl_schedule(self, obj: _Object, p: Any) -> None:
        channels = [c.channel for c in obj.children.values() if c.channel is not None]
        obj.scheduled = bool(p.bEnable)
        for channel in channels:
            if obj.scheduled: self._run_channel(channel)
            else: self._stop_channel(channel)

    def _debug_target(self, obj: _Object, h_channel: int | None = None) -> _Channel:
        """The channel a debugger reports on (hTargetChannel, which must be its object's channel, when given)."""
        h = self.h
        target = obj.target
        if target is None or target.parent is None or target.parent.channel is None or target.handle not in target.client.objects:
            raise _Status(h.NV_ERR_INVALID_STATE, "the debugged object is gone")
        if h_channel is not None and h_channel != target.parent.handle:
            raise _Status(h.NV_ERR_INVALID_OBJECT_HANDLE, f"0x{h_channel:x} is not the channel of the debugged object (0x{target.parent.handle:x})")
        return target.parent.channel

    def _channel_faults(self, channel: _Channel) -> list[_Fault]:
        with self._fault_lock: return list(self._faults.get((channel.gpu.index, channel.chid), []))

    def _ctrl_sm_errors(self, obj: _Object, p: Any) -> None:
        h = self.h
        faults = self._channel_faults(self._debug_target(obj, p.hTargetChannel))
        if p.numSMsToRead > h.NV83DE_CTRL_DEBUG_MAX_SMS_PER_CALL or p.startingSM >= ENABLED_SMS:
            raise _Status(h.NV_ERR_INVALID_ARGUMENT, f"SMs {p.startingSM}..+{p.numSMsToRead} (there are {ENABLED_SMS}, at most {h.NV83DE_CTRL_DEBUG_MAX_SMS_PER_CALL} a call)")
        ctypes.memset(ctypes.addressof(p.smErrorStateArray), 0, ctypes.sizeof(p.smErrorStateArray))
        mmu = next((f for f in faults if f.mmu), None)
        p.mmuFault.valid, p.mmuFault.faultInfo = (1, mmu.fault_type) if mmu else (0, 0)
        p.mmuFaultInfo = mmu.fault_type if mmu else 0
        gr = next((f for f in faults if not f.mmu), None)
        if gr is not None and p.startingSM == 0 and p.numSMsToRead > 0:  # (the emulated GPU runs a grid on "SM 0")
            e = p.smErrorStateArray[0]
            e.hwwGlobalEsr, e.hwwWarpEsr = 0x1, 0x1  # nonzero: an error is latched (the emulator has no real ESR values)
            e.hwwEsrAddr = e.hwwWarpEsrPc64 = gr.address or 0
            e.hwwWarpEsrPc = (gr.address or 0) & 0xFFFFFFFF

    def _ctrl_mmu_faults(self, obj: _Object, p: Any) -> None:
        h = self.h
        mmu = [f for f in self._channel_faults(self._debug_target(obj)) if f.mmu][:h.NV83DE_CTRL_DEBUG_READ_MMU_FAULT_INFO_MAX_ENTRIES]
        ctypes.memset(ctypes.addressof(p), 0, ctypes.sizeof(p))
        for entry, fault in zip(p.mmuFaultInfoList, mmu):
            entry.faultAddress, entry.faultType = fault.address or 0, fault.fault_type
            entry.accessType = h.NV_PFAULT_ACCESS_TYPE_VIRT_WRITE if fault.access == "write" else h.NV_PFAULT_ACCESS_TYPE_VIRT_READ
        p.count = len(mmu)

    # ---- GPU faults
    def _fault_callback(self, gpu: _Gpu) -> Callable[[int, str, int], None]:
        def on_fault(channel_id: int, text: str, address: int | None = None) -> None:
            self._on_fault(gpu, channel_id, text, address)
        return on_fault

    def _classify(self, text: str, address: int | None) -> _Fault:
        """A fault as the driver sees it: an MMU fault (memory.GpuFault's message) or an exception in the GPU (GR)."""
        h = self.h
        m = _GPU_FAULT.search(text)
        if m is None: return _Fault(text, False, address, None, 0)
        reason = m.group(3)
        kind = h.NV_PFAULT_FAULT_TYPE_RO_VIOLATION if "read-only" in reason else \
            h.NV_PFAULT_FAULT_TYPE_PDE if "no memory is mapped" in reason else h.NV_PFAULT_FAULT_TYPE_PTE
        return _Fault(text, True, int(m.group(2), 16), m.group(1), kind)

    def _on_fault(self, gpu: _Gpu, channel_id: int, text: str, address: int | None) -> None:
        """The GPU stopped channel `channel_id`: record the fault and write the channel's error notifier (called from
        the GPU's thread; it takes only the fault lock, never the driver's, and calls nothing of the GPU but its clock)."""
        h = self.h
        fault = self._classify(text, address)
        with self._fault_lock:
            self._faults.setdefault((gpu.index, channel_id), []).append(fault)
            target = self._notifiers.get((gpu.index, channel_id))
            if target is not None:
                code = ROBUST_CHANNEL_FIFO_ERROR_MMU_ERR_FLT if fault.mmu else ROBUST_CHANNEL_GR_EXCEPTION
                self._notify(target[0], h.NV_CHANNELGPFIFO_NOTIFICATION_TYPE_ERROR, gpu.emu.time_ns(), code, target[1], RC_NOTIFIER_STATUS)
        self._say(f"GPU {gpu.index} channel {channel_id} fault: {text}")

    @staticmethod
    def _notify(notifier: _Backing, index: int, time_ns: int, info32: int, info16: int, status: int) -> None:
        """Write NvNotification `index` of a notifier (status last: it is what the client polls)."""
        base = notifier.host + index * NOTIFICATION_BYTES
        ctypes.c_uint64.from_address(base).value = time_ns & (1 << 64) - 1
        ctypes.c_uint32.from_address(base + 8).value = info32 & 0xFFFFFFFF
        ctypes.c_uint16.from_address(base + 12).value = info16 & 0xFFFF
        ctypes.c_uint16.from_address(base + 14).value = status & 0xFFFF

    # ---- UVM
    def _uvm_table(self) -> dict[int, tuple[str, Callable[[_File, Any], None], bool]]:
        h = self.h
        return {
            h.UVM_INITIALIZE: ("UVM_INITIALIZE_PARAMS", self._uvm_initialize, False),
            h.UVM_MM_INITIALIZE: ("UVM_MM_INITIALIZE_PARAMS", self._uvm_mm_initialize, False),
            h.UVM_PAGEABLE_MEM_ACCESS: ("UVM_PAGEABLE_MEM_ACCESS_PARAMS", self._uvm_pageable, True),
            h.UVM_REGISTER_GPU: ("UVM_REGISTER_GPU_PARAMS", self._uvm_register_gpu, True),
            h.UVM_UNREGISTER_GPU: ("UVM_UNREGISTER_GPU_PARAMS", self._uvm_unregister_gpu, True),
            h.UVM_REGISTER_GPU_VASPACE: ("UVM_REGISTER_GPU_VASPACE_PARAMS", self._uvm_register_vaspace, True),
            h.UVM_UNREGISTER_GPU_VASPACE: ("UVM_UNREGISTER_GPU_VASPACE_PARAMS", self._uvm_unregister_vaspace, True),
            h.UVM_ENABLE_PEER_ACCESS: ("UVM_ENABLE_PEER_ACCESS_PARAMS", self._uvm_peer(True), True),
            h.UVM_DISABLE_PEER_ACCESS: ("UVM_ENABLE_PEER_ACCESS_PARAMS", self._uvm_peer(False), True),
            h.UVM_CREATE_EXTERNAL_RANGE: ("UVM_CREATE_EXTERNAL_RANGE_PARAMS", self._uvm_create_range, True),
            h.UVM_MAP_EXTERNAL_ALLOCATION: ("UVM_MAP_EXTERNAL_ALLOCATION_PARAMS", self._uvm_map_external, True),
            h.UVM_UNMAP_EXTERNAL: ("UVM_UNMAP_EXTERNAL_PARAMS", self._uvm_unmap_external, True),
            h.UVM_FREE: ("UVM_FREE_PARAMS", self._uvm_free, True),
            h.UVM_REGISTER_CHANNEL: ("UVM_REGISTER_CHANNEL_PARAMS", self._uvm_register_channel, True),
            h.UVM_UNREGISTER_CHANNEL: ("UVM_UNREGISTER_CHANNEL_PARAMS", self._uvm_unregister_channel, True),
        }

    def _uvm_ioctl(self, f: _File, request: int, addr: int, avail: int) -> None:
        h = self.h
        if request == h.UVM_DEINITIALIZE: return
        entry = self._uvm_calls.get(request)
        if entry is None: raise _Errno(errno.EINVAL, f"unknown UVM command 0x{request:x}")
        params_t = getattr(h, entry[0])
        size = ctypes.sizeof(params_t)
        if avail < size: raise _Errno(errno.EFAULT, f"UVM command 0x{request:x}: the argument has {avail} bytes, the parameters are {size}")
        p = params_t.from_buffer_copy(ctypes.string_at(addr, size))
        try:
            if entry[2] and f.uvm_state != "va_space": raise _Status(h.NV_ERR_ILLEGAL_ACTION, "this UVM fd is not initialized (UVM_INITIALIZE first)")
            entry[1](f, p)
            p.rmStatus = h.NV_OK
        except _Status as e:
            p.rmStatus = e.code
            self._say(f"UVM 0x{request:x}: {h.nv_status_codes.get(e.code, hex(e.code))}: {e}")
        ctypes.memmove(addr, ctypes.addressof(p), size)

    def _uvm_initialize(self, f: _File, p: Any) -> None:
        h = self.h
        if f.uvm_state == "mm": raise _Status(h.NV_ERR_INVALID_ARGUMENT, "this fd is a UVM mm fd")
        if f.uvm is not None:
            if p.flags != f.uvm.flags: raise _Status(h.NV_ERR_INVALID_ARGUMENT, f"initialized before with flags {f.uvm.flags:#x}, not {p.flags:#x}")
            return
        f.uvm, f.uvm_state = _UvmSpace(p.flags), "va_space"

    def _uvm_mm_initialize(self, f: _File, p: Any) -> None:
        h = self.h
        other = self._files.get(p.uvmFd)
        if f.uvm_state != "new": raise _Status(h.NV_ERR_INVALID_ARGUMENT, "this UVM fd is already in use")
        if other is None or other.uvm_state != "va_space": raise _Status(h.NV_ERR_INVALID_ARGUMENT, f"fd {p.uvmFd} is not an initialized UVM fd")
        f.uvm_state = "mm"

    def _uvm_pageable(self, f: _File, p: Any) -> None:
        p.pageableMemAccess = 0

    def _uvm_gpu(self, space: _UvmSpace, uuid: Any, need_vaspace: bool = False) -> _Gpu:
        key = bytes(uuid.uuid)
        gpu = space.gpus.get(key)
        if gpu is None or need_vaspace and key not in space.vaspaces:
            raise _Status(self.h.NV_ERR_INVALID_DEVICE, f"GPU {key.hex()} is not registered{' with a VA space' if need_vaspace else ''} in this UVM va_space")
        return gpu

    def _uvm_register_gpu(self, f: _File, p: Any) -> None:
        h = self.h
        assert f.uvm is not None
        key = bytes(p.gpu_uuid.uuid)
        gpu = next((g for g in self._gpus if g.uuid == key), None)
        if gpu is None: raise _Status(h.NV_ERR_GPU_UUID_NOT_FOUND, f"no GPU {key.hex()}")
        if key in f.uvm.gpus: raise _Status(h.NV_ERR_INVALID_DEVICE, f"GPU {key.hex()} is registered already")
        f.uvm.gpus[key] = gpu
        p.numaEnabled, p.numaNodeId = 0, -1

    def _uvm_unregister_gpu(self, f: _File, p: Any) -> None:
        assert f.uvm is not None
        gpu = self._uvm_gpu(f.uvm, p.gpu_uuid)
        self._unmap_gpu(f.uvm, gpu)
        f.uvm.vaspaces.pop(gpu.uuid, None)
        del f.uvm.gpus[gpu.uuid]

    def _unmap_gpu(self, space: _UvmSpace, gpu: _Gpu) -> None:
        for r in space.ranges:
            for m in [m for m in r.maps if m.gpu is gpu]: self._drop_gpu_map(r, m)

    def _uvm_register_vaspace(self, f: _File, p: Any) -> None:
        h = self.h
        assert f.uvm is not None
        gpu = self._uvm_gpu(f.uvm, p.gpuUuid)
        vaspace = self._object(self._client_of_fd(p.hClient, p.rmCtrlFd), p.hVaSpace, kinds=("vaspace",))
        if vaspace.gpu is not gpu: raise _Status(h.NV_ERR_INVALID_DEVICE, f"VA space 0x{p.hVaSpace:x} is another GPU's")
        if gpu.uuid in f.uvm.vaspaces: raise _Status(h.NV_ERR_INVALID_DEVICE, "this GPU has its VA space registered already")
        f.uvm.vaspaces[gpu.uuid] = (p.hClient, p.hVaSpace)

    def _uvm_unregister_vaspace(self, f: _File, p: Any) -> None:
        assert f.uvm is not None
        gpu = self._uvm_gpu(f.uvm, p.gpuUuid, need_vaspace=True)
        self._unmap_gpu(f.uvm, gpu)
        del f.uvm.vaspaces[gpu.uuid]

    def _uvm_peer(self, enable: bool) -> Callable[[_File, Any], None]:
        def call(f: _File, p: Any) -> None:
            assert f.uvm is not None
            a, b = self._uvm_gpu(f.uvm, p.gpuUuidA), self._uvm_gpu(f.uvm, p.gpuUuidB)
            if a is b: raise _Status(self.h.NV_ERR_INVALID_DEVICE, "peer access of a GPU with itself")
            pair = frozenset((a.uuid, b.uuid))
            if enable: f.uvm.peers.add(pair)
            elif pair not in f.uvm.peers: raise _Status(self.h.NV_ERR_INVALID_DEVICE, "peer access was not enabled")
            else: f.uvm.peers.discard(pair)
        return call

    def _check_range(self, base: int, length: int) -> None:
        """uvm_api_range_invalid_4k: 4K-aligned, nonzero, no overflow (else NV_ERR_INVALID_ADDRESS)."""
        if base % 4096 or length % 4096 or not base or not length or base + length >= 1 << 64:
            raise _Status(self.h.NV_ERR_INVALID_ADDRESS, f"range [{base:#x}, +{length:#x}) is not 4K-aligned and nonempty")

    def _add_range(self, space: _UvmSpace, r: _UvmRange) -> None:
        clash = next((o for o in space.ranges if o.base < r.base + r.length and r.base < o.base + o.length), None)
        if clash is not None:
            raise _Status(self.h.NV_ERR_UVM_ADDRESS_IN_USE, f"[{r.base:#x}, +{r.length:#x}) overlaps the {clash.kind} range [{clash.base:#x}, +{clash.length:#x})")
        space.ranges.append(r)

    def _uvm_create_range(self, f: _File, p: Any) -> None:
        assert f.uvm is not None
        self._check_range(p.base, p.length)
        self._add_range(f.uvm, _UvmRange(p.base, p.length, "external"))

    def _external_range(self, space: _UvmSpace, base: int, length: int) -> _UvmRange:
        r = next((r for r in space.ranges if r.base <= base < r.base + r.length), None)
        if r is None or r.kind != "external" or base + length > r.base + r.length:
            raise _Status(self.h.NV_ERR_INVALID_ADDRESS, f"[{base:#x}, +{length:#x}) is not inside one external range (UVM_CREATE_EXTERNAL_RANGE)")
        return r

    def _uvm_map_external(self, f: _File, p: Any) -> None:
        h = self.h
        space = f.uvm
        assert space is not None
        self._check_range(p.base, p.length)
        if not 0 < p.gpuAttributesCount <= UVM_MAX_GPUS: raise _Status(h.NV_ERR_INVALID_ARGUMENT, f"gpuAttributesCount {p.gpuAttributesCount}")
        r = self._external_range(space, p.base, p.length)
        attrs = [p.perGpuAttributes[i] for i in range(p.gpuAttributesCount)]
        for a in attrs:
            if a.gpuMappingType >= UVM_MAPPING_TYPES or a.gpuCachingType >= UVM_CACHING_TYPES or a.gpuFormatType or a.gpuElementBits or a.gpuCompressionType:
                raise _Status(h.NV_ERR_INVALID_ARGUMENT, "mapping attributes: a mapping type, a caching type, default format and compression")
        gpus = [self._uvm_gpu(space, a.gpuUuid, need_vaspace=True) for a in attrs]
        memory = self._memory_object(self._client_of_fd(p.hClient, p.rmCtrlFd), p.hMemory, "UVM_MAP_EXTERNAL_ALLOCATION")
        backing = memory.backing
        assert backing is not None
        if p.offset % 4096: raise _Status(h.NV_ERR_INVALID_ADDRESS, f"offset {p.offset:#x} is not 4K-aligned")
        if p.offset + p.length > backing.size:
            raise _Status(h.NV_ERR_INVALID_LIMIT, f"[{p.offset:#x}, +{p.length:#x}) of memory 0x{p.hMemory:x} ({backing.size:#x} bytes)")
        if p.base + p.length > GPU_VA_LIMIT: raise _Status(h.NV_ERR_OUT_OF_RANGE, f"the GPU addresses {GPU_VA_LIMIT:#x} bytes of VA")
        made: list[_GpuMap] = []
        try:
            for a, gpu in zip(attrs, gpus):
                self._unmap_in(r, gpu, p.base, p.base + p.length)
                what = f"{backing.kind} memory 0x{p.hMemory:x} of client 0x{p.hClient:x}"
                made.append(self._add_gpu_map(r, _GpuMap(gpu, p.base, p.length, backing, backing.host + p.offset,
                                                         a.gpuMappingType != UVM_MAPPING_READ_ONLY, what)))
        except _Status:
            for m in made: self._drop_gpu_map(r, m)  # (only the mappings this call made go: as uvm_map_external_allocation)
            raise

    def _add_gpu_map(self, r: _UvmRange, m: _GpuMap) -> _GpuMap:
        try:
            m.gpu.space.map(m.va, m.size, m.host, m.what, writable=m.writable)
        except ValueError as e:  # (the GPU's one address space: another va_space, or the driver's USERD window, has it)
            raise _Status(self.h.NV_ERR_UVM_ADDRESS_IN_USE, str(e)) from None
        m.backing.refs += 1
        r.maps.append(m)
        return m

    def _drop_gpu_map(self, r: _UvmRange, m: _GpuMap) -> None:
        m.gpu.space.unmap(m.va)
        r.maps.remove(m)
        self._release(m.backing)

    def _unmap_in(self, r: _UvmRange, gpu: _Gpu, lo: int, hi: int) -> None:
        """Remove `gpu`'s mappings in [lo, hi) of range `r`, keeping the parts of them outside it (uvm_unmap_external_in_range)."""
        for m in [m for m in r.maps if m.gpu is gpu and m.va < hi and lo < m.va + m.size]:
            keep = [(a, b) for a, b in ((m.va, lo), (hi, m.va + m.size)) if a < b]
            m.backing.refs += 1  # (held across the cut)
            self._drop_gpu_map(r, m)
            for a, b in keep: self._add_gpu_map(r, _GpuMap(gpu, a, b - a, m.backing, m.host + (a - m.va), m.writable, m.what))
            self._release(m.backing)

    def _uvm_unmap_external(self, f: _File, p: Any) -> None:
        assert f.uvm is not None
        self._check_range(p.base, p.length)
        r = self._external_range(f.uvm, p.base, p.length)
        self._unmap_in(r, self._uvm_gpu(f.uvm, p.gpuUuid), p.base, p.base + p.length)

    def _uvm_free(self, f: _File, p: Any) -> None:
        space = f.uvm
        assert space is not None
        self._check_range(p.base, p.length)
        r = next((r for r in space.ranges if r.base == p.base and r.length == p.length and r.kind == "external"), None)
        if r is None: raise _Status(self.h.NV_ERR_INVALID_ADDRESS, f"no external range is exactly [{p.base:#x}, +{p.length:#x})")
        self._drop_range(space, r)

    def _drop_range(self, space: _UvmSpace, r: _UvmRange) -> None:
        for m in list(r.maps): self._drop_gpu_map(r, m)
        space.ranges.remove(r)
        if r.channel is not None: self._uvm_channels.pop(r.channel, None)

    def _uvm_register_channel(self, f: _File, p: Any) -> None:
        h = self.h
        space = f.uvm
        assert space is not None
        gpu = self._uvm_gpu(space, p.gpuUuid, need_vaspace=True)
        channel = self._object(self._client_of_fd(p.hClient, p.rmCtrlFd), p.hChannel, kinds=("channel",))
        if channel.gpu is not gpu: raise _Status(h.NV_ERR_INVALID_DEVICE, f"channel 0x{p.hChannel:x} is another GPU's")
        key = (p.hClient, p.hChannel)
        if key in self._uvm_channels: raise _Status(h.NV_ERR_INVALID_CHANNEL, f"channel 0x{p.hChannel:x} is registered already")
        self._check_range(p.base, p.length)
        self._add_range(space, _UvmRange(p.base, p.length, "channel", channel=key))
        self._uvm_channels[key] = space

    def _uvm_unregister_channel(self, f: _File, p: Any) -> None:
        assert f.uvm is not None
        key = (p.hClient, p.hChannel)
        r = next((r for r in f.uvm.ranges if r.channel == key), None)
        if r is None: raise _Status(self.h.NV_ERR_INVALID_CHANNEL, f"channel 0x{p.hChannel:x} is not registered")
        self._drop_range(f.uvm, r)

    def _destroy_uvm(self, space: _UvmSpace) -> None:
        for r in list(space.ranges): self._drop_range(space, r)
        space.gpus.clear()
        space.vaspaces.clear()

