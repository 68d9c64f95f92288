"""The emulated GPU: channels that fetch GPFIFO entries, decode their pushbuffers and run the host, compute and copy
methods in them, as an NVIDIA GPU would. Everything is decoded from NVIDIA's published headers (`hcq.backends.nv.abi`):
the GPFIFO entry and method-header formats, method offsets and fields, the USERD layout and the QMD. Nothing is shared
with the backend's encoder, so a backend that encodes something wrongly finds out here.

Each channel runs in its own thread, with a seeded random generator that inserts short pauses between methods (and
between blocks of a kernel), so that a missing wait between channels shows up as a wrong result. An access outside
mapped memory, a method this GPU does not know, SET_OBJECT of a class not allocated on the channel, or a launch it
cannot run stops the channel (a fault): its text and address are kept and `on_fault` is told; other channels go on."""
from __future__ import annotations

import ctypes
import functools
import random
import re
import threading
import time
from dataclasses import dataclass, field
from types import ModuleType
from typing import Callable, Iterable

from hcq.atomics import cas64
from hcq.backends.nv import abi
from hcq.backends.nv.emulator.memory import AddressSpace, GpuFault
from hcq.backends.nv.emulator.twins import KernelLaunch, LaunchError, TwinRegistry
from hcq.helpers import getenv

FaultCallback = Callable[[int, str, int], None]  # (channel id, fault text, GPU address)
Handler = Callable[[int, int], None]  # (subchannel, method data)

# Methods this GPU runs: (header name, handler). A handler of None only stores the value (a register that a later
# method reads) or is an ordering no-op: a channel runs its methods in order, each to completion, so waits for idle,
# cache invalidations and memory barriers have nothing left to order. Names a driver branch does not define are left out.
HOST_METHODS: tuple[tuple[str, str | None], ...] = (
    ("NVC56F_SET_OBJECT", "_set_object"), ("NVC56F_NOP", None),
    ("NVC56F_SEM_ADDR_LO", None), ("NVC56F_SEM_ADDR_HI", None), ("NVC56F_SEM_PAYLOAD_LO", None), ("NVC56F_SEM_PAYLOAD_HI", None),
    ("NVC56F_SEM_EXECUTE", "_sem_execute"), ("NVC56F_NON_STALL_INTERRUPT", None), ("NVC56F_WFI", None),
    ("NVC56F_MEM_OP_A", None), ("NVC56F_MEM_OP_B", None), ("NVC56F_MEM_OP_C", None), ("NVC56F_MEM_OP_D", None),
)
COMPUTE_METHODS: tuple[tuple[str, str | None], ...] = (
    ("NVC6C0_NO_OPERATION", None), ("NVC6C0_WAIT_FOR_IDLE", None), ("NVC6C0_INVALIDATE_SHADER_CACHES_NO_WFI", None),
    *((f"NVC6C0_SET_SHADER_LOCAL_MEMORY_{r}", None) for r in ("A", "B", "WINDOW_A", "WINDOW_B", "NON_THROTTLED_A", "NON_THROTTLED_B",
                                                               "NON_THROTTLED_C", "THROTTLED_A", "THROTTLED_B", "THROTTLED_C")),
    ("NVC6C0_SET_SHADER_SHARED_MEMORY_WINDOW_A", None), ("NVC6C0_SET_SHADER_SHARED_MEMORY_WINDOW_B", None),
    ("NVC6C0_SET_REPORT_SEMAPHORE_A", None), ("NVC6C0_SET_REPORT_SEMAPHORE_B", None), ("NVC6C0_SET_REPORT_SEMAPHORE_C", None),
    ("NVC6C0_SET_REPORT_SEMAPHORE_D", "_report_semaphore"),
    ("NVC6C0_LINE_LENGTH_IN", None), ("NVC6C0_LINE_COUNT", None), ("NVC6C0_OFFSET_OUT_UPPER", None), ("NVC6C0_OFFSET_OUT", None),
    ("NVC6C0_PITCH_OUT", None), ("NVC6C0_LAUNCH_DMA", "_inline_launch"), ("NVC6C0_LOAD_INLINE_DATA", "_inline_data"),
    ("NVC6C0_SEND_PCAS_A", None), ("NVC6C0_SEND_SIGNALING_PCAS_B", "_pcas"), ("NVC6C0_SEND_SIGNALING_PCAS2_B", "_pcas2"),
)
COPY_METHODS: tuple[tuple[str, str | None], ...] = (
    ("NVC6B5_NOP", None), ("NVC6B5_OFFSET_IN_UPPER", None), ("NVC6B5_OFFSET_IN_LOWER", None), ("NVC6B5_OFFSET_OUT_UPPER", None),
    ("NVC6B5_OFFSET_OUT_LOWER", None), ("NVC6B5_PITCH_IN", None), ("NVC6B5_PITCH_OUT", None), ("NVC6B5_LINE_LENGTH_IN", None),
    ("NVC6B5_LINE_COUNT", None), ("NVC6B5_SET_SEMAPHORE_A", None), ("NVC6B5_SET_SEMAPHORE_B", None),
    ("NVC6B5_SET_SEMAPHORE_PAYLOAD", None), ("NVC6B5_SET_SEMAPHORE_PAYLOAD_UPPER", None), ("NVC6B5_LAUNCH_DMA", "_copy_launch"),
)
# The classes whose methods those are (they share the Ampere offsets), and the USERD layout of each GPFIFO class.
CLASS_KINDS = {"compute": (("AMPERE_COMPUTE_A", "AMPERE_COMPUTE_B", "ADA_COMPUTE_A", "HOPPER_COMPUTE_A"), COMPUTE_METHODS),
               "copy": (("AMPERE_DMA_COPY_A", "AMPERE_DMA_COPY_B", "HOPPER_DMA_COPY_A"), COPY_METHODS)}
