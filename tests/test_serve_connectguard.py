"""Issue 40, 2, written as another user of the server's host: a client on 127.0.0.1 shares its address with every
local user, so the port filter (test_serve_portfilter) lets them all through to its worker, where UCX's tcp transport
executes a raw PUT frame from whoever completes its handshake. The connect guard (connectguard) refuses a connect()
to a worker's port from any local user but root, the worker itself, its client's uid and the workers its client
linked it with (docs/design.md, "Threat model": "Where a worker is reachable")."""
from __future__ import annotations

import os
import socket
import time

import pytest

pytest.importorskip("libucx", reason="remote devices need hcq[remote] (libucx-cu12)")

from hcq.backends.remote.connectguard import ConnectGuard, local_peer_uid  # noqa: E402
from test_remote import Served, _listening_ports  # noqa: E402 (pytest puts tests/ on sys.path)
from test_serve_portfilter import Holder  # noqa: E402

NOBODY = 65534
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="the connect guard is a root server's (cgroup BPF needs root)")


def _guard_or_skip() -> ConnectGuard:
    try:
        return ConnectGuard()
    except OSError as e:
        pytest.skip(f"this kernel takes no cgroup BPF connect guard: {e}")


def _connect_as(uid: int, port: int, host: str = "127.0.0.1", family: int = socket.AF_INET) -> str:
    """Connect to host:port from a forked child running as `uid` (no exec: it needs nothing from disk); "ok" or the
    error's name."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            if uid:
                os.setgroups([])
                os.setresgid(uid, uid, uid)
                os.setresuid(uid, uid, uid)
            with socket.socket(family) as sock:
                sock.settimeout(2)
                try:
                    sock.connect((host, port))
                    os.write(w, b"ok")
                except OSError as e:
                    os.write(w, (os.strerror(e.errno) if e.errno else type(e).__name__).encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f: out = f.read().decode()
    os.waitpid(pid, 0)
    return out


def _serve_as(uid: int, address: str = "127.0.0.1") -> tuple[int, int]:
    """A forked child as `uid` listening on address:0; returns (its pid, its port). It exits after 30 s (or killed)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
            server = socket.create_server((address, 0))
            os.write(w, f"{server.getsockname()[1]}\n".encode())
            server.settimeout(0.2)
            end = time.monotonic() + 30
            while time.monotonic() < end:
                try:
                    server.accept()[0].close()
                except OSError:
                    pass
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f: line = f.readline()
    if not line: raise AssertionError("the listening child did not start")
    return pid, int(line)


def _end(pid: int) -> None:
    os.kill(pid, 9)
    os.waitpid(pid, 0)


@pytest.mark.full
@needs_root
def test_the_guard_refuses_every_local_user_but_the_owner_root_and_those_let_in():
    """The guard itself: a socket a worker's uid makes, listening on 127.0.0.1 or 0.0.0.0, refuses connect() from another
    uid, by IPv4 and by IPv4-mapped IPv6 (EPERM: no SYN is ever sent), takes the owner itself and root, takes a uid let
    in for that owner and no other owner's; once the worker is removed its allowances go and its uid's new sockets are
    no worker's; other uids' ports are untouched, and nothing is guarded after close()."""
    guard = _guard_or_skip()
    worker, other_worker, friend = 61190, 61191, 61192
    children = []
    try:
        guard.add_worker(worker)
        guard.add_worker(other_worker)
        pid, port = _serve_as(worker)
        children.append(pid)
        pid, wild = _serve_as(worker, "0.0.0.0")
        children.append(pid)
        pid, plain = _serve_as(friend)  # (not a worker: not guarded)
        children.append(pid)
        for p in (port, wild):
            assert _connect_as(NOBODY, p) == os.strerror(1), f"another user connected to the worker's port {p}"
            assert _connect_as(NOBODY, p, "::ffff:127.0.0.1", socket.AF_INET6) == os.strerror(1)
            assert _connect_as(worker, p) == "ok" and _connect_as(0, p) == "ok"
        assert _connect_as(NOBODY, plain) == "ok", "the guard refused a port no worker bound"
        guard.allow(other_worker, [friend])
        assert _connect_as(friend, port) == os.strerror(1), "a uid let in for another worker reached this one"
        guard.allow(worker, [friend])
        assert _connect_as(friend, port) == "ok" and _connect_as(friend, wild) == "ok"
        assert _connect_as(NOBODY, port) == os.strerror(1)
        guard.remove_worker(worker)
        assert _connect_as(friend, port) == os.strerror(1), "an allowance outlived its worker"
        pid, later = _serve_as(worker)  # (its uid is no worker's now: a socket made now is no worker's)
        children.append(pid)
        assert _connect_as(NOBODY, later) == "ok", "a removed worker's uid still makes guarded sockets"
    finally:
        for pid in children: _end(pid)
        guard.close()
    pid, port = _serve_as(worker)
    try:
        assert _connect_as(NOBODY, port) == "ok", "the guard outlived its close()"
    finally:
        _end(pid)


def test_a_local_clients_uid_is_read_from_its_own_end_of_the_connection():
    """local_peer_uid: the uid of a local peer's socket (this process's, here), and None for a socket with no peer."""
    with socket.create_server(("127.0.0.1", 0)) as server, socket.create_connection(server.getsockname()) as c:
        accepted, _ = server.accept()
        with accepted:
            assert local_peer_uid(accepted) == os.geteuid()
            assert local_peer_uid(server) is None
        assert c


@pytest.mark.full
@needs_root
@pytest.mark.parametrize("isolation", ["process", "none"])
def test_another_local_user_cannot_connect_to_the_worker_of_a_loopback_client(isolation):
    """Issue 40, 2 (c): a client on 127.0.0.1; another user of the host (nobody) connected to each port its worker listens
    on (from 127.0.0.1: the port filter lets that address in), and UCT's tcp handshake and a raw PUT could follow. Now
    each connect() is refused (EPERM) while the client's devices still work; the worker holds no handle on the guard."""
    s = Served(args=("--isolation", isolation))
    holder = None
    try:
        if "cannot be kept from other users" in s.stderr(): pytest.skip("this kernel takes no cgroup BPF connect guard")
        holder = Holder(s.device(0))
        ports = sorted(_listening_ports(holder.pids[0]))
        assert ports, "the worker listens on no port"
        got = {p: _connect_as(NOBODY, p) for p in ports}
        assert set(got.values()) == {os.strerror(1)}, f"another local user reached the worker's ports: {got}"
        assert holder.works(), holder.close()
        fds = os.listdir(f"/proc/{holder.pids[0]}/fd")
        links = {os.readlink(f"/proc/{holder.pids[0]}/fd/{fd}") for fd in fds if os.path.exists(f"/proc/{holder.pids[0]}/fd/{fd}")}
        assert not any("bpf" in link for link in links), f"the worker holds a BPF object: {links}"
    finally:
        err = holder.close() if holder is not None else ""
        log = s.close()
    assert "Traceback" not in log + err, (log + err)[-3000:]
