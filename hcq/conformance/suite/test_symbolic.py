"""Symbolic queues: values, addresses, copy sizes, kernel arguments and launch dims patched at each submit (a submit
changing one variable leaves the words of the others right), refusals of missing or out-of-range values, bound
queues re-submitted with new values, and re-submits that do not wait for the previous run."""
import random

import pytest

import hcq
from hcq import HCQBuffer, Variable
from hcq.conformance.plugin import WAIT_MS, download, new_buffer, read_u32, require_session, still_blocked, upload

require_session()
pytestmark = pytest.mark.usefixtures("clean_device")
ADDR_MAX = (1 << 64) - 1


def test_symbolic_values(dev, queue_spec):
    v, d = Variable("v", 0, (1 << 32) - 1), Variable("d", 0, 1 << 40)
    buf, done = new_buffer(dev, 16), dev.new_signal()
    q = queue_spec.make(dev).write(buf, v).write(buf.offset(8), v * 2 + 1, b64=True).signal(done, d)
    for i in range(1, 6):
        val = i * 1_000_003 % (1 << 32)
        q.submit(dev, {"v": val, "d": i})
        done.wait(i, timeout=WAIT_MS)
        got = download(dev, buf)
        assert int.from_bytes(got[:4], "little") == val and int.from_bytes(got[8:], "little") == val * 2 + 1, f"submit {i}"
        assert done.value == i


def test_symbolic_addresses(dev, queue_spec):
    off, done = Variable("off", 0, 15), dev.new_signal()
    buf = new_buffer(dev, 64)
    q = queue_spec.make(dev).write(buf.va_addr + off * 4, off + 100).signal(done, off + 1)
    for i in range(16):
        q.submit(dev, {"off": i})
        done.wait(i + 1, timeout=WAIT_MS)
    assert read_u32(dev, buf) == list(range(100, 116))


def test_symbolic_copy_addresses_and_sizes(dev, copy_index):
    n, o, d = Variable("n", 0, 4096), Variable("o", 0, 64), Variable("d", 0, 100)
    data = random.Random(9).randbytes(4096 + 64)
    src, dst, done = upload(dev, data), new_buffer(dev, 4096 + 64, fill=0xEE), dev.new_signal()
    model = bytearray(b"\xee" * (4096 + 64))
    q = dev.hw_copy_queue_t(copy_index).copy(dst.va_addr + o, src.va_addr + o, n).signal(done, d)
    for i, (size, offset) in enumerate([(5, 0), (0, 10), (100, 33), (4096, 64), (1, 63)], start=1):
        q.submit(dev, {"n": size, "o": offset, "d": i})
        done.wait(i, timeout=WAIT_MS)
        model[offset:offset + size] = data[offset:offset + size]
        assert download(dev, dst) == bytes(model), f"copy of {size} bytes at {offset}"


