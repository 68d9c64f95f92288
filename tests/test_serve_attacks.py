"""Attacks on `hcq serve` before authentication (issue 40, points 4-6), each written as the attacker: a stranger's
messages at a worker, IPv6 listen addresses, and denial of service at the front door and its spare workers
(docs/design.md, "Threat model")."""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from typing import Any

import pytest

pytest.importorskip("libucx", reason="remote devices need hcq[remote] (libucx-cu12)")

from test_remote import ROOT, Served, _idle_worker_socket, _listening_ports, _workers, protocol_token  # noqa: E402 (pytest puts tests/ on sys.path)


def _hello_line(token: str | None) -> bytes:
    from hcq.backends.remote import protocol
    from hcq.backends.remote.door import where_am_i
    return json.dumps({"hcq": protocol.VERSION, "token": token, **where_am_i()}).encode() + b"\n"


def _connect_from(source: str, address: str, timeout: float = 5) -> socket.socket:
    """A TCP connection to HOST:PORT from local address `source` (any 127.x.y.z on loopback)."""
    host, port = address.rsplit(":", 1)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    sock.bind((source, 0))
    sock.connect((host, int(port)))
    return sock


def _knock(address: str, source: str = "127.0.0.1", token: str | None = None, timeout: float = 30) -> dict[str, Any]:
    """The door's answer to a hello from `source` (a worker's port and ticket, or a refusal); {} when the door closed
    the connection unanswered. socket.timeout when it says nothing for `timeout` s."""
    with _connect_from(source, address, timeout) as sock:
        sock.sendall(_hello_line(token))
        buf = b""
        while b"\n" not in buf:
            try:
                chunk = sock.recv(4096)
            except ConnectionResetError:
                chunk = b""
            if not chunk: return {}
            buf += chunk
    return dict(json.loads(buf.split(b"\n", 1)[0]))


def _say_hello(host: str, port: int, ticket: str | None, token: str | None = None) -> dict[str, Any]:
    """Connect to a worker as the client it was handed to, and say hello with its ticket; the answer."""
    from hcq.backends.remote import protocol
    from hcq.backends.remote.net import NetEngine
    with NetEngine() as engine:
        conn = engine.connect(host, port, 5000)
        return dict(json.loads(conn.request(protocol.call_message("hello", version=protocol.VERSION, token=token, ticket=ticket), 10000)))


def _closed(sock: socket.socket) -> bool:
    """Whether the peer closed `sock` (without waiting)."""
    sock.setblocking(False)
    try:
        return sock.recv(1) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


# ---- issue 40, 4: a stranger's messages at a worker

@pytest.mark.full
@pytest.mark.parametrize("isolation", ["process", "none"])
def test_a_strangers_messages_never_end_a_worker_or_the_server(isolation):
    """Issue 40, 4: a stranger at a worker's UCX port sent CALLs, then more messages than a stranger may: the engine
    closed its connection, the worker's reply to a CALL failed on it, and that error ended the worker (another client's,
    handed out and waiting for it) or, with --isolation none, the server of every client. The stranger is dropped;
    the worker's client still gets in."""
    from hcq.backends.remote import protocol
    from hcq.backends.remote.net import NetEngine
    from hcq.errors import HCQError
    s = Served(args=("--isolation", isolation))
    try:
        host = s.address.rsplit(":", 1)[0]
        victim = _knock(s.address)  # a client's worker, handed out: its port is where a port scan finds it
        assert victim.get("ok"), victim
        with NetEngine() as attacker:
            for _ in range(3):
                conn = attacker.connect(host, victim["port"], 3000)
                for _ in range(12):  # CALLs the worker answers, then past the 8 a stranger may send
                    try:
                        conn.send(protocol.call_message("open", device="CPU:0"))
                    except HCQError:
                        break
                deadline = time.monotonic() + 5
                while conn.alive and time.monotonic() < deadline: time.sleep(0.05)
                assert not conn.alive, "a stranger past its limits was kept"
            time.sleep(0.5)  # (the worker answers the CALLs it took)
        answer = _say_hello(host, victim["port"], victim["ticket"])
        assert answer.get("ok"), answer
        assert s.proc.poll() is None
    finally:
        log = s.close()
    assert "Traceback" not in log, log[-3000:]


# ---- issue 40, 5: IPv6

@pytest.mark.parametrize("listen", ["[::1]:0", "[::]:0"])
def test_ipv6_listen_addresses_are_refused_clearly(listen):
    """Issue 40, 5: a server listening on IPv6 let one stranger's connect corrupt a worker's heap (a UCX defect), and a
    [::1] server's workers listened on every interface. `hcq serve` refuses IPv6 addresses, saying to use IPv4."""
    proc = subprocess.Popen([sys.executable, "-m", "hcq", "serve", "--listen", listen], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=ROOT, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"hcq serve --listen {listen} is serving: {out} {err[-2000:]}") from None
    assert proc.returncode != 0 and "listening on" not in out, (out, err)
    assert "IPv6" in err and "IPv4" in err, err


def test_the_python_api_refuses_ipv6_listen_addresses(monkeypatch):
    """The same through the Python API: a v6 literal, and a name that resolves only to IPv6."""
    from hcq.backends.remote.door import FrontDoor
    from hcq.backends.remote.server import Server, check_listen_address
    for host in ("::1", "::", "fe80::1"):
        with pytest.raises(ValueError, match="IPv6.*IPv4"): check_listen_address(host, "t0ken")
    with pytest.raises(ValueError, match="IPv6"): FrontDoor("::1", 0, ("CPU:0",), None)
    with pytest.raises(ValueError, match="IPv6"): Server("::1", 0, ("CPU:0",))
    real = socket.getaddrinfo

    def only_v6(host: Any, *args: Any, **kwargs: Any) -> Any:
        if host == "v6only.example":
            if kwargs.get("family", args[1] if len(args) > 1 else 0) == socket.AF_INET: raise socket.gaierror(socket.EAI_ADDRFAMILY, "no IPv4 address")
            return [(socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("::1", 0, 0, 0))]
        return real(host, *args, **kwargs)
    monkeypatch.setattr(socket, "getaddrinfo", only_v6)
    with pytest.raises(ValueError, match="IPv6.*IPv4"): check_listen_address("v6only.example", None)


