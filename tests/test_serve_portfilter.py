"""Issue 40, 2, written as the attacker: UCX's tcp transport executes a raw PUT frame (a write to any address of the
process) from any peer that completes UCT's tcp handshake on one of a worker's ports, whatever the worker's settings.
Hand-writing such a frame is out of scope here; what every UCT frame needs first is a TCP connection, and these tests
show that none opens: a worker's listening TCP sockets take connections only from its client's address (and from
servers its client linked it with), filtered by the kernel (docs/design.md, "Threat model": "Where a worker is
reachable"). On loopback a socket bound to 127.0.0.2 comes from another address than a client of 127.0.0.1."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

pytest.importorskip("libucx", reason="remote devices need hcq[remote] (libucx-cu12)")

from test_remote import ROOT, Served, _idle_worker_socket, _listening_ports, client  # noqa: E402 (pytest puts tests/ on sys.path)

HOLDER = """
import sys, hcq
devs = [hcq.Device(name) for name in sys.argv[1:]]
print(*[d.connection.info["pid"] for d in devs], flush=True)
for line in sys.stdin:  # each line: the devices still work ("transfer": also between the first two, both ways)
    data = bytes(range(256)) * 4096
    bufs = [d.allocator.alloc(len(data)) for d in devs]
    for d, b in zip(devs, bufs): d.allocator.copyin(b, memoryview(data))
    if line.strip() == "transfer":
        (a, b), (ba, bb) = devs[:2], bufs[:2]
        b.allocator.copyin(bb, memoryview(bytes(len(data))))
        a.allocator.transfer(bb, ba, len(data), a, b)
        b.synchronize()
        a.allocator.copyin(ba, memoryview(bytes(len(data))))
        b.allocator.transfer(ba, bb, len(data), b, a)
        a.synchronize()
    outs = [bytearray(len(data)) for _ in devs]
    for d, b, out in zip(devs, bufs, outs): d.allocator.copyout(memoryview(out), b)
    print("ok" if all(out == data for out in outs) else "wrong", flush=True)
"""


class Holder:
    """A client process that holds devices (and so their workers) until closed; `pids` are their workers'."""

    def __init__(self, *devices: str, env: dict[str, str] | None = None):
        self.proc = subprocess.Popen([sys.executable, "-c", HOLDER, *devices], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, cwd=ROOT, env={**os.environ, **(env or {})})
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait(30)
            raise AssertionError(f"the client could not open {devices}: {self.proc.stderr.read() if self.proc.stderr else ''}")
        self.pids = [int(p) for p in line.split()]

    def works(self, what: str = "copies") -> bool:
        """Whether its devices still work (copies in and out; "transfer": also between the first two, both ways)."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(what + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip() == "ok"

    def close(self) -> str:
        return close_client(self.proc)


def close_client(proc: subprocess.Popen) -> str:
    """End a client process that runs until its stdin closes (killed after 30 s); its stderr."""
    if proc.stdin is not None and not proc.stdin.closed: proc.stdin.close()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    return proc.stderr.read() if proc.stderr else ""


def _connects(port: int, source: str, host: str = "127.0.0.1", timeout: float = 1.0) -> bool:
    """Whether a plain TCP connection from local address `source` to host:port completes within `timeout` (a dropped
    SYN: it times out)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        sock.bind((source, 0))
        try:
            sock.connect((host, port))
        except OSError:
            return False
        return True


def _reach(pid: int, sources: tuple[str, ...], host: str = "127.0.0.1") -> dict[str, list[int]]:
    """For each source address, the listening ports of process `pid` it can open a connection to. (The connects are
    tried all at once, each with its own timeout: a dropped SYN costs that timeout once, not once per port and source.)"""
    from concurrent.futures import ThreadPoolExecutor
    ports = sorted(_listening_ports(pid))
    assert ports, f"process {pid} listens on no TCP port"
    pairs = [(src, p) for src in sources for p in ports]
    with ThreadPoolExecutor(len(pairs)) as pool:
        reached = dict(zip(pairs, pool.map(lambda pair: _connects(pair[1], pair[0], host), pairs)))
    return {src: [p for p in ports if reached[src, p]] for src in sources}


