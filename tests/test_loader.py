"""hcq's in-process loader for kernel objects (hcq/backends/cpu/loader.py): what it relocates (constants, tables of
pointers, jump tables, globals, calls into libm, data of the process), what it refuses (and the shared-object build
that takes over), sealed code pages, and the same results from kernels built for dlopen (HCQ_CPU_DLOPEN=1)."""
import ctypes
import math
import uuid

import numpy as np
import pytest

import hcq
from hcq.backends.cpu import loader
from hcq.backends.cpu.compiler import CPUCompiler, load_library

from helpers import alloc, arr

pytestmark = pytest.mark.skipif(not loader.SUPPORTED, reason="the loader takes x86-64 objects")

RELOCATIONS = """
extern char **environ;                                 /* data of the process: a GOT slot */
static const float scale[4] = {1.5f, 2.5f, 3.5f, 4.5f};
static int twice(int x) { return 2 * x; }
static int square(int x) { return x * x; }
static int (*const ops[2])(int) = {twice, square};  /* pointers in data: absolute relocations */
static int launches;                                 /* a writable global, kept across launches */
static const char *names[3] = {"zero", "one", "two"};
static int pick(int i) {                             /* a jump table */
  switch (i % 7) { case 0: return 11; case 1: return 23; case 2: return 37; case 3: return 41; case 4: return 53;
                   case 5: return 67; default: return 79; }
}
static long local_id_of_helper(void) { return hcq_local_id(0); }  /* the context, read outside the kernel body */
HCQ_KERNEL void relocs(float *f, int *i, long *env, int n) {
  int g = (int)hcq_global_id(0);
  if (g == 0) { env[0] = (long)environ; env[1] = ++launches; env[2] = names[2][1]; }
  if (g >= n) return;
  f[g] = sinf((float)g) * scale[g % 4];
  i[g] = ops[g % 2](g) + pick(g) + 1000 * (int)local_id_of_helper();
}
"""


def expected(n: int, local: int) -> tuple[np.ndarray, np.ndarray]:
    g = np.arange(n)
    f = np.sin(g.astype(np.float32)) * np.array([1.5, 2.5, 3.5, 4.5], np.float32)[g % 4]
    i = np.where(g % 2 == 0, 2 * g, g * g) + np.array([11, 23, 37, 41, 53, 67, 79])[g % 7] + 1000 * (g % local)
    return f.astype(np.float32), i


@pytest.fixture(params=["loader", "dlopen"])
def build_mode(request, monkeypatch, tmp_path):
    monkeypatch.setenv("HCQ_CACHE_DIR", str(tmp_path))
    if request.param == "dlopen": monkeypatch.setenv("HCQ_CPU_DLOPEN", "1")
    return request.param


def unique(src: str, name: str) -> tuple[str, str]:
    new = f"{name}_{uuid.uuid4().hex[:8]}"
    return src.replace(f" {name}(", f" {new}("), new


