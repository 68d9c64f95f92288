"""The emulated GPU's virtual address space: GPU VA ranges mapped onto host memory. Every access the emulated GPU makes
goes through `AddressSpace.translate`, so an address outside mapped memory is a `GpuFault` (the MMU fault of a real
GPU), never a stray host access."""
from __future__ import annotations

import bisect
import ctypes
import threading
from dataclasses import dataclass


class GpuFault(Exception):
    """An access the GPU's MMU refuses: `address` (GPU VA), `access` ("read" or "write"), `reason`."""

    def __init__(self, address: int, access: str, reason: str) -> None:
        super().__init__(f"GPU {access} fault at {address:#x}: {reason}")
        self.address, self.access, self.reason = address, access, reason


@dataclass(frozen=True)
class Mapping:
    """GPU VA range [va, va + size) backed by host memory at `host`; `what` names it in faults."""
    va: int
    size: int
    host: int
    what: str
    writable: bool = True

    @property
    def end(self) -> int:
        return self.va + self.size

    def __str__(self) -> str:
        return f"{self.what} [{self.va:#x}, {self.end:#x}){'' if self.writable else ' (read-only)'}"


class AddressSpace:
    """Non-overlapping mappings looked up by bisection. map/unmap take a lock and publish a new immutable snapshot with
    one attribute store, so lookups read a consistent snapshot without locking."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._snapshot: tuple[tuple[int, ...], tuple[Mapping, ...]] = ((), ())

    def map(self, va: int, size: int, host_addr: int, what: str, writable: bool = True) -> Mapping:
        """Map [va, va + size) onto host memory at `host_addr`; a range that overlaps a mapping is refused (ValueError)."""
        if va < 0 or size <= 0 or va + size > 1 << 64: raise ValueError(f"cannot map {what}: bad GPU range va={va:#x} size={size:#x}")
        if not host_addr: raise ValueError(f"cannot map {what}: no host memory (host address 0)")
        new = Mapping(va, size, host_addr, what, writable)
        with self._lock:
            starts, maps = self._snapshot
            i = bisect.bisect_right(starts, va)
            for neighbour in maps[max(i - 1, 0):i + 1]:
                if neighbour.va < new.end and va < neighbour.end:
                    raise ValueError(f"cannot map {new}: it overlaps {neighbour}")
            self._snapshot = (starts[:i] + (va,) + starts[i:], maps[:i] + (new,) + maps[i:])
        return new

    def unmap(self, va: int) -> Mapping:
        """Remove the mapping that starts at `va` (KeyError if none does) and return it."""
        with self._lock:
            starts, maps = self._snapshot
            i = bisect.bisect_left(starts, va)
            if i == len(starts) or starts[i] != va: raise KeyError(f"no GPU mapping starts at {va:#x}")
            self._snapshot = (starts[:i] + starts[i + 1:], maps[:i] + maps[i + 1:])
            return maps[i]

    def mappings(self) -> list[Mapping]:
        """The mappings, by address."""
        return list(self._snapshot[1])

    def find(self, va: int) -> Mapping | None:
        """The mapping that contains `va`, or None."""
        starts, maps = self._snapshot
        i = bisect.bisect_right(starts, va) - 1
        return maps[i] if i >= 0 and va < maps[i].end else None

    def translate(self, va: int, nbytes: int, write: bool = False) -> int:
        """The host address of [va, va + nbytes), which must lie in one mapping (writable, for a write); else GpuFault."""
        access = "write" if write else "read"
        m = self.find(va)
        if m is None: raise GpuFault(va, access, "no memory is mapped there")
        if va + max(nbytes, 1) > m.end:
            raise GpuFault(va, access, f"{nbytes} bytes from there run past the end of {m} by {va + nbytes - m.end} bytes")
        if write and not m.writable: raise GpuFault(va, access, f"{m} is read-only")
        return m.host + (va - m.va)

    def read(self, va: int, n: int) -> bytes:
        return ctypes.string_at(self.translate(va, n), n) if n > 0 else b""

    def write(self, va: int, data: bytes | bytearray | memoryview) -> None:
        if len(data): ctypes.memmove(self.translate(va, len(data), write=True), bytes(data), len(data))

    def _aligned(self, va: int, size: int, write: bool) -> int:
        if va % size: raise GpuFault(va, "write" if write else "read", f"a {size}-byte access must be {size}-byte aligned")
        return self.translate(va, size, write)

    # One aligned access each, through ctypes: a single load or store instruction, so atomic with respect to host threads.
    def load32(self, va: int) -> int:
        return ctypes.c_uint32.from_address(self._aligned(va, 4, False)).value

    def load64(self, va: int) -> int:
        return ctypes.c_uint64.from_address(self._aligned(va, 8, False)).value

    def store32(self, va: int, value: int) -> None:
        ctypes.c_uint32.from_address(self._aligned(va, 4, True)).value = value & 0xFFFFFFFF

    def store64(self, va: int, value: int) -> None:
        ctypes.c_uint64.from_address(self._aligned(va, 8, True)).value = value & 0xFFFFFFFFFFFFFFFF
