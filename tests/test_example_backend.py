"""docs/examples/vec_backend.py, the complete example backend docs/backends.md points to: under 150 lines, it imports
from hcq only what `hcq.backend` offers, and it passes the conformance kit (run as its docstring says)."""
import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "docs" / "examples" / "vec_backend.py"


def test_the_example_is_short_and_uses_only_the_backend_module():
    src = EXAMPLE.read_text()
    assert len(src.splitlines()) < 150
    hcq_imports = {n.module for n in ast.walk(ast.parse(src)) if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("hcq")}
    assert hcq_imports == {"hcq.backend"}, hcq_imports


@pytest.mark.full
def test_the_example_passes_the_conformance_kit(tmp_path):
    code = (f"import sys; sys.path.insert(0, {str(EXAMPLE.parent)!r}); import vec_backend; vec_backend.register(); "
            "from hcq.conformance.__main__ import main; sys.exit(main(['VEC', '-q']))")
    env = {k: v for k, v in os.environ.items() if k not in ("PROFILE", "PROFILE_PATH", "PYTEST_ADDOPTS")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    out = r.stdout + r.stderr
    assert r.returncode == 0 and " passed" in out and " failed" not in out, out[-6000:]
    assert "testing VEC:0" in out, out[-3000:]