# ---- issue 40, 6: denial of service before authentication

@pytest.mark.full
def test_idle_connections_from_one_address_hold_few_places_at_the_door():
    """Issue 40, 6a: connections from one address that send nothing hold at most 8 places at the door (the oldest
    make room), and a client from that address still gets in."""
    s = Served()
    idle: list[socket.socket] = []
    try:
        for _ in range(24): idle.append(_connect_from("127.0.0.2", s.address))
        time.sleep(1)  # (well within the 5 s a hello may take)
        kept = sum(not _closed(c) for c in idle)
        assert kept <= 8, f"{kept} silent connections from one address are kept"
        assert _knock(s.address, "127.0.0.2").get("ok")
    finally:
        for c in idle: c.close()
        s.close()


@pytest.mark.full
def test_a_door_full_of_idle_connections_still_takes_a_client():
    """Issue 40, 6a: 64 connections that send nothing (8 from each of 8 addresses) filled the door's table of hellos
    being read, and every client was turned away for as long as they were renewed. The oldest idle one makes room."""
    s = Served()
    idle: list[socket.socket] = []
    try:
        for a in range(8):
            for _ in range(8): idle.append(_connect_from(f"127.0.0.{10 + a}", s.address))
        time.sleep(1)
        answer = _knock(s.address)
        assert answer.get("ok"), f"a client was turned away: {answer}"
    finally:
        for c in idle: c.close()
        s.close()


@pytest.mark.full
def test_strangers_at_a_wildcard_door_start_no_workers():
    """Issue 40, 6b: on a wildcard listen, the door started spare workers for every local address a connection came
    to, before any token was checked: 16 addresses, 16 workers, from empty connections. A worker starts for an address
    only once a hello on it passed the token check."""
    token = {protocol_token(): "t0ken"}
    s = Served(token, args=("--listen", "0.0.0.0:0"))
    port = int(s.address.rsplit(":", 1)[1])
    conns = []
    try:
        for a in range(8):  # empty connections, each to another address of this host
            conns.append(_connect_from(f"127.0.2.{a + 1}", f"127.0.1.{a + 1}:{port}"))
        refused = _knock(f"127.0.1.20:{port}", "127.0.2.20", token="wrong")
        assert not refused.get("ok") and "token" in refused.get("error", ""), refused
        time.sleep(1)  # (the door keeps its spares at each turn of its loop, every 0.2 s at most: five turns)
        assert _workers(s) == [], "strangers made the door start workers"
        answer = _knock(f"127.0.0.1:{port}", token="t0ken")
        assert answer.get("ok"), answer
    finally:
        for c in conns: c.close()
        s.close()


@pytest.mark.full
def test_a_stranger_cannot_reach_a_spare_worker():
    """Issue 40, 6c: a stranger that found a spare worker's UCX port filled its 64 stranger places, and the next
    client handed that worker was refused. A spare listens for nobody until it is handed out."""
    from hcq.backends.remote.net import NetEngine
    from hcq.errors import HCQError
    s = Served()
    try:
        pid, _ = _idle_worker_socket(s)  # (started and idle)
        taken = 0
        with NetEngine() as attacker:
            for p in _listening_ports(pid):
                try:
                    attacker.connect("127.0.0.1", p, 1000)
                except HCQError:
                    continue
                taken += 1
                for _ in range(70):
                    try:
                        attacker.connect("127.0.0.1", p, 1000)
                        taken += 1
                    except HCQError:
                        break
            answer = _knock(s.address)
            assert answer.get("ok") and answer["pid"] == pid, answer
            hello = _say_hello("127.0.0.1", answer["port"], answer["ticket"])
        assert taken == 0 and hello.get("ok"), f"a stranger connected to the spare worker {taken} times; its client was told {hello}"
    finally:
        s.close()


@pytest.mark.full
def test_a_token_holder_cannot_hold_many_workers_without_connecting():
    """Issue 40, 6d: a token holder that knocks and never connects held a worker for 30 s per knock, up to 256 of them.
    One address holds at most 4 workers it has not connected to; its next knock waits until it connects to one (or
    one expires, after ASSIGNED_S: 10 s), while other addresses are served at once."""
    from hcq.backends.remote import door
    s = Served({"HCQ_SERVE_SPARE": "2"})
    try:  # (from 127.0.0.1: the address a UCX connection to a worker comes from here, the only one its ports let in)
        held = [_knock(s.address, "127.0.0.1") for _ in range(4)]
        assert all(h.get("ok") for h in held), held
        with pytest.raises(socket.timeout):
            _knock(s.address, "127.0.0.1", timeout=3)  # a fifth waits...
        assert _knock(s.address, "127.0.0.3").get("ok")  # ...not for want of workers
        fifth = _connect_from("127.0.0.1", s.address, timeout=20)
        fifth.sendall(_hello_line(None))
        time.sleep(0.5)
        assert _say_hello("127.0.0.1", held[0]["port"], held[0]["ticket"]).get("ok")  # it connects to one of its workers
        answer = json.loads(fifth.recv(4096).split(b"\n", 1)[0])
        assert answer.get("ok"), answer
        fifth.close()
    finally:
        s.close()
    assert door.ASSIGNED_S <= 10
