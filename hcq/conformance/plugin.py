"""pytest plugin of the conformance kit: `--hcq-device=DEVICE` runs `hcq.conformance.suite` against DEVICE.

Loaded with `-p hcq.conformance.plugin` or, where hcq is installed, through its pytest11 entry point
`hcq-conformance`. It only adds the option: without `--hcq-device` it registers no fixture and does nothing, so
other test runs are untouched. With it, the device is opened when the session starts (a device that does not open, or
has no capability record, is a usage error) and these fixtures exist:

    dev       the device (hcq.Device(DEVICE)), session-wide
    caps      dev.capabilities (an hcq.interfaces.Capabilities)
    kernels   the device's conformance kernels, compiled: kernels["fill"] is an HCQProgram; a missing optional
              behaviour ("fault") skips the test that asks for it
    dev2      a second device of the same kind (index + 1) in the same peer group, or a skip (per test: opened anew
              after a test closed it)
    gates     gates.new() makes a signal for a queue to wait on; every gate is opened when the test ends
    queue_spec, copy_index
              parametrized from the capabilities: a queue of each kind the device has (QueueSpec) / the index of
              each copy queue

and helpers for tests: `skip_unless(cap)`, `new_buffer`, `upload`, `download`, `read_u32`, `poke` (with `require_poke`),
`launch`, `still_blocked`.
"""
from __future__ import annotations

import sys
import time
import types
from array import array
from dataclasses import dataclass
from typing import Any, Iterator

import pytest

ENTRY_POINT = "hcq-conformance"
REQUIRED_KERNELS = ("fill", "add", "spin")
WAIT_MS = 10_000  # ms; a wait that should succeed but takes this long means the device is stuck
GATE_OPEN = 1 << 62  # the value gates are opened to at the end of a test (every wait on a gate is >=)

_session: Session | None = None  # the conformance session of this pytest run, once --hcq-device was given


# ------------------------------------------------------------------ hooks (always registered, act only on the option)
def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("hcq-conformance", "hcq backend conformance kit")
    group.addoption("--hcq-device", action="store", default=None, metavar="DEVICE",
                    help="run the hcq conformance suite (--pyargs hcq.conformance.suite) against DEVICE, e.g. CPU or CPU:1")


def pytest_plugin_registered(plugin: object, plugin_name: str | None, manager: Any) -> None:
    # Loaded with -p under its module name while hcq's entry point would register this same module again under
    # ENTRY_POINT, which pytest refuses ("already registered under a different name"): block the second one.
    if plugin is sys.modules[__name__] and plugin_name != ENTRY_POINT and manager.get_plugin(ENTRY_POINT) is None:
        manager.set_blocked(ENTRY_POINT)


def pytest_configure(config: pytest.Config) -> None:
    name = config.getoption("hcq_device", default=None)
    if name is None: return
    global _session
    _session = Session(name)
    config.pluginmanager.register(_session, "hcq-conformance-session")
    config.pluginmanager.register(_session.fixtures(), "hcq-conformance-fixtures")


def pytest_unconfigure(config: pytest.Config) -> None:
    global _session
    if _session is not None and config.pluginmanager.get_plugin("hcq-conformance-session") is _session:
        for name in ("hcq-conformance-fixtures", "hcq-conformance-session"): config.pluginmanager.unregister(name=name)
        _session = None


# ------------------------------------------------------------------ the session: hooks and fixtures once --hcq-device is given
@dataclass(frozen=True)
class QueueSpec:
    """One queue of the device: ("compute", 0) or ("copy", i)."""
    kind: str
    index: int

    def make(self, dev: Any) -> Any:
        """A new, empty queue of this kind and index."""
        return dev.hw_compute_queue_t() if self.kind == "compute" else dev.hw_copy_queue_t(self.index)

    def other(self, dev: Any, caps: Any) -> Any | None:
        """A new queue other than this one (to unblock it with), or None when the device has no other."""
        if not getattr(caps, "independent_copy", True): return None  # (its copy queue waits behind the blocked compute queue)
        if self.kind == "copy": return dev.hw_compute_queue_t()
        return dev.hw_copy_queue_t(0) if caps.queues.get("copy", 0) > 0 else None

    def __str__(self) -> str:
        return "compute" if self.kind == "compute" else f"copy{self.index}"


