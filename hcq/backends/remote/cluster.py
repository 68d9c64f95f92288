"""`hcq serve` on every node of a Ray cluster, launched by Ray (pip install 'hcq[ray]'):

    import ray, hcq
    from hcq.backends.remote.cluster import launch
    ray.init(address="auto")               # a running cluster (SLURM, Kubernetes, ... through Ray's own launchers)
    servers = launch("CPU:0,CPU:1")         # one `hcq serve` per node, on the node's address and a free port
    devices = [hcq.Device(name) for name in servers.devices]

One actor per alive node (pinned to it, taking no CPU from Ray's accounting) starts `hcq serve --listen <node>:0`
with a token this driver generated (given to the actors, and set in this process's environment so that its clients
present it) and reports the device names. When a server dies, its actor starts it again at once on the same port,
so the names stay valid and clients reopen them with `hcq.Device(name)`; Ray restarts an actor that dies (its
server then gets a new port: `servers.refresh()` reads the names again)."""
from __future__ import annotations

import os
import secrets
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from hcq.backends.remote import protocol
from hcq.errors import HCQError

START_S = 60.0  # how long a server may take to start on its node


# `hcq serve`, started so that it gets SIGTERM when the thread that started it ends (the actor's watcher, which lives
# as long as the actor): a server never outlives the actor that keeps it.
_LAUNCH = ("import ctypes, os, signal, sys; ctypes.CDLL(None).prctl(1, int(signal.SIGTERM), 0, 0, 0); "
           "os.getppid() == int(sys.argv[1]) or os._exit(1); "
           "os.execv(sys.executable, [sys.executable, '-m', 'hcq', 'serve', *sys.argv[2:]])")


class _ServerOnNode:
    """The actor (made a Ray actor class by `_actor_class`): runs `hcq serve` on its node and keeps it running."""

    def __init__(self, devices: str, token: str):
        self.devices, self.token = devices, token
        self.port = 0
        self.proc: subprocess.Popen | None = None
        self.names: list[str] = []
        self.error: str | None = None
        self.restarts = 0
        self.stopping = False
        self.ready = threading.Event()
        threading.Thread(target=self._run, name="hcq-serve-watch", daemon=True).start()

    def start(self) -> list[str]:
        """The server's device names, once it listens."""
        if not self.ready.wait(START_S) or self.error is not None:
            raise HCQError(self.error or f"hcq serve did not start within {START_S:.0f} s")
        return list(self.names)

    def _spawn(self) -> None:
        import ray
        ip = ray.util.get_node_ip_address()
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "devices")
            self.proc = subprocess.Popen([sys.executable, "-c", _LAUNCH, str(os.getpid()), "--listen", f"{ip}:{self.port}",
                                          "--devices", self.devices, "--address-file", path],
                                         env={**os.environ, protocol.TOKEN_ENV: self.token}, stdout=subprocess.DEVNULL)
            deadline = time.monotonic() + START_S
            while not os.path.exists(path):
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise HCQError(f"hcq serve did not start on {ip}:{self.port} (exit code {self.proc.poll()})")
                time.sleep(0.05)
            with open(path) as f: self.names = f.read().split()
        self.port = int(self.names[0].rsplit(":", 1)[1])  # (a restart binds the same port: the names stay valid)

    def _run(self) -> None:
        """Start the server, then start it again whenever it exits (on the same port), until stop()."""
        while not self.stopping:
            if self.proc is None or self.proc.poll() is not None:
                try:
                    self._spawn()
                    if self.ready.is_set(): self.restarts += 1
                    self.error = None
                except HCQError as e:
                    self.error = str(e)
                    time.sleep(1.0)  # (its port may be held for a moment: try again)
                self.ready.set()
            time.sleep(0.1)

    def server_pid(self) -> int:
        return self.proc.pid if self.proc is not None else 0

    def restart_count(self) -> int:
        return self.restarts

    def stop(self) -> None:
        self.stopping = True
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def _actor_class() -> Any:
    import ray
    return ray.remote(num_cpus=0, max_restarts=-1)(_ServerOnNode)


