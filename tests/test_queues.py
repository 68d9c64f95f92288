"""Every command on every queue kind of the CPU device, command order, symbolic patching, bind,
multi-device waits and virtual signals."""
import time

import numpy as np
import pytest

import hcq
from hcq import HCQBuffer, Variable
from helpers import alloc, arr

KERNELS = r"""
HCQ_KERNEL void dbl(float *out, const float *in, int n) { long i = hcq_global_id(0); if (i < n) out[i] = in[i]*2; }
HCQ_KERNEL void addone(int *out, const int *in, int n) { long i = hcq_global_id(0); if (i < n) out[i] = in[i] + 1; }
HCQ_KERNEL void mark(int *out) { long i = hcq_global_id(0); out[i] += 1; }
HCQ_KERNEL void busy(long *out, long iters) { long acc = 0; for (long k = 0; k < iters; k++) acc += k ^ (acc >> 3); out[0] = acc; }
"""
TIMEOUT = 5000  # ms; generous, only hit when something is broken


@pytest.fixture
def queue_prgs(dev):
    return {name: dev.compile(KERNELS, name) for name in ("dbl", "addone", "mark", "busy")}


def released(sig, value):
    """Make sure a gate signal is open (so a failing test never leaves a queue blocked for later tests)."""
    if sig.value < value: sig.value = value


# ------------------------------------------------------------------ compute queue commands
def test_compute_wait_blocks_until_value_then_signal(dev):
    gate, done = dev.new_signal(value=0), dev.new_signal(value=0)
    buf = alloc(dev, 8)
    dev.hw_compute_queue_t().wait(gate, 3).write(buf, 0x1234).signal(done, 7).submit(dev)
    try:
        gate.value = 2  # below the value waited for: the queue stays blocked
        time.sleep(0.1)
        assert done.value == 0 and arr(buf)[0] == 0
        dev.hw_copy_queue_t().signal(gate, 10).submit(dev)  # >= is enough (another queue sets it)
        done.wait(7, timeout=TIMEOUT)
        assert done.value == 7 and arr(buf)[0] == 0x1234
    finally:
        released(gate, 10)


def test_compute_wait_compares_64_bits(dev):
    gate, done = dev.new_signal(value=6), dev.new_signal(value=0)
    dev.hw_compute_queue_t().wait(gate, 2**32 + 5).signal(done, 1).submit(dev)
    try:
        time.sleep(0.1)  # low word 6 >= 5, but 6 < 2**32 + 5
        assert done.value == 0
        gate.value = 2**33 + 1  # low word 1 < 5, but the 64-bit value is larger
        done.wait(1, timeout=TIMEOUT)
    finally:
        released(gate, 2**33 + 1)


def test_compute_signal_64bit_values(dev):
    s, done = dev.new_signal(value=0), dev.new_signal(value=0)
    dev.hw_compute_queue_t().signal(s, 2**63 + 12345).signal(done, 1).submit(dev)
    done.wait(1, timeout=TIMEOUT)
    assert s.value == 2**63 + 12345
    dev.hw_compute_queue_t().signal(s, 3).signal(done, 2).submit(dev)  # signal sets, it does not max
    done.wait(2, timeout=TIMEOUT)
    assert s.value == 3


@pytest.mark.parametrize("kind", ["compute", "copy"])
def test_timestamp_command(dev, queue_prgs, kind):
    s1, s2, done = dev.new_signal(), dev.new_signal(), dev.new_signal()
    assert s1.timestamp == 0
    t0 = time.monotonic_ns() / 1000
    if kind == "compute":
        out = alloc(dev, 8)
        q = dev.hw_compute_queue_t().timestamp(s1).exec(queue_prgs["busy"], queue_prgs["busy"].fill_kernargs((out,), vals=(200_000,)), (1, 1, 1), (1, 1, 1))
    else:
        a, b = alloc(dev, 1 << 20, 1), alloc(dev, 1 << 20)
        q = dev.hw_copy_queue_t().timestamp(s1).copy(b, a, 1 << 20)
    q.timestamp(s2).signal(done, 1).submit(dev)
    done.wait(1, timeout=TIMEOUT)
    t1 = time.monotonic_ns() / 1000
    # CLOCK_MONOTONIC in microseconds (Decimal), taken in order
    assert t0 <= s1.timestamp < s2.timestamp <= t1
    assert s1.value == 0 and s2.value == 0  # a timestamp touches only the timestamp field


def test_memory_barrier_then_later_commands_run(dev, queue_prgs):
    inp, out, done = alloc(dev, 64 * 4), alloc(dev, 64 * 4), dev.new_signal()
    arr(inp, np.int32)[:] = np.arange(64)
    args = queue_prgs["addone"].fill_kernargs((out, inp), vals=(64,))
    dev.hw_compute_queue_t().memory_barrier().exec(queue_prgs["addone"], args, (4, 1, 1), (16, 1, 1)).memory_barrier() \
        .write(inp, 99).memory_barrier().signal(done, 1).submit(dev)
    done.wait(1, timeout=TIMEOUT)
    np.testing.assert_array_equal(arr(out, np.int32), np.arange(64) + 1)
    assert arr(inp, np.int32)[0] == 99


