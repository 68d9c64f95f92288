"""The Vulkan device (VK) on whatever Vulkan driver the machine has (CI: Mesa's lavapipe): the conformance kit with
host-visible memory and with the forced non-host-visible path, graphs and transfers across VK and CPU, kernel
arguments read from SPIR-V, compile errors, a lost device and a timeout, and the backend's absence without a driver."""
import contextlib
import os
import subprocess
import sys
import time

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


@pytest.fixture
def vk(open_device):
    """A fresh VK device."""
    return open_device("VK")


@pytest.fixture
def K(vk):
    from hcq.backends.vk.kernels import CONFORMANCE_KERNELS
    return {name: vk.compile(src, kname) for name, (src, kname) in CONFORMANCE_KERNELS.items()}


@pytest.mark.full
@pytest.mark.slow_on(host_visible="1")  # (the full run: device memory the host cannot map, the path of a discrete GPU)
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


def test_graph_over_vk_and_cpu(vk, K, dev):
    cpu = dev
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


def test_transfers_both_ways(vk, dev):
    cpu = dev
    x = np.arange(N, dtype=np.uint32) * 3
    c, d, a = cpu.allocator.alloc(N * 4), cpu.allocator.alloc(N * 4), vk.allocator.alloc(N * 4)
    cpu.allocator.copyin(c, memoryview(x).cast("B"))
    cpu.allocator.transfer(a, c, N * 4, cpu, vk)
    assert (read(vk, a) == x).all()
    vk.allocator.transfer(d, a, N * 4, vk, cpu)
    assert (read(cpu, d) == x).all()