def test_symbolic_kernel_arguments_and_grid(dev, kernels):
    fill = kernels["fill"]
    val, n, d = Variable("val", 0, (1 << 32) - 1), Variable("n", 1, 1024), Variable("d", 0, 100)
    out, done = new_buffer(dev, 1024 * 4), dev.new_signal()
    model = [0] * 1024
    q = dev.hw_compute_queue_t().exec(fill, fill.fill_kernargs((out,), (val, n)), ((n + 63) // 64, 1, 1), (64, 1, 1)).signal(done, d)
    for i, (value, count) in enumerate([(7, 1024), (8, 1), (9, 65), (10, 64), (0xFFFFFFFF, 700)], start=1):
        q.submit(dev, {"val": value, "n": count, "d": i})
        done.wait(i, timeout=WAIT_MS)
        model[:count] = [value] * count
        assert read_u32(dev, out) == model, f"fill of {count} with {value}"


def test_symbolic_block_and_grid_dims(dev, kernels):
    fill = kernels["fill"]
    g, lsz, d = Variable("g", 1, 32), Variable("l", 1, 32), Variable("d", 0, 100)
    out, done = new_buffer(dev, 1024 * 4), dev.new_signal()
    q = dev.hw_compute_queue_t().exec(fill, fill.fill_kernargs((out,), (5, 1024)), (g, 1, 1), (lsz, 1, 1)).signal(done, d)
    covered = 0
    for i, (blocks, threads) in enumerate([(1, 1), (3, 7), (32, 1), (2, 32), (32, 32)], start=1):
        q.submit(dev, {"g": blocks, "l": threads, "d": i})
        done.wait(i, timeout=WAIT_MS)
        covered = max(covered, blocks * threads)
        assert read_u32(dev, out) == [5] * covered + [0] * (1024 - covered), f"grid {blocks} x {threads}"


def test_symbolic_buffer_address_in_kernel_arguments(dev, kernels):
    fill = kernels["fill"]
    where, val, d = Variable("where", 0, ADDR_MAX), Variable("val", 0, 1000), Variable("d", 0, 100)
    a, b, done = new_buffer(dev, 256 * 4), new_buffer(dev, 256 * 4), dev.new_signal()
    placeholder = HCQBuffer(where, 256 * 4)
    q = dev.hw_compute_queue_t().exec(fill, fill.fill_kernargs((placeholder,), (val, 256)), (4, 1, 1), (64, 1, 1)).signal(done, d)
    q.submit(dev, {"where": a.va_addr, "val": 1, "d": 1})
    done.wait(1, timeout=WAIT_MS)
    q.submit(dev, {"where": b.va_addr, "val": 2, "d": 2})
    done.wait(2, timeout=WAIT_MS)
    q.submit(dev, {"where": b.va_addr, "val": 3, "d": 3})  # only the value changes
    done.wait(3, timeout=WAIT_MS)
    assert read_u32(dev, a) == [1] * 256 and read_u32(dev, b) == [3] * 256


@pytest.mark.parametrize("bound", [False, True], ids=["unbound", "bound"])
def test_changing_one_variable_keeps_the_others(dev, queue_spec, bound):
    a, b, d = Variable("a", 0, 1000), Variable("b", 0, 1000), Variable("d", 0, 100)
    buf, done = new_buffer(dev, 12), dev.new_signal()
    q = queue_spec.make(dev).write(buf, a).write(buf.offset(4), b).write(buf.offset(8), a + b).signal(done, d)
    if bound: q.bind(dev)
    vals = {"a": 1, "b": 2}
    for i, change in enumerate([{}, {"a": 10}, {"b": 20}, {}, {"a": 100, "b": 200}, {"b": 3}, {"a": 3}], start=1):
        vals.update(change)
        q.submit(dev, {**vals, "d": i})
        done.wait(i, timeout=WAIT_MS)
        assert read_u32(dev, buf) == [vals["a"], vals["b"], vals["a"] + vals["b"]], f"after {change or 'no change'}"


def test_missing_or_out_of_range_values_are_refused(dev, queue_spec):
    buf, before, after = new_buffer(dev, 8), dev.new_signal(), dev.new_signal()
    v = Variable("v", 0, 10)
    q = queue_spec.make(dev).signal(before, 1).write(buf, v).signal(after, 1)
    with pytest.raises(KeyError, match="v"):  # hcq.UnboundVariableError
        q.submit(dev, {})
    with pytest.raises(ValueError, match="v"):
        q.submit(dev, {"v": 11})
    assert still_blocked(before, 1), "a refused submission reached the device"
    q.submit(dev, {"v": 4})  # the queue is still usable
    after.wait(1, timeout=WAIT_MS)  # (a raw queue is not on the timeline: synchronize() would not wait for its write)
    assert issubclass(hcq.UnboundVariableError, KeyError)
    assert read_u32(dev, buf, 1) == [4]


def test_bound_queue_resubmitted_with_new_values(dev, queue_spec):
    v, d = Variable("v", 0, (1 << 32) - 1), Variable("d", 0, 1 << 20)
    buf, done = new_buffer(dev, 8), dev.new_signal()
    q = queue_spec.make(dev).write(buf, v).write(buf.offset(4), v // 2).signal(done, d).bind(dev)
    for i in range(1, 21):
        q.submit(dev, {"v": i * 977, "d": i})
        done.wait(i, timeout=WAIT_MS)  # a bound queue is re-submitted once its previous run finished
        assert read_u32(dev, buf) == [i * 977, i * 977 // 2], f"submit {i}"


def test_bound_queue_with_a_kernel(dev, kernels):
    add, n = kernels["add"], 128
    a, b, out, done = upload(dev, bytes(range(256)) * 2), new_buffer(dev, n * 4), new_buffer(dev, n * 4), dev.new_signal()
    fill = kernels["fill"]
    val, d = Variable("val", 0, 1 << 20), Variable("d", 0, 100)
    q = dev.hw_compute_queue_t().exec(fill, fill.fill_kernargs((b,), (val, n)), (2, 1, 1), (64, 1, 1)).memory_barrier() \
        .exec(add, add.fill_kernargs((out, a, b), (n,)), (2, 1, 1), (64, 1, 1)).signal(done, d).bind(dev)
    base = read_u32(dev, a, n)
    for i in range(1, 11):
        q.submit(dev, {"val": i * 1000, "d": i})
        done.wait(i, timeout=WAIT_MS)
        assert read_u32(dev, out) == [x + i * 1000 for x in base], f"submit {i}"


def test_resubmits_without_waiting_each_run_with_their_own_values(dev, kernels):
    fill, slots = kernels["fill"], 32
    where, val = Variable("where", 0, ADDR_MAX), Variable("val", 0, 1 << 20)
    out = new_buffer(dev, slots * 64 * 4)
    q = dev.hw_compute_queue_t().exec(fill, fill.fill_kernargs((HCQBuffer(where, 64 * 4),), (val, 64)), (1, 1, 1), (64, 1, 1))
    for i in range(slots): q.submit(dev, {"where": out.va_addr + i * 256, "val": i + 1})  # kernargs patched while earlier runs are queued
    dev.hw_compute_queue_t().signal(dev.timeline_signal, dev.next_timeline()).submit(dev)
    dev.synchronize(timeout=WAIT_MS)
    got = read_u32(dev, out)
    for i in range(slots): assert got[i * 64:(i + 1) * 64] == [i + 1] * 64, f"submission {i} ran with another submission's arguments"
