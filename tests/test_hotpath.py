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
print("hotpath", hotpath.available(), type(dev.executor.hot_submit()).__name__)
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


def test_device_submits_through_the_extension_when_it_is_there():
    dev = hcq.Device("CPU:0")
    hot = dev.executor.hot_submit()
    assert hot is dev.executor.hot_submit()  # made once
    assert (type(hot).__name__ == "builtin_function_or_method") == hotpath.available()


def test_a_failed_extension_build_does_not_fail_the_install(tmp_path):
    """optional=True: with a compiler that fails, the build step warns and goes on (hcq then uses ctypes)."""
    env = {**os.environ, "CC": "false", "LDSHARED": "false"}
    proc = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--build-lib", str(tmp_path / "lib"), "--build-temp",
                           str(tmp_path / "tmp")], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert not list(tmp_path.rglob("_hotpath*.so"))
    assert "_hotpath" in proc.stdout + proc.stderr  # it says which extension it skipped
