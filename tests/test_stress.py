"""Stress runs of the command processor's hard parts: doorbells, cross-queue signalling, concurrent
submitters, the worker pool's job hand-off. Bounded by default; HCQ_SLOW=1 runs the long versions."""
import os
import threading
import time

import numpy as np
import pytest

import hcq
from hcq import arrays

SCALE = 500 if os.environ.get("HCQ_SLOW") == "1" else 1  # slow: a million alternating submits

FILL = """
HCQ_KERNEL void fill(int *out, int base, int n) {
  long i = hcq_global_id(0);
  if (i < n) out[i] = base + (int)i;
}
"""


def test_alternating_submit_and_wait_never_loses_a_doorbell(dev):
    # Alternate submits with host waits, with pauses that let the queue thread fall asleep in between.
    sig = dev.new_signal(value=0)
    for i in range(1, 2000 * SCALE + 1):
        dev.hw_compute_queue_t().signal(sig, i).submit(dev)
        sig.wait(i, timeout=5000)
        if i % 250 == 0: time.sleep(0.002)  # longer than every spin budget: the next submit must wake a sleeper
    assert sig.value == 2000 * SCALE


def test_cross_device_ping_pong(dev, dev1):
    a, b = dev.new_signal(value=0), dev.new_signal(value=0)
    rounds = 300 * SCALE
    for i in range(1, rounds + 1):  # queue both sides ahead; they can only progress in lock-step
        dev.hw_compute_queue_t().wait(a, i - 1).signal(b, i).submit(dev)
        dev1.hw_copy_queue_t().wait(b, i).signal(a, i).submit(dev1)
    a.wait(rounds, timeout=10000)
    assert (a.value, b.value) == (rounds, rounds)


def test_two_host_threads_submit_to_one_ring(dev):
    sigs = [dev.new_signal(value=0) for _ in range(2)]
    n = 2000 * SCALE
    errors = []

    def run(sig):
        try:
            for i in range(1, n + 1):
                # a wait on itself keeps each thread's packets in order across the shared ring
                dev.hw_compute_queue_t().wait(sig, i - 1).signal(sig, i).submit(dev)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=run, args=(s,)) for s in sigs]
    for t in threads: t.start()
    for t in threads: t.join()
    assert not errors
    for s in sigs: s.wait(n, timeout=10000)
    assert [s.value for s in sigs] == [n, n]


def test_worker_pool_handoff_many_grid_sizes(dev):
    prg = dev.compile(FILL, "fill")
    n = 1 << 16
    out = dev.allocator.alloc(n * 4)
    view = arrays.view(out, np.int32, n)
    rng = np.random.default_rng(0)
    for it in range(200 * SCALE):
        blocks = int(rng.choice([1, 2, 3, 7, 64, 255]))
        local = int(rng.choice([1, 16, 256]))
        count = min(n, blocks * local)
        prg(out, global_size=(blocks, 1, 1), local_size=(local, 1, 1), vals=(it * 7, count))
        if it % 10 == 0 or it == 200 * SCALE - 1:
            dev.synchronize()
            assert np.array_equal(view[:count], it * 7 + np.arange(count, dtype=np.int32)), f"iteration {it}"


def test_long_grid_uses_pool_and_is_correct(dev):
    # A grid long enough that the queue thread wakes the pool mid-run, repeated so the history path is taken too.
    prg = dev.compile("""
    HCQ_KERNEL void work(float *out, int iters) {
      long g = hcq_group_id(0);
      float acc = 0.0f;
      for (int k = 0; k < iters; k++) acc += (float)((g + k) % 7);
      out[g] = acc;
    }""", "work")
    blocks, iters = 512, 20000
    out = dev.allocator.alloc(blocks * 4)
    expect = np.array([sum(float((g + k) % 7) for k in range(0, 7)) * (iters // 7) +
                       sum(float((g + k) % 7) for k in range(iters - iters % 7, iters)) for g in range(blocks)], dtype=np.float32)
    for _ in range(3):
        arrays.view(out, np.float32)[:] = 0
        prg(out, global_size=(blocks, 1, 1), vals=(iters,), wait=True)
        np.testing.assert_allclose(arrays.view(out, np.float32, blocks), expect, rtol=1e-6)


def test_an_exec_on_a_copy_queue_fails_the_device(open_device):
    """Only the compute queue's thread may hand grids to the device's one worker pool (a second dispatcher would race in
    its job fields): an EXEC that reaches a copy ring in raw words (a served client can send any) fails the device,
    and the kernel does not run."""
    d = open_device()
    from array import array
    from hcq.packet_queue import publish
    from hcq.packets import Op, header
    prg = d.compile("HCQ_KERNEL void mark(int *o) { o[hcq_global_id(0)] = 7; }", "mark")
    out = d.allocator.alloc(16, hcq.BufferSpec(cpu_access=True))
    out.cpu_view()[:] = bytes(16)
    state = prg.fill_kernargs((out,), ())
    publish(d, d.ring("copy", 0), array("Q", [header(Op.EXEC), prg.entry, state.buf.va_addr, 4, 1, 1, 1, 1, 1]))
    with pytest.raises(hcq.DeviceError, match="EXEC on copy queue 0: kernels run on the compute queue"):
        d.hw_copy_queue_t().signal(d.timeline_signal, d.next_timeline()).submit(d)
        d.synchronize(timeout=5000)
    assert bytes(out.cpu_view()) == bytes(16)


def test_device_error_is_sticky_and_reported(open_device):
    d = open_device()
    from array import array
    from hcq.packet_queue import publish
    publish(d, d.ring("compute"), array("Q", [0x2A | (1 << 8)]))  # unknown opcode 42, one word
    with pytest.raises(hcq.DeviceError, match="unknown packet opcode 42"):
        d.hw_compute_queue_t().signal(d.timeline_signal, d.next_timeline()).submit(d)
        d.synchronize(timeout=2000)
    with pytest.raises(hcq.DeviceError, match=f"{d.device} failed"):
        d.synchronize()
    assert isinstance(d.error_state, hcq.DeviceError)