def test_relocated_kernel_computes_what_its_source_says(dev, build_mode):
    src, name = unique(RELOCATIONS, "relocs")
    lib = CPUCompiler().compile(src)
    assert lib[16] == (1 if build_mode == "loader" else 3), "ET_REL for the loader, ET_DYN for dlopen"
    prg = dev.runtime(dev, name, lib)
    n, local = 1000, 64
    f, i, env = alloc(dev, 4 * n), alloc(dev, 4 * n), alloc(dev, 24)
    for launch in (1, 2):
        prg(f, i, env, vals=(n,), global_size=((n + local - 1) // local, 1, 1), local_size=(local, 1, 1), wait=True)
        want_f, want_i = expected(n, local)
        np.testing.assert_allclose(arr(f, np.float32)[:n], want_f, rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(arr(i, np.int32)[:n], want_i)
        environ = ctypes.c_void_p.in_dll(ctypes.CDLL(None), "environ").value
        assert list(arr(env, np.int64)) == [environ, launch, ord("w")]  # the process's data; a global kept across launches


def test_a_kernel_that_needs_the_dynamic_linker_is_linked_instead(dev, tmp_path, monkeypatch):
    """A thread-local of the kernel's own: the loader refuses the object at build time, so a shared object is built."""
    monkeypatch.setenv("HCQ_CACHE_DIR", str(tmp_path))
    src, name = unique("static _Thread_local int calls;\nHCQ_KERNEL void tls(int *o) { o[hcq_global_id(0)] = ++calls; }", "tls")
    lib = CPUCompiler().compile(src)
    assert lib[16] == 3, "a shared object"
    prg = dev.runtime(dev, name, lib)
    out = alloc(dev, 16)
    prg(out, global_size=(4, 1, 1), wait=True)
    assert all(v >= 1 for v in arr(out, np.int32))


def test_refusals_say_why():
    assert "malformed" in loader.refusal(b"\x7fELF\x02\x01" + b"\0" * 10)
    assert "little-endian ELF64" in loader.refusal(b"not an object at all, but long enough for a header" * 2)
    lib = CPUCompiler().compile(f"HCQ_KERNEL void ok_{uuid.uuid4().hex[:8]}(int *o) {{ o[0] = 1; }}")
    assert loader.refusal(lib) is None
    with pytest.raises(hcq.CompileError, match="malformed kernel object"):
        loader.LoadedObject(lib[:200])


def test_a_symbol_nobody_defines_is_named_at_load(dev, tmp_path, monkeypatch):
    monkeypatch.setenv("HCQ_CACHE_DIR", str(tmp_path))
    src, name = unique("extern void hcq_test_no_such_function(int *);\nHCQ_KERNEL void undef(int *o) { hcq_test_no_such_function(o); }", "undef")
    with pytest.raises(hcq.CompileError, match="hcq_test_no_such_function"):
        dev.compile(src, name)


@pytest.mark.usefixtures("no_validation")
def test_loaded_code_is_not_writable(dev):
    """Code pages are sealed read+execute before anything runs: a kernel that writes into its own code faults (and the
    device says which kernel), instead of rewriting itself."""
    src, name = unique("__attribute__((noinline)) int selfmod_target(int x) { return x + 1; }\n"
                       "HCQ_KERNEL void selfmod(int *o) { o[0] = selfmod_target(o[0]); *(volatile unsigned char *)(void *)selfmod_target = 0xc3; }\n",
                       "selfmod")
    prg = dev.compile(src, name)
    out = dev.allocator.alloc(16)
    with pytest.raises(hcq.DeviceError, match=rf"kernel '{name}' faulted in block 0: Segmentation fault"):
        prg(out, wait=True)


def test_a_library_is_loaded_once_and_shared():
    lib = CPUCompiler().compile(f"HCQ_KERNEL void shared_{uuid.uuid4().hex[:8]}(int *o) {{ o[0] = 1; }}")
    first = load_library(lib)
    assert load_library(lib) is first and isinstance(first.image, loader.LoadedObject)
    (slots, size, entry), = first.kernels.values()
    assert first.image.base <= entry < first.image.base + first.image.size and size == 8 and slots[0].is_pointer
    assert math.gcd(first.image.base, loader.PAGE) == loader.PAGE


def test_a_relocation_outside_its_section_is_refused_not_applied():
    """A corrupt object (here: a relocation's offset pointed past its section) is refused with a message; nothing is
    written outside the mapping."""
    lib = bytearray(CPUCompiler().compile(f"HCQ_KERNEL void rel_{uuid.uuid4().hex[:8]}(float *o) {{ o[0] = sinf(o[1]); }}"))
    obj = loader.ObjectFile(bytes(lib))
    rela = next(s for s in obj.sections if s.type == loader.SHT_RELA and obj.sections[s.info].name == ".text")
    lib[rela.offset:rela.offset + 8] = (obj.sections[rela.info].size + (1 << 20)).to_bytes(8, "little")
    assert "points outside its section" in loader.refusal(bytes(lib))
    with pytest.raises(hcq.CompileError, match="points outside its section"):
        loader.LoadedObject(bytes(lib))


def test_threads_loading_the_same_new_kernel_at_once(dev, tmp_path, monkeypatch):
    """Eight threads build and load one new kernel together: each gets a working program."""
    import threading
    monkeypatch.setenv("HCQ_CACHE_DIR", str(tmp_path))
    src, name = unique("HCQ_KERNEL void same(int *o, int v) { o[hcq_global_id(0)] = v; }", "same")
    bufs = [alloc(dev, 64) for _ in range(8)]
    errors: list[BaseException] = []
    start = threading.Barrier(8)

    def work(i: int) -> None:
        try:
            start.wait()
            dev.compile(src, name)(bufs[i], vals=(i + 1,), global_size=(16, 1, 1), wait=True)
        except BaseException as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads: t.start()
    for t in threads: t.join(60)
    assert not errors, errors
    for i, b in enumerate(bufs): assert list(arr(b, np.int32)) == [i + 1] * 16


def test_a_policy_against_executable_memory_is_named_with_the_way_out(monkeypatch):
    """Where mprotect refuses executable pages (SELinux deny_execmem, PaX), the error says so and names HCQ_CPU_DLOPEN."""
    import errno
    lib = CPUCompiler().compile(f"HCQ_KERNEL void sealed_{uuid.uuid4().hex[:8]}(int *o) {{ o[0] = 1; }}")

    class Refusing:
        def mprotect(self, addr, size, prot):
            ctypes.set_errno(errno.EACCES)
            return -1
    monkeypatch.setattr(loader, "_libc", Refusing())
    with pytest.raises(hcq.CompileError, match="Permission denied.*HCQ_CPU_DLOPEN=1"):
        loader.LoadedObject(lib)


@pytest.mark.parametrize("cc", ["gcc", "clang"])
def test_both_compilers_objects_load_in_process(dev, tmp_path, monkeypatch, clear_find_compiler, cc):
    """gcc's objects and clang's differ (gcc lists _GLOBAL_OFFSET_TABLE_ as undefined, unused): both load without a linker."""
    import shutil
    if shutil.which(cc) is None: pytest.skip(f"no {cc} here")
    monkeypatch.setenv("HCQ_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", cc)
    src, name = unique(RELOCATIONS, "relocs")
    lib = CPUCompiler().compile(src)
    assert lib[16] == 1, f"{cc}'s object was linked instead: {loader.refusal(lib)}"
    n, local = 256, 32
    f, i, env = alloc(dev, 4 * n), alloc(dev, 4 * n), alloc(dev, 24)
    dev.runtime(dev, name, lib)(f, i, env, vals=(n,), global_size=(n // local, 1, 1), local_size=(local, 1, 1), wait=True)
    want_f, want_i = expected(n, local)
    np.testing.assert_allclose(arr(f, np.float32)[:n], want_f, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(arr(i, np.int32)[:n], want_i)


def test_on_other_machines_kernels_are_linked(dev, tmp_path, monkeypatch):
    """Where the loader does not apply (another architecture), kernels are built as shared objects and dlopen()ed."""
    monkeypatch.setenv("HCQ_CACHE_DIR", str(tmp_path))
    lib = CPUCompiler().compile(f"HCQ_KERNEL void here_{uuid.uuid4().hex[:8]}(int *o) {{ o[0] = 1; }}")
    monkeypatch.setattr(loader, "SUPPORTED", False)
    with pytest.raises(hcq.CompileError, match="x86-64 objects only"):
        loader.LoadedObject(lib)
    src, name = unique("HCQ_KERNEL void elsewhere(int *o) { o[hcq_global_id(0)] = 7; }", "elsewhere")
    linked = CPUCompiler().compile(src)
    assert linked[16] == 3, "a shared object"
    out = alloc(dev, 16)
    dev.runtime(dev, name, linked)(out, global_size=(4, 1, 1), wait=True)
    assert list(arr(out, np.int32)) == [7] * 4
