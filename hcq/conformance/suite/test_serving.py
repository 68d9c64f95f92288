"""Serving: a backend that names a DEVICE_HOST (docs/backends.md, "Serving a backend") has every member of
`hcq.interfaces.DeviceHost`, and `hcq serve` hosts its device for a client: the client learns what the device is from
the server, compiles and launches the device's conformance kernels on it, and moves bytes both ways. A backend without
a DEVICE_HOST is refused by `hcq serve` with a message naming what it lacks (allowed: serving is optional)."""
import re
import subprocess
import sys
import tempfile
from array import array

import pytest

import hcq
from hcq.conformance.plugin import WAIT_MS, download, launch, require_session, upload

require_session()

SERVE_START_S = 60  # a server that does not say where it listens by then did not start


def _served_kind(dev) -> tuple[str, str]:
    """(kind, index) of `dev`, or a skip: a device that is itself served (its server's own kit run checks its host)."""
    if "@" in dev.device: pytest.skip(f"{dev.device} is a served device: run the kit on its server's host to check its backend's DEVICE_HOST")
    kind, _, index = dev.device.partition(":")
    return kind, index or "0"


def _servable(kind: str) -> None:
    """Nothing for a backend with a complete DEVICE_HOST; a skip for one without (ValueError for an incomplete one)."""
    from hcq import registry
    try:
        registry.device_host_class(kind)
    except ValueError as e:
        if "names no DEVICE_HOST" in str(e): pytest.skip(f"the {kind} backend names no DEVICE_HOST: hcq serve refuses it, saying so")
        raise


def test_a_device_host_has_every_member_the_server_uses(dev):
    _servable(_served_kind(dev)[0])


def test_hcq_serve_hosts_the_device_for_a_client(dev):
    """`hcq serve --devices KIND:N` (unconfined: the isolation of workers is the server's, tested with hcq itself) hosts
    the device: a client opens it, gets its kind and capabilities from the server, runs the conformance kernels there
    and copies bytes in and out."""
    kind, index = _served_kind(dev)
    _servable(kind)
    if (why := hcq.registry.unavailable_reason("REMOTE")) is not None: pytest.skip(f"hcq serve cannot run here: {why}")
    log = tempfile.TemporaryFile(mode="w+")  # (a pipe nobody reads would fill and stall the server)
    proc = subprocess.Popen([sys.executable, "-m", "hcq", "serve", "--devices", f"{kind}:{index}", "--no-confine"],
                            stdout=subprocess.PIPE, stderr=log, text=True, start_new_session=True)
    served = None
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not (m := re.search(r"listening on (\S+:\d+)", line)):
            log.seek(0)
            pytest.fail(f"hcq serve --devices {kind}:{index} did not start: {line!r} {log.read()[-3000:]}")
        served = hcq.Device(f"{kind}:{index}@{m.group(1)}")
        assert served.capabilities.queue_count("compute") >= 1, served.capabilities
        fill = served.compile(*served.CONFORMANCE_KERNELS["fill"])
        add = served.compile(*served.CONFORMANCE_KERNELS["add"])
        n = 1024
        a, b = upload(served, array("I", range(n))), served.allocator.alloc(4 * n)
        launch(fill, (b,), (7, n), n)
        launch(add, (b, b, a), (n,), n)  # b = b + a
        served.synchronize(timeout=WAIT_MS)
        got = array("I", download(served, b, 4 * n))
        assert list(got) == [7 + i for i in range(n)], list(got[:8])
    finally:
        if served is not None: served.close()
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
