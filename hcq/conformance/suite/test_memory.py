"""Memory: host copies (odd sizes and offsets, zero bytes, more than the staging buffers hold, ordered with kernels),
host views, transfers between two devices, and kernel-argument lifetimes (queues re-submitted long after the user
dropped their arguments, many launches in flight at once)."""
import gc
import random
import threading
from array import array

import pytest

import hcq
from hcq.conformance.plugin import (WAIT_MS, download, launch, new_buffer, poke, read_u32, require_poke,
                                    require_session, skip_unless, upload)

require_session()
pytestmark = pytest.mark.usefixtures("clean_device")


def big_size(dev):
    """More than two staging buffers' worth (a copy of several chunks), with an odd tail; at least 5 MiB."""
    batch = getattr(dev.allocator, "batch_size", 2 << 20)
    return max(5 << 20, min(2 * batch, 24 << 20)) + 13


# ------------------------------------------------------------------ host copies
@pytest.mark.parametrize("size", ["1", "3", "4097", "big"])
def test_copyin_copyout_roundtrip(dev, size):
    n = big_size(dev) if size == "big" else int(size)
    data = random.Random(n).randbytes(n)
    buf = new_buffer(dev, n + 16, fill=0xEE)
    try:
        dev.allocator.copyin(buf, memoryview(data))
        assert download(dev, buf) == data + b"\xee" * 16
        out = bytearray(n)
        dev.allocator.copyout(memoryview(out), buf)
        assert out == data
    finally:
        dev.allocator.free(buf, n + 16)


def test_copies_at_odd_offsets(dev):
    buf = new_buffer(dev, 8192, fill=0xEE)
    data = random.Random(3).randbytes(1001)
    dev.allocator.copyin(buf.offset(3, 1001), memoryview(data))
    model = bytearray(b"\xee" * 8192)
    model[3:1004] = data
    assert download(dev, buf) == bytes(model)
    out = bytearray(17)
    dev.allocator.copyout(memoryview(out), buf.offset(5, 17))
    assert out == model[5:22]
    tail = bytearray(7)
    dev.allocator.copyout(memoryview(tail), buf.offset(8192 - 7))
    assert tail == b"\xee" * 7


def test_zero_byte_copies(dev, caps):
    data = random.Random(4).randbytes(64)
    buf = upload(dev, data)
    dev.allocator.copyin(buf, memoryview(b""))
    dev.allocator.copyout(memoryview(bytearray()), buf)
    if caps.queues.get("copy", 0):
        other, done = upload(dev, bytes(64)), dev.new_signal()
        dev.hw_copy_queue_t().copy(other, buf, 0).signal(done, 1).submit(dev)
        done.wait(1, timeout=WAIT_MS)
        assert download(dev, other) == bytes(64)
    assert download(dev, buf) == data


