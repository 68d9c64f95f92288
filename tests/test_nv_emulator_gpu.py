"""The emulated NVIDIA GPU (hcq/backends/nv/emulator): address space, GPFIFO and pushbuffer decoding, host semaphores,
copies, inline data, report semaphores, QMD launches of CPU twins, faults, seeded interleaving and close.

The test is its own little encoder: GPFIFO entries, method headers and QMDs are built here from the header constants
(nothing is shared with the backend's encoder), in an AddressSpace over a ctypes buffer."""
import ctypes
import random
import struct
import threading
import time

import pytest

from hcq.backends.nv import abi

if abi.unavailable_reason(): pytest.skip(abi.unavailable_reason(), allow_module_level=True)

from hcq.backends.nv.cubin import CubinKernel, CubinParam  # noqa: E402
from hcq.backends.nv.emulator.gpu import EmulatedGpu  # noqa: E402
from hcq.backends.nv.emulator.memory import AddressSpace, GpuFault  # noqa: E402
from hcq.errors import CompileError  # noqa: E402

h = abi.headers()
BASE = 0x7_1230_0000  # above 4 GiB: the high address words are exercised too
SIZE = 1 << 22
HOST, COMPUTE, COPY = 0, 1, 4  # subchannels
CLASSES = (h.HOPPER_CHANNEL_GPFIFO_A, h.HOPPER_COMPUTE_A, h.HOPPER_DMA_COPY_A)
USERD = h.HopperAControlGPFifo
QMD = "NVC6C0_QMDV03_00"
QMD_BYTES = (max(v[0] for k, v in vars(h).items() if k.startswith(QMD + "_") and isinstance(v, tuple)) + 1) // 8

ADD = "HCQ_KERNEL void add(float *out, const float *a, float b) { int i = hcq_global_id(0); out[i] = a[i] + b; }"
# What read_cubin gives for ADD (NVRTC 13, sm_90), written out so the launch tests need no NVRTC.
ADD_KERNEL = CubinKernel("add", registers=10, shared_bytes=0, local_bytes=0, cbank0_size=0x224, param_base=0x210,
                         params=(CubinParam(0, 0, 8), CubinParam(1, 8, 8), CubinParam(2, 16, 4)), param_size=20)
SPIN = "HCQ_KERNEL void spin(volatile int *flag) { flag[1] = 1; while (!flag[0]) {} }"
SPIN_KERNEL = CubinKernel("spin", registers=8, shared_bytes=0, local_bytes=0, cbank0_size=0x218, param_base=0x210,
                          params=(CubinParam(0, 0, 8),), param_size=8)


# ---------------------------------------------------------------- the test's encoder
def fld(name: str, value: int) -> int:
    hi, lo = abi.field(h, name)
    assert 0 <= value < 1 << (hi - lo + 1), (name, value)
    return value << lo


def header(op: int, sc: int, method: int, count: int) -> int:
    return (fld("NVC56F_DMA_SEC_OP", op) | fld("NVC56F_DMA_METHOD_COUNT", count) | fld("NVC56F_DMA_METHOD_SUBCHANNEL", sc)
            | fld("NVC56F_DMA_METHOD_ADDRESS", method >> 2))


def inc(sc: int, method: int, *data: int) -> list[int]:
    return [header(h.NVC56F_DMA_SEC_OP_INC_METHOD, sc, method, len(data)), *data]


def non_inc(sc: int, method: int, *data: int) -> list[int]:
    return [header(h.NVC56F_DMA_SEC_OP_NON_INC_METHOD, sc, method, len(data)), *data]


def one_inc(sc: int, method: int, *data: int) -> list[int]:
    return [header(h.NVC56F_DMA_SEC_OP_ONE_INC, sc, method, len(data)), *data]


def immd(sc: int, method: int, value: int) -> list[int]:
    return [fld("NVC56F_DMA_SEC_OP", h.NVC56F_DMA_SEC_OP_IMMD_DATA_METHOD) | fld("NVC56F_DMA_IMMD_DATA", value)
            | fld("NVC56F_DMA_METHOD_SUBCHANNEL", sc) | fld("NVC56F_DMA_METHOD_ADDRESS", method >> 2)]


def set_object(sc: int, cls: int) -> list[int]:
    return inc(sc, h.NVC56F_SET_OBJECT, fld("NVC56F_SET_OBJECT_NVCLASS", cls))


