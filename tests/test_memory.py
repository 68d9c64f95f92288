"""Memory: BufferSpec, HCQBuffer (allocation, offset views, freeing, the LRU cache, mappings) and
MMIOInterface (the typed host window cpu_view() returns)."""
import dataclasses
import struct

import numpy as np
import pytest

import hcq
from hcq import BufferSpec, HCQBuffer, MMIOInterface


# ---------------------------------------------------------------- BufferSpec
def test_bufferspec_defaults():
    spec = BufferSpec()
    assert (spec.host, spec.cpu_access, spec.uncached, spec.nolru) == (False, False, False, False)
    assert spec == BufferSpec(host=False, cpu_access=False, uncached=False, nolru=False)
    assert BufferSpec(nolru=True) != spec


def test_bufferspec_is_frozen_and_hashable():
    spec = BufferSpec(cpu_access=True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.host = True
    assert {spec: 1}[BufferSpec(cpu_access=True)] == 1  # usable as the LRU cache key


# ---------------------------------------------------------------- alloc
@pytest.mark.parametrize("size", [1, 7, 4096, 4097, 3 << 20])
def test_alloc_returns_buffer(dev, size):
    spec = BufferSpec(cpu_access=True)
    buf = dev.allocator.alloc(size, spec)
    try:
        assert isinstance(buf, HCQBuffer)
        assert isinstance(buf.va_addr, int) and buf.va_addr != 0
        assert buf.size == size
        assert buf.base is buf and not buf.freed
        assert len(buf.cpu_view()) == size
        buf.cpu_view()[size - 1] = 0xAB  # the whole range is usable
        assert buf.cpu_view()[size - 1] == 0xAB
    finally:
        dev.allocator.free(buf, size, spec)


def test_alloc_default_options(dev):
    buf = dev.allocator.alloc(256)
    try:
        assert buf.size == 256
    finally:
        dev.allocator.free(buf, 256)


def test_distinct_allocations_do_not_overlap(dev):
    spec = BufferSpec(cpu_access=True, nolru=True)
    bufs = [dev.allocator.alloc(4096, spec) for _ in range(8)]
    try:
        for i, b in enumerate(bufs): b.cpu_view()[:] = bytes([i]) * 4096
        for i, b in enumerate(bufs): assert b.cpu_view()[:] == bytes([i]) * 4096
        spans = sorted((b.va_addr, b.va_addr + b.size) for b in bufs)
        assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))
    finally:
        for b in bufs: dev.allocator.free(b, 4096, spec)


@pytest.mark.parametrize("size", [0, -1, -4096, 1.5, 4096.0, "4096", None, True])
def test_alloc_bad_size_raises(dev, size):
    with pytest.raises(ValueError, match="positive int"):
        dev.allocator.alloc(size, BufferSpec())


def test_alloc_bad_options_raises(dev):
    with pytest.raises(TypeError, match="BufferSpec"):
        dev.allocator.alloc(64, {"cpu_access": True})


# ---------------------------------------------------------------- offset views
def test_offset_views(dev):
    spec = BufferSpec(cpu_access=True)
    buf = dev.allocator.alloc(1024, spec)
    try:
        buf.cpu_view()[:] = bytes(1024)
        v = buf.offset(100, 50)
        assert v.va_addr == buf.va_addr + 100 and v.size == 50
        assert v.base is buf
        rest = buf.offset(1000)
        assert rest.size == 24 and rest.va_addr == buf.va_addr + 1000
        whole = buf.offset()
        assert whole.size == 1024 and whole.va_addr == buf.va_addr
        assert buf.offset(1024).size == 0  # an empty view at the end is fine
        # writes through a view land in the allocation at the right place
        v.cpu_view()[:] = bytes(range(50))
        assert buf.cpu_view()[100:150] == bytes(range(50))
        assert buf.cpu_view()[99] == 0 and buf.cpu_view()[150] == 0
        # a view of a view is relative to its parent, and its base is the allocation
        vv = v.offset(10, 5)
        assert vv.va_addr == buf.va_addr + 110 and vv.size == 5 and vv.base is buf
        assert vv.cpu_view()[:] == bytes(range(10, 15))
    finally:
        dev.allocator.free(buf, 1024, spec)


