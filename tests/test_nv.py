"""The NV backend on the emulated GPU (HCQ_NV_EMULATE=1): the conformance kit with real sm_90 cubins and CPU twins,
kernels, copies both ways, graphs across NV and CPU with transfers, profiling on the host clock, GPU faults as device
errors, raw cubins, the driver version check, the fuzzer on NV and NV + CPU, and the first-GPU check."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import hcq
from hcq import CopyItem, ExecItem, HCQGraph, Variable
from hcq.backends.nv import abi
from hcq.backends.nv.compiler import NVCompiler
from hcq.backends.nv.qmd import Descriptor
from hcq.backends.nv.queues import SUBCH_COPY, method_words
from hcq.errors import DeviceError, HCQError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WHY_NOT = abi.unavailable_reason() or NVCompiler.unavailable_reason()
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=f"NV cannot be emulated here: {WHY_NOT}")
N = 4096
SAXPY = ("HCQ_KERNEL void saxpy(float *y, const float *x, float a, uint32_t n) {\n"
         "  int64_t i = hcq_global_id(0);\n  if (i < (int64_t)n) y[i] = a * x[i] + y[i];\n}\n")


def env(**extra):
    e = {k: v for k, v in os.environ.items() if k not in ("PROFILE", "PYTEST_ADDOPTS")}
    e["PYTHONPATH"] = REPO + os.pathsep + e.get("PYTHONPATH", "")
    return {**e, "HCQ_NV_EMULATE": "1", **extra}


@pytest.fixture
def nv(open_device, monkeypatch):
    """A fresh NV device on the emulated GPU."""
    monkeypatch.setenv("HCQ_NV_EMULATE", "1")
    return open_device("NV")


@pytest.fixture
def nv_kernels(nv):
    return {name: nv.compile(src, kname) for name, (src, kname) in type(nv).CONFORMANCE_KERNELS.items()}


def read(dev, buf, n=N, dtype=np.uint32):
    out = np.zeros(n, dtype)
    dev.allocator.copyout(out.data.cast("B"), buf)
    return out


def write(dev, buf, arr):
    dev.allocator.copyin(buf, np.ascontiguousarray(arr).data.cast("B"))


def test_saxpy_runs_as_its_cpu_twin_from_a_real_cubin(nv):
    prg = nv.compile(SAXPY, "saxpy")
    assert prg.cubin.arch == 90 and prg.kernel.param_base > 0  # (the parameters sit where the cubin says, after the driver's words)
    x, y = np.arange(N, dtype=np.float32), np.ones(N, dtype=np.float32)
    bx, by = nv.allocator.alloc(4 * N), nv.allocator.alloc(4 * N)
    assert by.view is None  # device memory: the host reaches it only through copies
    write(nv, bx, x)
    write(nv, by, y)
    t = prg(by, bx, global_size=(N // 128,), local_size=(128,), vals=(2.0, N), wait=True)
    assert t is not None and t >= 0
    assert np.array_equal(read(nv, by, dtype=np.float32), 2 * x + 1)


def test_copies_both_ways_and_between_buffers(nv):
    data = np.random.default_rng(1).integers(0, 2**32, N, dtype=np.uint32)
    a, b = nv.allocator.alloc(4 * N), nv.allocator.alloc(4 * N)
    write(nv, a, data)
    nv.hw_copy_queue_t().wait(nv.timeline_signal, nv.timeline_value - 1).copy(b, a, 4 * N) \
      .signal(nv.timeline_signal, nv.next_timeline()).submit(nv)
    assert np.array_equal(read(nv, b), data)


def test_a_graph_across_nv_and_cpu_replays_with_a_variable(nv, nv_kernels, dev):
    """NV fill -> copy to CPU -> CPU add -> copy back -> NV add, replayed with new values."""
    cpu = dev
    cfill, cadd = (cpu.compile(*type(nv).CONFORMANCE_KERNELS[k]) for k in ("fill", "add"))
    a, b = nv.allocator.alloc(4 * N), nv.allocator.alloc(4 * N)
    c, d = cpu.allocator.alloc(4 * N), cpu.allocator.alloc(4 * N)
    v = Variable("v", 0, 1000)
    items = [ExecItem(nv_kernels["fill"], (a,), (v, N), (N // 64,), (64,)), CopyItem(c, a, 4 * N), ExecItem(cfill, (d,), (4, N), (N // 64,), (64,)),
             ExecItem(cadd, (d, c, d), (N,), (N // 64,), (64,)), CopyItem(b, d, 4 * N), ExecItem(nv_kernels["add"], (b, b, a), (N,), (N // 64,), (64,))]
    g = HCQGraph(items)
    for value in (3, 7, 100):
        g(var_vals={"v": value})
        nv.synchronize()
        assert (read(nv, b) == 2 * value + 4).all(), value


def test_profiled_kernels_are_on_the_host_clock(nv, nv_kernels):
    """The GPU's timer runs far from the host's (the emulator offsets it); calibration puts NV events where they ran."""
    out = nv.allocator.alloc(4 * N)
    import time
    t0 = time.perf_counter() * 1e6
    with hcq.profile() as p:
        for _ in range(3): nv_kernels["fill"](out, global_size=(N // 64,), local_size=(64,), vals=(1, N))
        nv.synchronize()
    t1 = time.perf_counter() * 1e6
    kernels = [e for e in p.events if e.kind == "kernel" and e.device == nv.device]
    assert len(kernels) == 3
    assert all(t0 - 1000 <= e.start_us <= e.end_us <= t1 + 1000 for e in kernels), (t0, t1, kernels)
    assert kernels[0].end_us <= kernels[1].start_us + 1 and kernels[1].end_us <= kernels[2].start_us + 1  # one queue: in order


def test_a_gpu_fault_is_a_device_error_naming_the_address(nv):
    q = nv.hw_compute_queue_t().wait(nv.timeline_signal, nv.timeline_value - 1)
    q.write(0xDEAD0000, 1)
    with pytest.raises(DeviceError, match=r"(?s)GPU write fault at 0xdead0000.*no memory is mapped there"):
        q.signal(nv.timeline_signal, nv.next_timeline()).submit(nv)
        nv.synchronize(timeout=10_000)


def test_a_raw_cubin_loads_with_its_parameters_from_the_cubin_and_needs_a_gpu_to_run(nv):
    """A cubin hcq did not compile (here: one whose bytes the compiler never returned) has no source: its parameters are
    plain words of the sizes the cubin gives, and the emulated GPU, which runs kernels as CPU twins of their source,
    faults on its launch saying so."""
    unique = SAXPY.replace("a * x[i]", f"a * x[i] * {os.getpid()}.0f")  # (code no program of this process loaded: no twin)
    raw = NVCompiler("sm_90").compile(unique) + b"\0" * 8  # (bytes past the ELF's sections: the same kernel, bytes hcq never returned)
    prg = nv.load_cubin(raw, "saxpy")
    assert [(s.name, s.fmt, s.is_pointer) for s in prg.arg_slots] == [("param0", "Q", False), ("param1", "Q", False), ("param2", "I", False),
                                                                      ("param3", "I", False)]
    y = nv.allocator.alloc(4 * N)
    with pytest.raises(DeviceError, match="no CPU twin"):
        prg(global_size=(1,), local_size=(1,), vals=(y.va_addr, y.va_addr, 0, 1), wait=True)


def test_method_headers_and_qmd_fields_follow_the_headers():
    h = abi.headers()
    header, data = method_words(h, SUBCH_COPY, h.NVC6B5_LAUNCH_DMA, 7)
    assert abi.get_field(h, "NVC56F_DMA", "sec_op", header) == h.NVC56F_DMA_SEC_OP_INC_METHOD
    assert abi.get_field(h, "NVC56F_DMA", "method_subchannel", header) == SUBCH_COPY
    assert abi.get_field(h, "NVC56F_DMA", "method_address", header) << 2 == h.NVC6B5_LAUNCH_DMA and data == 7
    q = Descriptor(h, "NVC6C0_QMDV03_00")
    q.set("cta_raster_width", 0x12345678).set("cta_thread_dimension2", 64).set_address("constant_buffer_addr_lower", "constant_buffer_addr_upper",
                                                                                   0x12_3456_7800, index=0)
    assert q.get("cta_raster_width") == 0x12345678 and q.get("cta_thread_dimension2") == 64
    assert q.get("constant_buffer_addr_upper", index=0) == 0x12 and q.get("constant_buffer_addr_lower", index=0) == 0x3456_7800
    with pytest.raises(ValueError, match="does not fit its 16 bits"): q.set("cta_raster_height", 1 << 16)


def test_an_unknown_driver_branch_is_refused_by_name():
    with pytest.raises(abi.NVDriverError, match=r"driver 590\.48\.01 is not supported: hcq knows the interface of driver branches 570, 575, 580, 610"):
        abi.headers("590.48.01")
    with pytest.raises(abi.NVDriverError, match="cannot read"): abi.branch_of("banana")
    assert abi.headers("580.95.05").HOPPER_COMPUTE_A == 0xCBC0


def test_without_a_driver_nv_is_absent_with_the_reason(monkeypatch):
    monkeypatch.delenv("HCQ_NV_EMULATE", raising=False)
    if os.path.exists("/dev/nvidiactl"): pytest.skip("this machine has an NVIDIA driver")
    why = hcq.registry.unavailable_backends().get("NV")
    assert why is not None and "/dev/nvidiactl" in why and "HCQ_NV_EMULATE=1" in why


def test_bad_launches_are_refused_before_the_gpu_sees_them(nv, nv_kernels):
    out = nv.allocator.alloc(4 * N)
    with pytest.raises(ValueError, match=r"local_size dimensions must be in \[1, 1024\] on NV:\d+; local_size\[0\] is 2048"):
        nv_kernels["fill"](out, global_size=(1,), local_size=(2048,), vals=(1, N))
    with pytest.raises(ValueError, match=r"local_size \(64, 32, 1\) has 2048 threads; a block holds at most 1024"):
        nv_kernels["fill"](out, global_size=(1,), local_size=(64, 32), vals=(1, N))
    with pytest.raises(ValueError, match=r"global_size dimensions must be in \[1, 65535\] on NV:\d+; global_size\[1\] is 70000"):
        nv_kernels["fill"](out, global_size=(1, 70000), local_size=(1,), vals=(1, N))
    with pytest.raises(HCQError, match="has 2 copy queue"):
        nv.hw_copy_queue_t(2).signal(nv.timeline_signal, 1).submit(nv)


@pytest.mark.full
@pytest.mark.slow_on(devices="NV")  # (the full run: NV and CPU devices together, which NV alone adds little to)
@pytest.mark.parametrize("devices", ["NV", "NV,CPU"])
def test_the_fuzzer_passes_on_nv(devices):
    args = ["--device", devices, "--programs", "150", "--seed", "11"] + (["--devices", "2"] if devices == "NV" else [])
    r = subprocess.run([sys.executable, "-m", "tools.fuzz", *args], env=env(), cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and " 0 failure(s)" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]


@pytest.mark.full
def test_the_first_gpu_check_and_the_conformance_kit_pass_on_the_emulator(tmp_path):
    """The first-GPU check, which runs `python -m hcq.conformance NV` (real sm_90 cubins, kernels as CPU twins): every
    skip names a capability NV declares absent (recover, queue states, host-visible memory, masked polls), a second
    device of the same peer group. The kit's serving check serves the emulated GPU (hcq serve --devices NV:0) and runs
    the conformance kernels through it."""
    r = subprocess.run([sys.executable, "-m", "hcq.bench.gpu_check", "--out", str(tmp_path), "--budget", "240"], env=env(), cwd=REPO,
                       capture_output=True, text=True, timeout=400)
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert r.returncode == 0 and report["failed"] == [], r.stdout + r.stderr
    kit = report["steps"]["conformance"]["result"]
    assert kit["returncode"] == 0 and " passed" in kit["summary"] and " failed" not in kit["summary"], kit
    skips = [ln for ln in kit["tail"] if ln.startswith("SKIPPED")]
    assert skips and all("capability" in ln or "peer group" in ln for ln in skips), skips
    assert report["steps"]["driver"]["result"]["emulated"] is True
    assert report["steps"]["open"]["result"]["driver_version"] == abi.EMULATED_DRIVER_VERSION
    assert report["steps"]["saxpy"]["result"]["correct"] is True
    assert report["steps"]["bench"]["result"]["round_trip_us"]["p50"] > 0
