"""Copies: copyin/copyout (direct and through the staging ring), transfers between CPU devices,
copy_from_disk, and the copy queue's copy semantics."""
import os
import re
import signal
import sys
import threading
import time

import numpy as np
import pytest

import hcq
from hcq import BufferSpec
from hcq.allocator import HOST_COPY_MAX

MiB = 1 << 20
SPEC = BufferSpec(cpu_access=True)
NOLRU = BufferSpec(cpu_access=True, nolru=True)


def pattern(n: int, seed: int) -> np.ndarray:
    """n pseudo-random bytes (fast for big n: a multiplicative hash of the index)."""
    if n <= 64 * MiB: return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)
    words = np.arange(-(-n // 8), dtype=np.uint64)
    words *= np.uint64(0x9E3779B97F4A7C15)
    words ^= np.uint64((seed * 0x632BE59BD9B4E019 + 1) & 0xFFFFFFFFFFFFFFFF)
    words ^= words >> np.uint64(29)
    return words.view(np.uint8)[:n]


def roundtrip(dev, n: int, seed: int, spec: BufferSpec = SPEC, slack: int = 64) -> None:
    """copyin n bytes into a buffer with `slack` extra bytes, check the device bytes and that the slack
    is untouched, copyout and compare."""
    src = pattern(n, seed)
    buf = dev.allocator.alloc(n + slack, spec)
    try:
        buf.cpu_view()[n:n + slack] = b"\xa5" * slack
        dev.allocator.copyin(buf, memoryview(src))
        dev.synchronize()
        assert buf.cpu_view()[n:n + slack] == b"\xa5" * slack, "copyin wrote past its size"
        out = np.zeros(n, np.uint8)
        dev.allocator.copyout(memoryview(out), buf)
        assert np.array_equal(out, src)
        # the device really holds the data (not just the host round trip)
        dev_bytes = np.frombuffer(buf.cpu_view().view(0, n).mv, np.uint8)
        assert np.array_equal(dev_bytes, src)
    finally:
        dev.allocator.free(buf, n + slack, spec)


SIZES = [1, 3, 4095, MiB + 7, 2 * MiB, 2 * MiB + 1, 17 * MiB]


@pytest.mark.parametrize("n", SIZES)
def test_copy_roundtrip(dev, n):
    roundtrip(dev, n, seed=n)


@pytest.mark.full
def test_copy_roundtrip_256mib(dev):
    n = 256 * MiB
    src = np.arange(n // 4, dtype=np.uint32)
    src ^= np.uint32(0x5A5A5A5A)
    buf = dev.allocator.alloc(n, NOLRU)
    try:
        dev.allocator.copyin(buf, memoryview(src))
        out = np.empty_like(src)
        dev.allocator.copyout(memoryview(out), buf)
        assert np.array_equal(out, src)
    finally:
        dev.allocator.free(buf, n, NOLRU)
    assert buf.freed
    del src, out


def test_copyin_partial_and_at_offset(dev):
    buf = dev.allocator.alloc(1000, SPEC)
    try:
        buf.cpu_view()[:] = bytes(1000)
        dev.allocator.copyin(buf.offset(100, 50), memoryview(bytes(range(1, 51))))
        dev.synchronize()
        assert buf.cpu_view()[100:150] == bytes(range(1, 51))
        assert buf.cpu_view()[:100] == bytes(100) and buf.cpu_view()[150:] == bytes(850)
        out = bytearray(10)
        dev.allocator.copyout(memoryview(out), buf.offset(120))
        assert bytes(out) == bytes(range(21, 31))
    finally:
        dev.allocator.free(buf, 1000, SPEC)


def test_copyin_typed_and_readonly_sources(dev):
    buf = dev.allocator.alloc(64, SPEC)
    try:
        dev.allocator.copyin(buf, memoryview(b"read-only bytes source!"))  # bytes are read-only
        dev.synchronize()
        assert buf.cpu_view()[:23] == b"read-only bytes source!"
        ro = np.arange(16, dtype=np.float32)
        ro.flags.writeable = False
        dev.allocator.copyin(buf, memoryview(ro))
        out = np.zeros(16, np.float32)
        dev.allocator.copyout(memoryview(out), buf)
        assert np.array_equal(out, np.arange(16, dtype=np.float32))
        big = bytes(pattern(3 * MiB + 5, 7))  # a read-only source bigger than a staging buffer
        bbuf = dev.allocator.alloc(len(big), SPEC)
        try:
            dev.allocator.copyin(bbuf, memoryview(big))
            out2 = bytearray(len(big))
            dev.allocator.copyout(memoryview(out2), bbuf)
            assert bytes(out2) == big
        finally:
            dev.allocator.free(bbuf, len(big), SPEC)
    finally:
        dev.allocator.free(buf, 64, SPEC)


def test_copyin_source_may_change_after_return(dev):
    src = bytearray(b"A" * 4096)
    buf = dev.allocator.alloc(4096, SPEC)
    try:
        dev.allocator.copyin(buf, memoryview(src))
        src[:] = b"B" * 4096  # copyin has taken its copy by the time it returns
        out = bytearray(4096)
        dev.allocator.copyout(memoryview(out), buf)
        assert out == b"A" * 4096
    finally:
        dev.allocator.free(buf, 4096, SPEC)


@pytest.mark.parametrize("direct", [True, False])
def test_copy_multidim_arrays(dev, monkeypatch, direct):
    monkeypatch.setattr(dev.allocator, "direct_copy", direct)
    src = np.arange(3 * 1024 * 700, dtype=np.float32).reshape(3, 1024, 700)  # 8.2 MiB, 3-D
    buf = dev.allocator.alloc(src.nbytes, NOLRU)
    try:
        dev.allocator.copyin(buf, memoryview(src))
        out = np.zeros_like(src)
        dev.allocator.copyout(memoryview(out), buf)
        assert np.array_equal(out, src)
    finally:
        dev.allocator.free(buf, src.nbytes, NOLRU)


def test_copy_non_contiguous_raises(dev):
    buf = dev.allocator.alloc(64, SPEC)
    try:
        strided = np.arange(32, dtype=np.uint8)[::2]
        with pytest.raises(ValueError, match="contiguous"):
            dev.allocator.copyin(buf, memoryview(strided))
        with pytest.raises(ValueError, match="contiguous"):
            dev.allocator.copyout(memoryview(np.zeros(32, np.uint8)[::2]), buf)
    finally:
        dev.allocator.free(buf, 64, SPEC)


def test_copy_zero_bytes(dev):
    buf = dev.allocator.alloc(16, SPEC)
    try:
        buf.cpu_view()[:] = b"z" * 16
        dev.allocator.copyin(buf, memoryview(b""))
        dev.allocator.copyout(memoryview(bytearray()), buf)
        assert buf.cpu_view()[:] == b"z" * 16
    finally:
        dev.allocator.free(buf, 16, SPEC)


def test_copyout_into_readonly_raises(dev):
    buf = dev.allocator.alloc(16, SPEC)
    try:
        with pytest.raises(ValueError, match="read-only"):
            dev.allocator.copyout(memoryview(bytes(16)), buf)
        ro = np.zeros(16, np.uint8)
        ro.flags.writeable = False
        with pytest.raises(ValueError, match="read-only"):
            dev.allocator.copyout(memoryview(ro), buf)
    finally:
        dev.allocator.free(buf, 16, SPEC)


def test_oversized_copies_raise(dev):
    buf = dev.allocator.alloc(100, SPEC)
    try:
        buf.cpu_view()[:] = b"\x11" * 100
        with pytest.raises(ValueError, match="do not fit"):
            dev.allocator.copyin(buf, memoryview(bytes(101)))
        with pytest.raises(ValueError, match="do not fit"):
            dev.allocator.copyin(buf.offset(50), memoryview(bytes(51)))
        with pytest.raises(ValueError, match="do not fit"):
            dev.allocator.copyout(memoryview(bytearray(101)), buf)
        dev.synchronize()
        assert buf.cpu_view()[:] == b"\x11" * 100  # nothing was copied
    finally:
        dev.allocator.free(buf, 100, SPEC)


def test_copies_of_freed_buffer_raise(dev):
    buf = dev.allocator.alloc(64, NOLRU)
    dev.allocator.free(buf, 64, NOLRU)
    with pytest.raises(ValueError, match="freed"):
        dev.allocator.copyin(buf, memoryview(bytes(8)))
    with pytest.raises(ValueError, match="freed"):
        dev.allocator.copyout(memoryview(bytearray(8)), buf)


def test_copy_ordered_after_kernel(dev):
    """copyin goes after earlier work on the device, copyout after it too."""
    n = 1 << 16
    prg = dev.compile("""
HCQ_KERNEL void slow_fill(unsigned *o, unsigned v, int iters) {
  size_t i = hcq_global_id(0); volatile unsigned x = 0;
  for (int k = 0; k < iters; k++) x += k;
  o[i] = v + (unsigned)i;
}""", "slow_fill")
    buf = dev.allocator.alloc(n * 4, SPEC)
    try:
        prg(buf, global_size=(n // 64, 1, 1), local_size=(64, 1, 1), vals=(7, 2000))  # no wait
        dev.allocator.copyin(buf.offset(0, 16), memoryview(np.full(4, 0xFFFF, np.uint32)))  # must land after the kernel
        out = np.zeros(n, np.uint32)
        dev.allocator.copyout(memoryview(out), buf)
        expect = 7 + np.arange(n, dtype=np.uint32)
        expect[:4] = 0xFFFF
        assert np.array_equal(out, expect)
    finally:
        dev.allocator.free(buf, n * 4, SPEC)


# ---------------------------------------------------------------- the staging ring
@pytest.fixture
def staged(dev, monkeypatch):
    monkeypatch.setattr(dev.allocator, "direct_copy", False)
    monkeypatch.setattr(dev.allocator, "host_copy_max", 0)  # small copies too (else the host's memmove)
    assert dev.allocator._host_copy_address(0x1000, 16) is None
    yield dev
    monkeypatch.undo()
    assert dev.allocator.direct_copy


def test_staging_ring_shape(staged):
    a = staged.allocator
    assert a.batch_size == 2 * MiB and a.batch_cnt == 32
    assert len(a.b) == 32 and all(b.size == 2 * MiB for b in a.b)
    assert len({b.va_addr for b in a.b}) == 32


@pytest.mark.parametrize("n", [1, 4095, 2 * MiB, 2 * MiB + 1, 5 * MiB + 3, 80 * MiB + 5])
def test_staged_roundtrip(staged, n):
    roundtrip(staged, n, seed=1000 + n, spec=NOLRU)


def test_staged_copyin_many_in_a_row(staged):
    """Staging buffers are reused across copies: successive staged copyins of different data must each
    arrive intact (a reused staging buffer must not be overwritten before its copy ran)."""
    n = 9 * MiB + 100
    bufs = [staged.allocator.alloc(n, NOLRU) for _ in range(5)]
    try:
        srcs = [pattern(n, 50 + i) for i in range(5)]
        for b, s in zip(bufs, srcs): staged.allocator.copyin(b, memoryview(s))
        for b, s in zip(bufs, srcs):
            out = np.empty(n, np.uint8)
            staged.allocator.copyout(memoryview(out), b)
            assert np.array_equal(out, s)
    finally:
        for b in bufs: staged.allocator.free(b, n, NOLRU)


STALL_SRC = """
HCQ_KERNEL void stall(uint32_t *o, int iters) {
  uint32_t x = o[0];
  for (int i = 0; i < iters; i++) x = x * 1664525u + 1013904223u;
  o[0] = x;
}
"""


def stall(dev, iters=150_000_000):
    """Keep the device busy for a while (~0.1-0.5 s) without waiting: later copies queue behind it."""
    prg = dev.compile(STALL_SRC, "stall")
    buf = dev.allocator.alloc(8, SPEC)
    prg(buf, vals=(iters,))
    return buf


def test_staged_copyin_behind_busy_device(staged):
    """More chunks than staging buffers while the copy engine cannot start yet: a staging buffer is
    refilled only after the copy that reads it ran."""
    dev = staged
    n = 80 * MiB + 5
    src = pattern(n, 99)
    buf = dev.allocator.alloc(n, NOLRU)
    busy = stall(dev)
    try:
        dev.allocator.copyin(buf, memoryview(src))
        out = np.empty(n, np.uint8)
        dev.allocator.copyout(memoryview(out), buf)
        bad = np.flatnonzero(out != src)
        assert bad.size == 0, f"{bad.size} bytes differ, first at {bad[0]} (staging chunk {bad[0] // (2 * MiB)})"
    finally:
        dev.allocator.free(buf, n, NOLRU)
        dev.allocator.free(busy, 8, SPEC)


def test_copy_from_disk_behind_busy_device(dev, tmp_path):
    n = 70 * MiB + 11  # 36 staging chunks
    data = pattern(n, 123)
    path = tmp_path / "big.bin"
    path.write_bytes(data.tobytes())
    buf = dev.allocator.alloc(n, NOLRU)
    busy = stall(dev)
    try:
        dev.allocator.copy_from_disk(buf, path, n)
        out = np.empty(n, np.uint8)
        dev.allocator.copyout(memoryview(out), buf)
        bad = np.flatnonzero(out != data)
        assert bad.size == 0, f"{bad.size} bytes differ, first at {bad[0]} (staging chunk {bad[0] // (2 * MiB)})"
    finally:
        dev.allocator.free(buf, n, NOLRU)
        dev.allocator.free(busy, 8, SPEC)


def test_staged_copyin_source_may_change_after_return(staged):
    n = 6 * MiB + 1
    src = pattern(n, 3).copy()
    keep = src.copy()
    buf = staged.allocator.alloc(n, NOLRU)
    try:
        staged.allocator.copyin(buf, memoryview(src))
        src[:] = 0
        out = np.empty(n, np.uint8)
        staged.allocator.copyout(memoryview(out), buf)
        assert np.array_equal(out, keep)
    finally:
        staged.allocator.free(buf, n, NOLRU)


def test_staged_copyout_after_kernel(staged):
    dev = staged
    n = 3 * MiB  # 1.5 staging buffers of u32 words x4 bytes... crosses several staging buffers
    prg = dev.compile("HCQ_KERNEL void iota(unsigned *o, unsigned base) { o[hcq_global_id(0)] = base ^ (unsigned)hcq_global_id(0); }", "iota")
    buf = dev.allocator.alloc(n * 4, NOLRU)
    try:
        prg(buf, global_size=(n // 256, 1, 1), local_size=(256, 1, 1), vals=(0xC0FFEE,))
        out = np.zeros(n, np.uint32)
        dev.allocator.copyout(memoryview(out), buf)
        assert np.array_equal(out, np.uint32(0xC0FFEE) ^ np.arange(n, dtype=np.uint32))
    finally:
        dev.allocator.free(buf, n * 4, NOLRU)


# ---------------------------------------------------------------- transfers between devices
TRANSFER_SRC = """
HCQ_KERNEL void produce(unsigned *o, unsigned seed, int iters) {
  size_t i = hcq_global_id(0);
  unsigned x = seed ^ (unsigned)i;
  for (int k = 0; k < iters; k++) x = x * 1664525u + 1013904223u;
  o[i] = x;
}
HCQ_KERNEL void consume(unsigned *out, const unsigned *in) {
  size_t i = hcq_global_id(0);
  out[i] = in[i] * 3u + 1u;
}
"""


def lcg(seed: int, n: int, iters: int) -> np.ndarray:
    x = (np.uint32(seed) ^ np.arange(n, dtype=np.uint32)).astype(np.uint64)
    for _ in range(iters): x = (x * 1664525 + 1013904223) & 0xFFFFFFFF
    return x.astype(np.uint32)


def test_transfer_both_ways(dev, dev1):
    n = 3 * MiB + 13
    src1 = dev1.allocator.alloc(n, NOLRU)
    dst0 = dev.allocator.alloc(n, NOLRU)
    back1 = dev1.allocator.alloc(n, NOLRU)
    try:
        data = pattern(n, 11)
        dev1.allocator.copyin(src1, memoryview(data))
        dev.allocator.transfer(dst0, src1, n, src_dev=dev1, dest_dev=dev)
        out = np.empty(n, np.uint8)
        dev.allocator.copyout(memoryview(out), dst0)
        assert np.array_equal(out, data)
        assert dev in src1.mappings and dev1 in dst0.mappings

        dev1.allocator.transfer(back1, dst0, n, src_dev=dev, dest_dev=dev1)
        out2 = np.empty(n, np.uint8)
        dev1.allocator.copyout(memoryview(out2), back1)
        assert np.array_equal(out2, data)
    finally:
        for d, b in ((dev1, src1), (dev, dst0), (dev1, back1)): d.allocator.free(b, n, NOLRU)


def test_transfer_orders_with_work_on_both_devices(dev, dev1):
    """dev1 produces data (slowly, not waited for), it is transferred to dev, and a kernel on dev reads
    it at once: the transfer waits for dev1's kernel and dev's kernel waits for the transfer."""
    n, iters = 1 << 16, 3000
    p1 = dev1.compile(TRANSFER_SRC, "produce")
    p0 = dev.compile(TRANSFER_SRC, "consume")
    src1 = dev1.allocator.alloc(n * 4, NOLRU)
    dst0 = dev.allocator.alloc(n * 4, NOLRU)
    res0 = dev.allocator.alloc(n * 4, NOLRU)
    try:
        src1.cpu_view()[:] = bytes(n * 4)
        for rnd in range(3):
            seed = 0x1234 + rnd
            p1(src1, global_size=(n // 64, 1, 1), local_size=(64, 1, 1), vals=(seed, iters))  # wait=False
            dev.allocator.transfer(dst0, src1, n * 4, src_dev=dev1, dest_dev=dev)
            p0(res0, dst0, global_size=(n // 64, 1, 1), local_size=(64, 1, 1))  # no sync in between
            out = np.empty(n, np.uint32)
            dev.allocator.copyout(memoryview(out), res0)
            expect = lcg(seed, n, iters) * np.uint32(3) + np.uint32(1)
            assert np.array_equal(out, expect), f"round {rnd}"
    finally:
        dev1.allocator.free(src1, n * 4, NOLRU)
        dev.allocator.free(dst0, n * 4, NOLRU)
        dev.allocator.free(res0, n * 4, NOLRU)


def test_transfer_waits_for_destination_work(dev, dev1):
    """A transfer into a buffer that a kernel on the destination device is still writing lands after it."""
    n = 1 << 16
    slow = dev.compile("""
HCQ_KERNEL void slow_fill(unsigned *o, unsigned v, int iters) {
  volatile unsigned x = 0; for (int k = 0; k < iters; k++) x += k;
  o[hcq_global_id(0)] = v;
}""", "slow_fill")
    dst0 = dev.allocator.alloc(n * 4, NOLRU)
    src1 = dev1.allocator.alloc(16, NOLRU)
    try:
        src1.cpu_view()[:] = b"\xee" * 16
        slow(dst0, global_size=(n // 64, 1, 1), local_size=(64, 1, 1), vals=(5, 3000))
        dev.allocator.transfer(dst0, src1, 16, src_dev=dev1, dest_dev=dev)
        out = np.empty(n, np.uint32)
        dev.allocator.copyout(memoryview(out), dst0)
        assert out[:4].tolist() == [0xEEEEEEEE] * 4
        assert np.all(out[4:] == 5)
    finally:
        dev.allocator.free(dst0, n * 4, NOLRU)
        dev1.allocator.free(src1, 16, NOLRU)


def test_transfer_between_views_and_same_device(dev, dev1):
    n = 1 << 20
    a = dev1.allocator.alloc(3 * n, NOLRU)
    b = dev.allocator.alloc(3 * n, NOLRU)
    try:
        data = pattern(3 * n, 21)
        a.cpu_view()[:] = data.tobytes()
        b.cpu_view()[:] = bytes(3 * n)
        dev.allocator.transfer(b.offset(n, n), a.offset(2 * n, n), n, src_dev=dev1, dest_dev=dev)  # views at offsets
        dev.allocator.transfer(b.offset(2 * n), b.offset(n, n), n, src_dev=dev, dest_dev=dev)  # within one device
        out = np.empty(3 * n, np.uint8)
        dev.allocator.copyout(memoryview(out), b)
        assert np.array_equal(out[:n], np.zeros(n, np.uint8))
        assert np.array_equal(out[n:2 * n], data[2 * n:])
        assert np.array_equal(out[2 * n:], data[2 * n:])
    finally:
        dev1.allocator.free(a, 3 * n, NOLRU)
        dev.allocator.free(b, 3 * n, NOLRU)


def test_transfer_oversized_raises(dev, dev1):
    a = dev.allocator.alloc(64, NOLRU)
    b = dev1.allocator.alloc(32, NOLRU)
    try:
        with pytest.raises(ValueError, match="do not fit"):
            dev.allocator.transfer(a, b, 64, src_dev=dev1, dest_dev=dev)
        with pytest.raises(ValueError, match="do not fit"):
            dev1.allocator.transfer(b, a, 64, src_dev=dev, dest_dev=dev1)
    finally:
        dev.allocator.free(a, 64, NOLRU)
        dev1.allocator.free(b, 32, NOLRU)


# ---------------------------------------------------------------- copy_from_disk
@pytest.fixture(scope="module")
def disk_file(tmp_path_factory):
    data = pattern(9 * MiB + 123, 77)
    path = tmp_path_factory.mktemp("disk") / "blob.bin"
    path.write_bytes(data.tobytes())
    return path, data


@pytest.mark.parametrize("offset,size", [(0, 1), (0, 9 * MiB + 123), (4097, 5 * MiB + 17), (2 * MiB, 2 * MiB), (9 * MiB, 123)])
def test_copy_from_disk(dev, disk_file, offset, size):
    path, data = disk_file
    buf = dev.allocator.alloc(size + 8, NOLRU)
    try:
        buf.cpu_view()[size:] = b"\x5a" * 8
        src = (str(path), offset) if offset else path
        dev.allocator.copy_from_disk(buf, src, size)
        out = np.empty(size, np.uint8)
        dev.allocator.copyout(memoryview(out), buf)
        assert np.array_equal(out, data[offset:offset + size])
        assert buf.cpu_view()[size:] == b"\x5a" * 8
    finally:
        dev.allocator.free(buf, size + 8, NOLRU)


def test_copy_from_disk_fd_then_kernel(dev, disk_file):
    """A kernel launched right after copy_from_disk sees the file's bytes (ordered by the timeline)."""
    path, data = disk_file
    n = 6 * MiB  # bytes, crosses three staging buffers
    prg = dev.compile("HCQ_KERNEL void inc(unsigned char *o, const unsigned char *i) { size_t g = hcq_global_id(0); o[g] = i[g] + 1; }", "inc")
    inp = dev.allocator.alloc(n, NOLRU)
    outb = dev.allocator.alloc(n, NOLRU)
    fd = os.open(path, os.O_RDONLY)
    try:
        dev.allocator.copy_from_disk(inp, (fd, 1000), n)
        prg(outb, inp, global_size=(n // 256, 1, 1), local_size=(256, 1, 1))
        out = np.empty(n, np.uint8)
        dev.allocator.copyout(memoryview(out), outb)
        assert np.array_equal(out, data[1000:1000 + n] + np.uint8(1))
        os.fstat(fd)  # the caller's fd stays open
    finally:
        os.close(fd)
        dev.allocator.free(inp, n, NOLRU)
        dev.allocator.free(outb, n, NOLRU)


def test_copy_from_disk_short_file_raises(dev, tmp_path):
    """A range past the end of the file is refused before the destination is touched."""
    path = tmp_path / "short.bin"
    path.write_bytes(b"x" * (3 * MiB))
    buf = dev.allocator.alloc(4 * MiB, NOLRU)
    try:
        dev.allocator.copyin(buf, memoryview(b"\xab" * (4 * MiB)))
        with pytest.raises(ValueError, match="holds 3145728 bytes; 4194304 bytes from offset 0 run past its end"):
            dev.allocator.copy_from_disk(buf, path, 4 * MiB)
        with pytest.raises(ValueError, match="run past its end"):
            dev.allocator.copy_from_disk(buf, (path, 3 * MiB - 10), 11)
        out = bytearray(4 * MiB)
        dev.allocator.copyout(memoryview(out), buf)
        assert out == b"\xab" * (4 * MiB), "the destination was partly overwritten before the error"
        # the device is still usable afterwards
        dev.allocator.copy_from_disk(buf, path, 3 * MiB)
        out = bytearray(3 * MiB)
        dev.allocator.copyout(memoryview(out), buf)
        assert out == b"x" * (3 * MiB)
    finally:
        dev.allocator.free(buf, 4 * MiB, NOLRU)


def test_copy_from_disk_oversized_raises(dev, disk_file):
    path, _ = disk_file
    buf = dev.allocator.alloc(100, NOLRU)
    try:
        with pytest.raises(ValueError, match="do not fit"):
            dev.allocator.copy_from_disk(buf, path, 101)
    finally:
        dev.allocator.free(buf, 100, NOLRU)


# ---------------------------------------------------------------- copy queue: overlapping copies
def queue_copy(dev, dest: int, src: int, n: int) -> None:
    dev.hw_copy_queue_t().wait(dev.timeline_signal, dev.timeline_value - 1).copy(dest, src, n) \
       .signal(dev.timeline_signal, dev.next_timeline()).submit(dev)
    dev.synchronize()


@pytest.mark.parametrize("n,shift", [(100, 10), (100, -10), (100, 1), (100, -1), (4096, 4095),
                                     (9 * MiB, 3), (9 * MiB, -3), (9 * MiB, 4 * MiB + 64), (9 * MiB, -(4 * MiB + 64))])
def test_copy_queue_overlapping_is_memmove(dev, n, shift):
    total = n + abs(shift)
    buf = dev.allocator.alloc(total, NOLRU)
    try:
        init = pattern(total, n + shift & 0xFFFF)
        buf.cpu_view()[:] = init.tobytes()
        src_off, dst_off = (0, shift) if shift > 0 else (-shift, 0)
        queue_copy(dev, buf.va_addr + dst_off, buf.va_addr + src_off, n)
        expect = init.copy()
        expect[dst_off:dst_off + n] = init[src_off:src_off + n]
        got = np.frombuffer(buf.cpu_view().mv, np.uint8)
        assert np.array_equal(got, expect)
    finally:
        dev.allocator.free(buf, total, NOLRU)


def test_copy_queue_large_disjoint(dev):
    n = 9 * MiB + 3  # big enough for the copy engine to split it
    buf = dev.allocator.alloc(2 * n, NOLRU)
    try:
        init = pattern(2 * n, 5)
        buf.cpu_view()[:] = init.tobytes()
        queue_copy(dev, buf.offset(n), buf, n)  # HCQBuffers are accepted as addresses
        got = np.frombuffer(buf.cpu_view().mv, np.uint8)
        assert np.array_equal(got[:n], init[:n]) and np.array_equal(got[n:], init[:n])
    finally:
        dev.allocator.free(buf, 2 * n, NOLRU)


def test_copy_queue_rejects_overrun_and_negative(dev):
    buf = dev.allocator.alloc(64, NOLRU)
    try:
        with pytest.raises(ValueError, match="overruns"):
            dev.hw_copy_queue_t().copy(buf, buf.va_addr, 65)
        with pytest.raises(ValueError, match=">= 0"):
            dev.hw_copy_queue_t().copy(buf.va_addr, buf.va_addr, -1)
        with pytest.raises(hcq.QueueKindError):
            dev.hw_compute_queue_t().copy(buf.va_addr, buf.va_addr, 8)
    finally:
        dev.allocator.free(buf, 64, NOLRU)


# ---------------------------------------------------------------- small copies by the host (allocator.HOST_COPY_MAX)
SLOW_SRC = r"""
HCQ_KERNEL void late_fill(int *out, int v, long spin, int n) {
  volatile long t = 0; for (long i = 0; i < spin; i++) t += i;
  for (int i = 0; i < n; i++) out[i] = v + i;
}
HCQ_KERNEL void copy_words(int *out, const int *a, int n) { for (int i = 0; i < n; i++) out[i] = a[i]; }
"""
SMALL = 256  # ints: 1 KiB


@pytest.fixture
def small_dev(dev):
    return dev, {k: dev.compile(SLOW_SRC, k) for k in ("late_fill", "copy_words")}


def gated_copy_words(d, prgs, out, a):
    """copy_words(out, a) on the timeline behind a gate the caller opens; returns the gate."""
    gate = d.new_signal(value=0)
    args = prgs["copy_words"].fill_kernargs((out, a), (SMALL,))
    d.hw_compute_queue_t().wait(d.timeline_signal, d.timeline_value - 1).wait(gate, 1) \
        .exec(prgs["copy_words"], args, (1, 1, 1), (1, 1, 1)).signal(d.timeline_signal, d.next_timeline()).submit(d)
    return gate


def test_small_copies_are_the_hosts_and_step_no_timeline(small_dev):
    d, _ = small_dev
    buf = d.allocator.alloc(SMALL * 4, SPEC)
    tv = d.timeline_value
    d.allocator.copyin(buf, memoryview(np.arange(SMALL, dtype=np.int32)))
    out = np.zeros(SMALL, np.int32)
    d.allocator.copyout(memoryview(out), buf)
    assert (out == np.arange(SMALL)).all() and d.timeline_value == tv  # no queue round trip
    d.allocator.host_copy_max = 0
    try:
        d.allocator.copyin(buf, memoryview(np.arange(SMALL, dtype=np.int32)))
        assert d.timeline_value == tv + 1  # the knob (HCQ_HOST_COPY_MAX=0) sends it through the copy engine
    finally:
        d.allocator.host_copy_max = HOST_COPY_MAX


def test_a_small_copyout_waits_for_the_kernel_still_writing(small_dev):
    d, prgs = small_dev
    buf = d.allocator.alloc(SMALL * 4, SPEC)
    for v in range(20):
        prgs["late_fill"](buf, vals=(v * 1000, 200_000, SMALL))  # not waited for
        out = np.full(SMALL, -1, np.int32)
        d.allocator.copyout(memoryview(out), buf)
        assert (out == v * 1000 + np.arange(SMALL)).all(), "stale or torn data: the copyout overtook the kernel"


def test_a_small_copyin_waits_for_the_kernel_still_reading(small_dev):
    d, prgs = small_dev
    a, out = d.allocator.alloc(SMALL * 4, SPEC), d.allocator.alloc(SMALL * 4, SPEC)
    d.allocator.copyin(a, memoryview(np.full(SMALL, 5, np.int32)))
    gate = gated_copy_words(d, prgs, out, a)
    opener = threading.Timer(0.1, lambda: setattr(gate, "value", 1))
    opener.start()
    try:
        d.allocator.copyin(a, memoryview(np.full(SMALL, 9, np.int32)))  # ordered after the kernel that reads `a`
    finally:
        opener.cancel()
        gate.value = 1
    got = np.zeros(SMALL, np.int32)
    d.allocator.copyout(memoryview(got), out)
    assert (got == 5).all(), "the copyin overtook the kernel before it"
    d.allocator.copyout(memoryview(got), a)
    assert (got == 9).all()


def test_ctrl_c_while_a_small_copyin_waits_copies_nothing(small_dev):
    if threading.current_thread() is not threading.main_thread(): pytest.skip("SIGINT reaches the main thread only")
    d, prgs = small_dev
    a, out = d.allocator.alloc(SMALL * 4, SPEC), d.allocator.alloc(SMALL * 4, SPEC)
    d.allocator.copyin(a, memoryview(np.full(SMALL, 5, np.int32)))
    gate = gated_copy_words(d, prgs, out, a)
    timer = threading.Timer(0.1, signal.pthread_kill, (threading.main_thread().ident, signal.SIGINT))
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            d.allocator.copyin(a, memoryview(np.full(SMALL, 9, np.int32)))
    finally:
        timer.cancel()
        gate.value = 1
    got = np.zeros(SMALL, np.int32)
    d.allocator.copyout(memoryview(got), out)
    assert (got == 5).all()
    d.allocator.copyout(memoryview(got), a)
    assert (got == 5).all(), "the interrupted copyin still copied"


def test_small_transfers_by_the_host_only_when_both_devices_are_idle(small_dev, dev1):
    d, prgs = small_dev
    src, dst = d.allocator.alloc(SMALL * 4, SPEC), dev1.allocator.alloc(SMALL * 4, SPEC)
    d.synchronize(), dev1.synchronize()
    gate = d.new_signal(value=0)
    args = prgs["late_fill"].fill_kernargs((src,), (7, 0, SMALL))
    d.hw_compute_queue_t().wait(d.timeline_signal, d.timeline_value - 1).wait(gate, 1) \
        .exec(prgs["late_fill"], args, (1, 1, 1), (1, 1, 1)).signal(d.timeline_signal, d.next_timeline()).submit(d)
    tv = d.timeline_value
    d.allocator.transfer(dst, src, SMALL * 4, src_dev=d, dest_dev=dev1)  # busy: the copy engine does it, behind the kernel
    assert d.timeline_value == tv + 1
    gate.value = 1
    got = np.zeros(SMALL, np.int32)
    dev1.allocator.copyout(memoryview(got), dst)
    assert (got == 7 + np.arange(SMALL)).all()
    d.allocator.copyin(src, memoryview(np.full(SMALL, 3, np.int32)))
    tv = d.timeline_value
    d.allocator.transfer(dst, src, SMALL * 4, src_dev=d, dest_dev=dev1)  # both idle: the host's memmove
    assert d.timeline_value == tv
    dev1.allocator.copyout(memoryview(got), dst)
    assert (got == 3).all()


def test_small_copies_from_threads(small_dev, open_device):
    """Threads each with a device of their own, and threads sharing one under a lock (the threading rule), mixing
    launches with small copies: every copy sees the launch before it."""
    devs = [open_device() for _ in range(3)]
    shared, lock, errors = small_dev, threading.Lock(), []

    def work(d, prg, lk, tag):
        buf = d.allocator.alloc(SMALL * 4, SPEC)
        out = np.zeros(SMALL, np.int32)
        try:
            for v in range(60):
                with lk:
                    prg(buf, vals=(tag * 10_000 + v, 2_000, SMALL))
                    d.allocator.copyout(memoryview(out), buf)
                assert (out == tag * 10_000 + v + np.arange(SMALL)).all()
                with lk:
                    d.allocator.copyin(buf, memoryview(np.full(SMALL, v, np.int32)))
                    d.allocator.copyout(memoryview(out), buf)
                assert (out == v).all()
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)
    jobs = [(d, d.compile(SLOW_SRC, "late_fill"), threading.Lock(), i) for i, d in enumerate(devs)]
    jobs += [(shared[0], shared[1]["late_fill"], lock, 10 + i) for i in range(2)]
    threads = [threading.Thread(target=work, args=job) for job in jobs]
    for t in threads: t.start()
    for t in threads: t.join()
    assert not errors, errors


# ---------------------------------------------------------------- host copies between 4K-aliased buffers (hcq/hostcopy.h)
def _host_copiers():
    from hcq import hostcopy, hotpath
    out = [pytest.param(hostcopy._copy_ctypes, id="ctypes")]
    if hotpath.available(): out.append(pytest.param(hotpath.host_copy_function(), id="extension"))
    return out


def _at_distance(pool: np.ndarray, base: np.ndarray, ahead: int, n: int) -> np.ndarray:
    """n bytes of `pool` starting `ahead` bytes (mod 4 KB) past `base`'s first byte."""
    start = (base.ctypes.data + ahead - pool.ctypes.data) % 4096
    return pool[start:start + n]


@pytest.mark.parametrize("copy", _host_copiers())
@pytest.mark.parametrize("n", [1023, 1024, 4096 + 7, 64 * 1024 + 3])
def test_host_copy_at_short_distances(copy, n):
    """The destination a few bytes past the source modulo 4 KB (where the vector loop replaces memmove) and around
    that band: every byte arrives, none past the end is touched."""
    src = pattern(n, n)
    pool = np.zeros(n + 2 * 4096 + 64, np.uint8)
    for ahead in (0, 1, 15, 16, 31, 32, 63, 64, 65, 4080):
        pool[:] = 0xA5
        dst = _at_distance(pool, src, ahead, n)
        copy(memoryview(dst), memoryview(src))
        assert np.array_equal(dst, src), f"{ahead} bytes ahead"
        start = dst.ctypes.data - pool.ctypes.data
        assert (pool[:start] == 0xA5).all() and (pool[start + n:] == 0xA5).all(), f"{ahead} bytes ahead: wrote outside"


@pytest.mark.parametrize("copy", _host_copiers())
@pytest.mark.parametrize("shift", [-16, 16, -4096, 4096])
def test_host_copy_overlapping_is_memmove(copy, shift):
    n = 3 * 4096
    data = pattern(n + 2 * 4096, 5)
    want = data.copy()
    lo = 4096
    want[lo + shift:lo + shift + n] = data[lo:lo + n].copy()
    copy(memoryview(data)[lo + shift:lo + shift + n], memoryview(data)[lo:lo + n])
    assert np.array_equal(data, want)


@pytest.mark.parametrize("copy", _host_copiers())
def test_host_copy_refuses_bad_buffers(copy):
    with pytest.raises(ValueError, match="do not fit"):
        copy(memoryview(bytearray(2048)), memoryview(bytes(4096)))
    with pytest.raises((TypeError, BufferError)):
        copy(memoryview(bytes(4096)), memoryview(bytes(4096)))  # read-only destination


@pytest.mark.parametrize("engine", [False, True], ids=["host", "copy-engine"])
def test_copyout_into_an_array_just_past_the_buffer_mod_4k(dev, engine):
    """A copyout into host memory 16 bytes past the device buffer modulo 4 KB (a numpy array's usual placement
    against page-aligned device memory), by the host and by the copy engine: the bytes arrive."""
    n = 256 * 1024 + 24
    buf = dev.allocator.alloc(n, SPEC)
    src = pattern(n, 9)
    dev.allocator.copyin(buf, memoryview(src))
    pool = np.zeros(n + 8192, np.uint8)
    dst = _at_distance(pool, np.frombuffer(buf.cpu_view().raw, np.uint8), 16, n)
    if engine: dev.allocator.host_copy_max = 0
    try:
        dev.allocator.copyout(memoryview(dst), buf)
    finally:
        dev.allocator.host_copy_max = HOST_COPY_MAX
    assert np.array_equal(dst, src)
    dev.allocator.free(buf, n, SPEC)


@pytest.mark.parametrize("copy", _host_copiers())
def test_host_copy_at_a_short_distance_is_not_crawling(copy):
    """Loose sanity bound: 256 KB copied 16 bytes ahead (mod 4 KB) takes at most 4x a copy 2 KB ahead, best of 30
    each. glibc's memmove took 10-15x on an AMD EPYC with glibc 2.36; the vector loop takes about 1x."""
    import time
    n = 256 * 1024
    src = pattern(n, 3)
    pool = np.zeros(n + 8192, np.uint8)
    best = {}
    for ahead in (2048, 16):
        dst = memoryview(_at_distance(pool, src, ahead, n))
        times = []
        for _ in range(30):
            t = time.perf_counter_ns()
            copy(dst, memoryview(src))
            times.append(time.perf_counter_ns() - t)
        best[ahead] = min(times)
    assert best[16] <= 4 * best[2048], best


# ---------------------------------------------------------------- small copies in one native call (hcq/_hotpath.c's HostCopier)
from hcq import hotpath  # noqa: E402
from hcq.allocator import HCQAllocator  # noqa: E402
from hcq.packets import POISON_TAG  # noqa: E402

native_copies = pytest.mark.skipif(not hotpath.available(), reason=f"extension not in use: {hotpath.why_not}")


@native_copies
def test_small_copies_on_a_cpu_device_are_native(small_dev):
    d, _ = small_dev
    assert type(d.allocator.copyin).__name__ == type(d.allocator.copyout).__name__ == "HostCopier"
    buf = d.allocator.alloc(SMALL * 4, SPEC)
    tv = d.timeline_value
    d.allocator.copyin(buf, np.arange(SMALL, dtype=np.int32))
    out = np.zeros((SMALL // 16, 16), np.int32)  # any C-contiguous buffer, as the method takes
    d.allocator.copyout(out, buf)
    assert (out.ravel() == np.arange(SMALL)).all() and d.timeline_value == tv


def _outcome(fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
        return None
    except Exception as e:  # noqa: BLE001 - compared below
        return type(e), str(e)


@native_copies
def test_native_small_copies_refuse_what_the_methods_refuse(small_dev):
    """Every refusal of the Python methods (called past the native path) is the native path's too, word for word."""
    d, _ = small_dev
    a = d.allocator
    buf, freed, ro = a.alloc(SMALL * 4, SPEC), a.alloc(SMALL * 4, NOLRU), a.alloc(SMALL * 4, SPEC)
    a.free(freed, SMALL * 4, NOLRU)
    ro._readonly = True
    data = np.arange(SMALL, dtype=np.int32)
    copyin_cases = [(buf, np.arange(2 * SMALL, dtype=np.int32)), (freed, data), (ro, data), (buf, np.arange(2 * SMALL, dtype=np.int32)[::2]),
                    ("not a buffer", data), (buf, 12345), (buf,), (buf, data, data)]
    copyout_cases = [(np.zeros(2 * SMALL, np.int32), buf), (np.zeros(SMALL, np.int32), freed), (np.zeros(SMALL, np.int32).view(), "x"),
                     (np.zeros(2 * SMALL, np.int32)[::2], buf), (bytes(SMALL * 4), buf)]
    ro_out = np.zeros(SMALL, np.int32)
    ro_out.flags.writeable = False
    copyout_cases.append((ro_out, buf))
    for fast, slow, cases in ((a.copyin, HCQAllocator.copyin, copyin_cases), (a.copyout, HCQAllocator.copyout, copyout_cases)):
        for args in cases:
            got, want = _outcome(fast, *args), _outcome(slow, a, *args)
            assert want is not None and got == want, (args, got, want)
    assert _outcome(a.copyin, buf, src=data) == _outcome(HCQAllocator.copyin, a, buf, src=data)
    # read-only memory may still be copied out of
    ro_data = np.zeros(SMALL, np.int32)
    a.copyout(ro_data, ro)


@native_copies
def test_native_small_copies_raise_once_the_device_failed(open_device):
    """A kernel fault on a queue that does not signal the timeline (so the timeline is reached, unpoisoned) and that no
    wait has seen yet: the next small copy raises DeviceError and copies nothing, as the method does."""
    d = open_device()
    poke = d.compile("HCQ_KERNEL void poke(int *out, long addr) { *(volatile int *)addr = 1; out[0] = 1; }", "poke")
    buf = d.allocator.alloc(SMALL * 4, SPEC)
    d.allocator.copyin(buf, np.full(SMALL, 3, np.int32))
    out = np.full(SMALL, -1, np.int32)
    try:
        d.hw_compute_queue_t().exec(poke, poke.fill_kernargs((buf,), (0x28,)), (1, 1, 1), (1, 1, 1)).submit(d)
        deadline = time.monotonic() + 10
        while not d.executor._failed_flag.value and time.monotonic() < deadline: time.sleep(0.001)
        assert d.executor._failed_flag.value and d.error_state is None
        assert d.timeline_signal.value >= d.timeline_value - 1  # the timeline says idle
        with pytest.raises(hcq.DeviceError, match="faulted"):
            d.allocator.copyin(buf, np.full(SMALL, 7, np.int32))
        d.error_state = None  # (so that the copyout meets the failure as the copyin did)
        with pytest.raises(hcq.DeviceError, match="faulted"):
            d.allocator.copyout(out, buf)
        assert (out == -1).all() and (np.frombuffer(buf.cpu_view().raw, np.int32) == 3).all()
    finally:
        d.recover()
    d.allocator.copyin(buf, np.full(SMALL, 7, np.int32))
    d.allocator.copyout(out, buf)
    assert (out == 7).all()


@native_copies
def test_native_small_copies_raise_on_a_closed_device(open_device):
    d = open_device()
    buf = d.allocator.alloc(SMALL * 4, SPEC)
    d.allocator.copyin(buf, np.full(SMALL, 3, np.int32))
    d.close()
    out = np.full(SMALL, -1, np.int32)
    for call in (lambda: d.allocator.copyin(buf, np.full(SMALL, 7, np.int32)), lambda: d.allocator.copyout(out, buf)):
        with pytest.raises(hcq.HCQError, match="was closed"):
            call()
    assert (out == -1).all() and (np.frombuffer(buf.cpu_view().raw, np.int32) == 3).all()


@native_copies
def test_native_small_copies_raise_on_a_poisoned_timeline(small_dev):
    """A timeline value stored by a failed device (the poison tag in its timestamp word): the copy raises and copies
    nothing."""
    d, _ = small_dev
    buf = d.allocator.alloc(SMALL * 4, SPEC)
    d.allocator.copyin(buf, np.full(SMALL, 3, np.int32))
    ts = d.timeline_signal._ts_mv
    saved = ts[0]
    ts[0] = POISON_TAG | 0xABCD  # a device id no device of the group has
    try:
        with pytest.raises(hcq.DeviceError, match="device #43981"):
            d.allocator.copyin(buf, np.full(SMALL, 7, np.int32))
    finally:
        ts[0] = saved
    out = np.zeros(SMALL, np.int32)
    d.allocator.copyout(out, buf)
    assert (out == 3).all()


@native_copies
def test_native_small_copies_follow_the_timeline_across_its_wrap(open_device):
    """After the timeline wraps onto its shadow signal, a small copyout behind a kernel still running waits for it (a
    native path still reading the old signal, at a value far past, would copy stale bytes)."""
    d = open_device()
    late = d.compile(SLOW_SRC, "late_fill")
    buf = d.allocator.alloc(SMALL * 4, SPEC)
    out = np.zeros(SMALL, np.int32)
    d.allocator.copyout(out, buf)  # the native path reads the first timeline signal
    tl, big = d.timeline_signal, (1 << 31) - 1
    d.hw_compute_queue_t().wait(tl, d.timeline_value - 1).signal(tl, big + 10).submit(d)
    d.timeline_value = big + 11
    d.synchronize()  # wraps
    assert d.timeline_signal is not tl and tl.value == big + 10
    for v in range(5):
        late(buf, vals=(v * 1000, 200_000, SMALL))  # not waited for
        out[:] = -1
        d.allocator.copyout(out, buf)
        assert (out == v * 1000 + np.arange(SMALL)).all(), "the copyout overtook the kernel"


@native_copies
def test_native_small_copies_step_aside_for_the_profiler(small_dev):
    d, _ = small_dev
    buf = d.allocator.alloc(SMALL * 4, SPEC)
    with hcq.profile() as p:
        d.allocator.copyin(buf, np.zeros(SMALL, np.int32))
    assert any(e.name == "copyin" for e in p.events), [e.name for e in p.events]


@native_copies
def test_native_small_copies_stay_off_where_a_backend_overrides_a_check(small_dev, monkeypatch):
    """The native copy stands in for the core's checks; a backend class that overrides one keeps the Python copies, and
    the allocator says so, naming the override."""
    d, _ = small_dev
    assert d._copy_checks_overridden() == [] and d.allocator.native_copies_why_not == ""
    assert type(d.allocator.__dict__["copyin"]).__name__ == "HostCopier"
    for cls, name in ((type(d.allocator), "_host_window"), (type(d), "check_error"), (type(d.timeline_signal), "wait")):
        with monkeypatch.context() as m:
            orig = getattr(cls, name)
            m.setattr(cls, name, lambda *a, _orig=orig, **k: _orig(*a, **k))
            assert d._copy_checks_overridden() == [f"{cls.__name__}.{name}"]
            fresh = type(d.allocator).__new__(type(d.allocator))
            fresh.dev, fresh.native_copies_why_not = d, "unset"
            fresh._fast_host_copies(d.executor.failed_flag_address(), d._copy_checks_overridden())
            assert fresh.native_copies_why_not == f"{cls.__name__}.{name} override the core's checks the native copy stands in for"
            assert "copyin" not in fresh.__dict__


def test_the_allocator_says_why_small_host_copies_are_not_native(dev):
    """`native_copies_why_not` is empty where small host copies are one native call, else it says why."""
    why = dev.allocator.native_copies_why_not
    if hotpath.available():
        assert why == "" and type(dev.allocator.copyin).__name__ == "HostCopier"
    else:
        assert why == f"the hot-path extension is not in use ({hotpath.why_not})" and "copyin" not in dev.allocator.__dict__


@native_copies
@pytest.mark.skipif(sys.version_info < (3, 12), reason="a Python-level buffer export (__buffer__) needs Python 3.12")
def test_an_interrupt_out_of_a_host_buffer_export_is_not_swallowed(small_dev):
    d, _ = small_dev
    buf = d.allocator.alloc(SMALL * 4, SPEC)

    class InterruptedOnce:
        """A Ctrl-C that lands in the first export: it must leave the call, not be cleared and the copy made."""
        def __init__(self):
            self.data, self.calls = bytearray(SMALL * 4), 0

        def __buffer__(self, flags):
            self.calls += 1
            if self.calls == 1: raise KeyboardInterrupt
            return memoryview(self.data)

    for call in (lambda: d.allocator.copyin(buf, InterruptedOnce()), lambda: d.allocator.copyout(InterruptedOnce(), buf)):
        with pytest.raises(KeyboardInterrupt):
            call()


# ---------------------------------------------------------------- host copies through another device's allocator
def _gated_fill_on(d, buf, n, v):
    """late_fill(buf, v) on `d`'s timeline, behind a gate the caller opens; returns the gate."""
    late = d.compile(SLOW_SRC, "late_fill")
    gate = d.new_signal(value=0)
    d.hw_compute_queue_t().wait(d.timeline_signal, d.timeline_value - 1).wait(gate, 1) \
        .exec(late, late.fill_kernargs((buf,), (v, 0, n)), (1, 1, 1), (1, 1, 1)).signal(d.timeline_signal, d.next_timeline()).submit(d)
    return gate


@pytest.mark.parametrize("nbytes", [SMALL * 4, 3 * MiB], ids=["small", "large"])
def test_host_copies_through_another_devices_allocator_are_refused(dev, dev1, tmp_path, nbytes):
    """dev's allocator asked to copy into or out of a buffer of dev1, while a dev1 kernel still writes it: refused,
    naming the owner, on the native path and the Python method alike, and nothing is copied (before, the copy went
    ahead at once, ordered on dev's idle timeline: the copyin was lost under the kernel, the copyout read stale bytes)."""
    n = nbytes // 4
    b = dev1.allocator.alloc(nbytes, SPEC)
    dev1.allocator.copyin(b, np.zeros(n, np.int32))
    path = tmp_path / "src.bin"
    path.write_bytes(np.full(n, 5, np.int32).tobytes())
    gate = _gated_fill_on(dev1, b, n, 7)
    out = np.full(n, -1, np.int32)
    a = dev.allocator
    calls = {"copyin": lambda: a.copyin(b, np.full(n, 9, np.int32)),
             "copyin (method)": lambda: HCQAllocator.copyin(a, b, memoryview(np.full(n, 9, np.int32))),
             "copyin of a view": lambda: a.copyin(b.offset(4, 64), np.full(16, 9, np.int32)),
             "copyout": lambda: a.copyout(out, b),
             "copyout (method)": lambda: HCQAllocator.copyout(a, memoryview(out), b),
             "copy_from_disk": lambda: a.copy_from_disk(b, str(path), nbytes)}
    try:
        for what, call in calls.items():
            with pytest.raises(ValueError, match=re.escape(dev1.device) + r"\b.*its own allocator"):
                call()
            assert (out == -1).all(), what
    finally:
        gate.value = 1
    dev1.allocator.copyout(out, b)  # the owner's copy waits for its kernel
    assert (out == 7 + np.arange(n)).all(), "a refused copy still wrote the buffer"
    dev1.allocator.free(b, nbytes, SPEC)