@pytest.mark.parametrize("offset,size", [(-1, None), (-1, 4), (0, 1025), (1025, None), (1000, 25), (10, -1), (1024, 1)])
def test_offset_out_of_bounds_raises(dev, offset, size):
    spec = BufferSpec(cpu_access=True)
    buf = dev.allocator.alloc(1024, spec)
    try:
        with pytest.raises(ValueError, match="outside"):
            buf.offset(offset, size)
    finally:
        dev.allocator.free(buf, 1024, spec)


def test_offset_of_view_out_of_bounds_raises(dev):
    spec = BufferSpec(cpu_access=True)
    buf = dev.allocator.alloc(1024, spec)
    try:
        v = buf.offset(512, 100)
        with pytest.raises(ValueError, match="outside"):
            v.offset(50, 51)  # inside the allocation, but outside the 100-byte view
    finally:
        dev.allocator.free(buf, 1024, spec)


# ---------------------------------------------------------------- cpu_view / MMIOInterface
def test_cpu_view_bytes(dev):
    spec = BufferSpec(cpu_access=True)
    buf = dev.allocator.alloc(64, spec)
    try:
        mv = buf.cpu_view()
        assert isinstance(mv, MMIOInterface)
        assert len(mv) == 64
        mv[:] = bytes(range(64))
        assert mv[0] == 0 and mv[63] == 63 and mv[-1] == 63
        assert mv[3:7] == bytes([3, 4, 5, 6]) and isinstance(mv[3:7], bytes)
        mv[10:13] = b"\xff\xfe\xfd"
        assert mv[9:14] == bytes([9, 0xFF, 0xFE, 0xFD, 13])
        mv[20:22] = [1, 2]  # a list of ints works for 'B' too
        assert mv[20:22] == b"\x01\x02"
        mv[5] = 200
        assert mv[5] == 200
        with pytest.raises(IndexError):
            mv[64]
    finally:
        dev.allocator.free(buf, 64, spec)


def test_cpu_view_typed_views(dev):
    spec = BufferSpec(cpu_access=True)
    buf = dev.allocator.alloc(64, spec)
    try:
        raw = buf.cpu_view()
        raw[:] = bytes(64)
        words = raw.view(fmt="I")
        assert len(words) == 16 and words.fmt == "I"
        words[:] = list(range(100, 116))  # slice assignment from a list of ints
        assert words[0:4] == [100, 101, 102, 103] and isinstance(words[0:4], list)
        assert words[15] == 115
        assert raw[0:8] == struct.pack("<2I", 100, 101)
        words[2:4] = struct.pack("<2I", 0xDEADBEEF, 7)  # and from bytes
        assert words[2] == 0xDEADBEEF and words[3] == 7
        words[1] = 0xFFFFFFFF
        assert struct.unpack_from("<I", raw[:], 4)[0] == 0xFFFFFFFF

        # a sub-window at an offset, retyped
        sub = raw.view(8, 16, "Q")
        assert len(sub) == 2 and sub.nbytes == 16 and sub.addr == raw.addr + 8
        sub[0] = (1 << 64) - 1
        assert words[2] == 0xFFFFFFFF and words[3] == 0xFFFFFFFF
        # a view keeps the parent's format unless told otherwise
        w2 = words.view(4, 8)
        assert w2.fmt == "I" and len(w2) == 2 and w2[0:2] == [words[1], words[2]]
        # default size: to the end
        tail = raw.view(60)
        assert len(tail) == 4
        f = raw.view(32, 8, "f")
        f[:] = [1.5, -2.25]
        assert f[0:2] == [1.5, -2.25]
        assert np.frombuffer(raw[32:40], np.float32).tolist() == [1.5, -2.25]
    finally:
        dev.allocator.free(buf, 64, spec)


def test_cpu_view_bad_slice_assignment_raises_valueerror(dev):
    """A slice assignment of the wrong length or with values out of range raises ValueError, whether the
    new contents come as bytes or as a list, and leaves the memory unchanged."""
    spec = BufferSpec(cpu_access=True)
    buf = dev.allocator.alloc(16, spec)
    try:
        words = buf.cpu_view().view(fmt="I")
        words[:] = [1, 2, 3, 4]
        with pytest.raises(ValueError):
            words[0:2] = struct.pack("<3I", 7, 7, 7)
        with pytest.raises(ValueError):
            words[0:2] = [7, 7, 7]
        with pytest.raises(ValueError):
            words[0:2] = [7, -1]
        with pytest.raises(ValueError):
            words[0:2] = [7, 1 << 32]
        assert words[:] == [1, 2, 3, 4]
    finally:
        dev.allocator.free(buf, 16, spec)


