"""Every queue command on each queue kind (signal, wait, timestamp, write, poll_bit, memory_barrier, exec, copy), the
refusals (wrong queue kind, poll conditions the device does not offer), order within a queue and across queues."""
import random

import pytest

import hcq
from hcq.conformance.plugin import (WAIT_MS, QueueSpec, download, new_buffer, poke, read_u32, require_poke,
                                    require_session, skip_unless, still_blocked, upload)

require_session()
pytestmark = pytest.mark.usefixtures("clean_device")
U32 = (1 << 32) - 1
U64 = (1 << 64) - 1


def u32s(*values):
    return b"".join(v.to_bytes(4, "little") for v in values)


# ------------------------------------------------------------------ signal, wait, timestamp, write
def test_signal_stores_the_value(dev, queue_spec):
    s, done = dev.new_signal(value=0), dev.new_signal(value=0)
    queue_spec.make(dev).signal(s, 2**63 + 12345).signal(done, 1).submit(dev)
    done.wait(1, timeout=WAIT_MS)
    assert s.value == 2**63 + 12345
    queue_spec.make(dev).signal(s, 3).signal(done, 2).submit(dev)  # a signal stores, it does not take the maximum
    done.wait(2, timeout=WAIT_MS)
    assert s.value == 3


def test_wait_holds_the_queue_until_the_64_bit_value(dev, queue_spec, gates):
    gate, done = gates.new(value=6), dev.new_signal(value=0)
    out = new_buffer(dev, 8)
    queue_spec.make(dev).wait(gate, 2**32 + 5).write(out, 0xC0FFEE).signal(done, 1).submit(dev)
    assert still_blocked(done, 1), "the wait let the queue run on while the signal was below the value"
    gate.value = 2**32 + 4  # one short
    assert still_blocked(done, 1), "the wait compares fewer than 64 bits"
    gate.value = 2**33 + 1  # past the value is enough; the low word (1) is smaller than the one waited for
    done.wait(1, timeout=WAIT_MS)
    assert read_u32(dev, out, 1) == [0xC0FFEE]


def test_timestamp_records_device_time_in_order(dev, queue_spec):
    skip_unless("timestamps")
    s1, s2, s3, done = dev.new_signal(value=11), dev.new_signal(value=22), dev.new_signal(), dev.new_signal()
    sink = new_buffer(dev, 8)
    q = queue_spec.make(dev).timestamp(s1)
    for i in range(200): q.write(sink, i)  # some work between the two
    q.timestamp(s2).signal(done, 1).submit(dev)
    done.wait(1, timeout=WAIT_MS)
    queue_spec.make(dev).timestamp(s3).signal(done, 2).submit(dev)
    done.wait(2, timeout=WAIT_MS)
    assert 0 < s1.timestamp <= s2.timestamp <= s3.timestamp, (s1.timestamp, s2.timestamp, s3.timestamp)
    assert s1.timestamp < s3.timestamp  # the clock moves between submissions
    assert (s1.value, s2.value) == (11, 22), "a timestamp wrote the signal's value"


def test_write_32_and_64_bit_words(dev, queue_spec):
    buf, done = new_buffer(dev, 32, fill=0xFF), dev.new_signal()
    queue_spec.make(dev).write(buf, 0x12345678).write(buf.offset(8), 0x0123456789ABCDEF, b64=True) \
        .write(buf.offset(20).va_addr, 0).write(buf.offset(24), U64, b64=True).signal(done, 1).submit(dev)
    done.wait(1, timeout=WAIT_MS)
    want = (0x12345678).to_bytes(4, "little") + b"\xff" * 4 + (0x0123456789ABCDEF).to_bytes(8, "little") + b"\xff" * 4 + bytes(4) + b"\xff" * 8
    assert download(dev, buf) == want  # a 32-bit write touches 4 bytes, a 64-bit one 8
    with pytest.raises(ValueError):
        queue_spec.make(dev).write(buf, 2**32)
    with pytest.raises(ValueError):
        queue_spec.make(dev).write(buf, 2**64, b64=True)


# ------------------------------------------------------------------ poll_bit
# (condition, b64, value, mask or None for all ones, [values that do not satisfy it], the value that does)
POLL_CASES = {
    "EQ-32": ("EQ", False, 0x1234, None, [0x1233, 0x11234], 0x1234),
    "EQ-32-masked": ("EQ", False, 0x5, 0xF, [0xF3, 0x16], 0xA5),
    "EQ-64": ("EQ", True, 1 << 40, None, [0, (1 << 40) | 1], 1 << 40),
    "EQ-64-masked": ("EQ", True, 1 << 40, 1 << 40, [1 << 8, 0xFFFFFFFF], (1 << 40) | 0xFFFF),
    "GEQ-32": ("GEQ", False, 100, None, [0, 99], 150),
    "GEQ-64": ("GEQ", True, 1 << 40, None, [U32, (1 << 40) - 1], (1 << 40) + 7),
    "AND-32": ("AND", False, 0b1000, None, [0b0111, 0xF0], 0b1001),
    "AND-64": ("AND", True, 1 << 40, None, [U32, 1 << 41], (1 << 40) | 1),
    "NOR-32": ("NOR", False, 0xFFFF0000, None, [0x0000FFFF, U32], 0x0000FFF0),
    "NOR-64": ("NOR", True, 0xFFFFFFFF00000000, None, [0x00000000FFFFFFFF, U64], 0x00000000FFFFFFF0),
}


