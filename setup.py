"""Build step for the optional CPython extension of the launch hot path (hcq/_hotpath.c). Everything else is in
pyproject.toml. `optional=True`: where the extension cannot be built (no Python headers, no compiler), the install
still succeeds and hcq calls its native submit through ctypes instead (HCQ_HOTPATH=0 forces that path).

The extension includes the packet format's C header (`hcq_packets.h`: the poison tag and the rules on it), generated
here from hcq/packets.py, the one definition, as the C executors' builds generate it."""
import importlib.util
import pathlib
import sys

from setuptools import Extension, setup

HERE = pathlib.Path(__file__).resolve().parent


def packets_header_dir() -> str:
    """A folder holding hcq_packets.h, written from hcq.packets.c_header() (hcq/packets.py imports nothing of hcq, so it
    is loaded by path: the package need not be importable while it is being built)."""
    spec = importlib.util.spec_from_file_location("_hcq_packets_for_build", HERE / "hcq" / "packets.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    out = HERE / "build" / "hcq_generated"
    out.mkdir(parents=True, exist_ok=True)
    header = out / "hcq_packets.h"
    if not header.exists() or header.read_text() != module.c_header(): header.write_text(module.c_header())
    return str(out)


setup(ext_modules=[Extension("hcq._hotpath", ["hcq/_hotpath.c"], include_dirs=["hcq", packets_header_dir()],
                             depends=["hcq/hostcopy.h", "hcq/packets.py"], optional=True, extra_compile_args=["-O2"])])