def test_transfers_and_waits_across_groups_without_direct_host_copies(vk):
    """HCQ_CPU_DIRECT_COPY=0 (the CPU device's host copies go through its staging ring) turned off what Vulkan uses to
    reach CPU memory across peer groups too: a CPU queue could not wait on a VK signal, and a transfer the host could
    not do itself raised "cannot wait on". Where a copy engine uses host memory in place is another question than
    whether host copies go direct: transfers and waits work both ways."""
    code = """
import numpy as np, hcq
vk, cpu = hcq.Device("VK"), hcq.Device("CPU")
assert not cpu.allocator.direct_copy
n = 1 << 16
x = np.arange(n, dtype=np.uint32) * 7
c, d, a = cpu.allocator.alloc(n * 4), cpu.allocator.alloc(n * 4), vk.allocator.alloc(n * 4)
cpu.allocator.copyin(c, memoryview(x).cast("B"))
cpu.allocator.transfer(a, c, n * 4, cpu, vk)
vk.allocator.transfer(d, a, n * 4, vk, cpu)
out = np.zeros(n, np.uint32)
cpu.allocator.copyout(memoryview(out).cast("B"), d)
sig = vk.new_signal(value=0)
cpu.hw_compute_queue_t().wait(cpu.replica(sig), 1).signal(cpu.timeline_signal, cpu.next_timeline()).submit(cpu)
vk.hw_compute_queue_t().signal(sig, 1).submit(vk)
cpu.synchronize()
print("ok", bool((out == x).all()))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "HCQ_CPU_DIRECT_COPY": "0"})
    assert r.stdout.split() == ["ok", "True"], r.stdout + r.stderr


def test_the_store_hook_hears_each_store_once_the_host_sees_it_in_ring_order(vk, K):
    """vk.c's store hook (`VKDevice.host_stores`, what lets remote devices follow a VK device's memory) is told of each
    WRITE, COPY destination, TIMESTAMP and SIGNAL a ring stores, by device address, once the host sees the bytes, in
    ring order (batches the GPU runs, and stores the ring makes on the host); host stores into a signal too; nothing
    once it is removed."""
    import ctypes
    from hcq.packets import FLAG_SIGNAL, HOOK_VALUE
    a, b, w = vk.allocator.alloc(N * 4), vk.allocator.alloc(N * 4), vk.allocator.alloc(64)
    sig, ts = vk.new_signal(value=0), vk.new_signal(value=0)
    heard: list = []

    def hook(ctx, addr, n, flags, value):  # (on the ring's thread) what the host sees of the range as it is told
        if addr == b.va_addr: heard.append(("copy", n, flags, int(np.frombuffer(b.cpu_view().mv, np.uint32)[N - 1])))
        elif addr == w.va_addr: heard.append(("write", n, flags, int(np.frombuffer(w.cpu_view().mv, np.uint32)[0])))
        elif addr == sig.value_addr: heard.append(("signal", n, flags, sig.load()) if flags & HOOK_VALUE and value == sig.load() else ("value", flags, value, sig.load()))
        elif addr == ts.timestamp_addr: heard.append(("timestamp", n, flags, ts.load_timestamp() != 0))
    callback = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint64)(hook)
    vk.host_stores.set_hook(ctypes.cast(callback, ctypes.c_void_p).value, None)
    try:
        for rnd in range(1, 4):  # (the second round finds the ring idle: its stores are made on the host)
            K["fill"](a, vals=(rnd, N), global_size=(N // 64, 1, 1), local_size=(64, 1, 1))
            vk.hw_copy_queue_t().wait(vk.timeline_signal, vk.timeline_value - 1).copy(b, a, N * 4).write(w, 40 + rnd) \
              .timestamp(ts).signal(sig, rnd).signal(vk.timeline_signal, vk.next_timeline()).submit(vk)
            vk.synchronize()
            deadline = time.monotonic() + 10  # (the hook is told after the host can see the stores: maybe after the wait returned)
            while len(heard) < 4 and time.monotonic() < deadline: time.sleep(0.001)
            assert heard == [("copy", N * 4, 0, rnd), ("write", 4, 0, 40 + rnd), ("timestamp", 8, 0, True),
                             ("signal", 16, FLAG_SIGNAL | HOOK_VALUE, rnd)], (rnd, heard)
            heard.clear()
        sig.store(99)
        assert heard == [("signal", 16, FLAG_SIGNAL | HOOK_VALUE, 99)]
    finally:
        vk.host_stores.set_hook(None, None)
    heard.clear()
    vk.hw_compute_queue_t().signal(sig, 100).submit(vk)
    sig.wait(100, timeout=10_000)
    sig.store(101)
    assert heard == []


@contextlib.contextmanager
def values_forwarded(vk, sig):
    """The values vk.c's store hook is given for `sig`'s stores while inside (the hook is set, then removed)."""
    import ctypes
    from hcq.packets import FLAG_SIGNAL
    heard: list = []

    def hook(ctx, addr, n, flags, value):
        if addr == sig.value_addr and flags & FLAG_SIGNAL: heard.append(value)
    callback = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint64)(hook)
    vk.host_stores.set_hook(ctypes.cast(callback, ctypes.c_void_p).value, None)
    try:
        yield heard
    finally:
        vk.host_stores.set_hook(None, None)


def test_the_store_hook_is_given_each_signal_value_a_batch_stored(vk, K):
    """A batch that stores one signal several times is reported once it finished, when the word holds only the last
    value: the hook is given each value in store order (what a remote follower must see, never a later value ahead of
    the bytes stored before it)."""
    a, sig = vk.allocator.alloc(N * 4), vk.new_signal(value=0)
    with values_forwarded(vk, sig) as heard:
        q = vk.hw_compute_queue_t()
        for i in range(1, 9): q.exec(K["fill"], K["fill"].fill_kernargs((a,), (i, N)), (N // 64, 1, 1), (64, 1, 1)).signal(sig, i)
        q.signal(vk.timeline_signal, vk.next_timeline()).submit(vk)
        vk.synchronize()
        deadline = time.monotonic() + 10
        while len(heard) < 8 and time.monotonic() < deadline: time.sleep(0.001)
    assert heard == list(range(1, 9)) and sig.load() == 8, heard


def test_a_host_store_after_a_batch_signal_is_not_taken_back_when_the_batch_is_handed_over(vk, K):
    """A batch stores a signal, then runs on (a spinning kernel); the host stores the signal meanwhile, without the hook
    (as hcq serve stores a client's value). When the batch finishes and its stores are handed to the hook, the hook is
    given what the signal holds (the host's newer value), not the batch's older one, which would take a follower back."""
    flag, out, sig = vk.allocator.alloc(8), vk.allocator.alloc(8), vk.new_signal(value=0)
    flag.cpu_view()[:] = bytes(8)
    with values_forwarded(vk, sig) as heard:
        q = vk.hw_compute_queue_t().exec(K["fill"], K["fill"].fill_kernargs((out,), (7, 2)), (1, 1, 1), (64, 1, 1)).signal(sig, 1)  # (in the batch)
        q.exec(K["spin"], K["spin"].fill_kernargs((flag, out)), (1, 1, 1), (1, 1, 1)).signal(vk.timeline_signal, vk.next_timeline()).submit(vk)
        deadline = time.monotonic() + 10
        while sig.load() != 1 and time.monotonic() < deadline: time.sleep(0.001)  # (the GPU stored it; the batch still runs)
        assert sig.load() == 1 and heard == [], heard
        sig.store(5, wake=False)  # (a store the hook is not told of, as hcq serve makes a client's)
        flag.cpu_view()[:] = (1).to_bytes(8, "little")
        vk.synchronize()
        while not heard and time.monotonic() < deadline + 10: time.sleep(0.001)
        time.sleep(0.05)
    assert heard == [5] and sig.load() == 5, heard


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
    with pytest.raises(hcq.CompileError, match="push constant member 'v' .*a vector"):
        vk.compile("#version 460\nlayout(local_size_x = 1) in;\nlayout(push_constant) uniform P { vec4 v; };\nvoid main() {}\n", "bad")


# Ordinary Vulkan compute GLSL: buffers through descriptor bindings (declared here out of binding order, one anonymous and
# one named instance), scalars through push constants.
SAXPY_BINDINGS = """#version 460
layout(local_size_x_id = 0) in;
layout(std430, binding = 1) readonly buffer In { float x[]; };
layout(std430, binding = 0) buffer Out { float v[]; } y;
layout(push_constant) uniform P { float a; uint n; } pc;
void main() { uint i = gl_GlobalInvocationID.x; if (i < pc.n) y.v[i] = pc.a * x[i] + y.v[i]; }
"""
# No push constants at all (the kernel of the issue: it compiled with no parameters and crashed the process when launched),
# and `.length()`, which counts the elements of the buffer the launch passed.
LENGTHS_BINDINGS = """#version 460
layout(local_size_x = 1) in;
layout(std430, binding = 0) buffer Out { uint out_[]; };
layout(std430, binding = 2) readonly buffer A { uint a[]; };
layout(std430, binding = 3) readonly buffer B { uvec2 b[]; };
void main() { out_[0] = uint(out_.length()); out_[1] = uint(a.length()); out_[2] = uint(b.length()); out_[3] = a[0] + b[1].y; }
"""


def test_glsl_with_storage_buffer_bindings_and_push_constants():
    """Storage-buffer bindings take the launch's buffers in binding order, push-constant members its values, on every
    launch path (the plain call, fill_kernargs and a queue, a graph with a symbolic value). Run in a process of its own:
    such a kernel used to compile with no parameters and crash the process with SIGSEGV when launched."""
    code = f"""
import numpy as np, hcq
from hcq import ExecItem, HCQGraph
from tests.test_vk import SAXPY_BINDINGS, LENGTHS_BINDINGS
vk = hcq.Device("VK")
prg = vk.compile(SAXPY_BINDINGS, "saxpy")
print([(s.name, s.ctype, s.is_pointer, s.offset, s.fmt, s.read_only) for s in prg.arg_slots])
n = 1000
x = np.arange(n, dtype=np.float32)
y, xb = vk.allocator.alloc(4096), vk.allocator.alloc(4096)
vk.allocator.copyin(xb, memoryview(x).cast("B"))
def ys():
    out = np.zeros(n, np.float32); vk.allocator.copyout(memoryview(out).cast("B"), y); return out
vk.allocator.copyin(y, memoryview(np.ones(n, np.float32)).cast("B"))
for _ in range(2): prg(y, xb, vals=(2.0, n - 1), global_size=(16,), local_size=(64,), wait=True)
want = 4 * x + 1; want[-1] = 1
assert (ys() == want).all(), ys()[:8]
vk.hw_compute_queue_t().wait(vk.timeline_signal, vk.timeline_value - 1).memory_barrier() \\
    .exec(prg, prg.fill_kernargs((y, xb), (-1.0, 8)), (1, 1, 1), (8, 1, 1)).signal(vk.timeline_signal, vk.next_timeline()).submit(vk)
vk.synchronize()
want[:8] -= x[:8]
assert (ys() == want).all(), ys()[:8]
nv = hcq.Variable("nn", 1, n)
g = HCQGraph([ExecItem(prg, (y, xb), (0.5, nv), (16,), (64,))])
for k in (3, 500):
    g(var_vals={{"nn": k}}); vk.synchronize()
    want[:k] += 0.5 * x[:k]
    assert (ys() == want).all(), (k, ys()[:8])
lengths = vk.compile(LENGTHS_BINDINGS, "lengths")
print([(s.name, s.ctype, s.read_only) for s in lengths.arg_slots])
out, a, b = vk.allocator.alloc(64), vk.allocator.alloc(4096), vk.allocator.alloc(4096)
vk.allocator.copyin(a, memoryview(np.full(1024, 7, np.uint32)).cast("B"))
vk.allocator.copyin(b, memoryview(np.arange(1024, dtype=np.uint32)).cast("B"))
lengths(out, a.offset(256, 40), b.offset(0, 48), global_size=(1,), local_size=(1,), wait=True)
res = np.zeros(4, np.uint32); vk.allocator.copyout(memoryview(res).cast("B"), out)
assert list(res) == [16, 10, 6, 7 + 3], res
print("OK")
"""
    r = run(code)
    assert r.returncode == 0 and "OK" in r.stdout, f"exit status {r.returncode}\n" + r.stdout + r.stderr[-3000:]
    slots, lengths = r.stdout.splitlines()[:2]
    assert slots == str([("y", "layout(binding=0) buffer", True, 0, "Q", False), ("x", "layout(binding=1) readonly buffer", True, 8, "Q", True),
                         ("a", "float", False, 16, "f", False), ("n", "uint32_t", False, 20, "I", False)]), slots
    assert lengths == str([("out_", "layout(binding=0) buffer", False), ("a", "layout(binding=2) readonly buffer", True),
                           ("b", "layout(binding=3) readonly buffer", True)]), lengths


def test_binding_buffers_that_vulkan_cannot_bind_are_refused(vk):
    """A storage-buffer binding must start at a multiple of the device's minStorageBufferOffsetAlignment and hold
    something: other views are refused with ValueError on every launch path, before anything reaches the device."""
    prg = vk.compile(LENGTHS_BINDINGS, "lengths")
    out, a = vk.allocator.alloc(64), vk.allocator.alloc(4096)
    align = vk.storage_buffer_alignment
    assert align >= 1 and a.va_addr % align == 0
    if align > 1:
        for call in (lambda: prg(out, a.offset(align // 2 or 1, 64), a, global_size=(1,), local_size=(1,)),
                     lambda: prg.fill_kernargs((out, a.offset(align // 2 or 1, 64), a))):
            with pytest.raises(ValueError, match=r"parameter 'a' .*minStorageBufferOffsetAlignment"):
                call()
    with pytest.raises(ValueError, match=r"parameter 'b' .*empty"):
        prg(out, a, a.offset(0, 0), global_size=(1,), local_size=(1,))
    prg(out, a, a, global_size=(1,), local_size=(1,), wait=True)  # the device is fine
    assert vk.lost() is None


def test_binding_addresses_known_only_at_submit_are_checked_by_the_command_processor():
    """A binding whose address is a Variable (resolved at submit, so never seen by check_args) is checked where the launch
    is recorded: a misaligned one, or one outside the device's memory, fails the device with DeviceError naming the
    kernel and binding, and the process lives on."""
    code = """
import hcq
from hcq import HCQBuffer, Variable
from tests.test_vk import LENGTHS_BINDINGS
vk = hcq.Device("VK")
prg = vk.compile(LENGTHS_BINDINGS, "lengths")
out, a = vk.allocator.alloc(64), vk.allocator.alloc(4096)
q = vk.hw_compute_queue_t().exec(prg, prg.fill_kernargs((out, HCQBuffer(Variable("where", 0, 2**62), 64), a)), (1, 1, 1), (1, 1, 1))
q.submit(vk, {"where": a.va_addr + 64})
vk.hw_compute_queue_t().signal(vk.timeline_signal, vk.next_timeline()).submit(vk)
vk.synchronize(timeout=10000)
assert list(out.cpu_view().view(0, 12, "I")) == [16, 16, 512], list(out.cpu_view().view(0, 12, "I"))
bad, why = (a.va_addr + 4, "minStorageBufferOffsetAlignment") if vk.storage_buffer_alignment > 4 else (16, "not memory of this device")
q.submit(vk, {"where": bad})
vk.hw_compute_queue_t().signal(vk.timeline_signal, vk.next_timeline()).submit(vk)
try:
    vk.synchronize(timeout=10000)
except hcq.DeviceError as e:
    assert "kernel 'lengths'" in str(e) and "binding 2" in str(e) and why in str(e), e
    print("OK")
"""
    r = run(code)
    assert r.returncode == 0 and "OK" in r.stdout, f"exit status {r.returncode}\n" + r.stdout + r.stderr[-3000:]


@pytest.mark.parametrize("decl, match", [
    ("layout(std140, binding = 0) uniform U { uint x; } u;", r"binding 0 \('u'\) is a uniform block.*layout\(std430, binding = 0\) readonly buffer"),
    ("layout(binding = 1, r32ui) uniform uimage2D img;", r"binding 1 \('img'\) is an image or sampler"),
    ("layout(std430, set = 1, binding = 0) buffer S { uint x[]; };", r"descriptor set 1 \('x'\).*set = 0"),
    ("layout(std430, binding = 0) buffer S { uint x[]; } s[2];", r"binding 0 \('s'\) is an array of buffers"),
    ("layout(std430, binding = 0) buffer S { uint x[]; };\nlayout(std430, binding = 0) buffer T { uint y[]; };", r"binding 0 .*twice"),
    ("#extension GL_EXT_buffer_reference : require\nlayout(buffer_reference, std430) buffer R { uint v[]; };\n"
     "layout(buffer_reference, std430, buffer_reference_align = 8) readonly buffer Args { R out_; };\n"
     "layout(push_constant) uniform P { Args args; uint extra; };", r"push constant member 'extra' follows the argument struct"),
    ("#extension GL_EXT_buffer_reference : require\nlayout(buffer_reference, std430) buffer R { uint v[]; };\n"
     "layout(buffer_reference, std430, buffer_reference_align = 8) readonly buffer Args { R out_; };\n"
     "layout(push_constant) uniform P { Args args; };\nlayout(std430, binding = 0) buffer S { uint x[]; };", r"both storage-buffer bindings and an argument struct"),
    ("#extension GL_EXT_buffer_reference : require\nlayout(buffer_reference, std430) buffer R { uint v[]; };\n"
     "layout(push_constant) uniform P { uint n; R data; };", r"push constant member 'data' is a buffer reference"),
    ("\n".join(f"layout(std430, binding = {i}) buffer B{i} {{ uint x{i}[]; }};" for i in range(33)), r"it has 33 storage-buffer bindings"),
    (f"layout(push_constant) uniform P {{ uint v[{1 << 14}]; }};", r"push constant member 'v' is an array"),
    ("layout(push_constant) uniform P { " + " ".join(f"uint v{i};" for i in range(4096)) + " };", r"push constant block is 16384 bytes"),
], ids=["uniform-block", "image", "set-1", "buffer-array", "binding-twice", "member-after-argument-struct", "bindings-and-argument-struct",
        "push-buffer-reference", "too-many-bindings", "push-array", "push-block-too-large"])
def test_glsl_the_loader_cannot_fill_is_refused_at_compile(vk, decl, match):
    """What hcq cannot fill from a launch is refused when the kernel is compiled, saying what to write instead, never
    a kernel with parameters left unfilled."""
    src = f"#version 460\nlayout(local_size_x = 1) in;\n{decl}\nvoid main() {{}}\n"
    with pytest.raises(hcq.CompileError, match=match):
        vk.compile(src, "bad")


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


def test_copy_queues_as_many_as_asked_and_a_bad_count_is_refused(monkeypatch):
    from hcq.backends.vk.device import copy_queue_count
    for bad in ("0", "9", "two", "-1"):
        monkeypatch.setenv("HCQ_VK_COPY_QUEUES", bad)
        with pytest.raises(ValueError, match="HCQ_VK_COPY_QUEUES"):
            copy_queue_count()
    monkeypatch.setenv("HCQ_VK_COPY_QUEUES", "3")
    r = run("""
import numpy as np, hcq
vk = hcq.Device("VK")
assert vk.capabilities.queue_count("copy") == 3
a, b = vk.allocator.alloc(4096), vk.allocator.alloc(4096)
vk.allocator.copyin(a, memoryview(np.arange(1024, dtype=np.uint32)).cast("B"))
done = [vk.new_signal(value=0) for _ in range(3)]
for i in range(3): vk.hw_copy_queue_t(i).wait(vk.timeline_signal, vk.timeline_value - 1).copy(b, a, 4096).signal(done[i], 1).submit(vk)
for s in done: s.wait(1, timeout=10_000)
out = np.zeros(1024, np.uint32); vk.allocator.copyout(memoryview(out).cast("B"), b)
print("OK", (out == np.arange(1024)).all())
""", HCQ_VK_COPY_QUEUES="3")
    assert r.returncode == 0 and "OK True" in r.stdout, r.stdout + r.stderr


def test_its_own_host_mapped_memory_is_used_in_place_and_imported_memory_is_not(vk, dev):
    """`wrap_host` of memory VK itself maps (what a replica slot in it, or DLPack, hands back) is that memory at its device
    address; host memory VK imported for its copy engine is another's and is not taken for its own."""
    a = vk.allocator.alloc(4096)
    if a.view is None: pytest.skip("the device's user memory is not host-visible")
    w = vk.allocator.wrap_host(a.cpu_view().addr + 64, 128, keepalive=a)
    assert w is not None and w.va_addr == a.va_addr + 64
    c = dev.allocator.alloc(4096)
    vk.allocator.map(c)
    assert c.mappings[vk] is not c and vk.allocator._use_host(c.cpu_view().addr, 64) is None
    vk.allocator.free(w, 128)


def test_a_lost_device_hands_the_store_hook_each_signal_once_in_order():
    """With a store hook set (remote devices follow the device), a device lost mid-stream still hands the hook every
    SIGNAL once, in ring order: the values of the batches that ran, then those stored poisoned; no value goes back."""
    code = """
import ctypes, time, hcq
from hcq.packets import POISON_MASK, POISON_TAG
from hcq.backends.vk.kernels import CONFORMANCE_KERNELS as VKK
vk = hcq.Device("VK")
fill = vk.compile(*VKK["fill"])
n = 1 << 18
a = vk.allocator.alloc(4 * n)
sigs = {}  # value address -> (step, signal): each step stores its own signal
heard = []
def hook(ctx, addr, nbytes, flags, value):
    if addr in sigs:
        step, s = sigs[addr]
        heard.append((step, value, (s.load_timestamp() & POISON_MASK) == POISON_TAG))
callback = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint64)(hook)
vk.host_stores.set_hook(ctypes.cast(callback, ctypes.c_void_p).value, None)
vk.inject_device_lost(3)  # (the third submission to the Vulkan queue: each step's launch is one)
for step in range(1, 9):
    s = vk.new_signal(value=0)
    sigs[s.value_addr] = (step, s)
    fill(a, vals=(step, n), global_size=(n // 64,), local_size=(64,))
    vk.hw_compute_queue_t().signal(s, 100 + step).submit(vk)
    time.sleep(0.05)  # (each step its own batch)
deadline = time.monotonic() + 20
while len(heard) < 8 and time.monotonic() < deadline: time.sleep(0.01)
time.sleep(0.2)  # (nothing is heard twice)
vk.host_stores.set_hook(None, None)
assert [(step, value) for step, value, _ in heard] == [(i, 100 + i) for i in range(1, 9)], heard
poisoned = [p for _, _, p in heard]
assert poisoned == sorted(poisoned) and poisoned[-1] and not poisoned[0], heard  # (those that ran first, then the poisoned)
assert vk.lost() is not None
print("OK", heard)
"""
    r = run(code)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout + r.stderr


def test_a_kernel_that_never_finishes_times_out_with_a_report(vk, K):
    flag, out = vk.allocator.alloc(8), vk.allocator.alloc(4)
    flag.cpu_view().view(0, 8, "Q")[0] = 0
    K["spin"](flag, out, global_size=(1,), local_size=(1,))
    try:
        with pytest.raises(hcq.HCQTimeoutError, match=rf"(?s)timeline signal.*{vk.device} compute.*EXEC of kernel 'spin'"):
            vk.synchronize(timeout=300)
    finally:
        flag.cpu_view().view(0, 8, "Q")[0] = 1
    vk.synchronize()
    assert out.cpu_view().view(0, 4, "I")[0] == 1


def test_without_a_driver_vk_is_absent_with_the_reason(open_device, monkeypatch):
    from hcq.backends.vk import native
    monkeypatch.setattr(native.shutil, "which", lambda name: None)
    native.unavailable_reason.cache_clear()
    try:
        assert "VK" not in hcq.available_backends()
        assert "glslangValidator" in hcq.registry.unavailable_backends()["VK"]
        with pytest.raises(hcq.HCQError, match="VK is unavailable here: glslangValidator"):
            open_device("VK")
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


@pytest.mark.full
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
