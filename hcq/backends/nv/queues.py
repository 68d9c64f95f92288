"""NV queues: every HCQ command as the GPU's own methods, written into a pushbuffer of 32-bit words (method headers
and data from NVIDIA's headers through hcq.backends.nv.abi). Host-class semaphores carry signal, wait, write and
poll_bit; the compute class runs launch descriptors (QMDs); the copy engine copies. A submission ends with a
semaphore release of the ring's fence and reaches the GPU as a GPFIFO entry (hcq.backends.nv.channel)."""
from __future__ import annotations

import functools
import struct
from typing import Any

from hcq.backends.nv import abi
from hcq.backends.nv.qmd import QMD_ALIGN, QMD_BYTES, Descriptor
from hcq.errors import HCQError
from hcq.helpers import round_up
from hcq.interfaces import COMPUTE, COPY
from hcq.lifetimes import Ring
from hcq.packets import PollCondition
from hcq.program import HCQArgsState, HCQProgram
from hcq.queue import HWQueue
from hcq.signal import HCQSignal
from hcq.symbolic import Expr, sint

NVDevice = Any  # (the device module imports this one: its types are named, not imported)
NVProgram = Any


def va(buf: Any) -> int:
    """The GPU address of an NV buffer (always concrete: only placeholders have symbolic ones)."""
    if not isinstance(buf.va_addr, int): raise HCQError(f"{buf!r} has no concrete address")
    return buf.va_addr

SUBCH_HOST, SUBCH_COMPUTE, SUBCH_COPY = 0, 1, 4  # the subchannels the device binds its classes to (SET_OBJECT)
MAX_COPY_LINE = 1 << 31  # bytes one LAUNCH_DMA moves here (LINE_LENGTH_IN is 32 bits; halves keep clear of its top)
# poll_bit conditions as host semaphore acquires
_ACQUIRE_OPS = {PollCondition.EQ: "acquire", PollCondition.GEQ: "acq_strict_geq", PollCondition.AND: "acq_and", PollCondition.NOR: "acq_nor"}


def split64(value: sint) -> tuple[sint, sint]:
    """(low 32 bits, high 32 bits) of a 64-bit value, symbolic ones included."""
    return value % (1 << 32), value // (1 << 32)


class NVQueue(HWQueue):
    """A queue of NV methods. `h` (the headers) is set by the device class on first use."""
    word_bits = 32

    def __init__(self, index: int = 0, *, profile: bool | None = None) -> None:
        super().__init__(index, profile=profile)
        self._bound: tuple[Any, int] | None = None  # (the device memory holding the words, their GPU address) once bound
        self._symbolic_sem_hi: list[int] = []  # word indices of the upper address words of semaphores with symbolic addresses

    @property
    def h(self) -> Any:
        return abi.active()

    def method(self, subchannel: int, method: int, *data: sint) -> None:
        """An incrementing method header (`method` is a byte offset) followed by its data words."""
        self.q(*method_words(self.h, subchannel, method, *data))

    def semaphore(self, address: sint, payload: sint, **execute: Any) -> None:
        """A host-class semaphore operation on `address` (SEM_EXECUTE's fields given by name)."""
        if isinstance(address, int): check_semaphore_address(address)
        else: self._symbolic_sem_hi.append(len(self._q) + 2)  # (its upper word, checked once resolved: see _submit)
        self.q(*semaphore_words(self.h, address, payload, **execute))

    # ---- HWQueue commands
    def _signal(self, signal: HCQSignal, value: sint) -> None:
        self.semaphore(signal.value_addr, value, operation="release", release_wfi="en", payload_size="64bit")

    def _wait(self, signal: HCQSignal, value: sint) -> None:
        self.semaphore(signal.value_addr, value, operation="acq_strict_geq", payload_size="64bit")

    def _timestamp(self, signal: HCQSignal) -> None:
        # A release with a timestamp writes its payload too: adding 0 to the value leaves it as it is and writes the
        # GPU time into the 8 bytes after it, the signal's timestamp word.
        self.semaphore(signal.value_addr, 0, operation="reduction", reduction="iadd", reduction_format="unsigned", release_wfi="en",
                       payload_size="64bit", release_timestamp="en")

    def _write(self, addr: sint, value: sint, b64: bool) -> None:
        self.semaphore(addr, value, operation="release", release_wfi="en", payload_size="64bit" if b64 else "32bit")

    def _poll_bit(self, addr: sint, value: sint, mask: sint, b64: bool, cond: PollCondition) -> None:
        self.semaphore(addr, value, operation=_ACQUIRE_OPS[cond], payload_size="64bit" if b64 else "32bit")

    def _memory_barrier(self) -> None:
        h = self.h
        self.method(SUBCH_COMPUTE, h.NVC6C0_INVALIDATE_SHADER_CACHES_NO_WFI,
                    abi.fields(h, "NVC6C0_INVALIDATE_SHADER_CACHES_NO_WFI", instruction="true", global_data="true", constant="true"))

    # ---- bound queues and submission
    def _bind(self, dev: NVDevice) -> None:
        words = list(self._q)  # type: ignore[arg-type]
        buf = dev.allocator.alloc(max(4, 4 * len(words)), dev.runtime_spec, internal=True)
        view = buf.cpu_view().view(0, 4 * len(words), "I") if words else buf.cpu_view().view(0, 4, "I")
        for i, w in enumerate(words): view[i] = w
        self._bound = (buf, va(buf))
        self._q = view if words else []
        self._words_in_memory = True

    def _submit(self, dev: NVDevice, ring: Ring, fence_value: int) -> Any:
        for i in self._symbolic_sem_hi: check_semaphore_address(self._q[i] << 32)
        channel = dev.channel(self.kind, self.index)
        fence = semaphore_words(self.h, ring.fence.value_addr, fence_value, operation="release", release_wfi="en", payload_size="64bit")
        if self._bound is not None: channel.submit(fence, ring, fence_value, bound=(self._bound[1], len(self._q)))
        else: channel.submit(list(self._q) + fence, ring, fence_value)  # type: ignore[arg-type]
        return None