@pytest.mark.full
@pytest.mark.parametrize("isolation", ["process", "none"])
@pytest.mark.slow_on(isolation="none")  # (the full run: workers isolated as processes, the default)
def test_a_workers_ports_take_no_connection_from_another_address(isolation):
    """Issue 40, 2 (a): a plain TCP connect from 127.0.0.2 to each port a handed-out worker listens on (UCX's tcp
    interface port and its UCP listener) completed, and UCT's tcp handshake (and then a raw PUT frame) could follow.
    Now the SYN is dropped (the connect times out), while from its client's address, 127.0.0.1, each still connects,
    and the client's devices still work afterwards."""
    s = Served(args=("--isolation", isolation))
    holder = None
    try:
        holder = Holder(s.device(0))
        ports = sorted(_listening_ports(holder.pids[0]))
        assert len(ports) >= 2, f"the worker listens on {ports}: expected its UCP listener and UCX's tcp port"
        reach = _reach(holder.pids[0], ("127.0.0.2", "127.0.0.1"))
        assert reach["127.0.0.2"] == [], f"a stranger at 127.0.0.2 opened TCP connections to the worker's ports {reach['127.0.0.2']} (of {ports})"
        assert reach["127.0.0.1"] == ports, f"its client's address reaches only {reach['127.0.0.1']} of {ports}"
        assert holder.works(), holder.close()
    finally:
        err = holder.close() if holder is not None else ""
        log = s.close()
    assert "Traceback" not in log + err, (log + err)[-3000:]


@pytest.mark.full
def test_a_spare_workers_ports_take_no_connection_at_all():
    """Issue 40, 2 (b): a spare worker (started, not handed out yet) has UCX's tcp port from the moment its UCX worker
    exists; anyone on its network could connect there. Now nobody can, from any address; and the client it is then
    handed to gets in and works."""
    s = Served()
    try:
        pid, _ = _idle_worker_socket(s)
        reach = _reach(pid, ("127.0.0.1", "127.0.0.2"))
        assert reach == {"127.0.0.1": [], "127.0.0.2": []}, f"the spare worker {pid} took connections: {reach}"
        r = client(f"""
            import hcq
            dev = hcq.Device("{s.device(0)}")
            b = dev.allocator.alloc(4096); dev.allocator.copyin(b, memoryview(b"x" * 4096))
            out = bytearray(4096); dev.allocator.copyout(memoryview(out), b)
            print("in", dev.connection.info["pid"], out == b"x" * 4096)
        """)
        assert f"in {pid} True" in r.stdout, r.stdout + r.stderr
    finally:
        s.close()


FILTER = """
import socket, sys
from hcq.backends.remote import portfilter
server = socket.create_server(("127.0.0.1", 0))
port = server.getsockname()[1]

def connect(source):
    sock = socket.socket()
    sock.settimeout(1)
    sock.bind((source, 0))
    try:
        sock.connect(("127.0.0.1", port))
    except OSError:
        sock.close()
        return None
    return sock

def connect_each(*sources):  # (at once: each dropped SYN's second runs beside the others')
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(len(sources)) as pool:
        return list(pool.map(connect, sources))

def closed(sock):
    sock.settimeout(2)
    try:
        return sock.recv(1) == b""
    except OSError as e:
        return not isinstance(e, TimeoutError)

early = connect("127.0.0.2")  # in before the filter (accepted, as UCX would)
early_in, _ = server.accept()
friend = connect("127.0.0.1")
friend_in, _ = server.accept()
print("ports", sorted(portfilter.apply(["127.0.0.1"]).values()) == [port])
print("early swept", closed(early))
stranger, friend2 = connect_each("127.0.0.2", "127.0.0.1")
print("stranger", stranger is None)
print("friend", friend2 is not None)
friend.sendall(b"x")
print("friend kept", friend_in.recv(1) == b"x")
portfilter.apply([])
print("nobody", connect_each("127.0.0.1", "127.0.0.2") == [None, None])
portfilter.apply([f"10.{i // 250}.{i % 250}.1" for i in range(portfilter.MAX_ALLOWED - 1)] + ["127.0.0.2"])
print("replaced", connect("127.0.0.2") is not None and connect("127.0.0.1") is None)
for bad in (["localhost"], ["::1"], [f"10.0.{i // 250}.{i % 250}" for i in range(portfilter.MAX_ALLOWED + 1)]):
    try:
        portfilter.apply(bad)
        print("took", bad[:2])
    except ValueError:
        pass
print("done")
"""


