"""What a new user tripped on (one test per item): launch dims as an int, copies past the end of a buffer given by
address, errors that say what to do next, `hcq info | head`, and the rest in their own files (profiling of
hand-built queues in test_profiler.py, hcq bench in test_cli.py, the API reference in test_apidoc.py)."""
import subprocess
import sys

import numpy as np
import pytest

import hcq
from hcq import arrays
from helpers import alloc

SRC = """
HCQ_KERNEL void ones(int *o, int n) { long i = hcq_global_id(0); if (i < n) o[i] = 1; }
HCQ_KERNEL void spin(const volatile unsigned long *flag) { while (!*flag) {} }
HCQ_KERNEL void bad(int *o) { *(volatile int *)16 = o[0]; }
"""
TIMEOUT = 10_000


@pytest.fixture
def newcomer_prgs(dev):
    return {name: dev.compile(SRC, name) for name in ("ones", "spin", "bad")}


def test_launch_dims_may_be_ints(dev, newcomer_prgs):
    out = alloc(dev, 1024 * 4)
    newcomer_prgs["ones"](out, vals=(1024,), global_size=256, local_size=4, wait=True)
    assert arrays.view(out, np.int32, 1024).sum() == 1024
    q = dev.hw_compute_queue_t().exec(newcomer_prgs["ones"], newcomer_prgs["ones"].fill_kernargs((out,), vals=(1024,)), 16, 64)
    q.signal(sig := dev.new_signal(), 1).submit(dev)
    sig.wait(1, timeout=TIMEOUT)
    g = hcq.HCQGraph([hcq.ExecItem(newcomer_prgs["ones"], (out,), (1024,), 8, 128)])
    g(wait=True)
    with pytest.raises(ValueError, match=r"an int or a tuple of 1 to 3 dimensions, e.g. 256 or \(256, 1, 1\); got 'x'"):
        newcomer_prgs["ones"](out, vals=(1024,), global_size="x")


def test_a_copy_given_addresses_that_runs_past_its_buffer_is_refused(dev, no_validation):  # the normal path (validation refuses it too)
    a, b = alloc(dev, 4096), alloc(dev, 4096)
    q = dev.hw_copy_queue_t().copy(a.va_addr + 100, b.va_addr, 4096)
    with pytest.raises(ValueError, match="destination .* is 100 bytes into .* runs 100 bytes past the end"):
        q.submit(dev)
    with pytest.raises(ValueError, match="source .* runs 8 bytes past the end"):
        dev.hw_copy_queue_t().copy(a.va_addr, b.va_addr + 8, 4096).submit(dev)
    with pytest.raises(ValueError, match="overruns"):  # buffers given as such: refused when the command is built
        dev.hw_copy_queue_t().copy(a, b.offset(8), 4096)
    done = dev.new_signal()
    dev.hw_copy_queue_t().copy(a.va_addr + 96, b.va_addr, 4000).signal(done, 1).submit(dev)  # inside: fine
    done.wait(1, timeout=TIMEOUT)


def test_a_device_failure_says_how_to_clear_it(dev):
    bad = dev.compile(SRC, "bad")
    bad(alloc(dev, 64))
    with pytest.raises(hcq.DeviceError, match=r"kernel 'bad' faulted .*The failure is sticky: dev.recover\(\) clears it"):
        dev.synchronize(timeout=TIMEOUT)
    dev.recover()


def test_a_timeout_stuck_on_a_kernel_names_it(dev, newcomer_prgs):
    flag = alloc(dev, 8)
    newcomer_prgs["spin"](flag)
    try:
        with pytest.raises(hcq.HCQTimeoutError, match=r"compute is stuck at ring word \d+: EXEC of kernel 'spin'"):
            dev.synchronize(timeout=200)
    finally:
        arrays.view(flag, np.uint64, 1)[0] = 1
        dev.synchronize(timeout=TIMEOUT)


def test_unknown_names_in_a_graphs_var_vals_are_refused(dev, newcomer_prgs):
    out = alloc(dev, 1024 * 4)
    n = hcq.Variable("n", 1, 1024)
    g = hcq.HCQGraph([hcq.ExecItem(newcomer_prgs["ones"], (out,), (n,), 8, 128)])
    assert g.variables == {"n"}
    with pytest.raises(ValueError, match=r"var_vals names 'm', which this graph does not use; it takes 'n'"):
        g(var_vals={"n": 4, "m": 1})
    with pytest.raises(hcq.UnboundVariableError, match="'n'"):
        g(var_vals={})
    g(var_vals={"n": 4}, wait=True)
    assert arrays.view(out, np.int32, 1024)[:4].tolist() == [1, 1, 1, 1]


@pytest.mark.parametrize("reader", ["head -1", "true"])  # true: the pipe is closed before hcq writes anything
def test_hcq_info_into_a_closed_pipe_ends_quietly(reader):
    r = subprocess.run(f"{sys.executable} -m hcq info CPU:0 CPU:1 CPU:2 --queues | {reader}; echo \"rc=${{PIPESTATUS[0]}}\"",
                       shell=True, executable="/bin/bash", capture_output=True, text=True, timeout=120)
    assert "Traceback" not in r.stderr and "BrokenPipe" not in r.stderr and r.stdout.rstrip().endswith("rc=0"), (r.stdout, r.stderr)


def test_validation_warns_when_the_host_reads_what_unfinished_work_writes(dev, newcomer_prgs, validating):
    """Reading `cpu_view()` before the work that writes the buffer finished gives stale data: validation mode says so
    (and says nothing once the work is done, or for buffers the work only reads)."""
    import warnings

    from hcq.validation import StaleReadWarning
    flag, out, idle = alloc(dev, 8), alloc(dev, 1024 * 4), alloc(dev, 64)
    gate = dev.new_signal(value=0)
    q = dev.hw_compute_queue_t().wait(gate, 1).exec(newcomer_prgs["ones"], newcomer_prgs["ones"].fill_kernargs((out,), vals=(1024,)), 8, 128)
    q.signal(dev.timeline_signal, dev.next_timeline()).submit(dev)
    cq = dev.hw_copy_queue_t().wait(gate, 1).copy(idle.va_addr, flag.va_addr, 8)  # writes `idle`, reads `flag`
    cq.signal(done := dev.new_signal(), 1).submit(dev)
    try:
        with pytest.warns(StaleReadWarning, match=r"read by the host while submitted work that writes it \(exec of"):
            out.cpu_view()
        with pytest.warns(StaleReadWarning, match=r"\(copy of"):
            arrays.view(idle, np.uint8, 64)
        with warnings.catch_warnings():
            warnings.simplefilter("error", StaleReadWarning)
            flag.cpu_view()  # only read by the pending copy
    finally:
        gate.value = 1
    dev.synchronize(timeout=TIMEOUT)
    done.wait(1, timeout=TIMEOUT)
    with warnings.catch_warnings():
        warnings.simplefilter("error", StaleReadWarning)
        assert arrays.view(out, np.int32, 1024).sum() == 1024
        idle.cpu_view()
