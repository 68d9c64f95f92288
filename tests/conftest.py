import os
import pytest

import hcq
from hcq import toolchain


@pytest.fixture(scope="session")
def dev():
    return hcq.Device("CPU")


@pytest.fixture(scope="session")
def dev1():
    return hcq.Device("CPU:1")


@pytest.fixture
def compiler_runs(monkeypatch):
    """Counts compiler invocations (toolchain.run_compiler calls that compile a C source)."""
    calls = []
    real = toolchain.run_compiler

    def counting(cmd, *a, **kw):
        if any(str(arg).endswith(".c") for arg in cmd): calls.append(cmd)
        return real(cmd, *a, **kw)

    monkeypatch.setattr(toolchain, "run_compiler", counting)
    return calls


@pytest.fixture
def clear_find_compiler():
    toolchain.find_compiler.cache_clear()
    yield
    toolchain.find_compiler.cache_clear()


def _validation(on: bool):
    was = hcq.validation.enabled
    hcq.validation.set_enabled(on)
    yield
    hcq.validation.set_enabled(was)


@pytest.fixture
def validating():
    """Validation mode on for the test (queues built during it note their commands)."""
    yield from _validation(True)


@pytest.fixture
def no_validation():
    """Validation mode off for a test that hands the command processor bad input on purpose (it would refuse it)."""
    yield from _validation(False)


def pytest_collection_modifyitems(config, items):
    if os.environ.get("HCQ_SLOW") == "1": return
    skip = pytest.mark.skip(reason="slow soak run; set HCQ_SLOW=1")
    for item in items:
        if "slow" in item.keywords: item.add_marker(skip)
