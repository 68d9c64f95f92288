"""The runtime layers over the device: graphs (inputs replaced, variables, repeated runs, captures, copies to a
second device), profiling (kernel, copy and graph events with durations) and validation mode."""
from array import array

import pytest

import hcq
from hcq import CopyItem, ExecItem, HCQGraph, Variable
from hcq.conformance.plugin import (WAIT_MS, download, launch, new_buffer, read_u32, require_session, skip_unless,
                                    still_blocked, upload)

require_session()
pytestmark = pytest.mark.usefixtures("clean_device")


def u32_buffer(dev, values):
    return upload(dev, array("I", values))


# ------------------------------------------------------------------ the contract
def test_the_backend_implements_the_hooks_the_core_calls(dev):
    """Every hook the core calls for this device is the backend's own (hcq.backend.contract_problems)."""
    from hcq.backend import contract_problems
    missing = contract_problems(dev)
    assert not missing, f"{dev.device}: not implemented: {', '.join(missing)} (see docs/backends.md)"


# ------------------------------------------------------------------ closing
def test_a_device_closes_refuses_work_and_opens_anew(dev2):
    """dev.close() waits for the work in flight (a copy here), then every use raises; hcq.Device(name) opens the device
    anew, and it works."""
    data = bytes(range(256)) * 4
    name, buf = dev2.device, upload(dev2, data)
    dev2.close()
    assert dev2.closed
    dev2.close()  # (a second close does nothing)
    with pytest.raises(hcq.HCQError, match="was closed"):
        dev2.allocator.alloc(64)
    with pytest.raises(hcq.HCQError, match="was closed"):
        dev2.hw_compute_queue_t().signal(dev2.new_signal(), 1).submit(dev2)
    again = hcq.Device(name)
    assert again is not dev2 and not again.closed and again.device == name
    assert download(again, upload(again, data)) == data


