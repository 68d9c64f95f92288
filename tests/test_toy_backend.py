"""The backend seam, proven with TOY (tests/toy_backend.py): a backend in pure Python whose executor is a thread
per ring decoding hcq packets, whose memory is anonymous mmaps and whose kernels are Python functions. Everything
here goes through the public API (Device, compile, launch, queues, the allocator's copies, HCQGraph, recover,
queue_states); nothing of the CPU backend is involved."""
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import hcq
from hcq.conformance.plugin import idle_queue_states
from hcq import CopyItem, ExecItem, HCQGraph, Variable
from hcq.packets import GUARD_CANCELLED, GUARD_DONE, GUARD_PENDING, PollCondition

sys.path.insert(0, str(Path(__file__).resolve().parent))
import toy_backend  # noqa: E402
from helpers import alloc, arr  # noqa: E402

toy_backend.register()

REPO = Path(__file__).resolve().parent.parent
TIMEOUT = 10_000  # ms; only reached when something is broken

KERNELS = '''
def axpy(out: "f32*", x: "f32*", y: "f32*", k: "f32", n: "i32", *, gid):
    if gid < n: mem(out, n, "f")[gid] = k * mem(x, n, "f")[gid] + mem(y, n, "f")[gid]

def twice(out: "u32*", a: "u32*", n: "u32", *, gid):
    if gid < n: mem(out, n)[gid] = 2 * mem(a, n)[gid]

def where(out: "u32*", *, ctx):
    gx, gy, _ = ctx.global_size
    x, y, _ = ctx.global_id
    mem(out, gx * gy)[y * gx + x] = (ctx.group_id[0] << 16) | (ctx.local_id[0] << 8) | y

def mixed(out: "u64*", a: "u8", b: "u64", c: "i16", d: "f64", e: "u32"):
    store(out, a, "Q"); store(out + 8, b, "Q"); store(out + 16, c, "q"); store(out + 24, int(d * 100), "Q"); store(out + 32, e, "Q")

def nap(seconds: "f64", *, gid):
    if gid == 0: sleep(seconds)

def overrun(out: "u32*", *, gid):
    mem(out, 1 << 30)[0] = 1
'''


@pytest.fixture(autouse=True)
def toy_short_waits(monkeypatch):
    monkeypatch.setenv("HCQDEV_WAIT_TIMEOUT_MS", str(TIMEOUT))


@pytest.fixture
def t0(open_device):
    """A fresh TOY device (TOY:0 unless the test opened another TOY device before it)."""
    return open_device("TOY")


@pytest.fixture
def t1(open_device, t0):
    """A second fresh TOY device, t0's peer."""
    return open_device("TOY")


@pytest.fixture
def k(t0):
    """The conformance kernels and KERNELS on t0."""
    prgs = {name: t0.compile(src, fn) for name, (src, fn) in toy_backend.CONFORMANCE_KERNELS.items()}
    prgs.update({name: t0.compile(KERNELS, name) for name in ("axpy", "twice", "where", "mixed", "nap", "overrun")})
    return prgs


@pytest.fixture
def failing_toy(open_device):
    """A TOY device of its own for tests that fail it (closed after the test, failed or not)."""
    return open_device("TOY")