def sem(addr: int, payload: int, operation: str | int, wide: bool = True, timestamp: bool = False, **more: str) -> list[int]:
    execute = abi.fields(h, "NVC56F_SEM_EXECUTE", operation=operation, payload_size="64bit" if wide else "32bit",
                         release_timestamp="en" if timestamp else "dis", release_wfi="en", **more)
    return inc(HOST, h.NVC56F_SEM_ADDR_LO, addr & 0xFFFFFFFF, addr >> 32, payload & 0xFFFFFFFF, payload >> 32, execute)


def setup() -> list[int]:
    return set_object(COMPUTE, h.HOPPER_COMPUTE_A) + set_object(COPY, h.HOPPER_DMA_COPY_A)


def copy(src: int, dst: int, length: int, lines: int = 0, pitch_in: int = 0, pitch_out: int = 0, semaphore: tuple | None = None) -> list[int]:
    words = inc(COPY, h.NVC6B5_OFFSET_IN_UPPER, src >> 32, src & 0xFFFFFFFF, dst >> 32, dst & 0xFFFFFFFF)
    if lines: words += inc(COPY, h.NVC6B5_PITCH_IN, pitch_in, pitch_out, length, lines)
    else: words += inc(COPY, h.NVC6B5_LINE_LENGTH_IN, length)
    kind = {}
    if semaphore is not None:
        addr, payload, four = semaphore
        words += inc(COPY, h.NVC6B5_SET_SEMAPHORE_A, addr >> 32, addr & 0xFFFFFFFF, payload)
        kind = {"semaphore_type": "release_four_word_semaphore" if four else "release_one_word_semaphore"}
    return words + inc(COPY, h.NVC6B5_LAUNCH_DMA, abi.fields(h, "NVC6B5_LAUNCH_DMA", data_transfer_type="non_pipelined",
                                                            src_memory_layout="pitch", dst_memory_layout="pitch", flush_enable="true",
                                                            multi_line_enable="true" if lines else "false", **kind))


class Qmd:
    """A V03_00 launch descriptor, field by field."""

    def __init__(self) -> None:
        self.value = 0
        self.set("QMD_MAJOR_VERSION", 3)  # (V03_00)

    def set(self, name: str, value: int, index: int | None = None) -> "Qmd":
        rng = getattr(h, f"{QMD}_{name}")
        hi, lo = rng(index) if index is not None else rng
        assert 0 <= value < 1 << (hi - lo + 1), (name, value)
        self.value = (self.value & ~(((1 << (hi - lo + 1)) - 1) << lo)) | value << lo
        return self

    def bytes(self) -> bytes:
        return self.value.to_bytes(QMD_BYTES, "little")


def launch_words(qmd_va: int) -> list[int]:
    return inc(COMPUTE, h.NVC6C0_SEND_PCAS_A, qmd_va >> 8) + inc(
        COMPUTE, h.NVC6C0_SEND_SIGNALING_PCAS2_B, abi.fields(h, "NVC6C0_SEND_SIGNALING_PCAS2_B", pcas_action="invalidate_copy_schedule"))


# ---------------------------------------------------------------- a GPU over test memory
class Rig:
    def __init__(self, seed: int = 1, **kw) -> None:
        self.buf = (ctypes.c_uint8 * SIZE)()
        self.space = AddressSpace()
        self.space.map(BASE, SIZE, ctypes.addressof(self.buf), "test memory")
        self.faults: list[tuple[int, str, int]] = []
        self.gpu = EmulatedGpu(self.space, seed=seed, on_fault=lambda c, t, a: self.faults.append((c, t, a)), **kw)
        self.top = BASE

    def alloc(self, n: int, align: int = 256) -> int:
        va = (self.top + align - 1) // align * align
        self.top = va + n
        assert self.top <= BASE + SIZE
        return va

    def data(self, payload: bytes, align: int = 256) -> int:
        va = self.alloc(len(payload), align)
        self.space.write(va, payload)
        return va

    def channel(self, cid: int, classes=CLASSES, entries: int = 16) -> "Chan":
        return Chan(self, cid, classes, entries)

    def code(self, text: bytes, kernel: CubinKernel, source: str) -> int:
        va = self.data(text)
        self.gpu.twins.register(text, kernel, source)
        return va

    def kernel_qmd(self, kernel: CubinKernel, program_va: int, params: list[bytes], grid=(1, 1, 1), block=(1, 1, 1), **fields) -> int:
        cb = self.alloc(kernel.cbank0_size)
        for p, raw in zip(kernel.params, params): self.space.write(cb + kernel.param_base + p.offset, raw)
        q = Qmd().set("PROGRAM_ADDRESS_LOWER", program_va & 0xFFFFFFFF).set("PROGRAM_ADDRESS_UPPER", program_va >> 32)
        for name, v in zip(("CTA_RASTER_WIDTH", "CTA_RASTER_HEIGHT", "CTA_RASTER_DEPTH"), grid): q.set(name, v)
        for name, v in zip(("CTA_THREAD_DIMENSION0", "CTA_THREAD_DIMENSION1", "CTA_THREAD_DIMENSION2"), block): q.set(name, v)
        q.set("REGISTER_COUNT_V", kernel.registers).set("SHARED_MEMORY_SIZE", kernel.shared_bytes)
        q.set("CONSTANT_BUFFER_VALID", getattr(h, f"{QMD}_CONSTANT_BUFFER_VALID_TRUE"), 0)
        q.set("CONSTANT_BUFFER_ADDR_LOWER", cb & 0xFFFFFFFF, 0).set("CONSTANT_BUFFER_ADDR_UPPER", cb >> 32, 0)
        q.set("CONSTANT_BUFFER_SIZE_SHIFTED4", (kernel.cbank0_size + 15) >> 4, 0)
        for name, v in fields.items(): q.set(name, v)
        return self.data(q.bytes())

    def u32(self, va: int) -> int:
        return self.space.load32(va)

    def u64(self, va: int) -> int:
        return self.space.load64(va)


