"""DLPack both ways (issue 30): buffers and typed views exported to numpy, torch and JAX without copies, host arrays
imported as buffers the CPU device uses in place, lifetimes on both sides, read-only memory, and bad input."""
import gc
import importlib.util
import os
import re
import subprocess
import sys
import threading
import weakref

import numpy as np
import pytest

import hcq
import hcq.arrays as A
from hcq import dlpack

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SRC = r"""
HCQ_KERNEL void scale(float *x, float k, int n) { long i = hcq_global_id(0); if (i < n) x[i] *= k; }
HCQ_KERNEL void total(float *out, const float *x, int n) { float s = 0; for (int i = 0; i < n; i++) s += x[i]; out[0] = s; }
HCQ_KERNEL void late_fill(float *x, long spin, int n) {
  volatile long t = 0; for (long i = 0; i < spin; i++) t += i;
  for (int i = 0; i < n; i++) x[i] = 42;
}
"""


@pytest.fixture
def dlpack_prgs(dev):
    return {name: dev.compile(SRC, name) for name in ("scale", "total", "late_fill")}


def run(prg, *bufs, vals=(), n=1, wait=True):
    return prg(*bufs, global_size=(n, 1, 1), local_size=(1, 1, 1), vals=vals, wait=wait)


def settle(dev):
    """Let the allocator act on what the garbage collector and finished work released."""
    gc.collect()
    dev.synchronize()
    dev.allocator.free(dev.allocator.alloc(64), 64)


# ---------------------------------------------------------------- export
def test_a_buffer_and_its_typed_views_are_read_in_place(dev, dlpack_prgs):
    buf = A.upload(dev, np.arange(16, dtype=np.float32))
    run(dlpack_prgs["scale"], buf, vals=(3.0, 16), n=16, wait=False)  # not waited for: the export orders it (stream=None)
    arr = np.from_dlpack(buf.array("float32"))
    assert arr.ctypes.data == buf.va_addr and arr.flags.writeable
    assert (arr == np.arange(16) * 3).all()
    raw = np.from_dlpack(buf)  # the buffer itself: flat bytes
    assert raw.dtype == np.uint8 and raw.shape == (64,) and raw.ctypes.data == buf.va_addr
    grid = np.from_dlpack(buf.array(np.float32, (2, 4), strides=(8, 2), offset=0))
    assert grid.tolist() == [[0, 6, 12, 18], [24, 30, 36, 42]]
    tail = np.from_dlpack(buf.array("float32", offset=8 * 4))
    assert tail.ctypes.data == buf.va_addr + 32 and tail.shape == (8,)
    arr[0] = 99  # the consumer writes the device's memory
    assert A.download(buf, np.float32)[0] == 99


def test_legacy_consumers_get_the_legacy_capsule(dev):
    buf = A.upload(dev, np.arange(4, dtype=np.int32))

    class Legacy:  # a producer as DLPack < 1.0 consumers call it
        def __dlpack__(self, stream=None):
            return buf.array("int32").__dlpack__(stream)

        def __dlpack_device__(self):
            return buf.__dlpack_device__()
    capsule = Legacy().__dlpack__()
    assert "dltensor" in repr(capsule) and "versioned" not in repr(capsule)
    assert np.from_dlpack(Legacy()).tolist() == [0, 1, 2, 3]
    with pytest.raises(BufferError, match="read-only"):
        buf.array("int32", readonly=True).__dlpack__()  # the legacy capsule cannot say read-only


def test_an_exported_buffer_outlives_its_free_until_the_consumer_lets_go(dev):
    """Freeing a buffer a consumer holds does not hand its memory to the next allocation (nor unmap it)."""
    buf = A.upload(dev, np.full(256, 5, np.float32), hcq.BufferSpec(nolru=False))
    arr = np.from_dlpack(buf.array("float32"))
    dev.allocator.free(buf, buf.size)
    others = [A.upload(dev, np.full(256, 9, np.float32)) for _ in range(8)]  # (would reuse a released block)
    assert all(o.va_addr != buf.va_addr for o in others)
    assert (arr == 5).all()
    assert buf.base._dlpack_holds == 1
    del arr
    settle(dev)
    assert buf.base._dlpack_holds == 0 and not dev.allocator._held
    with pytest.raises(BufferError, match="was freed"):
        buf.__dlpack__()


