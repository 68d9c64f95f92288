"""The other side of the seam: DIRECT (direct_backend.py) runs no packets and has no executor; the core's stream model
(hcq.stream_queue, hcq.stream_device) makes its device calls on a thread per queue. The core's symbolic patching,
lifetimes, graphs and failure handling work on it, and it passes the conformance kit."""
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import direct_backend  # noqa: E402

import hcq  # noqa: E402
from hcq import arrays  # noqa: E402

direct_backend.register()
TIMEOUT = 10_000


@pytest.fixture
def direct_dev(open_device):
    """A fresh DIRECT device."""
    return open_device("DIRECT")


def test_launch_patch_and_graph(direct_dev):
    fill = direct_dev.compile(direct_backend.toy.CONFORMANCE_KERNELS["fill"][0], "fill")
    out = direct_dev.allocator.alloc(64 * 4, hcq.BufferSpec(cpu_access=True))
    fill(out, vals=(7, 64), global_size=(4, 1, 1), local_size=(16, 1, 1), wait=True)
    assert (arrays.view(out, np.uint32, 64) == 7).all()
    v, done = hcq.Variable("v", 0, 1000), direct_dev.new_signal(value=0)
    q = direct_dev.hw_compute_queue_t().exec(fill, fill.fill_kernargs((out,), vals=(v, 64)), (4, 1, 1), (16, 1, 1))
    q = q.signal(done, v).bind(direct_dev)
    for i in (1, 2, 3):
        q.submit(direct_dev, {"v": i})
        done.wait(i, timeout=TIMEOUT)
        assert (arrays.view(out, np.uint32, 64) == i).all()
    g = hcq.HCQGraph([hcq.ExecItem(fill, (out,), (v, 64), (4, 1, 1), (16, 1, 1))])
    g(var_vals={"v": 9}, wait=True)
    assert (arrays.view(out, np.uint32, 64) == 9).all()


def test_a_fault_is_sticky_until_recover_and_hangs_are_reported(direct_dev):
    fault = direct_dev.compile(direct_backend.toy.CONFORMANCE_KERNELS["fault"][0], "fault")
    buf = direct_dev.allocator.alloc(64)
    fault(buf)
    with pytest.raises(hcq.DeviceError, match="faults on purpose"):
        direct_dev.synchronize(timeout=TIMEOUT)
    direct_dev.recover()
    direct_dev.synchronize(timeout=TIMEOUT)
    gate, done = direct_dev.new_signal(value=0), direct_dev.new_signal(value=0)
    direct_dev.hw_compute_queue_t().wait(gate, 1).signal(done, 1).submit(direct_dev)
    with pytest.raises(hcq.HCQTimeoutError, match=rf"{direct_dev.device} compute is stuck: wait \[\d+, 1\]"):
        done.wait(1, timeout=200)
    gate.value = 1
    done.wait(1, timeout=TIMEOUT)


def test_poll_conditions_it_lacks_are_refused(direct_dev):
    q = direct_dev.hw_compute_queue_t().poll_bit(direct_dev.allocator.alloc(64), 1, cond=hcq.PollCondition.AND)
    with pytest.raises(ValueError, match="cannot poll with AND"):
        q.submit(direct_dev)


@pytest.mark.full
@pytest.mark.slow_on(kind="DIRECT")  # (the full run: the asynchronous variant, which takes the synchronous one's paths and more)
@pytest.mark.parametrize("kind", ["DIRECT", "DIRECTQ"])
def test_conformance_kit_passes_on_direct(tmp_path, kind: str):
    """DIRECT, and DIRECTQ: the same device made asynchronous (kernels and copies queued, signals stored by their
    completions)."""
    here = Path(__file__).resolve().parent
    code = (f"import sys; sys.path.insert(0, {str(here)!r}); import direct_backend; direct_backend.register(); "
            f"from hcq.conformance.__main__ import main; sys.exit(main([{kind!r}, '-q']))")
    env = {k: v for k, v in os.environ.items() if k not in ("PROFILE", "PROFILE_PATH", "PYTEST_ADDOPTS")}
    env["PYTHONPATH"] = str(here.parent) + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-6000:]
    assert " passed" in out and " failed" not in out, out[-3000:]


