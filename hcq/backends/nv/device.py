"""The NVIDIA device `NV:n`: the GPU driven through its own queues, over the kernel driver's interface (no CUDA). Memory
is resource-manager memory mapped into one GPU virtual address space through UVM (device memory, mapped to the CPU
where the runtime needs to write it, and host memory); a compute channel and a copy channel (GPFIFO) share a channel
group; kernels are sm_90 cubins launched through QMDs. With `HCQ_NV_EMULATE=1` the same code drives an emulated
GPU (hcq.backends.nv.emulator) that runs each kernel as a CPU twin compiled from the same source."""
from __future__ import annotations

import ctypes
import mmap
import os
import struct
import threading
from types import ModuleType
from typing import Any, cast

from hcq.allocator import HCQAllocator
from hcq.backends.nv import abi
from hcq.backends.nv.abi import NVDriverError
from hcq.backends.nv.channel import Channel
from hcq.backends.nv.compiler import NVCompiler, source_of
from hcq.backends.nv.cubin import CubinKernel, read_cubin
from hcq.backends.nv.driver import DriverInterface, LinuxDriver, ResourceManager
from hcq.backends.nv.kernels import CONFORMANCE_KERNELS
from hcq.backends.nv.qmd import Descriptor, qmd_prefix
from hcq.backends.nv.queues import SUBCH_COMPUTE, SUBCH_COPY, NVComputeQueue, NVCopyQueue, kernargs_layout, method_words, va
from hcq.device import HCQCompiled
from hcq.errors import CompileError, HCQError
from hcq.helpers import env_flag, getenv, round_up
from hcq.interfaces import COMPUTE, COPY, Capabilities
from hcq.kernel_source import KernelParam, find_kernels, without_directives
from hcq.memory import BufferSpec, HCQBuffer, MMIOInterface
from hcq.packets import PollCondition
from hcq.program import ArgSlot, CLikeArgsState, HCQProgram
from hcq.signal import HCQSignal, SignalReplica

PAGE = mmap.PAGESIZE
MAP_FIXED_NOREPLACE = 0x100000
GPFIFO_ENTRIES = 1024
COPY_CHANNELS = 2  # copy queues: each its own channel on a copy engine (the runtime's host copies use the first)
PUSHBUFFER_BYTES = 2 << 20
NOTIFIER_BYTES = 4096
USERMODE_BYTES = 0x10000
CHANNEL_WINDOW = 0x4000000
SHARED_WINDOW, LOCAL_WINDOW = 0x729400000000, 0x729300000000  # where kernels see shared and local memory (clear of allocations)
LOW_VA = (0x1000000000, 0x1000000000)  # (base, size): memory the CPU maps too (its CPU address is its GPU address)
HIGH_VA = (0x2000000000, 0x700000000000 - 0x2000000000)  # device memory only the GPU sees


class _VARange:
    """First-fit allocation of virtual address ranges (shared by every NV device of the process: CPU-visible GPU
    addresses are CPU addresses too, so they must not collide)."""

    def __init__(self, base: int, size: int):
        self.free: list[tuple[int, int]] = [(base, size)]
        self.lock = threading.Lock()

    def alloc(self, size: int, align: int) -> int:
        with self.lock:
            for i, (start, n) in enumerate(self.free):
                at = round_up(start, align)
                if at + size <= start + n:
                    rest = [(s, e - s) for s, e in ((start, at), (at + size, start + n)) if e > s]
                    self.free[i:i + 1] = rest
                    return at
        raise MemoryError(f"no {size} bytes of GPU virtual address space left")

    def release(self, at: int, size: int) -> None:
        with self.lock:
            self.free.append((at, size))
            self.free.sort()
            merged: list[tuple[int, int]] = []
            for s, n in self.free:
                if merged and merged[-1][0] + merged[-1][1] == s: merged[-1] = (merged[-1][0], merged[-1][1] + n)
                else: merged.append((s, n))
            self.free = merged


_low_va, _high_va = _VARange(*LOW_VA), _VARange(*HIGH_VA)


def emulated() -> bool:
    """Whether NV devices are the emulated GPU (HCQ_NV_EMULATE=1)."""
    return env_flag("HCQ_NV_EMULATE", False)


_process: dict[str, Any] = {}  # the process's driver, resource-manager client and GPU list (one per process, as CUDA keeps one)
_process_lock = threading.Lock()


def _process_state() -> tuple[DriverInterface, ResourceManager, ModuleType, list[Any]]:
    with _process_lock:
        if not _process:
            driver: DriverInterface
            if emulated():
                from hcq.backends.nv.emulator.driver import EmulatedDriver
                driver = EmulatedDriver(gpus=getenv("HCQ_NV_EMULATE_GPUS", 2, lo=1))
            else:
                driver = LinuxDriver()
            h = abi.headers(driver.driver_version())
            rm = ResourceManager(driver, h)
            try:
                build = rm.control(rm.root, h.NV0000_CTRL_CMD_SYSTEM_GET_BUILD_VERSION_V2, h.NV0000_CTRL_SYSTEM_GET_BUILD_VERSION_V2_PARAMS())
                reported = bytes(build.driverVersionBuffer).split(b"\0")[0].decode(errors="replace")
                if abi.branch_of(reported) != abi.branch_of(driver.driver_version()):
                    raise NVDriverError(f"the driver's module reports {driver.driver_version()} but its resource manager {reported}")
                rm.open_uvm()
                cards = (h.nv_ioctl_card_info_t * 64)()
                rm._ioctl(rm.ctl, h.NV_ESC_CARD_INFO, cards, "listing the GPUs")
                gpus = [c for c in cards if c.valid]
            except BaseException:
                rm.close()
                raise
            _process.update(driver=driver, rm=rm, h=h, gpus=gpus)
        return _process["driver"], _process["rm"], _process["h"], _process["gpus"]