USERD_OF = {"HOPPER_CHANNEL_GPFIFO_A": "HopperAControlGPFifo", "AMPERE_CHANNEL_GPFIFO_A": "AmpereAControlGPFifo"}
QMD = "NVC6C0_QMDV03_00"  # the launch descriptor these compute classes read


class ChannelFault(Exception):
    """What stops a channel: its text and the GPU address it concerns."""

    def __init__(self, text: str, address: int) -> None:
        super().__init__(text)
        self.text, self.address = text, address


class _Refused(Exception):
    """A method this GPU will not run (the caller adds which method, and where)."""


class _Stopped(Exception):
    """The channel is being removed, or the GPU closed."""


class _Layout:
    """Field ranges and constants of one headers module, looked up once."""

    def __init__(self, h: ModuleType) -> None:
        self.h = h
        self._ranges: dict[str, tuple[int, int]] = {}
        qmd_fields = [v for k, v in vars(h).items() if k.startswith(QMD + "_") and isinstance(v, tuple)]
        self.qmd_bytes = (max(hi for hi, _ in qmd_fields) + 1 + 7) // 8
        m = re.fullmatch(r".*QMDV(\d+)_(\d+)", QMD)
        assert m is not None
        self.qmd_version = (int(m.group(1)), int(m.group(2)))
        self.class_names = {getattr(h, n): n for kind in CLASS_KINDS.values() for n in kind[0] if hasattr(h, n)}
        self.class_names.update({getattr(h, n): n for n in USERD_OF if hasattr(h, n)})
        self.kind_of = {getattr(h, n): kind for kind, (names, _) in CLASS_KINDS.items() for n in names if hasattr(h, n)}

    def rng(self, name: str) -> tuple[int, int]:
        r = self._ranges.get(name)
        if r is None: r = self._ranges[name] = abi.field(self.h, name)
        return r

    def get(self, name: str, word: int) -> int:
        """Field `name` (a header bit range) of `word`."""
        hi, lo = self.rng(name)
        return (word >> lo) & ((1 << (hi - lo + 1)) - 1)

    def const(self, name: str) -> int:
        return int(getattr(self.h, name))

    def value_name(self, reg_field: str, value: int) -> str:
        """The header name of a field's value (for fault texts), else the number."""
        prefix = reg_field + "_"
        names = [k[len(prefix):] for k, v in vars(self.h).items() if k.startswith(prefix) and v == value and not isinstance(v, tuple)]
        return f"{names[0]} ({value})" if names else str(value)

    def named(self, reg_field: str, word: int) -> str:
        """Field `reg_field` of `word`, by its header name."""
        return self.value_name(reg_field, self.get(reg_field, word))

    def class_name(self, cls: int) -> str:
        return f"{self.class_names[cls]} ({cls:#x})" if cls in self.class_names else f"class {cls:#x}"


@functools.cache
def _layout(h: ModuleType) -> _Layout:
    return _Layout(h)


@dataclass
class _Inline:
    """An inline-to-memory copy waiting for its data: lines of `length` bytes at `dst`, `pitch` apart."""
    dst: int
    length: int
    count: int
    pitch: int
    data: bytearray = field(default_factory=bytearray)


@dataclass
class _Bound:
    """The object bound to a subchannel by SET_OBJECT: its class, method table and registers."""
    cls: int
    table: dict[int, tuple[str, Handler | None]]
    regs: dict[int, int] = field(default_factory=dict)
    inline: _Inline | None = None