def test_copies_and_orders(dev, dlpack_prgs):
    buf = A.upload(dev, np.ones(8, np.float32))
    copied = np.from_dlpack(buf.array("float32"), copy=True)
    assert copied.ctypes.data != buf.va_addr and (copied == 1).all()
    run(dlpack_prgs["late_fill"], buf, vals=(2_000_000, 8), wait=False)
    no_wait = buf.array("float32").__dlpack__(stream=-1)  # the consumer orders it: no synchronize
    del no_wait
    dev.synchronize()
    with pytest.raises(BufferError, match="stream=7"):
        buf.__dlpack__(stream=7)
    with pytest.raises(BufferError, match="CUDA:0"):
        buf.__dlpack__(dl_device=(dlpack.KDL_CUDA, 0))
    with pytest.raises(BufferError, match="copy=False"):
        buf.__dlpack__(dl_device=(dlpack.KDL_CUDA, 0), copy=False)


def test_bad_views_are_refused(dev):
    buf = dev.allocator.alloc(64)
    with pytest.raises(ValueError, match="reaches bytes"):
        buf.array("float32", (17,))
    with pytest.raises(ValueError, match="reaches bytes"):
        buf.array("float32", (4, 4), strides=(4, 2))
    with pytest.raises(ValueError, match="multiple"):
        buf.array("float32", offset=2)
    with pytest.raises(TypeError, match="no dtype"):
        buf.array("float7")
    with pytest.raises(ValueError, match="non-negative"):
        buf.array("uint8", (-1,))


def test_exports_from_many_threads_are_released(dev):
    buf = A.upload(dev, np.arange(1024, dtype=np.int32))
    errors = []

    def consume():
        try:
            for _ in range(300):
                assert np.from_dlpack(buf.array("int32"))[1023] == 1023
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)
    threads = [threading.Thread(target=consume) for _ in range(4)]
    for t in threads: t.start()
    for t in threads: t.join()
    gc.collect()
    assert not errors and buf.base._dlpack_holds == 0 and dlpack.exported_count() == 0


def test_a_consumer_that_refuses_the_capsule_raises_its_own_error_and_lets_go(dev):
    """numpy has no bfloat16: its from_dlpack refuses the capsule (and destroys it with its error set). That error reaches
    the caller, and the export's hold goes with the capsule, so a free of the buffer releases it."""
    buf = A.upload(dev, np.arange(8, dtype=np.float32), hcq.BufferSpec(nolru=False))
    exported = dlpack.exported_count()
    for version in ((1, 0), None):  # the versioned capsule and the legacy one, whatever numpy asks for
        class Producer:
            def __dlpack__(self, stream=None, **kw):
                return buf.array("bfloat16").__dlpack__(stream, version)

            def __dlpack_device__(self):
                return buf.__dlpack_device__()
        with pytest.raises(Exception) as e:
            np.from_dlpack(Producer())
        assert not isinstance(e.value, SystemError) and "dtype" in str(e.value), repr(e.value)
        assert buf.base._dlpack_holds == 0 and dlpack.exported_count() == exported
    dev.allocator.free(buf, buf.size)
    settle(dev)
    assert not dev.allocator._held


RAISE_WHILE_HELD = """
import gc, numpy as np, hcq, hcq.arrays as A
from hcq import dlpack
dev = hcq.Device("CPU")
buf = A.upload(dev, np.arange(8, dtype=np.float32))
def takes(arr, x): pass
try:  # the array dies while the ZeroDivisionError unwinds: numpy calls the deleter with the error set
    takes(np.from_dlpack(buf.array("float32")), 1 // 0)
except ZeroDivisionError:
    pass
gc.collect()
assert buf.base._dlpack_holds == 0 and dlpack.exported_count() == 0, (buf.base._dlpack_holds, dlpack.exported_count())
print("ok")
"""


