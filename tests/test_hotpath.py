"""The optional CPython extension of the launch hot path (hcq._hotpath) and its ctypes fallback (HCQ_HOTPATH=0):
it is built wherever Python's headers are, both paths run the same work, and bad arguments are refused."""
import os
import pathlib
import subprocess
import sys
import sysconfig

import pytest

import hcq
from hcq import hotpath
from helpers import use_kernargs_ring

ROOT = pathlib.Path(__file__).resolve().parent.parent
HEADERS = pathlib.Path(sysconfig.get_paths()["include"]) / "Python.h"

WORK = """
import numpy as np, hcq
from hcq import ExecItem, HCQGraph, Variable, hotpath
dev = hcq.Device("CPU:0")
prg = dev.compile("HCQ_KERNEL void add(int *a, int v) { a[hcq_global_id(0)] += v; }", "add")
buf = dev.allocator.alloc(4 * 64)
dev.allocator.copyin(buf, memoryview(np.zeros(64, np.int32).tobytes()))
for i in range(200): prg(buf, global_size=64, vals=(1,))
g = HCQGraph([ExecItem(prg, (buf,), (Variable("v", 0, 100),), 64)])
for v in range(1, 6): g(var_vals={"v": v})
out = np.zeros(64, np.int32)
dev.allocator.copyout(memoryview(out), buf)
assert (out == 200 + 15).all(), out
print("hotpath", hotpath.available(), type(dev.executor.submit_function()).__name__)
"""


@pytest.mark.skipif(not HEADERS.exists(), reason="Python's headers are not installed: the extension cannot be built here")
def test_the_extension_is_built_where_python_headers_exist():
    import hcq._hotpath  # noqa: F401  (the package's build step built it)
    assert hotpath.available() or os.environ.get("HCQ_HOTPATH") == "0", hotpath.why_not


@pytest.mark.parametrize("flag", ["1", "0"])
def test_both_paths_run_the_same_work(flag):
    env = {**os.environ, "HCQ_HOTPATH": flag, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", WORK], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = proc.stdout.strip().splitlines()[-1]
    if flag == "0":
        assert line == "hotpath False _FuncPtr", line  # ctypes
    elif hotpath.available():
        assert line == "hotpath True builtin_function_or_method", line


@pytest.mark.skipif(not hotpath.available(), reason=f"extension not in use: {hotpath.why_not}")
def test_submitter_refuses_bad_arguments():
    import ctypes
    from hcq.backends.cpu.native import engine
    submit = hotpath.native_submitter(ctypes.cast(engine().hcq_queue_submit, ctypes.c_void_p).value)
    with pytest.raises(TypeError, match="takes 4 arguments, got 2"):
        submit(1, 2)
    with pytest.raises(ValueError, match="non-zero"):
        submit(0, 0, 1, 0)
    with pytest.raises(TypeError):
        submit("ring", 1, 1, 0)
    with pytest.raises(ValueError, match="address is 0"):
        hotpath.native_submitter(0)
    wait = hotpath.native_waiter(ctypes.cast(engine().hcq_wait_ge, ctypes.c_void_p).value)
    with pytest.raises(TypeError, match="takes 3 arguments, got 1"):
        wait(1)
    with pytest.raises(ValueError, match="non-zero"):
        wait(0, 1, 0)
    with pytest.raises(OverflowError):
        wait(8, -1, 0)
    with pytest.raises(ValueError, match="address is 0"):
        hotpath.native_waiter(0)
    word = (ctypes.c_uint64 * 1)(5)
    assert wait(ctypes.addressof(word), 5, 0) == 0 and wait(ctypes.addressof(word), 6, 1000) == 1  # reached; timed out


def test_the_extensions_objects_refuse_to_run_before_they_are_made():
    """An object of the extension's types whose __init__ never ran (or failed) raises TypeError when used, instead of
    following null pointers (GraphRun and HostCopier crashed the process before); a bad take raises too."""
    if not hotpath.available(): pytest.skip(f"extension not in use: {hotpath.why_not}")
    ext = hotpath._ext
    calls = [(ext.GraphRun, (None, None)), (ext.Resubmit, (None, None, None)), (ext.HostCopier, (None, None))]
    for cls, args in calls:
        with pytest.raises(TypeError):
            cls.__new__(cls)(*args)
    run = ext.GraphRun.__new__(ext.GraphRun)
    with pytest.raises(TypeError):
        run.__init__(1)
    with pytest.raises(TypeError, match="not made"):
        run(None, None)
    with pytest.raises(ValueError, match="null array address"):
        ext.timeline_ring_take(0, 0, 0, 0, 0, 0, 0, 0, 0, 0)
    with pytest.raises(TypeError, match="takes 10 arguments"):
        ext.timeline_ring_take(1, 2)


def test_device_submits_through_the_extension_when_it_is_there(dev):
    hot = dev.executor.submit_function()
    assert hot is dev.executor.submit_function()  # made once
    assert (type(hot).__name__ == "builtin_function_or_method") == hotpath.available()


def test_a_failed_extension_build_does_not_fail_the_install(tmp_path):
    """optional=True: with a compiler that fails, the build step warns and goes on (hcq then uses ctypes)."""
    env = {**os.environ, "CC": "false", "LDSHARED": "false"}
    proc = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--build-lib", str(tmp_path / "lib"), "--build-temp",
                           str(tmp_path / "tmp")], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert not list(tmp_path.rglob("_hotpath*.so"))
    assert "_hotpath" in proc.stdout + proc.stderr  # it says which extension it skipped


