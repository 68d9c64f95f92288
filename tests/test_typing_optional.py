"""`mypy hcq` is clean without the optional packages too (Ray, tinygrad, UCX), not only in the test environment that
has them: mypy checks hcq against the site-packages of a Python without them.

That Python is a venv made here (no pip, no system site-packages) whose site-packages hold links to every installed
distribution pyproject.toml declares (and what those require), less the optional ones; mypy gets it with
`--python-executable`, which is how mypy finds installed packages. So its imports resolve as in an environment
installed without the ray/tinygrad/remote extras, with no second environment to install."""
import importlib.util
import os
import pathlib
import subprocess
import sys
import venv
from importlib import metadata

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
# The optional packages (distribution -> its import name): hcq imports them only where they are used, and its typing
# must hold with or without them.
OPTIONAL = {"ray": "ray", "tinygrad": "tinygrad", "libucx-cu12": "libucx"}


def _declared_requirements() -> list:
    """Every requirement pyproject.toml declares (dependencies and all extras) for this Python and platform."""
    tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11's tomllib")
    from packaging.requirements import Requirement
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = [Requirement(r) for r in project.get("dependencies", [])]
    reqs += [Requirement(r) for extra in project.get("optional-dependencies", {}).values() for r in extra]
    return [r for r in reqs if r.marker is None or r.marker.evaluate({"extra": ""})]


def _installed_closure(reqs: list) -> list[metadata.Distribution]:
    """The installed distributions for `reqs`, and those they require (recursively); the optional ones left out."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
    optional = {canonicalize_name(n) for n in OPTIONAL}
    seen: set[str] = set()
    out: list[metadata.Distribution] = []
    todo = list(reqs)
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        if name in seen or name in optional: continue
        seen.add(name)
        try:
            dist = metadata.distribution(req.name)
        except metadata.PackageNotFoundError:
            continue  # (not installed here: mypy does not find it in either environment)
        out.append(dist)
        for r in map(Requirement, dist.requires or []):
            if r.marker is None or any(r.marker.evaluate({"extra": e}) for e in ("", *req.extras)):
                todo.append(r)
    return out


def _python_without_optional(tmp: pathlib.Path) -> str:
    """A venv's Python that finds the declared packages but none of the optional ones."""
    env_dir = tmp / "venv"
    venv.EnvBuilder(with_pip=False, symlinks=os.name != "nt").create(env_dir)
    python = str(env_dir / ("Scripts/python.exe" if os.name == "nt" else "bin/python"))
    site = pathlib.Path(subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                                       capture_output=True, text=True, check=True).stdout.strip())
    for dist in _installed_closure(_declared_requirements()):
        for top in {f.parts[0] for f in dist.files or [] if f.parts and f.parts[0] != ".."}:
            src, dst = pathlib.Path(str(dist.locate_file(top))), site / top
            if src.exists() and not os.path.lexists(dst): dst.symlink_to(src, target_is_directory=src.is_dir())
    return python


def test_mypy_is_clean_without_the_optional_packages(tmp_path):
    pytest.importorskip("mypy", reason="mypy is part of the test extras: pip install -e '.[test]'")
    python = _python_without_optional(tmp_path)
    modules = ["numpy", *OPTIONAL.values()]
    probe = subprocess.run([python, "-c", "import importlib.util as u, sys; print(*(u.find_spec(m) is not None for m in sys.argv[1:]))",
                            *modules], capture_output=True, text=True, check=True).stdout.split()
    found = dict(zip(modules, (p == "True" for p in probe)))
    if any(found[m] for m in OPTIONAL.values()):  # (e.g. PYTHONPATH names their directory)
        pytest.skip(f"the optional packages cannot be hidden from a venv here: {found}")
    assert found["numpy"] or importlib.util.find_spec("numpy") is None, f"the venv does not see the declared packages: {found}"
    # The default cache, as tests/test_typing.py: mypy keeps one entry per module and re-checks what the other run saw
    # differently (the modules that import the optional packages), about a second.
    r = subprocess.run([sys.executable, "-m", "mypy", "--python-executable", python, "hcq"], cwd=ROOT,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