class NVSignal(HCQSignal):
    """A signal in host memory the GPU maps: its semaphores write the value (and GPU time), the host polls it."""


class NVAllocator(HCQAllocator["NVDevice"]):
    """Resource-manager memory in the device's GPU address space. User buffers are device memory the host cannot
    see; runtime state and `cpu_access` buffers are device memory mapped to the CPU at their GPU address; `host`
    buffers are host memory the GPU maps."""

    def _alloc(self, size: int, options: BufferSpec) -> HCQBuffer:
        dev = self.dev
        with dev._memory_lock:
            if options.host: return dev.alloc_host(size)
            return dev.alloc_device(size, cpu_access=self.for_runtime or options.cpu_access)

    def _free(self, buf: HCQBuffer, options: BufferSpec) -> None:
        with self.dev._memory_lock: self.dev.free_memory(buf)

    def _map_into(self, buf: HCQBuffer) -> HCQBuffer:
        if buf.owner is not self.dev: raise HCQError(f"{self.dev.device} cannot map {buf!r}: it belongs to another GPU")
        return buf

    def _use_host(self, host_addr: int, nbytes: int) -> int | None:
        # (lent until the device closes: this hook's callers do not say when they are done; _import's mappings do)
        return None if self.dev.use_host(host_addr, nbytes) is None else host_addr

    def _export_to(self, buf: HCQBuffer, dev: Any) -> HCQBuffer | None:
        """`buf` for a device of another peer group that reaches host memory: its CPU mapping (the same address)."""
        if buf.view is None: return None
        addr = dev.allocator._use_host(buf.view.addr, buf.size)
        if addr is None: return None
        mapping = HCQBuffer(addr, buf.size, meta="host mapping of NV memory", owner=dev)
        mapping._keep = buf.view  # type: ignore[attr-defined]
        return mapping

    def _import(self, buf: HCQBuffer) -> HCQBuffer | None:
        """`buf` of another peer group, through its host view: the pages registered with the driver and mapped here."""
        if buf.view is None: return None
        holds = self.dev.use_host(buf.view.addr, buf.size)
        if holds is None: return None
        mapping = HCQBuffer(buf.view.addr, buf.size, meta="host memory mapped into the GPU", owner=self.dev)
        mapping._keep = buf.view  # type: ignore[attr-defined]
        mapping.on_release = lambda: None if self.dev.closed else self.dev.unuse_host(holds)
        return mapping


class NVArgsState(CLikeArgsState["NVProgram"]):
    """A kernargs block of an NV kernel: constant bank 0 (the driver words, then the parameters where the cubin puts
    them), and the launch's QMD after it."""

    def __init__(self, buf: HCQBuffer, prg: NVProgram, bufs: tuple[HCQBuffer, ...], vals: tuple = (), prefix: Any = None):
        if isinstance(buf.va_addr, int) and buf.va_addr % 256:
            raise ValueError(f"an NV kernargs block must start at a multiple of 256 (constant bank 0 and the QMD need it), got 0x{buf.va_addr:x}")
        super().__init__(buf, prg, bufs, vals, prefix=prg.driver_words)


