"""Signals (value, timestamp, load/store, waits and their timeouts), the device timeline (values, synchronize,
wrap-around), and what a stuck device reports (timeout messages, hang reports, queue states)."""
import re
import time
from decimal import Decimal

import pytest

import hcq
from hcq.conformance.plugin import (WAIT_MS, idle_queue_states, launch, new_buffer, poke, read_u32, require_poke, require_session,
                                    skip_unless, still_blocked, upload)

require_session()
pytestmark = pytest.mark.usefixtures("clean_device")
STATE_KEYS = {"device", "queue", "rptr", "wptr", "packets_done", "current"}


# ------------------------------------------------------------------ signals
def test_signal_value(dev):
    s = dev.new_signal(value=3)
    assert s.value == 3
    s.value = 2**64 - 1
    assert s.value == 2**64 - 1
    for bad in (-1, 2**64):
        with pytest.raises(ValueError):
            s.value = bad
    assert s.value == 2**64 - 1
    assert dev.new_signal().value == 0
    assert isinstance(s.timestamp, Decimal)


def test_signal_load_and_store(dev):
    s, done = dev.new_signal(value=1), dev.new_signal(value=0)
    assert s.load() == 1
    s.store(5)
    assert s.load() == 5 and s.value == 5
    s.value = 9
    assert s.load() == 9
    with pytest.raises(ValueError):
        s.store(-1)
    dev.hw_compute_queue_t().wait(s, 11).signal(done, 1).submit(dev)
    assert still_blocked(done, 1)
    s.store(11)  # wakes the queue waiting on it
    done.wait(1, timeout=WAIT_MS)
    assert done.load() == 1


def test_signal_load_timestamp(dev, queue_spec):
    skip_unless("timestamps")
    s, done = dev.new_signal(), dev.new_signal()
    assert s.load_timestamp() == 0
    queue_spec.make(dev).timestamp(s).signal(done, 1).submit(dev)
    done.wait(1, timeout=WAIT_MS)
    raw = s.load_timestamp()
    assert raw > 0
    assert s.timestamp == Decimal(raw) / Decimal(s.timestamp_divider)


def test_device_signals_are_seen_by_host_waits(dev, queue_spec, gates):
    gate, s = gates.new(), dev.new_signal(value=0)
    q = queue_spec.make(dev).wait(gate, 1)
    for v in (1, 2, 3, 2**40): q.signal(s, v)
    q.submit(dev)
    assert still_blocked(s, 1)
    gate.value = 1
    s.wait(2**40, timeout=WAIT_MS)
    assert s.value == 2**40


def test_wait_returns_at_once_when_reached(dev):
    s = dev.new_signal(value=10)
    t0 = time.monotonic()
    s.wait(10, timeout=0)
    s.wait(3, timeout=0)
    assert time.monotonic() - t0 < 1


def test_wait_timeout_names_the_signal_and_values(dev):
    s = dev.new_signal(value=98761)
    t0 = time.monotonic()
    with pytest.raises(hcq.HCQTimeoutError) as ei:
        s.wait(123457, timeout=200)
    elapsed = time.monotonic() - t0
    msg = str(ei.value)
    assert f"{s.value_addr:x}" in msg, f"the message does not name the signal: {msg}"
    assert re.search(r"\b123457\b", msg) and re.search(r"\b98761\b", msg), f"the message lacks the values: {msg}"
    assert 0.15 <= elapsed < 10


# ------------------------------------------------------------------ timeline
def test_timeline_values_advance(dev, kernels):
    dev.synchronize()
    tv = dev.timeline_value
    assert dev.timeline_signal.value == tv - 1
    assert dev.next_timeline() == tv and dev.timeline_value == tv + 1
    dev.hw_compute_queue_t().wait(dev.timeline_signal, tv - 1).signal(dev.timeline_signal, tv).submit(dev)
    dev.synchronize(timeout=WAIT_MS)
    assert dev.timeline_signal.value == tv
    out = new_buffer(dev, 64 * 4)
    before = dev.timeline_value
    launch(kernels["fill"], (out,), (77, 64), 64)
    assert dev.timeline_value > before
    dev.synchronize(timeout=WAIT_MS)
    assert dev.timeline_signal.value == dev.timeline_value - 1
    assert read_u32(dev, out) == [77] * 64


def test_synchronize_waits_for_all_submitted_work(dev, gates):
    gate, buf = gates.new(), new_buffer(dev, 4)
    tv = dev.next_timeline()
    dev.hw_compute_queue_t().wait(gate, 1).write(buf, 5).signal(dev.timeline_signal, tv).submit(dev)
    with pytest.raises(hcq.HCQTimeoutError):
        dev.timeline_signal.wait(tv, timeout=100)
    gate.value = 1
    dev.synchronize(timeout=WAIT_MS)
    assert dev.timeline_signal.value == tv
    assert read_u32(dev, buf) == [5]