class _Channel:
    """One GPFIFO channel and the thread that runs it."""

    def __init__(self, gpu: EmulatedGpu, channel_id: int, gpfifo_va: int, entries: int, userd_va: int, classes: frozenset[int]) -> None:
        self.gpu, self.id, self.gpfifo_va, self.entries, self.userd_va, self.classes = gpu, channel_id, gpfifo_va, entries, userd_va, classes
        self.L, self.space = gpu.layout, gpu.space
        h = self.L.h
        userd = next((getattr(h, USERD_OF[n]) for n in USERD_OF if getattr(h, n, None) in classes), getattr(h, USERD_OF["HOPPER_CHANNEL_GPFIFO_A"]))
        # the host class's semaphore address: Hopper's (C86F) has 25 upper bits, Ampere's (C56F) 8 (40-bit addresses)
        ampere = getattr(h, "AMPERE_CHANNEL_GPFIFO_A", None) in classes and getattr(h, "HOPPER_CHANNEL_GPFIFO_A", None) not in classes
        self.sem_addr_hi = "NVC56F_SEM_ADDR_HI_OFFSET" if ampere else "NVC86F_SEM_ADDR_HI_OFFSET"
        self.gp_put_va, self.gp_get_va = userd_va + userd.GPPut.offset, userd_va + userd.GPGet.offset
        self.gp_get = 0
        self.host = self._table(HOST_METHODS)
        self.tables = {kind: self._table(methods) for kind, (_, methods) in CLASS_KINDS.items()}
        self.host_regs: dict[int, int] = {}
        self.bound: dict[int, _Bound] = {}
        self.rng = random.Random(gpu.seed ^ channel_id)
        self.jitter: list[int] | None = [] if gpu.trace_jitter else None
        self.kicked = threading.Event()
        self.stopping = False
        self.thread = threading.Thread(target=self._run, name=f"nv-emu-channel-{channel_id}", daemon=True)

    def _table(self, methods: tuple[tuple[str, str | None], ...]) -> dict[int, tuple[str, Handler | None]]:
        return {self.L.const(name): (name, getattr(self, handler) if handler else None) for name, handler in methods if hasattr(self.L.h, name)}

    # ------------------------------------------------------------ fetching
    def _run(self) -> None:
        try:
            while True:
                self.kicked.wait()
                if self.stopping: return
                self.kicked.clear()
                self._drain()
        except _Stopped:
            return
        except ChannelFault as f:
            self.gpu._fault(self.id, f.text, f.address)
        except Exception as e:  # a bug of the emulator's: the channel stops, visibly
            self.gpu._fault(self.id, f"emulator error: {type(e).__name__}: {e}", 0)

    def _drain(self) -> None:
        """Run the GPFIFO entries from GPGet up to the GPPut in USERD, until GPPut stops moving."""
        while True:
            put = self._userd("reading GPPut")
            if put >= self.entries:
                raise ChannelFault(f"GPPut = {put} in USERD at {self.gp_put_va:#x} is past the end of the {self.entries}-entry GPFIFO",
                                   self.gp_put_va)
            if put == self.gp_get: return
            while self.gp_get != put:
                self._entry(self.gp_get)
                self.gp_get = (self.gp_get + 1) % self.entries
                self._userd("writing GPGet", self.gp_get)  # after the entry ran: its pushbuffer may be reused

    def _userd(self, what: str, store: int | None = None) -> int:
        """Read GPPut from USERD, or store GPGet there."""
        try:
            if store is None: return self.space.load32(self.gp_put_va)
            self.space.store32(self.gp_get_va, store)
            return store
        except GpuFault as e:
            raise ChannelFault(f"{e}, {what} in the USERD at {self.userd_va:#x}", e.address) from None

    def _entry(self, index: int) -> None:
        L = self.L
        size = L.const("NVC56F_GP_ENTRY__SIZE")
        va = self.gpfifo_va + index * size
        try:
            w0, w1 = self.space.load32(va), self.space.load32(va + 4)
        except GpuFault as e:
            raise ChannelFault(f"{e}, reading GPFIFO entry {index} (GPFIFO at {self.gpfifo_va:#x})", e.address) from None
        where = f"GPFIFO entry {index} at {va:#x} ({w0:#010x} {w1:#010x})"
        length = L.get("NVC56F_GP_ENTRY1_LENGTH", w1)
        if length == 0:  # a control entry
            opcode = L.get("NVC56F_GP_ENTRY1_OPCODE", w1)
            if opcode != L.const("NVC56F_GP_ENTRY1_OPCODE_NOP"):
                raise ChannelFault(f"{where}: control opcode {L.value_name('NVC56F_GP_ENTRY1_OPCODE', opcode)} is not emulated", va)
            return
        if L.get("NVC56F_GP_ENTRY1_LEVEL", w1) != L.const("NVC56F_GP_ENTRY1_LEVEL_MAIN"):
            raise ChannelFault(f"{where}: subroutine-level entries are not emulated", va)
        if L.get("NVC56F_GP_ENTRY0_FETCH", w0) != L.const("NVC56F_GP_ENTRY0_FETCH_UNCONDITIONAL"):
            raise ChannelFault(f"{where}: conditional fetch is not emulated", va)
        # (SYNC_WAIT needs nothing: every earlier entry has completed by now)
        seg = (L.get("NVC56F_GP_ENTRY1_GET_HI", w1) << 32) | (L.get("NVC56F_GP_ENTRY0_GET", w0) << L.rng("NVC56F_GP_ENTRY0_GET")[1])
        try:
            data = self.space.read(seg, length * 4)
        except GpuFault as e:
            raise ChannelFault(f"{e} fetching the pushbuffer segment of {where}", e.address) from None
        self._segment(seg, memoryview(data).cast("I"))

    def _segment(self, seg: int, words: memoryview) -> None:
        """Decode and run one pushbuffer segment."""
        L, n, i = self.L, len(words), 0
        inc, non_inc, one_inc = (L.const(f"NVC56F_DMA_SEC_OP_{op}") for op in ("INC_METHOD", "NON_INC_METHOD", "ONE_INC"))
        immd, end = L.const("NVC56F_DMA_SEC_OP_IMMD_DATA_METHOD"), L.const("NVC56F_DMA_SEC_OP_END_PB_SEGMENT")
        while i < n:
            header, header_va = words[i], seg + 4 * i
            i += 1
            op = L.get("NVC56F_DMA_SEC_OP", header)
            sc, method = L.get("NVC56F_DMA_METHOD_SUBCHANNEL", header), L.get("NVC56F_DMA_METHOD_ADDRESS", header) << 2
            if op in (inc, non_inc, one_inc):
                count = L.get("NVC56F_DMA_METHOD_COUNT", header)
                if i + count > n:
                    raise ChannelFault(f"method header {header:#010x} at {header_va:#x} is followed by {count} data words, but the "
                                       f"pushbuffer segment at {seg:#x} ends after {n - i}", header_va)
                for k in range(count):
                    step = k if op == inc else 0 if op == non_inc else min(k, 1)
                    self._method(sc, method + 4 * step, words[i + k], seg + 4 * (i + k))
                i += count
            elif op == immd:
                self._method(sc, method, L.get("NVC56F_DMA_IMMD_DATA", header), header_va)
            elif op == end:
                return
            elif header != L.const("NVC56F_DMA_NOP"):
                raise ChannelFault(f"pushbuffer word {header:#010x} at {header_va:#x}: header type "
                                   f"{L.value_name('NVC56F_DMA_SEC_OP', op)} is not emulated", header_va)

    def _method(self, sc: int, method: int, value: int, word_va: int) -> None:
        if self.stopping: raise _Stopped
        self._pause()
        bound = None
        entry = self.host.get(method)  # host methods (SET_OBJECT included) go to the channel itself, on any subchannel
        if entry is None:
            bound = self.bound.get(sc)
            if bound is None:
                raise ChannelFault(f"method {method:#x} = {value:#x} on subchannel {sc}, which has no object bound (no SET_OBJECT "
                                   f"before it); pushbuffer word at {word_va:#x}", word_va)
            entry = bound.table.get(method)
            if entry is None:
                raise ChannelFault(f"unknown method {method:#x} of {self.L.class_name(bound.cls)} (value {value:#x}, subchannel {sc}): "
                                   f"the emulator does not run it; pushbuffer word at {word_va:#x}", word_va)
        name, handler = entry
        (self.host_regs if bound is None else bound.regs)[method] = value
        if handler is None: return
        where = f"{name} = {value:#x} (subchannel {sc}, pushbuffer word at {word_va:#x})"
        try:
            handler(sc, value)
        except GpuFault as e:
            raise ChannelFault(f"{e}, in {where}", e.address) from None
        except LaunchError as e:
            raise ChannelFault(f"{e.text}, in {where}", e.address) from None
        except _Refused as e:
            raise ChannelFault(f"{e}, in {where}", word_va) from None

    def _pause(self) -> None:
        """The seeded random pause between methods: mostly none, sometimes a yield, now and then up to 200 us."""
        r = self.rng.random()
        us = 0 if r < 0.85 else -1 if r < 0.95 else self.rng.randrange(1, 201)
        if us: time.sleep(max(us, 0) * 1e-6)
        if self.jitter is not None: self.jitter.append(us)

    # ------------------------------------------------------------ host methods
    def _set_object(self, sc: int, value: int) -> None:
        cls = self.L.get("NVC56F_SET_OBJECT_NVCLASS", value)
        if cls not in self.classes:
            raise _Refused(f"SET_OBJECT of {self.L.class_name(cls)} on subchannel {sc}, but that class is not allocated on channel {self.id}")
        kind = self.L.kind_of.get(cls)
        if kind is None: raise _Refused(f"SET_OBJECT of {self.L.class_name(cls)}: the emulator runs no methods of that class")
        self.bound[sc] = _Bound(cls, self.tables[kind])

    def _sem_execute(self, sc: int, value: int) -> None:
        L, regs = self.L, self.host_regs
        addr = (L.get(self.sem_addr_hi, regs.get(L.const("NVC56F_SEM_ADDR_HI"), 0)) << 32) | \
               (L.get("NVC56F_SEM_ADDR_LO_OFFSET", regs.get(L.const("NVC56F_SEM_ADDR_LO"), 0)) << L.rng("NVC56F_SEM_ADDR_LO_OFFSET")[1])
        wide = L.get("NVC56F_SEM_EXECUTE_PAYLOAD_SIZE", value) == L.const("NVC56F_SEM_EXECUTE_PAYLOAD_SIZE_64BIT")
        payload = regs.get(L.const("NVC56F_SEM_PAYLOAD_LO"), 0) | ((regs.get(L.const("NVC56F_SEM_PAYLOAD_HI"), 0) << 32) if wide else 0)
        op = L.get("NVC56F_SEM_EXECUTE_OPERATION", value)
        if op == L.const("NVC56F_SEM_EXECUTE_OPERATION_RELEASE"):
            # (RELEASE_WFI needs nothing: everything before this method has completed)
            stamp = L.get("NVC56F_SEM_EXECUTE_RELEASE_TIMESTAMP", value) == L.const("NVC56F_SEM_EXECUTE_RELEASE_TIMESTAMP_EN")
            self._release(addr, payload, wide, stamp)
            return
        if op == L.const("NVC56F_SEM_EXECUTE_OPERATION_REDUCTION"):
            stamp = L.get("NVC56F_SEM_EXECUTE_RELEASE_TIMESTAMP", value) == L.const("NVC56F_SEM_EXECUTE_RELEASE_TIMESTAMP_EN")
            signed = L.get("NVC56F_SEM_EXECUTE_REDUCTION_FORMAT", value) == L.const("NVC56F_SEM_EXECUTE_REDUCTION_FORMAT_SIGNED")
            self._reduce(addr, payload, wide, L.get("NVC56F_SEM_EXECUTE_REDUCTION", value), signed, stamp)
            return
        bits = 64 if wide else 32
        mask = (1 << bits) - 1
        conditions: dict[str, Callable[[int], bool]] = {
            "ACQUIRE": lambda v: v == payload,
            "ACQ_STRICT_GEQ": lambda v: v >= payload,
            "ACQ_CIRC_GEQ": lambda v: ((v - payload) & mask) < 1 << (bits - 1),  # v - payload >= 0 as a signed difference
            "ACQ_AND": lambda v: (v & payload) != 0,
            "ACQ_NOR": lambda v: (~(v | payload) & mask) != 0,
        }
        for name, cond in conditions.items():
            if op == L.const(f"NVC56F_SEM_EXECUTE_OPERATION_{name}"):
                self._acquire(addr, wide, cond)
                return
        raise _Refused(f"semaphore operation {L.value_name('NVC56F_SEM_EXECUTE_OPERATION', op)} is not emulated")

    def _acquire(self, addr: int, wide: bool, cond: Callable[[int], bool]) -> None:
        """Wait until the semaphore satisfies `cond`: polled with short sleeps, for as long as it takes (a GPU has no timeout)."""
        load = self.space.load64 if wide else self.space.load32
        delay = 5e-6
        while not cond(load(addr)):
            if self.stopping: raise _Stopped
            time.sleep(delay)
            delay = min(delay * 2, 2e-4)

    def _release(self, addr: int, payload: int, wide: bool, timestamp: bool) -> None:
        """Write a semaphore: the GPU time at addr + 8 (with `timestamp`), then the payload, one aligned store.
        Everything this channel did before (kernel stores, copies) was done by this thread before these stores, and x86
        keeps a thread's stores in program order (TSO), so a host thread that sees the payload sees all of it; the
        timestamp is stored first for the same reason."""
        if timestamp: self.space.store64(addr + 8, self.gpu.time_ns())
        (self.space.store64 if wide else self.space.store32)(addr, payload)

    def _reduce(self, addr: int, operand: int, wide: bool, op: int, signed: bool, timestamp: bool) -> None:
        """A semaphore reduction: an atomic read-modify-write of the payload (a compare-and-swap loop on the aligned 8
        bytes holding it, so a host store racing it is never lost), then the GPU time at addr + 8 with `timestamp`."""
        bits = 64 if wide else 32
        mask = (1 << bits) - 1

        def as_signed(v: int) -> int:
            return v - (1 << bits) if signed and v >> (bits - 1) else v
        ops: dict[str, Callable[[int], int]] = {
            "IADD": lambda v: v + operand, "INC": lambda v: 0 if v >= operand else v + 1, "DEC": lambda v: operand if v == 0 or v > operand else v - 1,
            "IAND": lambda v: v & operand, "IOR": lambda v: v | operand, "IXOR": lambda v: v ^ operand,
            "IMIN": lambda v: min(as_signed(v), as_signed(operand)), "IMAX": lambda v: max(as_signed(v), as_signed(operand))}
        name = next((n for n in ops if op == self.L.const(f"NVC56F_SEM_EXECUTE_REDUCTION_{n}")), None)
        if name is None: raise _Refused(f"semaphore reduction {op} is not emulated")
        word = addr - addr % 8
        host = self.space.translate(word, 8, write=True)
        shift = 8 * (addr - word)
        while True:
            old64 = ctypes.c_uint64.from_address(host).value
            old = (old64 >> shift) & mask
            new64 = (old64 & ~(mask << shift)) | ((ops[name](old) & mask) << shift)
            if cas64(host, old64, new64) == old64: break
        if timestamp: self.space.store64(addr + 8, self.gpu.time_ns())

    # ------------------------------------------------------------ compute methods
    def _report_semaphore(self, sc: int, value: int) -> None:
        L, regs = self.L, self.bound[sc].regs
        op = L.get("NVC6C0_SET_REPORT_SEMAPHORE_D_OPERATION", value)
        if op != L.const("NVC6C0_SET_REPORT_SEMAPHORE_D_OPERATION_RELEASE"):
            raise _Refused(f"report semaphore operation {L.value_name('NVC6C0_SET_REPORT_SEMAPHORE_D_OPERATION', op)} is not emulated")
        if L.get("NVC6C0_SET_REPORT_SEMAPHORE_D_REDUCTION_ENABLE", value) == L.const("NVC6C0_SET_REPORT_SEMAPHORE_D_REDUCTION_ENABLE_TRUE"):
            raise _Refused("report semaphore reductions are not emulated")
        addr = (L.get("NVC6C0_SET_REPORT_SEMAPHORE_A_OFFSET_UPPER", regs.get(L.const("NVC6C0_SET_REPORT_SEMAPHORE_A"), 0)) << 32) | \
            L.get("NVC6C0_SET_REPORT_SEMAPHORE_B_OFFSET_LOWER", regs.get(L.const("NVC6C0_SET_REPORT_SEMAPHORE_B"), 0))
        payload = regs.get(L.const("NVC6C0_SET_REPORT_SEMAPHORE_C"), 0)
        four = L.get("NVC6C0_SET_REPORT_SEMAPHORE_D_STRUCTURE_SIZE", value) == L.const("NVC6C0_SET_REPORT_SEMAPHORE_D_STRUCTURE_SIZE_FOUR_WORDS")
        self._release(addr, payload, four, four)  # four words: the payload, a zero word, the timestamp

    def _inline_launch(self, sc: int, value: int) -> None:
        L, b = self.L, self.bound[sc]
        if b.inline is not None:
            raise _Refused(f"inline copy started while the one before still waits for {self._inline_total(b.inline) - len(b.inline.data)} bytes")
        if L.get("NVC6C0_LAUNCH_DMA_DST_MEMORY_LAYOUT", value) != L.const("NVC6C0_LAUNCH_DMA_DST_MEMORY_LAYOUT_PITCH"):
            raise _Refused("inline copies to block-linear memory are not emulated")
        if L.get("NVC6C0_LAUNCH_DMA_COMPLETION_TYPE", value) == L.const("NVC6C0_LAUNCH_DMA_COMPLETION_TYPE_RELEASE_SEMAPHORE"):
            raise _Refused("inline copies that release a semaphore are not emulated")
        if L.get("NVC6C0_LAUNCH_DMA_REDUCTION_ENABLE", value) == L.const("NVC6C0_LAUNCH_DMA_REDUCTION_ENABLE_TRUE"):
            raise _Refused("inline copies with reduction are not emulated")
        r = b.regs.get
        dst = (L.get("NVC6C0_OFFSET_OUT_UPPER_VALUE", r(L.const("NVC6C0_OFFSET_OUT_UPPER"), 0)) << 32) | r(L.const("NVC6C0_OFFSET_OUT"), 0)
        inline = _Inline(dst, r(L.const("NVC6C0_LINE_LENGTH_IN"), 0), r(L.const("NVC6C0_LINE_COUNT"), 0), r(L.const("NVC6C0_PITCH_OUT"), 0))
        for line in range(inline.count if inline.length else 0):  # the destination must be there before the data comes
            self.space.translate(dst + line * inline.pitch, inline.length, write=True)
        if self._inline_total(inline): b.inline = inline

    @staticmethod
    def _inline_total(inline: _Inline) -> int:
        return inline.length * inline.count

    def _inline_data(self, sc: int, value: int) -> None:
        b = self.bound[sc]
        inline = b.inline
        if inline is None: raise _Refused("inline data with no inline copy (LAUNCH_DMA) waiting for it")
        inline.data += value.to_bytes(4, "little")
        total = self._inline_total(inline)
        if len(inline.data) < total: return
        # (the data is packed: lines follow each other in the data words, the last word padded)
        for line in range(inline.count):
            self.space.write(inline.dst + line * inline.pitch, inline.data[line * inline.length:(line + 1) * inline.length])
        b.inline = None

    def _pcas(self, sc: int, value: int) -> None:
        L = self.L
        if L.get("NVC6C0_SEND_SIGNALING_PCAS_B_SCHEDULE", value) == L.const("NVC6C0_SEND_SIGNALING_PCAS_B_SCHEDULE_TRUE"): self._launch(sc)

    def _pcas2(self, sc: int, value: int) -> None:
        L = self.L
        action = L.get("NVC6C0_SEND_SIGNALING_PCAS2_B_PCAS_ACTION", value)
        names = {L.const(f"NVC6C0_SEND_SIGNALING_PCAS2_B_PCAS_ACTION_{a}"): a for a in ("NOP", "INVALIDATE", "SCHEDULE", "INVALIDATE_COPY_SCHEDULE")}
        if action not in names:
            raise _Refused(f"PCAS action {L.value_name('NVC6C0_SEND_SIGNALING_PCAS2_B_PCAS_ACTION', action)} is not emulated")
        if names[action].endswith("SCHEDULE"): self._launch(sc)

    def _launch(self, sc: int) -> None:
        """Run the QMD at SEND_PCAS_A << 8: the grid on the kernel's CPU twin, then the QMD's semaphore releases."""
        L, b = self.L, self.bound[sc]
        qmd_va = b.regs.get(L.const("NVC6C0_SEND_PCAS_A"), 0) << 8
        try:
            raw = int.from_bytes(self.space.read(qmd_va, L.qmd_bytes), "little")
        except GpuFault as e:
            raise GpuFault(e.address, e.access, f"{e.reason} (reading the {L.qmd_bytes}-byte QMD at {qmd_va:#x})") from None

        def q(name: str, index: int | None = None) -> int:
            rng = getattr(L.h, f"{QMD}_{name}")
            hi, lo = rng(index) if index is not None else rng
            return (raw >> lo) & ((1 << (hi - lo + 1)) - 1)

        version = (q("QMD_MAJOR_VERSION"), q("QMD_VERSION"))
        if version != L.qmd_version:
            raise LaunchError(f"QMD at {qmd_va:#x} is version {version[0]}.{version[1]}; {L.class_name(b.cls)} reads "
                              f"{L.qmd_version[0]}.{L.qmd_version[1]}", qmd_va)
        launch = KernelLaunch(
            qmd_va=qmd_va, program_va=(q("PROGRAM_ADDRESS_UPPER") << 32) | q("PROGRAM_ADDRESS_LOWER"),
            grid=(q("CTA_RASTER_WIDTH"), q("CTA_RASTER_HEIGHT"), q("CTA_RASTER_DEPTH")),
            block=(q("CTA_THREAD_DIMENSION0"), q("CTA_THREAD_DIMENSION1"), q("CTA_THREAD_DIMENSION2")),
            registers=q("REGISTER_COUNT_V"), shared_bytes=q("SHARED_MEMORY_SIZE"),
            cbank0_valid=q("CONSTANT_BUFFER_VALID", 0) == L.const(f"{QMD}_CONSTANT_BUFFER_VALID_TRUE"),
            cbank0_va=(q("CONSTANT_BUFFER_ADDR_UPPER", 0) << 32) | q("CONSTANT_BUFFER_ADDR_LOWER", 0),
            cbank0_size=q("CONSTANT_BUFFER_SIZE_SHIFTED4", 0) << 4)
        prepared = self.gpu.twins.prepare(self.space, launch)
        start = 0
        while start < prepared.nblocks:  # now and then in pieces, with a pause between
            stop = prepared.nblocks if self.rng.random() < 0.7 else self.rng.randrange(start + 1, prepared.nblocks + 1)
            prepared.run(start, stop)
            start = stop
            if start < prepared.nblocks: self._pause()
        for i in (0, 1):
            if q(f"RELEASE{i}_ENABLE") != L.const(f"{QMD}_RELEASE{i}_ENABLE_TRUE"): continue
            if q(f"RELEASE{i}_REDUCTION_ENABLE") == L.const(f"{QMD}_RELEASE{i}_REDUCTION_ENABLE_TRUE"):
                raise LaunchError(f"QMD at {qmd_va:#x}: RELEASE{i} with a reduction is not emulated", qmd_va)
            addr = (q(f"RELEASE{i}_ADDRESS_UPPER") << 32) | q(f"RELEASE{i}_ADDRESS_LOWER")
            wide = q(f"RELEASE{i}_PAYLOAD64B") == L.const(f"{QMD}_RELEASE{i}_PAYLOAD64B_TRUE")
            payload = q(f"RELEASE{i}_PAYLOAD_LOWER") | ((q(f"RELEASE{i}_PAYLOAD_UPPER") << 32) if wide else 0)
            size = q(f"RELEASE{i}_STRUCTURE_SIZE")
            if size == L.const(f"{QMD}_RELEASE{i}_STRUCTURE_SIZE_SEMAPHORE_ONE_WORD"): self._release(addr, payload, wide, False)
            elif size == L.const(f"{QMD}_RELEASE{i}_STRUCTURE_SIZE_SEMAPHORE_TWO_WORDS"): self._release(addr, payload, True, False)
            elif size == L.const(f"{QMD}_RELEASE{i}_STRUCTURE_SIZE_SEMAPHORE_FOUR_WORDS"): self._release(addr, payload, True, True)
            else: raise LaunchError(f"QMD at {qmd_va:#x}: RELEASE{i} structure size {size} is not defined", qmd_va)

    # ------------------------------------------------------------ copy methods
    def _copy_launch(self, sc: int, value: int) -> None:
        L, r = self.L, self.bound[sc].regs.get

        def is_(fld: str, val: str) -> bool:
            return L.get(f"NVC6B5_LAUNCH_DMA_{fld}", value) == L.const(f"NVC6B5_LAUNCH_DMA_{fld}_{val}")

        def addr(upper: str, lower: str) -> int:
            return (L.get(f"NVC6B5_{upper}_UPPER", r(L.const(f"NVC6B5_{upper}"), 0)) << 32) | r(L.const(f"NVC6B5_{lower}"), 0)

        if not is_("DATA_TRANSFER_TYPE", "NONE"):
            for fld, val in (("SRC_MEMORY_LAYOUT", "PITCH"), ("DST_MEMORY_LAYOUT", "PITCH"), ("SRC_TYPE", "VIRTUAL"),
                             ("DST_TYPE", "VIRTUAL"), ("REMAP_ENABLE", "FALSE")):
                if not is_(fld, val): raise _Refused(f"copies with {fld} = {L.named('NVC6B5_LAUNCH_DMA_' + fld, value)} are not emulated")
            src, dst = addr("OFFSET_IN_UPPER", "OFFSET_IN_LOWER"), addr("OFFSET_OUT_UPPER", "OFFSET_OUT_LOWER")
            length = r(L.const("NVC6B5_LINE_LENGTH_IN"), 0)
            multi = is_("MULTI_LINE_ENABLE", "TRUE")
            lines = r(L.const("NVC6B5_LINE_COUNT"), 0) if multi else 1
            pitch_in, pitch_out = (r(L.const("NVC6B5_PITCH_IN"), 0), r(L.const("NVC6B5_PITCH_OUT"), 0)) if multi else (0, 0)
            for line in range(lines if length else 0):
                s = self.space.translate(src + line * pitch_in, length)
                d = self.space.translate(dst + line * pitch_out, length, write=True)
                ctypes.memmove(d, s, length)
        if is_("SEMAPHORE_TYPE", "NONE"): return
        if is_("SEMAPHORE_REDUCTION_ENABLE", "TRUE"): raise _Refused("copy-engine semaphore reductions are not emulated")
        sem = addr("SET_SEMAPHORE_A", "SET_SEMAPHORE_B")
        upper = r(L.const("NVC6B5_SET_SEMAPHORE_PAYLOAD_UPPER"), 0) if hasattr(L.h, "NVC6B5_SET_SEMAPHORE_PAYLOAD_UPPER") else 0
        payload = r(L.const("NVC6B5_SET_SEMAPHORE_PAYLOAD"), 0)
        if is_("SEMAPHORE_TYPE", "RELEASE_ONE_WORD_SEMAPHORE"): self._release(sem, payload, False, False)
        elif is_("SEMAPHORE_TYPE", "RELEASE_FOUR_WORD_SEMAPHORE"): self._release(sem, payload | upper << 32, True, True)
        else: raise _Refused(f"copy semaphore type {L.named('NVC6B5_LAUNCH_DMA_SEMAPHORE_TYPE', value)} is not emulated")