@pytest.mark.full
def test_the_filter_passes_only_allowed_sources_and_sweeps_those_that_came_before():
    """The filter itself (portfilter.apply, in a process of its own: it filters every listening socket of the process
    it runs in): only allowed sources connect (none when none is allowed; up to MAX_ALLOWED addresses), attaching again
    replaces the filter, a connection from a stranger that was established before is shut down while an allowed one is
    kept, and names, IPv6 or too many addresses are refused."""
    r = subprocess.run([sys.executable, "-c", FILTER], capture_output=True, text=True, timeout=120, cwd=ROOT)
    want = ["ports True", "early swept True", "stranger True", "friend True", "friend kept True", "nobody True", "replaced True", "done"]
    assert r.stdout.split("\n")[:-1] == want, r.stdout + r.stderr


def test_a_client_announces_each_linked_servers_addresses_to_the_other():
    """Linking server A to server B, the client tells B the addresses of A (as the client names A, resolved here to IPv4:
    A's connection comes from there) and the uid of A's worker (on one host, the connect guard lets only that local user
    in), and A those of B (B's engine connects back to A's as part of the handshake), so each worker lets the other in. (Two servers on two addresses of one host cannot link here at all: UCX reaches no
    worker on 127.0.0.3, or on another interface than the linking worker's, so this is checked at the client's CALLs.)"""
    import threading
    from hcq.backends.remote.device import Connection
    calls: list[tuple[str, str, dict]] = []

    def connection(name: str, host: str, port: int, uid: int) -> Connection:
        c = object.__new__(Connection)
        c.address, c.host, c.worker_address = f"{host}:{port}", host, f"{host}:{port + 1}"
        c.lock, c.links, c.info = threading.Lock(), {}, {"uid": uid}
        c.call = lambda op, **args: calls.append((name, op, args))  # type: ignore[method-assign]
        return c
    a, b = connection("A", "127.0.0.3", 1000, 61200), connection("B", "localhost", 2000, 61300)
    key = a.link_to(b)
    assert calls == [("B", "expect_link", {"key": key, "from_ips": ["127.0.0.3"], "from_uids": [61200]}),
                     ("A", "link", {"peer": "localhost:2001", "key": key, "peer_ips": ["127.0.0.1"], "peer_uids": [61300]})], calls


ANNOUNCE = """
import json, sys, hcq
dev = hcq.Device(sys.argv[1])
print(dev.connection.info["pid"], flush=True)
for line in sys.stdin:
    try:
        dev.connection.call("expect_link", key="k" * 32 + line.strip()[:8], from_ips=json.loads(line))
        print("ok", flush=True)
    except Exception as e:
        print("refused", type(e).__name__, flush=True)
"""