def test_synchronize_timeout_then_the_device_goes_on(dev, kernels, gates):
    gate = gates.new()
    tv = dev.next_timeline()
    dev.hw_compute_queue_t().wait(gate, 1).signal(dev.timeline_signal, tv).submit(dev)
    with pytest.raises(hcq.HCQTimeoutError) as ei:
        dev.synchronize(timeout=200)
    assert re.search(rf"\b{tv}\b", str(ei.value)), f"the message does not name the timeline value: {ei.value}"
    gate.value = 1
    dev.synchronize(timeout=WAIT_MS)
    out = new_buffer(dev, 64 * 4)
    launch(kernels["fill"], (out,), (31, 64), 64, wait=True)
    assert read_u32(dev, out) == [31] * 64


def test_timeline_wrap_around(dev, caps, kernels):
    from hcq.device import TIMELINE_WRAP
    fill, add, n = kernels["fill"], kernels["add"], 4096
    a, b, out = upload(dev, bytes(range(256)) * 64), new_buffer(dev, n * 4), new_buffer(dev, n * 4)
    base = read_u32(dev, a)
    graph = hcq.HCQGraph([hcq.ExecItem(add, (out, a, b), (n,), (n // 64, 1, 1), (64, 1, 1))])  # built before the wrap
    dev.synchronize()
    tl = dev.timeline_signal
    dev.hw_compute_queue_t().wait(tl, dev.timeline_value - 1).signal(tl, TIMELINE_WRAP - 2).submit(dev)
    dev.timeline_value = TIMELINE_WRAP - 1
    dev.synchronize(timeout=WAIT_MS)
    assert dev.timeline_signal is tl and tl.value == TIMELINE_WRAP - 2  # not past the wrap point yet
    launch(fill, (b,), (1, n), n)  # signals TIMELINE_WRAP - 1
    launch(fill, (b,), (2, n), n)  # signals TIMELINE_WRAP: the next value is past it
    assert dev.timeline_value > TIMELINE_WRAP
    dev.synchronize(timeout=WAIT_MS)  # wraps
    assert dev.timeline_value < 100 and dev.timeline_signal.value == dev.timeline_value - 1
    # work after the wrap: kernels, host copies, a graph built before it
    launch(add, (out, a, b), (n,), n)
    assert read_u32(dev, out) == [x + 2 for x in base]
    launch(fill, (b,), (5, n), n)
    graph(wait=True)
    assert read_u32(dev, out) == [x + 5 for x in base]
    dev.synchronize(timeout=WAIT_MS)
    assert dev.timeline_signal.value == dev.timeline_value - 1


# ------------------------------------------------------------------ stuck devices: timeouts, hang reports, queue states
def test_stuck_queue_times_out_with_a_hang_report(dev, caps, gates):
    gate, done = gates.new(value=3), dev.new_signal()
    dev.hw_compute_queue_t().wait(gate, 5).signal(done, 1).submit(dev)
    with pytest.raises(hcq.HCQTimeoutError) as ei:
        done.wait(1, timeout=200)
    msg = str(ei.value)
    assert f"{done.value_addr:x}" in msg
    if caps.queue_states:
        assert "queues:" in msg, f"no hang report in: {msg}"
        compute = [s for s in dev.queue_states() if s["current"] is not None]
        assert compute, "queue_states shows no queue stuck on the wait"
    gate.value = 5  # nothing wedged: the queue drains
    done.wait(1, timeout=WAIT_MS)
    assert done.value == 1


def test_queue_states_of_an_idle_device(dev, caps):
    skip_unless("queue_states")
    dev.synchronize()
    states = idle_queue_states(dev)
    assert len(states) == sum(caps.queues.values()), states
    for st in states:
        assert STATE_KEYS <= set(st), st
        assert st["device"] == dev.device and st["current"] is None and st["rptr"] == st["wptr"], st
    done_before = sum(st["packets_done"] for st in states)
    done = dev.new_signal()
    dev.hw_compute_queue_t().signal(done, 1).submit(dev)
    done.wait(1, timeout=WAIT_MS)
    dev.synchronize()
    assert sum(st["packets_done"] for st in idle_queue_states(dev)) > done_before


def test_queue_states_while_a_kernel_spins(dev, caps, kernels):
    require_poke(dev, caps)
    flag, out = new_buffer(dev, 8), new_buffer(dev, 4)
    kernels["spin"](flag, out, global_size=(1, 1, 1), local_size=(1, 1, 1))
    tv = dev.timeline_value - 1
    try:
        with pytest.raises(hcq.HCQTimeoutError):
            dev.timeline_signal.wait(tv, timeout=200)
        if caps.queue_states:
            busy = [st for st in dev.queue_states() if st["current"] is not None]
            assert busy and all(st["device"] == dev.device for st in busy), dev.queue_states()
            progress = [st["packets_done"] for st in dev.queue_states()]
            time.sleep(0.02)
            assert [st["packets_done"] for st in dev.queue_states()] == progress
    finally:
        poke(dev, caps, flag, 1, b64=True)
    dev.synchronize(timeout=WAIT_MS)
    assert read_u32(dev, out) == [1]
    if caps.queue_states: idle_queue_states(dev)
