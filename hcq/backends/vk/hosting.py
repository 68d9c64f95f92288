"""The VK backend as `hcq serve` hosts it (`DEVICE_HOST`, an `hcq.interfaces.DeviceHost`): a Vulkan device of its own
per client (vk.c), and GLSL kernels compiled here. Runtime memory (and windows, landing buffers, shareable memory) is
host-visible memory (memfd-backed and imported where it is shared) that the host maps at its device address, since
serve.c copies what clients submit into it and reads back what the rings store (lavapipe's memory is such; memory the
host maps elsewhere is refused, saying so). User buffers are device-local memory where the device keeps its buffers
there (no host-visible memory, or HCQ_VK_HOST_VISIBLE=0): their bytes then move through the device's copy queues."""
from __future__ import annotations

import ctypes
import os
import time
from typing import Any

from hcq import atomics
from hcq.backends.vk.compiler import glslang, reflect, VKCompiler
from hcq.backends.vk.device import (buffer_bindings, copy_queue_count, device_limits, device_memory_forced, kernargs_size, load_program,
                                    open_vulkan, user_memory_host_visible, VKDevice, VKExecutor)
from hcq.backends.vk.kernels import CONFORMANCE_KERNELS
from hcq.backends.vk.native import RING_STATE, engine, function_address
from hcq.helpers import round_up
from hcq.program import BufferBindings
from hcq.hostmap import check_sealed_memfd, libc, MAP_FAILED, MAP_SHARED, PAGE, PROT_RW

STOP_NS = 1_000_000_000  # how long a client's closing device gets to finish what runs (a kernel may run past it)


class VKMemory:
    """Memory of one served Vulkan device at `addr` (its device address). Host-visible memory is mapped by this process
    at that address; `fd` its memfd where other processes may map it (-1: none). With `shareable` it is a memfd of its
    own where Vulkan imports one (else plain memory), and with `fd` the client's (sealed against shrinking; mapped, then
    closed here). With `device_local`, memory the host does not map (`host_visible` False). Freed with this object (a
    device that closed goes once its last memory has)."""
    __slots__ = ("handle", "device", "addr", "size", "fd", "_mapped", "host_visible")

    def __init__(self, executor: VKExecutor, size: int, shareable: bool = False, fd: int | None = None, device_local: bool = False):
        self.handle, self.device, self.addr, self.size, self.fd, self._mapped = executor.handle, executor.device, 0, round_up(size, PAGE), -1, 0
        self.host_visible = not device_local
        if device_local:
            self._allocate(host_visible=False)
            return
        if fd is not None:
            host = self._import_memfd(fd, given=True)
        elif shareable:
            try:
                host = self._import_memfd(os.memfd_create("hcq-vk-memory", os.MFD_CLOEXEC), given=False)
            except MemoryError:  # (no memfd Vulkan imports here: memory no other server maps)
                host = self._allocate()
        else:
            host = self._allocate()
        if host != self.addr:
            self.__del__()
            raise MemoryError(f"{self.device}: the host maps its memory at 0x{host:x}, not at its device address: hcq serve follows only "
                              "memory the host maps at its device address (serve.c translates no addresses)")

    def _allocate(self, host_visible: bool = True) -> int:
        va, mapping = ctypes.c_uint64(), ctypes.c_void_p()
        rc = engine().hcq_vk_alloc(self.handle, self.size, int(host_visible), ctypes.byref(va), ctypes.byref(mapping))
        if rc: raise MemoryError(f"{self.device}: cannot allocate {self.size} bytes of {'host-visible' if host_visible else 'device'} memory (VkResult {rc})")
        self.addr = va.value
        return mapping.value or 0

    def _import_memfd(self, fd: int, given: bool) -> int:
        """Map memfd `fd` and import the mapping as Vulkan memory: its host address. A given fd is closed; our own kept."""
        try:
            if given: check_sealed_memfd(fd, self.size)
            else: os.ftruncate(fd, self.size)
            mapped = libc.mmap(None, self.size, PROT_RW, MAP_SHARED, fd, 0)
            if mapped in (None, MAP_FAILED): raise MemoryError(f"cannot map it ({os.strerror(ctypes.get_errno())})")
            self._mapped = int(mapped)
            va = ctypes.c_uint64()
            if engine().hcq_vk_import_host(self.handle, self._mapped, self.size, ctypes.byref(va)): raise MemoryError("Vulkan cannot import it")
            self.addr = va.value
            if not given: self.fd, fd = fd, -1
            return self._mapped
        except MemoryError as e:
            self.__del__()
            raise MemoryError(f"{self.device}: {self.size} bytes of shareable memory: {e}") from None
        except BaseException:
            self.__del__()
            raise
        finally:
            if fd >= 0: os.close(fd)  # (the client's, once mapped; or ours, when it failed)

    def __del__(self) -> None:
        if getattr(self, "addr", 0): engine().hcq_vk_free(self.handle, self.addr)
        if getattr(self, "_mapped", 0): libc.munmap(self._mapped, self.size)
        if getattr(self, "fd", -1) >= 0: os.close(self.fd)
        self.addr = self._mapped = 0
        self.fd = -1