class Chan:
    def __init__(self, rig: Rig, cid: int, classes, entries: int) -> None:
        self.rig, self.cid, self.entries, self.put = rig, cid, entries, 0
        self.gpfifo, self.userd = rig.alloc(entries * 8), rig.alloc(ctypes.sizeof(USERD))
        rig.gpu.add_channel(cid, self.gpfifo, entries, self.userd, classes)

    def submit(self, *parts: list[int]) -> None:
        words = [w for p in parts for w in p]
        pb = self.rig.data(struct.pack(f"<{len(words)}I", *words), 4)
        entry = self.gpfifo + self.put * 8
        self.rig.space.store32(entry, fld("NVC56F_GP_ENTRY0_GET", (pb & 0xFFFFFFFF) >> 2))
        self.rig.space.store32(entry + 4, fld("NVC56F_GP_ENTRY1_GET_HI", pb >> 32) | fld("NVC56F_GP_ENTRY1_LENGTH", len(words))
                               | fld("NVC56F_GP_ENTRY1_LEVEL", h.NVC56F_GP_ENTRY1_LEVEL_MAIN))
        self.put = (self.put + 1) % self.entries
        self.rig.space.store32(self.userd + USERD.GPPut.offset, self.put)
        self.rig.gpu.kick(self.cid)

    def idle(self) -> bool:
        return self.rig.u32(self.userd + USERD.GPGet.offset) == self.put

    def fault(self) -> str:
        until(lambda: self.rig.gpu.fault_of(self.cid) is not None)
        return self.rig.gpu.fault_of(self.cid)[0]


def until(cond, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.0005)


@pytest.fixture
def rig():
    r = Rig()
    yield r
    r.gpu.close()


# ---------------------------------------------------------------- address space
def test_address_space_maps_translates_and_faults():
    bufs = [(ctypes.c_uint8 * 4096)() for _ in range(3)]
    space = AddressSpace()
    for i, b in enumerate(bufs): space.map(0x10000 * (i + 1), 4096, ctypes.addressof(b), f"buf{i}", writable=i != 2)
    assert space.translate(0x20010, 16) == ctypes.addressof(bufs[1]) + 0x10
    with pytest.raises(ValueError, match="overlaps buf1"): space.map(0x20800, 4096, ctypes.addressof(bufs[0]), "clash")
    with pytest.raises(ValueError, match="overlaps buf1"): space.map(0x1F800, 4096, ctypes.addressof(bufs[0]), "clash")
    with pytest.raises(GpuFault, match="no memory is mapped") as e: space.read(0x18000, 4)
    assert (e.value.address, e.value.access) == (0x18000, "read")
    with pytest.raises(GpuFault, match="run past the end of buf0"): space.read(0x10FF0, 32)
    with pytest.raises(GpuFault, match="read-only") as e: space.store32(0x30000, 1)
    assert e.value.access == "write"
    with pytest.raises(GpuFault, match="aligned"): space.load64(0x10004)
    space.store64(0x10008, 0x1122334455667788)
    assert space.read(0x10008, 8) == (0x1122334455667788).to_bytes(8, "little") and space.load32(0x1000C) == 0x11223344
    assert space.unmap(0x20000).what == "buf1" and space.find(0x20010) is None
    with pytest.raises(KeyError): space.unmap(0x20000)
    assert [m.what for m in space.mappings()] == ["buf0", "buf2"]