@dataclass
class RayServers:
    """The servers `launch` started: their device names, the token (left out of repr(): a result that is printed or
    logged must not carry it), the actors keeping them running, and the nodes they run on (parallel to `actors`).
    `gone`: the nodes whose actor could not be reached at the last `refresh` or `shutdown` (a node that died)."""
    token: str = field(repr=False)
    actors: list[Any]
    devices: list[str] = field(default_factory=list)
    nodes: list[str] = field(default_factory=list)
    gone: list[str] = field(default_factory=list)

    def _node(self, i: int) -> str:
        return self.nodes[i] if i < len(self.nodes) else f"actor {i}"

    def _ask(self, method: str, timeout_s: float) -> list[Any]:
        """Call `method` on every actor; each one's result, or the Ray error that says it cannot be reached (a dead
        node: the actor died, is unavailable, or did not answer within `timeout_s`). An error raised by the method
        itself (a server that cannot start) is raised."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError
        refs: list[Any] = []
        for a in self.actors:
            try:
                refs.append(getattr(a, method).remote())
            except RayActorError as e:
                refs.append(e)
        out: list[Any] = []
        deadline = time.monotonic() + timeout_s
        for ref in refs:
            if isinstance(ref, BaseException):
                out.append(ref)
                continue
            try:
                out.append(ray.get(ref, timeout=max(0.1, deadline - time.monotonic())))
            except (RayActorError, GetTimeoutError) as e:  # (ActorDiedError, ActorUnavailableError: its node is gone)
                out.append(e)
        return out

    def refresh(self) -> list[str]:
        """The device names as the actors report them now (after Ray restarted an actor, its server has a new port).
        Nodes whose actor cannot be reached are left out and listed in `gone`; HCQError when no server is left."""
        results = self._ask("start", START_S + 10)
        self.gone = [self._node(i) for i, r in enumerate(results) if isinstance(r, BaseException)]
        self.devices = [name for r in results if not isinstance(r, BaseException) for name in r]
        if self.actors and not self.devices:
            raise HCQError(f"no hcq server can be reached: every node is gone ({', '.join(self.gone)})")
        return self.devices

    def shutdown(self) -> list[str]:
        """Stop every server that can be reached and its actor, and forget them all (a second call does nothing);
        returns the nodes that could not be reached (also in `gone`)."""
        import ray
        results = self._ask("stop", 30.0)
        self.gone = [self._node(i) for i, r in enumerate(results) if isinstance(r, BaseException)]
        for a in self.actors:
            try:
                ray.kill(a)
            except Exception:  # noqa: BLE001 - an actor of a dead node: nothing left to kill
                pass
        self.actors, self.nodes, self.devices = [], [], []
        return self.gone


def launch(devices: str = "CPU:0,CPU:1", *, token: str | None = None, set_env: bool = True) -> RayServers:
    """One `hcq serve` per alive node of the Ray cluster this process is connected to (`ray.init` first), serving
    `devices` with `token` (default: a new random one; with `set_env`, put in this process's environment for its
    clients). Returns when every server listens."""
    try:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
    except ImportError as e:
        raise HCQError("launching servers with Ray needs Ray: pip install 'hcq[ray]'") from e
    if not ray.is_initialized(): raise HCQError("connect to a Ray cluster first: ray.init(address='auto'), or ray.init() for this machine")
    token = token or secrets.token_urlsafe(24)
    actor_class = _actor_class()
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    actors = [actor_class.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote(devices, token)
              for n in nodes]
    servers = RayServers(token, actors, nodes=[str(n.get("NodeManagerAddress") or n["NodeID"]) for n in nodes])
    try:
        servers.refresh()
    except BaseException:
        servers.shutdown()
        raise
    if set_env: os.environ[protocol.TOKEN_ENV] = token
    return servers