class NVComputeQueue(NVQueue):
    """Compute queue of an NV device: host semaphores and QMD launches on the compute channel."""
    kind = COMPUTE

    def _exec(self, prg: HCQProgram, args_state: HCQArgsState, global_size: tuple[sint, ...], local_size: tuple[sint, ...]) -> None:
        nvp: NVProgram = prg
        h, buf = self.h, args_state.buf
        view, base = buf.cpu_view(), va(buf)
        at = nvp.bank_size  # (the QMD follows constant bank 0 in the kernargs block)
        layout = qmd_layout(h, nvp.qmd_prefix)
        qmd = bytearray(nvp.qmd_template)
        struct.pack_into("<I", qmd, layout.bank_lower, base & 0xFFFFFFFF)
        off, shift, mask = layout.bank_upper
        if base >> 32 > mask: raise ValueError(f"constant bank address 0x{base:x} does not fit the QMD")
        word = struct.unpack_from("<I", qmd, off)[0]
        struct.pack_into("<I", qmd, off, (word & ~(mask << shift)) | ((base >> 32) << shift))
        for (off, fmt, limit), d in zip(layout.dims, (*global_size, *local_size)):
            if isinstance(d, int):
                if d > limit: raise ValueError(f"launch dims {global_size}, {local_size}: {d} exceeds the QMD's {limit}")
                struct.pack_into(fmt, qmd, off, d)
        view.view(at, QMD_BYTES, "B")[:] = qmd
        for (off, fmt, _), d in zip(layout.dims, (*global_size, *local_size)):
            if isinstance(d, Expr): self.bind_sints_to_mem(d, mem=view, fmt=fmt[1], offset=at + off)  # (patched in memory at each submit)
        qmd_va = base + at
        self.q(method_header(h, SUBCH_COMPUTE, h.NVC6C0_SEND_PCAS_A, 1), qmd_va >> 8,
               method_header(h, SUBCH_COMPUTE, h.NVC6C0_SEND_SIGNALING_PCAS2_B, 1),
               abi.fields(h, "NVC6C0_SEND_SIGNALING_PCAS2_B", pcas_action="invalidate_copy_schedule"))