# ---------------------------------------------------------------- host semaphores
def test_semaphore_releases_32_and_64_bit_with_and_without_timestamp(rig):
    ch = rig.channel(1)
    s = [rig.data(b"\xaa" * 16, 16) for _ in range(3)]
    before = rig.gpu.time_ns()
    ch.submit(sem(s[0], 0x1_2345_6789, "release", timestamp=True), sem(s[1], 0xCAFE, "release", wide=False),
              sem(s[2], 0xFFFF_0000_0000_0001, "release"))
    until(ch.idle)
    assert rig.u64(s[0]) == 0x1_2345_6789 and before <= rig.u64(s[0] + 8) <= rig.gpu.time_ns()
    assert rig.space.read(s[1], 16) == (0xCAFE).to_bytes(4, "little") + b"\xaa" * 12  # 32 bits, no timestamp
    assert rig.u64(s[2]) == 0xFFFF_0000_0000_0001 and rig.space.read(s[2] + 8, 8) == b"\xaa" * 8
    assert abs(rig.gpu.time_ns() - time.monotonic_ns()) > 10**12  # the GPU clock is not the host's
    assert not rig.faults


def test_semaphore_reductions_are_atomic_and_may_write_the_time(rig):
    """A reduction adding 0 with a timestamp leaves the value and records the GPU time (hcq's `timestamp` command); the
    others combine the payload with the value, on 32 or 64 bits."""
    ch = rig.channel(2)
    s = [rig.data((1000).to_bytes(8, "little") + b"\xaa" * 8, 16) for _ in range(4)]
    before = rig.gpu.time_ns()
    ch.submit(sem(s[0], 0, "reduction", timestamp=True, reduction="iadd", reduction_format="unsigned"),
              sem(s[1], 5, "reduction", reduction="iadd", reduction_format="unsigned"),
              sem(s[2], 0xF0F, "reduction", wide=False, reduction="iand", reduction_format="unsigned"),
              sem(s[3], 7, "reduction", reduction="imin", reduction_format="signed"))
    until(ch.idle)
    assert rig.u64(s[0]) == 1000 and before <= rig.u64(s[0] + 8) <= rig.gpu.time_ns()
    assert rig.u64(s[1]) == 1005 and rig.space.read(s[1] + 8, 8) == b"\xaa" * 8  # no timestamp asked
    assert rig.u64(s[2]) == 1000 & 0xF0F and rig.u64(s[3]) == 7
    assert not rig.faults


ACQUIRES = [  # operation, 64-bit, payload, a value that does not satisfy it, one that does
    ("acquire", False, 7, 6, 7),
    ("acquire", True, 1 << 40 | 7, 7, 1 << 40 | 7),
    ("acq_strict_geq", False, 100, 99, 101),
    ("acq_strict_geq", True, 1 << 33, (1 << 33) - 1, 1 << 33),
    ("acq_circ_geq", False, 0xFFFF_FFF0, 0xFFFF_FF00, 0x10),  # past the wrap is later
    ("acq_circ_geq", True, 5, 1 << 63 | 5, 6),
    ("acq_and", False, 0b100, 0b011, 0b110),
    ("acq_and", True, 1 << 50, (1 << 50) - 1, 1 << 50),
    ("acq_nor", False, 0b0101, 0xFFFF_FFFA, 0),
]


@pytest.mark.parametrize("operation,wide,payload,unsatisfied,satisfied", ACQUIRES)
def test_acquire_waits_until_its_condition_holds(rig, operation, wide, payload, unsatisfied, satisfied):
    ch = rig.channel(1)
    s, marker = rig.alloc(8, 8), rig.alloc(16, 16)
    rig.space.store64(s, unsatisfied)
    ch.submit(sem(s, payload, operation, wide), sem(marker, 1, "release"))
    time.sleep(0.02)
    assert rig.u64(marker) == 0, "the acquire passed with its condition unmet"
    (rig.space.store64 if wide else rig.space.store32)(s, satisfied)
    until(lambda: rig.u64(marker) == 1)
    assert not rig.faults


