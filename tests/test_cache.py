"""The on-disk compile cache under attack and under load: planted and non-regular entries, unsafe cache
directories, concurrent first use, corrupt entries, edited headers, unusable cache locations and a hanging
compiler."""
import hashlib
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

import hcq
from hcq import BufferSpec
from hcq import compile_server, helpers, hotpath, toolchain
from hcq.backends.cpu import compiler, native
from hcq.backends.cpu import device as cpu_device
from hcq.backends.cpu.compiler import CPUCompiler, load_library
from helpers import wait_gone

SPEC = BufferSpec(cpu_access=True)
ROOT = Path(__file__).resolve().parents[1]
IS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0
OTHER_UID = 4242

# Run in a fresh process: open a device, then for each [source, kernel name, v, expected] in the JSON list argv[1]
# compile the source, run the kernel with value v and check that it stores the expected value. With HCQ_TEST_GO
# set, first report ready (a file in the folder HCQ_TEST_READY) and wait for that file to appear.
SCRIPT = r"""
import json, os, sys, time
import hcq
from hcq import BufferSpec
go, ready = os.environ.get("HCQ_TEST_GO"), os.environ.get("HCQ_TEST_READY")
if go:
    open(os.path.join(ready, str(os.getpid())), "w").close()
    deadline = time.monotonic() + 60
    while not os.path.exists(go) and time.monotonic() < deadline: time.sleep(0.002)
dev = hcq.Device("CPU")
buf = dev.allocator.alloc(8, BufferSpec(cpu_access=True))
for _ in range(2):  # twice: the second compile is a cache hit
    for src, name, v, want in json.loads(sys.argv[1]):
        dev.compile(src, name)(buf, vals=(v,), wait=True)
        got = buf.cpu_view().view(fmt="i")[0]
        if got != want: sys.exit(f"{name}: wrong result {got}, expected {want}")
print("OK")
"""


def kernel_src(add: int = 0, pad: int = 0) -> tuple[str, str]:
    """A never-seen kernel storing v * 2 + add; `pad` bytes of constant data make its library bigger (so it
    takes longer to write)."""
    name = f"k_{uuid.uuid4().hex[:12]}"
    data = f"__attribute__((used)) static const char pad_{name}[{pad}] = {{1}};\n" if pad else ""
    return f"{data}HCQ_KERNEL void {name}(int *o, int v) {{ o[0] = v * 2 + {add}; }}", name


def child_env(**env: str | None) -> dict[str, str]:
    out = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for k, v in env.items():
        if v is None: out.pop(k, None)
        else: out[k] = v
    return out


def child_args(kernels: list[tuple[str, str, int]], v: int = 5) -> list[str]:
    """The command line running SCRIPT on (source, name, add) kernels made by kernel_src."""
    return [sys.executable, "-c", SCRIPT, json.dumps([(src, name, v, v * 2 + add) for src, name, add in kernels])]


def run_child(src: str, name: str, env: dict[str, str], add: int = 0) -> subprocess.CompletedProcess:
    return subprocess.run(child_args([(src, name, add)]), env=env, capture_output=True, text=True, timeout=120)


def alloc(dev, n):
    return dev.allocator.alloc(n, SPEC)