@pytest.mark.parametrize("case", list(POLL_CASES))
def test_poll_bit_holds_the_queue_until_the_condition(dev, caps, queue_spec, case):
    from hcq.packets import PollCondition
    cond_name, b64, value, mask, unsatisfying, satisfying = POLL_CASES[case]
    cond = PollCondition[cond_name]
    if cond not in caps.poll_conditions: pytest.skip(f"caps.poll_conditions does not offer {cond_name}")
    if mask is not None: skip_unless("poll_mask")
    require_poke(dev, caps, queue_spec)
    full = U64 if b64 else U32
    width = 8 if b64 else 4
    # the polled word is followed by zero bytes: a 32-bit poll that read 64 bits would see them
    reg, out, done = upload(dev, unsatisfying[0].to_bytes(width, "little") + bytes(8)), new_buffer(dev, 8), dev.new_signal()
    queue_spec.make(dev).poll_bit(reg, value, full if mask is None else mask, b64=b64, cond=cond).write(out, 1).signal(done, 1).submit(dev)
    try:
        assert still_blocked(done, 1), f"poll {case} went on with the word at {unsatisfying[0]:#x}"
        for v in unsatisfying[1:]:
            poke(dev, caps, reg, v, b64=b64, busy=queue_spec)
            assert still_blocked(done, 1), f"poll {case} went on with the word at {v:#x}"
        poke(dev, caps, reg, satisfying, b64=b64, busy=queue_spec)
        done.wait(1, timeout=WAIT_MS)
    finally:
        if done.value < 1: poke(dev, caps, reg, satisfying, b64=b64, busy=queue_spec)
    assert read_u32(dev, out, 1) == [1]


def test_poll_conditions_not_offered_are_refused(dev, caps, queue_spec):
    from hcq.packets import PollCondition
    refused = [c for c in PollCondition if c not in caps.poll_conditions]
    masked = not caps.poll_mask
    if not refused and not masked: pytest.skip("the device offers every poll condition, masked EQ included")
    reg = new_buffer(dev, 8)
    before = dev.new_signal(value=0)
    for cond in refused:
        with pytest.raises(ValueError, match=cond.name):  # at build or at submit, but before anything runs
            queue_spec.make(dev).signal(before, 1).poll_bit(reg, 0, U32, cond=cond).submit(dev)
    if masked:
        with pytest.raises(ValueError, match="mask"):
            queue_spec.make(dev).signal(before, 1).poll_bit(reg, 0, 0xF, cond=PollCondition.EQ).submit(dev)
    assert still_blocked(before, 1), "a refused queue reached the device"


# ------------------------------------------------------------------ exec, memory_barrier, copy and the refusals
def test_exec_runs_the_kernel_on_its_grid(dev, kernels):
    fill, n = kernels["fill"], 1000
    out, done = new_buffer(dev, 1024 * 4, fill=0xEE), dev.new_signal()
    args = fill.fill_kernargs((out,), (0xA5A5A5A5, n))
    dev.hw_compute_queue_t().exec(fill, args, (16, 1, 1), (64, 1, 1)).signal(done, 1).submit(dev)
    done.wait(1, timeout=WAIT_MS)
    got = read_u32(dev, out)
    assert got[:n] == [0xA5A5A5A5] * n
    assert got[n:] == [0xEEEEEEEE] * (1024 - n), "threads with i >= n wrote"


def test_memory_barrier_between_dependent_kernels(dev, kernels):
    add, n = kernels["add"], 256
    a = upload(dev, u32s(*range(n)))
    b, c, done = new_buffer(dev, n * 4), new_buffer(dev, n * 4), dev.new_signal()
    dev.hw_compute_queue_t().exec(add, add.fill_kernargs((b, a, a), (n,)), (4, 1, 1), (64, 1, 1)).memory_barrier() \
        .exec(add, add.fill_kernargs((c, b, a), (n,)), (4, 1, 1), (64, 1, 1)).memory_barrier().signal(done, 1).submit(dev)
    done.wait(1, timeout=WAIT_MS)
    assert read_u32(dev, c) == [3 * i for i in range(n)]


def test_copy_on_every_copy_queue(dev, copy_index):
    n = 4096 + 3
    data = random.Random(copy_index).randbytes(n)
    src, dst, dst2 = upload(dev, data), new_buffer(dev, n + 16, fill=0xEE), new_buffer(dev, n + 16, fill=0xEE)
    done = dev.new_signal()
    dev.hw_copy_queue_t(copy_index).copy(dst, src, n).copy(dst2.offset(1).va_addr, src.va_addr, n - 1).signal(done, 1).submit(dev)
    done.wait(1, timeout=WAIT_MS)
    assert download(dev, dst) == data + b"\xee" * 16
    assert download(dev, dst2) == b"\xee" + data[:-1] + b"\xee" * 16