@pytest.mark.parametrize("offset,size", [(-1, 4), (0, 65), (64, 1), (60, 8), (8, -1), (65, None)])
def test_cpu_view_view_out_of_bounds(dev, offset, size):
    spec = BufferSpec(cpu_access=True)
    buf = dev.allocator.alloc(64, spec)
    try:
        with pytest.raises(ValueError, match="outside"):
            buf.cpu_view().view(offset, size)
    finally:
        dev.allocator.free(buf, 64, spec)


def test_cpu_view_view_size_not_multiple_of_format(dev):
    spec = BufferSpec(cpu_access=True)
    buf = dev.allocator.alloc(64, spec)
    try:
        with pytest.raises(ValueError, match="whole number"):
            buf.cpu_view().view(0, 6, "I")
    finally:
        dev.allocator.free(buf, 64, spec)


def test_cpu_view_of_offset_view_is_the_same_memory(dev):
    spec = BufferSpec(cpu_access=True)
    buf = dev.allocator.alloc(4096, spec)
    try:
        buf.cpu_view()[:] = bytes(4096)
        v = buf.offset(1000, 8).cpu_view()
        assert len(v) == 8
        v.view(fmt="I")[:] = [0x11223344, 0x55667788]
        assert buf.cpu_view().view(1000, 8, "I")[0:2] == [0x11223344, 0x55667788]
    finally:
        dev.allocator.free(buf, 4096, spec)


def test_cpu_view_without_host_view_raises(dev):
    buf = HCQBuffer(0x1000, 64)  # device-only memory: no host view
    with pytest.raises(hcq.NotHostVisibleError, match="not host-visible"):
        buf.cpu_view()
    with pytest.raises(hcq.NotHostVisibleError):
        buf.offset(8, 8).cpu_view()


def test_cpu_view_of_freed_buffer_raises(dev):
    spec = BufferSpec(cpu_access=True, nolru=True)
    buf = dev.allocator.alloc(64, spec)
    dev.allocator.free(buf, 64, spec)
    assert buf.freed
    with pytest.raises(RuntimeError, match="freed"):
        buf.cpu_view()


# ---------------------------------------------------------------- free
def test_free_and_double_free(dev):
    spec = BufferSpec(cpu_access=True)
    buf = dev.allocator.alloc(123, spec)
    dev.allocator.free(buf, 123, spec)
    assert buf.freed
    with pytest.raises(ValueError, match="already freed"):
        dev.allocator.free(buf, 123, spec)


def test_double_free_nolru(dev):
    spec = BufferSpec(cpu_access=True, nolru=True)
    buf = dev.allocator.alloc(4096, spec)
    dev.allocator.free(buf, 4096, spec)
    with pytest.raises(ValueError, match="already freed"):
        dev.allocator.free(buf, 4096, spec)


def test_free_wrong_size_raises(dev):
    spec = BufferSpec(cpu_access=True)
    buf = dev.allocator.alloc(100, spec)
    with pytest.raises(ValueError, match="size 99"):
        dev.allocator.free(buf, 99, spec)
    assert not buf.freed  # a refused free leaves the buffer alone
    buf.cpu_view()[0] = 1
    dev.allocator.free(buf, 100, spec)


def test_free_of_view_raises(dev):
    spec = BufferSpec(cpu_access=True)
    buf = dev.allocator.alloc(100, spec)
    try:
        with pytest.raises(ValueError, match="view"):
            dev.allocator.free(buf.offset(0, 100), 100, spec)
        assert not buf.freed
    finally:
        dev.allocator.free(buf, 100, spec)


def test_views_see_free(dev):
    spec = BufferSpec(cpu_access=True)
    buf = dev.allocator.alloc(100, spec)
    v = buf.offset(10, 10)
    assert not v.freed
    dev.allocator.free(buf, 100, spec)
    assert v.freed


# ---------------------------------------------------------------- LRU cache
def test_lru_reuses_freed_buffer(dev):
    size, spec = 12345, BufferSpec(cpu_access=True)
    a = dev.allocator.alloc(size, spec)
    addr = a.va_addr
    a.cpu_view()[0:4] = b"lru!"
    dev.allocator.free(a, size, spec)
    b = dev.allocator.alloc(size, spec)
    try:
        assert b is not a and b.va_addr == addr and a.freed  # the same memory under a new buffer object: `a` stays freed
        assert not b.freed and b.cpu_view()[0:4] == b"lru!"  # the same memory, usable again
    finally:
        dev.allocator.free(b, size, spec)


