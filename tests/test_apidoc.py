"""The API reference is HTML that pdoc (https://pdoc.dev) generates from the docstrings into docs/api/ (not checked
in), with the command in README.md ("The public API"). It must build without a single pdoc warning (an annotation
that does not resolve, a module that does not import...), cover the expected modules, and every class, function,
method and property it lists must carry a docstring of its own."""
import importlib
import inspect
import os
import subprocess
import sys
from functools import cached_property

import pytest

pytest.importorskip("pdoc", minversion="15", reason="pdoc>=15 is not installed (pip install 'pdoc>=15' or the test extra)")
import pdoc.doc  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The documented modules: hcq (its __all__, which pdoc respects, so no other submodule is pulled in), the numpy
# helpers, the backend contract (hcq.backend's __all__) and the conformance kit's page (not its pytest plugin or suite).
MODULES = ["hcq", "hcq.arrays", "hcq.backend", "hcq.conformance"]
SPECS = [*MODULES, "!hcq.conformance."]
OPTIONS = ["--no-show-source"]  # no source view in the pages: it would double their size and the build's time
PROPERTIES = (property, cached_property)
COMMAND = " ".join(["python -m pdoc", *OPTIONS, "-o docs/api", *(f"'{s}'" if s.startswith("!") else s for s in SPECS)])


def test_readme_gives_the_build_command():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f: readme = f.read()
    assert COMMAND in readme, f"README.md should give the command that builds the API reference: {COMMAND}"


@pytest.mark.full
def test_reference_builds_without_warnings(tmp_path):
    # In a fresh interpreter, as the README command runs (from the repository root, so `hcq` is this checkout), with
    # every warning an error: pdoc reports what it cannot document (an unresolved annotation, say) as a warning.
    env = {k: v for k, v in os.environ.items() if k not in ("PROFILE", "PROFILE_PATH")}
    out = tmp_path / "api"
    cmd = [sys.executable, "-W", "error", "-m", "pdoc", *OPTIONS, "-o", str(out), *SPECS]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"pdoc failed or warned (`{COMMAND}` from the repository root):\n{proc.stderr[-4000:]}"
    pages = {os.path.relpath(os.path.join(d, f), out) for d, _, fs in os.walk(out) for f in fs if f.endswith(".html")}
    assert pages == {"index.html", *(m.replace(".", "/") + ".html" for m in MODULES)}
    for module in ("hcq", "hcq.backend"):  # every exported name has its entry on the module's page
        html = (out / (module.replace(".", "/") + ".html")).read_text(encoding="utf-8")
        missing = [n for n in importlib.import_module(module).__all__ if f'id="{n}"' not in html]
        assert not missing, f"{module}'s page has no entry for {missing}"


def _listed(doc, module, documented):
    """Whether pdoc's default template shows `doc` (its `is_public`, less `__init__`: the class docstring covers it)."""
    if "@private" in doc.docstring: return False
    if "@public" in doc.docstring: return True
    if doc.kind == "module": return doc.fullname in documented
    if (doc.qualname or doc.name) in (getattr(module.obj, "__all__", None) or ()): return True
    return not doc.name.startswith("_")


def _reference_entries():
    """(doc, kind, its own docstring) for every class, function, method and property the reference lists, each
    definition once. Its own: not one pdoc borrows from a base class (an undocumented override shows the docstring of
    what it overrides), nor a dataclass's or an enum's generated one (pdoc shows none)."""
    modules = {name: pdoc.doc.Module(importlib.import_module(name)) for name in MODULES}
    seen = set()

    def walk(members, module, owner=None):
        for d in members:
            if not _listed(d, module, modules) or d.taken_from in seen: continue
            if d.kind == "variable":  # pdoc shows a property as a variable with the getter's docstring
                raw = None if owner is None else inspect.getattr_static(owner.obj, d.name, None)
                if not isinstance(raw, PROPERTIES): continue
                kind, own = "property", raw.__doc__  # the getter's (a property copies it)
            elif d.kind == "function":
                kind, own = "function" if owner is None else "method", d.obj.__doc__
            elif d.kind == "class":
                kind, own = "class", vars(d.obj).get("__doc__") if d.docstring else None
            else:
                continue
            seen.add(d.taken_from)
            yield d, kind, own
            if d.kind == "class":
                yield from walk(d.own_members, module, d)
                for (base_module, _), inherited in d.inherited_members.items():
                    if base_module in modules: yield from walk(inherited, module, d)  # listed when its module is

    for module in modules.values(): yield from walk(module.members.values(), module)


@pytest.mark.full
def test_every_listed_callable_has_a_docstring():
    entries = list(_reference_entries())
    assert {k for _, k, _ in entries} == {"class", "function", "method", "property"} and len(entries) > 150, \
        f"the walk over pdoc's model found only {len(entries)} entries"
    missing = [(d, k) for d, k, own in entries if not (own and own.strip())]
    lines = [f"  {'.'.join(d.taken_from)} ({k}) at {os.path.relpath(str(d.source_file), ROOT)}:{(d.source_lines or '?')[0]}"
             for d, k in missing]
    assert not missing, f"{len(missing)} of what the API reference lists have no docstring of their own:\n" + "\n".join(lines)
