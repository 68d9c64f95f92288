"""The emulated NVIDIA driver model (hcq.backends.nv.emulator.driver), driven as a client drives the real one: device
files, resource-manager objects and controls, memory and its CPU / GPU mappings, UVM, channels and their doorbell, and
each refusal the driver makes. The GPU behind it is a small fake with EmulatedGpu's methods, so these tests depend on the
driver model only."""
import ctypes
import errno
import mmap
import os

import pytest

abi = pytest.importorskip("hcq.backends.nv.abi")
if abi.unavailable_reason(): pytest.skip(abi.unavailable_reason(), allow_module_level=True)

from hcq.backends.nv.emulator.driver import EmulatedDriver  # noqa: E402
from hcq.backends.nv.emulator.memory import AddressSpace  # noqa: E402

h = abi.headers()
PAGE = mmap.PAGESIZE
RW = mmap.PROT_READ | mmap.PROT_WRITE
GPU_BASE = 0x10_0000_0000  # where these tests put GPU mappings the CPU does not see
MAP_FIXED = 0x10
RESERVED = 256 << 20  # the process VA a session reserves for memory mapped at the same address in the CPU and the GPU


class FakeGpu:
    """EmulatedGpu's interface, recording what the driver asks of it."""

    def __init__(self, space, headers, seed=0, on_fault=None):
        self.space, self.on_fault, self.seed = space, on_fault, seed
        self.channels, self.kicks, self.removed, self.closed = {}, [], [], False

    def add_channel(self, channel_id, gpfifo_va, entries, userd_va, classes):
        assert channel_id not in self.channels
        self.channels[channel_id] = (gpfifo_va, entries, userd_va, frozenset(classes))

    def remove_channel(self, channel_id):
        del self.channels[channel_id]
        self.removed.append(channel_id)

    def kick(self, channel_id):
        assert channel_id in self.channels
        self.kicks.append(channel_id)

    def time_ns(self):
        return 123_456_789

    def fault_of(self, channel_id):
        return None

    def close(self):
        self.closed = True


def ioc(nr, size, kind=ord("F"), direction=3):
    return (direction << 30) | (size << 16) | (kind << 8) | nr


class Client:
    """A client of the emulated driver, doing what the NV backend does (and letting a test do it wrongly)."""

    def __init__(self, driver):
        self.d = driver
        self.cpu_mapped = []  # (address, size, fd) of each CPU mapping made
        self.ctl = driver.open("/dev/nvidiactl", os.O_RDWR)
        made = self.alloc_raw(0, h.NV01_ROOT_CLIENT, root=0)
        assert made.status == 0
        self.root = made.hObjectNew

    def nv(self, fd, nr, arg):
        return self.d.ioctl(fd, ioc(nr, ctypes.sizeof(arg)), arg)

    def alloc_raw(self, parent, cls, params=None, root=None, handle=0, params_size=None):
        made = h.NVOS21_PARAMETERS(hRoot=self.root if root is None else root, hObjectParent=parent, hObjectNew=handle, hClass=cls,
                                   pAllocParms=ctypes.addressof(params) if params is not None else 0,
                                   paramsSize=(ctypes.sizeof(params) if params is not None else 0) if params_size is None else params_size)
        assert self.nv(self.ctl, h.NV_ESC_RM_ALLOC, made) == 0
        return made

    def alloc(self, parent, cls, params=None, **kw):
        made = self.alloc_raw(parent, cls, params, **kw)
        assert made.status == 0, h.nv_status_codes.get(made.status, made.status)
        return made.hObjectNew

    def control_status(self, obj, cmd, params=None, size=None, pointer=None):
        made = h.NVOS54_PARAMETERS(hClient=self.root, hObject=obj, cmd=cmd,
                                   params=(ctypes.addressof(params) if params is not None else 0) if pointer is None else pointer,
                                   paramsSize=(ctypes.sizeof(params) if params is not None else 0) if size is None else size)
        assert self.nv(self.ctl, h.NV_ESC_RM_CONTROL, made) == 0
        return made.status

    def control(self, obj, cmd, params=None):
        status = self.control_status(obj, cmd, params)
        assert status == 0, h.nv_status_codes.get(status, status)
        return params

    def free_status(self, obj, parent=0):
        made = h.NVOS00_PARAMETERS(hRoot=self.root, hObjectParent=parent, hObjectOld=obj)
        assert self.nv(self.ctl, h.NV_ESC_RM_FREE, made) == 0
        return made.status

    def uvm_status(self, fd, cmd, params):
        assert self.d.ioctl(fd, cmd, params) == 0
        return params.rmStatus

    def uvm(self, fd, cmd, params):
        status = self.uvm_status(fd, cmd, params)
        assert status == 0, h.nv_status_codes.get(status, status)
        return params

    def map_memory_status(self, device, memory, size, fd, offset=0):
        made = h.nv_ioctl_nvos33_parameters_with_fd(fd=fd, params=h.NVOS33_PARAMETERS(hClient=self.root, hDevice=device, hMemory=memory,
                                                                                      offset=offset, length=size))
        assert self.nv(self.ctl, h.NV_ESC_RM_MAP_MEMORY, made) == 0
        return made.params.status


