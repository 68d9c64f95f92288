"""hcq as a tinygrad device (hcq.tinygrad): kernels, JIT graphs, copies, transfers, disk loads, and a bounded run of
tinygrad's own test suite against DEV=HCQ."""
import contextlib
import os
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest

tinygrad = pytest.importorskip("tinygrad", reason="tinygrad is not installed (pip install 'hcq[tinygrad]')")
if shutil.which("clang") is None: pytest.skip("tinygrad's C renderer needs clang", allow_module_level=True)

import hcq  # noqa: E402
import hcq.tinygrad  # noqa: E402,F401  (registers device HCQ)
from hcq.tinygrad.device import HCQDevice, HCQTinyProgram, hcq_device_name, wrap_kernel  # noqa: E402
from hcq.tinygrad.graph import HCQTinyGraph  # noqa: E402
from tinygrad import Device, Tensor, TinyJit, Variable  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module", autouse=True)
def tinygrad_hcq_devices():
    """tinygrad keeps each device it opens (Device["HCQ"], Device["HCQ:1"]) for the rest of the process, and with it
    the hcq device it maps to (CPU:0, CPU:1): this module's tests share them. After the module they are closed and
    tinygrad's exit handler no longer finalizes them, so the tests after this module find no device open."""
    yield
    for name in sorted(n for n in Device._opened_devices if n.split(":")[0] == "HCQ"):
        Device[name].hdev.close()
        Device._opened_devices.discard(name)


def test_device_names_map_to_hcq_devices(monkeypatch):
    assert isinstance(Device["HCQ"], HCQDevice)
    assert Device["HCQ"].hdev is hcq.Device("CPU:0")  # index under test
    assert Device["HCQ:1"].hdev is hcq.Device("CPU:1")  # index under test
    monkeypatch.setenv("HCQ_TINYGRAD_DEVICES", "CPU:1,CPU:0")
    assert hcq_device_name("HCQ") == "CPU:1" and hcq_device_name("HCQ:1") == "CPU:0"
    with pytest.raises(RuntimeError, match="none for index 2"):
        hcq_device_name("HCQ:2")


