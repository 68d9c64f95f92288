"""`mypy hcq` is clean (configuration in pyproject.toml), and the package says it is typed."""
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_package_ships_py_typed():
    assert (ROOT / "hcq" / "py.typed").is_file()


def test_mypy_is_clean():
    pytest.importorskip("mypy", reason="mypy is part of the test extras: pip install -e '.[test]'")
    from conftest import mypy_result  # (started when collection ended: see there)
    rc, out = mypy_result()
    assert rc == 0, out[-6000:]


def test_the_test_extra_pins_mypy_to_a_tested_range():
    """The suite runs mypy with warn_unused_ignores: a new mypy release could turn CI red with no change of ours, so the
    test extra takes a tested range (raise it after running the suite with the newer mypy)."""
    tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11's tomllib")
    from importlib import metadata
    from packaging.requirements import Requirement
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["test"]
    mypy = [Requirement(r) for r in extra if Requirement(r).name == "mypy"]
    assert len(mypy) == 1 and any(s.operator == "<" for s in mypy[0].specifier), mypy
    try:
        installed = metadata.version("mypy")
    except metadata.PackageNotFoundError:
        pytest.skip("mypy is not installed")
    assert mypy[0].specifier.contains(installed), f"mypy {installed} is outside the tested range {mypy[0].specifier}"