def test_lru_keys_on_size_and_spec(dev):
    size, spec = 12347, BufferSpec(cpu_access=True)
    a = dev.allocator.alloc(size, spec)
    dev.allocator.free(a, size, spec)
    other_size = dev.allocator.alloc(size + 1, spec)
    other_spec = dev.allocator.alloc(size, BufferSpec(cpu_access=True, uncached=True))
    try:
        assert other_size is not a and other_spec is not a
        assert a.freed  # still in the cache, untouched
        again = dev.allocator.alloc(size, spec)
        assert again.va_addr == a.va_addr and again is not a and a.freed
        dev.allocator.free(again, size, spec)
    finally:
        dev.allocator.free(other_size, size + 1, spec)
        dev.allocator.free(other_spec, size, BufferSpec(cpu_access=True, uncached=True))


def test_nolru_does_not_reuse(dev):
    size, spec = 12349, BufferSpec(cpu_access=True, nolru=True)
    a = dev.allocator.alloc(size, spec)
    dev.allocator.free(a, size, spec)
    assert all(a not in bufs for bufs in dev.allocator.cache.values())
    b = dev.allocator.alloc(size, spec)
    try:
        assert b is not a and not b.freed and a.freed
        b.cpu_view()[:] = bytes(size)  # the new one is fully usable
    finally:
        dev.allocator.free(b, size, spec)


def test_free_cache_releases_cached_buffers(dev):
    size, spec = 12351, BufferSpec(cpu_access=True)
    a = dev.allocator.alloc(size, spec)
    dev.allocator.free(a, size, spec)
    dev.allocator.free_cache()
    assert not dev.allocator.cache.get((size, spec))
    b = dev.allocator.alloc(size, spec)
    try:
        assert b is not a
    finally:
        dev.allocator.free(b, size, spec)


# ---------------------------------------------------------------- mappings
def test_alloc_is_mapped_on_its_device(dev):
    spec = BufferSpec(cpu_access=True)
    buf = dev.allocator.alloc(64, spec)
    try:
        assert buf.owner is dev
        assert dev in buf.mappings and dev in buf.mapped_devs
    finally:
        dev.allocator.free(buf, 64, spec)


def test_map_records_mapping(dev, dev1):
    spec = BufferSpec(cpu_access=True, nolru=True)
    buf = dev.allocator.alloc(4096, spec)
    try:
        assert dev1 not in buf.mappings
        dev1.allocator.map(buf)
        assert dev1 in buf.mappings and dev1 in buf.mapped_devs and dev in buf.mapped_devs
        assert buf.mappings[dev1].va_addr == buf.va_addr  # one address space for all CPU devices
        dev1.allocator.map(buf)  # a no-op the second time
        assert buf.mapped_devs.count(dev1) == 1
        # mappings are shared by views, and mapping through a view maps the allocation
        v = buf.offset(128, 64)
        assert dev1 in v.mappings
    finally:
        dev.allocator.free(buf, 4096, spec)


def test_map_through_view(dev, dev1):
    spec = BufferSpec(cpu_access=True, nolru=True)
    buf = dev.allocator.alloc(4096, spec)
    try:
        dev1.allocator.map(buf.offset(64, 64))
        assert dev1 in buf.mappings
        assert buf.mappings[dev1].size == 4096  # the allocation is mapped, not just the view
    finally:
        dev.allocator.free(buf, 4096, spec)


def test_mapped_buffer_is_usable_by_other_device(dev, dev1):
    spec = BufferSpec(cpu_access=True, nolru=True)
    buf = dev.allocator.alloc(64 * 4, spec)
    try:
        dev1.allocator.map(buf)
        prg = dev1.compile("HCQ_KERNEL void fill(unsigned *o, unsigned v) { o[hcq_global_id(0)] = v + hcq_global_id(0); }", "fill")
        prg(buf, global_size=(4, 1, 1), local_size=(16, 1, 1), vals=(1000,), wait=True)
        assert buf.cpu_view().view(fmt="I")[:] == [1000 + i for i in range(64)]
    finally:
        dev.allocator.free(buf, 64 * 4, spec)


# ---------------------------------------------------------------- the process's mapping limit (vm.max_map_count)
MAP_LIMIT_SCRIPT = r"""
import numpy as np
import hcq
dev = hcq.Device("CPU:0")
bufs = []
try:
    while True: bufs.append(dev.allocator.alloc(128 << 10))
except MemoryError as e:
    assert "vm.max_map_count" in str(e), e
# with every buffer it allowed still held, the runtime works: Python objects, new signals (signal pages), a
# kernel (a library to load), copies and launches
junk = [str(i) * 20 for i in range(300_000)]
sigs = [dev.new_signal() for _ in range(2000)]
prg = dev.compile("HCQ_KERNEL void k(int *a, int v) { a[0] = v; }", "k")
dev.allocator.copyin(bufs[0], memoryview(np.arange(8, dtype=np.int32)))
prg(bufs[0], vals=(5,), wait=True)
assert bufs[0].cpu_view().view(0, 8, "i")[:2] == [5, 1]
for b in bufs: dev.allocator.free(b, 128 << 10)  # never raises
dev.allocator.free_cache()
other = hcq.Device("CPU:1")  # what was given back can be used again: another device, the same allocations
again = [dev.allocator.alloc(128 << 10) for _ in range(len(bufs) // 2)]
prg(again[-1], vals=(6,), wait=True)
assert again[-1].cpu_view().view(0, 4, "i")[0] == 6
print("ok", len(bufs))
"""


@pytest.mark.full
def test_allocating_up_to_the_mapping_limit_leaves_the_process_working():
    """Reliability III, 2: allocations stop short of vm.max_map_count (a reserve is kept for Python, kernels, signals
    and other devices, which keep working while the buffers are held), freeing never fails, and what was freed can be
    allocated again."""
    import subprocess, sys, pathlib
    root = pathlib.Path(__file__).resolve().parent.parent
    r = subprocess.run([sys.executable, "-c", MAP_LIMIT_SCRIPT], capture_output=True, text=True, timeout=300, cwd=root)
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]


def _mapping_of(addr):
    """(permissions, resident kB) of the mapping holding `addr` in this process, or None."""
    with open("/proc/self/smaps") as f:
        lines = f.read().splitlines()
    for i, line in enumerate(lines):
        head = line.split()
        if "-" in head[0] and len(head) >= 5 and ":" in head[3]:
            lo, hi = (int(x, 16) for x in head[0].split("-"))
            if lo <= addr < hi:
                rss = next(int(x.split()[1]) for x in lines[i + 1:] if x.startswith("Rss:"))
                return head[1], rss
    return None


def test_a_release_that_munmap_refuses_still_gives_the_memory_back(dev, monkeypatch):
    """At the mapping limit munmap can refuse (ENOMEM: the range would cut a mapping merged with a neighbour's guard
    page in two). The release then makes the range inaccessible and drops its memory, and unmaps it at a later release."""
    import gc
    import types
    from hcq.backends.cpu import device as cpu
    libc, refused = cpu._libc, []

    def munmap(addr, length):  # the first one fails, as at the limit
        if refused: return libc.munmap(addr, length)
        refused.append((addr, length))
        return -1
    gc.collect()  # (memory of earlier tests' closed devices is unmapped now, not in the collections below: that would be a later release)
    spec = BufferSpec(nolru=True)
    a, b = dev.allocator.alloc(1 << 20, spec), dev.allocator.alloc(1 << 20, spec)
    a.cpu_view()[:] = b"\x5a" * (1 << 20)
    addr = a.va_addr
    assert _mapping_of(addr) == ("rw-p", 1024)
    monkeypatch.setattr(cpu, "_libc", types.SimpleNamespace(munmap=munmap, mprotect=libc.mprotect, madvise=libc.madvise, mmap=libc.mmap))
    dev.allocator.free(a, 1 << 20, spec)  # no exception
    del a
    gc.collect()
    assert refused and refused[0][0] + cpu.PAGE == addr
    assert _mapping_of(addr) == ("---p", 0)  # inaccessible (nothing can use it by mistake) and its memory given back
    assert refused[0] in cpu._unmapped_later
    dev.allocator.free(b, 1 << 20, spec)  # the next release unmaps it too
    del b
    gc.collect()
    assert _mapping_of(addr) is None and not cpu._unmapped_later