class NVProgram(HCQProgram):
    """An sm_90 kernel loaded into GPU memory, with its QMD template; parameters where the cubin's info puts them."""

    def __init__(self, dev: NVDevice, name: str, lib: bytes):
        cubin = read_cubin(lib)
        if name not in cubin.kernels: raise CompileError(f"no kernel named {name!r} in the cubin; it defines: {', '.join(sorted(cubin.kernels))}")
        self.cubin, self.kernel = cubin, cubin.kernels[name]
        kernel = self.kernel
        if cubin.arch != dev.sm_arch: raise CompileError(f"{dev.device} runs sm_{dev.sm_arch} code; kernel {name!r} is sm_{cubin.arch}")
        self.arg_slots = _arg_slots(kernel, source_of(lib))
        self.args_offset = kernel.param_base
        bank, self.block_size = kernargs_layout(max(kernel.cbank0_size, kernel.param_base + kernel.param_size, 12 * 4))
        self.bank_size = bank
        self.driver_words = [0] * 6 + [SHARED_WINDOW & 0xFFFFFFFF, SHARED_WINDOW >> 32, LOCAL_WINDOW & 0xFFFFFFFF, LOCAL_WINDOW >> 32, 0xFFFDC0, 0]
        # the image: code and constant banks, in device memory
        self.image_buf: HCQBuffer = dev.allocator.alloc(round_up(len(cubin.image(0).data), PAGE) + PAGE, BufferSpec(nolru=True), internal=True)
        self.image_va = image_va = va(self.image_buf)
        image = cubin.image(image_va)
        dev.allocator.copyin(self.image_buf, memoryview(image.data))
        text_off, text_size = image.text[name]
        self.program_address = image_va + text_off
        dev.ensure_local_memory(kernel.local_bytes)
        self.qmd_prefix = qmd_prefix(dev.h, dev.compute_class)
        self.qmd_template = bytes(self._qmd(dev, image.constants, text_size).data)
        if dev.emulated_gpu is not None:
            source = source_of(lib)
            if source is not None: dev.emulated_gpu.twins.register(image.data[text_off:text_off + text_size], kernel, source)
        dev.synchronize()
        super().__init__(NVArgsState, dev, name, kernargs_alloc_size=self.block_size, lib=lib, base=self.program_address)

    def _qmd(self, dev: NVDevice, constants: dict[tuple[str | None, int], tuple[int, int]], text_size: int) -> Descriptor:
        k = self.kernel
        shared = max(0x400, round_up(k.shared_bytes, 128))  # (the section counts the 1 KiB the driver reserves per block; without one, that reserve)
        smem_config = min(c for c in (32 << 10, 64 << 10, 100 << 10, 228 << 10) if c >= shared) // 4096 + 1
        q = Descriptor(dev.h, self.qmd_prefix)
        q.set("qmd_major_version", 3).set("qmd_version", 0).set("sm_global_caching_enable", 1).set("qmd_group_id", 0x3F)
        q.set_address("program_address_lower", "program_address_upper", self.program_address)
        q.set("program_prefetch_addr_lower_shifted", (self.program_address >> 8) & 0xFFFFFFFF)
        q.set("program_prefetch_addr_upper_shifted", self.program_address >> 40)
        q.set("program_prefetch_size", min(text_size >> 8, 0x1FF)).set("sass_version", dev.sass_version)
        q.set("register_count_v", k.registers).set("shared_memory_size", shared).set("barrier_count", 1)
        q.set("shader_local_memory_high_size", dev.local_bytes_per_thread)
        q.set("min_sm_config_shared_mem_size", smem_config).set("target_sm_config_shared_mem_size", smem_config).set("max_sm_config_shared_mem_size", 0x1A)
        for flag in ("invalidate_texture_header_cache", "invalidate_texture_sampler_cache", "invalidate_texture_data_cache",
                     "invalidate_shader_data_cache", "api_visible_call_limit", "sampler_index"):
            q.set(flag, 1)
        q.set("cwd_membar_type", dev.h.NVC6C0_QMDV03_00_CWD_MEMBAR_TYPE_L1_SYSMEMBAR)
        q.set("constant_buffer_valid", 1, index=0).set("constant_buffer_size_shifted4", self.bank_size, index=0)
        q.set("constant_buffer_invalidate", 1, index=0)
        for (kernel, bank), (off, size) in constants.items():
            if bank == 0 or (kernel is not None and kernel != self.kernel.name): continue
            q.set_address("constant_buffer_addr_lower", "constant_buffer_addr_upper", self.image_va + off, index=bank)
            q.set("constant_buffer_size_shifted4", round_up(size, 16), index=bank).set("constant_buffer_valid", 1, index=bank)
        return q

    def __del__(self) -> None:
        buf = getattr(self, "image_buf", None)
        if buf is None or buf.freed: return
        try:
            self.dev.allocator.free_from_finalizer(buf, BufferSpec(nolru=True))
        except Exception:  # noqa: BLE001 - a destructor must not raise
            pass


def _arg_slots(kernel: CubinKernel, source: str | None) -> list[ArgSlot]:
    """The parameters as the core fills them: types from the kernel's source where it is known (pointers and scalar
    formats), offsets and sizes from the cubin; a cubin without source takes each parameter as bytes of its size."""
    params = sorted(kernel.params, key=lambda p: p.ordinal)
    declared = _declared(source, kernel.name) if source is not None else None
    if declared is not None and len(declared) != len(params):
        raise CompileError(f"kernel {kernel.name}: the source declares {len(declared)} parameters, the cubin {len(params)}")
    slots = []
    for i, p in enumerate(params):
        if declared is not None:
            d = declared[i]
            if struct.calcsize("=" + d.fmt) != p.size:
                raise CompileError(f"kernel {kernel.name}: parameter {d.name!r} ({d.ctype}) is {struct.calcsize('=' + d.fmt)} bytes in C "
                                   f"but {p.size} in the cubin")
            slots.append(ArgSlot(d.name, d.ctype, d.is_pointer, p.offset, d.fmt, read_only=d.is_pointer and "const" in d.decl.split("*")[0].split()))
        else:
            fmt = {1: "B", 2: "H", 4: "I", 8: "Q"}.get(p.size)
            if fmt is None: raise CompileError(f"kernel {kernel.name}: parameter {p.ordinal} is {p.size} bytes; without its source hcq cannot fill it")
            slots.append(ArgSlot(f"param{p.ordinal}", f"uint{8 * p.size}_t", False, p.offset, fmt))
    return slots


def _declared(source: str, name: str) -> list[KernelParam]:
    """The parameters HCQ_KERNEL `name` declares in `source` (the dialect's parser, as the compilers read it)."""
    kernels = find_kernels(without_directives(source))
    if name not in kernels: raise CompileError(f"no HCQ_KERNEL named {name!r} in the kernel's source; it defines: {', '.join(kernels)}")
    return kernels[name]