def test_exec_on_compute_queue(dev, queue_prgs):
    n = 1000
    inp, out, done = alloc(dev, n * 4), alloc(dev, 1024 * 4), dev.new_signal()
    src = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    arr(inp, np.float32)[:] = src
    arr(out, np.float32)[:] = -1
    args = queue_prgs["dbl"].fill_kernargs((out, inp), vals=(n,))
    dev.hw_compute_queue_t().exec(queue_prgs["dbl"], args, (8, 1, 1), (128, 1, 1)).signal(done, 1).submit(dev)
    done.wait(1, timeout=TIMEOUT)
    np.testing.assert_array_equal(arr(out, np.float32)[:n], src * 2)
    assert (arr(out, np.float32)[n:] == -1).all()  # threads with i >= n wrote nothing


def test_program_call(dev, queue_prgs):
    n = 300
    inp, out = alloc(dev, n * 4), alloc(dev, n * 4)
    arr(inp, np.float32)[:] = np.arange(n)
    t = queue_prgs["dbl"](out, inp, global_size=(3, 1, 1), local_size=(100, 1, 1), vals=(n,), wait=True)
    assert isinstance(t, float) and t >= 0
    np.testing.assert_array_equal(arr(out, np.float32), np.arange(n) * 2)
    assert queue_prgs["dbl"](inp, out, global_size=(3, 1, 1), local_size=(100, 1, 1), vals=(n,)) is None
    dev.synchronize()
    np.testing.assert_array_equal(arr(inp, np.float32), np.arange(n) * 4)


@pytest.mark.parametrize("kind", ["compute", "copy"])
def test_write_32_and_64_bit(dev, kind):
    buf, done = alloc(dev, 32, 0xFF), dev.new_signal()
    mk = dev.hw_compute_queue_t if kind == "compute" else dev.hw_copy_queue_t
    mk().write(buf, 0x12345678).write(buf.offset(8), 0x0123456789ABCDEF, b64=True) \
        .write(buf.offset(16), 0xFFFFFFFF).write(buf.offset(24).va_addr, 2**64 - 1, b64=True).signal(done, 1).submit(dev)
    done.wait(1, timeout=TIMEOUT)
    words = buf.cpu_view().view(0, 32, "I")
    assert words[0] == 0x12345678 and words[1] == 0xFFFFFFFF  # a 32-bit write touches 4 bytes only
    assert buf.cpu_view().view(8, 8, "Q")[0] == 0x0123456789ABCDEF
    assert words[4] == 0xFFFFFFFF
    assert buf.cpu_view().view(24, 8, "Q")[0] == 2**64 - 1
    buf.cpu_view()[:] = bytes(32)
    mk().write(buf, 0).write(buf.offset(4), 7).signal(done, 2).submit(dev)
    done.wait(2, timeout=TIMEOUT)
    assert list(buf.cpu_view().view(0, 8, "I")[0:2]) == [0, 7]
    with pytest.raises(ValueError, match="32 bits"):
        mk().write(buf, 2**32)
    with pytest.raises(ValueError, match="64 bits"):
        mk().write(buf, 2**64, b64=True)


@pytest.mark.parametrize("kind", ["compute", "copy"])
def test_poll_bit_blocks_until_host_writes_bits(dev, kind):
    reg, out, done = alloc(dev, 16), alloc(dev, 8), dev.new_signal()
    mk = dev.hw_compute_queue_t if kind == "compute" else dev.hw_copy_queue_t
    mk().poll_bit(reg, 0x5, 0xF).write(out, 1).poll_bit(reg.offset(8), 1 << 40, 1 << 40, b64=True).write(out.offset(4), 2) \
        .signal(done, 1).submit(dev)
    regs = reg.cpu_view().view(0, 16, "Q")
    try:
        time.sleep(0.05)
        assert done.value == 0 and arr(out)[0] == 0
        regs[0] = 0xF3  # masked bits are 3, not 5
        time.sleep(0.05)
        assert done.value == 0 and arr(out)[0] == 0
        regs[0] = 0xA5  # masked bits are 5: the queue continues to the 64-bit poll
        for _ in range(500):
            if arr(out)[0] == 1: break
            time.sleep(0.01)
        assert arr(out)[0] == 1 and arr(out)[1] == 0 and done.value == 0
        regs[1] = 1 << 8  # only low bits: the 64-bit poll keeps waiting
        time.sleep(0.05)
        assert arr(out)[1] == 0 and done.value == 0
        regs[1] = (1 << 40) | 0xFFFF
        done.wait(1, timeout=TIMEOUT)
        assert list(arr(out)) == [1, 2]
    finally:
        regs[0], regs[1] = 0x5, 1 << 40


# ------------------------------------------------------------------ copy queue commands
def test_copy_queue_copy_wait_signal(dev):
    n = 4096 + 3
    a, b, c = alloc(dev, n), alloc(dev, n), alloc(dev, n)
    data = np.random.default_rng(1).integers(0, 256, n, dtype=np.uint8)
    arr(a, np.uint8)[:] = data
    gate, done = dev.new_signal(), dev.new_signal()
    dev.hw_copy_queue_t().wait(gate, 1).copy(b, a, n).copy(c.offset(1), b.va_addr, n - 1).signal(done, 5).submit(dev)
    try:
        time.sleep(0.05)
        assert done.value == 0 and not arr(b, np.uint8).any()
        gate.value = 1
        done.wait(5, timeout=TIMEOUT)
    finally:
        released(gate, 1)
    np.testing.assert_array_equal(arr(b, np.uint8), data)
    np.testing.assert_array_equal(arr(c, np.uint8)[1:], data[:-1])
    assert arr(c, np.uint8)[0] == 0


