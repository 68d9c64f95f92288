"""Signals, the signal pool, the device timeline (and its wrap), timeouts and the kernargs ring."""
import gc
import random
import re
import threading
import time
from decimal import Decimal

import numpy as np
import pytest

import hcq
from helpers import alloc, arr, use_kernargs_ring

TIMEOUT = 5000  # ms; generous, only hit when something is broken

STORE = r"""
HCQ_KERNEL void store(long *out, int idx, long val, int spin) {
  volatile int k = 0; while (k < spin) k++;
  out[idx] = val;
}
HCQ_KERNEL void dbl(float *out, const float *in, int n) { long i = hcq_global_id(0); if (i < n) out[i] = in[i]*2; }
"""


# ------------------------------------------------------------------ signal basics
def test_new_signal_value_and_timestamp(dev):
    s = dev.new_signal(value=3)
    assert s.value == 3
    assert isinstance(s.timestamp, Decimal) and s.timestamp == 0
    s.value = 5
    assert s.value == 5
    s.value = 2**64 - 1
    assert s.value == 2**64 - 1
    with pytest.raises(ValueError, match="outside"):
        s.value = -1
    with pytest.raises(ValueError, match="outside"):
        s.value = 2**64
    assert s.value == 2**64 - 1
    assert dev.new_signal().value == 0  # a fresh signal starts at 0 even from a reused slot


def test_timestamps_are_microseconds_and_increase(dev):
    s1, s2, done = dev.new_signal(), dev.new_signal(), dev.new_signal()
    t0 = Decimal(time.monotonic_ns()) / 1000
    q = dev.hw_compute_queue_t().timestamp(s1)
    sink = alloc(dev, 8)
    for i in range(2000): q.write(sink, i)  # some work between the two timestamps
    q.timestamp(s2).signal(done, 1).submit(dev)
    done.wait(1, timeout=TIMEOUT)
    t1 = Decimal(time.monotonic_ns()) / 1000
    assert isinstance(s1.timestamp, Decimal) and isinstance(s2.timestamp, Decimal)
    assert t0 <= s1.timestamp < s2.timestamp <= t1  # CLOCK_MONOTONIC, in microseconds
    assert s1.timestamp_divider == 1000


def test_host_value_seen_by_queue_wait_without_doorbell(dev):
    sig, done = dev.new_signal(value=0), dev.new_signal(value=0)
    buf = alloc(dev, 8)
    dev.hw_compute_queue_t().wait(sig, 1).write(buf, 0xAB).signal(done, 1).submit(dev)
    try:
        time.sleep(0.2)  # long enough for the queue thread to stop spinning and sleep
        assert done.value == 0 and arr(buf)[0] == 0
        sig.store(1, wake=False)  # a plain store into signal memory: no doorbell, no wake-up
        done.wait(1, timeout=TIMEOUT)
        assert arr(buf)[0] == 0xAB
    finally:
        if sig.value < 1: sig.value = 1


def test_host_signal_store_wakes_a_sleeping_queue(dev):
    sig, done = dev.new_signal(value=0), dev.new_signal(value=0)
    dev.hw_compute_queue_t().wait(sig, 7).signal(done, 1).submit(dev)
    time.sleep(0.05)
    assert done.value == 0
    sig.value = 7  # the setter stores natively and wakes sleepers
    done.wait(1, timeout=TIMEOUT)
    assert done.value == 1


def test_wait_timeout_message(dev):
    s = dev.new_signal(value=98761)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError) as ei:
        s.wait(123457, timeout=200)
    elapsed = time.monotonic() - t0
    assert isinstance(ei.value, hcq.HCQTimeoutError)
    msg = str(ei.value)
    assert f"{s.value_addr:x}" in msg  # names the signal
    assert re.search(r"\b123457\b", msg) and re.search(r"\b98761\b", msg), msg  # value waited for, value seen
    assert 0.18 <= elapsed < 10


def test_wait_returns_at_once_when_reached(dev):
    s = dev.new_signal(value=10)
    s.wait(10, timeout=0)
    s.wait(3, timeout=0)


@pytest.mark.full
def test_progress_aware_wait(dev):
    s = dev.new_signal(value=0)
    stop = threading.Event()

    def bump():
        for _ in range(20):
            if stop.wait(0.05): return
            s.value = s.value + 1

    th = threading.Thread(target=bump)
    t0 = time.monotonic()
    th.start()
    try:
        s.wait(20, timeout=150)  # 1 s in total, but the value never stands still for 150 ms
    finally:
        stop.set()
        th.join()
    assert s.value == 20
    assert time.monotonic() - t0 >= 0.9  # it really outlived the timeout