def run_kernel(dev, prg, v: int) -> int:
    buf = alloc(dev, 8)
    try:
        prg(buf, vals=(v,), wait=True)
        return int(np.frombuffer(buf.cpu_view().mv, np.int32)[0])
    finally:
        dev.allocator.free(buf, 8, SPEC)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A fresh private cache directory for this test."""
    d = tmp_path / "cache"
    monkeypatch.setenv("HCQ_CACHE_DIR", str(d))
    return d


def kernel_entries(d: Path) -> set[Path]:
    return set(d.glob("hcq-kernel-*.lib"))


def compile_entry(dev, d: Path, src: str, name: str) -> tuple[object, Path]:
    """Compile `src` and return (program, the cache entry it created)."""
    before = kernel_entries(d)
    prg = dev.compile(src, name)
    (entry,) = kernel_entries(d) - before
    return prg, entry


def meta(entry: Path) -> Path:
    return entry.with_name(entry.name + ".meta")


# ---------------------------------------------------------------- 7: permissions and planted entries
def test_cache_dir_and_entries_are_private(dev, cache, compiler_runs):
    assert toolchain.cache_dir() == cache and mode(cache) == 0o700
    src, name = kernel_src()
    _, entry = compile_entry(dev, cache, src, name)
    assert (mode(entry), mode(meta(entry))) == (0o600, 0o600)
    assert not list(cache.glob("hcq-lib-*")), "an object loaded in-process needs no loadable copy"
    assert not [p for p in cache.iterdir() if p.name.endswith(".tmp")]  # no temporaries left behind


def plant(dev, cache: Path, how: str) -> tuple[str, str, Path, bytes]:
    """Compile a good kernel, then put an evil build (same name and signature, stores 666) in its entry's place
    as `how` says. Returns (source, name, entry, the good entry's bytes)."""
    src, name = kernel_src()
    _, entry = compile_entry(dev, cache, src, name)
    good = entry.read_bytes()
    _, evil = compile_entry(dev, cache, src.replace("v * 2 + 0", "666"), name)
    for e in (entry, meta(entry)): e.unlink()
    if how == "symlink":
        entry.symlink_to(evil)
    elif how == "fifo":
        os.mkfifo(entry, 0o600)
    else:
        shutil.copyfile(evil, entry)
    shutil.copyfile(meta(evil), meta(entry))  # a sidecar that matches the evil bytes
    if how.startswith("mode"):
        for e in (entry, meta(entry)): os.chmod(e, int(how[4:], 8))
    if how == "other-owner":
        for e in (entry, meta(entry)): os.chown(e, OTHER_UID, -1)
    return src, name, entry, good


@pytest.mark.parametrize("how", ["mode0666", "mode0620", "symlink", "fifo",
                                 pytest.param("other-owner", marks=pytest.mark.skipif(not IS_ROOT, reason="chown needs root"))])
def test_untrustworthy_entry_is_rebuilt_not_loaded(dev, cache, compiler_runs, how):
    src, name, entry, good = plant(dev, cache, how)
    runs = len(compiler_runs)
    assert run_kernel(dev, dev.compile(src, name), 4) == 8, "the planted library ran"
    assert len(compiler_runs) == runs + 1
    assert entry.read_bytes() == good and not entry.is_symlink() and mode(entry) == 0o600
    assert entry.stat().st_uid == os.geteuid() and meta(entry).stat().st_uid == os.geteuid()


def test_planted_entry_with_safe_mode_is_used(dev, cache, compiler_runs):
    """The control for the test above: the planted files are well-formed, so it is their mode that is refused."""
    src, name, _, _ = plant(dev, cache, "mode0600")
    assert run_kernel(dev, dev.compile(src, name), 4) == 666


@pytest.mark.parametrize("garbage_mode", [0o666, 0o600])
def test_untrustworthy_loaded_library_is_rewritten(dev, cache, garbage_mode, monkeypatch):
    """hcq-lib-<hash>.so, the copy that is dlopen()ed (HCQ_CPU_DLOPEN=1): a planted or corrupt file under its name is replaced."""
    monkeypatch.setenv("HCQ_CPU_DLOPEN", "1")
    src, name = kernel_src()
    lib = CPUCompiler().compile(src)
    key = hashlib.sha256(lib).hexdigest()[:24]
    path = cache / f"hcq-lib-{key}.so"
    path.write_bytes(b"\x7fELF garbage")
    os.chmod(path, garbage_mode)
    compiler._loaded.pop(key, None)
    loaded = load_library(lib)
    assert name in loaded.kernels
    assert path.read_bytes() == lib and mode(path) == 0o700


# ---------------------------------------------------------------- 7 + 11: unusable cache locations fall back
def _group_writable(tmp: Path) -> dict[str, str | None]:
    d = tmp / "shared"
    d.mkdir()
    os.chmod(d, 0o777)
    return {"HCQ_CACHE_DIR": str(d)}


def _other_owner(tmp: Path) -> dict[str, str | None]:
    d = tmp / "theirs"
    d.mkdir(mode=0o700)
    os.chown(d, OTHER_UID, -1)
    return {"HCQ_CACHE_DIR": str(d)}


def _under_a_file(tmp: Path) -> dict[str, str | None]:
    (tmp / "afile").write_text("not a directory")
    return {"HCQ_CACHE_DIR": str(tmp / "afile" / "sub")}


def _unusable_home(tmp: Path) -> dict[str, str | None]:
    (tmp / "afile").write_text("not a directory")
    return {"HCQ_CACHE_DIR": None, "XDG_CACHE_HOME": None, "HOME": str(tmp / "afile" / "home")}


@pytest.mark.full
@pytest.mark.parametrize("setup,problem", [
    (_group_writable, "writable by group or others"),
    pytest.param(_other_owner, "owned by uid", marks=pytest.mark.skipif(not IS_ROOT, reason="chown needs root")),
    (_under_a_file, "cannot create"),
    (_unusable_home, "cannot create"),
])
def test_unusable_cache_dir_falls_back_with_one_warning(tmp_path, setup, problem):
    env = setup(tmp_path)
    src, name = kernel_src(1)
    res = run_child(src, name, child_env(**env), add=1)
    assert res.returncode == 0 and "OK" in res.stdout, res.stderr
    assert res.stderr.count("CacheWarning") == 1, res.stderr
    assert problem in res.stderr and "HCQ_CACHE_DIR" in res.stderr
    if env.get("HCQ_CACHE_DIR") and os.path.isdir(env["HCQ_CACHE_DIR"]):
        assert not os.listdir(env["HCQ_CACHE_DIR"]), "wrote into a refused cache directory"


def test_fallback_dir_is_private_and_made_once(tmp_path, monkeypatch):
    monkeypatch.setattr(toolchain, "_fallback", None)
    monkeypatch.setattr(toolchain, "_warned", set())
    (tmp_path / "afile").write_text("")
    monkeypatch.setenv("HCQ_CACHE_DIR", str(tmp_path / "afile" / "sub"))
    with pytest.warns(toolchain.CacheWarning, match="HCQ_CACHE_DIR"):
        first = toolchain.cache_dir()
    assert toolchain.cache_dir() == first and mode(first) == 0o700
    shutil.rmtree(first)


# ---------------------------------------------------------------- 8: concurrent first use
@pytest.mark.full
def test_concurrent_processes_build_and_load_safely(tmp_path, monkeypatch):
    """Many processes start at once on a shared cache and run the same new kernels. 8 find the command processor
    and the kernels built but their loadable copies (hcq-lib-*) missing, so they all write and load those at the
    same moment (kernels built as shared objects: HCQ_CPU_DLOPEN=1); 4 start from an empty cache, so they build the
    command processor and a kernel concurrently too. (16 and 8 with HCQ_SLOW=1: 12 processes released at once
    already outnumber the CPUs several times, so their writes and builds overlap as they do with 24.)"""
    n_warm, n_cold = (16, 8) if os.environ.get("HCQ_SLOW") == "1" else (8, 4)
    warm, cold, ready, go = tmp_path / "warm", tmp_path / "cold", tmp_path / "ready", tmp_path / "go"
    ready.mkdir()
    monkeypatch.setenv("HCQ_CPU_DLOPEN", "1")
    kernels = [(*kernel_src(add, pad=4 << 20), add) for add in range(4)]  # big: slow to write, so writes overlap
    monkeypatch.setenv("HCQ_CACHE_DIR", str(warm))
    toolchain.build_shared_object(native.cp_source(), native.CP_FLAGS, "hcq-cp")
    for src, _, _ in kernels: CPUCompiler().compile(src)
    assert not list(warm.glob("hcq-lib-*"))
    env_warm = child_env(HCQ_CACHE_DIR=str(warm), HCQ_TEST_GO=str(go), HCQ_TEST_READY=str(ready))
    env_cold = {k: v for k, v in env_warm.items() if k != "HCQ_CPU_DLOPEN"} | {"HCQ_CACHE_DIR": str(cold)}  # (hcq's loader)
    procs = [subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for args, env in [(child_args(kernels), env_warm)] * n_warm + [(child_args([(*kernel_src(9), 9)]), env_cold)] * n_cold]
    try:
        deadline = time.monotonic() + 60
        while len(os.listdir(ready)) < len(procs) and time.monotonic() < deadline: time.sleep(0.01)
        go.touch()
        results = [(p.wait(timeout=120), *p.communicate()) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None: p.kill()
    bad = [(rc, err[-800:]) for rc, out, err in results if rc != 0 or "OK" not in out]
    assert not bad, f"{len(bad)} of {len(procs)} processes failed: {bad[:3]}"
    leftovers = [p.name for d in (warm, cold) for p in d.iterdir() if p.name.endswith(".tmp")]
    assert not leftovers
    shutil.rmtree(warm)  # tens of MB


# ---------------------------------------------------------------- 9: corrupt entries
@pytest.mark.full
@pytest.mark.parametrize("dlopen", [False, True])
def test_truncated_entries_are_rebuilt(tmp_path, dlopen):
    """Truncated command-processor, kernel and (HCQ_CPU_DLOPEN=1) loaded-library files: a new process still works and
    rebuilds them."""
    env = child_env(HCQ_CACHE_DIR=str(tmp_path), HCQ_CPU_DLOPEN="1" if dlopen else None)
    src, name = kernel_src(2)
    res = run_child(src, name, env, add=2)
    assert res.returncode == 0, res.stderr
    sos = {p: p.read_bytes() for p in tmp_path.iterdir() if p.suffix in (".so", ".lib")}
    # ("compile": the compile server's preload library, built for the first compile step it takes)
    served = {"compile"} if compile_server.enabled() and not dlopen else set()
    # ("timeline": without the extension, the kernargs ring's take, hcq/timeline_ring.h, is a library too)
    served |= set() if hotpath.available() else {"timeline"}
    assert {p.name.split("-")[1] for p in sos} == ({"cp", "kernel", "lib"} if dlopen else {"cp", "kernel"}) | served
    for p, data in sos.items(): p.write_bytes(data[:len(data) // 3])
    res = run_child(src, name, env, add=2)
    assert res.returncode == 0 and "OK" in res.stdout, res.stderr
    assert {p: p.read_bytes() for p in sos} == sos


@pytest.mark.parametrize("damage", ["truncate entry", "flip a byte", "delete sidecar", "garbage sidecar", "sidecar of another entry"])
def test_damaged_kernel_entry_is_rebuilt(dev, cache, compiler_runs, damage):
    src, name = kernel_src()
    _, entry = compile_entry(dev, cache, src, name)
    good = entry.read_bytes()
    if damage == "truncate entry": entry.write_bytes(good[:100])
    elif damage == "flip a byte": entry.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))
    elif damage == "delete sidecar": meta(entry).unlink()
    elif damage == "garbage sidecar": meta(entry).write_text("{not json")
    else:
        _, other = compile_entry(dev, cache, *kernel_src())
        meta(entry).write_bytes(meta(other).read_bytes())
    runs = len(compiler_runs)
    assert CPUCompiler().compile(src) == good
    assert len(compiler_runs) == runs + 1
    assert json.loads(meta(entry).read_text())["sha256"] == hashlib.sha256(good).hexdigest()


# ---------------------------------------------------------------- 10: included headers
@pytest.mark.parametrize("include", ["absolute", "-I"])
def test_editing_an_included_header_rebuilds(dev, cache, compiler_runs, tmp_path, monkeypatch, include):
    header = tmp_path / "inc" / "hcq_test_value.h"
    header.parent.mkdir()
    header.write_text("#define HCQ_TEST_VALUE 7\n")
    if include == "-I": monkeypatch.setenv("HCQ_CPU_CFLAGS", f"-I{header.parent}")
    name = f"k_{uuid.uuid4().hex[:12]}"
    src = f'#include "{header if include == "absolute" else header.name}"\nHCQ_KERNEL void {name}(int *o, int v) {{ o[0] = v + HCQ_TEST_VALUE; }}'

    def build_and_run() -> int:
        return run_kernel(dev, dev.runtime(dev, name, CPUCompiler().compile(src)), 100)

    assert build_and_run() == 107
    assert build_and_run() == 107 and len(compiler_runs) == 1, "an unchanged header must be a cache hit"
    header.write_text("#define HCQ_TEST_VALUE 9\n")
    assert build_and_run() == 109 and len(compiler_runs) == 2
    header.unlink()
    with pytest.raises(hcq.CompileError, match="hcq_test_value.h"):
        build_and_run()


# ---------------------------------------------------------------- 12: compiler timeout
@pytest.mark.full
def test_hanging_compiler_times_out_and_is_killed(dev, cache, tmp_path, monkeypatch, clear_find_compiler):
    pids = tmp_path / "pids"
    cc = tmp_path / "slow-cc"
    cc.write_text(f"#!/bin/sh\nif [ \"$1\" = --version ]; then echo slow-cc 1.0; exit 0; fi\n"
                  f"sleep 60 &\necho $$ $! > {pids}\nwait\n")
    cc.chmod(0o755)
    monkeypatch.setenv("CC", str(cc))
    monkeypatch.setenv("HCQ_COMPILE_TIMEOUT_S", "1")
    t = time.monotonic()
    with pytest.raises(hcq.CompileError, match=r"(?s)slow-cc.*1 s.*HCQ_COMPILE_TIMEOUT_S"):
        dev.compile(*kernel_src())  # (the message carries the runtime's own limit, 1 s: matched above)
    assert time.monotonic() - t < 30  # a hang guard only: an unenforced limit leaves the compiler its 60 s sleep
    assert wait_gone([int(p) for p in pids.read_text().split()], within=30), "the compiler's processes outlived the timeout"  # (60 s unkilled)


def test_bad_compile_timeout_value_is_named(dev, cache, monkeypatch):
    monkeypatch.setenv("HCQ_COMPILE_TIMEOUT_S", "soon")
    with pytest.raises(ValueError, match="HCQ_COMPILE_TIMEOUT_S"):
        dev.compile(*kernel_src())


# ---------------------------------------------------------------- native code and the host CPU
@pytest.mark.full
@pytest.mark.parametrize("cflags,native,keyed", [("-march=native", "0", True), ("-O3 -mtune=native", "0", True), ("-mcpu=native", "0", True),
                                                 ("", "1", True), ("-O3", "0", False)])
def test_native_code_is_keyed_by_the_host_cpu_however_asked_for(cache, compiler_runs, monkeypatch, cflags, native, keyed):
    """Flags that ask for this CPU's code (-march, -mcpu or -mtune=native) make the host CPU part of the cache key,
    whether they come from HCQ_CPU_CFLAGS or the default: a cache shared with another CPU never hands it this
    CPU's build. Portable flags keep one entry for every CPU."""
    monkeypatch.setenv("HCQ_CPU_CFLAGS", cflags)
    monkeypatch.setenv("HCQ_CPU_NATIVE", native)
    builds = lambda tag: sum(any(str(arg).endswith(f"/{tag}.c") for arg in cmd) for cmd in compiler_runs)  # noqa: E731
    src, _ = kernel_src()
    lib, flags = "int hcq_test_native(void) { return 1; }", ("-O2", *cflags.split())
    for _ in range(2):  # the same CPU: the second time from the cache
        CPUCompiler().compile(src)
        toolchain.build_shared_object(lib, flags, "hcq-test-native")  # (any build of the toolchain, not only kernels)
    assert builds("hcq-kernel") == builds("hcq-test-native") == 1
    monkeypatch.setattr(toolchain, "host_cpu_tag", lambda: "another-cpu", raising=False)  # (as a second machine sees it)
    CPUCompiler().compile(src)
    toolchain.build_shared_object(lib, flags, "hcq-test-native")
    why = "a build for this host's CPU was handed to another CPU" if keyed else "a portable build was not shared"
    assert builds("hcq-kernel") == (2 if keyed else 1), why
    assert builds("hcq-test-native") == (2 if "native" in cflags else 1), why


# ---------------------------------------------------------------- settings
def _open_cpu(dev, open_device) -> None:
    open_device()


def _graph_of_one_copy(dev, open_device) -> None:
    a, b = alloc(dev, 64), alloc(dev, 64)
    hcq.HCQGraph([hcq.CopyItem(a, b, 64)])


DEVICE_READS = (_open_cpu, _graph_of_one_copy)  # (reads given the test's device and its open_device)


@pytest.mark.parametrize("var,value,read", [
    ("HCQ_CPU_MAP_RESERVE", "-1", lambda: cpu_device._MapBudget()), ("HCQ_CPU_MAP_RESERVE", str(1 << 40), lambda: cpu_device._MapBudget()),
    ("HCQ_CPU_WORKERS", "0", _open_cpu), ("HCQ_CPU_COPY_ENGINES", "65", _open_cpu), ("HCQ_CPU_DIRECT_COPY", "2", _open_cpu),
    ("HCQ_LRU", "-1", _open_cpu), ("HCQ_HOST_COPY_MAX", "-1", _open_cpu),
    ("HCQ_CPU_NATIVE", "2", CPUCompiler), ("HCQ_CPU_DLOPEN", "yes", CPUCompiler),
    ("HCQ_CPU_QUEUE_SPIN_US", "-1", lambda: native.tunables()), ("HCQ_CPU_SPIN_MAX_US", "1e3", lambda: native.tunables()),
    ("HCQ_CPU_PLACEMENT", "3", lambda: native.tunables()),
    ("HCQ_COMPILE_TIMEOUT_S", "0", toolchain.compile_timeout), ("HCQ_COMPILE_TIMEOUT_S", "nan", toolchain.compile_timeout),
    ("HCQ_COMPILE_SERVER", "2", compile_server.enabled), ("HCQDEV_WAIT_TIMEOUT_MS", "-1", helpers.wait_timeout_ms),
    ("HCQ_NUM_SDMA", "0", _graph_of_one_copy),
])
def test_bad_settings_raise_naming_the_variable(dev, open_device, monkeypatch, var, value, read):
    """Every HCQ_* setting is parsed by one helper: a value of the wrong type or out of range (a negative map reserve,
    a switch that is neither 0 nor 1, a timeout that is not a positive number) raises ValueError naming the variable
    and its value, instead of being taken silently."""
    monkeypatch.setenv(var, value)  # (dev, opened before: the graph's device; the others are not opened)
    opened = set(hcq.opened_devices())
    with pytest.raises(ValueError, match=re.escape(f"environment variable {var}={value!r} ")):
        read(dev, open_device) if read in DEVICE_READS else read()
    assert set(hcq.opened_devices()) == opened


@pytest.mark.parametrize("var,value", [("HCQ_CPU_MAP_RESERVE", "-5"), ("HCQ_VALIDATE", "2"), ("HCQ_HOTPATH", "-1")])
def test_bad_settings_read_at_import_are_named(var, value):
    """Settings read once, when hcq or the CPU backend is imported, are checked the same way: opening a device says
    which variable is wrong instead of running with it."""
    r = subprocess.run([sys.executable, "-c", "import hcq; hcq.Device('CPU').synchronize(); print('opened')"], env=child_env(**{var: value}),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "opened" not in r.stdout, r.stdout
    assert f"ValueError: environment variable {var}={value!r} " in r.stderr, r.stderr[-2000:]