def test_a_consumer_letting_go_while_an_exception_unwinds_keeps_the_exception():
    """(In a process of its own: before the deleter kept the error aside, this crashed the interpreter.)"""
    r = subprocess.run([sys.executable, "-c", RAISE_WHILE_HELD], capture_output=True, text=True, timeout=120, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": ROOT})
    assert r.returncode == 0 and "ok" in r.stdout and "Exception ignored" not in r.stderr, f"rc {r.returncode}\n{r.stdout}{r.stderr}"


def test_shapes_and_strides_beyond_int64_are_refused(dev):
    buf = dev.allocator.alloc(64)
    for shape, strides in (((0, 1 << 63), None), ((1,), (1 << 64,)), ((1, 2), (-(1 << 63) - 1, 1))):
        with pytest.raises(ValueError, match="int64"):
            buf.array("uint8", shape, strides)
    exported = dlpack.exported_count()
    with pytest.raises(ValueError, match=r"shape .* int64"):
        dlpack.export(buf.va_addr, (dlpack.KDL_CPU, 0), "uint8", (1 << 63,), (1,), None, versioned=True)
    with pytest.raises(ValueError, match=r"strides .* int64"):
        dlpack.export(buf.va_addr, (dlpack.KDL_CPU, 0), "uint8", (1,), (1 << 64,), None, versioned=False)
    assert dlpack.exported_count() == exported


# ---------------------------------------------------------------- import
def test_a_host_array_is_used_in_place_and_kept_alive(dev, dlpack_prgs):
    x = np.arange(8, dtype=np.float32)
    buf = A.from_dlpack(dev, x)
    assert buf.va_addr == x.ctypes.data and buf.size == x.nbytes and not buf.readonly
    assert dev.allocator.owns(buf.va_addr, 4) is buf  # (validation mode finds it)
    run(dlpack_prgs["scale"], buf, vals=(2.0, 8), n=8)
    assert x.tolist() == [0, 2, 4, 6, 8, 10, 12, 14]  # the kernel wrote the array's memory
    back = np.from_dlpack(buf.array("float32"))
    assert back.ctypes.data == x.ctypes.data  # a round trip without a copy
    ref = weakref.ref(x)
    del x, back
    gc.collect()
    assert ref() is not None  # the buffer holds its producer
    assert A.download(buf, np.float32).tolist() == [0, 2, 4, 6, 8, 10, 12, 14]
    del buf
    settle(dev)
    assert ref() is None  # collected buffer: the producer's deleter ran


def test_a_dropped_import_keeps_its_producer_until_the_kernel_using_it_finished(dev, dlpack_prgs):
    x = np.zeros(64, np.float32)
    ref = weakref.ref(x)
    buf = A.from_dlpack(dev, x)
    gate = dev.new_signal(value=0)
    args = dlpack_prgs["late_fill"].fill_kernargs((buf,), (0, 64))
    dev.hw_compute_queue_t().wait(dev.timeline_signal, dev.timeline_value - 1).wait(gate, 1) \
        .exec(dlpack_prgs["late_fill"], args, (1, 1, 1), (1, 1, 1)).signal(dev.timeline_signal, dev.next_timeline()).submit(dev)
    del buf, x, args
    gc.collect()
    dev.allocator.free(dev.allocator.alloc(64), 64)  # an allocator call while the kernel waits to run
    assert ref() is not None, "the producer was released while a kernel was still to write its memory"
    gate.value = 1
    dev.synchronize()
    assert (ref() == 42).all()
    settle(dev)
    assert ref() is None


def test_an_explicit_free_gives_the_memory_back(dev):
    x = np.ones(16, np.uint8)
    ref = weakref.ref(x)
    buf = A.from_dlpack(dev, x)
    live = dev.allocator.live
    del x
    dev.allocator.free(buf, buf.size)
    assert dev.allocator.live == live - 1
    settle(dev)
    assert ref() is None and not dev.allocator._wrapped


def test_read_only_arrays_give_read_only_buffers(dev, dlpack_prgs):
    x = np.arange(4, dtype=np.float32)
    x.flags.writeable = False
    buf = A.from_dlpack(dev, x)
    assert buf.readonly and buf.offset(4).readonly
    for wait in (False, True):  # the native launch path and the checked one
        with pytest.raises(ValueError, match="read-only memory"):
            run(dlpack_prgs["scale"], buf, vals=(2.0, 4), n=4, wait=wait)
    with pytest.raises(ValueError, match="read-only"):
        dev.allocator.copyin(buf, memoryview(bytes(16)))
    out = A.upload(dev, np.zeros(1, np.float32))
    run(dlpack_prgs["total"], out, buf, vals=(4,))  # a const parameter reads it
    assert A.download(out, np.float32)[0] == 6
    assert x.tolist() == [0, 1, 2, 3]
    back = np.from_dlpack(buf.array("float32"))
    assert not back.flags.writeable and back.ctypes.data == x.ctypes.data  # the flag goes round


def read_only_array(kind, tmp_path):
    """64 bytes (0..63) lent read-only: numpy over a bytes object, a numpy array made read-only, or a read-only memmap
    (pages mapped without write permission: a write to them is SIGSEGV)."""
    data = np.arange(64, dtype=np.uint8)
    if kind == "bytes": return np.frombuffer(data.tobytes(), np.uint8)
    if kind == "numpy":
        data.flags.writeable = False
        return data
    data.tofile(tmp_path / "ro.bin")
    return np.memmap(tmp_path / "ro.bin", np.uint8, mode="r")


READ_ONLY_KINDS = ("bytes", "numpy", "memmap")


@pytest.mark.parametrize("kind", READ_ONLY_KINDS)
def test_read_only_imports_have_read_only_host_views(dev, tmp_path, kind):
    src = read_only_array(kind, tmp_path)
    buf = A.from_dlpack(dev, src)
    assert buf.readonly and buf.va_addr == src.ctypes.data  # in place
    view = buf.cpu_view()
    assert view.raw.readonly and view.mv.readonly, "the host view of read-only memory is writable"
    assert view.view(8, 8, "I").mv.readonly and buf.offset(4).cpu_view().raw.readonly
    arr = A.view(buf, np.uint8)
    assert not arr.flags.writeable and arr.ctypes.data == src.ctypes.data
    for write in (lambda: view.__setitem__(0, 1), lambda: view.__setitem__(slice(0, 4), b"abcd"),
                  lambda: view.view(8, 8, "I").__setitem__(slice(0, 2), [1, 2]), lambda: buf.offset(4).cpu_view().__setitem__(0, 9)):
        with pytest.raises(ValueError, match="read-only memory"):
            write()
    assert view[:] == bytes(range(64)) and np.array_equal(src, np.arange(64))


@pytest.mark.parametrize("kind", READ_ONLY_KINDS)
def test_nothing_writes_read_only_memory(dev, tmp_path, kind):
    """Every path that writes device memory refuses a read-only buffer with a ValueError naming it: host copies, a transfer,
    copy_from_disk, and a raw queue's copy and write, given the buffer or its address."""
    src = read_only_array(kind, tmp_path)
    buf = A.from_dlpack(dev, src)
    other = A.upload(dev, np.full(64, 7, np.uint8))
    (tmp_path / "disk.bin").write_bytes(bytes(64))
    writes = {
        "copyin": lambda: dev.allocator.copyin(buf, memoryview(bytes(64))),
        "copyin of an offset view": lambda: A.copyin(buf.offset(8), np.zeros(8, np.uint8)),
        "transfer": lambda: dev.allocator.transfer(buf, other, 64, dev, dev),
        "copy_from_disk": lambda: dev.allocator.copy_from_disk(buf, str(tmp_path / "disk.bin"), 64),
        "copy_from_disk of an offset view": lambda: dev.allocator.copy_from_disk(buf.offset(16), (str(tmp_path / "disk.bin"), 8), 8),
        "queue copy to the buffer": lambda: dev.hw_copy_queue_t().copy(buf, other, 64).submit(dev),
        "queue copy to its address": lambda: dev.hw_copy_queue_t().copy(buf.va_addr + 8, other.va_addr, 8).submit(dev),
        "queue write to the buffer": lambda: dev.hw_compute_queue_t().write(buf, 1).submit(dev),
        "queue write to its address": lambda: dev.hw_compute_queue_t().write(buf.va_addr + 4, 1, b64=True).submit(dev),
    }
    for what, write in writes.items():
        with pytest.raises(ValueError, match=rf"<HCQBuffer 0x[0-9a-f]+ size=\d+ on {dev.device}> is read-only memory"):  # named
            write()
        dev.synchronize()
        assert np.array_equal(src, np.arange(64)), f"{what} wrote read-only memory"
    dev.allocator.copyout(memoryview(out := bytearray(64)), buf)  # reading it is fine
    assert out == bytes(range(64))


def test_validation_refuses_writes_to_read_only_memory_at_symbolic_addresses(dev, tmp_path, validating):
    """With HCQ_VALIDATE=1, a copy or write whose address is a variable is refused at submit where the value lands in
    read-only memory, and submitted where it does not."""
    from hcq.validation import ValidationError
    src = read_only_array("numpy", tmp_path)
    buf, other = A.from_dlpack(dev, src), A.upload(dev, np.full(64, 7, np.uint8))
    dst = hcq.Variable("dst", 0, (1 << 63) - 1)
    copied, written = dev.new_signal(), dev.new_signal()
    cq = dev.hw_copy_queue_t().copy(dst, other.va_addr, 8).signal(copied, 1)
    wq = dev.hw_compute_queue_t().write(dst, 5).signal(written, 1)
    for q in (cq, wq):
        with pytest.raises(ValidationError, match=rf"{re.escape(repr(buf))} is read-only memory"):
            q.submit(dev, {"dst": buf.va_addr + 8})
    target = A.upload(dev, np.zeros(64, np.uint8))
    cq.submit(dev, {"dst": target.va_addr})
    wq.submit(dev, {"dst": target.va_addr + 16})  # (another queue: not ordered after the copy)
    copied.wait(1, timeout=10_000)
    written.wait(1, timeout=10_000)
    assert np.array_equal(src, np.arange(64)) and A.download(target, np.uint8)[:20].tolist() == [7] * 8 + [0] * 8 + [5, 0, 0, 0]


@pytest.mark.full
def test_read_only_rules_hold_without_the_extension():
    """The read-only tests again with HCQ_HOTPATH=0 (the launch path and host copies through Python and ctypes)."""
    if os.environ.get("HCQ_HOTPATH") == "0": pytest.skip("already running without the extension")
    env = {**os.environ, "HCQ_HOTPATH": "0", "PYTHONPATH": ROOT}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", os.path.join(ROOT, "tests", "test_dlpack.py"),
                           "-k", "read_only and not without_the_extension"], env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0 and " passed" in proc.stdout, proc.stdout[-4000:] + proc.stderr[-2000:]