# ---------------------------------------------------------------- the native launch path (and its Python twin)
# These run in-process with whichever path this interpreter has; test_the_launch_tests_pass_without_the_extension
# runs them again with HCQ_HOTPATH=0 (launches then go through Python and ctypes).
import signal
import threading
import time

import numpy as np

from hcq import BufferSpec, Variable, interrupts, profiler

SPEC = BufferSpec(cpu_access=True, nolru=True)
COUNT = "HCQ_KERNEL void count(int *a, int v) { a[hcq_global_id(0)] += v; }"
ALL_KINDS = """
HCQ_KERNEL void kinds(int8_t b, double *out, uint8_t B, int16_t h, int64_t *o2, uint16_t H, int i, float f,
                      unsigned I, _Bool t, long long q, uint64_t Q, double d, const float *in) {
  o2[0] = b; o2[1] = B; o2[2] = h; o2[3] = H; o2[4] = i; o2[5] = I; o2[6] = t; o2[7] = q; o2[8] = (int64_t)Q;
  out[0] = f; out[1] = d; out[2] = in[0];
}
"""
KIND_VALS = (-128, 255, -32768, 65535, -(1 << 31), 0.25, (1 << 32) - 1, 7, -(1 << 63), (1 << 64) - 1, 3, )


def ints(buf, n=None):
    arr = np.frombuffer(buf.cpu_view().mv, np.int32)
    return arr.copy() if n is None else arr[:n].copy()


def test_plain_launches_take_the_native_path(dev, python_launches):
    prg = dev.compile(COUNT, "count")
    buf = dev.allocator.alloc(4 * 64, SPEC)
    buf.cpu_view()[:] = bytes(buf.size)
    prg(buf, global_size=64, vals=(1,))  # may go through Python once (lists the device busy)
    python_launches.clear()
    for i in range(3000): prg(buf, global_size=(64, 1, 1), local_size=(1, 1, 1), vals=(i % 7,))
    dev.synchronize()
    assert (ints(buf) == 1 + sum(i % 7 for i in range(3000))).all()
    assert len(python_launches) == (0 if hotpath.available() else 3000)
    dev.allocator.free(buf, buf.size, SPEC)


def test_every_parameter_kind_arrives_the_same_on_both_paths(dev, python_launches):
    prg = dev.compile(ALL_KINDS, "kinds")
    got = []
    for how in ("call", "launch", "call-int-for-double"):
        out, o2, inp = (dev.allocator.alloc(n, SPEC) for n in (64, 128, 8))
        for b in (out, o2): b.cpu_view()[:] = bytes(b.size)
        inp.cpu_view().view(fmt="f")[0] = 2.5
        vals = KIND_VALS[:-1] + ((3 if how == "call-int-for-double" else 1 / 3),)
        python_launches.clear()
        if how == "launch": prg.launch(out, o2, inp, vals=vals)
        else: prg(out, o2, inp, vals=vals)
        dev.synchronize()
        if how != "launch" and hotpath.available(): assert python_launches == [], how
        got.append((np.frombuffer(out.cpu_view().mv, np.float64)[:3].tolist(), np.frombuffer(o2.cpu_view().mv, np.int64)[:9].tolist()))
        for b in (out, o2, inp): dev.allocator.free(b, b.size, SPEC)
    assert got[0] == got[1]
    assert got[0][0] == [0.25, 1 / 3, 2.5] and got[2][0] == [0.25, 3.0, 2.5]
    assert got[0][1] == [-128, 255, -32768, 65535, -(1 << 31), (1 << 32) - 1, 1, -(1 << 63), -1]