def test_two_channels_ordered_by_a_semaphore():
    for seed in range(4):
        r = Rig(seed)
        try:
            waiter, producer = r.channel(1), r.channel(2)
            n = 64 * 1024
            src = r.data(random.Random(seed).randbytes(n))
            mid, dst, ready, done = r.alloc(n), r.alloc(n), r.alloc(8, 8), r.alloc(16, 16)
            waiter.submit(setup(), sem(ready, 1, "acq_strict_geq"), copy(mid, dst, n), sem(done, 1, "release"))
            time.sleep(0.005)
            producer.submit(setup(), copy(src, mid, n), sem(ready, 1, "release"))
            until(lambda: r.u64(done) == 1)
            assert r.space.read(dst, n) == r.space.read(src, n)
        finally:
            r.gpu.close()


# ---------------------------------------------------------------- copies, inline data, report semaphores
def test_copies_single_and_multi_line_with_semaphores(rig):
    ch = rig.channel(1)
    src = rig.data(bytes(range(256)) * 4)
    one, rect = rig.alloc(1024), rig.data(b"\xee" * 512)
    s1, s4 = rig.data(b"\xaa" * 8, 8), rig.data(b"\xaa" * 16, 16)
    before = rig.gpu.time_ns()
    ch.submit(setup(), copy(src + 3, one, 1000, semaphore=(s1, 0x1234, False)),
              copy(src, rect, 16, lines=4, pitch_in=100, pitch_out=64, semaphore=(s4, 77, True)))
    until(ch.idle)
    assert rig.space.read(one, 1000) == rig.space.read(src + 3, 1000)
    got = rig.space.read(rect, 512)
    for line in range(4): assert got[line * 64:line * 64 + 16] == rig.space.read(src + line * 100, 16)
    assert got[16:64] == b"\xee" * 48 and got[256:] == b"\xee" * 256
    assert rig.space.read(s1, 8) == (0x1234).to_bytes(4, "little") + b"\xaa" * 4
    assert rig.u64(s4) == 77 and before <= rig.u64(s4 + 8) <= rig.gpu.time_ns()
    assert not rig.faults


def test_inline_data_and_report_semaphores(rig):
    ch = rig.channel(1)
    dst, lines = rig.data(b"\xee" * 32), rig.data(b"\xee" * 64)
    r1, r4 = rig.data(b"\xaa" * 8, 8), rig.data(b"\xaa" * 16, 16)
    data = bytes(range(1, 11))  # 10 bytes: the last word is padded
    words = list(struct.unpack("<3I", data + b"\0\0"))
    i2m = abi.fields(h, "NVC6C0_LAUNCH_DMA", dst_memory_layout="pitch", completion_type="flush_disable")
    report = abi.fields(h, "NVC6C0_SET_REPORT_SEMAPHORE_D", operation="release", structure_size="one_word")
    report4 = abi.fields(h, "NVC6C0_SET_REPORT_SEMAPHORE_D", operation="release", structure_size="four_words")
    before = rig.gpu.time_ns()
    ch.submit(setup(), inc(COMPUTE, h.NVC6C0_LINE_LENGTH_IN, len(data), 1, dst >> 32, dst & 0xFFFFFFFF),
              inc(COMPUTE, h.NVC6C0_LAUNCH_DMA, i2m), non_inc(COMPUTE, h.NVC6C0_LOAD_INLINE_DATA, *words),
              # two lines of 6 bytes, 32 apart: ONE_INC sends LAUNCH_DMA then all the data to the next method
              inc(COMPUTE, h.NVC6C0_LINE_LENGTH_IN, 6, 2, lines >> 32, lines & 0xFFFFFFFF, 32),
              one_inc(COMPUTE, h.NVC6C0_LAUNCH_DMA, i2m, *struct.unpack("<3I", b"abcdefghijkl")),
              inc(COMPUTE, h.NVC6C0_SET_REPORT_SEMAPHORE_A, r1 >> 32, r1 & 0xFFFFFFFF, 0x55, report),
              inc(COMPUTE, h.NVC6C0_SET_REPORT_SEMAPHORE_A, r4 >> 32, r4 & 0xFFFFFFFF, 0x66, report4),
              immd(COMPUTE, h.NVC6C0_INVALIDATE_SHADER_CACHES_NO_WFI, 1), inc(HOST, h.NVC56F_WFI, 0))
    until(ch.idle)
    assert rig.space.read(dst, 32) == data + b"\xee" * 22
    got = rig.space.read(lines, 64)
    assert got[:6] == b"abcdef" and got[32:38] == b"ghijkl" and got[6:32] == b"\xee" * 26
    assert rig.space.read(r1, 8) == (0x55).to_bytes(4, "little") + b"\xaa" * 4
    assert rig.u64(r4) == 0x66 and before <= rig.u64(r4 + 8) <= rig.gpu.time_ns()
    assert not rig.faults