class Kernels(dict):
    """behaviour -> compiled HCQProgram; asking for a behaviour the backend does not provide skips the test."""

    def __init__(self, device: str, programs: dict[str, Any]):
        super().__init__(programs)
        self.device = device

    def __missing__(self, key: str) -> Any:
        pytest.skip(f"{self.device}: the backend's CONFORMANCE_KERNELS has no {key!r} kernel")


class Gates:
    """Signals tests hold queues on; each is opened (stored to GATE_OPEN) when the test ends, so a failing test
    never leaves a queue blocked for the next one."""

    def __init__(self, dev: Any):
        self.device = dev
        self.signals: list[Any] = []

    def new(self, value: int = 0) -> Any:
        sig = self.device.new_signal(value=value)
        self.signals.append(sig)
        return sig

    def open_all(self) -> None:
        for sig in self.signals:
            if sig.value < GATE_OPEN: sig.value = GATE_OPEN


class Session:
    """The conformance run of one device: opened at session start, torn down by nothing (devices live until exit)."""

    def __init__(self, name: str):
        self.name = name
        self.device: Any = None
        self.capabilities: Any = None
        self.other_devs: list[Any] = []  # second devices tests opened (kept clean like the first)

    # ---- hooks
    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionstart(self, session: pytest.Session) -> None:
        import hcq
        try:
            self.device = hcq.Device(self.name)
        except Exception as e:  # noqa: BLE001 - whatever went wrong, say so instead of failing every test
            raise pytest.UsageError(f"--hcq-device={self.name}: cannot open the device: {type(e).__name__}: {e}") from None
        caps = getattr(self.device, "capabilities", None)
        if caps is None:
            raise pytest.UsageError(f"--hcq-device={self.name}: {type(self.device).__name__} has no capability record "
                                    "(dev.capabilities, an hcq.interfaces.Capabilities); the kit needs one to know what to test")
        self.capabilities = caps

    def pytest_report_header(self, config: pytest.Config) -> list[str]:
        if self.device is None: return []
        return [f"hcq conformance: {self.device.device} ({type(self.device).__module__}.{type(self.device).__name__})",
                *(f"  {line}" for line in self.device.describe())]

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        if self.capabilities is None: return
        ncopy = self.capabilities.queues.get("copy", 0)
        if "queue_spec" in metafunc.fixturenames:
            specs = [QueueSpec("compute", 0)] + ([QueueSpec("copy", 0)] if ncopy else [])  # each kind (copy_index: each copy queue)
            metafunc.parametrize("queue_spec", specs, ids=[str(s) for s in specs])
        if "copy_index" in metafunc.fixturenames:
            params = [pytest.param(i, id=f"copy{i}") for i in range(ncopy)] or \
                     [pytest.param(0, id="no-copy-queue", marks=pytest.mark.skip(reason="caps.queues has no copy queue"))]
            metafunc.parametrize("copy_index", params)

    def fixtures(self) -> types.ModuleType:
        """The session's fixtures, as a module registered as a plugin of its own (so they exist only with the option)."""
        s = self
        mod = types.ModuleType("hcq.conformance.plugin.<fixtures>")

        @pytest.fixture(scope="session")
        def dev() -> Any:
            return s.device

        @pytest.fixture(scope="session")
        def caps() -> Any:
            return s.capabilities

        @pytest.fixture(scope="session")
        def kernels(dev: Any) -> Kernels:
            return compile_kernels(dev)

        @pytest.fixture
        def dev2(dev: Any) -> Any:  # (per test: a test that closes it gets it opened anew by the next one)
            import hcq
            local, at, server = dev.device.partition("@")  # a remote device's second device is on the same server
            kind, _, idx = local.partition(":")
            name = f"{kind}:{int(idx or 0) + 1}{at}{server}"
            try:
                other = hcq.Device(name)
            except Exception as e:  # noqa: BLE001 - no second device: the tests that need one skip
                pytest.skip(f"no second device: {name} does not open ({type(e).__name__}: {e})")
            if other.peer_group != dev.peer_group:
                pytest.skip(f"{name} is in peer group {other.peer_group!r}, {dev.device} in {dev.peer_group!r}")
            if other not in s.other_devs: s.other_devs.append(other)
            return other

        @pytest.fixture
        def gates(dev: Any) -> Iterator[Gates]:
            g = Gates(dev)
            try:
                yield g
            finally:
                g.open_all()

        @pytest.fixture
        def clean_device(dev: Any) -> Iterator[None]:
            """After the test: every device it used is idle and healthy (a failure it left is recovered, then reported)."""
            yield
            s.other_devs[:] = [d for d in s.other_devs if not d.closed]  # (one the test closed is done with)
            problems = [p for d in [dev, *s.other_devs] if (p := settle(d)) is not None]
            if problems: pytest.fail("\n".join(problems), pytrace=False)

        for f in (dev, caps, kernels, dev2, gates, clean_device): setattr(mod, f.__name__, f)
        return mod


