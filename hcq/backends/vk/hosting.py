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
from hcq.backends.vk.device import _physical_index, device_info, device_limits, VKDevice, VKExecutor
from hcq.backends.vk.kernels import CONFORMANCE_KERNELS
from hcq.backends.vk.native import RING_STATE, engine, function_address
from hcq.errors import CompileError, HCQError
from hcq.helpers import round_up
from hcq.hostmap import check_sealed_memfd, libc, MAP_FAILED, MAP_SHARED, PAGE, PROT_RW


class VKMemory:
    """Host-visible memory of one served Vulkan device, at `addr` (its device address, which is where this process maps
    it); `fd` its memfd where other processes may map it (-1: none). With `shareable` it is a memfd of its own, and with
    `fd` the client's (sealed against shrinking; mapped, then closed here), imported as Vulkan memory. Freed with this
    object (a device that closed goes once its last memory has)."""
    __slots__ = ("handle", "addr", "size", "fd", "_mapped")

    def __init__(self, executor: VKExecutor, size: int, shareable: bool = False, fd: int | None = None):
        lib, device = engine(), executor.device
        self.handle, self.addr, self.size, self.fd, self._mapped = executor.handle, 0, round_up(size, PAGE), -1, 0
        va, host = ctypes.c_uint64(), 0
        if fd is None and not shareable:
            mapping = ctypes.c_void_p()
            rc = lib.hcq_vk_alloc(self.handle, self.size, 1, ctypes.byref(va), ctypes.byref(mapping))
            if rc: raise MemoryError(f"{device}: cannot allocate {size} bytes of host-visible memory (VkResult {rc})")
            self.addr, host = va.value, mapping.value or 0
        else:
            try:
                if fd is None:
                    self.fd = os.memfd_create("hcq-vk-memory", os.MFD_CLOEXEC)
                    os.ftruncate(self.fd, self.size)
                else:
                    check_sealed_memfd(fd, self.size)
                mapped = libc.mmap(None, self.size, PROT_RW, MAP_SHARED, self.fd if fd is None else fd, 0)
                if mapped in (None, MAP_FAILED): raise MemoryError(f"cannot map it ({os.strerror(ctypes.get_errno())})")
                self._mapped = host = int(mapped)
                if lib.hcq_vk_import_host(self.handle, host, self.size, ctypes.byref(va)): raise MemoryError("Vulkan cannot import it")
                self.addr = va.value
            except BaseException as e:
                self.__del__()
                if isinstance(e, MemoryError): raise MemoryError(f"{device}: {size} bytes of shareable memory: {e}") from None
                raise
            finally:
                if fd is not None: os.close(fd)  # (the client's: once mapped, nothing here needs it)
        if host != self.addr:
            self.__del__()
            raise MemoryError(f"{device}: the host maps its memory at 0x{host:x}, not at its device address 0x{va.value:x}: hcq serve "
                              "follows only memory the host maps at its device address (serve.c translates no addresses)")

    def __del__(self) -> None:
        if self.addr: engine().hcq_vk_free(self.handle, self.addr)
        if self._mapped: libc.munmap(self._mapped, self.size)
        if self.fd >= 0: os.close(self.fd)
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
        return 1, 1  # (a compute ring and a copy ring per device; the driver runs the kernels' invocations)

    def now_ns(self) -> int:
        return time.monotonic_ns()

    def describe(self) -> dict[str, Any]:
        executor = self.open_device("VK:0", 1)
        try:
            info, _ = device_info(executor.handle)
        finally:
            executor.close([], release=True)
        divider, max_grid, max_block, max_block_threads = device_limits(info)
        # (served memory is host memory: its rings copy it themselves on a CPU-type device)
        caps = VKDevice.device_capabilities(info, user_host_visible=True)
        return {"capabilities": caps.to_wire(), "max_grid": list(max_grid), "max_block": list(max_block),
                "max_block_threads": max_block_threads, "timestamp_divider": divider, "language": "glsl", "compiler": glslang()[1],
                "conformance_kernels": CONFORMANCE_KERNELS}

    def open_device(self, name: str, workers: int) -> VKExecutor:
        err = ctypes.create_string_buffer(512)
        handle = engine().hcq_vk_open(_physical_index(name.partition("@")[0]), 0, err, len(err))
        if not handle: raise HCQError(f"{name}: cannot open: {err.value.decode(errors='replace')}")
        return VKExecutor(name, handle)

    def failed_flag(self, executor: Any) -> int:
        return int(engine().hcq_vk_failed_flag(executor.handle))

    def stop_device(self, executor: Any, rings: list[Any]) -> bool:
        return bool(executor.close(rings, release=True))  # (joins the ring threads; the device goes with its last memory)

    def memory(self, size: int, executor: Any, shareable: bool = False, fd: int | None = None) -> VKMemory:
        return VKMemory(executor, size, shareable, fd)

    def load(self, source: str, name: str, executor: Any) -> tuple[int, int, list[Any], Any]:
        if self._compiler is None: self._compiler = VKCompiler()
        spirv = self._compiler.compile(source)
        info = reflect(spirv)
        if info.bindings:
            raise CompileError(f"kernel {name!r} takes storage-buffer bindings: a served VK device runs kernels whose parameters are "
                               "one argument struct of buffer references and scalars (as the conformance kernels declare theirs)")
        err = ctypes.create_string_buffer(512)
        local = (ctypes.c_uint32 * 3)(*info.fixed_local) if info.fixed_local is not None else None
        entry = engine().hcq_vk_program(executor.handle, spirv, len(spirv), name.encode(), local, 0, 0, (ctypes.c_uint32 * 1)(), 0, err, len(err))
        if not entry: raise CompileError(f"{executor.device}: cannot load kernel {name!r}: {err.value.decode(errors='replace')}")
        return int(entry), round_up(max(info.args_size, 8), 16), info.arg_slots, None

    def cas64(self, addr: int, expected: int, desired: int) -> int:
        return atomics.cas64(addr, expected, desired)

    def poison(self, addr: int, value: int, poison_id: int) -> None:
        engine().hcq_vk_signal_poison(addr, value, poison_id)
