"""Build step for the optional CPython extension of the launch hot path (hcq/_hotpath.c). Everything else is in
pyproject.toml. `optional=True`: where the extension cannot be built (no Python headers, no compiler), the install
still succeeds and hcq calls its native submit through ctypes instead (HCQ_HOTPATH=0 forces that path)."""
from setuptools import Extension, setup

setup(ext_modules=[Extension("hcq._hotpath", ["hcq/_hotpath.c"], include_dirs=["hcq"], depends=["hcq/hostcopy.h"], optional=True, extra_compile_args=["-O2"])])
