"""The suite's fixtures, defined here once. Devices: each test gets fresh ones and they are closed after it (work it left
running is failed and dropped then, and the test errors saying so), so no test sees what an earlier one left behind.
`dev`/`dev1` are two CPU devices; `open_device(kind)` opens more, of any kind, at indices no open device holds."""
import itertools
import os
import weakref

import pytest

import hcq
from hcq import toolchain
from helpers import close_after_test


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
    close_after_test(d for ref in opened if (d := ref()) is not None)


@pytest.fixture
def dev(open_device):
    """A fresh CPU device."""
    return open_device()


@pytest.fixture
def dev1(open_device, dev):
    """A second fresh CPU device (dev's peer)."""
    return open_device()


@pytest.fixture
def python_launches(monkeypatch):
    """The launches a fast run left to the checked path (HCQProgram.launch), each as its keyword arguments."""
    calls = []
    real = hcq.HCQProgram.launch

    def counting(self, *bufs, **kw):
        calls.append(kw)
        return real(self, *bufs, **kw)
    monkeypatch.setattr(hcq.HCQProgram, "launch", counting)
    return calls


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


# ---------------------------------------------------------------- tiers
# Daily (`pytest`): every module, without the tests marked `full` (servers, subprocesses, conformance runs: under two
# minutes on 2 cores). Full (`pytest --full`, what CI and the README's test command run): everything but the soak and
# stress runs, which are marked `slow` and run with HCQ_SLOW=1. A run that names files or tests runs them whole.
def pytest_addoption(parser):
    parser.addoption("--full", action="store_true", help="hcq: run the full suite (tests marked `full` too), as CI does")


def pytest_collection_modifyitems(config, items):
    slow = os.environ.get("HCQ_SLOW") == "1"
    named = any(not os.path.isdir(arg.split("::")[0]) for arg in config.args)  # (files or tests named: run them whole)
    if not (slow or named or config.getoption("--full")):
        left_out = [item for item in items if "full" in item.keywords]
        if left_out:
            config.hook.pytest_deselected(items=left_out)
            items[:] = [item for item in items if "full" not in item.keywords]
    if slow: return
    skip = pytest.mark.skip(reason="slow soak run; set HCQ_SLOW=1")
    for item in items:
        if "slow" in item.keywords or _slow_variant(item): item.add_marker(skip)


def _slow_variant(item) -> bool:
    """Whether `item` is a variant its test's `slow_on(param=value, ...)` marker leaves to HCQ_SLOW (the full run keeps
    one variant of a test whose others repeat it over another transport or kind)."""
    marker = item.get_closest_marker("slow_on")
    params = getattr(getattr(item, "callspec", None), "params", {})
    return marker is not None and all(params.get(k) == v for k, v in marker.kwargs.items())


# ---------------------------------------------------------------- mypy, started early
_mypy: dict = {}  # "proc": the `mypy hcq` started at collection's end, "out": its output file


def pytest_collection_finish(session):
    """Start `mypy hcq` (tests/test_typing.py) as soon as the run is known to include it, niced: from a cold cache it
    keeps a core busy for about 20 s, which the many tests that wait on servers and timeouts leave room for, instead of
    adding them to the run at its end. Its test waits for it."""
    if not any(item.name == "test_mypy_is_clean" for item in session.items): return
    import importlib.util
    import subprocess
    import sys
    import tempfile
    if importlib.util.find_spec("mypy") is None: return
    out = tempfile.TemporaryFile(mode="w+")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _mypy["out"] = out
    _mypy["proc"] = subprocess.Popen([sys.executable, "-m", "mypy", "hcq"], cwd=root, stdout=out, stderr=subprocess.STDOUT,
                                     preexec_fn=lambda: os.nice(19))


def pytest_unconfigure(config):
    proc = _mypy.pop("proc", None)
    if proc is not None and proc.poll() is None: proc.kill()


def mypy_result(timeout: float = 600) -> tuple[int, str]:
    """(exit status, output) of `mypy hcq`: the run started at collection's end, or a new one."""
    import subprocess
    import sys
    proc = _mypy.get("proc")
    if proc is None:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        r = subprocess.run([sys.executable, "-m", "mypy", "hcq"], cwd=root, capture_output=True, text=True, timeout=timeout)
        return r.returncode, r.stdout + r.stderr
    rc = proc.wait(timeout)
    _mypy["out"].seek(0)
    return rc, _mypy["out"].read()


# ---------------------------------------------------------------- Ctrl-C, however the suite was started
@pytest.fixture(scope="session", autouse=True)
def _sigint_raises_keyboard_interrupt():
    """The Ctrl-C tests need SIGINT to raise KeyboardInterrupt, which it does not in a Python started with SIGINT
    ignored: a background job of a non-interactive shell (`cmd &` in a script, `nohup cmd &`) inherits it ignored,
    and Python keeps it so. For the session, SIGINT gets Python's own handler there (and where it has its default
    action, which would kill the run); what was there comes back after. The processes the tests start inherit
    SIGINT's default action from it (exec keeps an ignored signal ignored, but resets a handled one), so a Python
    child raises KeyboardInterrupt as well. (pytest itself sets no SIGINT handler.)"""
    import signal
    import threading
    previous = signal.getsignal(signal.SIGINT)
    if previous not in (signal.SIG_IGN, signal.SIG_DFL) or threading.current_thread() is not threading.main_thread():
        yield  # a handler is there already (Python's, or one the caller installed): left alone
        return
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
