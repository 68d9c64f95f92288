"""The API reference docs/api.md is generated from the live package by `python -m tools.apidoc` (a development tool
of the checkout, like tools/fuzz.py): the checked-in page must be what the generator writes now, and every callable
it lists (classes, functions, methods, properties) must carry a docstring of its own."""
import difflib
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path: sys.path.insert(0, ROOT)  # `tools` is not installed; plain `pytest` may not put the root first

from tools import apidoc  # noqa: E402

REGEN = "python -m tools.apidoc"


def test_api_page_is_current():
    # In a fresh interpreter, exactly as the command that writes the page runs (no state from other tests).
    env = {k: v for k, v in os.environ.items() if k not in ("PROFILE", "PROFILE_PATH")}
    proc = subprocess.run([sys.executable, "-m", "tools.apidoc", "--stdout"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, f"`{REGEN}` failed:\n{proc.stderr}"
    try:
        with open(apidoc.OUT_PATH, encoding="utf-8") as f: checked_in = f.read()
    except FileNotFoundError:
        pytest.fail(f"docs/api.md is missing; run `{REGEN}` from the repository root and commit it")
    if checked_in != proc.stdout:
        diff = list(difflib.unified_diff(checked_in.splitlines(), proc.stdout.splitlines(), "docs/api.md (checked in)",
                                         f"{REGEN} (now)", lineterm="", n=1))
        shown = "\n".join(diff[:60]) + (f"\n... ({len(diff) - 60} more diff lines)" if len(diff) > 60 else "")
        pytest.fail(f"docs/api.md is stale (the docstrings or signatures changed): run `{REGEN}` from the repository root "
                    f"and commit the result.\n{shown}")


def test_every_listed_callable_has_a_docstring():
    missing = apidoc.missing_docstrings()
    if missing:
        raise AssertionError(f"{len(missing)} callables listed in docs/api.md have no docstring of their own; add one to each "
                             f"(then run `{REGEN}`):\n" + "\n".join(f"  {e.qualname} ({e.kind}) at {e.location}" for e in missing))