class Session(Client):
    """A client that has opened GPU 0 as the backend does: device, subdevice, usermode mapping, VA space, UVM."""

    def __init__(self, driver):
        super().__init__(driver)
        d = driver
        self.uvm_fd = d.open("/dev/nvidia-uvm", os.O_RDWR)
        self.uvm(self.uvm_fd, h.UVM_INITIALIZE, h.UVM_INITIALIZE_PARAMS())
        self.uvm_mm = d.open("/dev/nvidia-uvm", os.O_RDWR)
        self.uvm(self.uvm_mm, h.UVM_MM_INITIALIZE, h.UVM_MM_INITIALIZE_PARAMS(uvmFd=self.uvm_fd))
        cards = (h.nv_ioctl_card_info_t * 64)()
        assert self.nv(self.ctl, h.NV_ESC_CARD_INFO, cards) == 0
        self.card = cards[0]
        info = self.control(self.root, h.NV0000_CTRL_CMD_GPU_GET_ID_INFO_V2, h.NV0000_CTRL_GPU_GET_ID_INFO_V2_PARAMS(gpuId=self.card.gpu_id))
        self.gpu_fd = self.gpu_file()
        self.device = self.alloc(self.root, h.NV01_DEVICE_0, h.NV0080_ALLOC_PARAMETERS(deviceId=info.deviceInstance, hClientShare=self.root))
        self.subdevice = self.alloc(self.device, h.NV20_SUBDEVICE_0, h.NV2080_ALLOC_PARAMETERS())
        self.usermode = self.alloc(self.subdevice, h.HOPPER_USERMODE_A)
        self.usermode_addr, self.usermode_fd = self.map_to_cpu(self.usermode, 0x10000, None)
        self.vaspace = self.alloc(self.device, h.FERMI_VASPACE_A, h.NV_VASPACE_ALLOCATION_PARAMETERS(
            vaBase=0x1000, vaSize=0x1FFFFFB000000, flags=h.NV_VASPACE_ALLOCATION_FLAGS_ENABLE_PAGE_FAULTING | h.NV_VASPACE_ALLOCATION_FLAGS_IS_EXTERNALLY_OWNED))
        gid = self.control(self.subdevice, h.NV2080_CTRL_CMD_GPU_GET_GID_INFO, h.NV2080_CTRL_GPU_GET_GID_INFO_PARAMS(
            flags=h.NV2080_GPU_CMD_GPU_GET_GID_FLAGS_FORMAT_BINARY, length=16))
        self.uuid = h.struct_nv_uuid(uuid=(ctypes.c_ubyte * 16)(*gid.data[:16]))
        self.uvm(self.uvm_fd, h.UVM_REGISTER_GPU, h.UVM_REGISTER_GPU_PARAMS(rmCtrlFd=-1, gpu_uuid=self.uuid))
        self.uvm(self.uvm_fd, h.UVM_REGISTER_GPU_VASPACE, h.UVM_REGISTER_GPU_VASPACE_PARAMS(gpuUuid=self.uuid, rmCtrlFd=self.ctl, hClient=self.root,
                                                                                            hVaSpace=self.vaspace))
        self.reserved = driver.mmap(None, RESERVED, 0, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
        self.next_va = self.reserved

    def release(self):
        """Unmap what the session mapped and give back its reserved process VA."""
        for addr, size, _ in self.cpu_mapped: self.d.munmap(addr, size)
        self.d.munmap(self.reserved, RESERVED)

    def gpu_file(self):
        fd = self.d.open("/dev/nvidia0", os.O_RDWR)
        assert self.nv(fd, h.NV_ESC_REGISTER_FD, h.nv_ioctl_register_fd_t(ctl_fd=self.ctl)) == 0
        return fd

    def map_to_cpu(self, memory, size, target, system=False):
        fd = self.d.open("/dev/nvidiactl", os.O_RDWR) if system else self.gpu_file()
        assert self.map_memory_status(self.device, memory, size, fd) == 0
        addr = self.d.mmap(target, size, RW, mmap.MAP_SHARED | (MAP_FIXED if target else 0), fd, 0)
        self.cpu_mapped.append((addr, size, fd))
        return addr, fd

    def alloc_memory(self, size, system=False, cpu=True):
        """Memory mapped in the GPU at a fresh VA (and to the CPU there, `cpu`): (va, handle, fd)."""
        size = -(-size // PAGE) * PAGE
        va, self.next_va = self.next_va, self.next_va + size + PAGE
        assert self.next_va <= self.reserved + RESERVED
        params = h.NV_MEMORY_ALLOCATION_PARAMS(owner=self.root, size=size, alignment=PAGE, type=h.NVOS32_TYPE_IMAGE)
        handle = self.alloc(self.device, h.NV1_MEMORY_SYSTEM if system else h.NV1_MEMORY_USER, params)
        fd = None
        if cpu: _, fd = self.map_to_cpu(handle, size, va, system)
        self.gpu_map(va, size, handle)
        return va, handle, fd

    def gpu_map(self, va, size, handle):
        self.uvm(self.uvm_fd, h.UVM_CREATE_EXTERNAL_RANGE, h.UVM_CREATE_EXTERNAL_RANGE_PARAMS(base=va, length=size))
        made = h.NVOS46_PARAMETERS(hClient=self.root, hDevice=self.device, hDma=self.vaspace, hMemory=handle, length=size, dmaOffset=va,
                                   flags=(h.NVOS46_FLAGS_PAGE_SIZE_4KB << 8) | (h.NVOS46_FLAGS_DMA_OFFSET_FIXED_TRUE << 15))
        assert self.nv(self.ctl, h.NV_ESC_RM_MAP_MEMORY_DMA, made) == 0 and made.status == 0 and made.dmaOffset == va
        self.uvm(self.uvm_fd, h.UVM_MAP_EXTERNAL_ALLOCATION, self.map_params(va, size, handle))

    def map_params(self, va, size, handle, uuid=None, mapping_type=1):
        attrs = (h.UvmGpuMappingAttributes * 256)(h.UvmGpuMappingAttributes(gpuUuid=uuid or self.uuid, gpuMappingType=mapping_type))
        return h.UVM_MAP_EXTERNAL_ALLOCATION_PARAMS(base=va, length=size, rmCtrlFd=self.ctl, hClient=self.root, hMemory=handle,
                                                    gpuAttributesCount=1, perGpuAttributes=attrs)

    def free_memory(self, va, size, handle, fd, cpu=True):
        self.uvm(self.uvm_fd, h.UVM_FREE, h.UVM_FREE_PARAMS(base=va, length=size))
        assert self.free_status(handle, self.device) == 0
        if cpu: self.d.munmap(va, size)
        if fd is not None: self.d.close(fd)

    def channels(self, entries=1024):
        """A channel group with a compute and a copy channel (each GPFIFO + USERD in one allocation), a notifier, a context share."""
        group = self.alloc(self.device, h.KEPLER_CHANNEL_GROUP_A, h.NV_CHANNEL_GROUP_ALLOCATION_PARAMETERS(engineType=h.NV2080_ENGINE_TYPE_GRAPHICS))
        ctxshare = self.alloc(group, h.FERMI_CONTEXT_SHARE_A, h.NV_CTXSHARE_ALLOCATION_PARAMETERS(hVASpace=self.vaspace,
                                                                                                  flags=h.NV_CTXSHARE_ALLOCATION_FLAGS_SUBCONTEXT_ASYNC))
        self.notifier_va, self.notifier, _ = self.alloc_memory(PAGE, system=True)
        made = []
        for engine in (h.HOPPER_COMPUTE_A, h.HOPPER_DMA_COPY_A):
            area_va, area, _ = self.alloc_memory(entries * 8 + PAGE)
            channel = self.alloc(group, h.HOPPER_CHANNEL_GPFIFO_A, self.gpfifo_params(area_va, area, entries, ctxshare))
            self.alloc(channel, engine)
            token = self.control(channel, h.NVC36F_CTRL_CMD_GPFIFO_GET_WORK_SUBMIT_TOKEN,
                                 h.NVC36F_CTRL_CMD_GPFIFO_GET_WORK_SUBMIT_TOKEN_PARAMS(workSubmitToken=-1)).workSubmitToken
            made.append((channel, token, area_va))
        return group, ctxshare, made

    def gpfifo_params(self, area_va, area, entries, ctxshare, **kw):
        fields = dict(gpFifoOffset=area_va, gpFifoEntries=entries, hContextShare=ctxshare, hObjectError=self.notifier, hObjectBuffer=area,
                      hUserdMemory=(ctypes.c_uint32 * 8)(area), userdOffset=(ctypes.c_uint64 * 8)(entries * 8))
        fields.update(kw)
        return h.NV_CHANNELGPFIFO_ALLOCATION_PARAMETERS(**fields)


@pytest.fixture
def driver():
    d = EmulatedDriver(gpus=1, device_memory_bytes=64 << 20, gpu_factory=FakeGpu)
    yield d
    d.close()


@pytest.fixture
def session(driver):
    s = Session(driver)
    yield s
    s.release()


def test_bring_up_a_gpu_and_its_channels_as_a_client_does(driver, session):
    s, fake = session, driver.gpu(0)
    assert isinstance(fake, FakeGpu) and isinstance(fake.space, AddressSpace)
    build = s.control(s.root, h.NV0000_CTRL_CMD_SYSTEM_GET_BUILD_VERSION_V2, h.NV0000_CTRL_SYSTEM_GET_BUILD_VERSION_V2_PARAMS())
    assert bytes(build.driverVersionBuffer).split(b"\0")[0].decode() == abi.EMULATED_DRIVER_VERSION == driver.driver_version()
    assert s.card.valid and s.card.pci_info.vendor_id == 0x10DE and s.card.minor_number == 0
    count = s.control(s.device, h.NV0080_CTRL_CMD_GPU_GET_CLASSLIST, h.NV0080_CTRL_GPU_GET_CLASSLIST_PARAMS(numClasses=0)).numClasses
    listing = (ctypes.c_uint32 * count)()
    s.control(s.device, h.NV0080_CTRL_CMD_GPU_GET_CLASSLIST, h.NV0080_CTRL_GPU_GET_CLASSLIST_PARAMS(numClasses=count, classList=ctypes.addressof(listing)))
    assert {h.HOPPER_USERMODE_A, h.HOPPER_CHANNEL_GPFIFO_A, h.HOPPER_COMPUTE_A, h.HOPPER_DMA_COPY_A, h.FERMI_VASPACE_A} <= set(listing)
    names = ("SM_VERSION", "LITTER_NUM_GPCS", "LITTER_NUM_TPC_PER_GPC", "LITTER_NUM_SM_PER_TPC", "MAX_WARPS_PER_SM")
    infos = (h.NV2080_CTRL_GR_INFO * 5)(*[h.NV2080_CTRL_GR_INFO(index=getattr(h, f"NV2080_CTRL_GR_INFO_INDEX_{n}")) for n in names])
    s.control(s.subdevice, h.NV2080_CTRL_CMD_GR_GET_INFO, h.NV2080_CTRL_GR_GET_INFO_PARAMS(grInfoListSize=5, grInfoList=ctypes.addressof(infos)))
    assert [i.data for i in infos][0] == 0x900 and all(i.data for i in infos)
    assert s.control(s.subdevice, h.NV2080_CTRL_CMD_TIMER_GET_TIME, h.NV2080_CTRL_TIMER_GET_TIME_PARAMS()).time_nsec == 123_456_789
    s.control(s.subdevice, h.NV2080_CTRL_CMD_PERF_BOOST, h.NV2080_CTRL_PERF_BOOST_PARAMS(duration=0xFFFFFFFF))
    s.control(s.subdevice, h.NV2080_CTRL_CMD_FB_FLUSH_GPU_CACHE, h.NV2080_CTRL_FB_FLUSH_GPU_CACHE_PARAMS())
    ascii_gid = s.control(s.subdevice, h.NV2080_CTRL_CMD_GPU_GET_GID_INFO, h.NV2080_CTRL_GPU_GET_GID_INFO_PARAMS(flags=h.NV2080_GPU_CMD_GPU_GET_GID_FLAGS_FORMAT_ASCII))
    assert bytes(ascii_gid.data[:4]) == b"GPU-" and bytes(ascii_gid.data[4:12]).decode() == bytes(s.uuid.uuid).hex()[:8]

    group, _, made = s.channels()
    (compute, token, area_va), (copy, copy_token, _) = made
    assert token != copy_token and not fake.channels  # (not on the GPU before the group is scheduled)
    s.uvm(s.uvm_fd, h.UVM_REGISTER_CHANNEL, h.UVM_REGISTER_CHANNEL_PARAMS(gpuUuid=s.uuid, rmCtrlFd=s.ctl, hClient=s.root, hChannel=compute,
                                                                         base=0x20_0000_0000, length=0x4000000))
    s.control(group, h.NVA06C_CTRL_CMD_GPFIFO_SCHEDULE, h.NVA06C_CTRL_GPFIFO_SCHEDULE_PARAMS(bEnable=1))
    gpfifo_va, entries, userd_va, classes = fake.channels[token]
    assert (gpfifo_va, entries) == (area_va, 1024) and classes == {h.HOPPER_CHANNEL_GPFIFO_A, h.HOPPER_COMPUTE_A}
    assert fake.channels[copy_token][3] == {h.HOPPER_CHANNEL_GPFIFO_A, h.HOPPER_DMA_COPY_A}
    # the GPU reads the USERD the CPU writes (GPPut), and the GPFIFO ring through the GPU's address space
    ctypes.c_uint32.from_address(area_va + 1024 * 8 + h.HopperAControlGPFifo.GPPut.offset).value = 7
    assert fake.space.load32(userd_va + h.HopperAControlGPFifo.GPPut.offset) == 7
    ctypes.c_uint64.from_address(area_va + 8).value = 0x1234_5678
    assert fake.space.load64(gpfifo_va + 8) == 0x1234_5678
    driver.doorbell(s.usermode_addr, token)
    assert fake.kicks == [token] and ctypes.c_uint32.from_address(s.usermode_addr + 0x90).value == token
    driver.doorbell(s.usermode_addr, 999)  # (an unknown token: ignored, as the hardware does)
    assert fake.kicks == [token] and driver.stray_doorbells == 1
    with pytest.raises(ValueError, match="usermode"):
        driver.doorbell(s.usermode_addr + PAGE, token)
    # the notifier got the work submit token in its slot, as the driver posts it
    slot = s.notifier_va + h.NV_CHANNELGPFIFO_NOTIFICATION_TYPE_WORK_SUBMIT_TOKEN * 16
    assert ctypes.c_uint32.from_address(slot + 8).value == copy_token

    assert s.free_status(compute) == 0
    assert fake.removed == [token] and token not in fake.channels
    assert s.free_status(s.root) == 0
    assert fake.channels == {} and driver.stats()["clients"] == 0


def test_memory_is_mapped_to_the_cpu_and_the_gpu_and_freed(driver, session):
    s, space = session, driver.gpu(0).space
    before = driver.stats()
    va, handle, fd = s.alloc_memory(2 * PAGE)
    assert driver.stats()["device_bytes"] == before["device_bytes"] + 2 * PAGE
    ctypes.memmove(va, b"from the cpu", 12)
    assert space.read(va, 12) == b"from the cpu"
    space.write(va + PAGE, b"from the gpu")
    assert ctypes.string_at(va + PAGE, 12) == b"from the gpu"
    # system memory goes through a control fd
    sys_va, sys_handle, sys_fd = s.alloc_memory(PAGE, system=True)
    assert driver.stats()["system_bytes"] == before["system_bytes"] + PAGE
    # the resource manager frees the handle, UVM's mapping keeps the memory until UVM_FREE
    assert s.free_status(handle, s.device) == 0
    assert space.read(va, 12) == b"from the cpu"
    s.uvm(s.uvm_fd, h.UVM_FREE, h.UVM_FREE_PARAMS(base=va, length=2 * PAGE))
    assert space.find(va) is None and driver.stats()["device_bytes"] == before["device_bytes"] + 2 * PAGE  # (the CPU mapping holds it)
    driver.munmap(va, 2 * PAGE)
    driver.close(fd)
    s.free_memory(sys_va, PAGE, sys_handle, sys_fd)
    after = driver.stats()
    assert after["device_bytes"] == before["device_bytes"] and after["system_bytes"] == before["system_bytes"]
    assert after["cpu_mappings"] == before["cpu_mappings"] and after["gpu_mappings"] == before["gpu_mappings"]


def test_host_memory_is_wrapped_where_it_is(driver, session):
    s, space = session, driver.gpu(0).space
    size = 2 * PAGE
    addr = driver.mmap(None, size, RW, mmap.MAP_SHARED | mmap.MAP_ANONYMOUS, -1, 0)
    flags = (h.NVOS02_FLAGS_PHYSICALITY_NONCONTIGUOUS << 4) | (h.NVOS02_FLAGS_COHERENCY_CACHED << 12) | (h.NVOS02_FLAGS_MAPPING_NO_MAP << 30)

    def register(pointer, on=None, handle=0x1001, fl=flags):
        made = h.nv_ioctl_nvos02_parameters_with_fd(params=h.NVOS02_PARAMETERS(hRoot=s.root, hObjectParent=s.device, flags=fl, hObjectNew=handle,
                                                    hClass=h.NV01_MEMORY_SYSTEM_OS_DESCRIPTOR, pMemory=pointer, limit=size - 1), fd=-1)
        rc = s.nv(s.gpu_fd if on is None else on, h.NV_ESC_RM_ALLOC_MEMORY, made)
        return rc, made.params.status, made.params.hObjectNew

    assert register(addr, on=s.ctl)[0] == -errno.EINVAL  # (a /dev/nvidiaN escape)
    assert register(addr + 8)[1] == h.NV_ERR_NOT_SUPPORTED  # not page-aligned
    assert register(0x10000)[1] == h.NV_ERR_INVALID_ADDRESS  # not the process's memory
    assert register(addr, fl=flags & ~(3 << 30))[1] == h.NV_ERR_INVALID_FLAGS  # (mapping must be NO_MAP)
    rc, status, handle = register(addr)
    assert (rc, status, handle) == (0, 0, 0x1001)
    assert register(addr)[1] == h.NV_ERR_INSERT_DUPLICATE_NAME
    assert driver.stats()["host_bytes"] == size
    va = addr  # (host memory is mapped in the GPU at its own address)
    s.uvm(s.uvm_fd, h.UVM_CREATE_EXTERNAL_RANGE, h.UVM_CREATE_EXTERNAL_RANGE_PARAMS(base=va, length=size))
    s.uvm(s.uvm_fd, h.UVM_MAP_EXTERNAL_ALLOCATION, s.map_params(va, size, handle))
    space.write(va + 16, b"gpu wrote")
    assert ctypes.string_at(addr + 16, 9) == b"gpu wrote"
    driver.munmap(addr, size)  # (the process lets go of its pages: the driver pinned them)
    space.write(va, b"still there")
    s.free_memory(va, size, handle, None, cpu=False)
    assert driver.stats()["host_bytes"] == 0


def test_ioctl_level_refusals(driver, session):
    s = session
    made = h.NVOS21_PARAMETERS(hRoot=s.root, hObjectParent=s.root, hClass=h.NV01_DEVICE_0)
    assert driver.ioctl(s.ctl, ioc(h.NV_ESC_RM_ALLOC, 24), made) == -errno.EINVAL  # wrong structure size
    assert driver.ioctl(s.ctl, ioc(0x7F, 32), made) == -errno.EINVAL  # unknown escape
    assert driver.ioctl(s.ctl, ioc(h.NV_ESC_RM_ALLOC, 32, kind=ord("G")), made) == -errno.EINVAL  # not an NVIDIA ioctl
    assert driver.ioctl(s.ctl, ioc(h.NV_ESC_RM_ALLOC, 48), made) == -errno.EFAULT  # NVOS64's size, but a 32-byte argument
    assert driver.ioctl(s.gpu_fd, ioc(h.NV_ESC_RM_ALLOC, 32), made) == -errno.EINVAL  # a /dev/nvidiactl escape
    assert driver.ioctl(12345, ioc(h.NV_ESC_RM_ALLOC, 32), made) == -errno.EBADF
    assert driver.ioctl(s.ctl, ioc(h.NV_ESC_CARD_INFO, 100), (ctypes.c_char * 100)()) == -errno.EINVAL  # not a whole number of cards
    assert driver.ioctl(s.gpu_fd, ioc(h.NV_ESC_REGISTER_FD, 4), h.nv_ioctl_register_fd_t(ctl_fd=s.ctl)) == -errno.EINVAL  # registered already
    other = driver.open("/dev/nvidia0", os.O_RDWR)
    assert driver.ioctl(other, ioc(h.NV_ESC_REGISTER_FD, 4), h.nv_ioctl_register_fd_t(ctl_fd=other)) == -errno.EINVAL  # not a control fd
    driver.close(other)
    fresh = driver.open("/dev/nvidia-uvm", os.O_RDWR)
    params = h.UVM_CREATE_EXTERNAL_RANGE_PARAMS(base=GPU_BASE, length=PAGE)
    assert driver.ioctl(fresh, h.UVM_CREATE_EXTERNAL_RANGE, params) == 0 and params.rmStatus == h.NV_ERR_ILLEGAL_ACTION  # not initialized
    assert driver.ioctl(fresh, 0x7777, params) == -errno.EINVAL  # unknown UVM command
    assert driver.ioctl(fresh, h.UVM_FREE, h.UVM_CREATE_EXTERNAL_RANGE_PARAMS()) == 0  # (same size: fine)
    assert driver.ioctl(fresh, h.UVM_REGISTER_GPU, params) == -errno.EFAULT  # 24 bytes for a 40-byte structure
    driver.close(fresh)
    with pytest.raises(OSError) as e:
        driver.close(fresh)
    assert e.value.errno == errno.EBADF


def test_resource_manager_refusals(driver, session):
    s = session
    assert s.alloc_raw(s.root, 0xBEEF).status == h.NV_ERR_INVALID_CLASS
    assert s.alloc_raw(s.root, h.NV01_DEVICE_0, root=0x1234).status == h.NV_ERR_INVALID_CLIENT
    assert s.alloc_raw(0x1234, h.NV20_SUBDEVICE_0).status == h.NV_ERR_INVALID_OBJECT_PARENT  # no such parent
    assert s.alloc_raw(s.root, h.NV20_SUBDEVICE_0).status == h.NV_ERR_INVALID_OBJECT_PARENT  # a subdevice goes under a device
    assert s.alloc_raw(s.device, h.HOPPER_COMPUTE_A).status == h.NV_ERR_INVALID_OBJECT_PARENT  # ... an engine under a channel
    assert s.alloc_raw(s.device, h.NV1_MEMORY_USER).status == h.NV_ERR_INVALID_ARGUMENT  # parameters required
    params = h.NV_MEMORY_ALLOCATION_PARAMS(owner=s.root, size=PAGE)
    assert s.alloc_raw(s.device, h.NV1_MEMORY_USER, params, params_size=8).status == h.NV_ERR_INVALID_PARAM_STRUCT
    assert s.alloc_raw(s.device, h.NV1_MEMORY_USER, h.NV_MEMORY_ALLOCATION_PARAMS(owner=s.root)).status == h.NV_ERR_INVALID_ARGUMENT  # 0 bytes
    made = h.NVOS21_PARAMETERS(hRoot=s.root, hObjectParent=s.device, hClass=h.NV1_MEMORY_USER, pAllocParms=0x10, paramsSize=0)
    assert s.nv(s.ctl, h.NV_ESC_RM_ALLOC, made) == 0 and made.status == h.NV_ERR_INVALID_ADDRESS  # a pointer to nothing
    handle = s.alloc(s.device, h.NV1_MEMORY_USER, params, handle=0x5000)
    assert s.alloc_raw(s.device, h.NV1_MEMORY_USER, params, handle=0x5000).status == h.NV_ERR_INSERT_DUPLICATE_NAME
    assert s.alloc_raw(s.root, h.NV01_DEVICE_0, h.NV0080_ALLOC_PARAMETERS()).status == h.NV_ERR_STATE_IN_USE  # one device per GPU
    assert s.alloc_raw(s.root, h.NV01_DEVICE_0, h.NV0080_ALLOC_PARAMETERS(deviceId=3)).status == h.NV_ERR_INVALID_ARGUMENT  # no GPU 3

    timer = h.NV2080_CTRL_TIMER_GET_TIME_PARAMS()
    assert s.control_status(0x4321, h.NV2080_CTRL_CMD_TIMER_GET_TIME, timer) == h.NV_ERR_INVALID_OBJECT_HANDLE
    assert s.control_status(s.device, h.NV2080_CTRL_CMD_TIMER_GET_TIME, timer) == h.NV_ERR_NOT_SUPPORTED  # a subdevice's control
    assert s.control_status(s.subdevice, 0x20801234, timer) == h.NV_ERR_NOT_SUPPORTED  # one the driver does not answer
    assert s.control_status(s.subdevice, h.NV2080_CTRL_CMD_TIMER_GET_TIME, timer, size=4) == h.NV_ERR_INVALID_PARAM_STRUCT
    assert s.control_status(s.subdevice, h.NV2080_CTRL_CMD_TIMER_GET_TIME, None, size=8) == h.NV_ERR_INVALID_ARGUMENT  # NULL, 8 bytes
    assert s.control_status(s.subdevice, h.NV2080_CTRL_CMD_TIMER_GET_TIME, timer, pointer=0x18) == h.NV_ERR_INVALID_ADDRESS
    gr = h.NV2080_CTRL_GR_GET_INFO_PARAMS(grInfoListSize=1, grInfoList=0x20)
    assert s.control_status(s.subdevice, h.NV2080_CTRL_CMD_GR_GET_INFO, gr) == h.NV_ERR_INVALID_ADDRESS  # its embedded list
    small = (ctypes.c_uint32 * 2)()
    classes = h.NV0080_CTRL_GPU_GET_CLASSLIST_PARAMS(numClasses=2, classList=ctypes.addressof(small))
    assert s.control_status(s.device, h.NV0080_CTRL_CMD_GPU_GET_CLASSLIST, classes) == h.NV_ERR_INVALID_PARAM_STRUCT
    id_info = h.NV0000_CTRL_GPU_GET_ID_INFO_V2_PARAMS(gpuId=0xDEAD)
    assert s.control_status(s.root, h.NV0000_CTRL_CMD_GPU_GET_ID_INFO_V2, id_info) == h.NV_ERR_INVALID_ARGUMENT

    other = Client(driver)  # another client, on another control fd: its handles are not this fd's
    made = h.NVOS54_PARAMETERS(hClient=s.root, hObject=s.subdevice, cmd=h.NV2080_CTRL_CMD_TIMER_GET_TIME, params=ctypes.addressof(timer), paramsSize=8)
    assert other.nv(other.ctl, h.NV_ESC_RM_CONTROL, made) == 0 and made.status == h.NV_ERR_INVALID_CLIENT
    assert s.free_status(0x4321) == h.NV_ERR_INVALID_OBJECT_HANDLE
    assert s.free_status(handle) == 0 and s.free_status(handle) == h.NV_ERR_INVALID_OBJECT_HANDLE
    assert any("INVALID_CLASS" in m for m in driver.messages)


def test_out_of_device_memory(driver, session):
    s = session
    big = h.NV_MEMORY_ALLOCATION_PARAMS(owner=s.root, size=48 << 20)
    first = s.alloc(s.device, h.NV1_MEMORY_USER, big)
    assert big.size == 48 << 20 and big.limit == big.size - 1
    assert s.alloc_raw(s.device, h.NV1_MEMORY_USER, h.NV_MEMORY_ALLOCATION_PARAMS(owner=s.root, size=32 << 20)).status == h.NV_ERR_NO_MEMORY
    assert s.free_status(first) == 0
    s.alloc(s.device, h.NV1_MEMORY_USER, h.NV_MEMORY_ALLOCATION_PARAMS(owner=s.root, size=32 << 20))


def test_cpu_mapping_refusals(driver, session):
    s = session
    memory = s.alloc(s.device, h.NV1_MEMORY_USER, h.NV_MEMORY_ALLOCATION_PARAMS(owner=s.root, size=2 * PAGE))
    fd = s.gpu_file()
    with pytest.raises(OSError) as e:
        driver.mmap(None, PAGE, RW, mmap.MAP_SHARED, fd, 0)  # nothing pending on the fd
    assert e.value.errno == errno.EINVAL
    assert s.map_memory_status(s.device, memory, 2 * PAGE, s.ctl) == h.NV_ERR_INVALID_ARGUMENT  # device memory maps through /dev/nvidiaN
    assert s.map_memory_status(s.device, memory, 4 * PAGE, fd) == h.NV_ERR_INVALID_LIMIT
    assert s.map_memory_status(s.device, 0x999, PAGE, fd) == h.NV_ERR_INVALID_OBJECT_HANDLE
    assert s.map_memory_status(s.device, memory, 2 * PAGE, fd) == 0
    assert s.map_memory_status(s.device, memory, 2 * PAGE, fd) == h.NV_ERR_STATE_IN_USE  # one pending mapping per fd
    for length, offset, flags, code in ((PAGE, 0, mmap.MAP_SHARED, errno.ENXIO), (2 * PAGE, PAGE, mmap.MAP_SHARED, errno.EINVAL),
                                        (2 * PAGE, 0, mmap.MAP_PRIVATE, errno.EINVAL)):
        with pytest.raises(OSError) as e:
            driver.mmap(None, length, RW, flags, fd, offset)
        assert e.value.errno == code
    addr = driver.mmap(None, 2 * PAGE, RW, mmap.MAP_SHARED, fd, 0)
    ctypes.memmove(addr, b"ok", 2)
    assert s.free_status(memory) == 0
    assert ctypes.string_at(addr, 2) == b"ok"  # (the mapping keeps the memory)
    driver.munmap(addr, PAGE)
    assert driver.stats()["cpu_mappings"] == 2  # (the usermode window, and half of this one)
    driver.munmap(addr + PAGE, PAGE)
    driver.close(fd)
    assert driver.stats()["device_bytes"] == 0


def test_device_files():
    d = EmulatedDriver(gpus=2, gpu_factory=FakeGpu)
    try:
        with pytest.raises(FileNotFoundError):
            d.open("/dev/nvidia2", os.O_RDWR)
        with pytest.raises(FileNotFoundError):
            d.open("/dev/null", os.O_RDWR)
        fds = [d.open(p, os.O_RDWR) for p in ("/dev/nvidiactl", "/dev/nvidia0", "/dev/nvidia1", "/dev/nvidia-uvm")]
        assert len(set(fds)) == 4 and all(os.fstat(fd) for fd in fds)  # (real fds: they never collide with the process's)
        cards = (h.nv_ioctl_card_info_t * 4)()
        assert d.ioctl(fds[0], ioc(h.NV_ESC_CARD_INFO, ctypes.sizeof(cards)), cards) == 0
        assert [c.valid for c in cards] == [1, 1, 0, 0] and cards[0].gpu_id != cards[1].gpu_id
        assert d.gpu(1) is not d.gpu(0)
    finally:
        d.close()
    assert all(g.closed for g in (d.gpu(0), d.gpu(1))) and d.stats()["fds"] == 0
    with pytest.raises(OSError):
        os.fstat(fds[0])


def test_channel_parameters_are_checked(driver, session):
    s = session
    group = s.alloc(s.device, h.KEPLER_CHANNEL_GROUP_A, h.NV_CHANNEL_GROUP_ALLOCATION_PARAMETERS(engineType=h.NV2080_ENGINE_TYPE_GRAPHICS))
    ctxshare = s.alloc(group, h.FERMI_CONTEXT_SHARE_A, h.NV_CTXSHARE_ALLOCATION_PARAMETERS(hVASpace=s.vaspace, flags=h.NV_CTXSHARE_ALLOCATION_FLAGS_SUBCONTEXT_ASYNC))
    s.notifier_va, s.notifier, _ = s.alloc_memory(PAGE, system=True)
    area_va, area, _ = s.alloc_memory(64 * 8 + PAGE)
    unmapped = s.alloc(s.device, h.NV1_MEMORY_USER, h.NV_MEMORY_ALLOCATION_PARAMS(owner=s.root, size=PAGE))
    for kw, code in ((dict(gpFifoEntries=48), h.NV_ERR_INVALID_ARGUMENT), (dict(gpFifoOffset=0x7000_0000_0000), h.NV_ERR_INVALID_ADDRESS),
                     (dict(gpFifoEntries=4096), h.NV_ERR_INVALID_ADDRESS), (dict(hObjectError=group), h.NV_ERR_INVALID_OBJECT_HANDLE),
                     (dict(userdOffset=(ctypes.c_uint64 * 8)(2 * PAGE)), h.NV_ERR_INVALID_OFFSET),
                     (dict(userdOffset=(ctypes.c_uint64 * 8)(100)), h.NV_ERR_INVALID_OFFSET),
                     (dict(hContextShare=group), h.NV_ERR_INVALID_OBJECT_HANDLE)):
        assert s.alloc_raw(group, h.HOPPER_CHANNEL_GPFIFO_A, s.gpfifo_params(area_va, area, 64, ctxshare, **kw)).status == code, kw
    assert s.alloc_raw(s.device, h.HOPPER_CHANNEL_GPFIFO_A, s.gpfifo_params(area_va, area, 64, ctxshare)).status == h.NV_ERR_INVALID_OBJECT_PARENT
    channel = s.alloc(group, h.HOPPER_CHANNEL_GPFIFO_A, s.gpfifo_params(area_va, area, 64, ctxshare, hObjectBuffer=unmapped))
    assert driver.stats()["channels"] == 1
    assert s.free_status(group) == 0  # (its channel and context share with it)
    assert driver.stats()["channels"] == 0 and s.free_status(channel) == h.NV_ERR_INVALID_OBJECT_HANDLE


def test_uvm_ranges(driver, session):
    s = session
    memory = s.alloc(s.device, h.NV1_MEMORY_USER, h.NV_MEMORY_ALLOCATION_PARAMS(owner=s.root, size=4 * PAGE))
    create = lambda base, length: s.uvm_status(s.uvm_fd, h.UVM_CREATE_EXTERNAL_RANGE, h.UVM_CREATE_EXTERNAL_RANGE_PARAMS(base=base, length=length))
    assert create(GPU_BASE + 1, PAGE) == h.NV_ERR_INVALID_ADDRESS
    assert create(GPU_BASE, 4 * PAGE) == 0
    assert create(GPU_BASE + PAGE, PAGE) == h.NV_ERR_UVM_ADDRESS_IN_USE
    map_status = lambda va, size, **kw: s.uvm_status(s.uvm_fd, h.UVM_MAP_EXTERNAL_ALLOCATION, s.map_params(va, size, memory, **kw))
    assert map_status(GPU_BASE + 4 * PAGE, PAGE) == h.NV_ERR_INVALID_ADDRESS  # outside the range
    assert map_status(GPU_BASE, 8 * PAGE) == h.NV_ERR_INVALID_ADDRESS  # runs past it
    assert map_status(GPU_BASE, PAGE, uuid=h.struct_nv_uuid()) == h.NV_ERR_INVALID_DEVICE  # a GPU not registered
    assert map_status(GPU_BASE, PAGE, mapping_type=9) == h.NV_ERR_INVALID_ARGUMENT
    bad = s.map_params(GPU_BASE, PAGE, 0x999)
    assert s.uvm_status(s.uvm_fd, h.UVM_MAP_EXTERNAL_ALLOCATION, bad) == h.NV_ERR_INVALID_OBJECT_HANDLE
    space = driver.gpu(0).space
    assert map_status(GPU_BASE, 4 * PAGE) == 0
    assert map_status(GPU_BASE + PAGE, PAGE, mapping_type=3) == 0  # remaps the middle read-only: the rest stays
    assert [(m.va - GPU_BASE, m.size, m.writable) for m in space.mappings() if m.va < GPU_BASE + 4 * PAGE and m.va >= GPU_BASE] == \
        [(0, PAGE, True), (PAGE, PAGE, False), (2 * PAGE, 2 * PAGE, True)]
    free = lambda base, length: s.uvm_status(s.uvm_fd, h.UVM_FREE, h.UVM_FREE_PARAMS(base=base, length=length))
    assert free(GPU_BASE, PAGE) == h.NV_ERR_INVALID_ADDRESS  # (not the whole range)
    assert s.free_status(memory) == 0
    assert driver.stats()["device_bytes"] == 4 * PAGE  # UVM's mappings hold it
    assert free(GPU_BASE, 4 * PAGE) == 0
    assert driver.stats()["device_bytes"] == 0 and space.find(GPU_BASE) is None
    unknown = h.UVM_REGISTER_GPU_PARAMS(rmCtrlFd=-1, gpu_uuid=h.struct_nv_uuid())
    assert s.uvm_status(s.uvm_fd, h.UVM_REGISTER_GPU, unknown) == h.NV_ERR_GPU_UUID_NOT_FOUND
    again = h.UVM_REGISTER_GPU_PARAMS(rmCtrlFd=-1, gpu_uuid=s.uuid)
    assert s.uvm_status(s.uvm_fd, h.UVM_REGISTER_GPU, again) == h.NV_ERR_INVALID_DEVICE


def test_freeing_the_client_frees_its_tree_and_memory(driver, session):
    s = session
    group, _, made = s.channels(entries=64)
    s.control(group, h.NVA06C_CTRL_CMD_GPFIFO_SCHEDULE, h.NVA06C_CTRL_GPFIFO_SCHEDULE_PARAMS(bEnable=1))
    fake = driver.gpu(0)
    assert len(fake.channels) == 2 and driver.stats()["objects"] > 10
    assert s.free_status(s.root) == 0
    stats = driver.stats()
    assert stats["clients"] == stats["objects"] == stats["channels"] == 0 and not fake.channels
    assert stats["usermode_objects"] == 1  # (its CPU mapping keeps the usermode window until munmap)
    assert s.control_status(s.subdevice, h.NV2080_CTRL_CMD_TIMER_GET_TIME, h.NV2080_CTRL_TIMER_GET_TIME_PARAMS()) == h.NV_ERR_INVALID_CLIENT
    for fd in (s.uvm_fd, s.uvm_mm):  # UVM's mappings go with its fd
        driver.close(fd)
    assert driver.stats()["gpu_mappings"] == 0 and driver.stats()["memory_objects"] == 4  # (CPU mappings and their fds hold 4)
    for addr, size, fd in s.cpu_mapped:
        driver.munmap(addr, size)
        driver.close(fd)
    stats = driver.stats()
    assert stats["gpu_mappings"] == 0 and stats["memory_objects"] == 0 and stats["device_bytes"] == stats["system_bytes"] == 0


def test_closing_the_control_fd_frees_its_clients(driver, session):
    session.channels(entries=64)
    driver.close(session.ctl)
    assert driver.stats()["clients"] == 0 and driver.stats()["channels"] == 0


def test_a_fault_writes_the_error_notifier_and_the_debugger_reports_it(driver, session):
    s = session
    group, _, made = s.channels(entries=64)
    (compute, token, _), (copy, copy_token, _) = made
    compute_obj = s.alloc(compute, h.HOPPER_COMPUTE_A)  # (a second compute object: the debugger's target)
    debugger = s.alloc(s.device, h.GT200_DEBUGGER, h.NV83DE_ALLOC_PARAMETERS(hAppClient=s.root, hClass3dObject=compute_obj))
    assert s.alloc_raw(s.device, h.GT200_DEBUGGER, h.NV83DE_ALLOC_PARAMETERS(hAppClient=s.root, hClass3dObject=s.device)).status == \
        h.NV_ERR_INVALID_OBJECT_HANDLE
    s.control(group, h.NVA06C_CTRL_CMD_GPFIFO_SCHEDULE, h.NVA06C_CTRL_GPFIFO_SCHEDULE_PARAMS(bEnable=1))
    fake = driver.gpu(0)
    fake.on_fault(token, f"channel {token}: GPU write fault at 0xdead000: no memory is mapped there, in a semaphore release", 0xDEAD000)
    error = s.notifier_va + h.NV_CHANNELGPFIFO_NOTIFICATION_TYPE_ERROR * 16
    raw = (ctypes.c_uint32 * 4).from_address(error)
    assert raw[2] == 31 and raw[3] >> 16 == 0xFFFF and (raw[1] << 32 | raw[0]) == 123_456_789  # MMU fault, status, GPU time
    mmu = s.control(debugger, h.NV83DE_CTRL_CMD_DEBUG_READ_MMU_FAULT_INFO, h.NV83DE_CTRL_DEBUG_READ_MMU_FAULT_INFO_PARAMS())
    assert mmu.count == 1 and mmu.mmuFaultInfoList[0].faultAddress == 0xDEAD000
    assert mmu.mmuFaultInfoList[0].faultType == h.NV_PFAULT_FAULT_TYPE_PDE and mmu.mmuFaultInfoList[0].accessType == h.NV_PFAULT_ACCESS_TYPE_VIRT_WRITE
    sm = s.control(debugger, h.NV83DE_CTRL_CMD_DEBUG_READ_ALL_SM_ERROR_STATES,
                   h.NV83DE_CTRL_DEBUG_READ_ALL_SM_ERROR_STATES_PARAMS(hTargetChannel=compute, numSMsToRead=100))
    assert sm.mmuFault.valid == 1
    wrong = h.NV83DE_CTRL_DEBUG_READ_ALL_SM_ERROR_STATES_PARAMS(hTargetChannel=copy, numSMsToRead=100)
    assert s.control_status(debugger, h.NV83DE_CTRL_CMD_DEBUG_READ_ALL_SM_ERROR_STATES, wrong) == h.NV_ERR_INVALID_OBJECT_HANDLE
    # an exception in the GPU (not the MMU): a GR error, reported as an SM error state
    fake.on_fault(copy_token, f"channel {copy_token}: unknown method 0x1234 of HOPPER_DMA_COPY_A", 0x5000)
    assert raw[2] == 13
    # the debugger of the compute channel saw only its own fault
    sm = s.control(debugger, h.NV83DE_CTRL_CMD_DEBUG_READ_ALL_SM_ERROR_STATES,
                   h.NV83DE_CTRL_DEBUG_READ_ALL_SM_ERROR_STATES_PARAMS(hTargetChannel=compute, numSMsToRead=100))
    assert not any(e.hwwGlobalEsr for e in sm.smErrorStateArray)
    fake.on_fault(token, f"channel {token}: no CPU twin for the kernel at 0x7000", 0x7000)
    sm = s.control(debugger, h.NV83DE_CTRL_CMD_DEBUG_READ_ALL_SM_ERROR_STATES,
                   h.NV83DE_CTRL_DEBUG_READ_ALL_SM_ERROR_STATES_PARAMS(hTargetChannel=compute, numSMsToRead=100))
    assert sm.smErrorStateArray[0].hwwGlobalEsr and sm.smErrorStateArray[0].hwwWarpEsrPc64 == 0x7000
    fake.on_fault(77, "a channel the driver does not know", 0)  # (recorded, nothing written)


def test_engine_objects_reach_a_channel_that_is_on_the_gpu_before_its_first_doorbell(driver, session):
    s = session
    group, _, made = s.channels(entries=64)
    s.control(group, h.NVA06C_CTRL_CMD_GPFIFO_SCHEDULE, h.NVA06C_CTRL_GPFIFO_SCHEDULE_PARAMS(bEnable=1))
    (compute, token, _), _ = made
    fake = driver.gpu(0)
    s.alloc(compute, h.HOPPER_DMA_COPY_A)
    assert h.HOPPER_DMA_COPY_A in fake.channels[token][3]
    # a doorbell rung while the group is off the GPU is delivered when it is scheduled again
    s.control(group, h.NVA06C_CTRL_CMD_GPFIFO_SCHEDULE, h.NVA06C_CTRL_GPFIFO_SCHEDULE_PARAMS(bEnable=0))
    driver.doorbell(s.usermode_addr, token)
    assert fake.kicks == [] and not fake.channels
    s.control(group, h.NVA06C_CTRL_CMD_GPFIFO_SCHEDULE, h.NVA06C_CTRL_GPFIFO_SCHEDULE_PARAMS(bEnable=1))
    assert fake.kicks == [token]


def test_closing_the_driver_frees_everything():
    d = EmulatedDriver(gpu_factory=FakeGpu, device_memory_bytes=64 << 20)
    s = Session(d)
    group, _, _ = s.channels(entries=64)
    s.control(group, h.NVA06C_CTRL_CMD_GPFIFO_SCHEDULE, h.NVA06C_CTRL_GPFIFO_SCHEDULE_PARAMS(bEnable=1))
    s.alloc_memory(PAGE)
    d.close()
    d.close()  # (twice: nothing left)
    s.release()
    stats = d.stats()
    assert all(v == 0 for v in stats.values()), stats
    assert d.gpu(0).closed
    with pytest.raises(OSError):
        d.open("/dev/nvidiactl", os.O_RDWR)
