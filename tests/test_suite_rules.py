"""Rules of this suite, checked: every fixture is defined once (in conftest.py, or in the one module that uses it), and
tests open devices through the fixtures (`dev`, `dev1`, `open_device`), which hand out fresh ones and close them after
the test, never at an index of their choosing; a line where the index itself is under test says so (`# index under
test`). Devices that scripts open in their own processes are theirs."""
import ast
import re
from pathlib import Path

TESTS = Path(__file__).resolve().parent
INDEX_UNDER_TEST = "# index under test"


def modules() -> list[Path]:
    return sorted(p for p in TESTS.glob("*.py") if p.name != Path(__file__).name)


def is_fixture(decorator: ast.expr) -> bool:
    target = decorator.func if isinstance(decorator, ast.Call) else decorator
    return isinstance(target, ast.Attribute) and target.attr == "fixture" or isinstance(target, ast.Name) and target.id == "fixture"


def test_every_fixture_is_defined_once():
    where: dict[str, list[str]] = {}
    for path in modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and any(is_fixture(d) for d in node.decorator_list):
                where.setdefault(node.name, []).append(f"{path.name}:{node.lineno}")
    twice = {name: places for name, places in where.items() if len(places) > 1}
    assert not twice, f"fixtures defined more than once: {twice}"


def picked_indices(path: Path) -> list[str]:
    """Lines of `path` that open a local device at a fixed index in the test process: Device("CPU:3"), Device(f"CPU:{i}"),
    Device("CPU") (which is CPU:0)."""
    source = path.read_text()
    lines = source.splitlines()
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and node.args and (getattr(node.func, "attr", None) == "Device" or getattr(node.func, "id", None) == "Device")):
            continue
        arg = node.args[0]
        text = arg.value if isinstance(arg, ast.Constant) and isinstance(arg.value, str) else \
            ast.unparse(arg) if isinstance(arg, ast.JoinedStr) else None
        if text is None or "@" in text or not re.match(r"""^f?["']?[A-Za-z_]+\w*(:|$|["'])""", text.strip()): continue  # (served devices: the server's names)
        if INDEX_UNDER_TEST not in lines[node.lineno - 1]: found.append(f"{path.name}:{node.lineno}: {lines[node.lineno - 1].strip()}")
    return found


def test_no_test_opens_a_device_at_an_index_of_its_choosing():
    found = [line for path in modules() for line in picked_indices(path)]
    assert not found, "use the dev/dev1/open_device fixtures (fresh devices, closed after the test):\n" + "\n".join(found)


def test_the_rules_catch_what_they_forbid(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text('import hcq\nd = hcq.Device("CPU:3")\ne = hcq.Device(f"CPU:{1 + 1}")\nok = hcq.Device("CPU:0")  # index under test\n'
                   'remote = hcq.Device("CPU:0@127.0.0.1:5555")\nscript = \'hcq.Device("CPU:7")\'\nf = hcq.Device("CPU")\n')
    assert [line.split(":")[1] for line in picked_indices(bad)] == ["2", "3", "7"]


def test_ci_runs_exactly_the_readme_test_command():
    root = TESTS.parent
    readme = (root / "README.md").read_text()
    command = re.search(r"Tests \(the full suite, as CI runs it\):\n\n    (.+)\n", readme).group(1)
    assert "--full" in command
    assert (root / ".ci" / "run").read_text().rstrip().splitlines()[-1] == command


def test_the_daily_run_covers_every_module():
    """`pytest` leaves out the tests marked `full` (see conftest.py): every module keeps at least one test in it."""
    uncovered = []
    for path in modules():
        tests = [n for n in ast.parse(path.read_text()).body if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")]
        daily = [t for t in tests if not {ast.unparse(d) for d in t.decorator_list} & {"pytest.mark.full", "pytest.mark.slow"}]
        if tests and not daily: uncovered.append(path.name)
    assert not uncovered, f"modules with no test in the daily run: {uncovered}"
