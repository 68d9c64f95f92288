"""hcq installed as users install it: `python -m build` (an sdist, then a wheel built from that sdist) on a copy of the
checkout, the wheel pip-installed into a fresh venv, and the demo, the conformance kit, a remote device and the
tinygrad device run with that venv's Python from a directory outside the checkout, with empty caches (so the native
code is built again from the installed files). The package files every archive must hold are derived from the
checkout: every non-Python file under hcq/ that git tracks (or would: new files not ignored)."""
from __future__ import annotations

import importlib.util
import os
import re
import select
import shutil
import signal
import site
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
STEP_TIMEOUT_S = 300
# A startup line for the venv: every Python process that imported hcq says, as it exits, which hcq it was.
PROBE_PTH = ('import atexit, sys; atexit.register(lambda: "hcq" in sys.modules and '
             'print("hcq imported from", sys.modules["hcq"].__file__, file=sys.stderr, flush=True))\n')
PROBE_LINE = re.compile(r"^hcq imported from (.+)$", re.M)


@dataclass
class Installed:
    """A venv with the built wheel installed, and what the build made."""

    venv: Path
    work: Path  # the directory the steps run in (outside the checkout)
    env: dict[str, str]
    expected: list[str]  # package files (relative to the checkout) that every archive must hold
    sdist: Path
    wheel: Path

    @property
    def python(self) -> str:
        return venv_python(self.venv)

    @property
    def hcq(self) -> str:
        return str(self.venv / "bin" / "hcq")


def venv_python(venv: Path) -> str:
    """The Python of `venv`."""
    return str(venv / "bin" / "python")


def require_module(name: str, why: str) -> None:
    """Skip the test unless module `name` can be imported by this Python."""
    if importlib.util.find_spec(name) is None: pytest.skip(f"module {name} is missing: {why}")


def checkout_files() -> list[str]:
    """The checkout's files as git sees them (tracked, and new ones not ignored), relative to ROOT."""
    if shutil.which("git") is None: pytest.skip("git is missing: the package files are listed from the git checkout")
    r = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT, capture_output=True)
    if r.returncode != 0: pytest.skip(f"{ROOT} is not a git checkout: {r.stderr.decode().strip()}")
    return sorted(p for p in r.stdout.decode().split("\0") if p and (ROOT / p).is_file())  # (a file deleted, not yet staged)


def package_data(files: list[str]) -> list[str]:
    """The non-Python files of the package: what it reads at run time (C sources, headers, py.typed, ...)."""
    return [f for f in files if f.startswith("hcq/") and "__pycache__" not in f and not f.endswith((".py", ".pyc", ".so"))]


def copy_files(files: list[str], dest: Path) -> None:
    """Copy `files` (relative to ROOT) to `dest`, keeping their paths."""
    for f in files:
        (dest / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, dest / f)


def run_checked(cmd: list[str], what: str, **kw: Any) -> subprocess.CompletedProcess:
    """Run `cmd`; fail the test with its output unless it succeeds."""
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=STEP_TIMEOUT_S, **kw)
    assert r.returncode == 0, f"{what} failed ({r.returncode}):\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}"
    return r


def build(src: Path, out: Path) -> tuple[Path, Path]:
    """`python -m build` on `src` (the sdist, then the wheel from it) into `out`: (sdist, wheel)."""
    run_checked([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(src)], "python -m build", cwd=src)
    (sdist,), (wheel,) = out.glob("*.tar.gz"), out.glob("*.whl")
    return sdist, wheel


def site_dirs() -> list[str]:
    """This Python's site-packages directories (where the dependencies are installed)."""
    paths = sysconfig.get_paths()
    dirs = [paths["purelib"], paths["platlib"]] + ([site.getusersitepackages()] if site.ENABLE_USER_SITE else [])
    return list(dict.fromkeys(d for d in dirs if os.path.isdir(d)))