def test_wrong_queue_kind_is_refused(dev, caps, kernels):
    buf = new_buffer(dev, 64)
    with pytest.raises(hcq.QueueKindError):
        dev.hw_compute_queue_t().copy(buf.va_addr, buf.va_addr + 32, 16)
    assert issubclass(hcq.QueueKindError, hcq.HCQError)
    if caps.queues.get("copy", 0) == 0: return
    fill = kernels["fill"]
    with pytest.raises(hcq.QueueKindError):
        dev.hw_copy_queue_t().exec(fill, fill.fill_kernargs((buf,), (1, 16)), (1, 1, 1), (16, 1, 1))


# ------------------------------------------------------------------ order
def test_commands_of_a_queue_run_in_order(dev, kernels, queue_spec):
    a, b, done = upload(dev, u32s(1, 2)), new_buffer(dev, 8), dev.new_signal()
    q = queue_spec.make(dev).write(a, 7)
    if queue_spec.kind == "compute":
        add = kernels["add"]
        q.memory_barrier().exec(add, add.fill_kernargs((b, a, a), (2,)), (1, 1, 1), (2, 1, 1)).memory_barrier()
    else:
        q.copy(b, a, 8)
    for i in range(1, 51): q.write(a.offset(4), i)
    q.signal(done, 1).submit(dev)
    done.wait(1, timeout=WAIT_MS)
    assert read_u32(dev, b) == ([14, 4] if queue_spec.kind == "compute" else [7, 2]), "the exec/copy did not see the write before it"
    assert read_u32(dev, a) == [7, 50], "writes after the exec/copy landed early, or out of order"


def test_signals_order_work_across_queues(dev, caps, kernels):
    if caps.queues.get("copy", 0) == 0: pytest.skip("caps.queues has no copy queue")
    fill, add, n = kernels["fill"], kernels["add"], 512
    mid, dst, out = new_buffer(dev, n * 4), new_buffer(dev, n * 4), new_buffer(dev, n * 4)
    s1, s2, done = dev.new_signal(), dev.new_signal(), dev.new_signal()
    # submitted first: the copy queue waits for the compute queue's kernel, the compute queue then for the copy
    dev.hw_copy_queue_t().wait(s1, 1).copy(dst, mid, n * 4).signal(s2, 1).submit(dev)
    dev.hw_compute_queue_t().exec(fill, fill.fill_kernargs((mid,), (41, n)), (n // 64, 1, 1), (64, 1, 1)).signal(s1, 1) \
        .wait(s2, 1).exec(add, add.fill_kernargs((out, dst, mid), (n,)), (n // 64, 1, 1), (64, 1, 1)).signal(done, 1).submit(dev)
    done.wait(1, timeout=WAIT_MS)
    assert read_u32(dev, out) == [82] * n


def test_copy_queue_runs_while_the_compute_queue_is_busy(dev, caps, kernels):
    if caps.queues.get("copy", 0) == 0: pytest.skip("caps.queues has no copy queue")
    skip_unless("independent_copy")
    flag, out = new_buffer(dev, 8), new_buffer(dev, 4)
    data = random.Random(5).randbytes(1 << 16)
    src, dst, done = upload(dev, data), new_buffer(dev, 1 << 16), dev.new_signal()  # (host copies wait for the timeline: before)
    kernels["spin"](flag, out, global_size=(1, 1, 1), local_size=(1, 1, 1))  # holds the compute queue until flag != 0
    tl_value = dev.timeline_value - 1
    try:
        dev.hw_copy_queue_t().copy(dst, src, 1 << 16).signal(done, 1).submit(dev)
        done.wait(1, timeout=WAIT_MS)
        assert dev.timeline_signal.value < tl_value, "the spin kernel finished before its flag was set"
    finally:
        poke(dev, caps, flag, 1, b64=True)
    dev.synchronize(timeout=WAIT_MS)
    assert read_u32(dev, out) == [1]
    assert download(dev, dst) == data


def test_every_queue_of_the_capability_record_runs(dev, caps):
    assert caps.queues.get("compute", 0) >= 1 and caps.word_bits in (32, 64)
    done = dev.new_signal()
    specs = [QueueSpec("compute", 0)] + [QueueSpec("copy", i) for i in range(caps.queues.get("copy", 0))]
    for i, spec in enumerate(specs): spec.make(dev).wait(done, i).signal(done, i + 1).submit(dev)  # a chain through every queue
    done.wait(len(specs), timeout=WAIT_MS)
    assert done.value == len(specs)
    sig = dev.new_signal()
    dev.hw_compute_queue_t().signal(sig, U64).submit(dev)
    sig.wait(U64, timeout=WAIT_MS)
    assert sig.value == U64
