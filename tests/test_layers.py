"""The layering the design doc promises, checked on the source: every import of every module under hcq/ (module
level, inside functions, and under TYPE_CHECKING alike) goes to its own layer or one below, the import graph has
no cycle, and nothing but a backend imports a backend. The core also never names attributes only one backend has."""
import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent / "hcq"

# Lowest first. A module may import modules of its own layer or lower ones (cycles are checked separately).
LAYERS = [
    {"hcq.errors", "hcq.helpers", "hcq.symbolic", "hcq.interrupts", "hcq.recorder", "hcq.lifecycle", "hcq.packets", "hcq.toolchain", "hcq.compile_server", "hcq.hostmap",
     "hcq.hotpath", "hcq.device_state", "hcq.graph_state", "hcq.atomics", "hcq.dlpack", "hcq.kernel_source"},
    {"hcq.interfaces"},
    {"hcq.memory", "hcq.hostcopy", "hcq.timeline_ring", "hcq.profiler", "hcq.validation"},
    {"hcq.signal"},
    {"hcq.lifetimes"},
    {"hcq.program"},
    {"hcq.queue"},
    {"hcq.packet_queue", "hcq.stream_queue"},
    {"hcq.allocator"},
    {"hcq.device"},
    {"hcq.stream_device"},
    {"hcq.graph", "hcq.registry", "hcq.arrays", "hcq.backends"},
    {"hcq", "hcq.cli", "hcq.__main__", "hcq.conformance", "hcq.bench", "hcq.tinygrad", "hcq.backend"},
]


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports() -> dict[str, set[str]]:
    mods = {module_name(f): f for f in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, f in mods.items():
        deps = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name.split(".")[0] == "hcq")
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "hcq" and not node.level:
                deps.update(f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in mods else node.module for a in node.names)
        graph[name] = {d for d in deps if d in mods and d != name}
    return graph


def layer_of(name: str) -> int:
    for i, layer in enumerate(LAYERS):
        if name in layer or any(name.startswith(m + ".") for m in layer if m != "hcq"): return i
    raise AssertionError(f"{name} is in no layer: add it to LAYERS (and to docs/design.md)")


def test_every_import_goes_down_the_layers():
    graph = imports()
    for name, deps in graph.items():
        if name.startswith("hcq.backends."): continue  # backends sit on top of everything
        for dep in deps:
            if dep == "hcq.backends": continue
            assert layer_of(dep) <= layer_of(name), f"{name} (layer {layer_of(name)}) imports {dep} (layer {layer_of(dep)})"


def test_import_graph_has_no_cycle():
    graph, state, path = imports(), {}, []

    def visit(n):
        state[n] = "open"
        path.append(n)
        for d in sorted(graph[n]):
            if state.get(d) == "open": raise AssertionError("import cycle: " + " -> ".join(path[path.index(d):] + [d]))
            if d not in state: visit(d)
        path.pop()
        state[n] = "done"

    for n in sorted(graph):
        if n not in state: visit(n)


def test_only_backends_import_backends():
    for name, deps in imports().items():
        if name.startswith("hcq.backends."): continue
        bad = [d for d in deps if d.startswith("hcq.backends.")]
        assert not bad, f"{name} imports backend module(s) {bad}"


@pytest.mark.parametrize("attr", ["queue_idx", "num_copy_queues", "num_copy_engines", "_rings", "value_mv", "timestamp_mv",
                                  "entry_addr", "_native_submit", "direct_copy", "queue_stats"])
def test_core_names_no_backend_only_attribute(attr):
    for f in ROOT.rglob("*.py"):
        if "backends" in f.parts: continue
        assert not re.search(rf"\b{attr}\b", f.read_text()), f"{f.relative_to(ROOT.parent)} mentions {attr}"


# Imports from one backend into another, each with why it stands. Nothing else crosses: a backend is made only of the
# core (hcq.backend) and its own modules.
BETWEEN_BACKENDS = {
    # the emulated GPU runs its kernels' C twins on the host: a test instrument, not the NV backend (nothing in
    # hcq.backends.nv outside the emulator imports it)
    ("hcq.backends.nv.emulator", "hcq.backends.cpu"): "the emulator's kernel twins",
}


def test_no_backend_imports_another_beyond_what_is_listed():
    crossings = set()
    for name, deps in imports().items():
        if not name.startswith("hcq.backends.") or name.count(".") < 2: continue
        for dep in deps:
            if dep.startswith("hcq.backends.") and dep.count(".") >= 2 and dep.split(".")[2] != name.split(".")[2]:
                owner = next((k for k in BETWEEN_BACKENDS if name.startswith(k[0]) and dep.startswith(k[1])), None)
                assert owner is not None, f"{name} imports {dep}: a backend may import only the core and its own modules"
                crossings.add(owner)
    assert crossings == set(BETWEEN_BACKENDS), f"listed crossings no module makes any more: {set(BETWEEN_BACKENDS) - crossings}"


def test_a_remote_client_imports_no_other_backend():
    """The client side of remote devices (what `hcq.Device("KIND:N@HOST:PORT")` loads) learns what the device is from its
    server and reaches local devices through the core (HCQCompiled.host_stores), never through another backend."""
    graph, seen, todo = imports(), set(), ["hcq.backends.remote.device"]
    while todo:
        name = todo.pop()
        if name in seen: continue
        seen.add(name)
        todo += [d for d in graph.get(name, ()) if d.startswith("hcq.backends.remote")]
    other = {(n, d) for n in seen for d in graph[n] if d.startswith("hcq.backends.") and not d.startswith("hcq.backends.remote")}
    assert not other, f"the remote client imports other backends: {sorted(other)}"