def test_progress_aware_wait_times_out_when_progress_stops(dev):
    s = dev.new_signal(value=0)

    def bump():
        for _ in range(4):
            time.sleep(0.05)
            s.value = s.value + 1

    th = threading.Thread(target=bump)
    th.start()
    try:
        with pytest.raises(hcq.HCQTimeoutError, match=r"\b4\b"):
            s.wait(100, timeout=150)
    finally:
        th.join()


def test_default_timeout_from_env(dev, monkeypatch):
    monkeypatch.setenv("HCQDEV_WAIT_TIMEOUT_MS", "200")
    s = dev.new_signal(value=0)
    t0 = time.monotonic()
    with pytest.raises(hcq.HCQTimeoutError, match="200 ms"):
        s.wait(1)
    assert time.monotonic() - t0 < 10  # not the 30 s default


# ------------------------------------------------------------------ signal pool
def test_signals_are_16_byte_slots_of_sigalloc_pages(dev, dev1):
    sigs = [dev.new_signal() for _ in range(300)] + [dev1.new_signal() for _ in range(300)]
    pages = hcq.HCQCompiled.signal_pages[dev.peer_group]
    assert dev.peer_group == dev1.peer_group
    addrs = [s.value_addr for s in sigs]
    assert len(set(addrs)) == len(addrs)  # no slot handed out twice
    for s in sigs:
        assert s.base_buf.size == 16 and s.timestamp_addr == s.value_addr + 8
        page = s.base_buf.base
        assert page in pages and page.size == dev.sigalloc_size
        assert (s.value_addr - page.va_addr) % 16 == 0
    for page in pages:  # mapped to every device of the peer group
        assert dev in page.mappings and dev1 in page.mappings


def test_signal_pool_reuse(dev):
    group = dev.peer_group
    gc.collect()
    pool, pages = hcq.HCQCompiled.signal_pool[group], hcq.HCQCompiled.signal_pages[group]
    held = [dev.new_signal() for _ in range(1000)]  # make the pool big enough for 1000 live signals
    del held
    npages, npool = len(pages), len(pool)
    assert npool >= 1000
    s = dev.new_signal(value=7)
    addr = s.value_addr
    del s  # its slot goes back to the pool ...
    s = dev.new_signal()
    assert s.value_addr == addr and s.value == 0  # ... and is handed out again, reset
    del s
    for i in range(10_000):
        s = dev.new_signal(value=i)
        assert s.value == i
    del s
    for _ in range(5):
        held = [dev.new_signal() for _ in range(1000)]
        assert len(pages) == npages
        del held
    assert len(pages) == npages and len(pool) >= npool  # no new pages, no slot lost


def test_failed_signal_creation_does_not_leak_slots(dev):
    group = dev.peer_group
    dev.new_signal()  # the pool exists
    pool = hcq.HCQCompiled.signal_pool[group]
    before = len(pool)
    for bad in (-1, 2**64):
        with pytest.raises(ValueError):
            dev.new_signal(value=bad)
    gc.collect()
    assert len(pool) == before, "a signal whose construction failed kept its pool slot"


# ------------------------------------------------------------------ timeline
def test_next_timeline_and_synchronize(dev):
    dev.synchronize()
    tv = dev.timeline_value
    assert dev.timeline_signal.value == tv - 1
    assert dev.next_timeline() == tv and dev.timeline_value == tv + 1
    gate = dev.new_signal()
    dev.hw_compute_queue_t().wait(gate, 1).signal(dev.timeline_signal, tv).submit(dev)
    try:
        with pytest.raises(hcq.HCQTimeoutError):
            dev.timeline_signal.wait(tv, timeout=100)  # (not synchronize: that would mark the device broken)
        gate.value = 1
        dev.synchronize()
    finally:
        if gate.value < 1: gate.value = 1
    assert dev.timeline_signal.value == tv


def test_error_state_after_synchronize_timeout(open_device):
    d = open_device()  # (a fresh device: this test breaks it)
    d.synchronize()
    gate = d.new_signal()
    tv = d.next_timeline()
    d.hw_compute_queue_t().wait(gate, 1).signal(d.timeline_signal, tv).submit(d)
    try:
        assert d.error_state is None
        with pytest.raises(hcq.HCQTimeoutError) as ei:
            d.synchronize(timeout=200)
        assert d.error_state is ei.value
        assert f"{d.timeline_signal.value_addr:x}" in str(ei.value) and re.search(rf"\b{tv}\b", str(ei.value))
    finally:
        gate.value = 1
    d.synchronize(timeout=TIMEOUT)  # released: the queue drains and the device is still usable
    out = alloc(d, 8)
    prg = d.compile(STORE, "store")
    prg(out, vals=(0, 4242, 0), wait=True)
    assert arr(out, np.int64)[0] == 4242


