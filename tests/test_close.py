"""Closing devices: dev.close() and `with`, what a closed device refuses, reopening by name, work in flight (waited for,
or failed and dropped past the timeout), a kernel that does not return, peers of a closed device, fork and exit."""
import gc
import os
import subprocess
import sys
import threading
import time
import weakref

import numpy as np
import pytest

import hcq
from hcq import BufferSpec, DeviceError, HCQError, HCQTimeoutError
from helpers import alloc, arr

SPIN = """HCQ_KERNEL void spin(int *flag, int *out) {
  while (!__atomic_load_n(flag, __ATOMIC_ACQUIRE)) {}
  out[0] = 7;
}"""
FILL = "HCQ_KERNEL void fill(int *o, int v) { o[hcq_global_id(0)] = v; }"


def native_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def test_close_stops_the_threads_and_refuses_further_use(open_device):
    before = native_threads()
    d = open_device()
    prg = d.compile(FILL, "fill")
    buf = alloc(d, 64 * 4)
    prg(buf, global_size=64, local_size=1, vals=(3,))
    d.synchronize()
    assert native_threads() > before
    d.close()
    assert d.closed and native_threads() == before
    for use in (lambda: d.allocator.alloc(64), lambda: d.synchronize(), lambda: prg(buf, global_size=64, local_size=1, vals=(1,)),
                lambda: d.compile(FILL, "fill"), lambda: d.allocator.copyin(buf, memoryview(bytearray(16))),
                lambda: d.allocator.copyout(memoryview(bytearray(16)), buf), lambda: d.new_signal(value=0).wait(1, timeout=10)):
        with pytest.raises(HCQError, match="was closed"):
            use()
    d.allocator.free(buf, 64 * 4, BufferSpec(cpu_access=True))  # (freeing what it handed out is fine)
    d.close()  # (closing again does nothing)


def test_a_closed_device_opens_anew_by_name(open_device):
    d = open_device()
    name = d.device
    d.close()
    again = open_device(name)
    assert again is not d and not again.closed and again.device == name
    assert hcq.Device(name) is again and d not in hcq.opened_devices() and again in hcq.opened_devices()
    prg, buf = again.compile(FILL, "fill"), alloc(again, 16 * 4)
    prg(buf, global_size=16, local_size=1, vals=(5,))
    again.synchronize()
    assert list(arr(buf, np.int32)) == [5] * 16


def test_with_closes_the_device_at_the_end_of_the_block(open_device):
    name = open_device().device
    hcq.Device(name).close()
    with hcq.Device(name) as d:
        buf = alloc(d, 16)
        d.allocator.copyin(buf, memoryview(b"x" * 16))
    assert d.closed
    with pytest.raises(RuntimeError), hcq.Device(name) as d2:
        raise RuntimeError("the block's own error")
    assert d2.closed


def test_close_waits_for_work_in_flight(open_device):
    d = open_device()
    gate = d.new_signal(value=0)
    out = alloc(d, 8)
    q = d.hw_compute_queue_t().wait(gate, 1)
    prg = d.compile(FILL, "fill")
    q.submit(d)
    prg(out, global_size=2, local_size=1, vals=(42,))  # runs after the gate opens
    opener = threading.Timer(0.05, gate.store, args=(1,))
    opener.start()
    d.close()  # (the work is the device's to finish: it reads `out`, so close returns once it did)
    opener.join()
    assert list(arr(out, np.int32)) == [42, 42]


def test_close_past_its_timeout_fails_the_work_and_releases_its_waiters(open_device):
    d, peer = open_device(), open_device()
    never = d.new_signal(value=0)
    done = d.new_signal(value=0)
    d.hw_compute_queue_t().wait(never, 1).signal(done, 1).submit(d)
    peer.hw_compute_queue_t().wait(done, 1).signal(peer.timeline_signal, peer.timeline_value).submit(peer)
    peer.next_timeline()
    with pytest.raises(HCQTimeoutError, match=r"(?s)closed with work that did not finish.*WAIT"):
        d.close(timeout=50)
    assert d.closed
    with pytest.raises(DeviceError, match=d.device):  # the peer's wait was released, saying by whom
        peer.synchronize(timeout=5000)
    peer.recover()
    peer.synchronize()


