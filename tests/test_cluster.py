"""`hcq serve` launched by Ray (hcq.backends.remote.cluster), on a local Ray instance: one server per node with a
token the driver made, device names a client opens, and a server that crashes started again on its port (the
client reopens its device by name)."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import alive

ray = pytest.importorskip("ray", reason="launching with Ray needs hcq[ray]")
pytest.importorskip("libucx", reason="remote devices need hcq[remote]")

ROOT = Path(__file__).resolve().parents[1]

CLIENT = """
import os, sys, numpy as np, hcq
names, phase = sys.argv[1].split(","), sys.argv[2]
dev = hcq.Device(names[0])
prg = dev.compile("HCQ_KERNEL void put(int *a, int v) { a[hcq_global_id(0)] = v; }", "put")
buf = dev.allocator.alloc(64 * 4)
prg(buf, vals=(int(phase),), global_size=64, wait=True)
out = np.zeros(64, np.int32)
dev.allocator.copyout(memoryview(out), buf)
print("ran", dev.device, int(out.sum()), flush=True)
"""


@pytest.fixture(scope="module")
def local_ray():
    try:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    except Exception as e:  # noqa: BLE001 - a machine where Ray itself cannot start (no /dev/shm room, ...): say why
        pytest.skip(f"a local Ray instance cannot start here: {type(e).__name__}: {e}")
    yield
    ray.shutdown()


@pytest.mark.full
def test_ray_starts_a_server_per_node_and_restarts_one_that_crashes(local_ray):
    from hcq.backends.remote import protocol
    from hcq.backends.remote.cluster import launch
    saved = os.environ.get(protocol.TOKEN_ENV)
    servers = launch("CPU:0,CPU:1")
    try:
        nodes = [n for n in ray.nodes() if n["Alive"]]
        assert len(servers.devices) == 2 * len(nodes) and all("@" in d for d in servers.devices), servers.devices
        assert os.environ[protocol.TOKEN_ENV] == servers.token and len(servers.token) >= 24
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        run = lambda phase: subprocess.run([sys.executable, "-c", CLIENT, ",".join(servers.devices), phase], capture_output=True,
                                           text=True, env=env, cwd=ROOT, timeout=120)
        r = run("3")
        assert f"ran {servers.devices[0]} 192" in r.stdout, r.stdout + r.stderr
        no_token = subprocess.run([sys.executable, "-c", CLIENT, ",".join(servers.devices), "1"], capture_output=True, text=True,
                                  env={k: v for k, v in env.items() if k != protocol.TOKEN_ENV}, cwd=ROOT, timeout=120)
        assert no_token.returncode != 0 and "token" in no_token.stderr, no_token.stdout + no_token.stderr
        actor = servers.actors[0]
        pid = ray.get(actor.server_pid.remote())
        os.kill(pid, signal.SIGKILL)  # the server crashes; its actor starts it again on the same port
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and ray.get(actor.restart_count.remote()) == 0: time.sleep(0.2)
        assert ray.get(actor.restart_count.remote()) == 1 and ray.get(actor.server_pid.remote()) != pid
        assert servers.refresh() == servers.devices
        r = run("5")
        assert f"ran {servers.devices[0]} 320" in r.stdout, r.stdout + r.stderr
    finally:
        servers.shutdown()
        if saved is None: os.environ.pop(protocol.TOKEN_ENV, None)
        else: os.environ[protocol.TOKEN_ENV] = saved


def test_a_dead_node_neither_breaks_refresh_nor_keeps_shutdown_from_stopping_the_others(local_ray):
    """Issue 41, 10: with every process of one node killed, `refresh()` and `shutdown()` raised ActorUnavailableError,
    `shutdown()` stopped none of the surviving servers and kept the dead actors (raising again on every call), and the
    surviving nodes' device names could not be had. Two actors on this one node stand for two nodes; one is killed
    for good (its actor process gone, as with its node): refresh() gives the survivor's names and says which is gone,
    shutdown() stops the survivor's server, and a second shutdown() does nothing."""
    from hcq.backends.remote.cluster import RayServers, _actor_class
    actor_class = _actor_class()
    actors = [actor_class.remote("CPU:0", "t" * 24), actor_class.remote("CPU:0", "t" * 24)]
    servers = RayServers("t" * 24, actors, nodes=["alive-node", "dead-node"])
    try:
        assert len(servers.refresh()) == 2 and servers.gone == []
        survivor = ray.get(actors[0].server_pid.remote())
        ray.kill(actors[1], no_restart=True)
        _wait_dead(actors[1])  # (ray.kill returns before the actor is gone: a refresh at once could still reach it)
        names = servers.refresh()
        assert servers.gone == ["dead-node"] and names == servers.devices and len(names) == 1, (names, servers.gone)
        assert servers.shutdown() == ["dead-node"]
        assert servers.actors == [] and servers.devices == []
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and os.path.exists(f"/proc/{survivor}") and alive(survivor): time.sleep(0.1)
        assert not alive(survivor), "the surviving node's server still runs after shutdown()"
        assert servers.shutdown() == []
    finally:
        servers.shutdown()


def _wait_dead(actor, timeout_s: float = 30.0) -> None:
    """Until calls to `actor` fail (Ray kills an actor asynchronously)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get(actor.server_pid.remote(), timeout=5)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            return
        time.sleep(0.05)
    raise AssertionError(f"the killed actor still answered after {timeout_s} s")
