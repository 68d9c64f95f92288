"""Build step for the optional CPython extension of the launch hot path (hcq/_hotpath.c). Everything else is in
pyproject.toml. `optional=True`: where the extension cannot be built (no Python headers, no compiler), the install
still succeeds and hcq calls its native submit through ctypes instead (HCQ_HOTPATH=0 forces that path).

The extension includes C headers generated here from their one definition: the packet format's (`hcq_packets.h`: the
poison tag and the rules on it, from hcq/packets.py, as the C executors' builds generate it) and a device's state words
(`hcq_device_state.h`, from hcq/device_state.py) and a graph's run state words (`hcq_graph_state.h`, from
hcq/graph_state.py)."""
import importlib.util
import pathlib
import sys

from setuptools import Extension, setup

HERE = pathlib.Path(__file__).resolve().parent


def generated_headers() -> str:
    """A folder holding the C headers the core generates for native code: hcq_packets.h (hcq.packets.c_header()),
    hcq_device_state.h (hcq.device_state.c_header()) and hcq_graph_state.h (hcq.graph_state.c_header()). Their modules
    import nothing of hcq, so they are loaded by path: the package need not be importable while it is being built."""
    out = HERE / "build" / "hcq_generated"
    out.mkdir(parents=True, exist_ok=True)
    for name in ("packets", "device_state", "graph_state"):
        spec = importlib.util.spec_from_file_location(f"_hcq_{name}_for_build", HERE / "hcq" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        header, text = out / f"hcq_{name}.h", module.c_header()
        if not header.exists() or header.read_text() != text: header.write_text(text)
    return str(out)


setup(ext_modules=[Extension("hcq._hotpath", ["hcq/_hotpath.c"], include_dirs=["hcq", generated_headers()],
                             depends=["hcq/hostcopy.h", "hcq/timeline_ring.h", "hcq/packets.py", "hcq/device_state.py", "hcq/graph_state.py"], optional=True, extra_compile_args=["-O2"])])
