"""Contained faults and hang reports: a kernel or packet that faults fails its device (sticky, with the
kernel, block and address), the process lives, the device recovers; timeouts say what each queue is stuck on."""
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import direct_backend  # noqa: E402

import hcq  # noqa: E402
from hcq.conformance.plugin import idle_queue_states  # noqa: E402
from hcq import arrays  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
direct_backend.register()

BAD = """
HCQ_KERNEL void poke(int *out, long bad_block, long addr) {
  long b = hcq_group_id(0);
  if (b == bad_block) *(volatile int *)addr = 1;
  else out[b] = (int)b;
}
HCQ_KERNEL void divide(int *out, int z) { out[0] = 7 / z; }
HCQ_KERNEL void trap(int *out) { __builtin_trap(); }
HCQ_KERNEL void fill(int *out, int v) { out[hcq_global_id(0)] = v; }
"""


pytestmark = pytest.mark.usefixtures("no_validation")  # these tests hand the command processor bad addresses on purpose: validation mode would refuse them.


def test_segfault_in_worker_names_kernel_block_and_address(dev):
    poke = dev.compile(BAD, "poke")
    out = dev.allocator.alloc(4096 * 4)
    with pytest.raises(hcq.DeviceError, match=r"kernel 'poke' faulted in block 1234: Segmentation fault at address 0x28"):
        poke(out, vals=(1234, 0x28), global_size=(4096, 1, 1), wait=True)
    # sticky: every later synchronize says the same, and queued work is dropped instead of hanging
    dev.hw_compute_queue_t().signal(dev.timeline_signal, dev.next_timeline()).submit(dev)
    for _ in range(2):
        with pytest.raises(hcq.DeviceError, match="poke' faulted in block 1234"):
            dev.synchronize(timeout=5000)
    assert isinstance(dev.error_state, hcq.DeviceError)


def test_device_recovers_and_runs_again(dev):
    poke, fill = dev.compile(BAD, "poke"), dev.compile(BAD, "fill")
    out = dev.allocator.alloc(64 * 4)
    with pytest.raises(hcq.DeviceError):
        poke(out, vals=(3, 16), global_size=(64, 1, 1), wait=True)
    assert dev.can_recover
    dev.recover()
    assert dev.error_state is None
    fill(out, vals=(9,), global_size=(64, 1, 1), wait=True)
    assert np.array_equal(arrays.view(out, np.int32, 64), np.full(64, 9, np.int32))


@pytest.mark.parametrize("kernel,vals,pattern", [("divide", (0,), "Floating point exception"), ("trap", (), "Illegal instruction")])
def test_other_fault_signals_are_contained(dev, kernel, vals, pattern):
    prg = dev.compile(BAD, kernel)
    out = dev.allocator.alloc(16)
    with pytest.raises(hcq.DeviceError, match=f"kernel '{kernel}' faulted in block 0: {pattern}"):
        prg(out, vals=vals, wait=True)


def test_bad_copy_and_signal_addresses_fail_the_device(dev):
    buf = dev.allocator.alloc(64)
    dev.hw_copy_queue_t().copy(0x40, buf.va_addr, 64).signal(dev.timeline_signal, dev.next_timeline()).submit(dev)
    with pytest.raises(hcq.DeviceError, match="a COPY packet faulted: Segmentation fault at address 0x40"):
        dev.synchronize(timeout=5000)
    dev.recover()
    dev.hw_compute_queue_t().write(0x80, 1).signal(dev.timeline_signal, dev.next_timeline()).submit(dev)
    with pytest.raises(hcq.DeviceError, match="a WRITE packet faulted: Segmentation fault at address 0x80"):
        dev.synchronize(timeout=5000)
    dev.recover()
    dev.synchronize()


def test_fault_after_an_earlier_timeout_is_still_reported(dev):
    sig = dev.new_signal(value=0)
    dev.hw_compute_queue_t().wait(sig, 1).signal(dev.timeline_signal, dev.next_timeline()).submit(dev)
    with pytest.raises(hcq.HCQTimeoutError):
        dev.synchronize(timeout=100)
    sig.value = 1
    dev.synchronize()
    with pytest.raises(hcq.DeviceError, match="divide"):
        dev.compile(BAD, "divide")(dev.allocator.alloc(16), vals=(0,), wait=True)