def test_a_failed_device_closes_without_raising(open_device, no_validation):
    d = open_device()
    prg = d.compile("HCQ_KERNEL void crash(int *p) { *(volatile int *)0 = 1; }", "crash")
    prg(alloc(d, 8), global_size=1, local_size=1)
    with pytest.raises(DeviceError):
        d.synchronize()
    d.close()
    assert d.closed


@pytest.mark.full
def test_a_kernel_that_does_not_return_keeps_its_memory(open_device):
    d = open_device()
    flag, out = alloc(d, 8), alloc(d, 8)
    d.compile(SPIN, "spin")(flag, out, global_size=1, local_size=1)
    with pytest.raises(HCQTimeoutError, match="a kernel still runs"):
        d.close(timeout=50)
    assert d.closed
    arr(flag, np.int32)[0] = 1  # the memory is still mapped: the kernel sees the flag and returns
    for _ in range(2000):
        if arr(out, np.int32)[0] == 7: break
        threading.Event().wait(0.005)
    assert arr(out, np.int32)[0] == 7


def test_closing_one_device_leaves_its_peers_working(open_device):
    a = open_device()
    b = open_device()
    sigs_b = [b.new_signal(value=0) for _ in range(300)]  # some from pages `a` or `b` allocated
    a.close()
    prg, buf = b.compile(FILL, "fill"), alloc(b, 8 * 4)
    prg(buf, global_size=8, local_size=1, vals=(9,))
    b.synchronize()
    for s in sigs_b[::50]:
        s.store(3)
        assert s.value == 3
    assert list(arr(buf, np.int32)) == [9] * 8


def test_closing_from_two_threads_closes_once(open_device):
    d = open_device()
    errors = []

    def close():
        try:
            d.close()
        except Exception as e:  # noqa: BLE001
            errors.append(e)
    ts = [threading.Thread(target=close) for _ in range(4)]
    for t in ts: t.start()
    for t in ts: t.join()
    assert not errors and d.closed


def test_opening_and_closing_does_not_leak_threads_or_mappings(open_device):
    open_device()  # (a peer that stays open: nothing of the peer group may keep the closed ones alive)
    name = open_device().device
    hcq.Device(name).close()

    def counts():
        gc.collect()
        with open("/proc/self/maps") as f: return native_threads(), sum(1 for _ in f)
    for _ in range(5):
        with hcq.Device(name) as d: alloc(d, 1 << 20)
    before = counts()
    for _ in range(100):
        with hcq.Device(name) as d:
            d.compile(FILL, "fill")(alloc(d, 64), global_size=16, local_size=1, vals=(1,))
    threads, maps = counts()
    assert threads == before[0] and maps <= before[1] + 8
    ref = weakref.ref(d)
    del d
    gc.collect()
    assert ref() is None


def test_ctrl_c_while_close_waits_leaves_the_device_open(open_device):
    d = open_device()
    gate = d.new_signal(value=0)
    d.hw_compute_queue_t().wait(gate, 1).signal(d.timeline_signal, d.timeline_value).submit(d)
    d.next_timeline()
    import _thread
    threading.Timer(0.05, _thread.interrupt_main).start()
    with pytest.raises(KeyboardInterrupt):
        d.close(timeout=20_000)
    assert not d.closed
    gate.store(1)
    d.synchronize()
    d.close()


def test_ctrl_c_while_waiting_for_another_threads_close_raises_and_that_close_goes_on(open_device):
    d = open_device()
    gate = d.new_signal(value=0)
    d.hw_compute_queue_t().wait(gate, 1).signal(d.timeline_signal, d.timeline_value).submit(d)
    d.next_timeline()
    closer = threading.Thread(target=d.close, kwargs={"timeout": 20_000})
    closer.start()
    deadline = time.monotonic() + 10
    while not d._closing and time.monotonic() < deadline: time.sleep(0.001)
    assert d._closing
    import _thread
    threading.Timer(0.05, _thread.interrupt_main).start()
    with pytest.raises(KeyboardInterrupt):
        d.close(timeout=20_000)  # waits for the other thread's close, until the Ctrl-C
    assert closer.is_alive() and d._closing
    gate.store(1)
    closer.join(20)
    assert not closer.is_alive() and d.closed
    d.close()


CHILD = """
import os, sys, hcq
d = hcq.Device("CPU:0")
d.close()
if os.fork() == 0:
    with hcq.Device("CPU:0") as c:
        c.synchronize()
    os._exit(0)
_, status = os.wait()
again = hcq.Device("CPU:0")
again.synchronize()
print("ok", status)
"""


def test_fork_and_exit_after_close():
    r = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.split() == ["ok", "0"], r.stdout + r.stderr


def test_a_vulkan_device_closes_and_opens_anew(open_device):
    if "VK" not in hcq.available_backends(): pytest.skip(f"no Vulkan here: {hcq.registry.unavailable_backends().get('VK')}")
    before = native_threads()
    d = open_device("VK")
    name = d.device
    for round_ in range(3):
        buf = d.allocator.alloc(256)
        d.allocator.copyin(buf, memoryview(bytes([round_]) * 256))
        out = bytearray(256)
        d.allocator.copyout(memoryview(out), buf)
        assert out == bytes([round_]) * 256
        d.close()
        with pytest.raises(HCQError, match="was closed"):
            d.allocator.alloc(16)
        del buf, d
        gc.collect()  # (the VkDevice goes with the device and the last of its memory: the driver's threads with it)
        assert native_threads() == before
        d = open_device(name)


def test_closing_while_another_thread_launches_refuses_its_new_work_and_finishes(open_device):
    """The other thread (which serialises its own calls, as one device's launches must be) gets HCQError saying the
    device was closed; the work it had submitted runs, and the close finishes without a timeout."""
    name = open_device().device
    hcq.Device(name).close()
    for _ in range(30):
        d = hcq.Device(name)
        prg, buf = d.compile(FILL, "fill"), alloc(d, 256)
        errors: list[Exception] = []
        started = threading.Event()

        def launch_until_refused():
            try:
                while True:
                    prg(buf, global_size=4, local_size=1, vals=(1,))
                    d.allocator.copyin(buf, memoryview(bytearray(16)))
                    started.set()
            except HCQError as e:
                errors.append(e)
        t = threading.Thread(target=launch_until_refused)
        t.start()
        started.wait(10)
        d.close(timeout=10_000)
        t.join()
        assert len(errors) == 1 and "was closed" in str(errors[0]), errors


def test_a_submission_that_meets_a_ring_stopped_by_close_says_the_device_was_closed(open_device):
    """A launch of another thread can pass the open check just before close() begins and reach the ring once close
    stopped it: what it raises says the device was closed (not only that a ring was stopped)."""
    from array import array
    from hcq import packet_queue
    d = open_device()
    ring = d.ring("compute")
    d.close()
    words = array("Q", [0])
    with pytest.raises(HCQError, match=r"was closed \(dev.close\(\)\).*its compute queue was stopped; nothing was queued"):
        packet_queue.publish_slow(d, ring, words.buffer_info()[0], 1, packet_queue.SubmitStatus.STOPPED)


def test_signals_of_a_closed_devices_pages_pass_validation_on_its_peers(open_device, validating):
    """The group's signal pages outlive the device that allocated them: an open peer takes them over, so validation
    still finds its signals in a live allocation."""
    from hcq.device import HCQCompiled
    a = open_device()
    b = open_device()
    owned = [p for p in HCQCompiled.signal_pages[a.peer_group] if p.owner is a]
    if not owned: pytest.skip("the group's signal pages were allocated before this test's devices")
    a.close()
    sig = b.new_signal(value=0)
    b.hw_compute_queue_t().signal(sig, 5).timestamp(sig).submit(b)
    sig.wait(5)
    assert all(p.owner is b for p in owned)
