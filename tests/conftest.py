import itertools
import os
import weakref

import pytest

import hcq
from hcq import toolchain
from hcq.errors import HCQTimeoutError

CLOSE_TIMEOUT_MS = 10_000  # how long a test's devices get to finish its work when it ends


@pytest.fixture
def open_device():
    """`open_device(kind="CPU")`: a fresh device of `kind` (at the lowest index no open device holds), closed when the test
    ends. A full name (KIND:N, KIND:N@HOST:PORT) opens that device; for tests where the index itself is under test, and
    for served devices."""
    opened: list = []

    def open_(kind: str = "CPU"):
        if ":" in kind or "@" in kind:
            name = kind
        else:
            taken = {d.device for d in hcq.opened_devices() if not d.closed}
            name = next(f"{kind}:{i}" for i in itertools.count() if f"{kind}:{i}" not in taken)
        d = hcq.Device(name)
        opened.append(weakref.ref(d))  # (the registry holds it while it is open; one the test closed and dropped may go)
        return d

    yield open_
    errors = []
    for d in (ref() for ref in reversed(opened)):
        if d is None: continue
        try:
            d.close(timeout=CLOSE_TIMEOUT_MS)
        except HCQTimeoutError as e:
            errors.append(str(e))
    if errors: pytest.fail("the test left work running on its devices:\n" + "\n".join(errors), pytrace=False)



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
