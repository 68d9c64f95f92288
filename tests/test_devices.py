"""Opening devices: names, caching, the default device (DEV), peer groups,
synchronize, queue_stats and the worker-count variable."""
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

import hcq
from hcq.allocator import HOST_COPY_MAX
from hcq import BufferSpec

SPEC = BufferSpec(cpu_access=True)


def test_device_names_are_cached(dev):
    assert dev.device == "CPU:0"  # (no other CPU device is open: the fixture's is CPU:0, the one "CPU" names)
    assert hcq.Device("CPU") is dev  # index under test
    assert hcq.Device("CPU:0") is dev  # index under test
    assert hcq.Device("cpu") is dev  # index under test
    assert hcq.Device("cpu:0") is dev  # index under test


def test_second_device_is_distinct(dev, dev1):
    assert dev1 is not dev
    assert dev1.device == "CPU:1"
    assert hcq.Device("CPU:1") is dev1 and hcq.Device("cpu:1") is dev1  # index under test
    assert dev.peer_group == dev1.peer_group == "CPU"
    assert dev in dev1.peers() and dev1 in dev.peers()
    assert dev.timeline_signal is not dev1.timeline_signal
    assert dev.allocator is not dev1.allocator
    assert dev in hcq.opened_devices() and dev1 in hcq.opened_devices()
    assert "CPU" in hcq.available_backends()


def test_devices_run_independently(dev, dev1):
    src = "HCQ_KERNEL void fill(int *o, int v) { o[hcq_global_id(0)] = v; }"
    p0, p1 = dev.compile(src, "fill"), dev1.compile(src, "fill")
    a, b = dev.allocator.alloc(64 * 4, SPEC), dev1.allocator.alloc(64 * 4, SPEC)
    try:
        p0(a, global_size=(4, 1, 1), local_size=(16, 1, 1), vals=(1,))
        p1(b, global_size=(4, 1, 1), local_size=(16, 1, 1), vals=(2,))
        dev.synchronize()
        dev1.synchronize()
        assert np.all(np.frombuffer(a.cpu_view().mv, np.int32) == 1)
        assert np.all(np.frombuffer(b.cpu_view().mv, np.int32) == 2)
    finally:
        dev.allocator.free(a, 64 * 4, SPEC)
        dev1.allocator.free(b, 64 * 4, SPEC)


def test_default_device_from_dev_env(dev, dev1, monkeypatch):
    monkeypatch.setenv("DEV", "CPU:1")
    assert hcq.Device() is dev1
    monkeypatch.setenv("DEV", "cpu")
    assert hcq.Device() is dev
    monkeypatch.delenv("DEV")
    assert hcq.Device() is dev


@pytest.mark.parametrize("name", ["CPU:x", "", "   ", ":1", "CPU:", "CPU:-1", "CPU:1:2", "CPU 1", "1CPU"])
def test_bad_device_names(name):
    with pytest.raises(ValueError, match="bad device name"):
        hcq.Device(name)


@pytest.mark.parametrize("name", ["GPU9", "GPU", "NOPE:0"])
def test_unknown_backend(name):
    with pytest.raises(ValueError, match=r"unknown device.*CPU"):
        hcq.Device(name)


def test_non_string_name():
    with pytest.raises(TypeError, match="str"):
        hcq.Device(0)


