"""The Vulkan device (VK) on whatever Vulkan driver the machine has (CI: Mesa's lavapipe): the conformance kit with
host-visible memory and with the forced non-host-visible path, graphs and transfers across VK and CPU, kernel
arguments read from SPIR-V, compile errors, a lost device and a timeout, and the backend's absence without a driver."""
import os
import subprocess
import sys

import numpy as np
import pytest

import hcq
from hcq import CopyItem, ExecItem, HCQGraph
from hcq.backends.cpu.kernels import CONFORMANCE_KERNELS as CPU_KERNELS

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WHY_NOT = hcq.registry.unavailable_backends().get("VK")
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=f"VK is unavailable: {WHY_NOT}")
N = 1024


def env(**extra):
    e = {k: v for k, v in os.environ.items() if k not in ("PROFILE", "PYTEST_ADDOPTS")}
    e["PYTHONPATH"] = REPO + os.pathsep + e.get("PYTHONPATH", "")
    return {**e, **extra}


def run(code_or_args, timeout=300, **extra):
    args = ["-c", code_or_args] if isinstance(code_or_args, str) else code_or_args
    return subprocess.run([sys.executable, *args], env=env(**extra), capture_output=True, text=True, timeout=timeout, cwd=REPO)


@pytest.fixture(scope="module")
def vk():
    return hcq.Device("VK")


@pytest.fixture(scope="module")
def K(vk):
    from hcq.backends.vk.kernels import CONFORMANCE_KERNELS
    return {name: vk.compile(src, kname) for name, (src, kname) in CONFORMANCE_KERNELS.items()}


@pytest.mark.parametrize("host_visible", ["1", "0"])
def test_conformance_kit_passes(tmp_path, host_visible):
    """Every skip names a capability the device declared absent, or the missing second device."""
    r = subprocess.run([sys.executable, "-m", "hcq.conformance", "VK", "-q", "--", "-rs"], cwd=tmp_path, env=env(HCQ_VK_HOST_VISIBLE=host_visible),
                       capture_output=True, text=True, timeout=600)
    out = r.stdout + r.stderr
    assert r.returncode == 0 and " passed" in out and " failed" not in out, out
    skips = [ln for ln in out.splitlines() if ln.startswith("SKIPPED")]
    assert skips and all("capability" in ln or "no second device" in ln or "every poll condition" in ln or "host-visible" in ln
                         for ln in skips), skips