@pytest.mark.parametrize("case,error,match", [
    ("bool value", TypeError, r"parameter 'v' \(int\) needs an int or Variable, got True"),
    ("value out of range", ValueError, r"'v' \(int\) = 2147483648 is outside"),
    ("float for an int", TypeError, r"needs an int or Variable, got 1.5"),
    ("too few values", ValueError, r"takes 1 buffer\(s\) and 1 value\(s\), got 1 buffer\(s\) and 0 value\(s\)"),
    ("too many buffers", ValueError, r"got 2 buffer\(s\)"),
    ("not a buffer", TypeError, r"parameter 'a' needs an HCQBuffer, got bytearray"),
    ("freed buffer", ValueError, r"parameter 'a' got a freed buffer"),
    ("zero grid", ValueError, r"global_size dimensions must be in \[1, "),
    ("grid of four dims", ValueError, r"global_size must be an int or a tuple of 1 to 3 dimensions"),
    ("unknown keyword", TypeError, r"unexpected keyword argument 'global'"),
])
def test_what_the_native_path_declines_gets_the_checked_paths_error(dev, case, error, match):
    prg = dev.compile(COUNT, "count")
    buf, spare = dev.allocator.alloc(4 * 64, SPEC), dev.allocator.alloc(64, SPEC)
    buf.cpu_view()[:] = bytes(buf.size)
    prg(buf, vals=(1,))  # the template is loaded: what follows is the native path's decision
    dev.allocator.free(spare, 64, SPEC)
    calls = {"bool value": lambda: prg(buf, vals=(True,)), "value out of range": lambda: prg(buf, vals=(1 << 31,)),
             "float for an int": lambda: prg(buf, vals=(1.5,)), "too few values": lambda: prg(buf),
             "too many buffers": lambda: prg(buf, buf, vals=(1,)), "not a buffer": lambda: prg(bytearray(8), vals=(1,)),
             "freed buffer": lambda: prg(spare, vals=(1,)), "zero grid": lambda: prg(buf, global_size=(0, 1, 1), vals=(1,)),
             "grid of four dims": lambda: prg(buf, global_size=(1, 1, 1, 1), vals=(1,)),
             "unknown keyword": lambda: prg(buf, vals=(1,), **{"global": 4})}
    tv = dev.timeline_value
    with pytest.raises(error, match=match):
        calls[case]()
    assert dev.timeline_value == tv  # nothing was submitted
    prg(buf, vals=(2,))
    dev.synchronize()
    assert ints(buf, 1)[0] == 3  # and the program still launches
    dev.allocator.free(buf, buf.size, SPEC)


@pytest.mark.parametrize("nscalars,nptrs", [(63, 1), (64, 1), (65, 1), (100, 1), (200, 1), (3, 70), (120, 80)])
def test_kernels_with_many_parameters_launch_on_every_path(dev, nscalars, nptrs, python_launches):
    """More parameters (or kernargs bytes) than the native launcher holds: a plain call falls back to the checked path
    instead of refusing what `wait=True` and `launch` run."""
    params = ", ".join([f"long *p{i}" for i in range(nptrs)] + [f"int a{i}" for i in range(nscalars)])
    body = " + ".join(f"a{i}" for i in range(nscalars))
    writes = " ".join(f"p{i}[0] = s + {i};" for i in range(nptrs))
    prg = dev.compile(f"HCQ_KERNEL void many(int {params[5:]}) {{ long s = {body}; {writes} }}".replace("int long", "long"), "many")
    bufs = [dev.allocator.alloc(8, SPEC) for _ in range(nptrs)]
    for how in ("call", "wait", "launch"):
        vals = tuple(range(1, nscalars + 1)) if how != "wait" else tuple(range(2, nscalars + 2))
        for b in bufs: b.cpu_view()[:] = bytes(8)
        {"call": lambda: prg(*bufs, vals=vals), "wait": lambda: prg(*bufs, vals=vals, wait=True),
         "launch": lambda: prg.launch(*bufs, vals=vals)}[how]()
        dev.synchronize()
        got = [int(np.frombuffer(b.cpu_view().mv, np.int64)[0]) for b in bufs]
        assert got == [sum(vals) + i for i in range(nptrs)], how
    for b in bufs: dev.allocator.free(b, 8, SPEC)


class RaisingIndex:
    """An object that claims to be an integer and fails when asked for its value."""
    def __index__(self): raise RuntimeError("no index")
    def __repr__(self): return "RaisingIndex()"


ODD = {"True": True, "False": False, "np.True_": np.bool_(True), "np.int64(4)": np.int64(4), "np.uint8(2)": np.uint8(2),
       "2**70": 2**70, "2**1030": 2**1030, "-1": -1, "0": 0, "RaisingIndex": RaisingIndex(), "4.0": 4.0, "np.float32(1.5)": np.float32(1.5),
       "1e300": 1e300, "'4'": "4", "None": None}