def test_copies_are_ordered_with_kernels(dev, kernels, gates):
    add, n = kernels["add"], 1024
    a_data = bytes(range(256)) * (n * 4 // 256)
    a, b, out = upload(dev, a_data), new_buffer(dev, n * 4), new_buffer(dev, n * 4)
    launch(kernels["fill"], (b,), (1000, n), n)
    # a kernel held behind a gate on the timeline: a copyin into its input waits for it, a copyout for its output
    gate = gates.new()
    args = add.fill_kernargs((out, a, b), (n,))
    dev.hw_compute_queue_t().wait(dev.timeline_signal, dev.timeline_value - 1).wait(gate, 1) \
        .exec(add, args, (n // 64, 1, 1), (64, 1, 1)).signal(dev.timeline_signal, dev.next_timeline()).submit(dev)
    opener = threading.Timer(0.1, lambda: setattr(gate, "value", 1))
    opener.start()
    try:
        dev.allocator.copyin(a, memoryview(bytes(n * 4)))  # ordered after the kernel that reads `a`
    finally:
        opener.cancel()
        gate.value = 1
    expect = [x + 1000 for x in array("I", a_data)]
    assert read_u32(dev, out) == expect, "the copyin overtook the kernel before it"
    assert read_u32(dev, a) == [0] * n


def test_host_views(dev, caps):
    skip_unless("host_visible_memory")
    buf = dev.allocator.alloc(4096, hcq.BufferSpec(cpu_access=True))
    view = buf.cpu_view()
    view[:] = bytes(range(256)) * 16
    assert download(dev, buf) == bytes(range(256)) * 16  # host stores are seen by the device
    done = dev.new_signal()
    dev.hw_compute_queue_t().write(buf.offset(8), 0xDEADBEEF).signal(done, 1).submit(dev)
    done.wait(1, timeout=WAIT_MS)
    assert buf.cpu_view().view(8, 4, "I")[0] == 0xDEADBEEF  # device stores are seen by the host
    assert buf.offset(8, 4).cpu_view().view(0, 4, "I")[0] == 0xDEADBEEF


def test_dlpack_export(dev, caps, kernels):
    """Buffers speak DLPack: host-visible memory is read in place, after the work submitted before the export; memory the
    host cannot see has the device's own DLPack device type or refuses with BufferError, and exports a host copy."""
    np = pytest.importorskip("numpy", reason="the DLPack item reads buffers with numpy")
    n = 1024
    buf = new_buffer(dev, n * 4)
    launch(kernels["fill"], (buf,), (7, n), n)  # not waited for: the export orders it
    view = buf.array("uint32", (n,))
    if not getattr(caps, "host_visible_memory", False) and getattr(dev, "dlpack_device", None) is None:
        with pytest.raises(BufferError, match="not host-visible"):
            view.__dlpack_device__()
        with pytest.raises(BufferError, match="not host-visible"):
            np.from_dlpack(view)
        assert (np.from_dlpack(view, copy=True) == 7).all()
        return
    skip_unless("host_visible_memory")
    assert view.__dlpack_device__() == (1, 0)  # kDLCPU
    arr = np.from_dlpack(view)
    assert arr.ctypes.data == buf.cpu_view().addr and (arr == 7).all()  # in place, after the kernel
    pairs = np.from_dlpack(buf.array("uint32", (n // 2 - 1, 2), offset=8))  # a typed view at an offset
    assert pairs.shape == (n // 2 - 1, 2) and pairs.ctypes.data == buf.cpu_view().addr + 8 and (pairs == 7).all()
    copied = np.from_dlpack(view, copy=True)
    assert copied.ctypes.data != arr.ctypes.data and (copied == 7).all()


# ------------------------------------------------------------------ transfers between devices
def test_transfer_between_devices(dev, dev2, kernels):
    n = (5 << 20) + 7
    data = random.Random(6).randbytes(n)
    a, b = upload(dev, data), new_buffer(dev2, n + 9, fill=0xEE)
    try:
        dev.allocator.transfer(b, a, n, src_dev=dev, dest_dev=dev2)
        assert download(dev2, b) == data + b"\xee" * 9
        # back, at odd offsets, after a kernel that rewrites the source (the transfer waits for it)
        c = new_buffer(dev, 4096, fill=0x11)
        launch(kernels["fill"], (c,), (0x01020304, 1024), 1024)
        dev.allocator.transfer(b.offset(1), c.offset(4), 1000, src_dev=dev, dest_dev=dev2)
        assert download(dev2, b)[:1002] == data[:1] + (bytes([4, 3, 2, 1]) * 250) + data[1001:1002]
        dev2.allocator.transfer(a.offset(3), b.offset(1), 8, src_dev=dev2, dest_dev=dev)
        assert download(dev, a, 11) == data[:3] + bytes([4, 3, 2, 1]) * 2
    finally:
        dev.allocator.free(a, n)
        dev2.allocator.free(b, n + 9)


# ------------------------------------------------------------------ kernel-argument lifetimes
def _fill_queue(dev, fill, out, value):
    """A queue whose only reference to its kernel arguments is the queue itself."""
    args = fill.fill_kernargs((out,), (value, 256))
    return dev.hw_compute_queue_t().exec(fill, args, (4, 1, 1), (64, 1, 1))


def test_queue_outlives_the_arguments_it_was_built_with(dev, kernels):
    fill, v, d = kernels["fill"], hcq.Variable("v", 0, 1 << 20), hcq.Variable("d", 0, 1000)
    out, done = new_buffer(dev, 256 * 4), dev.new_signal()
    q = _fill_queue(dev, fill, out, v).signal(done, d)
    gc.collect()
    scratch = new_buffer(dev, 64)
    for _ in range(200): fill.fill_kernargs((scratch,), (0, 16))  # kernargs blocks handed out and dropped again
    gc.collect()
    for i in range(1, 61):
        q.submit(dev, {"v": i * 7, "d": i})
        done.wait(i, timeout=WAIT_MS)
        if i % 10 == 0 or i < 4: assert read_u32(dev, out) == [i * 7] * 256, f"submit {i}"


def test_many_launches_in_flight(dev, caps, kernels):
    require_poke(dev, caps)
    fill, n = kernels["fill"], 300
    flag, gate_out = new_buffer(dev, 8), new_buffer(dev, 4)
    a, b = new_buffer(dev, n * 4), new_buffer(dev, n * 4)
    kernels["spin"](flag, gate_out, global_size=(1, 1, 1), local_size=(1, 1, 1))  # everything below queues up behind it
    tv = dev.timeline_value - 1
    try:
        for i in range(n): fill(a.offset(4 * i, 4), global_size=(1, 1, 1), local_size=(1, 1, 1), vals=(i + 1, 1))
        for i in range(n): _fill_queue_at(dev, fill, b.offset(4 * i, 4), 1000 + i).submit(dev)  # their args states dropped at once
        gc.collect()
        assert dev.timeline_signal.value < tv, "the spin kernel finished before its flag was set"
    finally:
        poke(dev, caps, flag, 1, b64=True)
    dev.hw_compute_queue_t().signal(dev.timeline_signal, dev.next_timeline()).submit(dev)
    dev.synchronize(timeout=WAIT_MS)
    assert read_u32(dev, a) == [i + 1 for i in range(n)]
    assert read_u32(dev, b) == [1000 + i for i in range(n)]


def _fill_queue_at(dev, fill, out, value):
    return dev.hw_compute_queue_t().exec(fill, fill.fill_kernargs((out,), (value, 1)), (1, 1, 1), (1, 1, 1))


def test_launches_accumulate_in_order(dev, kernels):
    add, n = kernels["add"], 64
    acc, ones = new_buffer(dev, n * 4), upload(dev, (1).to_bytes(4, "little") * n)
    for _ in range(1000): launch(add, (acc, acc, ones), (n,), n)
    assert read_u32(dev, acc) == [1000] * n