def test_synchronize_waits_for_work(dev):
    prg = dev.compile("""
HCQ_KERNEL void slow(uint32_t *o, int iters) {
  uint32_t x = (uint32_t)hcq_global_id(0);
  for (int i = 0; i < iters; i++) x = x * 1664525u + 1013904223u;
  o[hcq_global_id(0)] = x;
}""", "slow")
    n, iters = 1 << 14, 5000
    buf = dev.allocator.alloc(n * 4, SPEC)
    try:
        buf.cpu_view()[:] = bytes(n * 4)
        prg(buf, global_size=(n // 64, 1, 1), local_size=(64, 1, 1), vals=(iters,))
        dev.synchronize()
        assert dev.timeline_signal.value >= dev.timeline_value - 1
        x = np.arange(n, dtype=np.uint64)
        for _ in range(iters): x = (x * 1664525 + 1013904223) & 0xFFFFFFFF
        assert np.array_equal(np.frombuffer(buf.cpu_view().mv, np.uint32), x.astype(np.uint32))
        dev.synchronize()  # nothing pending: returns at once
        dev.synchronize(timeout=1000)
    finally:
        dev.allocator.free(buf, n * 4, SPEC)


def test_synchronize_timeout_names_the_signal(dev):
    """A queue stuck on a wait makes synchronize time out with a message naming the signal and values;
    setting the signal from the host lets the work finish. (The timeout is recorded in the fresh device's error_state.)"""
    sig = dev.new_signal(value=0)
    dev.hw_compute_queue_t().wait(sig, 1).signal(dev.timeline_signal, dev.next_timeline()).submit(dev)
    target = dev.timeline_value - 1
    with pytest.raises(hcq.HCQTimeoutError, match=rf"(?s)timeline signal.*{target}.*it is at {target - 1}"):
        dev.synchronize(timeout=100)
    assert isinstance(dev.error_state, hcq.HCQTimeoutError)
    sig.value = 1
    dev.timeline_signal.wait(target, timeout=5000)
    dev.synchronize()  # a timeout is not a device failure: the device goes on


def test_queue_stats(dev):
    stats = dev.queue_stats()
    assert "compute0" in stats and "copy0" in stats
    assert all(isinstance(w, int) and isinstance(r, int) and r <= w for w, r in stats.values())
    before = stats["compute0"][0]
    prg = dev.compile("HCQ_KERNEL void nop(int *o) { o[0] = 1; }", "nop")
    buf = dev.allocator.alloc(8, SPEC)
    try:
        prg(buf, wait=True)
        deadline = time.monotonic() + 5
        while True:  # the ring's read pointer catches up right after the last packet ran
            w, r = dev.queue_stats()["compute0"]
            if r == w or time.monotonic() > deadline: break
            time.sleep(0.001)
        assert w > before and r == w
    finally:
        dev.allocator.free(buf, 8, SPEC)


def test_queue_stats_copy_ring_moves(dev):
    before = dev.queue_stats()["copy0"][0]
    n = HOST_COPY_MAX + 4096  # (a smaller copy is the host's memmove)
    buf = dev.allocator.alloc(n, SPEC)
    try:
        dev.allocator.copyin(buf, memoryview(bytes(n)))
        dev.synchronize()
        assert dev.queue_stats()["copy0"][0] > before
    finally:
        dev.allocator.free(buf, n, SPEC)


def native_thread_count() -> int:
    return len(os.listdir("/proc/self/task"))


THREAD_ID_SRC = """
static _Thread_local int hcq_test_tl;
HCQ_KERNEL void who(uint64_t *o, int iters) {
  volatile double x = 1.5;
  for (int i = 0; i < iters; i++) x = x * 0.999 + 0.001;
  o[hcq_group_id(0)] = (uint64_t)(uintptr_t)&hcq_test_tl;  /* one address per thread */
}
"""


def threads_used(d, nblocks=512, iters=20000) -> int:
    prg = d.compile(THREAD_ID_SRC, "who")
    buf = d.allocator.alloc(nblocks * 8, SPEC)
    try:
        for _ in range(2): prg(buf, global_size=(nblocks, 1, 1), local_size=(1, 1, 1), vals=(iters,), wait=True)
        ids = np.frombuffer(buf.cpu_view().mv, np.uint64)
        assert np.all(ids != 0)
        return len(set(ids.tolist()))
    finally:
        d.allocator.free(buf, nblocks * 8, SPEC)


def test_worker_count_env(dev, open_device, monkeypatch):
    default_threads = threads_used(dev)
    assert 1 <= default_threads <= dev.num_workers
    if not os.environ.get("HCQ_CPU_WORKERS"): assert dev.num_workers == len(os.sched_getaffinity(0))  # default: one per core
    monkeypatch.setenv("HCQ_CPU_WORKERS", "1")
    t0 = native_thread_count()
    one = open_device()
    d_one = native_thread_count() - t0
    monkeypatch.setenv("HCQ_CPU_WORKERS", "3")
    t0 = native_thread_count()
    three = open_device()
    d_three = native_thread_count() - t0
    monkeypatch.delenv("HCQ_CPU_WORKERS")
    assert one.num_workers == 1 and three.num_workers == 3
    assert hcq.Device(three.device) is three and three.num_workers == 3  # cached, env no longer consulted
    assert d_one == d_three == 1, (d_one, d_three)  # threads start with use: only the compute queue's so far
    assert threads_used(one) == 1
    assert 1 <= threads_used(three) <= 3
    assert three.threads() == {"queues": 1, "workers": 2, "workers_wanted": 2}  # the pool started with the first big grid
    assert one.threads() == {"queues": 1, "workers": 0, "workers_wanted": 0}


PAIR_SRC = """
#include <time.h>
static long since(const struct timespec *t0) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (t.tv_sec - t0->tv_sec) * 1000000000L + (t.tv_nsec - t0->tv_nsec);
}
/* Two blocks: each says it started, waits (up to WAIT_NS) for the other, and lasts at least MIN_NS from its start.
   They meet (met[g] counts it) only when they run at the same time. */
HCQ_KERNEL void pair(int *started, int *met) {
  long g = hcq_group_id(0);
  struct timespec t0;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  __atomic_store_n(&started[g], 1, __ATOMIC_SEQ_CST);
  while (!__atomic_load_n(&started[1 - g], __ATOMIC_SEQ_CST) && since(&t0) < WAIT_NSL) {}
  met[g] += __atomic_load_n(&started[1 - g], __ATOMIC_SEQ_CST);
  while (since(&t0) < MIN_NSL) {}
}
"""


def pair_source(wait_ns: int, min_ns: int) -> str:
    return PAIR_SRC.replace("WAIT_NS", str(wait_ns)).replace("MIN_NS", str(min_ns))


def device_with_two_workers(open_device, monkeypatch):
    monkeypatch.setenv("HCQ_CPU_WORKERS", "2")
    d = open_device()
    monkeypatch.delenv("HCQ_CPU_WORKERS")
    return d


def test_a_grid_of_two_long_blocks_runs_them_at_once(open_device, monkeypatch):
    """A grid of a few long blocks is split over the pool from its first run: the queue thread used to wake the pool
    only between blocks, so an unknown kernel's two blocks ran one after the other on one thread (tinygrad's core_id
    kernels: the attention of a GPT forward took twice its time). Checked by the blocks meeting, not by a clock. Each
    block lasts 2 ms, so the pool's history never finds the kernel tiny."""
    d = device_with_two_workers(open_device, monkeypatch)
    started, met = d.allocator.alloc(8, SPEC), d.allocator.alloc(8, SPEC)
    try:
        for run in range(3):  # the first run (nothing known of the kernel) and later ones (known to be long)
            prg = d.compile(pair_source((10 + run) * 10**9, 2 * 10**6), "pair") if run < 2 else prg  # (two kernels of their own)
            for b in (started, met): d.allocator.copyin(b, memoryview(bytes(8)))
            prg(started, met, global_size=(2, 1, 1), wait=True)
            assert np.frombuffer(met.cpu_view().mv, np.int32).tolist() == [1, 1], f"run {run}: the blocks ran one after the other"
    finally:
        for b in (started, met): d.allocator.free(b, 8, SPEC)


@pytest.mark.skipif("HCQ_CPU_WAKE_AFTER_US" in os.environ, reason="the pool's threshold is the default's here")
def test_the_pool_keeps_what_it_learnt_of_each_kernel_apart(open_device, monkeypatch):
    """Grids of blocks measured tiny run inline on the queue thread. What was measured is kept per kernel entry: each
    kernel is a library of its own, loaded page-aligned, so keying by the entry's low address bits made every kernel
    share one slot, and two kernels run in turn never ran inline (the pool woken for every grid)."""
    d = device_with_two_workers(open_device, monkeypatch)
    src = "HCQ_KERNEL void tiny(int *o) { if (hcq_global_id(0) == 0) o[0] += STEP; }"
    a, b = (d.compile(src.replace("STEP", step), "tiny") for step in ("1", "2"))
    buf = d.allocator.alloc(4, SPEC)
    try:
        for prg in (a, b): prg(buf, global_size=(8, 1, 1), wait=True)  # (each measured once)
        before = d.executor.pool_counts()
        for _ in range(20):
            for prg in (a, b): prg(buf, global_size=(8, 1, 1), wait=True)
        after = d.executor.pool_counts()
        inline = after["inline"] - before["inline"]
        assert inline >= 30, f"{inline} of 40 grids of tiny blocks ran inline ({after})"  # (a run preempted mid-grid may measure long)
        assert int(np.frombuffer(buf.cpu_view().mv, np.int32)[0]) == 21 * 3
    finally:
        d.allocator.free(buf, 4, SPEC)


SPLIT_EVERY_TIME = """
import json, sys, hcq, numpy as np
d = hcq.Device("CPU")
prg = d.compile(sys.argv[1], "pair")
started, met = (d.allocator.alloc(8, hcq.BufferSpec(cpu_access=True)) for _ in range(2))
d.allocator.copyin(met, memoryview(bytes(8)))
before = d.executor.pool_counts()
for _ in range(6):
    d.allocator.copyin(started, memoryview(bytes(8)))
    prg(started, met, global_size=(2, 1, 1), wait=True)
after = d.executor.pool_counts()
print(json.dumps({"inline": after["inline"] - before["inline"], "woken": after["woken"] - before["woken"],
                  "met": np.frombuffer(met.cpu_view().mv, np.int32).tolist()}))
"""


def test_a_grid_long_alone_but_short_when_split_is_split_every_time():
    """Two blocks of 4 ms that run at the same time, with grids under 6 ms inline: 8 ms on one thread, 4 ms split.
    The history records what one block took (the queue thread's own blocks), so every run is split and the blocks
    meet each time; with the grid's wall time over its blocks, a split run looked like 2 ms a block, so the next
    ran inline (its blocks one after the other), and so on every other run."""
    env = {**os.environ, "HCQ_CPU_WORKERS": "2", "HCQ_CPU_WAKE_AFTER_US": "6000"}  # (read when the engine loads: a process of its own)
    out = subprocess.run([sys.executable, "-c", SPLIT_EVERY_TIME, pair_source(200 * 10**6, 4 * 10**6)], env=env, capture_output=True,
                         text=True, timeout=120, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {"inline": 0, "woken": 6, "met": [6, 6]}, got


@pytest.mark.parametrize("value,match", [("0", r"in \[1, 4096\]"), ("-2", r"in \[1, 4096\]"), ("5000", r"in \[1, 4096\]"), ("two", "HCQ_CPU_WORKERS")])
def test_bad_worker_count_env(open_device, monkeypatch, value, match):
    opened = hcq.opened_devices()
    monkeypatch.setenv("HCQ_CPU_WORKERS", value)
    with pytest.raises(ValueError, match=match):
        open_device()
    assert hcq.opened_devices() == opened


def test_a_device_that_fails_to_open_leaves_nothing_behind(dev, monkeypatch):
    """Opening fails after the rings started (its kernargs cannot be allocated): the half-opened device is not in
    its peer group, and its command-processor threads are gone."""
    from hcq.backends.cpu.device import CPUAllocator, CPUDevice
    assert dev.peer_group == "CPU"  # the peer group exists, its signal pool too
    real = CPUAllocator._alloc

    def no_kernargs(self, size, options):
        if size == 16 << 20: raise MemoryError("no room for the kernargs ring")
        return real(self, size, options)

    monkeypatch.setattr(CPUAllocator, "_alloc", no_kernargs)
    threads = len(os.listdir("/proc/self/task"))
    with pytest.raises(MemoryError, match="kernargs"):
        CPUDevice("CPU:77")
    assert "CPU:77" not in [d.device for d in hcq.HCQCompiled.peer_groups["CPU"]]
    deadline = time.monotonic() + 5
    while len(os.listdir("/proc/self/task")) > threads and time.monotonic() < deadline: time.sleep(0.01)
    assert len(os.listdir("/proc/self/task")) <= threads


def test_backends_plug_in_through_entry_points(open_device, monkeypatch):
    """An out-of-tree backend is found through the entry-point group `hcq.backends` (what `pip install` of its
    package registers): its kind is listed and its devices open. (The toy backend of the tests stands in.)"""
    from importlib.metadata import EntryPoint

    from hcq import registry
    monkeypatch.syspath_prepend(os.path.dirname(os.path.abspath(__file__)))  # the toy module the toy's own tests use
    ep = EntryPoint(name="PLUGGED", value="toy_backend:ToyDevice", group=registry.ENTRY_POINT_GROUP)
    monkeypatch.setattr(registry, "entry_points", lambda group: [ep] if group == registry.ENTRY_POINT_GROUP else [])
    assert "PLUGGED" in hcq.available_backends() and "CPU" in hcq.available_backends()
    dev = open_device("plugged:1")  # (the name, as given: any case)
    assert type(dev).__name__ == "ToyDevice" and dev.device == "PLUGGED:1"
    sig = dev.new_signal(value=0)
    dev.hw_compute_queue_t().signal(sig, 7).submit(dev)
    sig.wait(7, timeout=5000)


def test_installed_package_registers_the_cpu_backend_as_an_entry_point(dev):
    from importlib.metadata import PackageNotFoundError, distribution
    try:
        eps = distribution("hcq").entry_points
    except PackageNotFoundError:
        pytest.skip("hcq runs from the source tree without being installed")
    cpu = [ep for ep in eps if ep.group == "hcq.backends" and ep.name == "CPU"]
    assert cpu and cpu[0].load() is type(dev)