def test_timeline_wrap(open_device):
    d = open_device()
    d.allocator.direct_copy = False  # copies go through the staging ring, whose timelines must reset too
    d.allocator.host_copy_max = 0  # (small ones too)
    prg = d.compile(STORE, "dbl")
    d.synchronize()
    tl, shadow = d.timeline_signal, d._shadow_timeline_signal
    big = (1 << 31) - 1
    d.hw_compute_queue_t().wait(tl, d.timeline_value - 1).signal(tl, big - 1).submit(d)
    d.timeline_value = big
    d.synchronize()
    assert d.timeline_signal is tl and tl.value == big - 1  # not past the wrap point yet

    n = (5 << 20) // 4  # 3 chunks through the 2 MiB staging buffers: timeline values big .. big+2
    src = np.random.default_rng(3).standard_normal(n).astype(np.float32)
    a, b = alloc(d, n * 4), alloc(d, n * 4)
    d.allocator.copyin(a, memoryview(src))
    prg(b, a, global_size=(n // 256, 1, 1), local_size=(256, 1, 1), vals=(n,))
    assert d.timeline_value > (1 << 31)
    assert max(d.allocator.b_timeline) >= big
    d.synchronize()  # wraps

    assert d.timeline_signal is shadow and d._shadow_timeline_signal is tl
    assert d.timeline_value == 1 and d.timeline_signal.value == 0
    assert all(t == 0 for t in d.allocator.b_timeline)
    out = np.empty(n, np.float32)
    d.allocator.copyout(memoryview(out), b)  # staged, on the new timeline
    np.testing.assert_array_equal(out, src * 2)

    # work after the wrap: staged copies in and out, kernels, all on the new timeline signal
    src2 = src[::-1].copy()
    d.allocator.copyin(a, memoryview(src2))
    t = prg(b, a, global_size=(n // 256, 1, 1), local_size=(256, 1, 1), vals=(n,), wait=True)
    assert t is not None and t >= 0
    d.allocator.copyout(memoryview(out), b)
    np.testing.assert_array_equal(out, src2 * 2)
    assert 1 < d.timeline_value < 100 and d.timeline_signal.value == d.timeline_value - 1
    assert tl.value >= big  # the old signal, now the shadow, was left alone

    # a second wrap swaps back
    d.hw_compute_queue_t().wait(d.timeline_signal, d.timeline_value - 1).signal(d.timeline_signal, (1 << 31) + 10).submit(d)
    d.timeline_value = (1 << 31) + 11
    d.synchronize()
    assert d.timeline_signal is tl and d._shadow_timeline_signal is shadow and d.timeline_value == 1 and tl.value == 0
    prg(b, b, global_size=(n // 256, 1, 1), local_size=(256, 1, 1), vals=(n,), wait=True)
    d.allocator.copyout(memoryview(out), b)
    np.testing.assert_array_equal(out, src2 * 4)


# ------------------------------------------------------------------ kernargs ring
def _take_functions():
    """hcq/timeline_ring.h's take as the extension runs it and as the ctypes library does (every TimelineRing uses one)."""
    from hcq import hotpath, timeline_ring
    takes = [pytest.param(timeline_ring._ctypes_take(), id="ctypes")]
    if (ext := hotpath.timeline_ring_take_function()) is not None: takes.append(pytest.param(ext, id="extension"))
    return takes


def _ring(size, wait_tag, segments, take):
    ring = hcq.TimelineRing(size, wait_tag, segments=segments)
    ring._take = take
    return ring


@pytest.mark.parametrize("take", _take_functions())
def test_timeline_ring_waits_for_the_right_tag(take):
    waits = []
    ring = _ring(1024, waits.append, 4, take)  # 4 segments of 256 bytes
    offs = [ring.alloc(100, tag) for tag in range(1, 10)]
    assert offs == [0, 112, 224, 336, 448, 560, 672, 784, 896] and waits == []
    assert ring.alloc(100, 10) == 0  # wraps: segment 0 was last handed out to tag 3 (bytes 224..324)
    assert waits == [3]
    assert ring.alloc(100, 11) == 112 and waits == [3]  # same segment: nothing more to wait for
    assert ring.alloc(100, 12) == 224 and waits == [3, 5]  # enters segment 1, last used by tag 5 (448..548)
    ring.reset_tags()
    waits.clear()
    for tag in range(1, 8): ring.alloc(100, tag)
    assert waits == []
    with pytest.raises(ValueError, match="1024"):
        ring.alloc(1025, 9)


@pytest.mark.parametrize("take", _take_functions())
@pytest.mark.parametrize("size,segments", [(4096, 256), (1000, 7), (1 << 16, 16), (512, 2)])
def test_timeline_ring_never_hands_out_live_bytes(size, segments, take):
    rng = random.Random(size + segments)
    done = [0]  # newest finished tag; a wait finishes everything up to the tag waited for
    cur = [0]
    waited = []

    def wait_tag(tag):
        assert 0 < tag < cur[0], f"waited for tag {tag} while allocating for tag {cur[0]}"
        waited.append(tag)
        done[0] = max(done[0], tag)

    ring = _ring(size, wait_tag, segments, take)
    live = []  # (start, end, tag) handed out and not known finished
    for tag in range(1, 3000):
        cur[0] = tag
        if rng.random() < 0.1: done[0] = max(done[0], tag - 1 - rng.randrange(5))  # the device catches up sometimes
        budget = size // 4  # one submission's args stay well below the ring size
        for _ in range(rng.randrange(1, 4)):
            n = rng.randrange(1, max(2, min(budget, size // 8)))
            budget -= n
            if budget <= 0: break
            align = rng.choice([8, 16, 64])
            start = ring.alloc(n, tag, align)
            end = start + n
            assert start % align == 0 and 0 <= start and end <= size
            live = [r for r in live if r[2] > done[0]]
            for s, e, t in live:
                assert e <= start or end <= s, f"[{start},{end}) for tag {tag} overlaps live [{s},{e}) of tag {t}"
            live.append((start, end, tag))
    assert len(waited) > 10  # it wrapped many times


@pytest.mark.parametrize("take", _take_functions())
def test_timeline_ring_refuses_what_it_cannot_hand_out_and_a_failed_wait_changes_nothing(take):
    """Sizes and alignments no block can have raise ValueError naming them (never a crash: the take is C), a block of 0
    bytes is one byte, and a wait that raises (a timeout, a Ctrl-C) leaves the ring as it was, so a retry takes the
    same block."""
    ring = _ring(1024, lambda tag: None, 4, take)
    for size, align in ((-1, 16), (1025, 16), (1 << 62, 16), (16, 0), (16, -16)):
        with pytest.raises(ValueError, match=f"cannot allocate {size} bytes aligned to {align} for tag 1 from a 1024-byte ring"):
            ring.alloc(size, 1, align)
    for size, align, tag in ((1 << 64, 16, 1), (16, 1 << 63, 1), (16, 16, 1 << 63), (16, 16, -1)):  # (past int64: never wrapped)
        with pytest.raises(ValueError, match=f"cannot allocate {size} bytes aligned to {align} for tag {tag}"):
            ring.alloc(size, tag, align)
    assert list(ring.state) == [0, 0, 256, 0]
    assert ring.alloc(0, 1) == 0 and ring.alloc(0, 1) == 16
    assert ring.alloc(8, 1, 1 << 62) == 0 and ring.lap == 1  # (an alignment past the ring's end wraps to its start)
    for tag in range(2, 6): ring.alloc(200, tag)
    before = (list(ring.state), list(ring.seg_tags))

    def refuse(tag):
        raise TimeoutError(f"tag {tag} not reached")
    ring._wait_tag = refuse
    with pytest.raises(TimeoutError, match="tag 4 not reached"):  # (segments 0-1, last read by tags 3 and 4)
        ring.alloc(300, 6)
    assert (list(ring.state), list(ring.seg_tags)) == before
    ring._wait_tag = lambda tag: None
    assert ring.alloc(300, 6) == 0 and ring.lap == 2


def _with_small_ring(d, size, segments):
    waits = []

    def wait_tag(tag):
        waits.append(tag)
        d._wait_for_tag(tag)

    d.synchronize()
    return use_kernargs_ring(d, hcq.TimelineRing(size, wait_tag, segments=segments)), waits


@pytest.mark.parametrize("size,segments", [(512, 8), (4096, 256), (1000, 3)])
def test_kernargs_ring_wraps_under_load(open_device, size, segments):
    if hcq.validation.enabled: pytest.skip("validation mode turns the launch fast path, the ring's only user, off")
    d = open_device()
    prg = d.compile(STORE, "store")
    n = 2500
    out = alloc(d, n * 8)
    arr(out, np.int64)[:] = -1
    orig, waits = _with_small_ring(d, size, segments)
    try:
        for i in range(n):
            prg(out, vals=(i, i * 7 + 3, 20000 if i % 7 else 60000), wait=False)  # slow kernels: the host runs ahead
        d.synchronize()
    finally:
        d.synchronize()  # nothing may still read the small ring's bytes when the real ring comes back
        use_kernargs_ring(d, orig)
    np.testing.assert_array_equal(arr(out, np.int64), np.arange(n) * 7 + 3)
    laps = n * 32 // size
    assert len(waits) >= laps  # it wrapped (and waited) many times


def test_queue_built_launches_own_their_kernargs(open_device):
    """Args states from fill_kernargs own their blocks: they never take (or wait for) the kernargs ring, which
    only the launch fast path uses, so 1500 of them leave a tiny ring untouched and still read the right arguments."""
    d = open_device()
    prg = d.compile(STORE, "store")
    n = 1500
    out = alloc(d, n * 8)
    arr(out, np.int64)[:] = -1
    orig, waits = _with_small_ring(d, 640, 10)
    try:
        for i in range(n):
            args = prg.fill_kernargs((out,), vals=(i, 5 * i + 1, 20000))
            d.hw_compute_queue_t().wait(d.timeline_signal, d.timeline_value - 1).exec(prg, args, (1, 1, 1), (1, 1, 1)) \
                .signal(d.timeline_signal, d.next_timeline()).submit(d)
        d.synchronize()
    finally:
        d.synchronize()  # nothing may still read the small ring's bytes when the real ring comes back
        use_kernargs_ring(d, orig)
    np.testing.assert_array_equal(arr(out, np.int64), np.arange(n) * 5 + 1)
    assert waits == [] and d.kernargs_allocator.head == 0


def test_kernargs_default_ring_under_load(dev):
    prg = dev.compile(STORE, "store")
    n = 3000
    out = alloc(dev, n * 8)
    arr(out, np.int64)[:] = -1
    assert dev.kernargs_allocator.size == dev.kernargs_size == 16 << 20
    for i in range(n): prg(out, vals=(i, 3 * i, 0))
    dev.synchronize()
    np.testing.assert_array_equal(arr(out, np.int64), np.arange(n) * 3)


def test_a_long_wait_builds_no_description_per_slice(dev, monkeypatch):
    """A wait checks the device between 20 ms slices; the text naming the signal is built only for a message
    (tinygrad's JIT waits once built it 487 times in 20 calls)."""
    sig = dev.new_signal(value=0)
    described = []
    real = type(sig).__repr__
    monkeypatch.setattr(type(sig), "__repr__", lambda s: described.append(1) or real(s))
    threading.Timer(0.25, lambda: sig.store(1)).start()
    sig.wait(1, timeout=TIMEOUT)  # about 12 slices
    assert described == []
    with pytest.raises(hcq.HCQTimeoutError, match=r"waiting for <signal 0x[0-9a-f]+ of CPU:0> to reach 2"):
        sig.wait(2, timeout=60)  # the message still names it


def test_the_default_compare_exchange_is_an_atomic_swap_of_host_memory():
    """HCQSignal.compare_exchange without a backend's override: a hardware compare-and-swap of the word in host memory
    (backends need not write one for host-visible signals). Four threads increment one signal through it, 20,000
    times each (ctypes lets them run at once): no increment is lost."""
    import ctypes
    from hcq.memory import HCQBuffer, MMIOInterface
    from hcq.signal import HCQSignal
    words = (ctypes.c_uint64 * 2)()
    addr = ctypes.addressof(words)
    sig = HCQSignal(HCQBuffer(addr, 16, view=MMIOInterface(addr, 16, keepalive=words)), value=5)
    assert sig.compare_exchange(4, 9) == 5 and sig.load() == 5  # not what it holds: unchanged
    assert sig.compare_exchange(5, 9) == 5 and sig.load() == 9
    sig.store(0)

    def add(n: int) -> None:
        for _ in range(n):
            while True:
                seen = sig.load()
                if sig.compare_exchange(seen, seen + 1) == seen: break
    threads = [threading.Thread(target=add, args=(20_000,)) for _ in range(4)]
    for t in threads: t.start()
    for t in threads: t.join(60)
    assert sig.load() == 80_000
    for bad in (-1, 1 << 64, True, 1.5):  # (ctypes would wrap the first two silently)
        with pytest.raises((TypeError, ValueError), match="compare_exchange desired"):
            sig.compare_exchange(80_000, bad)
    assert sig.load() == 80_000
    with pytest.raises(ValueError, match="aligned"):
        from hcq import atomics
        atomics.cas64(addr + 4, 0, 1)