ODD_KERNEL = """HCQ_KERNEL void odd(long *out, int v, unsigned u, float f) {
  if (hcq_global_id(0) == 0) { out[0] = v; out[1] = u; out[2] = (long)(f * 4); }
  __atomic_fetch_add(&out[3], 1, __ATOMIC_RELAXED);
}"""


def odd_input_outcomes(dev) -> dict[str, str]:
    """Every odd input as a launch dim (in each position, and as a bare int) and as each kind of value, through a plain
    call, `launch` and `wait=True`: what came of it (the kernel's view of the launch, or the exception)."""
    prg = dev.compile(ODD_KERNEL, "odd")
    buf = dev.allocator.alloc(32, SPEC)
    out = {}

    def outcome(call) -> str:
        buf.cpu_view()[:] = bytes(32)
        tv = dev.timeline_value
        try:
            call()
            dev.synchronize()
            return f"ran {np.frombuffer(buf.cpu_view().mv, np.int64).tolist()}"
        except Exception as e:  # noqa: BLE001 - the outcome is what is compared
            return f"{type(e).__name__}: {e}" + (" (something was submitted)" if dev.timeline_value != tv else "")

    for how in ("call", "launch", "wait"):
        def run(*a, **kw):
            if how == "wait": kw["wait"] = True
            return (prg.launch if how == "launch" else prg)(*a, **kw)
        run(buf, global_size=(2, 1, 1), vals=(1, 2, 0.5))  # a template with these dims: odd dims that compare equal must not slip through
        dev.synchronize()
        for name, d in ODD.items():
            for where, gs, ls in (("gs[0]", (d, 1, 1), (1, 1, 1)), ("gs[1]", (2, d, 1), (1, 1, 1)), ("ls[0]", (2, 1, 1), (d, 1, 1)), ("gs", d, 1)):
                out[f"{how} {where}={name}"] = outcome(lambda: run(buf, global_size=gs, local_size=ls, vals=(1, 2, 0.5)))
            for slot in range(3):
                vals = [1, 2, 0.5]
                vals[slot] = d
                out[f"{how} val{slot}={name}"] = outcome(lambda: run(buf, global_size=(2, 1, 1), vals=tuple(vals)))
    dev.allocator.free(buf, 32, SPEC)
    return out


def test_odd_inputs_get_one_outcome_on_every_launch_path(dev):
    """bools, numpy numbers, huge and negative ints, objects whose __index__ raises: the plain call (native, or Python
    without the extension), `launch` and the checked `wait=True` path agree, and follow the rule (integers, numpy's
    included, are ints; a bool is not; a float parameter takes any real number that fits)."""
    got = odd_input_outcomes(dev)
    for key, result in got.items():
        how, what = key.split(" ", 1)
        if how != "wait": assert result == got[f"wait {what}"], f"{key}: {result!r} but wait=True gave {got['wait ' + what]!r}"
        assert "something was submitted" not in result, key
    for what in ("gs[0]", "gs[1]", "ls[0]", "gs"):
        for bad in ("True", "False", "np.True_", "RaisingIndex", "4.0", "'4'", "None", "2**70", "-1", "0"):
            assert got[f"call {what}={bad}"].startswith("ValueError"), (what, bad, got[f"call {what}={bad}"])
    assert got["call gs[0]=np.int64(4)"] == "ran [1, 2, 2, 4]" and got["call ls[0]=np.uint8(2)"] == "ran [1, 2, 2, 4]"
    assert got["call val0=np.int64(4)"] == "ran [4, 2, 2, 2]" and got["call val2=np.float32(1.5)"] == "ran [1, 2, 6, 2]"
    for slot, bad in ((0, "True"), (1, "np.True_"), (2, "False"), (0, "RaisingIndex"), (1, "4.0"), (0, "'4'"), (2, "None")):
        assert got[f"call val{slot}={bad}"].startswith("TypeError"), (slot, bad)
    for slot, bad in ((0, "2**70"), (1, "-1"), (2, "1e300"), (2, "2**1030")):
        assert got[f"call val{slot}={bad}"].startswith("ValueError"), (slot, bad)


def test_a_float_for_an_integer_parameter_is_refused_on_every_path(dev):
    """A float goes only to a floating parameter (KernargsLayout.real_values, check_args): a plain call (native or Python),
    `launch`, `wait=True` and the checked path (`timeout`) all refuse 0.5 for a bool or an int and take it for a float."""
    prg = dev.compile("HCQ_KERNEL void k(long *o, _Bool b, int i, float f) { o[0] = b; o[1] = i; o[2] = (long)(f * 4); }", "k")
    buf = dev.allocator.alloc(24, SPEC)
    for kw in ({}, {"wait": True}, {"wait": True, "timeout": 10_000}):
        for call in (prg, prg.launch):
            for bad in ((0.5, 1, 1.0), (1, 0.5, 1.0)):
                with pytest.raises(TypeError, match="needs an int or Variable, got 0.5"): call(buf, vals=bad, **kw)
            call(buf, vals=(2, 3, 0.5), **kw)
            dev.synchronize()
            assert np.frombuffer(buf.cpu_view().mv, np.int64).tolist() == [1, 3, 2], kw
    dev.allocator.free(buf, 24, SPEC)