def graph_items(vk, cpu, K):
    """VK fill a=3 -> copy to CPU c -> CPU d = 4 + c -> copy to VK b -> VK b = b + a: 10 everywhere."""
    cfill, cadd = cpu.compile(*CPU_KERNELS["fill"]), cpu.compile(*CPU_KERNELS["add"])
    a, b = vk.allocator.alloc(N * 4), vk.allocator.alloc(N * 4)
    c, d = cpu.allocator.alloc(N * 4), cpu.allocator.alloc(N * 4)
    items = [ExecItem(K["fill"], (a,), (3, N), (N // 64,), (64,)), CopyItem(c, a, N * 4), ExecItem(cfill, (d,), (4, N), (N // 64,), (64,)),
             ExecItem(cadd, (d, c, d), (N,), (N // 64,), (64,)), CopyItem(b, d, N * 4), ExecItem(K["add"], (b, b, a), (N,), (N // 64,), (64,))]
    return items, b


def read(dev, buf, n=N):
    out = np.zeros(n, np.uint32)
    dev.allocator.copyout(memoryview(out).cast("B"), buf)
    return out


def test_graph_over_vk_and_cpu(vk, K):
    cpu = hcq.Device("CPU")
    items, b = graph_items(vk, cpu, K)
    g = HCQGraph(items)
    for _ in range(3):
        vk.allocator.copyin(b, memoryview(np.zeros(N, np.uint32)).cast("B"))
        g()
        assert (read(vk, b) == 10).all()


def test_graph_over_vk_alone_with_a_symbolic_value(vk, K):
    a = vk.allocator.alloc(N * 4)
    n = hcq.Variable("n", 1, N)
    g = HCQGraph([ExecItem(K["fill"], (a,), (7, n), (N // 64,), (64,))])
    for count in (5, 700, N):
        vk.allocator.copyin(a, memoryview(np.zeros(N, np.uint32)).cast("B"))
        g(var_vals={"n": count})
        out = read(vk, a)
        assert (out[:count] == 7).all() and (out[count:] == 0).all()


def test_transfers_both_ways(vk):
    cpu = hcq.Device("CPU")
    x = np.arange(N, dtype=np.uint32) * 3
    c, d, a = cpu.allocator.alloc(N * 4), cpu.allocator.alloc(N * 4), vk.allocator.alloc(N * 4)
    cpu.allocator.copyin(c, memoryview(x).cast("B"))
    cpu.allocator.transfer(a, c, N * 4, cpu, vk)
    assert (read(vk, a) == x).all()
    vk.allocator.transfer(d, a, N * 4, vk, cpu)
    assert (read(cpu, d) == x).all()


def test_device_memory_the_host_cannot_map():
    """HCQ_VK_HOST_VISIBLE=0: user buffers have no host view; copies go through the staging ring, transfers to and
    from the CPU device are pulled or pushed by whichever copy engine reaches the other's memory, graphs still run."""
    code = """
import numpy as np, hcq, pytest
from hcq import HCQGraph
from hcq.backends.vk.kernels import CONFORMANCE_KERNELS as VKK
import tests.test_vk as t
vk, cpu = hcq.Device("VK"), hcq.Device("CPU")
assert not vk.capabilities.host_visible_memory
a = vk.allocator.alloc(1 << 20)
with pytest.raises(hcq.NotHostVisibleError): a.cpu_view()
data = np.random.default_rng(1).integers(0, 2**32, 1 << 18, dtype=np.uint32)
vk.allocator.copyin(a, memoryview(data).cast("B"))
assert (t.read(vk, a, 1 << 18) == data).all()
K = {k: vk.compile(*v) for k, v in VKK.items()}
items, b = t.graph_items(vk, cpu, K)
g = HCQGraph(items)
g(); g()
assert (t.read(vk, b) == 10).all()
print("OK")
"""
    r = run(code, HCQ_VK_HOST_VISIBLE="0")
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout + r.stderr


def test_kernel_arguments_come_from_the_argument_block(vk):
    src = """#version 460
#extension GL_EXT_buffer_reference : require
#extension GL_EXT_shader_explicit_arithmetic_types_int64 : require
layout(local_size_x = 4) in;
layout(buffer_reference, std430) buffer F32 { float v[]; };
layout(buffer_reference, std430) readonly buffer RO { float v[]; };
layout(buffer_reference, std430, buffer_reference_align = 8) readonly buffer Args { F32 out_; RO x; float scale; int64_t offset; uint n; };
layout(push_constant) uniform Push { Args args; };
void main() { uint i = gl_GlobalInvocationID.x; if (i < args.n) args.out_.v[i] = args.x.v[i] * args.scale + float(args.offset); }
"""
    prg = vk.compile(src, "scale")
    assert [(s.name, s.is_pointer, s.offset, s.fmt, s.read_only) for s in prg.arg_slots] == \
        [("out_", True, 0, "Q", False), ("x", True, 8, "Q", True), ("scale", False, 16, "f", False), ("offset", False, 24, "q", False),
         ("n", False, 32, "I", False)]
    assert prg.fixed_local_size == (4, 1, 1)
    x = np.arange(8, dtype=np.float32)
    out, xb = vk.allocator.alloc(32), vk.allocator.alloc(32)
    vk.allocator.copyin(xb, memoryview(x).cast("B"))
    prg(out, xb, vals=(2.0, -3, 8), global_size=(2,), local_size=(4,), wait=True)
    res = np.zeros(8, np.float32)
    vk.allocator.copyout(memoryview(res).cast("B"), out)
    assert (res == x * 2 - 3).all()
    with pytest.raises(ValueError, match=r"fixes its local size to \(4, 1, 1\)"):
        prg(out, xb, vals=(2.0, -3, 8), global_size=(4,), local_size=(2,))


def test_compile_errors_name_the_problem(vk):
    with pytest.raises(hcq.CompileError, match="undeclared identifier|no_such_thing"):
        vk.compile("#version 460\nlayout(local_size_x = 1) in;\nvoid main() { no_such_thing = 1; }\n", "bad")
    with pytest.raises(hcq.CompileError, match="push constant block"):
        vk.compile("#version 460\nlayout(local_size_x = 1) in;\nlayout(push_constant) uniform P { uint x; };\nvoid main() {}\n", "bad")


def test_a_lost_device_raises_and_opens_again():
    code = """
import hcq, pytest
from hcq.backends.vk.kernels import CONFORMANCE_KERNELS as VKK
vk = hcq.Device("VK")
fill = vk.compile(*VKK["fill"])
a = vk.allocator.alloc(4096)
vk.inject_device_lost(1)
fill(a, vals=(1, 16), global_size=(1,), local_size=(16,))
with pytest.raises(hcq.DeviceError, match="VK_ERROR_DEVICE_LOST") as e:
    vk.synchronize(timeout=10000)
assert "opens it again" in str(e.value), e.value
assert vk.lost() is not None
again = hcq.Device("VK")
assert again is not vk and again.lost() is None
b = again.allocator.alloc(64)
again.compile(*VKK["fill"])(b, vals=(5, 16), global_size=(1,), local_size=(16,), wait=True)
assert list(b.cpu_view().view(0, 64, "I")) == [5] * 16
print("OK")
"""
    r = run(code)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout + r.stderr


def test_a_kernel_that_never_finishes_times_out_with_a_report(vk, K):
    flag, out = vk.allocator.alloc(8), vk.allocator.alloc(4)
    flag.cpu_view().view(0, 8, "Q")[0] = 0
    K["spin"](flag, out, global_size=(1,), local_size=(1,))
    try:
        with pytest.raises(hcq.HCQTimeoutError, match=r"(?s)timeline signal.*VK:0 compute.*EXEC of kernel 'spin'"):
            vk.synchronize(timeout=300)
    finally:
        flag.cpu_view().view(0, 8, "Q")[0] = 1
    vk.synchronize()
    assert out.cpu_view().view(0, 4, "I")[0] == 1


def test_without_a_driver_vk_is_absent_with_the_reason(monkeypatch):
    from hcq.backends.vk import native
    monkeypatch.setattr(native.shutil, "which", lambda name: None)
    native.unavailable_reason.cache_clear()
    try:
        assert "VK" not in hcq.available_backends()
        assert "glslangValidator" in hcq.registry.unavailable_backends()["VK"]
        with pytest.raises(hcq.HCQError, match="VK is unavailable here: glslangValidator"):
            hcq.Device("VK:3")
    finally:
        native.unavailable_reason.cache_clear()


def test_hcq_info_names_the_vulkan_device():
    r = run(["-m", "hcq.cli", "info", "VK"])
    assert r.returncode == 0 and "Vulkan device" in r.stdout, r.stdout + r.stderr


def test_more_semaphore_waits_than_one_submission_carries():
    """A compute queue that waits on 40 signals the copy queue stored in batches still running (each WAIT becomes a
    semaphore wait, 16 at most per submission) runs after all of them, and right."""
    code = """
import numpy as np, hcq
vk = hcq.Device("VK")
n = 16 << 20
src, dst = vk.allocator.alloc(n), vk.allocator.alloc(n)
data = np.random.default_rng(2).integers(0, 2**32, n // 4, dtype=np.uint32)
vk.allocator.copyin(src, memoryview(data).cast("B"))
vk.synchronize()
sigs = [vk.new_signal(value=0) for _ in range(40)]
cq = vk.hw_copy_queue_t().copy(dst, src, n)  # (device memory: a vkCmdCopyBuffer, so the batch is still running below)
for s in sigs: cq.signal(s, 1)
done = vk.new_signal(value=0)
q = vk.hw_compute_queue_t()
for s in sigs: q.wait(s, 1)
q.signal(done, 1)
cq.submit(vk); q.submit(vk)
done.wait(1, timeout=20000)
vk.synchronize()
out = np.zeros(n // 4, np.uint32); vk.allocator.copyout(memoryview(out).cast("B"), dst)
assert (out == data).all() and all(s.value == 1 for s in sigs)
print("OK")
"""
    r = run(code, HCQ_VK_HOST_VISIBLE="0")
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout + r.stderr


def _threads_launch_and_check(vk, K, seconds: float) -> int:
    """Four threads submit to both rings of one device at once, as docs/design.md ("Threads calling hcq") allows:
    launches (which advance the timeline) under the caller's lock, then, without it, raw queues with their own
    signals (a compute queue after the launches, and a copy of the result on the copy queue), waited for on the host
    at once. The inline submit path and the rings' threads both take words. Every result is checked; returns the
    launches made."""
    import threading
    import time
    lock, errors, counts = threading.Lock(), [], [0] * 4
    bufs = [(vk.allocator.alloc(N * 4), vk.allocator.alloc(N * 4)) for _ in range(4)]
    sigs = [(vk.new_signal(value=0), vk.new_signal(value=0)) for _ in range(4)]

    def worker(t: int) -> None:
        (buf, copy), (ran, copied) = bufs[t], sigs[t]
        end, i = time.monotonic() + seconds, 0
        try:
            while time.monotonic() < end:
                i += 1
                value = (t + 1) * 100000 + i
                with lock:
                    for v in range(4): K["fill"](buf, vals=(value - 3 + v, N), global_size=(N // 64,), local_size=(64,))
                    launched = vk.timeline_value - 1
                vk.hw_compute_queue_t().wait(vk.timeline_signal, launched).signal(ran, i).submit(vk)
                vk.hw_copy_queue_t().wait(ran, i).copy(copy, buf, N * 4).signal(copied, i).submit(vk)
                copied.wait(i, timeout=20000)
                with lock: got = set(read(vk, copy).tolist())  # (copyout advances the timeline and uses the allocator)
                if got != {value}: errors.append((t, i, sorted(got)[:4]))
                counts[t] += 4
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append((t, repr(e)))
    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for th in threads: th.start()
    for th in threads: th.join()
    assert not errors, errors[:5]
    return sum(counts)


def test_threads_launching_at_once(vk, K):
    assert _threads_launch_and_check(vk, K, 3.0) > 40


@pytest.mark.slow
def test_threads_launching_at_once_soak(vk, K):
    seconds = float(os.environ.get("HCQ_RACE_SECONDS", "300"))
    print(f"\n{_threads_launch_and_check(vk, K, seconds)} launches in {seconds:.0f} s, all right")


def test_fork_child_opens_vk_afresh():
    code = """
import os, hcq, numpy as np
from hcq.backends.vk.kernels import CONFORMANCE_KERNELS as VKK
vk = hcq.Device("VK")
vk.compile(*VKK["fill"])(vk.allocator.alloc(64), vals=(1, 16), global_size=(1,), local_size=(16,), wait=True)
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    msg = ""
    try:
        try:
            vk.synchronize(timeout=2000)
            msg = "old device still usable"
        except hcq.DeviceError as e:
            msg = "old: " + ("fork" in str(e) and "ok" or str(e))
        d = hcq.Device("VK")
        b = d.allocator.alloc(64)
        d.compile(*VKK["fill"])(b, vals=(7, 16), global_size=(1,), local_size=(16,), wait=True)
        msg += "|new: " + ("ok" if list(b.cpu_view().view(0, 64, "I")) == [7] * 16 else "wrong")
    except BaseException as e:
        msg += f"|child raised {e!r}"
    finally:
        os.write(w, msg.encode()); os._exit(0)
os.close(w)
child = os.read(r, 4096).decode(); os.waitpid(pid, 0)
b = vk.allocator.alloc(64)
vk.compile(*VKK["fill"])(b, vals=(3, 16), global_size=(1,), local_size=(16,), wait=True)
assert child == "old: ok|new: ok", child
assert list(b.cpu_view().view(0, 64, "I")) == [3] * 16
print("OK")
"""
    r = run(code)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout + r.stderr
