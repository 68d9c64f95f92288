"""The VK backend as `hcq serve` hosts it (`DEVICE_HOST`, an `hcq.interfaces.DeviceHost`): a Vulkan device of its own
per client (vk.c), host-visible memory of it (memfd-backed and imported where it is shared), and GLSL kernels compiled
here. serve.c copies what clients submit into device memory and reads back what the rings store, so it serves memory
the host maps at its device address (lavapipe's); any other memory is refused, saying so."""
from __future__ import annotations

import ctypes
import os
import time
from typing import Any

from hcq import atomics
from hcq.backends.vk.compiler import glslang, reflect, VKCompiler
from hcq.backends.vk.device import copy_queue_count, device_info, device_limits, kernargs_size, load_program, open_vulkan, VKDevice, VKExecutor
from hcq.backends.vk.kernels import CONFORMANCE_KERNELS
from hcq.backends.vk.native import RING_STATE, engine, function_address
from hcq.errors import CompileError
from hcq.helpers import round_up
from hcq.hostmap import check_sealed_memfd, libc, MAP_FAILED, MAP_SHARED, PAGE, PROT_RW

STOP_NS = 1_000_000_000  # how long a client's closing device gets to finish what runs (a kernel may run past it)


class VKMemory:
    """Host-visible memory of one served Vulkan device, at `addr` (its device address, which is where this process maps
    it); `fd` its memfd where other processes may map it (-1: none). With `shareable` it is a memfd of its own where
    Vulkan imports one (else plain memory), and with `fd` the client's (sealed against shrinking; mapped, then closed
    here). Freed with this object (a device that closed goes once its last memory has)."""
    __slots__ = ("handle", "device", "addr", "size", "fd", "_mapped")

    def __init__(self, executor: VKExecutor, size: int, shareable: bool = False, fd: int | None = None):
        self.handle, self.device, self.addr, self.size, self.fd, self._mapped = executor.handle, executor.device, 0, round_up(size, PAGE), -1, 0
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

    def _allocate(self) -> int:
        va, mapping = ctypes.c_uint64(), ctypes.c_void_p()
        rc = engine().hcq_vk_alloc(self.handle, self.size, 1, ctypes.byref(va), ctypes.byref(mapping))
        if rc: raise MemoryError(f"{self.device}: cannot allocate {self.size} bytes of host-visible memory (VkResult {rc})")
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
        info, _ = device_info(executor.handle)
        divider, max_grid, max_block, max_block_threads = device_limits(info)
        # (served memory is host memory: its rings copy it themselves on a CPU-type device)
        caps = VKDevice.device_capabilities(info, user_host_visible=True, copy_queues=copy_queue_count())
        return {"capabilities": caps.to_wire(), "max_grid": list(max_grid), "max_block": list(max_block),
                "max_block_threads": max_block_threads, "timestamp_divider": divider, "language": "glsl", "compiler": glslang()[1],
                "conformance_kernels": CONFORMANCE_KERNELS}

    def open_device(self, name: str, workers: int) -> VKExecutor:
        return VKExecutor(name, open_vulkan(name.partition("@")[0]))

    def failed_flag(self, executor: Any) -> int:
        return int(engine().hcq_vk_failed_flag(executor.handle))

    def stop_device(self, executor: Any, rings: list[Any]) -> bool:
        lib = engine()
        lib.hcq_vk_stop(executor.handle)  # (joins the ring threads: a recording never blocks for long)
        if lib.hcq_vk_wait_idle(executor.handle, STOP_NS) != 0: return False  # a kernel still runs: the device and its memory stay
        executor.close(rings, release=True)  # (the device goes with its last memory)
        return True

    def memory(self, size: int, executor: Any, shareable: bool = False, fd: int | None = None) -> VKMemory:
        return VKMemory(executor, size, shareable, fd)

    def load(self, source: str, name: str, executor: Any) -> tuple[int, int, list[Any], Any]:
        if self._compiler is None: self._compiler = VKCompiler()
        spirv = self._compiler.compile(source)
        info = reflect(spirv)
        if info.bindings:
            raise CompileError(f"kernel {name!r} takes storage-buffer bindings: a served VK device runs kernels whose parameters are "
                               "one argument struct of buffer references and scalars (as the conformance kernels declare theirs)")
        return load_program(executor.handle, executor.device, name, spirv, info), kernargs_size(info), info.arg_slots, None

    def cas64(self, addr: int, expected: int, desired: int) -> int:
        return atomics.cas64(addr, expected, desired)

    def poison(self, addr: int, value: int, poison_id: int) -> None:
        engine().hcq_vk_signal_poison(addr, value, poison_id)