class QMDLayout:
    """Where a launch patches its QMD: constant bank 0's address, then the grid and block dims (byte offset, struct
    format, largest value), all read from the headers' field ranges."""

    def __init__(self, h: Any, prefix: str):
        q = Descriptor(h, prefix)
        self.bank_lower = q.byte_offset("constant_buffer_addr_lower", 0)
        hi, lo = q.bits("constant_buffer_addr_upper", 0)
        if lo // 32 != hi // 32: raise NotImplementedError(f"{prefix}: constant buffer 0's upper address spans two words")
        self.bank_upper = (lo // 32 * 4, lo % 32, (1 << (hi - lo + 1)) - 1)  # (its 32-bit word's byte offset, shift, mask)
        self.dims = []
        for name in ("cta_raster_width", "cta_raster_height", "cta_raster_depth", "cta_thread_dimension0", "cta_thread_dimension1",
                     "cta_thread_dimension2"):
            hi, lo = q.bits(name)
            width = hi - lo + 1
            if lo % 8 or width not in (8, 16, 32): raise NotImplementedError(f"{prefix}: {name} is not a whole 8, 16 or 32-bit field")
            self.dims.append((lo // 8, "<" + {8: "B", 16: "H", 32: "I"}[width], (1 << width) - 1))


@functools.lru_cache(maxsize=None)
def qmd_layout(h: Any, prefix: str) -> QMDLayout:
    """The QMD patch layout of a QMD version (made once)."""
    return QMDLayout(h, prefix)


class NVCopyQueue(NVQueue):
    """Copy queue of an NV device: the copy engine's LAUNCH_DMA, semaphores through the host class."""
    kind = COPY

    def _memory_barrier(self) -> None:  # (the core allows it on compute queues only)
        raise HCQError("memory_barrier runs on compute queues")

    def _copy(self, dest: sint, src: sint, copy_size: sint, guard: HCQSignal | None) -> None:
        if guard is not None: raise HCQError("NV copy engines do not run cancellable copies (host_copies is not declared)")
        h = self.h
        launch = abi.fields(h, "NVC6B5_LAUNCH_DMA", data_transfer_type="non_pipelined", src_memory_layout="pitch", dst_memory_layout="pitch",
                            flush_enable="true")
        if isinstance(copy_size, Expr) or isinstance(dest, Expr) or isinstance(src, Expr):
            if isinstance(copy_size, int) and copy_size > MAX_COPY_LINE: raise ValueError("a copy with symbolic addresses moves at most 2 GiB")
            chunks: list[tuple[sint, sint]] = [(0, copy_size)]
        else:
            chunks = [(off, min(MAX_COPY_LINE, copy_size - off)) for off in range(0, int(copy_size), MAX_COPY_LINE)]
        for off, n in chunks:
            s_lo, s_hi = split64(src + off)
            d_lo, d_hi = split64(dest + off)
            self.method(SUBCH_COPY, h.NVC6B5_OFFSET_IN_UPPER, s_hi, s_lo, d_hi, d_lo)
            self.method(SUBCH_COPY, h.NVC6B5_LINE_LENGTH_IN, n)
            self.method(SUBCH_COPY, h.NVC6B5_LAUNCH_DMA, launch)


def check_semaphore_address(address: int) -> None:
    """Refuse a semaphore address wider than the GPU's host class takes (it would be truncated, not faulted)."""
    bits = abi.semaphore_bits()
    if address >> bits:
        raise HCQError(f"semaphore address 0x{address:x} does not fit the {bits}-bit semaphore addresses of this GPU's host class")


def method_words(h: Any, subchannel: int, method: int, *data: sint) -> list[sint]:
    """An incrementing method header (INC_METHOD: count, subchannel, method offset >> 2) and its data words."""
    if not data: raise ValueError("a method needs at least one data word")
    return [method_header(h, subchannel, method, len(data)), *data]


@functools.lru_cache(maxsize=1024)
def method_header(h: Any, subchannel: int, method: int, count: int) -> int:
    """The INC_METHOD header of `count` data words for `method` (a byte offset) on `subchannel`."""
    return (h.NVC56F_DMA_SEC_OP_INC_METHOD << abi.field(h, "NVC56F_DMA_SEC_OP")[1]) | \
           (count << abi.field(h, "NVC56F_DMA_METHOD_COUNT")[1]) | \
           (subchannel << abi.field(h, "NVC56F_DMA_METHOD_SUBCHANNEL")[1]) | (method >> 2)


def semaphore_words(h: Any, address: sint, payload: sint, **execute: Any) -> list[sint]:
    """A host-class semaphore operation: SEM_ADDR_LO/HI, SEM_PAYLOAD_LO/HI, SEM_EXECUTE (its fields by name)."""
    lo, hi = split64(payload)
    a_lo, a_hi = split64(address)
    return method_words(h, SUBCH_HOST, h.NVC56F_SEM_ADDR_LO, a_lo, a_hi, lo, hi, abi.fields(h, "NVC56F_SEM_EXECUTE", **execute))


def kernargs_layout(param_end: int) -> tuple[int, int]:
    """(bytes of constant bank 0 to reserve, kernargs block size) for a kernel whose parameters end at `param_end`:
    the bank, then the QMD at the next 256-byte boundary; a power of two, so that the allocator's blocks (aligned to
    their size) keep the QMD aligned."""
    bank = round_up(param_end, QMD_ALIGN)
    total = bank + QMD_BYTES
    return bank, 1 << (total - 1).bit_length()
