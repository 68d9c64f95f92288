"""The CPU backend as `hcq serve` hosts it (`DEVICE_HOST`, an `hcq.interfaces.DeviceHost`): cp.c's command processors,
guard-paged host memory (memfd-backed where other servers on the host may map it) and the kernel loader."""
from __future__ import annotations

import ctypes
import os
from typing import Any

from hcq.backends.cpu.compiler import CPUCompiler, load_library
from hcq.backends.cpu.device import _entry_names, _Mapping, CPUDevice, CPUExecutor, STOP_NS
from hcq.backends.cpu.native import MAX_BLOCK_THREADS, QUEUE_STATE, engine, function_address, queue_settings
from hcq.hostmap import check_sealed_memfd, libc, MAP_FAILED, MAP_FIXED, MAP_SHARED, PAGE, PROT_RW
from hcq.toolchain import find_compiler


class GuardedMemory(_Mapping):
    """Device memory between guard pages (the CPU device's own kind of allocation); `fd` -1: in no memfd."""
    __slots__ = ("fd", "size")
    host_visible = True

    def __init__(self, size: int, device: str):
        self.fd, self.size = -1, -(-size // PAGE) * PAGE
        super().__init__(size, device)


class SharedMemory(_Mapping):
    """Device memory in a memfd (between guard pages): another server on this host can map it (the fd is passed over
    a unix socket), so a transfer from one of its devices is a plain copy into this memory. With `fd` (a client's
    runtime memory, given over that socket; this takes it over, and closes it once mapped: the server keeps no fd per
    client allocation, and shares such memory with no other server) the memory is the client's."""
    __slots__ = ("fd", "size")
    host_visible = True

    def __init__(self, size: int, device: str, fd: int | None = None):
        self.base, self.fd = 0, -1 if fd is None else fd  # (first: what __del__ releases should the mapping fail)
        self.size = -(-size // PAGE) * PAGE
        if fd is not None: check_sealed_memfd(fd, self.size)
        super().__init__(size, device)
        try:
            if fd is None:
                self.fd = os.memfd_create("hcq-device-memory", os.MFD_CLOEXEC)
                os.ftruncate(self.fd, self.size)
            if libc.mmap(self.addr, self.size, PROT_RW, MAP_SHARED | MAP_FIXED, self.fd, 0) in (None, MAP_FAILED):
                raise OSError(ctypes.get_errno(), "mmap")
            if fd is not None:
                os.close(self.fd)
                self.fd = -1
        except OSError as e:
            raise MemoryError(f"{device}: cannot allocate {size} bytes of shareable memory ({e})") from None

    def __del__(self) -> None:
        if self.fd >= 0: os.close(self.fd)
        super().__del__()


class CPUHost:
    """Hosts CPU devices: one cp.c device instance (its own queue threads, memory and failure state) per client."""
    kind = "CPU"
    stores = CPUDevice.host_stores
    queue_state_fields = QUEUE_STATE
    stores_before_hook = False  # (cp.c's threads call the hook before a later store of theirs)
    devices_share_memory = True  # (host memory at its device address: every device of the process reaches it)

    def __init__(self) -> None:
        self._compiler: CPUCompiler | None = None  # (made at the first load: a confined worker's environment is set by then)

    def preload(self) -> None:
        engine()

    def native_functions(self) -> tuple[int, int, int]:
        return function_address("hcq_queue_submit"), function_address("hcq_signal_store_quiet"), function_address("hcq_queue_rptr")

    def set_idle_hook(self, fn: int | None, ctx: int | None) -> None:
        engine().hcq_set_idle_hook(fn, ctx)  # (removing it waits until no queue thread is inside the hook)

    def queue_settings(self) -> tuple[int, int]:
        return queue_settings()

    def now_ns(self) -> int:
        return int(engine().hcq_now_ns())

    def describe(self, executor: Any) -> dict[str, Any]:
        return {"capabilities": CPUDevice.device_capabilities(queue_settings()[1]).to_wire(), "max_grid": list(CPUDevice.max_grid),
                "max_block": list(CPUDevice.max_block), "max_block_threads": MAX_BLOCK_THREADS,
                "timestamp_divider": CPUDevice.timestamp_divider, "language": "c", "compiler": find_compiler()[1],
                "conformance_kernels": CPUDevice.CONFORMANCE_KERNELS, "memory_host_visible": True}

    def open_device(self, name: str, workers: int) -> CPUExecutor:
        return CPUExecutor(name, workers)

    def failed_flag(self, executor: Any) -> int:
        return int(engine().hcq_dev_failed_flag(executor.handle))

    def stop_device(self, executor: Any, rings: list[Any]) -> bool:
        cp = engine()
        stopped = [cp.hcq_queue_stop(handle, STOP_NS) == 0 for handle in rings]
        cp.hcq_dev_stop(executor.handle)
        freed = [ok and cp.hcq_queue_destroy(h, STOP_NS) == 0 for h, ok in zip(rings, stopped)]
        if all(freed) and cp.hcq_dev_destroy(executor.handle, STOP_NS) == 0: executor.forget()
        return all(stopped)

    def memory(self, size: int, executor: CPUExecutor, shareable: bool = False, fd: int | None = None,
               host: bool = True) -> GuardedMemory | SharedMemory:
        device = executor.device  # (host memory, whatever `host` says: every CPU device reaches it)
        return SharedMemory(size, device, fd) if shareable or fd is not None else GuardedMemory(size, device)

    def load(self, source: str, name: str, executor: CPUExecutor) -> tuple[int, int, list[Any], Any, None]:
        if self._compiler is None: self._compiler = CPUCompiler()
        loaded = load_library(self._compiler.compile(source))
        if name not in loaded.kernels:
            raise ValueError(f"no HCQ_KERNEL named {name!r} in the source; it defines: {', '.join(sorted(loaded.kernels))}")
        slots, size, entry = loaded.kernels[name]
        _entry_names[entry] = name  # (fault reports name the kernel)
        return entry, size, slots, loaded, None

    def cas64(self, addr: int, expected: int, desired: int) -> int:
        return int(engine().hcq_cas64(addr, expected, desired))

    def poison(self, addr: int, value: int, poison_id: int) -> None:
        engine().hcq_signal_poison(addr, value, poison_id)
