"""`mypy hcq` is clean (configuration in pyproject.toml), and the package says it is typed."""
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_package_ships_py_typed():
    assert (ROOT / "hcq" / "py.typed").is_file()


def test_mypy_is_clean():
    pytest.importorskip("mypy", reason="mypy is part of the test extras: pip install -e '.[test]'")
    r = subprocess.run([sys.executable, "-m", "mypy", "hcq"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
