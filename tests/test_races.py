"""Races between threads that the thread-safety statement (docs/design.md, "Threads calling hcq") allows.

`test_free_waits_for_a_gated_copy_while_threads_submit` is the pattern that corrupted data: two threads submit
signal-only queues to copy engine 0 (re-submitted natively, without a Python step) while the main thread, the only
allocator user, frees a buffer a gated copy still reads and allocates another of the same size. A free looks at the
busy devices of the peer group; a look that found a device idle took it off that list while another thread had
already decided not to list it again for a submission not counted yet, so later frees waited for nothing. The
bounded version runs a few seconds (it failed in 3 of 3 runs before the fix); the slow one
(HCQ_SLOW=1, `HCQ_RACE_SECONDS`, default 300) runs for minutes.
"""
import os
import sys
import threading
import time

import pytest

from hcq import BufferSpec, lifetimes

NOLRU = BufferSpec(nolru=True)
TIMEOUT = 10000  # ms without progress; only reached when something is broken
N = 4096


def _gated_copy_while_threads_submit(dev, seconds: float) -> int:
    """The pattern of the module docstring for `seconds`; returns the iterations run, raises on corrupt data."""
    stop, errors = threading.Event(), []

    def submitter() -> None:
        try:
            sig = dev.new_signal(value=0)
            q = dev.hw_copy_queue_t(0).signal(sig, 1)
            while not stop.is_set(): q.submit(dev)
        except BaseException as e:  # noqa: BLE001 (reported by the main thread)
            errors.append(e)

    dst = dev.allocator.alloc(N, NOLRU)
    threads = [threading.Thread(target=submitter, daemon=True) for _ in range(2)]
    was = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    for t in threads: t.start()
    iterations, deadline = 0, time.monotonic() + seconds
    try:
        while time.monotonic() < deadline and not errors:
            iterations += 1
            x = dev.allocator.alloc(N, NOLRU)
            x.cpu_view().view(0, N, "B")[:] = bytes([iterations & 0x7F]) * N
            gate, done = dev.new_signal(value=0), dev.new_signal(value=0)
            dev.hw_copy_queue_t(0).wait(gate, 1).copy(dst, x, N).signal(done, 1).submit(dev)
            dev.allocator.free(x, N, NOLRU)  # released only once the gated copy ran
            y = dev.allocator.alloc(N, NOLRU)
            y.cpu_view().view(0, N, "B")[:] = b"\xee" * N
            gate.value = 1
            done.wait(1, timeout=TIMEOUT)
            got = bytes(dst.cpu_view().view(0, N, "B").mv)
            assert got == bytes([iterations & 0x7F]) * N, \
                f"iteration {iterations}: the copy read memory freed before it ran (first byte 0x{got[0]:02x})"
            dev.allocator.free(y, N, NOLRU)
            for _ in range(4):  # frees while the device is idle: each looks whether it may leave the busy set
                scratch = dev.allocator.alloc(64, NOLRU)
                dev.allocator.free(scratch, 64, NOLRU)
    finally:
        stop.set()
        for t in threads: t.join(timeout=30)
        sys.setswitchinterval(was)
    if errors: raise errors[0]
    dev.synchronize(timeout=TIMEOUT)
    dev.allocator.free(dst, N, NOLRU)
    return iterations


@pytest.mark.full
def test_free_waits_for_a_gated_copy_while_threads_submit(dev):
    iterations = _gated_copy_while_threads_submit(dev, 4.0)
    assert iterations > 100


@pytest.mark.slow
def test_free_waits_for_a_gated_copy_while_threads_submit_soak(dev):
    seconds = float(os.environ.get("HCQ_RACE_SECONDS", "300"))
    iterations = _gated_copy_while_threads_submit(dev, seconds)
    print(f"\n{iterations} iterations in {seconds:.0f} s, no corruption")


@pytest.mark.parametrize("during_look", [1, 2])
def test_a_submission_counted_during_an_idle_look_keeps_its_device_listed(dev, monkeypatch, during_look):
    """The busy-set protocol interleaved by hand: a look that finds the device idle removes it, looks again and puts
    it back if busy; a submitter adds the device once its submission is counted. A gated submission made during the
    first or the second look must leave the device listed, so a later free waits for it."""
    dev.synchronize(timeout=TIMEOUT)
    gate = dev.new_signal(value=0)
    real, looks = lifetimes._unreached, []

    def unreached(d):
        marks = real(d)
        looks.append(d)
        if len(looks) == during_look: dev.hw_compute_queue_t().wait(gate, 1).submit(dev)  # another thread, in effect
        return marks

    monkeypatch.setattr(lifetimes, "_unreached", unreached)
    lifetimes.outstanding(dev)
    monkeypatch.setattr(lifetimes, "_unreached", real)
    assert len(looks) == 2 and dev in lifetimes.busy_devices(dev.peer_group), "a device with gated work left the busy set"
    buf = dev.allocator.alloc(64, NOLRU)
    dev.allocator.free(buf, 64, NOLRU)
    assert len(dev.allocator._releases) == 1  # the release waits for the gated work
    gate.value = 1
    ring = dev.ring("compute")
    ring.fence.wait(ring.count, timeout=TIMEOUT)
    dev.allocator._poll_releases()
    assert not dev.allocator._releases