def test_graphs_refuse_read_only_memory_where_they_write(dev, dlpack_prgs):
    """A read-only buffer may replace a graph input the graph only reads, not one a kernel or a copy writes."""
    from hcq.graph import CopyItem, ExecItem, HCQGraph
    x = np.arange(1, 5, dtype=np.float32)
    x.flags.writeable = False
    ro = A.from_dlpack(dev, x)
    src, out, dst = (A.upload(dev, np.arange(4, dtype=np.float32)) for _ in range(3))
    g = HCQGraph([ExecItem(dlpack_prgs["scale"], (out,), (2.0, 4), (4, 1, 1)), ExecItem(dlpack_prgs["total"], (out, src), (4,), outs=(0,)),
                  CopyItem(dst, src, 16)], inputs=[out, src, dst])
    g([out, src, dst], wait=True)
    assert A.download(out, np.float32)[0] == 6
    for i, writer in ((0, r"item 0 \(kernel scale, parameter 'x'\)"), (2, r"item 2 \(copy destination\)")):
        inputs = [out, src, dst]
        inputs[i] = ro
        with pytest.raises(ValueError, match=rf"input {i}: .* is read-only memory, and {writer} writes it"):
            g(inputs)
    g([out, ro, dst], wait=True)  # input 1 is only read (const x of total, the copy's source)
    assert A.download(out, np.float32)[0] == 10 and A.download(dst, np.float32).tolist() == [1, 2, 3, 4]
    with pytest.raises(ValueError, match="CopyItem dest .* is read-only memory"):
        HCQGraph([CopyItem(ro, src, 16)])
    assert x.tolist() == [1, 2, 3, 4]