class VKHost:
    """Hosts VK devices: one Vulkan device (vk.c: its rings, memory and failure state) per client."""
    kind = "VK"
    stores = VKDevice.host_stores
    queue_state_fields = RING_STATE
    stores_before_hook = True  # (the GPU's stores are handed over once their batch finished)
    devices_share_memory = True  # (host memory at its device address: every device of the process reaches it)

    def __init__(self) -> None:
        self._compiler: VKCompiler | None = None

    def preload(self) -> None:
        engine()
        glslang()

    def native_functions(self) -> tuple[int, int, int]:
        return function_address("hcq_vk_submit"), function_address("hcq_vk_signal_store_quiet"), function_address("hcq_vk_rptr")

    def set_idle_hook(self, fn: int | None, ctx: int | None) -> None:
        """vk.c's ring threads lend no idle time: the server's progress thread takes every message."""

    def queue_settings(self) -> tuple[int, int]:
        return 1, copy_queue_count()  # (a compute ring and copy rings per device; the driver runs the kernels' invocations)

    def now_ns(self) -> int:
        return time.monotonic_ns()

    def describe(self, executor: Any) -> dict[str, Any]:
        info = executor.info
        divider, max_grid, max_block, max_block_threads = device_limits(info)
        user_host_visible = user_memory_host_visible(info)
        caps = VKDevice.device_capabilities(info, user_host_visible=user_host_visible, copy_queues=copy_queue_count())
        return {"capabilities": caps.to_wire(), "max_grid": list(max_grid), "max_block": list(max_block),
                "max_block_threads": max_block_threads, "timestamp_divider": divider, "language": "glsl", "compiler": glslang()[1],
                "conformance_kernels": CONFORMANCE_KERNELS, "memory_host_visible": user_host_visible}

    def open_device(self, name: str, workers: int) -> VKExecutor:
        return VKExecutor(name, open_vulkan(name.partition("@")[0], device_memory_forced()))

    def failed_flag(self, executor: Any) -> int:
        return int(engine().hcq_vk_failed_flag(executor.handle))

    def stop_device(self, executor: Any, rings: list[Any]) -> bool:
        lib = engine()
        lib.hcq_vk_stop(executor.handle)  # (joins the ring threads: a recording never blocks for long)
        if lib.hcq_vk_wait_idle(executor.handle, STOP_NS) != 0: return False  # a kernel still runs: the device and its memory stay
        executor.close(rings, release=True)  # (the device goes with its last memory)
        return True

    def memory(self, size: int, executor: Any, shareable: bool = False, fd: int | None = None, host: bool = True) -> VKMemory:
        return VKMemory(executor, size, shareable, fd, device_local=not host and not user_memory_host_visible(executor.info))

    def load(self, source: str, name: str, executor: Any) -> tuple[int, int, list[Any], Any, BufferBindings | None]:
        if self._compiler is None: self._compiler = VKCompiler()
        spirv = self._compiler.compile(source)
        info = reflect(spirv)
        entry = load_program(executor.handle, executor.device, name, spirv, info)
        return entry, kernargs_size(info), info.arg_slots, None, buffer_bindings(info, executor.info)

    def cas64(self, addr: int, expected: int, desired: int) -> int:
        return atomics.cas64(addr, expected, desired)

    def poison(self, addr: int, value: int, poison_id: int) -> None:
        engine().hcq_vk_signal_poison(addr, value, poison_id)
