"""Validation mode (HCQ_VALIDATE=1): every submit checks the queue's commands with symbols resolved."""
import numpy as np
import pytest

import hcq
from hcq import BufferSpec, ExecItem, HCQBuffer, HCQGraph, Variable, arrays
from hcq.validation import ValidationError

SRC = """
HCQ_KERNEL void add1(int *out, const int *in, int n) { long i = hcq_global_id(0); if (i < n) out[i] = in[i] + 1; }
HCQ_KERNEL void other(int *out) { out[0] = 1; }
"""


def test_off_by_default_keeps_no_notes(dev):
    if hcq.validation.enabled: pytest.skip("the suite runs with HCQ_VALIDATE=1")
    assert dev.hw_compute_queue_t()._notes is None


def test_valid_work_passes(dev, validating):
    prg = dev.compile(SRC, "add1")
    inp = arrays.upload(dev, np.arange(64, dtype=np.int32))
    out = dev.allocator.alloc(256)
    prg(out, inp, vals=(64,), global_size=(1, 1, 1), local_size=(64, 1, 1), wait=True)
    dev.allocator.copyin(out, memoryview(np.zeros(64, np.int32)).cast("B"))  # direct host copies are lent ranges
    prg(out, inp, vals=(64,), global_size=(1, 1, 1), local_size=(64, 1, 1), wait=True)
    assert np.array_equal(arrays.download(out, np.int32, 64), np.arange(1, 65, dtype=np.int32))


def test_write_outside_allocations_names_queue_index_command_and_value(dev, validating):
    sig = dev.new_signal()
    q = dev.hw_compute_queue_t().signal(sig, 1).write(0x1000, 5)
    with pytest.raises(ValidationError, match=r"CPUComputeQueue on CPU:0, command 1 \(write\): destination 0x1000 \(\+4 bytes\) "
                                              r"is outside every live allocation"):
        q.submit(dev)
    assert sig.value == 0  # nothing reached the device


def test_copy_overrunning_an_allocation(dev, validating):
    a, b = dev.allocator.alloc(4096), dev.allocator.alloc(4096)
    n = Variable("n", 0, 1 << 20)
    q = dev.hw_copy_queue_t().copy(a.va_addr, b.va_addr, n)
    q.submit(dev, {"n": 4096})
    dev.hw_copy_queue_t().signal(dev.timeline_signal, dev.next_timeline()).submit(dev)
    dev.synchronize()
    with pytest.raises(ValidationError, match=r"command 0 \(copy\): copy destination 0x[0-9a-f]+ \(\+4097 bytes\)"):
        q.submit(dev, {"n": 4097})


def test_freed_buffer_is_refused(dev, validating):
    prg = dev.compile(SRC, "add1")
    out, inp = dev.allocator.alloc(256), dev.allocator.alloc(256)
    args = prg.fill_kernargs((out, inp), vals=(64,))
    q = dev.hw_compute_queue_t().exec(prg, args, (1, 1, 1), (64, 1, 1))
    dev.allocator.free(inp, 256)  # back into the LRU cache: still mapped, but freed for its user
    with pytest.raises(ValidationError, match=r"command 0 \(exec\): buffer for 'in' 0x[0-9a-f]+ \(\+256 bytes\) uses freed buffer"):
        q.submit(dev)


def test_missing_symbol_names_the_command(dev, validating):
    sig = dev.new_signal()
    q = dev.hw_compute_queue_t().signal(sig, 1).write(HCQBuffer(Variable("where", 0, 2**64 - 1), 8), 1)
    with pytest.raises(ValidationError, match=r"command 1 \(write\): no value for variable 'where'"):
        q.submit(dev, {})


def test_grid_dims_and_block_limits(dev, validating):
    prg = dev.compile(SRC, "add1")
    out, inp = dev.allocator.alloc(256), dev.allocator.alloc(256)
    g = Variable("g", 0, 100)
    q = dev.hw_compute_queue_t().exec(prg, prg.fill_kernargs((out, inp), vals=(64,)), (g, 1, 1), (64, 1, 1))
    with pytest.raises(ValidationError, match=r"global_size\[0\] = 0 is outside \[1, "):
        q.submit(dev, {"g": 0})
    big = Variable("big", 1, 4096)
    q = dev.hw_compute_queue_t().exec(prg, prg.fill_kernargs((out, inp), vals=(64,)), (1, 1, 1), (big, 1024, 1))
    with pytest.raises(ValidationError, match="a block of 2097152 threads exceeds"):
        q.submit(dev, {"big": 2048})
    with pytest.raises(ValueError, match="has 2097152 threads"):  # concrete dims are checked at build, validating or not
        dev.hw_compute_queue_t().exec(prg, prg.fill_kernargs((out, inp), vals=(64,)), (1, 1, 1), (2048, 1024, 1))


def test_kernargs_of_another_program(dev, validating):
    add1, other = dev.compile(SRC, "add1"), dev.compile(SRC, "other")
    out, inp = dev.allocator.alloc(256), dev.allocator.alloc(256)
    q = dev.hw_compute_queue_t().exec(other, add1.fill_kernargs((out, inp), vals=(4,)), (1, 1, 1), (1, 1, 1))
    with pytest.raises(ValidationError, match="kernargs were filled for add1, not other"):
        q.submit(dev)


def test_graph_inputs_are_checked_every_run(dev, validating):
    prg = dev.compile(SRC, "add1")
    inp = arrays.upload(dev, np.arange(64, dtype=np.int32), BufferSpec(nolru=True))
    out = dev.allocator.alloc(256)
    g = HCQGraph([ExecItem(prg, (out, inp), (64,), (1, 1, 1), (64, 1, 1))], inputs=(inp,))
    g(inputs=(inp,), wait=True)
    assert arrays.download(out, np.int32, 64)[5] == 6
    stale = dev.allocator.alloc(256)
    dev.allocator.free(stale, 256)
    with pytest.raises(ValueError, match="was freed"):  # always on: the graph refuses a freed input
        g(inputs=(stale,))


def test_virtual_signal_patched_to_a_bad_address(dev, validating):
    vsig = dev.signal_t(base_buf=HCQBuffer(Variable("sig_addr", 0, 2**64 - 1), 16), owner=dev)
    q = dev.hw_compute_queue_t().signal(vsig, 1)
    real = dev.new_signal()
    q.submit(dev, {"sig_addr": real.value_addr})
    real.wait(1, timeout=5000)
    with pytest.raises(ValidationError, match=r"command 0 \(signal\): signal 0x10 \(\+8 bytes\) is outside"):
        q.submit(dev, {"sig_addr": 0x10})


def test_always_on_checks(dev):
    buf = dev.allocator.alloc(64)
    dev.allocator.free(buf, 64)
    with pytest.raises(ValueError, match="was freed"):
        dev.hw_compute_queue_t().write(buf, 1)
    with pytest.raises(ValueError, match="overruns"):
        dev.hw_copy_queue_t().copy(dev.allocator.alloc(64), dev.allocator.alloc(128), 128)