@pytest.mark.full
def test_kernels_match_numpy():
    a, b = np.random.rand(33, 47).astype(np.float32), np.random.rand(47, 29).astype(np.float32)
    ta, tb = Tensor(a, device="HCQ"), Tensor(b, device="HCQ")
    np.testing.assert_allclose((ta @ tb).numpy(), a @ b, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose((ta.exp() * 2 - 1).sum(axis=1).numpy(), (np.exp(a) * 2 - 1).sum(axis=1), rtol=1e-4)
    np.testing.assert_array_equal((Tensor(np.arange(100, dtype=np.int32), device="HCQ") % 7).numpy(), np.arange(100) % 7)
    h = Tensor(a, device="HCQ").half()
    np.testing.assert_allclose((h * 2).float().numpy(), (a.astype(np.float16) * 2).astype(np.float32), rtol=1e-3)


def test_core_id_comes_from_the_hcq_grid():
    source = "void r_4(float* restrict data0_4, const int data1_) {\n  *(data0_4+data1_) = 1.0f;\n}\n"
    core_param = tinygrad.UOp.variable("core_id", 0, 3, param=True)
    buf_param = tinygrad.UOp.param(0, tinygrad.dtypes.float, (4,))
    wrapped = wrap_kernel(source, "r_4", [("data0_4", (buf_param, True)), ("data1_", (core_param, False))])
    assert "HCQ_KERNEL void r_4(float* restrict data0_4)" in wrapped
    assert "r_4_body(data0_4, (int)hcq_group_id(0));" in wrapped
    # a reduction big enough for tinygrad to split across threads runs as one hcq launch of several blocks
    launches = []
    real_call = hcq.HCQProgram.__call__

    def spy(self, *bufs, global_size=(1, 1, 1), **kw):
        launches.append(global_size)
        return real_call(self, *bufs, global_size=global_size, **kw)

    x = np.random.rand(512, 512).astype(np.float32)
    hcq.HCQProgram.__call__ = spy
    try:
        got = Tensor(x, device="HCQ").sum(axis=1).numpy()
    finally:
        hcq.HCQProgram.__call__ = real_call
    np.testing.assert_allclose(got, x.sum(axis=1), rtol=1e-4)
    assert any(gs[0] > 1 for gs in launches), launches


@contextlib.contextmanager
def graphs_built():
    """The HCQTinyGraphs tinygrad's JIT builds inside the block."""
    made = []
    real_init = HCQTinyGraph.__init__

    def spy(self, *a, **kw):
        real_init(self, *a, **kw)
        made.append(self)

    HCQTinyGraph.__init__ = spy
    try:
        yield made
    finally:
        HCQTinyGraph.__init__ = real_init


def capture_graph_runner(fn, *args):
    """Run a TinyJit function until it replays, returning the HCQTinyGraph it built."""
    with graphs_built() as made:
        for _ in range(3): fn(*args)
    assert made, "the JIT built no graph"
    return made[-1]


def test_jit_batches_replay_as_one_hcq_graph_with_new_inputs():
    @TinyJit
    def step(x, y):
        h = (x * 2 + y).relu().contiguous()
        return ((h @ y).contiguous().sum(0) + h.max()).realize()
    with graphs_built() as made:
        for _ in range(4):
            x, y = np.random.randn(16, 16).astype(np.float32), np.random.randn(16, 16).astype(np.float32)
            out = step(Tensor(x, device="HCQ"), Tensor(y, device="HCQ"))
            h = np.maximum(x * 2 + y, 0)
            np.testing.assert_allclose(out.numpy(), (h @ y).sum(0) + h.max(), rtol=1e-4, atol=1e-4)
    assert made and all(isinstance(g.graph, hcq.HCQGraph) for g in made)
    assert sum(len(g.graph.items) for g in made) >= 2


def test_jit_graph_patches_symbolic_variables():
    @TinyJit
    def f(a, n): return ((a[:n] * 3).contiguous() + 1).sum().realize()
    data = np.arange(20, dtype=np.float32)
    t = Tensor(data, device="HCQ").realize()
    with graphs_built() as made:
        for n in (3, 7, 12, 5, 20, 1):
            got = f(t, Variable("n", 1, 20).bind(n))
            assert got.item() == pytest.approx(float((data[:n] * 3 + 1).sum()))
    assert made and "n" in made[-1].graph.variables


def test_symbolic_launch_dims_become_graph_variables():
    """tinygrad's C renderer always knows its thread count, but a symbolic block count must still work: it turns
    into an hcq Variable that each run fills from tinygrad's updated_launch_dims."""
    import dataclasses
    rows = 512
    x = Tensor(np.random.rand(rows, 512).astype(np.float32) + 1, device="HCQ").realize()

    @TinyJit
    def f(a): return (a.sum(axis=1).contiguous() * 2).contiguous().realize()  # the sum is split over threads
    runner = capture_graph_runner(f, x)
    j, (_, ast, bufs, dv) = next((j, c) for j, c in enumerate(runner.calls) if c[1].op.name == "PROGRAM" and runner.runtimes[j].threaded)
    threads = ast.arg.global_size[0]
    assert isinstance(threads, int) and threads > 1
    symbolic = ast.replace(arg=dataclasses.replace(ast.arg, global_size=(Variable("nblocks", 1, threads), 1, 1)))
    item = runner._item(j, symbolic, bufs, dv, runner.runtimes[j])
    assert runner.dim_vars == {j: f"__tinygrad_blocks{j}"} and isinstance(item.global_size[0], hcq.Variable)
    graph = hcq.HCQGraph([item])
    out = bufs[ast.arg.outs[0]]
    for blocks in (1, threads):  # one block computes only its share of the rows
        Device["HCQ"].hdev.allocator.copyin(out._buf, memoryview(np.zeros(out.size, np.float32).tobytes()))
        graph(var_vals={runner.dim_vars[j]: blocks}, wait=True)
        got = np.frombuffer(out.as_memoryview(), np.float32)
        assert np.count_nonzero(got) == out.size * blocks // threads, (blocks, np.count_nonzero(got))
    # and __call__ passes the dims tinygrad computes for the run
    seen = {}
    runner.graph = type("G", (), {"variables": frozenset(), "__call__": lambda self, i, vv, wait=False: seen.update(vv)})()
    runner.updated_launch_dims = lambda var_vals: iter([(j, (3, 1, 1), (1, 1, 1))])
    runner((x.uop.base,), {})
    assert seen == {runner.dim_vars[j]: 3}


def test_copies_transfers_and_multi_device_jit():
    x = np.random.rand(1000).astype(np.float32)
    t0 = Tensor(x, device="HCQ").realize()
    t1 = t0.to("HCQ:1").realize()
    assert t1.device == "HCQ:1"
    np.testing.assert_array_equal(t1.numpy(), x)
    np.testing.assert_array_equal(Tensor(x, device="CPU").to("HCQ").numpy(), x)  # tinygrad's own CPU device <-> HCQ
    np.testing.assert_array_equal(t0.to("CPU").numpy(), x)

    @TinyJit
    def across(a, b): return ((a + 1).contiguous().to("HCQ:1") * 2 + b).realize()
    pairs = [(np.random.rand(64).astype(np.float32), np.random.rand(64).astype(np.float32)) for _ in range(5)]
    tensors = [(Tensor(a, device="HCQ").realize(), Tensor(b, device="HCQ:1").realize()) for a, b in pairs]
    runner = capture_graph_runner(across, *tensors[0])
    kinds = {type(it).__name__ for it in runner.graph.items}
    assert kinds == {"ExecItem", "CopyItem"} and {d.device for d in runner.graph.devices} == {"CPU:0", "CPU:1"}, kinds
    for (a, b), (ta, tb) in zip(pairs, tensors):  # one graph over both devices, the transfer inside it
        np.testing.assert_allclose(across(ta, tb).numpy(), (a + 1) * 2 + b, rtol=1e-6)


def test_sharded_tensor_across_hcq_devices():
    devs = ("HCQ", "HCQ:1")
    x = np.random.rand(8, 16).astype(np.float32)
    t = Tensor(x).shard(devs, axis=0).realize()
    np.testing.assert_allclose((t * 2).sum(axis=1).numpy(), (x * 2).sum(axis=1), rtol=1e-5)


def test_loads_from_disk_through_the_staging_ring(tmp_path, monkeypatch):
    data = np.random.rand(300_000).astype(np.float32)
    path = tmp_path / "weights.bin"
    path.write_bytes(data.tobytes())
    calls = []
    real = hcq.HCQAllocator.copy_from_disk
    monkeypatch.setattr(hcq.HCQAllocator, "copy_from_disk", lambda self, *a: (calls.append(a[-1]), real(self, *a))[1])
    disk = Tensor.empty(data.size, dtype=tinygrad.dtypes.float32, device=f"disk:{path}")
    np.testing.assert_array_equal(disk.to("HCQ").numpy(), data)
    assert calls == [data.nbytes]


def test_waited_launches_report_device_time(capsys):
    """tinygrad asks programs to wait (DEBUG>=2, BEAM timing) and reads back seconds from hcq's timestamps."""
    from tinygrad.helpers import Context, GlobalCounters
    GlobalCounters.reset()
    with Context(DEBUG=2):
        (Tensor.ones(4096, device="HCQ").contiguous() * 3).realize()
    assert GlobalCounters.time_sum_s > 0
    assert "HCQ" in capsys.readouterr().out


def test_a_zero_timeout_is_no_deadline_as_in_tinygrad():
    """BEAM times a candidate with timeout=int(3 x best so far in ms): 0 below 333 us, which tinygrad's HCQ devices
    read as their default wait. A 0 ms deadline would fail every candidate that is not done at the first look."""
    x = Tensor.ones(1 << 22, device="HCQ").contiguous().realize()
    dev, seen = Device["HCQ"], []
    real = HCQTinyProgram.__call__

    def call(self, *bufs, **kw):
        seen.append(kw.get("timeout"))
        return real(self, *bufs, **{**kw, "wait": True, "timeout": 0})
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(HCQTinyProgram, "__call__", call)
        for i in range(5): (x * (3 + i)).realize()  # 16 MiB each: well past the first look at the timeline
    dev.synchronize()
    assert len(seen) == 5
    np.testing.assert_array_equal((x * 3).numpy()[:4], [3, 3, 3, 3])


def test_compile_workers_get_the_devices_compiler_and_skip_the_lookups(monkeypatch, clear_find_compiler):
    """tinygrad pickles the renderer to its compile workers: it arrives with the device's compiler (its backend's class,
    so no registry scan per compile) and the C compiler the parent found (so no `cc --version` per worker)."""
    import pickle
    import hcq.tinygrad.device as tg_device
    from hcq import toolchain
    renderer = Device["HCQ"].renderer
    toolchain.find_compiler()
    shipped = pickle.dumps(renderer)
    toolchain.find_compiler.cache_clear()  # as in a new worker process
    monkeypatch.setattr(toolchain, "_adopted", {})
    monkeypatch.setattr(toolchain.subprocess, "run", lambda *a, **kw: pytest.fail(f"ran {a[0]}"))
    monkeypatch.setattr(tg_device, "precompile", lambda *a: pytest.fail("looked the backend up in the registry"))
    worker = pickle.loads(shipped)
    assert worker.compiler.device_class is type(Device["HCQ"].hdev) and worker.compiler.backend == Device["HCQ"].hdev.device
    src = tg_device.DIRECTIVES + f"HCQ_KERNEL void k_{os.getpid()}_w(float *o) {{ o[0] = 2.0f; }}\n"
    assert worker.compiler.compile(src) == src.encode()
    assert toolchain.find_compiler() == toolchain.found_compiler()[:2]


def test_recent_programs_are_reused(monkeypatch):
    """BEAM timing makes a new tinygrad program for every run of a candidate: the device reuses its recent loads."""
    import hcq.tinygrad.device as tg_device
    dev = Device["HCQ"]
    loads, real = [], dev.hdev.compile
    monkeypatch.setattr(dev.hdev, "compile", lambda src, name: loads.append(src) or real(src, name))
    monkeypatch.setattr(tg_device, "RECENT_PROGRAMS", 2)
    src = tg_device.DIRECTIVES + f"HCQ_KERNEL void k_{os.getpid()}_r(float *o) {{ o[0] = 1.0f; }}\n"
    name = f"k_{os.getpid()}_r"
    first = dev.load(src, name)
    assert dev.load(src, name) is first and len(loads) == 1
    for v in (2, 3): dev.load(src.replace("1.0f", f"{v}.0f"), name)
    assert len(dev.recent) == 2 and dev.load(src, name) is not first and len(loads) == 4  # the oldest went first


def test_kernel_fault_is_a_device_error_and_the_device_recovers():
    good = Tensor([1.0, 2.0, 3.0], device="HCQ").realize()
    bad = Tensor.from_blob(0x1000, (1024,), dtype=tinygrad.dtypes.float32, device="HCQ")  # unmapped memory
    with pytest.raises(hcq.DeviceError, match=r"kernel '\w+' faulted .*Segmentation fault at address 0x1000"):
        (bad + 1).realize()
        Device["HCQ"].synchronize()
    Device["HCQ"].hdev.recover()
    np.testing.assert_array_equal((good * 2).numpy(), [2, 4, 6])


def test_hcq_profiler_sees_tinygrad_kernels_and_graphs():
    @TinyJit
    def f(x): return ((x + 1).contiguous() * 2).contiguous().sum().realize()
    x = Tensor.ones(256, device="HCQ").contiguous().realize()
    for _ in range(3): f(x)
    with hcq.profile() as prof:
        (x * 3).realize()
        f(x)
        Device["HCQ"].synchronize()
    kernels = [e for e in prof.events if e.kind == "kernel"]
    assert any(e.name.startswith(("E_", "r_")) for e in kernels), [(e.kind, e.name) for e in prof.events]
    assert any("graph" in e.name for e in prof.events), [(e.kind, e.name) for e in prof.events]


def test_bfloat16_is_claimed_only_where_the_compiler_takes_it():
    """tinygrad's tests skip bfloat16 where the renderer does not list it: hcq lists it only if its compiler takes
    `__bf16` (clang 14 on x86 does not), and what it lists works."""
    from tinygrad import dtypes
    from hcq.tinygrad.device import DIRECTIVES
    claimed = dtypes.bfloat16 in Device["HCQ"].renderer.supported_dtypes()
    try:
        Device["HCQ"].hdev.compile(DIRECTIVES + "HCQ_KERNEL void bf(__bf16 *a, float *o) { o[0] = (float)a[0] * 2.0f; }", "bf")
        compiles = True
    except hcq.CompileError as e:
        compiles = False
        assert "__bf16" in str(e), e
    assert claimed == compiles
    if claimed:
        got = (Tensor([1.5, -2.0], dtype=dtypes.bfloat16, device="HCQ") * 2).float().numpy()
        np.testing.assert_array_equal(got, [3.0, -4.0])


def test_host_memory_is_read_and_filled_without_a_copy():
    """tinygrad asks an allocator with `_as_buffer` for the memory itself (as_memoryview(allow_zero_copy=True), and
    copies from other devices land in it directly): hcq's memory is the host's, so the view aliases the buffer."""
    t = Tensor(np.arange(16, dtype=np.float32), device="HCQ").realize()
    buf = t.uop.base.realized
    mv = buf.as_memoryview(force_zero_copy=True)
    assert mv.nbytes == 64 and np.frombuffer(mv, np.float32)[3] == 3.0
    np.frombuffer(mv, np.float32)[3] = 42.0  # the buffer itself
    assert (t + 0).numpy()[3] == 42.0
    src = Tensor(np.full(16, 7, np.float32), device="CPU").realize()
    assert (src.to("HCQ") + 1).numpy().tolist() == [8.0] * 16


VALIDATED_SCRIPT = """
import numpy as np, hcq.tinygrad
from tinygrad import Tensor, TinyJit, Variable
@TinyJit
def f(a, n): return ((a[:n] * 2).contiguous() + 1).sum().realize()
t = Tensor(np.arange(32, dtype=np.float32), device="HCQ").realize()
for n in (4, 9, 16, 31):
    assert f(t, Variable("n", 1, 32).bind(n)).item() == float((np.arange(n) * 2 + 1).sum())
print("validated ok")
"""


def test_tinygrad_runs_clean_under_hcq_validation():
    env = {**os.environ, "HCQ_VALIDATE": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-W", "error::hcq.validation.StaleReadWarning", "-c", VALIDATED_SCRIPT], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "validated ok" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]


def tinygrad_suite() -> pathlib.Path | None:
    """$HCQ_TINYGRAD_TESTS, else a `shared/tinygrad-tests` folder next to the checkout or any folder above it."""
    cands = [os.environ.get("HCQ_TINYGRAD_TESTS")] + [d / "shared" / "tinygrad-tests" for d in (ROOT, *ROOT.parents)]
    return next((pathlib.Path(c) for c in cands if c and (pathlib.Path(c) / "test" / "test_tiny.py").exists()), None)


BOUNDED_SUITE = ["test/test_tiny.py", "test/backend/test_jit.py", "test/backend/test_subbuffer.py", "test/backend/test_tensor_variable.py"]


@pytest.mark.full
def test_tinygrads_own_tests_pass_on_hcq(tmp_path):
    """A bounded part of tinygrad's own test suite (the full table is in BENCHMARKS.md), run as tinygrad's CI would."""
    suite = tinygrad_suite()
    if suite is None: pytest.skip("tinygrad's test tree not found (set HCQ_TINYGRAD_TESTS to the folder holding its test/)")
    work = tmp_path / "tinygrad-tests"
    shutil.copytree(suite, work, ignore=shutil.ignore_patterns("__pycache__"))  # the suite's folder may be read-only
    env = {**os.environ, "DEV": "HCQ", "PYTHONDONTWRITEBYTECODE": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "hcq.tinygrad", *BOUNDED_SUITE],
                          cwd=work, env=env, capture_output=True, text=True, timeout=900)
    tail = proc.stdout[-3000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, tail
    assert " passed" in proc.stdout.splitlines()[-1] and "failed" not in proc.stdout.splitlines()[-1], tail