def test_stream_progress_counts_commands_and_a_bug_in_a_device_call_fails_the_device(direct_dev, monkeypatch):
    """Ring positions are commands (made / handed over), so a long submission moves while it runs; an exception a
    device call raises that is not a DeviceFault fails the device, named as a bug, and recover() clears it."""
    gate, step, done = (direct_dev.new_signal(value=0) for _ in range(3))
    q = direct_dev.hw_copy_queue_t(1).wait(gate, 1)
    for i in range(1, 51): q.signal(step, i)
    q.wait(gate, 2).signal(done, 1).submit(direct_dev)

    def copy1() -> dict:
        deadline = time.monotonic() + 5
        while True:  # (until the stream thread took its command up)
            (state,) = [st for st in direct_dev.queue_states() if st["queue"] == "copy1"]
            if state["current"] is not None or time.monotonic() > deadline: return state
            time.sleep(0.001)
    state = copy1()
    assert state["wptr"] - state["rptr"] == 54 and "wait" in str(state["current"]), state  # 53 commands and the fence
    gate.value = 1
    step.wait(50, timeout=TIMEOUT)
    time.sleep(0.01)  # (the stream counts the 50th signal just after storing it)
    state = copy1()
    assert state["wptr"] - state["rptr"] == 3, state  # blocked on the second wait: the 51 before it were made
    gate.value = 2
    done.wait(1, timeout=TIMEOUT)

    def broken(self, stream, addr, value, b64):
        raise ZeroDivisionError("the driver divided by zero")
    monkeypatch.setattr(direct_backend.DirectOps, "write", broken)
    after = direct_dev.new_signal(value=0)
    direct_dev.hw_compute_queue_t().write(direct_dev.allocator.alloc(64), 1).signal(after, 1).submit(direct_dev)
    after.wait(1, timeout=TIMEOUT, failed_ok=True)  # (a failed stream still stores signals, poisoned: nothing waits forever)
    with pytest.raises(hcq.DeviceError, match="write raised ZeroDivisionError: the driver divided by zero"):
        direct_dev.synchronize(timeout=TIMEOUT)
    monkeypatch.undo()
    direct_dev.recover()
    direct_dev.synchronize(timeout=TIMEOUT)


def test_an_asynchronous_stream_is_not_held_to_a_finish_per_signal(open_device, monkeypatch):
    """DIRECTQ queues kernels on its device and returns at once: 20 launches, each followed by a signal store, leave
    the stream thread free while the device has not finished (here: not started) one of them, and the stores come in
    order, each once its kernel finished. The device is held by a gate the test opens, not slowed by a delay, so
    no clock decides the order."""
    held, ran = threading.Event(), []

    def gated_exec(self, stream, prg, kernargs_addr, global_size, local_size):
        def run() -> None:
            held.wait(60)  # (hang guard only: the test opens the gate)
            ran.append(sig.value)  # what was stored when this kernel started
            direct_backend.DirectOps.exec(self, stream, prg, kernargs_addr, global_size, local_size)
        return self._enqueue(stream, run)
    monkeypatch.setattr(direct_backend.QueuedOps, "exec", gated_exec)
    dev = open_device("DIRECTQ")
    fill = dev.compile(direct_backend.toy.CONFORMANCE_KERNELS["fill"][0], "fill")
    out, sig = dev.allocator.alloc(64 * 4, hcq.BufferSpec(cpu_access=True)), dev.new_signal(value=0)
    q = dev.hw_compute_queue_t()
    for i in range(1, 21): q.exec(fill, fill.fill_kernargs((out,), vals=(i, 64)), (4, 1, 1), (16, 1, 1)).signal(sig, i)
    try:
        q.submit(dev)
        (stream,) = [r.handle for r in dev.rings["compute"]]
        deadline = time.monotonic() + 30  # (hang guard: a stream held to a finish per signal never gets there)
        while stream.done < stream.submitted and time.monotonic() < deadline: time.sleep(0.0005)
        assert stream.done == stream.submitted, f"the stream thread waited for the held device: {stream.done}/{stream.submitted}"
        assert sig.value == 0 and ran == [], "a signal was stored before its kernel ran"
    finally:
        held.set()
    seen = [sig.value]
    while seen[-1] < 20:
        if sig.value != seen[-1]: seen.append(sig.value)
        time.sleep(0.001)
    assert seen == sorted(seen) and (arrays.view(out, np.uint32, 64) == 20).all(), seen
    assert len(ran) == 20 and all(v <= i for i, v in enumerate(ran)), ran  # signal i+1 never stored before kernel i+1 ran
    dev.synchronize(timeout=TIMEOUT)


def test_a_backend_that_leaves_hooks_out_is_told_which(direct_dev):
    """hcq.backend.contract_problems (the kit's first check) names each hook the core would call and the backend did
    not implement, with the class it belongs to."""
    from hcq.backend import HCQCompiled, HWQueue, contract_problems

    class NoPoll(direct_backend.DirectComputeQueue):
        _poll_bit = HWQueue._poll_bit

    class Forgetful(direct_backend.DirectDevice):
        _ring_state = HCQCompiled._ring_state

        def __init__(self, device: str):
            super().__init__(device)
            self.hw_compute_queue_t = NoPoll
    assert contract_problems(direct_dev) == []
    with Forgetful("FORGETFUL:0") as forgetful:  # (not opened through the registry: closed here)
        assert contract_problems(forgetful) == ["NoPoll._poll_bit", "Forgetful._ring_state"]