def compile_kernels(dev: Any) -> Kernels:
    """The conformance kernels of `dev`'s backend, compiled for `dev` (a missing or broken table fails the test)."""
    table = getattr(dev, "CONFORMANCE_KERNELS", None)  # (a remote device has its server's)
    if table is None:
        pytest.fail(f"{type(dev).__name__} has no CONFORMANCE_KERNELS: the backend must provide the kernels the kit runs "
                    "(see hcq.conformance for the contract)", pytrace=False)
    missing = [k for k in REQUIRED_KERNELS if k not in table]
    if missing: pytest.fail(f"{type(dev).__name__}.CONFORMANCE_KERNELS lacks the required {', '.join(missing)}", pytrace=False)
    programs = {}
    for behaviour, (source, name) in table.items():
        try:
            programs[behaviour] = dev.compile(source, name)
        except Exception as e:  # noqa: BLE001 - name the behaviour whose kernel did not build
            pytest.fail(f"{dev.device}: the {behaviour!r} conformance kernel {name!r} did not compile: {type(e).__name__}: {e}",
                        pytrace=False)
    return Kernels(dev.device, programs)


def settle(dev: Any) -> str | None:
    """Wait until `dev` is idle; what is wrong with it if it is not (a failure is recovered where the device can)."""
    import hcq
    try:
        dev.synchronize(timeout=WAIT_MS)
    except hcq.DeviceError as e:
        if getattr(dev.capabilities, "recover", False): dev.recover()
        return f"the test left {dev.device} failed: {e}"
    except hcq.HCQTimeoutError as e:
        return f"the test left {dev.device} with work that does not finish: {e}"
    return None


# ------------------------------------------------------------------ helpers for tests
def session() -> Session:
    if _session is None or _session.device is None:
        raise RuntimeError("no conformance session: run with --hcq-device=DEVICE (python -m hcq.conformance DEVICE)")
    return _session


def skip_unless(cap: str) -> None:
    """Skip the test unless the device's capability `cap` is on (a true field of dev.capabilities)."""
    if not getattr(session().capabilities, cap):
        pytest.skip(f"capability {cap!r} is off for {session().device.device}")


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def launch(prg: Any, bufs: tuple, vals: tuple, n: int, local: int = 64, wait: bool = False) -> Any:
    """Call `prg` over a 1-D grid covering `n` threads in blocks of `local` threads."""
    return prg(*bufs, global_size=(max(1, ceil_div(n, local)), 1, 1), local_size=(local, 1, 1), vals=vals, wait=wait)