def test_strided_and_foreign_input(dev):
    x = np.arange(32, dtype=np.int16)[::2]
    buf = A.from_dlpack(dev, x)  # not contiguous: a copy in row-major order
    assert buf.va_addr != x.ctypes.data and A.download(buf, np.int16).tolist() == x.tolist()
    with pytest.raises(BufferError, match="not C-contiguous"):
        A.from_dlpack(dev, x, copy=False)
    y = np.arange(4, dtype=np.int64)
    copied = A.from_dlpack(dev, y, copy=True)
    assert copied.va_addr != y.ctypes.data and A.download(copied, np.int64).tolist() == [0, 1, 2, 3]
    with pytest.raises(TypeError, match="__dlpack__"):
        A.from_dlpack(dev, [1, 2, 3])

    class OnCuda:
        def __dlpack__(self, **kw):
            raise AssertionError("not asked")

        def __dlpack_device__(self):
            return (dlpack.KDL_CUDA, 1)
    with pytest.raises(BufferError, match="CUDA:1"):
        A.from_dlpack(dev, OnCuda())
    with pytest.raises(BufferError, match="not a DLPack capsule"):
        dlpack.consume(object())


# ---------------------------------------------------------------- other libraries
def test_torch_both_ways(dev, dlpack_prgs):
    torch = pytest.importorskip("torch", reason="torch is not installed (pip install torch)")
    t = torch.arange(8, dtype=torch.float32)
    buf = A.from_dlpack(dev, t)
    assert buf.va_addr == t.data_ptr()
    run(dlpack_prgs["scale"], buf, vals=(0.5, 8), n=8)  # a kernel writes the tensor's memory
    assert t.tolist() == [x / 2 for x in range(8)]
    back = torch.from_dlpack(buf.array("float32", (2, 4)))
    assert back.data_ptr() == t.data_ptr() and back.shape == (2, 4)
    del t
    gc.collect()
    assert back[1, 3].item() == 3.5  # the tensor's memory lives on in the buffer
    out = A.upload(dev, np.zeros(1, np.float32))
    run(dlpack_prgs["total"], out, A.from_dlpack(dev, torch.ones(10)), vals=(10,))
    assert torch.from_dlpack(out.array("float32"))[0].item() == 10