def copyout(buf, dtype=np.uint32):
    out = np.empty(buf.size // np.dtype(dtype).itemsize, dtype)
    buf.owner.allocator.copyout(memoryview(out), buf)
    return out


# ------------------------------------------------------------------ registration
def test_toy_opens_through_the_registry(t0, t1):
    assert "TOY" in hcq.available_backends()
    assert isinstance(t0, toy_backend.ToyDevice) and isinstance(t1, toy_backend.ToyDevice)
    assert t0.device == "TOY:0" and t1.device == "TOY:1"
    assert hcq.Device("TOY") is t0 and hcq.Device("toy:0") is t0 and hcq.Device("TOY:1") is t1  # index under test
    assert t0.peer_group == t1.peer_group == "TOY" and t1 in t0.peers()
    assert t0.capabilities.packets and not t0.capabilities.host_copies
    assert isinstance(t0.hw_compute_queue_t(), hcq.packet_queue.PacketComputeQueue)


# ------------------------------------------------------------------ kernels
def test_compile_launch_synchronize_copyout(t0, k):
    out = alloc(t0, 1000 * 4, fill=0xAB)
    k["fill"](out, global_size=(4, 1, 1), local_size=(256, 1, 1), vals=(77, 999))  # the fast launcher
    t0.synchronize()
    res = copyout(out)
    assert (res[:999] == 77).all() and res[999] == 0xABABABAB
    a, b = alloc(t0, 64 * 4), alloc(t0, 64 * 4)
    arr(a)[:], arr(b)[:] = np.arange(64), np.arange(64) * 1000 + 2**32 - 10
    secs = k["add"](out, a, b, global_size=(2, 1, 1), local_size=(32, 1, 1), vals=(64,), wait=True)
    assert isinstance(secs, float) and 0 < secs < 10
    np.testing.assert_array_equal(copyout(out)[:64], (np.arange(64) + np.arange(64) * 1000 + 2**32 - 10) % 2**32)


@pytest.mark.parametrize("path", ["fast", "checked"])
def test_timed_launch_reports_seconds_from_device_timestamps(t0, k, request, path):
    assert t0.timeline_signal.timestamp_divider == 1000  # perf_counter_ns -> microseconds
    if path == "checked": request.getfixturevalue("validating")  # validation mode takes the checked launch path
    for _ in range(2):  # the second call reuses what the first built (timing signals, the encoded launch)
        t = time.perf_counter()
        secs = k["nap"](vals=(0.05,), local_size=(2, 1, 1), wait=True)
        wall = time.perf_counter() - t
        # the kernel's span, read from the device's own timestamps (perf_counter_ns), lies inside the call's: at least
        # the nap, at most the call (a wrong divider or unit is 1000x off one way or the other)
        assert 0.045 <= secs <= wall + 1e-3, (secs, wall)


def test_launch_through_an_explicit_queue_with_floats(t0, k):
    n = 100
    out, x, y = alloc(t0, n * 4), alloc(t0, n * 4), alloc(t0, n * 4)
    arr(x, np.float32)[:], arr(y, np.float32)[:] = np.arange(n), 0.5
    args = k["axpy"].fill_kernargs((out, x, y), vals=(3.0, n))
    t0.submit_timeline(t0.hw_compute_queue_t().wait(t0.timeline_signal, t0.timeline_value - 1).memory_barrier()
                       .exec(k["axpy"], args, (4, 1, 1), (32, 1, 1)).signal(t0.timeline_signal, t0.timeline_value))
    t0.synchronize()
    np.testing.assert_allclose(copyout(out, np.float32), np.arange(n) * 3.0 + 0.5)


def test_kernargs_layout_is_a_c_struct(t0, k):
    slots = {s.name: (s.offset, s.fmt, s.is_pointer) for s in k["mixed"].arg_slots}
    assert slots == {"out": (0, "Q", True), "a": (8, "B", False), "b": (16, "Q", False), "c": (24, "h", False),
                     "d": (32, "d", False), "e": (40, "I", False)}
    assert k["mixed"].kernargs_alloc_size == 48
    out = alloc(t0, 40)
    k["mixed"](out, vals=(200, 2**64 - 1, -3, 1.25, 2**32 - 1), wait=True)
    assert list(arr(out, np.uint64)) == [200, 2**64 - 1, 2**64 - 3, 125, 2**32 - 1]


def test_grid_positions_in_three_dims(t0, k):
    out = alloc(t0, 8 * 3 * 4)
    k["where"](out, global_size=(2, 3, 1), local_size=(4, 1, 1), wait=True)
    got = arr(out).reshape(3, 8)
    for y in range(3):
        for x in range(8): assert got[y, x] == ((x // 4) << 16) | ((x % 4) << 8) | y


def test_compile_errors_and_argument_checks(t0, k):
    with pytest.raises(hcq.CompileError, match="does not parse"):
        t0.compile("def broken(:\n", "broken")
    with pytest.raises(ValueError, match="no kernel function named 'nope'.*axpy"):
        t0.compile(KERNELS, "nope")
    with pytest.raises(ValueError, match="unknown parameter type"):
        t0.compile('def bad(x: "complex"): pass\n', "bad")
    with pytest.raises(ValueError, match="takes 1 buffer"):
        k["fill"](alloc(t0, 8), alloc(t0, 8), vals=(1, 1))
    with pytest.raises(ValueError, match="outside"):
        k["fill"](alloc(t0, 8), vals=(-1, 1))


def test_spin_kernel_waits_for_the_host(t0, k):
    flag, out = alloc(t0, 8), alloc(t0, 4)
    k["spin"](flag, out, global_size=(1, 1, 1), local_size=(4, 1, 1))
    time.sleep(0.05)
    cur = next(s for s in t0.queue_states() if s["queue"] == "compute")["current"]
    assert cur is not None and cur["op"] == "EXEC"
    assert arr(out)[0] == 0
    arr(flag, np.uint64)[0] = 1
    t0.synchronize()
    assert arr(out)[0] == 1


# ------------------------------------------------------------------ queues
@pytest.mark.parametrize("kind", ["compute", "copy"])
def test_queue_commands_on_both_kinds(t0, kind):
    mk = t0.hw_compute_queue_t if kind == "compute" else t0.hw_copy_queue_t
    gate, done, ts = t0.new_signal(value=0), t0.new_signal(value=0), t0.new_signal(value=0)
    word, src, dst = alloc(t0, 16), alloc(t0, 256), alloc(t0, 256)
    src.cpu_view()[:] = bytes(range(256))
    mk().wait(gate, 3).timestamp(ts).write(word, 0xDEADBEEF).write(word.offset(8), 2**40 + 5, b64=True).signal(done, 5).submit(t0)
    try:
        gate.value = 2
        time.sleep(0.05)
        assert done.value == 0 and arr(word)[0] == 0  # still blocked below the value waited for
        other = t0.hw_copy_queue_t if kind == "compute" else t0.hw_compute_queue_t
        other().signal(gate, 3).submit(t0)  # the other queue releases it
        done.wait(5, timeout=TIMEOUT)
    finally:
        gate.value = max(gate.value, 3)
    assert arr(word)[0] == 0xDEADBEEF and arr(word, np.uint64)[1] == 2**40 + 5
    assert 0 < ts.load_timestamp() <= time.perf_counter_ns() and ts.timestamp > 0
    if kind == "copy":
        t0.hw_copy_queue_t().copy(dst.offset(16), src, 100).signal(done, 6).submit(t0)
        done.wait(6, timeout=TIMEOUT)
        assert dst.cpu_view()[16:116] == bytes(range(100)) and dst.cpu_view()[:16] == bytes(16)
    else:
        with pytest.raises(hcq.QueueKindError):
            t0.hw_compute_queue_t().copy(dst, src, 8)
        t0.hw_compute_queue_t().memory_barrier().signal(done, 6).submit(t0)
        done.wait(6, timeout=TIMEOUT)


@pytest.mark.parametrize("kind", ["compute", "copy"])
@pytest.mark.parametrize("cond, b64, start, release, blocked", [
    (PollCondition.EQ, False, 0x10, 0x2A, [0x2B, 0x11]),
    (PollCondition.GEQ, True, 5, 2**40, [2**39]),
    (PollCondition.AND, False, 0x1, 0x4, [0x2, 0x8]),
    (PollCondition.NOR, False, 0xFFFFFFFF, 0x7FFFFF0F, [0xFFFFFF0F]),
])
def test_poll_conditions(t0, kind, cond, b64, start, release, blocked):
    mk = t0.hw_compute_queue_t if kind == "compute" else t0.hw_copy_queue_t
    word, done = alloc(t0, 8), t0.new_signal(value=0)
    view = arr(word, np.uint64 if b64 else np.uint32)
    view[0] = start
    value = {PollCondition.EQ: 0x2A, PollCondition.GEQ: 2**40, PollCondition.AND: 0x4, PollCondition.NOR: 0xF0}[cond]
    mask = 0xFF if cond == PollCondition.EQ else None
    mk().poll_bit(word, value, mask=mask, b64=b64, cond=cond).signal(done, 1).submit(t0)
    try:
        for v in blocked:
            view[0] = v
            time.sleep(0.02)
            assert done.value == 0, f"{cond.name} released at {v:#x}"
        view[0] = release | (0x100 if cond == PollCondition.EQ else 0)  # EQ compares under the mask only
        done.wait(1, timeout=TIMEOUT)
    finally:
        view[0] = release


def test_guarded_copy_runs_or_is_cancelled(t0):
    src, dst, done = alloc(t0, 64, fill=7), alloc(t0, 64), t0.new_signal(value=0)
    guard = t0.new_signal(value=GUARD_PENDING)
    t0.hw_copy_queue_t().copy(dst, src, 64, guard=guard).signal(done, 1).submit(t0)
    done.wait(1, timeout=TIMEOUT)
    assert guard.value == GUARD_DONE and dst.cpu_view()[:] == bytes([7]) * 64
    src.cpu_view()[:] = bytes([9]) * 64
    assert guard.compare_exchange(GUARD_DONE, GUARD_PENDING) == GUARD_DONE
    assert guard.compare_exchange(GUARD_PENDING, GUARD_CANCELLED) == GUARD_PENDING  # the host wins: the copy is skipped
    t0.hw_copy_queue_t().copy(dst, src, 64, guard=guard).signal(done, 2).submit(t0)
    done.wait(2, timeout=TIMEOUT)
    assert guard.value == GUARD_CANCELLED and dst.cpu_view()[:] == bytes([7]) * 64


def test_bound_queues_resubmitted_with_variables(t0, k):
    n, v, s = Variable("n", 1, 256), Variable("v", 0, 2**32 - 1), Variable("s", 0, 2**64 - 1)
    out, flag, done = alloc(t0, 256 * 4), alloc(t0, 8), t0.new_signal(value=0)
    fill = k["fill"]
    q = t0.hw_compute_queue_t().exec(fill, fill.fill_kernargs((out,), vals=(v, n)), ((n + 31) // 32, 1, 1), (32, 1, 1)) \
        .write(flag, v).signal(done, s).bind(t0)
    assert isinstance(q._q, hcq.MMIOInterface)  # the words live in TOY memory and run through INDIRECT
    for nv, vv, sv in [(10, 7, 1), (256, 2**32 - 1, 2), (33, 5, 3), (33, 6, 4)]:
        arr(out)[:] = 0
        q.submit(t0, {"n": nv, "v": vv, "s": sv})
        done.wait(sv, timeout=TIMEOUT)
        assert (arr(out)[:nv] == vv).all() and (arr(out)[nv:] == 0).all() and arr(flag)[0] == vv
    sz, step = Variable("sz", 0, 128), Variable("step", 0, 100)
    src, dst = alloc(t0, 128), alloc(t0, 128)
    src.cpu_view()[:] = bytes(range(128))
    cq = t0.hw_copy_queue_t().copy(dst, src, sz).write(dst.offset(124), step).signal(done, step + 10).bind(t0)
    for szv, st in [(16, 1), (100, 2)]:
        cq.submit(t0, {"sz": szv, "step": st})
        done.wait(st + 10, timeout=TIMEOUT)
        assert dst.cpu_view()[:szv] == bytes(range(szv)) and arr(dst)[31] == st


def test_submission_larger_than_the_ring_runs_from_memory(t0):
    buf, done = alloc(t0, 8), t0.new_signal(value=0)
    q = t0.hw_compute_queue_t()
    for i in range(toy_backend.RING_WORDS // 3 + 10): q.write(buf, i)  # 3 words each: more than the ring holds
    assert len(q) > toy_backend.RING_WORDS
    q.signal(done, 1).submit(t0)
    done.wait(1, timeout=TIMEOUT)
    assert arr(buf)[0] == toy_backend.RING_WORDS // 3 + 9


def test_a_full_ring_waits_for_room_and_wraps(t0):
    gate, done, buf = t0.new_signal(value=0), t0.new_signal(value=0), alloc(t0, 8)
    t0.hw_compute_queue_t().wait(gate, 1).submit(t0)  # hold the ring while it fills up
    n = toy_backend.RING_WORDS // 9 + 300  # 9 words a submission (write, signal, fence): more than the ring holds
    opener = threading.Timer(0.3, lambda: setattr(gate, "value", 1))
    opener.start()
    try:
        start = time.monotonic()
        for i in range(1, n + 1): t0.hw_compute_queue_t().write(buf, i).signal(done, i).submit(t0)
        assert time.monotonic() - start >= 0.25  # some submission waited for room until the gate opened
        done.wait(n, timeout=TIMEOUT)
    finally:
        opener.join()
    assert arr(buf)[0] == n
    assert next(s for s in t0.queue_states() if s["queue"] == "compute")["rptr"] > toy_backend.RING_WORDS  # wrapped


# ------------------------------------------------------------------ copies
def test_copyin_copyout_5mib_with_odd_tail_goes_through_staging(t0):
    nbytes = (5 << 20) + 13
    assert nbytes > t0.allocator.batch_size * len(t0.allocator.b)  # the staging ring wraps
    data = np.random.default_rng(1).integers(0, 256, nbytes, dtype=np.uint8)
    buf = t0.allocator.alloc(nbytes)
    t0.allocator.copyin(buf, memoryview(data))
    t0.synchronize()  # staged copyin returns once its copies are queued
    assert buf.cpu_view()[nbytes - 13:] == data[-13:].tobytes()
    back = np.zeros(nbytes, np.uint8)
    t0.allocator.copyout(memoryview(back), buf)
    np.testing.assert_array_equal(back, data)
    t0.allocator.free(buf, nbytes)


def test_a_mapping_dropped_without_free_does_not_shadow_a_new_one_at_its_address():
    """A buffer dropped without `free` leaves its table entry behind when the collector unmaps it; a bigger mapping
    the OS then places at the same address must still be reachable end to end (this failed a staged copy once)."""
    class Fake:
        def __init__(self, addr: int, size: int): self.addr, self.size = addr, size
    base = 1 << 60  # far above any real mapping
    stale, fresh = Fake(base, 4096), Fake(base, 3 * 4096)
    toy_backend._register_region(stale)  # never unregistered: its buffer was garbage collected
    toy_backend._register_region(fresh)
    try:
        toy_backend.check_range(base + 4096, 2 * 4096)
        toy_backend._unregister_region(stale)  # a late unregister of the stale entry leaves the fresh one alone
        toy_backend.check_range(base, 3 * 4096)
    finally:
        toy_backend._unregister_region(fresh)
    with pytest.raises(toy_backend.ToyFault, match="outside every TOY allocation"):
        toy_backend.check_range(base, 1)


def test_transfer_between_toy_devices(t0, t1, k):
    n = 300_001
    src, dst = t0.allocator.alloc(n), t1.allocator.alloc(n)
    data = np.random.default_rng(2).integers(0, 256, n, dtype=np.uint8)
    t0.allocator.copyin(src, memoryview(data))
    t0.allocator.transfer(dst, src, n, t0, t1)
    back = np.zeros(n, np.uint8)
    t1.allocator.copyout(memoryview(back), dst)  # ordered after the transfer by TOY:1's timeline
    np.testing.assert_array_equal(back, data)


# ------------------------------------------------------------------ graphs
def test_graph_of_three_items_over_two_devices_replayed_with_new_inputs(t0, t1, k):
    n = 64
    twice1 = t1.compile(KERNELS, "twice")
    a, b = alloc(t0, n * 4), alloc(t0, n * 4)
    c, d, e = alloc(t0, n * 4), alloc(t1, n * 4), alloc(t1, n * 4)
    g = HCQGraph([ExecItem(k["add"], (c, a, b), (n,), (2, 1, 1), (32, 1, 1)),
                  CopyItem(d, c, n * 4),  # a transfer TOY:0 -> TOY:1
                  ExecItem(twice1, (e, d), (n,), (2, 1, 1), (32, 1, 1))], inputs=[a, b])
    for run in range(3):
        a2, b2 = alloc(t0, n * 4), alloc(t0, n * 4)
        arr(a2)[:], arr(b2)[:] = np.arange(n) * (run + 1), 1000 * run
        secs = g([a2, b2], wait=True)
        assert secs >= 0
        np.testing.assert_array_equal(copyout(e), 2 * (np.arange(n) * (run + 1) + 1000 * run))


# ------------------------------------------------------------------ failures
def test_kernel_fault_fails_the_device_and_recover_clears_it(failing_toy):
    fault = failing_toy.compile(*toy_backend.CONFORMANCE_KERNELS["fault"])
    fill = failing_toy.compile(*toy_backend.CONFORMANCE_KERNELS["fill"])
    out = alloc(failing_toy, 64 * 4)
    fault(out, global_size=(3, 1, 1), local_size=(2, 1, 1))
    fill(out, global_size=(1, 1, 1), local_size=(64, 1, 1), vals=(5, 64))  # dropped by the failed device
    with pytest.raises(hcq.DeviceError, match=rf"{failing_toy.device} failed: kernel 'fault' raised RuntimeError in block 0: the fault kernel"):
        failing_toy.synchronize()
    with pytest.raises(hcq.DeviceError):  # sticky
        failing_toy.synchronize()
    assert (arr(out) == 0).all()
    assert failing_toy.timeline_signal.failed_setter() is failing_toy  # the dropped work's signal was stored, poisoned
    failing_toy.recover()
    fill(out, global_size=(1, 1, 1), local_size=(64, 1, 1), vals=(5, 64), wait=True)
    assert (arr(out) == 5).all()


@pytest.mark.parametrize("what, pattern", [
    ("opcode", r"unknown packet opcode 99"),
    ("write", r"a WRITE packet faulted: access of 4 bytes at address 0x40 is outside every TOY allocation"),
    ("copy", r"a COPY packet faulted: access of 8 bytes at address 0x80"),
    ("overrun", r"kernel 'overrun' faulted in block 0"),
])
def test_bad_packets_and_addresses_fail_the_device_not_the_process(failing_toy, k, no_validation, what, pattern):
    if what == "opcode":
        q = failing_toy.hw_compute_queue_t()
        q.q(99 | (1 << 8))
    elif what == "write":
        q = failing_toy.hw_compute_queue_t().write(0x40, 1)
    elif what == "copy":
        q = failing_toy.hw_copy_queue_t().copy(alloc(failing_toy, 8), 0x80, 8)
    else:
        ov = failing_toy.compile(KERNELS, "overrun")
        q = failing_toy.hw_compute_queue_t().exec(ov, ov.fill_kernargs((alloc(failing_toy, 4),)), (1, 1, 1), (1, 1, 1))
    failing_toy.submit_timeline(q.signal(failing_toy.timeline_signal, failing_toy.timeline_value))
    with pytest.raises(hcq.DeviceError, match=pattern):
        failing_toy.synchronize()
    failing_toy.recover()
    failing_toy.hw_compute_queue_t().signal(failing_toy.timeline_signal, failing_toy.timeline_value).submit(failing_toy)
    failing_toy.next_timeline()
    failing_toy.synchronize()


def test_failure_propagates_to_a_peer_through_a_poisoned_signal(failing_toy, open_device):
    other = open_device("TOY")
    shared = failing_toy.new_signal(value=0)
    fault = failing_toy.compile(*toy_backend.CONFORMANCE_KERNELS["fault"])
    q = other.hw_compute_queue_t().wait(shared, 1).signal(other.timeline_signal, other.timeline_value)
    other.submit_timeline(q)
    fault(alloc(failing_toy, 4))
    failing_toy.hw_compute_queue_t().signal(shared, 1).submit(failing_toy)  # dropped work: stored poisoned
    with pytest.raises(hcq.DeviceError, match=rf"released by {failing_toy.device} after {failing_toy.device} failed.*kernel 'fault'"):
        other.synchronize()
    failing_toy.recover()
    other.recover()
    other.hw_compute_queue_t().signal(other.timeline_signal, other.timeline_value).submit(other)
    other.next_timeline()
    other.synchronize()


def test_hung_wait_times_out_with_the_hang_report(t0):
    gate = t0.new_signal(value=0)
    t0.submit_timeline(t0.hw_compute_queue_t().wait(gate, 1).signal(t0.timeline_signal, t0.timeline_value))
    try:
        t0_ms = time.monotonic()
        with pytest.raises(hcq.HCQTimeoutError) as ei:
            t0.synchronize(timeout=300)
        assert time.monotonic() - t0_ms < 25  # a hang guard only (the default timeout is 30 s)
        msg = str(ei.value)
        assert "timed out after 300 ms without progress" in msg, msg  # the runtime's own deadline: the one passed
        assert f"{t0.device} compute is stuck at ring word" in msg
        assert f"WAIT for 0x{gate.value_addr:x} >= 1, it is 0" in msg
        states = {s["queue"]: s for s in t0.queue_states()}
        assert states["compute"]["current"]["op"] == "WAIT" and states["compute"]["rptr"] < states["compute"]["wptr"]
        assert states["copy0"]["current"] is None
    finally:
        gate.value = 1
    t0.synchronize()
    idle_queue_states(t0)


def test_hang_report_names_the_packet_inside_a_bound_queue(t0):
    gate, done = t0.new_signal(value=0), t0.new_signal(value=0)
    q = t0.hw_copy_queue_t().wait(gate, 2).signal(done, Variable("s", 0, 10)).bind(t0)
    q.submit(t0, {"s": 1})
    try:
        with pytest.raises(hcq.HCQTimeoutError, match=rf"{t0.device} copy0 is stuck at ring word \d+, indirect packet 0: WAIT for .* >= 2, it is 0"):
            done.wait(1, timeout=200)
    finally:
        gate.value = 2
    done.wait(1, timeout=TIMEOUT)


def test_a_cpu_kernel_refuses_memory_of_another_peer_group_on_every_path(t0, dev, dev1):
    """A CPU kernel given a TOY buffer (memory the CPU device cannot address: another peer group) is refused on the
    native path, the Python path, the checked path, fill_kernargs and in a graph (built, and as a replaced input),
    with nothing submitted; a buffer of a CPU peer is mapped and runs."""
    cpu, peer = dev, dev1
    prg = cpu.compile("HCQ_KERNEL void put(int *a, int v) { a[0] = v; }", "put")
    foreign, own, other = t0.allocator.alloc(64), cpu.allocator.alloc(64), peer.allocator.alloc(64)
    tv = cpu.timeline_value
    refusal = rf"parameter 'a' got <HCQBuffer .* on {t0.device}>, memory of {t0.device} that {cpu.device} cannot address"
    for call in (lambda: prg(foreign, vals=(1,)), lambda: prg.launch(foreign, vals=(1,)), lambda: prg(foreign, vals=(1,), wait=True),
                 lambda: prg(foreign.offset(8, 8), vals=(1,)), lambda: prg.fill_kernargs((foreign,), (1,)),
                 lambda: HCQGraph([ExecItem(prg, (foreign,), (1,))])):
        prg(own, vals=(0,))  # (the native template is loaded, so what follows is its decision)
        tv = cpu.timeline_value
        with pytest.raises(ValueError, match=refusal):
            call()
        assert cpu.timeline_value == tv
    g = HCQGraph([ExecItem(prg, (own,), (5,))], inputs=(own,))
    with pytest.raises(ValueError, match=rf"input 0: <HCQBuffer .* on {t0.device}> is memory of {t0.device}, "
                                         "which the devices that use this input cannot address"):
        g(inputs=(foreign,))
    g(inputs=(other,), wait=True)  # a peer's buffer: mapped, and written
    assert arr(other, np.int32)[0] == 5
    prg(other, vals=(7,), wait=True)
    assert arr(other, np.int32)[0] == 7
    cpu.synchronize()
    for d, b in ((t0, foreign), (cpu, own), (peer, other)): d.allocator.free(b, 64)


# ------------------------------------------------------------------ the conformance kit
@pytest.mark.full
@pytest.mark.skipif(not (REPO / "hcq" / "conformance" / "__main__.py").is_file(), reason="the conformance kit (hcq/conformance) is not in this checkout")
@pytest.mark.parametrize("write_delay_s", [0.0, pytest.param(0.02, marks=pytest.mark.slow)], ids=["", "slow writes"])  # (slow: 20 s)
def test_conformance_kit_passes_on_toy(tmp_path, write_delay_s: float):
    # A fresh process registers the toy, then runs the kit's entry point. It runs from an empty directory: started
    # from the repository, pytest would pick up tests/conftest.py (whose `dev` fixture is CPU:0) for the kit's run.
    # With slow writes (20 ms each, in order) a kit test that reads what nothing ordered before its read fails.
    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).resolve().parent)!r}); import toy_backend; toy_backend.register(); "
            f"toy_backend.WRITE_DELAY_S = {write_delay_s}; from hcq.conformance.__main__ import main; sys.exit(main(['TOY', '-q']))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    res = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-6000:]
    assert "testing TOY:0" in out and " passed" in out and "failed" not in out, out[-3000:]


def test_memory_running_out_while_a_device_opens_is_a_memory_error(open_device, monkeypatch):
    """A backend's `_alloc` that fails while the device sets itself up (its signal page, its kernargs) is reported as
    the MemoryError it raised; the allocator's retry used to synchronize the half-made device first, and the user saw
    `AttributeError: ... no attribute 'timeline_signal'`."""
    def out_of_memory(self, size, options):
        raise MemoryError(f"{self.dev.device}: the test's device has no memory left")
    monkeypatch.setattr(toy_backend.ToyAllocator, "_alloc", out_of_memory)
    with pytest.raises(MemoryError, match="no memory left"):
        open_device("TOY")


def test_an_allocator_that_does_not_suballocate_gives_each_buffer_its_own_allocation(open_device, monkeypatch):
    """`HCQAllocator(..., suballocate=False)`: small buffers are not cut from 1 MiB slabs; each is an `_alloc` of its
    own size (for devices whose addresses allow no arithmetic across allocations)."""
    sizes = []
    real = toy_backend.ToyAllocator._alloc

    def counting(self, size, options):
        sizes.append(size)
        return real(self, size, options)
    monkeypatch.setattr(toy_backend.ToyAllocator, "_alloc", counting)
    dev = open_device("TOY")  # a fresh device: no slab made yet
    for suballocate, want in ((True, [1 << 20] * 3), (False, [64, 100, 4096])):  # (a slab per block size: 64, 128, 4096)
        dev.allocator.suballocate, sizes[:] = suballocate, []
        bufs = [dev.allocator.alloc(n, hcq.BufferSpec(nolru=True)) for n in (64, 100, 4096)]
        assert sizes == want, (suballocate, sizes)
        for b in bufs: dev.allocator.free(b, b.size, hcq.BufferSpec(nolru=True))