def make_venv(venv: Path) -> None:
    """A venv without pip nor system site-packages that sees this Python's site-packages after its own (plain path
    lines in a .pth: no editable finder there is activated; pip comes from there too), with the probe."""
    run_checked([sys.executable, "-m", "venv", "--without-pip", str(venv)], "python -m venv")
    purelib = run_checked([venv_python(venv), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          "the venv's python").stdout.strip()
    (Path(purelib) / "hcq-test-deps.pth").write_text("".join(d + "\n" for d in site_dirs()))
    (Path(purelib) / "hcq-test-probe.pth").write_text(PROBE_PTH)


def clean_env(venv: Path, caches: Path) -> dict[str, str]:
    """This environment as a user of the venv would have it: no PYTHON* variables (no PYTHONPATH to the checkout) nor
    DEV, the venv's bin first on PATH, and hcq's and tinygrad's caches in `caches` (empty)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON") and k not in ("VIRTUAL_ENV", "DEV")}
    env.update(PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}", VIRTUAL_ENV=str(venv),
               HCQ_CACHE_DIR=str(caches / "hcq"), XDG_CACHE_HOME=str(caches))
    return env


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    """Build the package from a copy of the checkout and pip-install the wheel into a fresh venv (once)."""
    require_module("build", "pip install build (it is in hcq[test])")
    require_module("setuptools", "the build backend, used without isolation")
    require_module("venv", "the venv module of the standard library")
    require_module("pip", "it installs the wheel into the venv")
    files = checkout_files()
    tmp = tmp_path_factory.mktemp("install")
    copy_files(files, tmp / "src")  # (the build writes egg-info and build/ into its source tree: not the checkout's)
    sdist, wheel = build(tmp / "src", tmp / "dist")
    venv = tmp / "venv"
    make_venv(venv)
    env = clean_env(venv, tmp / "cache")
    run_checked([venv_python(venv), "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--ignore-installed",
                 "--disable-pip-version-check", str(wheel)], "pip install of the wheel", env=env, cwd=tmp)
    (tmp / "work").mkdir()
    return Installed(venv, tmp / "work", env, package_data(files), sdist, wheel)


def run_step(inst: Installed, cmd: list[str]) -> subprocess.CompletedProcess:
    """Run `cmd` as the venv's user, in the work directory; it must succeed with hcq imported from the venv."""
    r = run_checked(cmd, " ".join(cmd[:3]), cwd=inst.work, env=inst.env)
    assert_hcq_from_venv(r.stderr, inst)
    return r


def assert_hcq_from_venv(stderr: str, inst: Installed) -> None:
    """Every process that reported its hcq (at least one did) imported it from the venv, not from the checkout."""
    where = PROBE_LINE.findall(stderr)
    venv = os.path.realpath(inst.venv) + os.sep
    assert where, f"no process reported where hcq came from:\n{stderr[-3000:]}"
    assert all(os.path.realpath(w).startswith(venv) for w in where), f"hcq imported from outside the venv {venv}: {where}"


def missing_from(names: list[str], expected: list[str]) -> list[str]:
    """The expected package files that an archive listing (paths relative to the project root) does not hold."""
    return sorted(set(expected) - set(names))


@pytest.mark.full
def test_sdist_and_wheel_hold_every_package_file(installed: Installed) -> None:
    with tarfile.open(installed.sdist) as t:
        sdist = [n.split("/", 1)[1] for n in t.getnames() if "/" in n]  # (below the hcq-VERSION/ folder)
    with zipfile.ZipFile(installed.wheel) as z:
        wheel = z.namelist()
    assert installed.expected, "no package files found: the expected list is derived wrongly"
    fix = "add them to [tool.setuptools.package-data] in pyproject.toml"
    assert not missing_from(sdist, installed.expected), f"the sdist lacks {missing_from(sdist, installed.expected)}: {fix}"
    assert not missing_from(wheel, installed.expected), f"the wheel lacks {missing_from(wheel, installed.expected)}: {fix}"


@pytest.mark.full
def test_demo_runs_from_the_venv(installed: Installed) -> None:
    r = run_step(installed, [installed.hcq, "demo", "--n", "4096", "--trace", str(installed.work / "trace.json")])
    assert "demo OK" in r.stdout, r.stdout[-3000:]


@pytest.mark.full
def test_conformance_kit_runs_from_the_venv(installed: Installed) -> None:
    # (every module of the kit is collected from the venv; a few of its tests run: tests/test_conformance.py runs it all)
    r = run_step(installed, [installed.python, "-m", "hcq.conformance", "CPU", "-q", "-k", "roundtrip or signal_stores or accumulate"])
    assert " passed" in r.stdout and " failed" not in r.stdout and " error" not in r.stdout, r.stdout[-3000:]


REMOTE_CLIENT = """
import array, sys, hcq
dev = hcq.Device(sys.argv[1])
n = 1 << 12
prg = dev.compile("HCQ_KERNEL void add(float *out, const float *a, float k, int n) {"
                  " int i = hcq_global_id(0); if (i < n) out[i] = a[i] + k; }", "add")
a, out = array.array("f", range(n)), array.array("f", bytes(4 * n))
ba, bo = dev.allocator.alloc(4 * n), dev.allocator.alloc(4 * n)
dev.allocator.copyin(ba, memoryview(a).cast("B"))
prg(bo, ba, global_size=n // 64, local_size=64, vals=(2.5, n), wait=True)
dev.allocator.copyout(memoryview(out).cast("B"), bo)
assert list(out) == [x + 2.5 for x in a], list(out[:4])
print("remote OK", dev.device)
"""


class Server:
    """The venv's `hcq serve` (in a session of its own), running in the work directory; `.address` is its HOST:PORT."""

    def __init__(self, inst: Installed) -> None:
        self.log = tempfile.TemporaryFile(mode="w+")  # (a pipe nobody reads would fill and stall the server)
        self.proc = subprocess.Popen([inst.hcq, "serve"], stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     cwd=inst.work, env=inst.env, start_new_session=True)
        assert self.proc.stdout is not None
        ready = select.select([self.proc.stdout], [], [], STEP_TIMEOUT_S)[0]
        m = re.search(r"listening on (\S+:\d+)", self.proc.stdout.readline() if ready else "")
        if not m:
            self.close()
            raise AssertionError(f"hcq serve did not start:\n{self.stderr()}")
        self.address = m.group(1)

    def close(self) -> None:
        """SIGTERM (the server stops and closes), then SIGKILL to its whole session if it lingers."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # whatever it left behind (its workers)
        except ProcessLookupError:
            pass
        self.proc.wait()

    def stderr(self) -> str:
        self.log.seek(0)
        return self.log.read()


@pytest.mark.full
def test_remote_device_served_from_the_venv(installed: Installed) -> None:
    require_module("libucx", "remote devices need hcq[remote] (libucx-cu12)")
    server = Server(installed)
    try:
        r = run_step(installed, [installed.python, "-c", REMOTE_CLIENT, f"CPU:0@{server.address}"])
    except AssertionError as e:
        raise AssertionError(f"{e}\nthe server's log:\n{server.stderr()[-3000:]}") from None
    finally:
        server.close()
    assert "remote OK" in r.stdout, r.stdout[-3000:]
    assert_hcq_from_venv(server.stderr(), installed)


TINYGRAD_CLIENT = """
import hcq.tinygrad
from tinygrad import Tensor
a = [[float(i * 8 + j) for j in range(8)] for i in range(8)]
want = sum(sum(a[i][k] * a[k][j] for k in range(8)) for i in range(8) for j in range(8))
got = (Tensor(a, device="HCQ") @ Tensor(a, device="HCQ")).sum().item()
assert abs(got - want) <= 1e-5 * want, (got, want)
print("tinygrad OK", got)
"""


def test_tinygrad_device_runs_from_the_venv(installed: Installed) -> None:
    require_module("tinygrad", "the tinygrad device needs hcq[tinygrad]")
    if shutil.which("clang") is None: pytest.skip("clang is missing: tinygrad's C renderer needs it")
    r = run_step(installed, [installed.python, "-c", TINYGRAD_CLIENT])
    assert "tinygrad OK" in r.stdout, r.stdout[-3000:]