JAX_SCRIPT = """
import jax, jax.numpy as jnp, numpy as np, hcq, hcq.arrays as A
dev = hcq.Device("CPU")
buf = A.upload(dev, np.arange(6, dtype=np.float32))
j = jax.dlpack.from_dlpack(buf.array("float32", (2, 3)))
assert j.shape == (2, 3) and j.sum().item() == 15
back = A.from_dlpack(dev, jnp.arange(5, dtype=jnp.int32))
assert A.download(back, np.int32).tolist() == [0, 1, 2, 3, 4]
print("ok")
"""


def test_jax_both_ways():
    """(In a process of its own: JAX starts threads and a garbage-collector hook that other tests' Ctrl-Cs would hit.)"""
    if importlib.util.find_spec("jax") is None: pytest.skip("jax is not installed (pip install jax)")
    r = subprocess.run([sys.executable, "-c", JAX_SCRIPT], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout + r.stderr


def test_hcq_to_hcq_to_numpy_releases_in_a_chain(dev):
    """An hcq buffer imported from an hcq export and exported again: dropping the last consumer releases both tensors
    (the inner deleter runs while the outer one is being released)."""
    inner = A.upload(dev, np.arange(8, dtype=np.int32))
    outer = A.from_dlpack(dev, inner.array("int32"))
    assert outer.va_addr == inner.va_addr  # in place: the CPU device uses its own host memory
    arr = np.from_dlpack(outer.array("int32"))
    del outer
    gc.collect()
    assert arr.tolist() == list(range(8))
    del arr
    settle(dev)
    assert dlpack.exported_count() == 0 and inner.base._dlpack_holds == 0