class NVDevice(HCQCompiled[NVSignal]):
    """`NV:n`: the n-th NVIDIA GPU (each its own peer group)."""
    CONFORMANCE_KERNELS = CONFORMANCE_KERNELS
    max_grid = (2**31 - 1, 65535, 65535)
    max_block = (1024, 1024, 64)
    max_block_threads = 1024
    def __init__(self, device: str):
        self.index = int(device.split(":")[1]) if ":" in device else 0
        self.driver, self.rm, self.h, gpus = _process_state()
        rm = self.rm
        if self.index >= len(gpus): raise HCQError(f"{device}: there are {len(gpus)} NVIDIA GPU(s) here")
        self.card = gpus[self.index]
        self._objects: list[int] = []
        self._memory: dict[int, tuple[int, int, int | None, str]] = {}  # GPU address -> (handle, size, CPU-mapping fd or None, kind)
        self._fds: list[int] = []
        self._unmaps: list[tuple[int, int]] = []  # CPU mappings that are not memory allocations (the usermode window)
        self._uvm_channels: list[tuple[int, int]] = []  # (channel handle, its UVM window) registered with UVM
        self._uvm_registered = False
        self._lent: dict[int, list[int]] = {}  # start of a lent host range -> [end, handle, holders]
        self._reservations: dict[int, tuple[int, int]] = {}  # GPU address of a guarded allocation -> (start, size) of its address range
        self._memory_lock = threading.RLock()  # allocations and frees (the core's deferred releases run on any thread)
        self.emulated_gpu: Any = None
        self._aborted: str | None = None
        self.local_bytes_per_thread, self._local_mem = 0, cast(HCQBuffer | None, None)
        try:
            self._open(device)
        except BaseException:
            self._teardown()
            raise
        caps = Capabilities(queues={COMPUTE: 1, COPY: COPY_CHANNELS}, word_bits=32,
                            poll_conditions=frozenset({PollCondition.EQ, PollCondition.GEQ, PollCondition.AND, PollCondition.NOR}), poll_mask=False,
                            recover=False, queue_states=False, host_visible_memory=False, host_copies=False, timestamps=True, packets=False)
        try:
            super().__init__(device, NVAllocator(self), NVCompiler(self.sm_name), NVProgram, NVSignal, NVComputeQueue, NVCopyQueue,
                             capabilities=caps, peer_group=device)
            self._bind_classes()
        except BaseException:
            self._teardown()
            raise

    # ---- opening
    def _open(self, device: str) -> None:
        h, rm = self.h, self.rm
        info = rm.control(rm.root, h.NV0000_CTRL_CMD_GPU_GET_ID_INFO_V2, h.NV0000_CTRL_GPU_GET_ID_INFO_V2_PARAMS(gpuId=self.card.gpu_id))
        self.minor = int(self.card.minor_number)
        self._fds.append(rm.gpu_fd(self.minor))
        self.nvdevice = rm.alloc(rm.root, h.NV01_DEVICE_0, h.NV0080_ALLOC_PARAMETERS(deviceId=info.deviceInstance, hClientShare=rm.root,
                                                                                      vaMode=h.NV_DEVICE_ALLOCATION_VAMODE_MULTIPLE_VASPACES))
        self._objects.append(self.nvdevice)
        self.subdevice = rm.alloc(self.nvdevice, h.NV20_SUBDEVICE_0, h.NV2080_ALLOC_PARAMETERS())
        classes = self._classes()
        pick = lambda names, what: next((getattr(h, n) for n in names if getattr(h, n, None) in classes), None) or \
            _refuse(f"{device}: the GPU offers no {what} class hcq drives ({', '.join(names)}); its classes: {sorted(hex(c) for c in classes)}")
        self.usermode_class = pick(("HOPPER_USERMODE_A", "TURING_USERMODE_A"), "usermode")
        self.gpfifo_class = pick(("HOPPER_CHANNEL_GPFIFO_A", "AMPERE_CHANNEL_GPFIFO_A"), "GPFIFO channel")
        self.compute_class = pick(("HOPPER_COMPUTE_A", "ADA_COMPUTE_A", "AMPERE_COMPUTE_B"), "compute")
        self.dma_class = pick(("HOPPER_DMA_COPY_A", "AMPERE_DMA_COPY_B"), "copy engine")
        # semaphore addresses: 57 bits on Hopper's host class (C86F), 40 on Ampere's (C56F)
        self.semaphore_bits = 57 if self.gpfifo_class == getattr(h, "HOPPER_CHANNEL_GPFIFO_A", None) else 40
        abi.use(h, self.semaphore_bits)
        usermode = rm.alloc(self.subdevice, self.usermode_class)
        self.usermode_addr, fd = rm.map_to_cpu(self.nvdevice, usermode, USERMODE_BYTES, None, self.minor)
        self._fds.append(fd)
        self._unmaps.append((self.usermode_addr, USERMODE_BYTES))
        self.vaspace = rm.alloc(self.nvdevice, h.FERMI_VASPACE_A, h.NV_VASPACE_ALLOCATION_PARAMETERS(
            vaBase=0x1000, vaSize=0x1FFFFFB000000, flags=h.NV_VASPACE_ALLOCATION_FLAGS_ENABLE_PAGE_FAULTING | h.NV_VASPACE_ALLOCATION_FLAGS_IS_EXTERNALLY_OWNED))
        gid = rm.control(self.subdevice, h.NV2080_CTRL_CMD_GPU_GET_GID_INFO, h.NV2080_CTRL_GPU_GET_GID_INFO_PARAMS(
            flags=h.NV2080_GPU_CMD_GPU_GET_GID_FLAGS_FORMAT_BINARY, length=16))
        self.uuid = h.struct_nv_uuid(uuid=(ctypes.c_ubyte * 16)(*gid.data[:16]))
        rm.uvm(h.UVM_REGISTER_GPU, h.UVM_REGISTER_GPU_PARAMS(rmCtrlFd=-1, gpu_uuid=self.uuid))
        self._uvm_registered = True
        rm.uvm(h.UVM_REGISTER_GPU_VASPACE, h.UVM_REGISTER_GPU_VASPACE_PARAMS(gpuUuid=self.uuid, rmCtrlFd=rm.ctl, hClient=rm.root, hVaSpace=self.vaspace))
        gr = self._gr_info("SM_VERSION", "LITTER_NUM_GPCS", "LITTER_NUM_TPC_PER_GPC", "LITTER_NUM_SM_PER_TPC", "MAX_WARPS_PER_SM")
        self.sm_version, self.num_gpcs, self.tpc_per_gpc, self.sm_per_tpc, self.max_warps_per_sm = gr
        self.sm_arch = (self.sm_version >> 8 & 0xFF) * 10 + (self.sm_version & 0xF)
        self.sm_name, self.sass_version = f"sm_{self.sm_arch}", ((self.sm_version & 0xF00) >> 4) | (self.sm_version & 0xF)
        if self.driver.__class__.__name__ == "EmulatedDriver": self.emulated_gpu = self.driver.gpu(self.minor)  # type: ignore[attr-defined]
        self._open_channels(device)

    def _classes(self) -> set[int]:
        h, rm = self.h, self.rm
        count = rm.control(self.nvdevice, h.NV0080_CTRL_CMD_GPU_GET_CLASSLIST, h.NV0080_CTRL_GPU_GET_CLASSLIST_PARAMS(numClasses=0)).numClasses
        listing = (ctypes.c_uint32 * count)()
        rm.control(self.nvdevice, h.NV0080_CTRL_CMD_GPU_GET_CLASSLIST,
                   h.NV0080_CTRL_GPU_GET_CLASSLIST_PARAMS(numClasses=count, classList=ctypes.addressof(listing)))
        return set(listing)

    def _gr_info(self, *names: str) -> list[int]:
        h = self.h
        infos = (h.NV2080_CTRL_GR_INFO * len(names))(*[h.NV2080_CTRL_GR_INFO(index=getattr(h, f"NV2080_CTRL_GR_INFO_INDEX_{n}")) for n in names])
        self.rm.control(self.subdevice, h.NV2080_CTRL_CMD_GR_GET_INFO, h.NV2080_CTRL_GR_GET_INFO_PARAMS(grInfoListSize=len(names),
                                                                                                     grInfoList=ctypes.addressof(infos)))
        return [int(i.data) for i in infos]

    def _open_channels(self, device: str) -> None:
        """The channel group and its two channels (what the core's rings submit to)."""
        h, rm = self.h, self.rm
        self.channel_group = rm.alloc(self.nvdevice, h.KEPLER_CHANNEL_GROUP_A, h.NV_CHANNEL_GROUP_ALLOCATION_PARAMETERS(engineType=h.NV2080_ENGINE_TYPE_GRAPHICS))
        ctxshare = rm.alloc(self.channel_group, h.FERMI_CONTEXT_SHARE_A, h.NV_CTXSHARE_ALLOCATION_PARAMETERS(
            hVASpace=self.vaspace, flags=h.NV_CTXSHARE_ALLOCATION_FLAGS_SUBCONTEXT_ASYNC))
        self.notifier = self.alloc_device(NOTIFIER_BYTES, cpu_access=True, system=True)
        self._channels = {COMPUTE: [self._channel(f"{device} compute channel", ctxshare, self.compute_class)],
                          COPY: [self._channel(f"{device} copy channel {i}", ctxshare, self.dma_class) for i in range(COPY_CHANNELS)]}
        rm.control(self.channel_group, h.NVA06C_CTRL_CMD_GPFIFO_SCHEDULE, h.NVA06C_CTRL_GPFIFO_SCHEDULE_PARAMS(bEnable=1))

    def _bind_classes(self) -> None:
        """Bind the compute and copy classes to their subchannels and set the shader memory windows (the first work)."""
        h = self.h
        compute = NVComputeQueue()
        compute.q(*method_words(h, SUBCH_COMPUTE, h.NVC56F_SET_OBJECT, self.compute_class))
        compute.q(*method_words(h, SUBCH_COMPUTE, h.NVC6C0_SET_SHADER_LOCAL_MEMORY_WINDOW_A, LOCAL_WINDOW >> 32, LOCAL_WINDOW & 0xFFFFFFFF))
        compute.q(*method_words(h, SUBCH_COMPUTE, h.NVC6C0_SET_SHADER_SHARED_MEMORY_WINDOW_A, SHARED_WINDOW >> 32, SHARED_WINDOW & 0xFFFFFFFF))
        self.submit_timeline(compute.signal(self.timeline_signal, self.timeline_value))
        for i in range(COPY_CHANNELS):
            copy = NVCopyQueue(i).wait(self.timeline_signal, self.timeline_value - 1)
            copy.q(*method_words(h, SUBCH_COPY, h.NVC56F_SET_OBJECT, self.dma_class))
            self.submit_timeline(copy.signal(self.timeline_signal, self.timeline_value))
        self.synchronize()

    def _channel(self, name: str, ctxshare: int, engine_class: int) -> Channel:
        h, rm = self.h, self.rm
        area = self.alloc_device(GPFIFO_ENTRIES * 8 + PAGE, cpu_access=True)  # the entries, then USERD
        handle = self._memory[va(area)][0]
        params = h.NV_CHANNELGPFIFO_ALLOCATION_PARAMETERS(gpFifoOffset=va(area), gpFifoEntries=GPFIFO_ENTRIES, hContextShare=ctxshare,
                                                          hObjectError=self._memory[va(self.notifier)][0], hObjectBuffer=handle,
                                                          hUserdMemory=(ctypes.c_uint32 * 8)(handle), userdOffset=(ctypes.c_uint64 * 8)(GPFIFO_ENTRIES * 8))
        channel = rm.alloc(self.channel_group, self.gpfifo_class, params)
        rm.alloc(channel, engine_class)
        token = rm.control(channel, h.NVC36F_CTRL_CMD_GPFIFO_GET_WORK_SUBMIT_TOKEN,
                           h.NVC36F_CTRL_CMD_GPFIFO_GET_WORK_SUBMIT_TOKEN_PARAMS(workSubmitToken=-1)).workSubmitToken
        window = _low_va.alloc(CHANNEL_WINDOW, PAGE)  # (UVM's per-channel VA window)
        try:
            rm.uvm(h.UVM_REGISTER_CHANNEL, h.UVM_REGISTER_CHANNEL_PARAMS(gpuUuid=self.uuid, rmCtrlFd=rm.ctl, hClient=rm.root, hChannel=channel,
                                                                         base=window, length=CHANNEL_WINDOW))
        except BaseException:
            _low_va.release(window, CHANNEL_WINDOW)
            raise
        self._uvm_channels.append((channel, window))
        pushbuffer = self.alloc_device(PUSHBUFFER_BYTES, cpu_access=True)
        userd = HCQBuffer(area.va_addr + GPFIFO_ENTRIES * 8, PAGE, view=area.cpu_view().view(GPFIFO_ENTRIES * 8, PAGE))
        return Channel(name, h, area, GPFIFO_ENTRIES, userd, pushbuffer, int(token),
                       lambda t: self.driver.doorbell(self.usermode_addr, t), lambda during: self.check_error(during))

    def _open_ring(self, kind: str, index: int) -> Channel:
        return self.channel(kind, index)

    def _drained(self) -> bool:
        # (every submission ends with its ring's fence: the queues drained once each fence reached its ring's count)
        return all(r.fence.load() >= r.count for rings in self.rings.values() for r in rings)

    def _failed_queues_stop(self) -> bool:
        return True  # (a faulted channel runs nothing more; the others go when closing frees their objects)

    def _abort(self, reason: str) -> None:
        self._aborted = reason  # (a GPU channel stops when its objects are freed, which closing does next)

    def channel(self, kind: str, index: int) -> Channel:
        """The channel queue `index` of `kind` submits to."""
        channels = self._channels[kind]
        if not 0 <= index < len(channels): raise HCQError(f"{self.device} has {len(channels)} {kind} queue(s); {kind} queue {index} does not exist")
        return channels[index]

    # ---- memory
    @property
    def runtime_spec(self) -> BufferSpec:
        return BufferSpec(cpu_access=True, nolru=True)

    def alloc_device(self, size: int, cpu_access: bool, system: bool = False, guarded: bool = False) -> HCQBuffer:
        """`size` bytes of device memory (or, `system`, of the GPU's uncached system memory) in the GPU's address space,
        mapped to the CPU at the same address when `cpu_access`. `guarded`: a page of address space on either side is
        left unmapped, so an access that runs off either end faults instead of reaching a neighbour."""
        h, rm = self.h, self.rm
        page = (2 << 20) if size >= (8 << 20) and not cpu_access else PAGE
        mapped = round_up(size, page)
        if guarded:
            reserved = (_low_va if cpu_access else _high_va).alloc(mapped + 2 * page, page)
            va = reserved + page
            self._reservations[va] = (reserved, mapped + 2 * page)
        else:
            va = (_low_va if cpu_access else _high_va).alloc(mapped, page)
        try:
            attr = (h.NVOS32_ATTR_PHYSICALITY_ALLOW_NONCONTIGUOUS << 27) | ((h.NVOS32_ATTR_LOCATION_PCI if system else 0) << 25) | \
                   ((h.NVOS32_ATTR_PAGE_SIZE_HUGE if page > PAGE else 0) << 23)
            attr2 = ((h.NVOS32_ATTR2_GPU_CACHEABLE_NO if system else h.NVOS32_ATTR2_GPU_CACHEABLE_YES) << 2) | h.NVOS32_ATTR2_ZBC_PREFER_NO_ZBC | \
                    ((h.NVOS32_ATTR2_PAGE_SIZE_HUGE_2MB if page > PAGE else 0) << 20)
            flags = h.NVOS32_ALLOC_FLAGS_MAP_NOT_REQUIRED | h.NVOS32_ALLOC_FLAGS_MEMORY_HANDLE_PROVIDED | h.NVOS32_ALLOC_FLAGS_ALIGNMENT_FORCE | \
                h.NVOS32_ALLOC_FLAGS_IGNORE_BANK_PLACEMENT | (0 if system else h.NVOS32_ALLOC_FLAGS_PERSISTENT_VIDMEM)
            params = h.NV_MEMORY_ALLOCATION_PARAMS(owner=rm.root, alignment=page, offset=0, limit=mapped - 1, format=6, size=mapped, attr=attr,
                                                   attr2=attr2, flags=flags, type=h.NVOS32_TYPE_NOTIFIER if system else h.NVOS32_TYPE_IMAGE)
            handle = rm.alloc(self.nvdevice, h.NV1_MEMORY_SYSTEM if system else h.NV1_MEMORY_USER, params)
        except BaseException:
            (_low_va if cpu_access else _high_va).release(*self._reservations.pop(va, (va, mapped)))
            raise
        fd = None
        kind = "mapped" if cpu_access else "device"
        try:
            if cpu_access: _, fd = rm.map_to_cpu(self.nvdevice, handle, mapped, va, self.minor, system=system)
            self._map_gpu(va, mapped, handle)
        except BaseException:
            self._release_memory(va, mapped, handle, fd, kind)
            raise
        self._memory[va] = (handle, mapped, fd, kind)
        return HCQBuffer(va, size, meta="NV device memory", view=MMIOInterface(va, size) if cpu_access else None, owner=self)

    def alloc_host(self, size: int) -> HCQBuffer:
        """`size` bytes of host memory the GPU maps at the same address."""
        mapped = round_up(size, PAGE)
        va = _low_va.alloc(mapped, PAGE)
        try:
            addr = self.driver.mmap(va, mapped, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED | mmap.MAP_ANONYMOUS | MAP_FIXED_NOREPLACE, -1, 0)
        except BaseException:
            _low_va.release(va, mapped)
            raise
        try:
            handle = self._register_host(addr, mapped)
            self._map_gpu(addr, mapped, handle)
        except BaseException:
            self.driver.munmap(addr, mapped)
            _low_va.release(va, mapped)
            raise
        self._memory[addr] = (handle, mapped, None, "host")
        return HCQBuffer(addr, size, meta="NV host memory", view=MMIOInterface(addr, size), owner=self)

    def _register_host(self, addr: int, size: int) -> int:
        """A resource-manager object for host memory at [addr, addr + size) (pages the process owns)."""
        h, rm = self.h, self.rm
        flags = (h.NVOS02_FLAGS_PHYSICALITY_NONCONTIGUOUS << 4) | (h.NVOS02_FLAGS_COHERENCY_CACHED << 12) | (h.NVOS02_FLAGS_MAPPING_NO_MAP << 30)
        made = h.nv_ioctl_nvos02_parameters_with_fd(params=h.NVOS02_PARAMETERS(hRoot=rm.root, hObjectParent=self.nvdevice, flags=flags,
                                                    hClass=h.NV01_MEMORY_SYSTEM_OS_DESCRIPTOR, pMemory=addr, limit=size - 1), fd=-1)
        rm._ioctl(self._fds[0], h.NV_ESC_RM_ALLOC_MEMORY, made, "registering host memory")
        rm._check(made.params.status, "registering host memory")
        return int(made.params.hObjectNew)

    def use_host(self, host_addr: int, nbytes: int) -> list[int] | None:
        """Map host memory of this process into the GPU at its own address: the starts of the lent page ranges it holds
        (give them back with `unuse_host`; memory of this device's own holds none), or None where it cannot be (above
        the addresses its queues reach, or refused by the driver). The driver pins the pages a range covers, so a range
        lives only while something holds it: memory unmapped and mapped anew at the same address is registered anew."""
        with self._memory_lock: return self._lend(host_addr, nbytes)

    def unuse_host(self, holds: list[int]) -> None:
        """Give back what `use_host` lent (a range goes once nothing holds it)."""
        with self._memory_lock:
            for start in holds:
                entry = self._lent[start]
                entry[2] -= 1
                if entry[2] == 0:
                    del self._lent[start]
                    handle, size, _, kind = self._memory.pop(start)
                    self._release_memory(start, size, handle, None, kind)

    def _lend(self, host_addr: int, nbytes: int) -> list[int] | None:
        start, end = host_addr - host_addr % PAGE, round_up(host_addr + nbytes, PAGE)
        if end > 1 << self.semaphore_bits: return None  # (its queues could not wait on signals there)
        for at, (_, size, _, kind) in self._memory.items():
            if kind in ("host", "mapped") and at <= start and end <= at + size: return []  # (its own memory)
        holds: list[int] = []
        cursor = start
        try:
            for at in sorted(a for a, (e, _, _) in self._lent.items() if a < end and start < e):
                if at > cursor: holds.append(self._lend_range(cursor, at))
                self._lent[at][2] += 1
                holds.append(at)
                cursor = max(cursor, self._lent[at][0])
            if cursor < end: holds.append(self._lend_range(cursor, end))
        except (NVDriverError, MemoryError):
            self.unuse_host(holds)
            return None
        return holds

    def _lend_range(self, start: int, end: int) -> int:
        """Register [start, end) (pages of this process that no range covers) and map it at its own address."""
        handle = self._register_host(start, end - start)
        try:
            self._map_gpu(start, end - start, handle)
        except BaseException:
            self.rm.free(handle, self.nvdevice)
            raise
        self._memory[start] = (handle, end - start, None, "lent")
        self._lent[start] = [end, handle, 1]
        return start

    def _map_gpu(self, va: int, size: int, handle: int) -> None:
        """Map memory object `handle` at GPU address `va` (UVM external range + the resource manager's DMA mapping)."""
        h, rm = self.h, self.rm
        rm.uvm(h.UVM_CREATE_EXTERNAL_RANGE, h.UVM_CREATE_EXTERNAL_RANGE_PARAMS(base=va, length=size))
        made = h.NVOS46_PARAMETERS(hClient=rm.root, hDevice=self.nvdevice, hDma=self.vaspace, hMemory=handle, length=size, dmaOffset=va,
                                   flags=(h.NVOS46_FLAGS_PAGE_SIZE_4KB << 8) | (h.NVOS46_FLAGS_CACHE_SNOOP_ENABLE << 4) | (h.NVOS46_FLAGS_DMA_OFFSET_FIXED_TRUE << 15))
        rm._ioctl(rm.ctl, h.NV_ESC_RM_MAP_MEMORY_DMA, made, "mapping memory into the GPU")
        rm._check(made.status, "mapping memory into the GPU")
        attrs = (h.UvmGpuMappingAttributes * 256)(h.UvmGpuMappingAttributes(gpuUuid=self.uuid, gpuMappingType=1))
        rm.uvm(h.UVM_MAP_EXTERNAL_ALLOCATION, h.UVM_MAP_EXTERNAL_ALLOCATION_PARAMS(base=va, length=size, rmCtrlFd=rm.ctl, hClient=rm.root,
                                                                                  hMemory=handle, gpuAttributesCount=1, perGpuAttributes=attrs))

    def free_memory(self, buf: HCQBuffer) -> None:
        """Give back an allocation of this device."""
        entry = self._memory.pop(va(buf), None)
        if entry is None: return
        handle, size, fd, kind = entry
        self._release_memory(va(buf), size, handle, fd, kind)

    def _release_memory(self, va: int, size: int, handle: int, fd: int | None, kind: str) -> None:
        h, rm = self.h, self.rm
        try:
            rm.uvm(h.UVM_FREE, h.UVM_FREE_PARAMS(base=va, length=size))
        except NVDriverError:
            pass  # (never mapped: a failed allocation)
        rm.free(handle, self.nvdevice)
        if kind in ("mapped", "host"): self.driver.munmap(va, size)
        if fd is not None: self.driver.close(fd)
        if kind != "lent": (_low_va if kind in ("mapped", "host") else _high_va).release(*self._reservations.pop(va, (va, size)))

    def ensure_local_memory(self, per_thread: int) -> None:
        """Give kernels at least `per_thread` bytes of local memory (stack) per thread."""
        if per_thread <= self.local_bytes_per_thread: return
        per_thread = round_up(per_thread, 32)
        per_tpc = round_up(round_up(per_thread * 32, 0x200) * self.max_warps_per_sm * self.sm_per_tpc, 0x8000)
        old = self._local_mem
        self._local_mem = self.alloc_device(round_up(per_tpc * self.tpc_per_gpc * self.num_gpcs, 0x20000), cpu_access=False)
        h = self.h
        q = NVComputeQueue().wait(self.timeline_signal, self.timeline_value - 1)
        local = va(self._local_mem)
        q.q(*method_words(h, SUBCH_COMPUTE, h.NVC6C0_SET_SHADER_LOCAL_MEMORY_A, local >> 32, local & 0xFFFFFFFF))
        q.q(*method_words(h, SUBCH_COMPUTE, h.NVC6C0_SET_SHADER_LOCAL_MEMORY_NON_THROTTLED_A, per_tpc >> 32, per_tpc & 0xFFFFFFFF, 0xFF))
        self.submit_timeline(q.signal(self.timeline_signal, self.timeline_value))
        self.synchronize()
        self.local_bytes_per_thread = per_thread
        if old is not None: self.free_memory(old)

    # ---- signals of other peer groups: their memory, mapped the other way
    def _import_signal(self, signal: HCQSignal) -> SignalReplica | None:
        return self.mapped_replica(signal, self)

    def _export_signal(self, signal: HCQSignal, waiter: HCQCompiled) -> SignalReplica | None:
        return self.mapped_replica(signal, waiter)

    # ---- failures
    def _device_error(self) -> str | None:
        if self._aborted is not None: return self._aborted
        notifier = getattr(self, "notifier", None)
        if notifier is None or notifier.view is None: return None
        h = self.h
        for index, name in ((h.NV_CHANNELGPFIFO_NOTIFICATION_TYPE_ERROR, "error"),):
            raw = notifier.view.view(index * 16, 16, "I")
            info32, status = raw[2], raw[3] >> 16
            if status or info32:
                return f"the GPU stopped a channel (error notifier: info32={info32}, status=0x{status:x}){self._fault_text()}"
        return None

    def _fault_text(self) -> str:
        gpu = self.emulated_gpu
        if gpu is None: return ""
        faults = [f for chs in self._channels.values() for ch in chs if (f := gpu.fault_of(ch.token)) is not None] if hasattr(self, "_channels") else []
        return "".join(f": {text}" for text, _ in faults)

    # ---- closing
    def _release(self, stopped: bool) -> None:
        super()._release(stopped)
        self._teardown()

    def _teardown(self) -> None:
        """Free what the device holds in the driver (its objects free their children and memory with them), and take
        the GPU out of this process's UVM state so the device opens again."""
        h, rm = self.h, self.rm
        for channel, window in self._uvm_channels:
            try:
                rm.uvm(h.UVM_UNREGISTER_CHANNEL, h.UVM_UNREGISTER_CHANNEL_PARAMS(gpuUuid=self.uuid, hClient=rm.root, hChannel=channel))
            except NVDriverError:
                pass
            _low_va.release(window, CHANNEL_WINDOW)
        self._uvm_channels.clear()
        self._lent.clear()
        for va in list(self._memory):
            handle, size, fd, kind = self._memory.pop(va)
            try:
                self._release_memory(va, size, handle, fd, kind)
            except (NVDriverError, OSError):
                pass
        if self._uvm_registered:  # (its VA space goes with it)
            try:
                rm.uvm(h.UVM_UNREGISTER_GPU, h.UVM_UNREGISTER_GPU_PARAMS(gpu_uuid=self.uuid))
            except NVDriverError:
                pass
            self._uvm_registered = False
        for obj in reversed(self._objects):
            try:
                self.rm.free(obj, self.rm.root)
            except NVDriverError:
                pass
        self._objects.clear()
        for addr, size in self._unmaps:
            try:
                self.driver.munmap(addr, size)
            except OSError:
                pass
        self._unmaps.clear()
        for fd in self._fds:
            try:
                self.driver.close(fd)
            except OSError:
                pass
        self._fds.clear()

    def load_cubin(self, cubin: bytes, name: str) -> NVProgram:
        """Load kernel `name` of a cubin built elsewhere (nvcc, ptxas, a cache): its parameters are words of the sizes
        its info gives. (`compile` takes hcq's C dialect or PTX.)"""
        if not isinstance(cubin, (bytes, bytearray, memoryview)) or not isinstance(name, str): raise TypeError("load_cubin(cubin: bytes, name: str)")
        self.check_open()
        return NVProgram(self, name, bytes(cubin))

    @classmethod
    def precompile(cls, source: str) -> None:
        NVCompiler("sm_90").compile(source)

    def describe(self) -> list[str]:
        return super().describe() + [f"NVIDIA GPU {self.sm_name} ({self.num_gpcs} GPCs x {self.tpc_per_gpc} TPCs x {self.sm_per_tpc} SMs), "
                                     f"driver {self.driver.driver_version()}{' (emulated)' if self.emulated_gpu is not None else ''}"]


def _refuse(message: str) -> Any:
    raise HCQError(message)


DEVICE_CLASS = NVDevice