@pytest.mark.full
def test_only_addresses_a_client_announces_for_a_link_are_let_in():
    """A client's link announcement (`expect_link`, as in test_a_client_announces_each_linked_servers_addresses_to_the_other)
    lets the addresses it names open connections to its worker (IPv4 literals only: a name, an IPv6 address or more
    than 16 addresses are refused, and let nothing in); any other address is still dropped."""
    s = Served()
    proc = subprocess.Popen([sys.executable, "-c", ANNOUNCE, s.device(0)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert proc.stdin is not None and proc.stdout is not None
        pid = int(proc.stdout.readline())

        def announce(ips: object) -> str:
            proc.stdin.write(json.dumps(ips) + "\n")  # type: ignore[union-attr]
            proc.stdin.flush()  # type: ignore[union-attr]
            return proc.stdout.readline().strip()  # type: ignore[union-attr]
        for bad in (["localhost"], ["::1"], [f"127.0.1.{i}" for i in range(17)], "127.0.0.9"):
            assert announce(bad).startswith("refused"), bad
        assert _reach(pid, ("127.0.0.9", "127.0.1.1")) == {"127.0.0.9": [], "127.0.1.1": []}
        assert announce(["127.0.0.9"]) == "ok"
        reach = _reach(pid, ("127.0.0.9", "127.0.0.8"))
        assert reach == {"127.0.0.9": sorted(_listening_ports(pid)), "127.0.0.8": []}, reach
    finally:
        proc.kill()
        proc.wait()
        s.close()


ATTACK_FROM = """
import socket, sys
from concurrent.futures import ThreadPoolExecutor
host, ports = sys.argv[1], [int(p) for p in sys.argv[2].split(",")]
def connects(source, port):  # (all tried at once, each with its own timeout)
    with socket.socket() as s:
        s.settimeout(1)
        s.bind((source, 0))
        try:
            s.connect((host, port))
            return True
        except OSError:
            return False
pairs = [(source, port) for source in sys.argv[3:] for port in ports]
with ThreadPoolExecutor(len(pairs)) as pool:
    ok = dict(zip(pairs, pool.map(lambda pair: connects(*pair), pairs)))
for source in sys.argv[3:]:
    print(source, ",".join(str(port) for port in ports if ok[source, port]) or "-", flush=True)
"""


def _listening_in_its_netns(pid: int) -> list[int]:
    """TCP ports process `pid` listens on, read from its own network namespace's table (/proc/PID/net/tcp)."""
    inodes = {os.readlink(f"/proc/{pid}/fd/{fd}")[8:-1] for fd in os.listdir(f"/proc/{pid}/fd")
              if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:[")}
    with open(f"/proc/{pid}/net/tcp") as f:
        return sorted(int(c[1].rsplit(":", 1)[1], 16) for c in (ln.split() for ln in list(f)[1:]) if c[3] == "0A" and c[9] in inodes)


@pytest.mark.full
def test_a_worker_across_a_network_takes_no_connection_from_another_host():
    """Issue 40, 2, between two network namespaces joined by a veth pair (two hosts): the client at 192.0.2.102 holds a
    worker of a server at 192.0.2.101; a stranger on the client's network at 192.0.2.103 (another host) opens no TCP
    connection to any of the worker's ports, while the client's own address still does."""
    from test_remote import Netns, protocol_token
    net = Netns()
    try:
        stranger = "192.0.2.103"
        r = subprocess.run(["ip", "-n", net.cli, "addr", "add", f"{stranger}/24", "dev", net.vc], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        token = {protocol_token(): "across-" + os.urandom(8).hex()}
        server = net.popen(net.srv, [sys.executable, "-m", "hcq", "serve", "--listen", "192.0.2.101:0"], token,
                           stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True)
        line = server.stdout.readline()
        assert "listening on" in line, line
        address = line.split("listening on ")[1].split()[0]
        holder = net.popen(net.cli, [sys.executable, "-c", HOLDER, f"CPU:0@{address}"], {**token, "UCX_TLS": "tcp"},
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        got = holder.stdout.readline()
        assert got.strip(), holder.stderr.read() if holder.poll() is not None else "no pid"
        ports = _listening_in_its_netns(int(got.split()[0]))
        assert len(ports) >= 2, ports
        attack = net.popen(net.cli, [sys.executable, "-c", ATTACK_FROM, "192.0.2.101", ",".join(map(str, ports)), stranger, "192.0.2.102"],
                           {}, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        out, err = attack.communicate(timeout=60)
        reached = dict(ln.split() for ln in out.splitlines())
        assert reached.get(stranger) == "-", (out, err, ports)
        assert reached.get("192.0.2.102") == ",".join(map(str, ports)), (out, err, ports)
        holder.stdin.close()
        holder.wait(30)
        server.terminate()
        server.wait(10)
    finally:
        net.close()