# ---------------------------------------------------------------- kernels
def run_add(rig: Rig, text: bytes, kernel: CubinKernel, n: int = 96, **qmd_fields) -> tuple[Chan, int, list[float]]:
    """Launch `add` over n floats (grid n/32 x block 32); returns the channel, the output address and the input."""
    ch = rig.channel(1)
    code = rig.data(text)
    a = [float(i) for i in range(n)]
    a_va, out = rig.data(struct.pack(f"<{n}f", *a)), rig.alloc(4 * n)
    qmd = rig.kernel_qmd(kernel, code, [out.to_bytes(8, "little"), a_va.to_bytes(8, "little"), struct.pack("<f", 0.5)],
                         grid=(n // 32, 1, 1), block=(32, 1, 1), **qmd_fields)
    ch.submit(setup(), launch_words(qmd))
    return ch, out, a


def test_qmd_launch_runs_the_cpu_twin_then_its_releases(rig):
    text = random.Random(5).randbytes(512)
    rig.gpu.twins.register(text, ADD_KERNEL, ADD)
    s0, s1 = rig.data(b"\xaa" * 16, 16), rig.data(b"\xaa" * 8, 8)
    four, one = (getattr(h, f"{QMD}_RELEASE{i}_STRUCTURE_SIZE_SEMAPHORE_{s}") for i, s in ((0, "FOUR_WORDS"), (1, "ONE_WORD")))
    before = rig.gpu.time_ns()
    ch, out, a = run_add(rig, text, ADD_KERNEL, RELEASE0_ENABLE=1, RELEASE0_ADDRESS_LOWER=s0 & 0xFFFFFFFF, RELEASE0_ADDRESS_UPPER=s0 >> 32,
                         RELEASE0_PAYLOAD_LOWER=5, RELEASE0_PAYLOAD_UPPER=1, RELEASE0_PAYLOAD64B=1, RELEASE0_STRUCTURE_SIZE=four,
                         RELEASE1_ENABLE=1, RELEASE1_ADDRESS_LOWER=s1 & 0xFFFFFFFF, RELEASE1_ADDRESS_UPPER=s1 >> 32,
                         RELEASE1_PAYLOAD_LOWER=9, RELEASE1_STRUCTURE_SIZE=one)
    until(ch.idle)
    assert not rig.faults
    assert list(struct.unpack(f"<{len(a)}f", rig.space.read(out, 4 * len(a)))) == [x + 0.5 for x in a]
    assert rig.u64(s0) == 1 << 32 | 5 and before <= rig.u64(s0 + 8) <= rig.gpu.time_ns()
    assert rig.space.read(s1, 8) == (9).to_bytes(4, "little") + b"\xaa" * 4


def test_qmd_launch_of_a_real_cubin(rig):
    from hcq.backends.nv.cubin import IMAGE_ALIGN, read_cubin
    try:
        from hcq.backends.nv.compiler import NVCompiler
    except ImportError as e:
        pytest.skip(f"hcq.backends.nv.compiler is not there yet ({e})")
    if NVCompiler.unavailable_reason(): pytest.skip(NVCompiler.unavailable_reason())
    kernel = read_cubin(cubin := NVCompiler().compile(ADD)).kernels["add"]
    base = rig.alloc(0, IMAGE_ALIGN)
    image = read_cubin(cubin).image(base)
    rig.space.write(rig.alloc(len(image.data), IMAGE_ALIGN), image.data)
    off, size = image.text["add"]
    rig.gpu.twins.register(image.data[off:off + size], kernel, ADD)
    ch = rig.channel(1)
    n = 64
    a_va, out = rig.data(struct.pack(f"<{n}f", *range(n))), rig.alloc(4 * n)
    qmd = rig.kernel_qmd(kernel, base + off, [out.to_bytes(8, "little"), a_va.to_bytes(8, "little"), struct.pack("<f", 2.0)],
                         grid=(2, 1, 1), block=(32, 1, 1))
    ch.submit(setup(), launch_words(qmd))
    until(ch.idle)
    assert not rig.faults
    assert list(struct.unpack(f"<{n}f", rig.space.read(out, 4 * n))) == [i + 2.0 for i in range(n)]


def test_twin_parameters_must_agree_with_the_cubin():
    from hcq.backends.nv.emulator.twins import TwinRegistry
    twins = TwinRegistry()
    with pytest.raises(CompileError, match="the cubin has 2 parameters, its CPU twin 3"):
        twins.register(b"x" * 8, CubinKernel("add", 10, 0, 0, 0x220, 0x210, (CubinParam(0, 0, 8), CubinParam(1, 8, 8))), ADD)
    with pytest.raises(CompileError, match="'b' is 8 bytes in the cubin, 4 in the CPU twin"):
        twins.register(b"x" * 8, CubinKernel("add", 10, 0, 0, 0x228, 0x210, (CubinParam(0, 0, 8), CubinParam(1, 8, 8), CubinParam(2, 16, 8))), ADD)
    with pytest.raises(CompileError, match="no such kernel"):
        twins.register(b"x" * 8, CubinKernel("sub", 10, 0, 0, 0x210, 0x210, ()), ADD)


# ---------------------------------------------------------------- faults
def fault_cases(rig: Rig):
    """(name, pushbuffer, the fault text expected, the address expected or None) -- one channel each."""
    text = random.Random(6).randbytes(256)
    rig.gpu.twins.register(text, ADD_KERNEL, ADD)
    code = rig.data(text)
    a, out = rig.alloc(4 * 32), rig.alloc(4 * 32)
    params = [out.to_bytes(8, "little"), a.to_bytes(8, "little"), struct.pack("<f", 1.0)]
    unmapped = BASE + SIZE + 0x1000
    yield "unmapped semaphore", sem(unmapped, 1, "release"), "no memory is mapped there", unmapped
    yield "unknown method", setup() + inc(COMPUTE, 0x1234 & ~3, 1), "unknown method 0x1234 of HOPPER_COMPUTE_A", None
    yield "unallocated class", set_object(COPY, h.AMPERE_DMA_COPY_B), "is not allocated on channel", None
    yield "no object bound", inc(COPY, h.NVC6B5_LINE_LENGTH_IN, 4), "which has no object bound", None
    bad_ptr = [(0xDEAD0000).to_bytes(8, "little"), *params[1:]]
    yield "pointer outside memory", setup() + launch_words(rig.kernel_qmd(ADD_KERNEL, code, bad_ptr, block=(32, 1, 1))), \
        "pointer parameter 'out' = 0xdead0000", 0xDEAD0000
    qmd = rig.kernel_qmd(ADD_KERNEL, code, params, block=(32, 1, 1), REGISTER_COUNT_V=ADD_KERNEL.registers - 1)
    yield "too few registers", setup() + launch_words(qmd), f"gives {ADD_KERNEL.registers - 1} registers per thread, the kernel uses 10", qmd
    other = rig.data(random.Random(7).randbytes(256))
    yield "no twin", setup() + launch_words(rig.kernel_qmd(ADD_KERNEL, other, params, block=(32, 1, 1))), "no CPU twin", other
    yield "unmapped QMD", setup() + launch_words(unmapped), "reading the 256-byte QMD", unmapped
    yield "not emulated", sem(a, 1, 7), "semaphore operation 7 is not emulated", None


def test_faults_stop_only_their_channel(rig):
    healthy = rig.channel(100)
    cases = list(fault_cases(rig))
    chans = []
    for i, (name, words, expect, address) in enumerate(cases):
        ch = rig.channel(i + 1)
        after = rig.alloc(16, 16)
        ch.submit(words, sem(after, 1, "release"))
        chans.append((ch, after))
    for (name, words, expect, address), (ch, after) in zip(cases, chans):
        text = ch.fault()
        assert expect in text and f"channel {ch.cid}:" in text, (name, text)
        if address is not None: assert rig.gpu.fault_of(ch.cid)[1] == address, name
        assert rig.u64(after) == 0, f"{name}: the channel went on after its fault"
    ch, after = chans[0]
    ch.submit(sem(after, 2, "release"))  # a faulted channel does nothing more
    done = rig.alloc(16, 16)
    healthy.submit(sem(done, 1, "release"))
    until(lambda: rig.u64(done) == 1)
    time.sleep(0.01)
    assert rig.u64(after) == 0
    assert sorted(c for c, _, _ in rig.faults) == [ch.cid for ch, _ in chans]  # once each
    assert rig.gpu.fault_of(healthy.cid) is None


def test_bad_gpfifo_entries_and_pushbuffers_fault(rig):
    unmapped = BASE + SIZE + 0x4000
    bad_segment, bad_put, short = rig.channel(1), rig.channel(2, entries=4), rig.channel(3)
    entry = bad_segment.gpfifo
    rig.space.store32(entry, fld("NVC56F_GP_ENTRY0_GET", (unmapped & 0xFFFFFFFF) >> 2))
    rig.space.store32(entry + 4, fld("NVC56F_GP_ENTRY1_GET_HI", unmapped >> 32) | fld("NVC56F_GP_ENTRY1_LENGTH", 4))
    rig.space.store32(bad_segment.userd + USERD.GPPut.offset, 1)
    rig.gpu.kick(1)
    assert "fetching the pushbuffer segment of GPFIFO entry 0" in bad_segment.fault()
    assert rig.gpu.fault_of(1)[1] == unmapped
    rig.space.store32(bad_put.userd + USERD.GPPut.offset, 4)
    rig.gpu.kick(2)
    assert "GPPut = 4 in USERD" in bad_put.fault() and "4-entry GPFIFO" in bad_put.fault()
    short.submit(inc(HOST, h.NVC56F_SEM_ADDR_LO, 0, 0)[:2])  # a header for two data words, one in the segment
    assert "followed by 2 data words, but the pushbuffer segment" in short.fault()


# ---------------------------------------------------------------- scheduling
def test_pauses_are_reproducible_for_a_seed():
    def pauses(seed: int) -> dict[int, list[int]]:
        r = Rig(seed, trace_jitter=True)
        try:
            chans = [r.channel(1), r.channel(2)]
            s = r.alloc(16, 16)
            for ch in chans: ch.submit(non_inc(HOST, h.NVC56F_NOP, *[0] * 60), sem(s, 1, "release"))
            until(lambda: all(ch.idle() for ch in chans))
            return {ch.cid: r.gpu.jitter_of(ch.cid) for ch in chans}
        finally:
            r.gpu.close()

    first, again, other = pauses(11), pauses(11), pauses(12)
    assert first == again and first != other and first[1] != first[2]
    assert len(first[1]) == 65 and any(first[1]) and first[1].count(0) > len(first[1]) // 2


def test_seed_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("HCQ_NV_EMULATE_SEED", "1234")
    gpu = EmulatedGpu(AddressSpace())
    assert gpu.seed == 1234 and gpu.time_ns() == pytest.approx(EmulatedGpu(AddressSpace()).time_ns(), abs=10**9)
    monkeypatch.delenv("HCQ_NV_EMULATE_SEED")
    assert EmulatedGpu(AddressSpace()).seed != EmulatedGpu(AddressSpace()).seed  # (random: 1 in 2**32 to clash)


def test_close_does_not_hang_on_a_stuck_kernel():
    r = Rig()
    text = random.Random(8).randbytes(128)
    r.gpu.twins.register(text, SPIN_KERNEL, SPIN)
    flag = r.alloc(8, 8)
    ch = r.channel(1)
    ch.submit(setup(), launch_words(r.kernel_qmd(SPIN_KERNEL, r.data(text), [flag.to_bytes(8, "little")])))
    until(lambda: r.u32(flag + 4) == 1)
    t0 = time.monotonic()
    r.gpu.close(timeout_s=0.2)
    assert time.monotonic() - t0 < 1.0
    thread = next(t for t in threading.enumerate() if t.name == "nv-emu-channel-1")
    assert thread.is_alive() and thread.daemon
    r.space.store32(flag, 1)  # let it go before the memory does
    thread.join(5)
    assert not thread.is_alive() and not r.faults


# A twin that stores through a pointer it computed (address 16 in the host): on a GPU an MMU fault; here the CPU
# command processor's guard contains the SIGSEGV, and the channel faults naming the kernel and block.
WILD = "HCQ_KERNEL void wild(volatile int *unused) { volatile int *bad = (volatile int *)(uintptr_t)16; *bad = 1; }"
WILD_KERNEL = CubinKernel("wild", registers=8, shared_bytes=0, local_bytes=0, cbank0_size=0x218, param_base=0x210,
                          params=(CubinParam(0, 0, 8),), param_size=8)


def test_a_twin_that_faults_faults_its_channel_not_the_process(rig):
    text = random.Random(9).randbytes(128)
    rig.gpu.twins.register(text, WILD_KERNEL, WILD)
    word = rig.alloc(8, 8)
    healthy, bad = rig.channel(1), rig.channel(2)
    bad.submit(setup(), launch_words(rig.kernel_qmd(WILD_KERNEL, rig.data(text), [word.to_bytes(8, "little")], grid=(3, 1, 1))))
    until(lambda: rig.faults)
    (cid, text_, addr), = rig.faults
    assert cid == 2 and addr == 16 and "kernel wild faulted in block 0: SIGSEGV at address 0x10" in text_, rig.faults
    healthy.submit(sem(word, 5, "release"))  # the GPU goes on: other channels, later launches on other threads
    until(healthy.idle)
    assert rig.u64(word) == 5 and len(rig.faults) == 1
