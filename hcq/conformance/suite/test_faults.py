"""Faults: a kernel that faults fails its device (hcq.DeviceError, sticky), later work on it raises instead of
hanging, `recover()` brings it back, and other devices are untouched."""
import pytest

import hcq
from hcq.conformance.plugin import WAIT_MS, download, launch, new_buffer, read_u32, require_session, skip_unless, upload

require_session()
pytestmark = pytest.mark.usefixtures("clean_device")


@pytest.fixture
def fault(dev, caps, kernels):
    """The fault kernel, on a device that can be recovered afterwards (whatever the test did)."""
    skip_unless("recover")  # a device that cannot recover would stay failed for every later test
    prg = kernels["fault"]
    try:
        yield prg
    finally:
        dev.recover()


def test_fault_fails_the_device_until_recover(dev, kernels, fault):
    out = new_buffer(dev, 64)
    with pytest.raises(hcq.DeviceError):
        fault(out, global_size=(1, 1, 1), local_size=(1, 1, 1), wait=True)
    with pytest.raises(hcq.DeviceError):  # sticky
        dev.synchronize(timeout=WAIT_MS)
    assert _failed_flag(dev) in (None, True), "Executor.failed_flag_address: the flag is clear on a failed device"
    try:  # work after the fault fails instead of hanging (refused at once, or dropped and reported)
        launch(kernels["fill"], (out,), (5, 16), 16)
    except hcq.DeviceError:
        pass
    with pytest.raises(hcq.DeviceError):
        dev.synchronize(timeout=WAIT_MS)
    dev.recover()
    dev.synchronize(timeout=WAIT_MS)
    assert _failed_flag(dev) in (None, False), "Executor.failed_flag_address: the flag stays set after recover()"
    launch(kernels["fill"], (out,), (6, 16), 16, wait=True)
    assert read_u32(dev, out) == [6] * 16


def _failed_flag(dev) -> bool | None:
    """Whether the executor's failed flag (Executor.failed_flag_address, read by the host-copy fast path) is set;
    None where the device has none."""
    import ctypes
    ex = getattr(dev, "executor", None)
    addr = ex.failed_flag_address() if ex is not None else None
    return bool(ctypes.c_int.from_address(addr).value) if addr else None


def test_device_works_fully_after_recover(dev, caps, kernels, fault):
    out = new_buffer(dev, 4096)
    with pytest.raises(hcq.DeviceError):
        fault(out, global_size=(1, 1, 1), local_size=(1, 1, 1), wait=True)
    dev.recover()
    data = bytes(range(256)) * 16
    buf = upload(dev, data)
    assert download(dev, buf) == data
    acc, ones = new_buffer(dev, 256), upload(dev, (1).to_bytes(4, "little") * 64)
    for _ in range(10): launch(kernels["add"], (acc, acc, ones), (64,), 64)
    assert read_u32(dev, acc) == [10] * 64
    done = dev.new_signal()
    for i in range(caps.queues.get("copy", 0)):
        dev.hw_copy_queue_t(i).copy(out, buf, 4096).signal(done, i + 1).submit(dev)
        done.wait(i + 1, timeout=WAIT_MS)
    if caps.queues.get("copy", 0): assert download(dev, out) == data


def test_fault_leaves_other_devices_alone(dev, dev2, fault):
    out = new_buffer(dev, 64)
    data = bytes(range(200))
    buf2 = upload(dev2, data)
    with pytest.raises(hcq.DeviceError):
        fault(out, global_size=(1, 1, 1), local_size=(1, 1, 1), wait=True)
    dev2.synchronize(timeout=WAIT_MS)
    done = dev2.new_signal()
    dev2.hw_compute_queue_t().write(buf2, 0x04030201).signal(done, 1).submit(dev2)
    done.wait(1, timeout=WAIT_MS)
    assert download(dev2, buf2) == bytes([1, 2, 3, 4]) + data[4:]