def upload(dev: Any, data: bytes | bytearray | memoryview | array, size: int | None = None) -> Any:
    """A new buffer of `size` bytes (default: the data's) holding `data` at its start, once this returns: a host copy
    is ordered on the device's timeline only, and queues the tests build by hand do not wait for the timeline."""
    import hcq
    mv = memoryview(data).cast("B")
    buf = dev.allocator.alloc(max(1, size if size is not None else mv.nbytes), hcq.BufferSpec())
    if mv.nbytes:
        dev.allocator.copyin(buf, mv)
        dev.synchronize(timeout=WAIT_MS)
    return buf


def new_buffer(dev: Any, nbytes: int, fill: int = 0) -> Any:
    """A new buffer of `nbytes` bytes, every byte `fill` (buffers may come back from a cache with old bytes)."""
    return upload(dev, bytes([fill]) * nbytes)


def download(dev: Any, buf: Any, nbytes: int | None = None) -> bytes:
    """The first `nbytes` (default all) bytes of `buf`, once all earlier work on `dev` finished."""
    out = bytearray(buf.size if nbytes is None else nbytes)
    if out: dev.allocator.copyout(memoryview(out), buf)
    return bytes(out)


def read_u32(dev: Any, buf: Any, n: int | None = None) -> list[int]:
    """The first `n` (default all) uint32 elements of `buf`."""
    n = buf.size // 4 if n is None else n
    return list(array("I", download(dev, buf, n * 4)))


def require_poke(dev: Any, caps: Any, busy: QueueSpec | None = None) -> None:
    """Skip the test (before it blocks anything) unless `poke` can reach memory while `busy` is blocked."""
    busy = busy if busy is not None else QueueSpec("compute", 0)
    if busy.other(dev, caps) is None and not getattr(caps, "host_visible_memory", False):
        why = "capability 'independent_copy' is off" if caps.queues.get("copy", 0) else "it has no copy queue"
        pytest.skip(f"{dev.device}: {why} and capability 'host_visible_memory' is off: nothing can unblock its {busy}")


def poke(dev: Any, caps: Any, buf: Any, value: int, b64: bool = False, busy: QueueSpec | None = None) -> None:
    """Store `value` into device memory `buf` while the queue `busy` (default the compute queue) is blocked: through a
    WRITE on another queue (waited for), else through the host view (see require_poke)."""
    busy = busy if busy is not None else QueueSpec("compute", 0)
    q = busy.other(dev, caps)
    if q is not None:
        done = dev.new_signal(value=0)
        q.write(buf, value, b64=b64).signal(done, 1).submit(dev)
        done.wait(1, timeout=WAIT_MS)
    else:
        buf.cpu_view().view(0, 8 if b64 else 4, "Q" if b64 else "I")[0] = value


def require_session() -> None:
    """At the top of a suite module: skip the module when the run has no --hcq-device (nothing to test against)."""
    if _session is None:
        pytest.skip("the hcq conformance suite runs against a device: pass --hcq-device=DEVICE "
                    "(or run python -m hcq.conformance DEVICE)", allow_module_level=True)


def idle_queue_states(dev: Any) -> list[dict[str, Any]]:
    """`dev.queue_states()` once every queue shows itself idle (the caller synchronized first). A queue finishes its
    last packet a moment after that packet's signal lands, as hardware read pointers trail end-of-pipe signals; a queue
    still busy after WAIT_MS fails the test."""
    deadline = time.monotonic() + WAIT_MS / 1000
    while True:
        states = dev.queue_states()
        if all(st["current"] is None and st["rptr"] == st["wptr"] for st in states): return states
        assert time.monotonic() < deadline, f"{dev.device}: queues still busy {WAIT_MS} ms after synchronize: {states}"
        time.sleep(0.0005)


def still_blocked(sig: Any, below: int, seconds: float = 0.03) -> bool:
    """Whether `sig` stays below `below` for `seconds` (a queue held on a wait or poll has not gone past it)."""
    time.sleep(seconds)
    return sig.value < below