def test_odd_inputs_get_the_same_outcome_with_and_without_the_extension(dev):
    if not hotpath.available(): pytest.skip(f"extension not in use: {hotpath.why_not}")
    script = "import json, hcq, sys; sys.path.insert(0, 'tests'); from test_hotpath import odd_input_outcomes; " \
             f"print(json.dumps(odd_input_outcomes(hcq.Device({dev.device!r}))))"  # (errors name the device: the same name)
    env = {**os.environ, "HCQ_HOTPATH": "0", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    import json
    without = json.loads(proc.stdout.strip().splitlines()[-1])
    with_ext = odd_input_outcomes(dev)
    assert {k: v for k, v in with_ext.items() if without[k] != v} == {}


def test_timed_deadline_and_symbolic_launches_still_work(dev):
    prg = dev.compile(COUNT, "count")
    buf = dev.allocator.alloc(4 * 64, SPEC)
    buf.cpu_view()[:] = bytes(buf.size)
    assert isinstance(prg(buf, global_size=64, vals=(1,), wait=True), float)
    assert prg(buf, global_size=64, vals=(1,), wait=True, timeout=10_000) is not None
    with pytest.raises(Exception, match="'v'|Variable|var_vals|symbolic"):
        prg(buf, global_size=64, vals=(Variable("v", 0, 9),))
    dev.synchronize()
    assert (ints(buf) == 2).all()
    dev.allocator.free(buf, buf.size, SPEC)


def test_dims_that_change_are_patched_even_when_a_list_changes_in_place(dev):
    prg = dev.compile(COUNT, "count")
    buf = dev.allocator.alloc(4 * 64, SPEC)
    buf.cpu_view()[:] = bytes(buf.size)
    for gs in ((4, 1, 1), (8, 1, 1), 16, (2, 2, 1), (8, 1, 1)): prg(buf, global_size=gs, vals=(1,))
    dims = [4, 1, 1]
    prg(buf, global_size=dims, vals=(100,))
    dims[0] = 32  # the same list object, new contents: the next launch must see 32 blocks
    prg(buf, global_size=dims, vals=(1000,))
    dev.synchronize()
    want = np.zeros(64, np.int32)
    for n, v in ((4, 1), (8, 1), (16, 1), (2, 2), (8, 1), (4, 100), (32, 1000)): want[:n] += v  # (2, 2, 1): ids 0-1 twice
    assert (ints(buf) == want).all()
    dev.allocator.free(buf, buf.size, SPEC)


def test_capturing_profiling_and_validating_launches_go_through_launch(dev, python_launches):
    prg = dev.compile(COUNT, "count")
    buf = dev.allocator.alloc(4 * 64, SPEC)
    buf.cpu_view()[:] = bytes(buf.size)
    prg(buf, vals=(1,))
    python_launches.clear()
    was = hcq.validation.enabled
    hcq.validation.set_enabled(True)
    try:
        prg(buf, vals=(1,))
    finally:
        hcq.validation.set_enabled(was)
    assert len(python_launches) == 1
    with profiler.profile():
        prg(buf, vals=(1,))
    assert len(python_launches) == 2

    @hcq.jit
    def step(b): prg(b, vals=(1,))
    step(buf)  # the first call runs plainly
    n = len(python_launches)
    step(buf)  # the second is captured (and the graph run)
    assert len(python_launches) == n + 1
    step(buf, wait=True)
    assert ints(buf, 1)[0] == 6
    dev.allocator.free(buf, buf.size, SPEC)


def test_native_launches_lap_a_small_kernargs_ring_and_cross_a_timeline_wrap(open_device):
    d = open_device()
    prg = d.compile(COUNT, "count")
    buf = d.allocator.alloc(4 * 64, SPEC)
    buf.cpu_view()[:] = bytes(buf.size)
    orig = use_kernargs_ring(d, ring := hcq.TimelineRing(512, d._wait_for_tag, segments=4))  # 16-byte blocks: a lap per 32 launches
    try:
        for i in range(1000): prg(buf, global_size=64, vals=(i % 5,))
        assert ring.lap >= 30
        d.synchronize()
        assert (ints(buf) == sum(i % 5 for i in range(1000))).all()
    finally:
        use_kernargs_ring(d, orig)
    prg = d.compile(COUNT, "count")  # (a program launched natively keeps the launcher it first took)
    # the timeline wraps after 2^31 submissions: the launch words then name the other timeline signal
    d.hw_compute_queue_t().wait(d.timeline_signal, d.timeline_value - 1).signal(d.timeline_signal, (1 << 31) + 4).submit(d)
    d.timeline_value = (1 << 31) + 5
    old = d.timeline_signal
    d.synchronize()
    assert d.timeline_signal is not old and d.timeline_value == 1
    for _ in range(100): prg(buf, global_size=64, vals=(1,))
    d.synchronize(timeout=10_000)
    assert d.timeline_signal.value == 100 and (ints(buf) == sum(i % 5 for i in range(1000)) + 100).all()
    d.allocator.free(buf, buf.size, SPEC)


def in_threads(work, n):
    """Run work(0) .. work(n - 1) on n threads at once; raise the first error any of them raised."""
    errors = []

    def run(i):
        try:
            work(i)
        except Exception as e:  # noqa: BLE001 - raised below, in the test's thread
            errors.append(e)
    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads: t.start()
    for t in threads: t.join(60)
    if errors: raise errors[0]


def test_threads_launch_on_their_own_devices_at_once(open_device):
    devs = [open_device() for _ in range(3)]
    prgs = [d.compile(COUNT, "count") for d in devs]
    bufs = [d.allocator.alloc(4 * 64, SPEC) for d in devs]
    for b in bufs: b.cpu_view()[:] = bytes(b.size)

    def work(i):
        for k in range(4000): prgs[i](bufs[i], global_size=64, vals=(i + 1,))
        devs[i].synchronize()
    in_threads(work, 3)
    for i, b in enumerate(bufs):
        assert (ints(b) == 4000 * (i + 1)).all()
        devs[i].allocator.free(b, b.size, SPEC)


def interrupted_for_a_second(call, monkeypatch):
    """Run `call()` over and over for a second while SIGINTs arrive every millisecond. The handler raises
    KeyboardInterrupt only around the call (a signal that arrives during a native call is handled when it returns),
    and hcq's handler stands in front of it, so Python paths defer it as in front of Python's default. Returns how
    many KeyboardInterrupts came out."""
    inside, raised, stop = [False], [0], threading.Event()
    main = threading.main_thread().ident

    def handler(signum, frame):
        if inside[0]:
            inside[0] = False
            raised[0] += 1
            raise KeyboardInterrupt

    def storm():
        while not stop.is_set():
            time.sleep(0.001)
            signal.pthread_kill(main, signal.SIGINT)
    monkeypatch.setattr(interrupts, "_wrapped", interrupts._wrapped)  # what hcq's handler stands in front of, restored after
    old = signal.signal(signal.SIGINT, handler)
    interrupts.install()
    t = threading.Thread(target=storm)
    t.start()
    try:
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            try:
                inside[0] = True
                call()
                inside[0] = False
            except KeyboardInterrupt:
                pass
    finally:
        inside[0] = False
        stop.set()
        t.join()
        signal.signal(signal.SIGINT, old)
    return raised[0]


@pytest.mark.full
def test_ctrl_c_during_native_launches_leaves_every_launch_whole(dev, monkeypatch):
    """SIGINTs while launching: each launch either happened (its timeline step and its data) or not at all."""
    prg = dev.compile(COUNT, "count")
    buf = dev.allocator.alloc(4 * 64, SPEC)
    buf.cpu_view()[:] = bytes(buf.size)
    prg(buf, global_size=64, vals=(0,))
    dev.synchronize()
    tv0 = dev.timeline_value
    raised = interrupted_for_a_second(lambda: prg(buf, global_size=64, vals=(1,)), monkeypatch)
    dev.synchronize()
    launched = dev.timeline_value - tv0
    assert raised > 10 and launched > 100
    assert dev.timeline_signal.value == dev.timeline_value - 1
    assert (ints(buf) == launched).all()


@pytest.fixture
def checked_submits(monkeypatch):
    """Queues that went through HWQueue._prepare (the checked submit path)."""
    calls = []
    real = hcq.HWQueue._prepare
    monkeypatch.setattr(hcq.HWQueue, "_prepare", lambda self, *a, **kw: (calls.append(self), real(self, *a, **kw))[1])
    return calls


def counter_queue(dev, sig, buf, v):
    """A 10-command queue whose symbols are plain Variables in its words."""
    q = dev.hw_compute_queue_t().wait(sig, 0).memory_barrier()
    for k in range(7): q.write(buf.va_addr + 4 * k, v if k % 2 else k)
    return q.signal(sig, v)


def test_a_built_queue_is_resubmitted_natively_with_new_values(dev, checked_submits):
    buf = dev.allocator.alloc(64, SPEC)
    sig, v = dev.new_signal(value=0), Variable("v", 0, (1 << 32) - 1)
    q = counter_queue(dev, sig, buf, v)
    q.submit(dev, {"v": 1})
    checked_submits.clear()
    ring = dev.ring("compute")
    count = ring.count
    for i in range(2, 2000): q.submit(dev, {"v": i, "unused": 5})
    sig.wait(1999, timeout=10_000)
    assert ring.count == count + 1998 and q._last_fence == (ring, ring.count)
    ring.fence.wait(ring.count, timeout=10_000)
    assert ints(buf, 7).tolist() == [0, 1999, 2, 1999, 4, 1999, 6]
    assert len(checked_submits) == (0 if hotpath.available() else 1998)
    # what the native path declines gets the checked path's answer, with nothing submitted
    with pytest.raises(hcq.UnboundVariableError, match="'v'"):
        q.submit(dev, {})
    with pytest.raises(ValueError, match="outside its range"):
        q.submit(dev, {"v": -1})
    with pytest.raises(ValueError, match="outside its range"):
        q.submit(dev, {"v": 1 << 32})
    assert ring.count == count + 1998
    q.write(buf.va_addr + 28, v)  # the queue grows: the next submit sees the new command
    q.submit(dev, {"v": 77})
    sig.wait(77, timeout=10_000)
    ring.fence.wait(ring.count, timeout=10_000)
    assert ints(buf, 8).tolist() == [0, 77, 2, 77, 4, 77, 6, 77]
    dev.allocator.free(buf, buf.size, SPEC)


def test_threads_resubmitting_to_one_ring_keep_its_fence_numbers_whole(open_device):
    d = open_device()
    bufs = [d.allocator.alloc(64, SPEC) for _ in range(3)]
    sigs = [d.new_signal(value=0) for _ in range(3)]
    v = Variable("v", 0, (1 << 32) - 1)
    queues = [counter_queue(d, sigs[i], bufs[i], v) for i in range(3)]
    for q in queues: q.submit(d, {"v": 1})
    in_threads(lambda i: [queues[i].submit(d, {"v": k}) for k in range(2, 3000)], 3)
    ring = d.ring("compute")
    assert ring.count == 3 * 2999  # every submission took its own number
    ring.fence.wait(ring.count, timeout=10_000)
    for i in range(3): assert sigs[i].value == 2999 and ints(bufs[i], 2).tolist() == [0, 2999]


@pytest.mark.full
def test_ctrl_c_during_native_resubmits_leaves_the_ring_count_whole(dev, monkeypatch):
    buf = dev.allocator.alloc(64, SPEC)
    sig, v = dev.new_signal(value=0), Variable("v", 0, (1 << 32) - 1)
    q = counter_queue(dev, sig, buf, v)
    q.submit(dev, {"v": 1})
    ring = dev.ring("compute")
    values = iter(range(2, 1 << 32))
    raised = interrupted_for_a_second(lambda: q.submit(dev, {"v": next(values)}), monkeypatch)
    ring.fence.wait(ring.count, timeout=10_000)  # every number taken was submitted (else this times out)
    assert raised > 10 and ring.fence.value == ring.count
    dev.allocator.free(buf, buf.size, SPEC)


def test_a_one_queue_graph_replays_in_one_native_call_and_every_change_is_seen(monkeypatch, open_device):
    """Replays that change nothing but the kickoff and timeline values are one C call (GraphRun); new inputs, a
    timeline wrap, validation and profiling take the Python path; every replay computes what it was given."""
    from hcq import ExecItem, HCQGraph
    d = open_device()
    prg = d.compile(COUNT, "count")
    a, b = (d.allocator.alloc(4 * 64, SPEC) for _ in range(2))
    for x in (a, b): x.cpu_view()[:] = bytes(x.size)
    g = HCQGraph([ExecItem(prg, (a,), (1,), 64), ExecItem(prg, (a,), (2,), 64)], inputs=(a,))
    python_runs = []
    real = HCQGraph._patch_and_submit
    monkeypatch.setattr(HCQGraph, "_patch_and_submit", lambda self, *args: (python_runs.append(1), real(self, *args))[1])
    for _ in range(50): g((a,))
    assert len(python_runs) == (1 if hotpath.available() else 50)
    assert type(g._native).__name__ == ("GraphRun" if hotpath.available() else "bool")
    for _ in range(5): g((b,))  # another input: the Python path once, then native again
    g.synchronize()
    assert (ints(a) == 150).all() and (ints(b) == 15).all()
    python_runs.clear()
    d.hw_compute_queue_t().wait(d.timeline_signal, d.timeline_value - 1).signal(d.timeline_signal, (1 << 31) + 2).submit(d)
    d.timeline_value = (1 << 31) + 3
    d.synchronize()  # the timeline wraps: its signal swaps
    for _ in range(10): g((b,))
    assert len(python_runs) == (1 if hotpath.available() else 10)
    was = hcq.validation.enabled
    hcq.validation.set_enabled(True)
    try:
        g((b,))
    finally:
        hcq.validation.set_enabled(was)
    with profiler.profile():
        g((b,))
    assert len(python_runs) == (3 if hotpath.available() else 12)
    g.synchronize()
    assert (ints(b) == 15 + 3 * 12).all() and d.timeline_signal.value == d.timeline_value - 1
    ring = d.ring("compute")
    ring.fence.wait(ring.count, timeout=10_000)
    assert ring.fence.value == ring.count


def test_a_native_graph_run_on_a_failed_device_raises_as_the_python_path_does(no_validation, open_device):
    from hcq import ExecItem, HCQGraph, Variable as V
    d = open_device()
    prg = d.compile("HCQ_KERNEL void poke(int *a, long off) { a[off] = 1; }", "poke")
    a = d.allocator.alloc(64, SPEC)
    g = HCQGraph([ExecItem(prg, (a,), (V("off", 0, 1 << 40),), 1)])
    for _ in range(3): g(var_vals={"off": 0}, wait=True)  # native from the second run on
    with pytest.raises(hcq.DeviceError):
        g(var_vals={"off": 1 << 36}, wait=True)  # far outside the buffer: the kernel faults
    with pytest.raises(hcq.DeviceError):
        g(var_vals={"off": 1 << 36})  # the same values as the last run (the native path's case), on a failed device: refused
    d.recover()
    for _ in range(3): g(var_vals={"off": 0}, wait=True)
    assert ints(a, 1)[0] == 1 and d.timeline_signal.value == d.timeline_value - 1


@pytest.mark.full
def test_ctrl_c_during_native_graph_runs_leaves_every_run_whole(monkeypatch, open_device):
    from hcq import ExecItem, HCQGraph
    d = open_device()
    prg = d.compile(COUNT, "count")
    a = d.allocator.alloc(4 * 64, SPEC)
    a.cpu_view()[:] = bytes(a.size)
    g = HCQGraph([ExecItem(prg, (a,), (1,), 64)])
    g()
    g.synchronize()
    tv0 = d.timeline_value
    raised = interrupted_for_a_second(g, monkeypatch)
    g.synchronize()
    runs = d.timeline_value - tv0
    assert raised > 10 and runs > 100
    assert d.timeline_signal.value == d.timeline_value - 1 and (ints(a) == runs + 1).all()


@pytest.mark.skipif(not hotpath.available(), reason=f"extension not in use: {hotpath.why_not}")
def test_a_ring_lock_behaves_as_a_lock_and_a_waiter_can_be_interrupted(dev):
    lock = hotpath.ring_lock()
    assert type(lock).__name__ == "RingLock" and isinstance(dev.ring("compute").lock, type(lock))
    assert lock.acquire() and lock.locked() and not lock.acquire(blocking=False)
    lock.release()
    with pytest.raises(RuntimeError, match="release unlocked lock"):
        lock.release()
    with lock:
        assert lock.locked()
    assert not lock.locked()
    with pytest.raises(ValueError, match="no timeout"):
        lock.acquire(timeout=1.0)
    # held by another thread: this thread waits (the GIL released), and a SIGINT still interrupts the wait
    held, done = threading.Event(), threading.Event()

    def hold():
        with lock:
            held.set()
            done.wait(10)
    t = threading.Thread(target=hold)
    t.start()
    held.wait(10)
    timer = threading.Timer(0.1, signal.pthread_kill, (threading.main_thread().ident, signal.SIGINT))
    timer.start()
    with pytest.raises(KeyboardInterrupt):
        lock.acquire()
    done.set()
    t.join(10)
    assert lock.acquire(blocking=False)
    lock.release()


@pytest.mark.full
def test_the_launch_tests_pass_without_the_extension():
    """The same launch tests with HCQ_HOTPATH=0: launches through Python and ctypes."""
    if os.environ.get("HCQ_HOTPATH") == "0": pytest.skip("already running without the extension")
    env = {**os.environ, "HCQ_HOTPATH": "0", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(ROOT / "tests" / "test_hotpath.py"),
                           "-k", "not without_the_extension and not failed_extension_build"],
                          env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout
