"""The Vulkan device `VK:n`: memory from Vulkan allocations addressed by buffer device addresses, kernels from GLSL
compute shaders, and a native command processor (vk.c) that records hcq packets into command buffers. Everything
else (queues, fences, lifetimes, graphs, the launch hot path) is the core's.

`VK` opens device 0 of the Vulkan driver, or the one `HCQ_VK_DEVICE` names (an index, or part of its name);
`VK:n` the n-th. `HCQ_VK_HOST_VISIBLE=0` gives user buffers memory the host cannot map even where the device has
only host-visible memory (lavapipe), the way a discrete GPU's device-local memory is: copies then go through the
staging ring and `cpu_view()` raises."""
from __future__ import annotations

import ctypes
import functools
import os
import struct
from typing import Any, Callable, Sequence

from hcq.allocator import HCQAllocator
from hcq.backends.vk.compiler import KernelInfo, reflect, VKCompiler
from hcq.backends.vk.kernels import CONFORMANCE_KERNELS
from hcq.backends.vk.native import INFO, RING_STATE, engine, function_address, unavailable_reason
from hcq.device import HCQCompiled
from hcq.errors import CompileError, HCQError
from hcq.helpers import env_flag, getenv, round_up
from hcq.interfaces import COMPUTE, COPY, Capabilities, HostStores
from hcq.memory import BufferSpec, HCQBuffer, MMIOInterface
from hcq.packet_queue import Executor, PacketComputeQueue, PacketCopyQueue, RingState, SubmitStatus
from hcq.packets import PollCondition, first_packet
from hcq.program import BufferBindings, CLikeArgsState, HCQProgram
from hcq.signal import check_word, HCQSignal, SignalReplica

RING_WORDS = 1 << 16
NO_POSITION = 2**64 - 1
QUEUE_KINDS = {COMPUTE: 0, COPY: 1}


def _physical_index(device: str) -> int:
    """The Vulkan device index `device` (VK or VK:n) opens: n, or for VK:0 the one HCQ_VK_DEVICE names."""
    index = int(device.split(":")[1]) if ":" in device else 0
    want = os.environ.get("HCQ_VK_DEVICE", "")
    if index != 0 or not want: return index
    if want.isdigit(): return int(want)
    lib, name = engine(), ctypes.create_string_buffer(256)
    for i in range(16):
        if lib.hcq_vk_name(i, name, len(name)) != 0: break
        if want.lower() in name.value.decode(errors="replace").lower(): return i
    raise HCQError(f"HCQ_VK_DEVICE={want!r} names no Vulkan device here")


class _Memory:
    """A Vulkan allocation, freed when the allocator and every host view of it have let go."""
    __slots__ = ("lib", "handle", "va", "__weakref__")

    def __init__(self, lib: Any, handle: int, va: int):
        self.lib, self.handle, self.va = lib, handle, va

    def __del__(self) -> None:
        if self.handle: self.lib.hcq_vk_free(self.handle, self.va)


class VKSignal(HCQSignal):
    """A signal in host-visible Vulkan memory: queues store it from the device (a timestamp copy, then the value),
    the host reads its mapping. Host waits sleep on the timeline semaphore of the batch that stores the value, where
    one did, else read the word. Host stores reach vk.c's store hook (HostStores) once one is set."""

    def store(self, value: int, wake: bool = True) -> None:
        if not _hooked or not wake: return super().store(value, wake)
        check_word("signal value", value)
        if self._value_mv is None: self._refuse_virtual()
        owner = self.owner  # (its device orders the hook's values: vk.c signal_reported)
        engine().hcq_vk_signal_store(owner.handle if isinstance(owner, VKDevice) and not owner.closed else None, self._host_value_addr,
                                     self.value_addr, value)

    def _wait_slice(self, value: int, ms: int) -> bool:
        owner = self.owner
        if self._value_mv is None: self._refuse_virtual()
        if not isinstance(owner, VKDevice) or owner.closed: return super()._wait_slice(value, ms)
        return engine().hcq_vk_wait(owner.handle, self.value_addr, value, ms * 1_000_000) == 0 or self.load() >= value


_hooked: list[int] = []  # (non-empty once a store hook was set: host stores into signals then go through vk.c)


def _set_store_hook(fn: int | None, ctx: int | None) -> None:
    if fn is not None and not _hooked: _hooked.append(1)
    engine().hcq_vk_set_store_hook(fn, ctx)


def _name_feeder(why: str) -> int:
    return int(engine().hcq_vk_name_feeder(why.encode(errors="replace")))


def _vk_function(name: str) -> Callable[[], int]:
    return lambda: function_address(name)


class VKExecutor(Executor):
    """vk.c: a native thread per ring recording packets into command buffers for the device's queue."""
    ring_words = RING_WORDS

    def __init__(self, device: str, handle: int):
        self.device, self.handle, self.lib = device, handle, engine()
        self.device_id = int(self.lib.hcq_vk_id(handle))
        self._err = ctypes.create_string_buffer(1024)

    @functools.cached_property
    def info(self) -> dict[str, int]:
        """vk.c's description of the device (`device_info`), read once."""
        return device_info(self.handle)[0]

    def open_ring(self, kind: str, index: int) -> int:
        out = ctypes.c_void_p()
        rc = self.lib.hcq_vk_ring_create(self.handle, QUEUE_KINDS[kind], index, RING_WORDS, ctypes.byref(out))
        if rc: raise HCQError(f"{self.device}: cannot create its {kind} queue {index}: {os.strerror(rc)}")
        return out.value  # type: ignore[return-value]

    def try_submit(self, handle: Any, addr: int, nwords: int, timeout_ns: int) -> int:
        return self.lib.hcq_vk_submit(handle, addr, nwords, timeout_ns)

    def native_submit_address(self) -> int | None:
        return ctypes.cast(self.lib.hcq_vk_submit, ctypes.c_void_p).value

    def submit_function(self) -> Callable[[Any, int, int, int], int]:
        fn = super().submit_function()
        return self.lib.hcq_vk_submit if fn == self.try_submit else fn

    def consumed(self, handle: Any) -> int:
        return self.lib.hcq_vk_rptr(handle)

    def room(self, handle: Any) -> int:
        return RING_WORDS - (self.lib.hcq_vk_wptr(handle) - self.lib.hcq_vk_rptr(handle))

    def ring_state(self, handle: Any) -> RingState:
        raw = (ctypes.c_uint64 * len(RING_STATE))()
        self.lib.hcq_vk_ring_state(handle, raw)
        st = dict(zip(RING_STATE, raw))
        state = RingState(st["rptr"], st["wptr"], st["packets_done"])
        if st["position"] != NO_POSITION:
            pkt = list(raw[RING_STATE.index("pkt0"):])
            state.current, state.position = first_packet(pkt), st["position"]
        return state

    def error(self) -> str | None:
        if not self.lib.hcq_vk_error(self.handle, self._err, len(self._err)): return None
        return self._err.value.decode(errors="replace")

    def submit_error(self, handle: Any, status: int) -> str:
        if status == SubmitStatus.TOO_BIG: return f"the submission exceeds the ring's {RING_WORDS} words"
        return super().submit_error(handle, status)

    def close(self, handles: Sequence[Any], release: bool = False) -> bool:
        # (joins the ring threads: a recording never blocks for long); release: the VkDevice goes with its last memory
        (self.lib.hcq_vk_close if release else self.lib.hcq_vk_stop)(self.handle)
        return True


def binding_limits(device: dict[str, int]) -> tuple[int, int]:
    """(minStorageBufferOffsetAlignment, maxStorageBufferRange) of a Vulkan device (`device_info`): where a storage-buffer
    binding may start, and the most bytes one may cover."""
    return max(1, int(device["storage_buffer_alignment"])), int(device["max_storage_buffer_range"])


def buffer_bindings(info: KernelInfo, device: dict[str, int]) -> BufferBindings | None:
    """What a kernel with storage-buffer bindings asks of a launch on `device` (`device_info`: each buffer's size written
    at `info.sizes_offset`, each buffer bindable there), or None for one whose parameters are an argument struct."""
    return BufferBindings(len(info.bindings), info.sizes_offset, *binding_limits(device)) if info.bindings else None


def device_memory_forced() -> bool:
    """HCQ_VK_HOST_VISIBLE=0: user buffers get memory the host cannot map even where the device has host-visible memory."""
    return not env_flag("HCQ_VK_HOST_VISIBLE", True)


def user_memory_host_visible(device: dict[str, int]) -> bool:
    """Whether a device (`device_info`) gives user buffers host-visible memory (not where it has none for them, nor with
    HCQ_VK_HOST_VISIBLE=0)."""
    return bool(device["user_host_visible"]) and not device_memory_forced()


def open_vulkan(device: str, force_device_memory: bool = False) -> int:
    """vk.c's handle of the Vulkan device `device` names (VK or VK:n, and HCQ_VK_DEVICE: `_physical_index`); HCQError
    saying why it cannot open."""
    err = ctypes.create_string_buffer(512)
    handle = engine().hcq_vk_open(_physical_index(device), int(force_device_memory), err, len(err))
    if not handle: raise HCQError(f"{device}: cannot open: {err.value.decode(errors='replace')}")
    return int(handle)


def load_program(handle: int, device: str, name: str, spirv: bytes, info: KernelInfo) -> int:
    """Load kernel `name` (its SPIR-V and what `reflect` read of it) on the device `handle` opens: its EXEC entry word;
    CompileError saying why it cannot load."""
    err = ctypes.create_string_buffer(512)
    local = (ctypes.c_uint32 * 3)(*info.fixed_local) if info.fixed_local is not None else None
    bindings = (ctypes.c_uint32 * max(1, len(info.bindings)))(*info.bindings)
    entry = engine().hcq_vk_program(handle, spirv, len(spirv), name.encode(), local, int(info.pushed), len(info.bindings), bindings,
                                    info.push_size, err, len(err))
    if not entry: raise CompileError(f"{device}: cannot load kernel {name!r}: {err.value.decode(errors='replace')}")
    return int(entry)


def kernargs_size(info: KernelInfo) -> int:
    """The kernargs block a kernel takes (at least 8 bytes, whole 16-byte units)."""
    return round_up(max(info.args_size, 8), 16)


class VKProgram(HCQProgram):
    """A GLSL compute shader loaded as a Vulkan shader module; its pipelines are made per local size on first launch.
    Its parameters are the members of its argument struct, or its storage-buffer bindings and push constants
    (`info.pushed`: the command processor reads them from the kernargs block when it records the launch)."""

    def __init__(self, dev: VKDevice, name: str, lib: bytes):
        self.info = info = reflect(lib)
        self.arg_slots, self.entry, self.fixed_local_size = info.arg_slots, load_program(dev.handle, dev.device, name, lib, info), info.fixed_local
        self.bindings = buffer_bindings(info, dev.vk_info)
        super().__init__(CLikeArgsState, dev, name, kernargs_alloc_size=kernargs_size(info), lib=lib, base=self.entry)


class VKAllocator(HCQAllocator["VKDevice"]):
    """Vulkan allocations, each bound to one buffer whose device address is the HCQ address. Runtime state (signals,
    kernargs, bound queues, staging) is host-visible; user buffers are device memory, host-visible only where the
    device's memory is (and not with HCQ_VK_HOST_VISIBLE=0). Memory of other peer groups that has a host view is
    imported (VK_EXT_external_memory_host) for the copy engine."""

    def _alloc(self, size: int, options: BufferSpec) -> HCQBuffer:
        dev = self.dev
        host_visible = self.for_runtime or options.cpu_access or options.host or dev.user_host_visible
        va, host = ctypes.c_uint64(), ctypes.c_void_p()
        rc = dev.lib.hcq_vk_alloc(dev.handle, size, int(host_visible), ctypes.byref(va), ctypes.byref(host))
        if rc: raise MemoryError(f"{dev.device}: cannot allocate {size} bytes of {'host-visible' if host_visible else 'device'} memory (VkResult {rc})")
        mem = _Memory(dev.lib, dev.handle, va.value)
        view = MMIOInterface(host.value, size, keepalive=mem) if host.value else None
        buf = HCQBuffer(va.value, size, meta=options, view=view, owner=dev)
        buf._vk_memory = mem  # type: ignore[attr-defined]
        return buf

    def _free(self, buf: HCQBuffer, options: BufferSpec) -> None:
        buf.view = None  # the allocation goes with the last host view of it
        buf._vk_memory = None  # type: ignore[attr-defined]

    def _use_host(self, host_addr: int, nbytes: int) -> int | None:
        """Host memory is used in place where it is this device's own memory (its host mapping): at its device address."""
        return int(self.dev.lib.hcq_vk_address_of_host(self.dev.handle, host_addr, nbytes)) or None

    def _map_into(self, buf: HCQBuffer) -> HCQBuffer:
        if buf.owner is not None and buf.owner is not self.dev:
            raise HCQError(f"{self.dev.device} cannot map {buf!r}: it belongs to another Vulkan device")
        return buf

    def _import(self, buf: HCQBuffer) -> HCQBuffer | None:
        """`buf` of another peer group, through its host view: its pages imported as Vulkan memory."""
        dev = self.dev
        if buf.view is None or not dev.host_import: return None
        host = buf.view.addr
        start = host - host % dev.import_align
        size = round_up(host + buf.size, dev.import_align) - start
        va = ctypes.c_uint64()
        if dev.lib.hcq_vk_import_host(dev.handle, start, size, ctypes.byref(va)): return None
        mapping = HCQBuffer(va.value + (host - start), buf.size, meta="imported host memory", owner=dev)
        mem = _Memory(dev.lib, dev.handle, va.value)
        mapping.on_release = lambda: setattr(mapping, "_vk_memory", None)
        mapping._vk_memory = mem  # type: ignore[attr-defined]
        mapping._keep = buf.view  # type: ignore[attr-defined]  # (the host memory stays while imported)
        return mapping

    def _export_to(self, buf: HCQBuffer, dev: Any) -> HCQBuffer | None:
        """`buf` for a device of another peer group whose copy engine reaches host memory: its host mapping."""
        if buf.view is None: return None
        addr = dev.allocator._use_host(buf.view.addr, buf.size)  # (where its kernels and copy engine use host memory in place)
        if addr is None: return None
        mapping = HCQBuffer(addr, buf.size, meta="host mapping of Vulkan memory", owner=dev)
        mapping._keep = buf.view  # type: ignore[attr-defined]
        return mapping


class VKComputeQueue(PacketComputeQueue):
    """Compute queue of a Vulkan device (hcq packets, recorded into command buffers by vk.c)."""


class VKCopyQueue(PacketCopyQueue):
    """Copy queue of a Vulkan device (its own ring and timeline semaphore on the device's queue)."""


def copy_queue_count() -> int:
    """How many copy queues a VK device has: HCQ_VK_COPY_QUEUES (1 to 8, default 1), rings that share the driver's
    queues (the fuzzer gives served devices three: one is its own)."""
    return getenv("HCQ_VK_COPY_QUEUES", 1, lo=1, hi=8)


def device_limits(info: dict[str, int]) -> tuple[int | float, tuple[int, int, int], tuple[int, int, int], int]:
    """(timestamp_divider, max_grid, max_block, max_block_threads) of a Vulkan device (vk.c's `hcq_vk_info`)."""
    period = struct.unpack("<f", struct.pack("<I", int(info["timestamp_period_bits"])))[0] or 1.0
    divider = round(1000 / period) if abs(1000 / period - round(1000 / period)) < 1e-6 else 1000 / period
    return (divider, (int(info["max_grid_x"]), int(info["max_grid_y"]), int(info["max_grid_z"])),
            (int(info["max_block_x"]), int(info["max_block_y"]), int(info["max_block_z"])), int(info["max_block_threads"]))


def device_info(handle: int) -> tuple[dict[str, int], str]:
    """vk.c's description of an open device: (INFO fields, the driver's device name)."""
    raw, name = (ctypes.c_uint64 * len(INFO))(), ctypes.create_string_buffer(256)
    engine().hcq_vk_info(handle, raw, name, len(name))
    return dict(zip(INFO, raw)), name.value.decode(errors="replace")


class VKDevice(HCQCompiled[VKSignal]):
    """`VK:n`: a Vulkan device; each VK device is its own peer group (its addresses are its own). Its rings hand what
    they store to a store hook (`host_stores`), so remote devices follow and feed its signals and buffers where their
    device addresses are host addresses (host-visible memory on a device that maps it at its device address: lavapipe)."""
    CONFORMANCE_KERNELS = CONFORMANCE_KERNELS
    host_stores = HostStores(_set_store_hook, _vk_function("hcq_vk_signal_poison"), _vk_function("hcq_vk_wake"), _name_feeder)

    def __init__(self, device: str):
        if (why := unavailable_reason()) is not None: raise HCQError(f"{device}: Vulkan is not available: {why}")
        self.lib = lib = engine()
        self._lost: str | None = None
        self.handle: int = open_vulkan(device, device_memory_forced())
        info, self.vk_name = device_info(self.handle)
        self.vk_info = info
        self.user_host_visible = user_memory_host_visible(info)
        self.host_import, self.import_align = bool(info["host_import"]), int(info["import_align"]) or 4096
        self.timestamp_divider, self.max_grid, self.max_block, self.max_block_threads = device_limits(info)  # type: ignore[assignment]
        self.storage_buffer_alignment, self.max_storage_buffer_range = binding_limits(info)
        caps = self.device_capabilities(info, self.user_host_visible, copy_queue_count())
        executor = VKExecutor(device, self.handle)
        try:
            super().__init__(device, VKAllocator(self), VKCompiler(), VKProgram, VKSignal, VKComputeQueue, VKCopyQueue,
                             capabilities=caps, executor=executor, peer_group=device)
        except BaseException:
            executor.close([])
            raise

    @staticmethod
    def device_capabilities(info: dict[str, int], user_host_visible: bool, copy_queues: int = 1) -> Capabilities:
        """What a Vulkan device (vk.c's `hcq_vk_info`) can do (hcq serve tells its clients this too)."""
        return Capabilities(queues={COMPUTE: 1, COPY: copy_queues}, word_bits=64, poll_conditions=frozenset(PollCondition), poll_mask=True,
                            recover=False, queue_states=True, host_visible_memory=user_host_visible, host_copies=False,
                            timestamps=True, packets=True,
                            # the copy ring has a hardware queue of its own, or copies the host's memory itself (see vk.c)
                            independent_copy=int(info["hardware_queues"]) > 1 or (bool(info["cpu_type"]) and user_host_visible))

    @classmethod
    def precompile(cls, source: str) -> None:
        """Compile `source` into the on-disk cache (no device needed)."""
        VKCompiler().compile(source)

    def lost(self) -> str | None:
        """Why the device is gone (VK_ERROR_DEVICE_LOST: its memory and queues went with it), else None."""
        if self._lost is None and (msg := self._device_error()) is not None and "VK_ERROR_DEVICE_LOST" in msg: self._lost = msg
        return self._lost

    def inject_device_lost(self, nth: int = 1) -> None:
        """Testing: the `nth` next submission to the Vulkan queue fails as VK_ERROR_DEVICE_LOST (a GPU reset)."""
        self.lib.hcq_vk_inject_device_lost(self.handle, nth)

    # ---- signals of other peer groups: the same memory, mapped the other way
    def _import_signal(self, signal: HCQSignal) -> SignalReplica | None:
        return self.mapped_replica(signal, self)

    def _export_signal(self, signal: HCQSignal, waiter: HCQCompiled) -> SignalReplica | None:
        return self.mapped_replica(signal, waiter)

    def describe(self) -> list[str]:
        i = self.vk_info
        api = int(i["api_version"])
        return super().describe() + [f"Vulkan device {self.vk_name!r} (vendor 0x{int(i['vendor_id']):04x}, device 0x{int(i['device_id']):04x}, "
                                     f"Vulkan {api >> 22}.{(api >> 12) & 0x3FF}.{api & 0xFFF}); user memory "
                                     f"{'host-visible' if self.user_host_visible else 'not host-visible'}; host memory import "
                                     f"{'yes' if self.host_import else 'no'}"]


DEVICE_CLASS = VKDevice