def test_timeout_reports_what_each_queue_is_stuck_on(dev):
    sig = dev.new_signal(value=3)
    dev.hw_compute_queue_t().wait(sig, 5).signal(dev.timeline_signal, dev.next_timeline()).submit(dev)
    with pytest.raises(hcq.HCQTimeoutError) as exc:
        dev.synchronize(timeout=200)
    msg = str(exc.value)
    assert f"to reach {dev.timeline_value - 1}; it is at {dev.timeline_value - 2}" in msg
    assert f"{dev.device} compute is stuck at ring word" in msg and f"WAIT for 0x{sig.value_addr:x} >= 5, it is 3" in msg
    states = {s["queue"]: s for s in dev.queue_states()}
    assert states["compute"]["current"]["op"] == "WAIT" and states["copy0"]["current"] is None
    sig.value = 5
    dev.synchronize()
    idle_queue_states(dev)


def test_hang_inside_a_bound_queue_names_the_indirect_packet(dev):
    sig = dev.new_signal(value=0)
    q = dev.hw_compute_queue_t().signal(sig, 1).wait(sig, 2).signal(sig, 3).bind(dev)
    q.submit(dev)
    with pytest.raises(hcq.HCQTimeoutError, match=r"stuck at ring word \d+, indirect packet 3: WAIT for .* >= 2, it is 1"):
        sig.wait(3, timeout=200)
    sig.value = 2
    sig.wait(3, timeout=5000)


@pytest.mark.parametrize("kind", ["DIRECT", "DIRECTQ"])
def test_a_failed_stream_device_poisons_its_signals(open_device, kind):
    """Stream model (DIRECT; DIRECTQ, whose stores come from completions): a kernel fault and then a signal store the
    value poisoned, as the CPU device does. The host wait raises naming the fault, a peer whose wait it releases
    fails instead of running on missing data, and a healthy store after recover() clears the poison."""
    a, b = open_device(kind), open_device(kind)
    kernels = direct_backend.toy.CONFORMANCE_KERNELS
    fault, fill = a.compile(*kernels["fault"]), b.compile(*kernels["fill"])
    shared, out = a.new_signal(value=0), b.allocator.alloc(16 * 4)
    arrays.view(out, np.uint32, 16)[:] = 0
    try:
        b.submit_timeline(b.hw_compute_queue_t().wait(shared, 1).exec(fill, fill.fill_kernargs((out,), vals=(7, 16)), (1, 1, 1), (16, 1, 1))
                          .signal(b.timeline_signal, b.timeline_value))
        fault(a.allocator.alloc(64))
        a.hw_compute_queue_t().signal(shared, 1).submit(a)  # dropped work: stored poisoned
        with pytest.raises(hcq.DeviceError, match=rf"{a.device} failed: .*faults on purpose"):
            shared.wait(1, timeout=10_000)
        assert shared.failed_setter() is a
        with pytest.raises(hcq.DeviceError, match=rf"{b.device} failed: a WAIT for signal 0x{shared.value_addr:x} >= 1 was released by "
                                                  rf"{a.device} after {a.device} failed.*faults on purpose"):
            b.synchronize(timeout=10_000)
        assert not arrays.view(out, np.uint32, 16).any(), "the peer ran its kernel on missing data"
    finally:
        a.recover()
        b.recover()
    a.hw_compute_queue_t().signal(shared, 2).submit(a)  # a healthy store clears the tag
    shared.wait(2, timeout=10_000)
    assert shared.failed_setter() is None
    b.submit_timeline(b.hw_compute_queue_t().wait(shared, 2).exec(fill, fill.fill_kernargs((out,), vals=(7, 16)), (1, 1, 1), (16, 1, 1))
                      .signal(b.timeline_signal, b.timeline_value))
    b.synchronize(timeout=10_000)
    assert (arrays.view(out, np.uint32, 16) == 7).all()


def test_fault_outside_kernels_is_not_swallowed(tmp_path):
    # Our handlers only catch faults of command-processor threads running guarded work; anything else
    # still kills the process (through the handler installed before ours).
    script = tmp_path / "crash.py"
    script.write_text(textwrap.dedent("""
        import ctypes, hcq
        hcq.Device("CPU").synchronize()
        ctypes.string_at(0x10, 4)
        print("survived")
    """))
    res = subprocess.run([sys.executable, "-X", "faulthandler", str(script)], capture_output=True, text=True, timeout=120,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert res.returncode != 0 and "survived" not in res.stdout
    assert "Segmentation fault" in res.stderr  # Python's faulthandler ran: the fault was chained to it