@pytest.mark.parametrize("nbytes", [1, 7, 4096, 5 << 20])
def test_copy_sizes(dev, nbytes):
    a, b, done = alloc(dev, nbytes + 16), alloc(dev, nbytes + 16, 0xEE), dev.new_signal()
    data = np.random.default_rng(nbytes).integers(0, 256, nbytes + 16, dtype=np.uint8)
    arr(a, np.uint8)[:] = data
    dev.hw_copy_queue_t().copy(b, a, nbytes).signal(done, 1).submit(dev)
    done.wait(1, timeout=TIMEOUT)
    np.testing.assert_array_equal(arr(b, np.uint8)[:nbytes], data[:nbytes])
    assert (arr(b, np.uint8)[nbytes:] == 0xEE).all()


def test_copy_queue_rejects_overrun(dev):
    a, b = alloc(dev, 16), alloc(dev, 32)
    with pytest.raises(ValueError, match="overruns"):
        dev.hw_copy_queue_t().copy(a, b, 32)
    with pytest.raises(ValueError, match=">= 0"):
        dev.hw_copy_queue_t().copy(b, a, -1)


def test_queue_kind_misuse(dev, queue_prgs):
    buf = alloc(dev, 64)
    args = queue_prgs["mark"].fill_kernargs((buf,))
    with pytest.raises(hcq.QueueKindError, match="compute"):
        dev.hw_copy_queue_t().exec(queue_prgs["mark"], args, (1, 1, 1), (1, 1, 1))
    with pytest.raises(hcq.QueueKindError, match="copy"):
        dev.hw_compute_queue_t().copy(buf.va_addr, buf.va_addr + 32, 16)
    with pytest.raises(hcq.QueueKindError, match="compute"):
        dev.hw_copy_queue_t().memory_barrier()
    assert issubclass(hcq.QueueKindError, hcq.HCQError)


# ------------------------------------------------------------------ order within a queue
def test_copy_queue_runs_in_order(dev):
    a, b, c, done = alloc(dev, 64), alloc(dev, 64), alloc(dev, 64), dev.new_signal()
    arr(a)[:] = np.arange(16)
    q = dev.hw_copy_queue_t()
    q.copy(b, a, 64).write(a, 0xDEAD).copy(c, a, 64)
    for i in range(1, 31): q.write(a.offset(4), i)
    q.copy(c.offset(32), a.offset(4), 4).signal(done, 1).submit(dev)
    done.wait(1, timeout=TIMEOUT)
    np.testing.assert_array_equal(arr(b), np.arange(16))  # the first copy saw the old value
    assert arr(c)[0] == 0xDEAD  # the second copy saw the write
    np.testing.assert_array_equal(arr(c)[1:8], np.arange(1, 8))  # and ran before the 30 writes
    assert arr(c)[8] == 30  # the last copy saw the last of the writes