# ------------------------------------------------------------------ graphs
def test_graph_with_inputs_replaced(dev, kernels):
    add, n = kernels["add"], 512
    x, x2, y = u32_buffer(dev, range(n)), u32_buffer(dev, range(1000, 1000 + n)), u32_buffer(dev, [7] * n)
    out = new_buffer(dev, n * 4)
    g = HCQGraph([ExecItem(add, (out, x, y), (n,), (n // 64, 1, 1), (64, 1, 1))], inputs=(x,))
    g(inputs=(x2,), wait=True)
    assert read_u32(dev, out) == [1007 + i for i in range(n)]
    g(inputs=(x,), wait=True)
    assert read_u32(dev, out) == [7 + i for i in range(n)]


def test_graph_with_variables(dev, caps, kernels):
    fill, v, n = kernels["fill"], Variable("v", 0, (1 << 32) - 1), Variable("n", 1, 1024)
    out, copy = new_buffer(dev, 1024 * 4), new_buffer(dev, 1024 * 4)
    items = [ExecItem(fill, (out,), (v, n), ((n + 63) // 64, 1, 1), (64, 1, 1))]
    has_copy = caps.queues.get("copy", 0) > 0
    if has_copy: items.append(CopyItem(dest=copy, src=out, nbytes=n * 4))
    g = HCQGraph(items)
    model = [0] * 1024
    for value, count in [(3, 1024), (4, 1), (5, 100), (6, 1024), (7, 63)]:
        g(var_vals={"v": value, "n": count}, wait=True)
        model[:count] = [value] * count
        assert read_u32(dev, out) == model, f"fill {count} with {value}"
        if has_copy: assert read_u32(dev, copy) == model, f"copy of {count} elements"


def test_graph_runs_in_order_with_other_work(dev, kernels):
    add, n = kernels["add"], 256
    acc, ones = new_buffer(dev, n * 4), u32_buffer(dev, [1] * n)
    g = HCQGraph([ExecItem(add, (acc, acc, ones), (n,), (n // 64, 1, 1), (64, 1, 1))])
    for _ in range(5): g()  # no waits between runs
    launch(add, (acc, acc, ones), (n,), n)  # a plain launch after them
    g()
    dev.synchronize(timeout=WAIT_MS)
    assert read_u32(dev, acc) == [7] * n
    t = g(wait=True)
    assert isinstance(t, float) and t >= 0
    assert read_u32(dev, acc) == [8] * n


def test_capture(dev, kernels):
    add, fill, n = kernels["add"], kernels["fill"], 128
    x, x2 = u32_buffer(dev, range(n)), u32_buffer(dev, [100] * n)
    y, out = new_buffer(dev, n * 4), new_buffer(dev, n * 4, fill=0xEE)
    with hcq.capture(inputs=(x,)) as g:
        launch(fill, (y,), (2, n), n)
        launch(add, (out, x, y), (n,), n)
    assert read_u32(dev, out) == [0xEEEEEEEE] * n, "a captured launch ran during the capture"
    g(inputs=(x2,), wait=True)
    assert read_u32(dev, out) == [102] * n
    g(inputs=(x,), wait=True)
    assert read_u32(dev, out) == [2 + i for i in range(n)]


def test_graph_copies_to_a_second_device(dev, dev2, caps, kernels):
    if caps.queues.get("copy", 0) == 0: pytest.skip("caps.queues has no copy queue")
    fill, n = kernels["fill"], 1000
    src, dst = new_buffer(dev, n * 4), new_buffer(dev2, n * 4)
    v = Variable("v", 0, 1 << 20)
    g = HCQGraph([ExecItem(fill, (src,), (v, n), ((n + 63) // 64, 1, 1), (64, 1, 1)), CopyItem(dest=dst, src=src, nbytes=n * 4)])
    for value in (11, 12):
        g(var_vals={"v": value}, wait=True)
        assert read_u32(dev2, dst) == [value] * n


# ------------------------------------------------------------------ profiling
def test_profile_kernel_and_copy_events(dev, kernels):
    skip_unless("timestamps")
    fill, n = kernels["fill"], 1 << 18
    out = new_buffer(dev, n * 4)
    data = bytes(range(256)) * 4096
    host = bytearray(len(data))
    with hcq.profile() as p:
        launch(fill, (out,), (1, n), n)
        launch(fill, (out,), (2, n), n)
        dev.allocator.copyin(out, memoryview(data))
        dev.allocator.copyout(memoryview(host), out)
    assert host == data
    kernels_ev = [e for e in p.events if e.kind == "kernel" and e.device == dev.device and e.name == fill.name]
    assert len(kernels_ev) == 2, [(e.kind, e.name, e.device) for e in p.events]
    assert all(e.dur_us > 0 for e in kernels_ev), [e.dur_us for e in kernels_ev]
    first, second = sorted(kernels_ev, key=lambda e: e.start_us)
    assert second.start_us >= first.end_us - 1, "the second launch started before the first ended"
    copies = [e for e in p.events if e.kind == "copy" and e.device == dev.device]
    assert copies and all(e.dur_us > 0 for e in copies), [(e.name, e.dur_us) for e in copies]
    assert sum(e.nbytes or 0 for e in copies) >= 2 * len(data), [(e.name, e.nbytes) for e in copies]
    assert any(e.kind == "host" for e in p.events)


def test_profile_graph_events(dev, kernels):
    skip_unless("timestamps")
    fill, add, n = kernels["fill"], kernels["add"], 1 << 16
    a, out = new_buffer(dev, n * 4), new_buffer(dev, n * 4)
    with hcq.profile() as p:
        g = HCQGraph([ExecItem(fill, (a,), (3, n), (n // 64, 1, 1), (64, 1, 1)), ExecItem(add, (out, a, a), (n,), (n // 64, 1, 1), (64, 1, 1))])
        g(wait=True)
        g(wait=True)
    assert read_u32(dev, out, 4) == [6] * 4
    items = [e for e in p.events if e.kind == "graph" and e.device == dev.device]
    assert len(items) == 4, [(e.kind, e.name) for e in p.events]
    assert {e.name for e in items} == {fill.name, add.name}
    assert all(e.dur_us > 0 for e in items), [e.dur_us for e in items]


# ------------------------------------------------------------------ validation
@pytest.fixture
def validating():
    was = hcq.validation.enabled
    hcq.validation.set_enabled(True)
    try:
        yield
    finally:
        hcq.validation.set_enabled(was)


def test_validation_accepts_correct_work(dev, caps, kernels, validating):
    fill, n = kernels["fill"], 256
    data = bytes(range(256)) * 4
    buf, other = upload(dev, data), new_buffer(dev, n * 4)
    assert download(dev, buf) == data
    launch(fill, (other,), (9, n), n, wait=True)
    done = dev.new_signal()
    args = fill.fill_kernargs((buf,), (8, n))
    dev.hw_compute_queue_t().exec(fill, args, (n // 64, 1, 1), (64, 1, 1)).signal(done, 1).submit(dev)
    done.wait(1, timeout=WAIT_MS)
    assert read_u32(dev, buf) == [8] * n and read_u32(dev, other) == [9] * n
    if caps.queues.get("copy", 0):
        dev.hw_copy_queue_t().copy(other, buf, n * 4).signal(done, 2).submit(dev)
        done.wait(2, timeout=WAIT_MS)
        assert read_u32(dev, other) == [8] * n


def test_validation_refuses_a_copy_out_of_range(dev, caps, validating):
    if caps.queues.get("copy", 0) == 0: pytest.skip("caps.queues has no copy queue")
    a, b, before, done = new_buffer(dev, 4096), new_buffer(dev, 4096, fill=7), dev.new_signal(), dev.new_signal()
    nbytes = Variable("nbytes", 0, 1 << 20)
    q = dev.hw_copy_queue_t().signal(before, 1).copy(a, b, nbytes).signal(done, 1)
    with pytest.raises(hcq.ValidationError):
        q.submit(dev, {"nbytes": 4097})
    assert still_blocked(before, 1), "a refused submission reached the device"
    q.submit(dev, {"nbytes": 4096})
    done.wait(1, timeout=WAIT_MS)
    assert download(dev, a) == bytes([7]) * 4096


def test_validation_refuses_a_write_outside_every_allocation(dev, validating):
    before = dev.new_signal()
    q = dev.hw_compute_queue_t().signal(before, 1).write(0x1000, 5)
    with pytest.raises(hcq.ValidationError, match="0x1000"):
        q.submit(dev)
    assert still_blocked(before, 1), "a refused submission reached the device"