class EmulatedGpu:
    """The emulated GPU over an address space: channels, their threads, the CPU twins of kernels and the GPU timer.

    `seed` (default: $HCQ_NV_EMULATE_SEED, else random; kept in `.seed`) fixes each channel's pauses (channel c uses
    seed ^ c) and the timer's offset. `timer_ns`: the GPU clock (default: the host's monotonic clock plus a fixed random
    offset, so a backend that does not calibrate shows wrong times). `on_fault(channel_id, text, address)` is called once
    per faulting channel, from its thread. `trace_jitter` keeps each channel's pauses (`jitter_of`) for tests."""

    def __init__(self, space: AddressSpace, headers: ModuleType | None = None, seed: int | None = None,
                 timer_ns: Callable[[], int] | None = None, on_fault: FaultCallback | None = None, trace_jitter: bool = False) -> None:
        self.space = space
        self.layout = _layout(headers if headers is not None else abi.headers())
        if seed is None:
            seed = getenv("HCQ_NV_EMULATE_SEED", -1, lo=0)
            if seed < 0: seed = random.SystemRandom().randrange(1 << 32)
        self.seed = seed
        offset = random.Random(seed).randrange(1 << 44, 1 << 50)
        self._timer = timer_ns if timer_ns is not None else lambda: time.monotonic_ns() + offset
        self.on_fault = on_fault
        self.trace_jitter = trace_jitter
        self.twins = TwinRegistry()
        self._lock = threading.Lock()
        self._channels: dict[int, _Channel] = {}
        self._faults: dict[int, tuple[str, int]] = {}
        self._closed = False

    def add_channel(self, channel_id: int, gpfifo_va: int, entries: int, userd_va: int, classes: Iterable[int]) -> None:
        """Start channel `channel_id`: a GPFIFO of `entries` entries at `gpfifo_va`, its USERD at `userd_va`, and the
        classes allocated on it (its GPFIFO class picks the USERD layout; SET_OBJECT may bind only these)."""
        if entries <= 0: raise ValueError(f"channel {channel_id}: a GPFIFO needs at least one entry, not {entries}")
        with self._lock:
            if self._closed: raise RuntimeError("the emulated GPU is closed")
            if channel_id in self._channels: raise ValueError(f"channel {channel_id} exists already")
            ch = self._channels[channel_id] = _Channel(self, channel_id, gpfifo_va, entries, userd_va, frozenset(classes))
            self._faults.pop(channel_id, None)
        ch.thread.start()

    def remove_channel(self, channel_id: int, timeout_s: float = 1.0) -> None:
        """Stop and forget a channel (its fault, if any, stays readable); waits up to `timeout_s` for its thread."""
        with self._lock:
            ch = self._channels.pop(channel_id, None)
        if ch is None: raise KeyError(f"no channel {channel_id}")
        self._stop([ch], timeout_s)

    def kick(self, channel_id: int) -> None:
        """The doorbell: the channel reads GPPut from its USERD and runs the entries up to it (a faulted channel: nothing)."""
        ch = self._channels.get(channel_id)
        if ch is None: raise KeyError(f"no channel {channel_id}")
        ch.kicked.set()

    def fault_of(self, channel_id: int) -> tuple[str, int] | None:
        """(text, GPU address) of the fault that stopped the channel, or None."""
        return self._faults.get(channel_id)

    def jitter_of(self, channel_id: int) -> list[int]:
        """The pauses a channel made so far, in microseconds (-1: a yield), when built with trace_jitter."""
        jitter = self._channels[channel_id].jitter
        if jitter is None: raise ValueError("the GPU keeps no pauses: build it with trace_jitter=True")
        return list(jitter)

    def time_ns(self) -> int:
        """The GPU timer, in ns."""
        return self._timer()

    def close(self, timeout_s: float = 1.0) -> None:
        """Stop every channel; a thread still inside a kernel after `timeout_s` is left behind (daemon)."""
        with self._lock:
            self._closed = True
            channels = list(self._channels.values())
            self._channels.clear()
        self._stop(channels, timeout_s)

    @staticmethod
    def _stop(channels: list[_Channel], timeout_s: float) -> None:
        for ch in channels:
            ch.stopping = True
            ch.kicked.set()
        deadline = time.monotonic() + timeout_s
        for ch in channels:
            if ch.thread is not threading.current_thread(): ch.thread.join(max(deadline - time.monotonic(), 0))

    def _fault(self, channel_id: int, text: str, address: int) -> None:
        text = f"channel {channel_id}: {text} [HCQ_NV_EMULATE_SEED={self.seed}]"
        self._faults[channel_id] = (text, address)
        if self.on_fault is not None: self.on_fault(channel_id, text, address)