def test_compute_queue_runs_in_order(dev, queue_prgs):
    n = 256
    a, b, c, d = (alloc(dev, n * 4) for _ in range(4))
    done = dev.new_signal()
    arr(a, np.int32)[:] = np.arange(n)
    addone = queue_prgs["addone"]
    q = dev.hw_compute_queue_t()
    q.exec(addone, addone.fill_kernargs((b, a), vals=(n,)), (n // 64, 1, 1), (64, 1, 1))  # b = a + 1
    q.write(a, 1000)  # a[0] = 1000 after the first kernel finished
    q.exec(addone, addone.fill_kernargs((c, a), vals=(n,)), (n // 64, 1, 1), (64, 1, 1))  # c = a + 1
    q.exec(addone, addone.fill_kernargs((d, b), vals=(n,)), (n // 64, 1, 1), (64, 1, 1))  # d = b + 1
    q.signal(done, 1).submit(dev)
    done.wait(1, timeout=TIMEOUT)
    expect = np.arange(n)
    np.testing.assert_array_equal(arr(b, np.int32), expect + 1)
    assert arr(c, np.int32)[0] == 1001 and (arr(c, np.int32)[1:] == expect[1:] + 1).all()
    np.testing.assert_array_equal(arr(d, np.int32), expect + 2)


# ------------------------------------------------------------------ symbolic patching
def test_symbolic_signal_value_write_value_and_address(dev):
    buf, done = alloc(dev, 64), dev.new_signal()
    idx, val, sv = Variable("idx", 0, 15), Variable("val", 0, 2**32 - 2), Variable("sv", 0, 2**64 - 1)
    dst = Variable("dst", 0, 2**64 - 1)
    # an address built from a buffer plus a Variable, and a buffer whose whole va_addr is a Variable
    q = dev.hw_compute_queue_t().write(HCQBuffer(buf.va_addr + 4 * idx, 4), val) \
        .write(HCQBuffer(dst, 4), val + 1).signal(done, sv)
    for k, v, s in [(0, 11, 1), (15, 2**32 - 2, 2**40), (3, 0, 2**64 - 1), (7, 123, 5)]:
        buf.cpu_view()[:] = bytes(64)
        done.value = 0
        q.submit(dev, {"idx": k, "val": v, "sv": s, "dst": buf.va_addr + 4 * ((k + 1) % 16)})
        done.wait(s, timeout=TIMEOUT)
        expect = np.zeros(16, np.uint32)
        expect[k], expect[(k + 1) % 16] = v, v + 1
        assert done.value == s
        np.testing.assert_array_equal(arr(buf), expect)


def test_symbolic_write_value_out_of_32_bits_is_refused(dev):
    """A concrete 32-bit write of 2**33+5 raises; the same value through a Variable must be refused too
    (at build or at submit), not silently truncated to its low 32 bits."""
    buf = alloc(dev, 8)
    with pytest.raises(ValueError, match="32 bits"):
        dev.hw_compute_queue_t().write(buf, 2**33 + 5)
    with pytest.raises(ValueError):
        dev.hw_compute_queue_t().write(buf, Variable("x", 0, 2**40)).submit(dev, {"x": 2**33 + 5})
    fence = dev.new_signal()
    dev.hw_compute_queue_t().signal(fence, 1).submit(dev)
    fence.wait(1, timeout=TIMEOUT)
    assert buf.cpu_view().view(0, 8, "Q")[0] == 0, "a 32-bit write stored a truncated value"


def test_symbolic_copy_size_and_addresses(dev):
    src, dst, done = alloc(dev, 256), alloc(dev, 512), dev.new_signal()
    data = np.random.default_rng(2).integers(0, 256, 256, dtype=np.uint8)
    arr(src, np.uint8)[:] = data
    sz, off = Variable("sz", 0, 256), Variable("off", 0, 256)
    q = dev.hw_copy_queue_t().copy(dst.va_addr + off, src, sz).signal(done, Variable("step", 0, 100))
    for step, (s, o) in enumerate([(16, 0), (256, 256), (1, 5), (0, 0), (100, 100)], start=1):
        arr(dst, np.uint8)[:] = 0xAA
        q.submit(dev, {"sz": s, "off": o, "step": step})
        done.wait(step, timeout=TIMEOUT)
        got = arr(dst, np.uint8)
        np.testing.assert_array_equal(got[o:o + s], data[:s])
        assert (got[:o] == 0xAA).all() and (got[o + s:] == 0xAA).all()


def test_symbolic_grid_dims(dev, queue_prgs):
    out, done = alloc(dev, 64 * 8 * 4), dev.new_signal()
    g, l = Variable("g", 1, 64), Variable("l", 1, 8)
    mark = queue_prgs["mark"]
    q = dev.hw_compute_queue_t().exec(mark, mark.fill_kernargs((out,)), (g, 1, 1), (l, 1, 1)).signal(done, Variable("step", 0, 100))
    for step, (gv, lv) in enumerate([(2, 8), (64, 8), (5, 3), (5, 3), (1, 1), (33, 7)], start=1):
        arr(out, np.int32)[:] = 0
        q.submit(dev, {"g": gv, "l": lv, "step": step})
        done.wait(step, timeout=TIMEOUT)
        got = arr(out, np.int32)
        assert (got[:gv * lv] == 1).all() and not got[gv * lv:].any(), (gv, lv)


def test_symbolic_grid_dims_as_expressions(dev, queue_prgs):
    n = Variable("n", 1, 1024)
    out, inp, done = alloc(dev, 1024 * 4), alloc(dev, 1024 * 4), dev.new_signal()
    arr(inp, np.int32)[:] = np.arange(1024) * 3
    addone = queue_prgs["addone"]
    args = addone.fill_kernargs((out, inp), vals=(n,))
    q = dev.hw_compute_queue_t().exec(addone, args, ((n + 15) // 16, 1, 1), (16, 1, 1)).signal(done, Variable("step", 0, 100))
    for step, nv in enumerate([1, 1024, 17, 500], start=1):
        arr(out, np.int32)[:] = -1
        q.submit(dev, {"n": nv, "step": step})
        done.wait(step, timeout=TIMEOUT)
        got = arr(out, np.int32)
        np.testing.assert_array_equal(got[:nv], np.arange(nv) * 3 + 1)
        assert (got[nv:] == -1).all()


def test_symbolic_kernel_vals(dev, queue_prgs):
    inp, out, done = alloc(dev, 512 * 4), alloc(dev, 512 * 4), dev.new_signal()
    arr(inp, np.float32)[:] = np.arange(512)
    n = Variable("n", 0, 512)
    dbl = queue_prgs["dbl"]
    args = dbl.fill_kernargs((out, inp), vals=(n,))
    q = dev.hw_compute_queue_t().exec(dbl, args, (4, 1, 1), (128, 1, 1)).signal(done, Variable("step", 0, 100))
    for step, nv in enumerate([10, 512, 0, 300, 300], start=1):
        arr(out, np.float32)[:] = -1
        q.submit(dev, {"n": nv, "step": step})
        done.wait(step, timeout=TIMEOUT)
        got = arr(out, np.float32)
        np.testing.assert_array_equal(got[:nv], np.arange(nv) * 2)
        assert (got[nv:] == -1).all()


class CountingList(list):
    def __init__(self, *a):
        super().__init__(*a)
        self.writes = []

    def __setitem__(self, i, v):
        self.writes.append((i, v))
        super().__setitem__(i, v)


def test_apply_var_vals_rewrites_only_changed_words(dev):
    buf, done = alloc(dev, 16), dev.new_signal()
    a, b = Variable("a", 0, 1000), Variable("b", 0, 1000)
    q = dev.hw_compute_queue_t().write(buf, a).write(buf.offset(4), a + 8).write(buf.offset(8), b).signal(done, Variable("s", 0, 100))
    q._q = CountingList(q._q)
    index = {e.expr: i for i, e in q.q_sints}

    def submit(vals):
        q._q.writes.clear()
        q.submit(dev, vals)
        done.wait(vals["s"], timeout=TIMEOUT)
        assert list(arr(buf)[:3]) == [vals["a"], vals["a"] + 8, vals["b"]]
        return sorted(i for i, _ in q._q.writes)

    assert submit({"a": 1, "b": 2, "s": 1}) == sorted(index.values())  # first submit: every symbolic word
    assert submit({"a": 1, "b": 2, "s": 2}) == [index["s"]]
    assert submit({"a": 5, "b": 2, "s": 3}) == sorted([index["a"], index["(a+8)"], index["s"]])
    assert submit({"a": 5, "b": 9, "s": 4}) == sorted([index["b"], index["s"]])
    q._q.writes.clear()
    q.submit(dev, {"a": 5, "b": 9, "s": 4})
    done.wait(4, timeout=TIMEOUT)
    assert q._q.writes == []  # nothing changed: nothing rewritten


def test_apply_var_vals_rewrites_only_changed_kernargs(dev, queue_prgs, monkeypatch):
    inp, out, done = alloc(dev, 512 * 4), alloc(dev, 512 * 4), dev.new_signal()
    arr(inp, np.float32)[:] = np.arange(512)
    n = Variable("n", 0, 512)
    dbl = queue_prgs["dbl"]
    args = dbl.fill_kernargs((out, inp), vals=(n,))
    q = dev.hw_compute_queue_t().exec(dbl, args, (4, 1, 1), (128, 1, 1)).signal(done, Variable("s", 0, 100))
    writes = []
    orig = hcq.MMIOInterface.__setitem__

    def counting(self, k, v):
        if args.buf.va_addr <= self.addr < args.buf.va_addr + args.buf.size: writes.append((self.addr, k, v))  # only kernargs
        orig(self, k, v)

    monkeypatch.setattr(hcq.MMIOInterface, "__setitem__", counting)
    for s, nv, expect_writes in [(1, 100, 1), (2, 100, 0), (3, 200, 1), (4, 200, 0)]:
        writes.clear()
        q.submit(dev, {"n": nv, "s": s})
        assert len(writes) == expect_writes
        done.wait(s, timeout=TIMEOUT)
        np.testing.assert_array_equal(arr(out, np.float32)[:nv], np.arange(nv) * 2)


def test_submit_without_variable_raises_and_runs_nothing(dev):
    buf, done = alloc(dev, 8), dev.new_signal()
    q = dev.hw_compute_queue_t().write(buf, Variable("value_var", 0, 100)).signal(done, 1)
    with pytest.raises(hcq.UnboundVariableError, match="value_var"):
        q.submit(dev)
    with pytest.raises(hcq.UnboundVariableError, match="value_var"):
        q.submit(dev, {"other": 1})
    with pytest.raises(ValueError, match="value_var"):
        q.submit(dev, {"value_var": 101})  # outside the variable's range
    fence = dev.new_signal()
    dev.hw_compute_queue_t().signal(fence, 1).submit(dev)  # in-order: anything submitted before has run
    fence.wait(1, timeout=TIMEOUT)
    assert done.value == 0 and arr(buf)[0] == 0
    q.submit(dev, {"value_var": 42})
    done.wait(1, timeout=TIMEOUT)
    assert arr(buf)[0] == 42


def test_negative_resolved_word_is_refused(dev):
    done = dev.new_signal()
    v = Variable("v", 0, 10)
    q = dev.hw_compute_queue_t().signal(done, v - 5)
    with pytest.raises(ValueError, match="64-bit"):
        q.submit(dev, {"v": 1})


# ------------------------------------------------------------------ bind
class CountingMMIO:
    def __init__(self, inner):
        self.inner, self.writes = inner, []

    def __setitem__(self, k, v):
        self.writes.append(k)
        self.inner[k] = v

    def __getitem__(self, k): return self.inner[k]
    def __len__(self): return len(self.inner)


def test_bound_queue_resubmitted_with_different_values(dev, queue_prgs):
    n, v, s = Variable("n", 1, 256), Variable("v", 0, 2**32 - 1), Variable("s", 0, 2**64 - 1)
    inp, out, flag, done = alloc(dev, 256 * 4), alloc(dev, 256 * 4), alloc(dev, 8), dev.new_signal()
    arr(inp, np.int32)[:] = np.arange(256) * 5
    addone = queue_prgs["addone"]
    q = dev.hw_compute_queue_t().exec(addone, addone.fill_kernargs((out, inp), vals=(n,)), ((n + 15) // 16, 1, 1), (16, 1, 1)) \
        .write(flag, v).signal(done, s)
    nwords = len(q)
    assert q.bind(dev) is q
    assert isinstance(q._q, hcq.MMIOInterface) and len(q) == nwords
    counting = q._q = CountingMMIO(q._q)
    for nv, vv, sv, changed in [(10, 7, 1, 3), (256, 9, 2, 3), (33, 2**32 - 1, 3, 3), (33, 5, 4, 2), (33, 5, 5, 1), (40, 5, 6, 1)]:
        arr(out, np.int32)[:] = -1
        counting.writes.clear()
        vals = {"n": nv, "v": vv, "s": sv}
        q.submit(dev, vals)
        done.wait(sv, timeout=TIMEOUT)
        # only queue words whose value changed were patched in device memory ((n+15)//16 is 3 for both 33 and 40)
        assert len(counting.writes) == changed
        np.testing.assert_array_equal(arr(out, np.int32)[:nv], np.arange(nv) * 5 + 1)
        assert (arr(out, np.int32)[nv:] == -1).all()
        assert arr(flag)[0] == vv and done.value == sv
        for idx, e in q.q_sints: assert counting.inner[idx] == e.resolve(vals)


def test_bound_queue_runs_its_words_from_device_memory(dev):
    buf, done = alloc(dev, 8), dev.new_signal()
    q = dev.hw_compute_queue_t().write(buf, 111).signal(done, Variable("s", 0, 100)).bind(dev)
    q.submit(dev, {"s": 1})
    done.wait(1, timeout=TIMEOUT)
    assert arr(buf)[0] == 111
    words = q._q
    i = [k for k in range(len(words)) if words[k] == 111]
    assert len(i) == 1
    words[i[0]] = 222  # change the bound packet in memory: the next run uses it
    q.submit(dev, {"s": 2})
    done.wait(2, timeout=TIMEOUT)
    assert arr(buf)[0] == 222


def test_bound_copy_queue(dev):
    src, dst, done = alloc(dev, 128), alloc(dev, 128), dev.new_signal()
    arr(src, np.uint8)[:] = np.arange(128)
    sz, step = Variable("sz", 0, 128), Variable("step", 0, 100)
    q = dev.hw_copy_queue_t().copy(dst, src, sz).write(dst.offset(124), step).signal(done, step).bind(dev)
    for st, s in enumerate([4, 128, 9], start=1):
        arr(dst, np.uint8)[:] = 0xFF
        q.submit(dev, {"sz": s, "step": st})
        done.wait(st, timeout=TIMEOUT)
        got = arr(dst, np.uint8)
        np.testing.assert_array_equal(got[:min(s, 124)], np.arange(min(s, 124)))
        assert (got[s:124] == 0xFF).all() and got[124:].view(np.uint32)[0] == st


def test_bound_queue_refuses_new_commands_and_other_devices(dev, dev1):
    buf, done = alloc(dev, 8), dev.new_signal()
    q = dev.hw_compute_queue_t().write(buf, 5).signal(done, 1).bind(dev)
    with pytest.raises(hcq.HCQError, match="bound"):
        q.signal(done, 2)
    with pytest.raises(hcq.HCQError, match="bound"):
        q.write(buf, 1)
    with pytest.raises(hcq.HCQError, match=r"bound to CPU:0.*CPU:1"):
        q.submit(dev1)
    q.submit(dev)
    done.wait(1, timeout=TIMEOUT)
    assert arr(buf)[0] == 5


# ------------------------------------------------------------------ several devices
def test_queue_on_cpu1_waits_for_signal_cpu0_sets_later(dev, dev1):
    gate, done = dev.new_signal(), dev1.new_signal()
    buf = alloc(dev1, 8)
    dev1.hw_compute_queue_t().wait(gate, 1).write(buf, 77).signal(done, 1).submit(dev1)
    try:
        time.sleep(0.1)
        assert done.value == 0 and arr(buf)[0] == 0
        dev.hw_compute_queue_t().wait(dev.timeline_signal, dev.timeline_value - 1).signal(gate, 1).submit(dev)
        done.wait(1, timeout=TIMEOUT)
        assert arr(buf)[0] == 77
    finally:
        released(gate, 1)


def test_devices_chain_through_signals(dev, dev1, queue_prgs):
    n = 256
    inp, mid = alloc(dev, n * 4), alloc(dev, n * 4)
    out = alloc(dev1, n * 4)
    arr(inp, np.float32)[:] = np.arange(n)
    s0, s1, s2 = dev.new_signal(), dev1.new_signal(), dev.new_signal()
    gate = dev.new_signal()
    # dev1's copy queue waits for dev's kernel; dev then waits for dev1's copy before writing a flag
    dev1.hw_copy_queue_t().wait(s0, 1).copy(out, mid, n * 4).signal(s1, 1).submit(dev1)
    dbl = queue_prgs["dbl"]
    try:
        dev.hw_compute_queue_t().wait(gate, 1).exec(dbl, dbl.fill_kernargs((mid, inp), vals=(n,)), (2, 1, 1), (128, 1, 1)) \
            .signal(s0, 1).submit(dev)
        time.sleep(0.05)
        assert s1.value == 0 and not arr(out).any()
        gate.value = 1
        s1.wait(1, timeout=TIMEOUT)
    finally:
        released(gate, 1)
    dev.hw_copy_queue_t().wait(s1, 1).signal(s2, 1).submit(dev)
    s2.wait(1, timeout=TIMEOUT)
    np.testing.assert_array_equal(arr(out, np.float32), np.arange(n) * 2)


# ------------------------------------------------------------------ virtual signals
def test_virtual_signal_patched_at_submit(dev):
    vsig = dev.signal_t(base_buf=HCQBuffer(Variable("addr", 0, 2**64 - 1), 16))
    real1, real2, done = dev.new_signal(), dev.new_signal(), dev.new_signal()
    q = dev.hw_compute_queue_t().signal(vsig, Variable("v", 0, 2**64 - 1)).timestamp(vsig).signal(done, Variable("d", 0, 100))
    q.submit(dev, {"addr": real1.value_addr, "v": 42, "d": 1})
    done.wait(1, timeout=TIMEOUT)
    assert real1.value == 42 and real1.timestamp > 0
    assert real2.value == 0 and real2.timestamp == 0
    q.submit(dev, {"addr": real2.value_addr, "v": 2**63, "d": 2})
    done.wait(2, timeout=TIMEOUT)
    assert real2.value == 2**63 and real2.timestamp > 0 and real1.value == 42


def test_virtual_signal_wait(dev):
    vsig = dev.signal_t(base_buf=HCQBuffer(Variable("addr", 0, 2**64 - 1), 16))
    gate, done, buf = dev.new_signal(), dev.new_signal(), alloc(dev, 8)
    q = dev.hw_compute_queue_t().wait(vsig, 3).write(buf, 9).signal(done, 1)
    q.submit(dev, {"addr": gate.value_addr})
    try:
        time.sleep(0.05)
        assert done.value == 0
        gate.value = 3
        done.wait(1, timeout=TIMEOUT)
        assert arr(buf)[0] == 9
    finally:
        released(gate, 3)


def test_host_cannot_touch_virtual_signal(dev):
    vsig = dev.signal_t(base_buf=HCQBuffer(Variable("addr", 0, 2**64 - 1), 16))
    with pytest.raises(hcq.HCQError, match="virtual"):
        vsig.value
    with pytest.raises(hcq.HCQError, match="virtual"):
        vsig.value = 1
    with pytest.raises(hcq.HCQError, match="virtual"):
        vsig.timestamp
    with pytest.raises(hcq.HCQError, match="virtual"):
        vsig.wait(1, timeout=100)


# ------------------------------------------------------------------ freed buffers: a re-submit must not write the next allocation
def _idle(d):
    """Wait until every ring of `d` has passed its last submission (a free is then reused at once)."""
    for rings in d.rings.values():
        for r in rings: r.fence.wait(r.count, timeout=TIMEOUT)


@pytest.mark.parametrize("how", ["exec", "copy", "write", "bound", "validating"])
def test_resubmit_after_free_raises_and_leaves_the_next_allocation_alone(dev, queue_prgs, how):
    """A queue built on `y`, submitted (the second time natively where it can be), then `free(y)` and an allocation of
    the same size: the re-submit raises, naming the freed buffer, and the new allocation, which may be the same memory
    but is never the same object, is not written. Before, the LRU cache handed back `y` itself, un-freed, and the
    re-submit wrote it (even HCQ_VALIDATE=1 could not tell)."""
    spec = hcq.BufferSpec(cpu_access=True)
    was = hcq.validation.enabled
    hcq.validation.set_enabled(how == "validating")
    try:
        y, src, done, s = alloc(dev, 64), alloc(dev, 64, fill=0xAB), dev.new_signal(), Variable("s", 0, 100)
        if how in ("exec", "bound", "validating"):
            q = dev.hw_compute_queue_t().exec(queue_prgs["mark"], queue_prgs["mark"].fill_kernargs((y,)), (16, 1, 1), (1, 1, 1))
        elif how == "copy":
            q = dev.hw_copy_queue_t().copy(y, src, 64)
        else:
            q = dev.hw_compute_queue_t().write(y.offset(8), 0x5555)
        q.signal(done, s)
        if how == "bound": q.bind(dev)
        for v in (1, 2):
            q.submit(dev, {"s": v})
            done.wait(v, timeout=TIMEOUT)
        _idle(dev)
        dev.allocator.free(y, 64, spec)
        z = dev.allocator.alloc(64, spec)
        z.cpu_view()[:] = bytes(64)
        with pytest.raises(ValueError, match=r"freed"):
            q.submit(dev, {"s": 3})
        _idle(dev)
        assert done.value == 2 and z.cpu_view()[:] == bytes(64), "the refused re-submit ran"
        assert z is not y and y.freed and not z.freed
        with pytest.raises(ValueError, match=r"freed"):  # and so does every later one
            q.submit(dev, {"s": 4})
        dev.allocator.free(z, 64, spec)
    finally:
        hcq.validation.set_enabled(was)


# ------------------------------------------------------------------ refused submits leave no hole in the timeline
SHORT_MS = 3000  # a wait for a timeline value nobody signals times out after this


def _refusal_cases():
    """(name, how the queue is built and submitted so that the submit is refused, the exception): every queue signals
    `d.next_timeline()`, taken when it is built."""
    def missing(d, q, buf): return lambda: q.write(buf, Variable("x", 0, 100)), lambda: q.submit(d)
    def out_of_range(d, q, buf): return lambda: q.write(buf, Variable("x", 0, 100)), lambda: q.submit(d, {"x": 101})
    def validation(d, q, buf): return lambda: q.write(0x10, 1), lambda: q.submit(d)
    def freed(d, q, buf):
        return lambda: q.write(buf, 1), lambda: (d.allocator.free(buf, buf.size, hcq.BufferSpec(cpu_access=True)), q.submit(d))
    def bound_elsewhere(d, q, buf): return lambda: q.write(buf, 1), lambda: q.bind(next(p for p in d.peers() if p is not d)).submit(d)
    def foreign_queue(d, q, buf): return lambda: None, lambda: q.submit(d)
    def ring_refused(d, q, buf):
        def submit():
            with pytest.MonkeyPatch.context() as m:
                m.setattr(hcq.packet_queue, "publish", lambda *a: (_ for _ in ()).throw(hcq.HCQError("the ring was stopped; nothing was queued")))
                q.submit(d)
        return lambda: q.write(buf, 1), submit
    return [("missing variable", missing, hcq.UnboundVariableError), ("variable out of range", out_of_range, ValueError),
            ("validation", validation, hcq.ValidationError), ("freed buffer", freed, ValueError),
            ("bound to another device", bound_elsewhere, hcq.HCQError), ("another backend's queue", foreign_queue, hcq.HCQError),
            ("ring refused", ring_refused, hcq.HCQError)]


@pytest.mark.full
@pytest.mark.parametrize("case", _refusal_cases(), ids=lambda c: c[0])
def test_a_refused_submit_leaves_no_hole_in_the_timeline(open_device, monkeypatch, case):
    """A queue built with `next_timeline()` whose submit is refused: later waits on the device still end (before, the
    value was never signalled, so every later synchronize timed out), later work runs, and re-submitting the refused
    queue (its timeline value given up) is refused, saying so."""
    name, build, error = case
    monkeypatch.setenv("HCQDEV_WAIT_TIMEOUT_MS", str(SHORT_MS))
    d = open_device()  # (a hole would wedge it)
    open_device()  # (its peer: the device "bound to another device" binds the queue to)
    prg = d.compile(KERNELS, "mark")
    buf = alloc(d, 64)
    was = hcq.validation.enabled
    hcq.validation.set_enabled(name == "validation")
    try:
        qt = hcq.packet_queue.PacketComputeQueue if name == "another backend's queue" else d.hw_compute_queue_t
        q = qt().wait(d.timeline_signal, d.timeline_value - 1)
        add, submit = build(d, q, buf)
        add()
        q.signal(d.timeline_signal, d.next_timeline())
        with pytest.raises(error):
            submit()
    finally:
        hcq.validation.set_enabled(was)
    d.synchronize()  # (timed out after SHORT_MS before)
    out = alloc(d, 64)
    prg(out, global_size=(16, 1, 1), local_size=(1, 1, 1))
    d.synchronize()
    assert (arr(out) == 1).all()
    if name in ("missing variable", "variable out of range"):
        with pytest.raises(hcq.HCQError, match="timeline value .* given up"):
            q.submit(d, {"x": 5})
        d.synchronize()


def test_a_refused_submit_of_an_earlier_timeline_value_lets_later_ones_run(open_device, monkeypatch):
    """Two queues built with `next_timeline()` (v, then v + 1, which waits for v): the second is submitted, the first is
    refused. The second still runs and the timeline reaches both values (before, both waits timed out)."""
    monkeypatch.setenv("HCQDEV_WAIT_TIMEOUT_MS", str(SHORT_MS))
    d = open_device()
    buf = alloc(d, 64)
    tl = d.timeline_signal
    q1 = d.hw_compute_queue_t().wait(tl, d.timeline_value - 1).write(buf, Variable("x", 0, 100)).signal(tl, d.next_timeline())
    q2 = d.hw_copy_queue_t().wait(tl, d.timeline_value - 1).write(buf.offset(4), 7).signal(tl, d.next_timeline())
    q2.submit(d)
    with pytest.raises(hcq.UnboundVariableError):
        q1.submit(d)
    d.synchronize()
    assert arr(buf)[0] == 0 and arr(buf)[1] == 7 and tl.value == d.timeline_value - 1


def test_a_refused_native_resubmit_leaves_no_hole_in_the_timeline(open_device, monkeypatch):
    """A queue that signals the timeline through a Variable, re-submitted natively with a new `next_timeline()` value
    each time: a submit refused for an out-of-range value (the native path declines, the checked one refuses) still
    lets the timeline reach the value it was given, and later submits of the queue go on."""
    monkeypatch.setenv("HCQDEV_WAIT_TIMEOUT_MS", str(SHORT_MS))
    d = open_device()
    buf, tl = alloc(d, 64), d.timeline_signal
    x, tw, tv = Variable("x", 0, 100), Variable("tw", 0, 2**40), Variable("tv", 1, 2**40)
    q = d.hw_compute_queue_t().wait(tl, tw).write(buf, x).signal(tl, tv)

    def values(x):
        v = d.next_timeline()
        return {"x": x, "tw": v - 1, "tv": v}
    for v in (1, 2, 3):
        q.submit(d, values(v))
    if hcq.hotpath.available(): assert q._native is not None  # (the native re-submit is in use)
    with pytest.raises(ValueError, match="outside its range"):
        q.submit(d, values(101))
    d.synchronize()
    assert arr(buf)[0] == 3
    q.submit(d, values(4))
    d.synchronize()
    assert arr(buf)[0] == 4


def test_submits_to_a_closed_or_failed_device_leave_no_wait_hanging(open_device, monkeypatch):
    """A closed device refuses the submit, a failed one drops it: either way a later synchronize raises DeviceError at
    once instead of waiting for the timeline value the queue took."""
    monkeypatch.setenv("HCQDEV_WAIT_TIMEOUT_MS", str(SHORT_MS))
    d = open_device()
    poke = d.compile("HCQ_KERNEL void poke(int *out, long addr) { *(volatile int *)addr = 1; out[0] = 1; }", "poke")
    buf = alloc(d, 64)
    poke(buf, vals=(0x28,))  # faults: the device fails
    with pytest.raises(hcq.DeviceError, match="faulted"):
        d.synchronize()
    tl = d.timeline_signal
    d.hw_compute_queue_t().wait(tl, d.timeline_value - 1).write(buf, 1).signal(tl, d.next_timeline()).submit(d)
    with pytest.raises(hcq.DeviceError, match="faulted"):
        d.synchronize()
    d.recover()
    d.synchronize()
    q = d.hw_compute_queue_t().wait(tl, d.timeline_value - 1).write(buf, 1).signal(tl, d.next_timeline())
    with pytest.raises(hcq.HCQTimeoutError, match="a value taken with next_timeline.. was never submitted"):
        d.close(timeout=SHORT_MS)  # (the value the queue took: nothing submitted signals it)
    with pytest.raises(hcq.HCQError, match="was closed"):
        q.submit(d)
    with pytest.raises(hcq.DeviceError, match="was closed"):
        d.synchronize()
