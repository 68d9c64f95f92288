"""The raw UCT PUT attacker's positive control (docs/design.md, "Threat model": "What remains"). UCX's tcp transport
executes a PUT frame (write these bytes at this address) from any peer that completed UCT's tcp handshake on one of a
worker's listening ports, whatever the worker's own settings. tests/uct_put.c is such a peer, written with nothing but
UCT (no UCP, no hcq): these tests show it does write into a served worker when nothing stands in its way, so that a
test where it fails (another uid, another network namespace) shows a barrier, not a broken attacker."""
from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("libucx", reason="remote devices need hcq[remote] (libucx-cu12)")

from test_remote import ROOT, Served, _listening_ports  # noqa: E402 (pytest puts tests/ on sys.path)
from test_serve_portfilter import close_client  # noqa: E402
from uct_attack import DONE, build_uct_put, uct_put  # noqa: E402

SIZE, OFFSET = 4096, 64
BEFORE = bytes(range(256)) * (SIZE // 256)
PAYLOAD = b"raw UCT PUT was here"  # (20 bytes: not a multiple of anything UCX might round to)

VICTIM = f"""
import sys, hcq
dev = hcq.Device(sys.argv[1])
buf = dev.allocator.alloc({SIZE})
dev.allocator.copyin(buf, memoryview(bytes(range(256)) * {SIZE // 256}))
dev.synchronize()
print(dev.connection.info["pid"], buf.va_addr, flush=True)  # (a CPU device's buffer: a pointer in the worker process)
for line in sys.stdin:
    out = bytearray({SIZE})
    dev.allocator.copyout(memoryview(out), buf)
    print(out.hex(), flush=True)
"""


class Victim:
    """A client holding one buffer of known bytes on a served CPU device; `pid` is its worker's, `addr` the buffer's
    address in that worker."""

    def __init__(self, device: str):
        self.proc = subprocess.Popen([sys.executable, "-c", VICTIM, device], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, cwd=ROOT, start_new_session=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait(30)
            raise AssertionError(f"the client could not open {device}: {self.proc.stderr.read() if self.proc.stderr else ''}")
        pid, addr = line.split()
        self.pid, self.addr = int(pid), int(addr)

    def read(self) -> bytes:
        """The buffer's bytes, as the client reads them back from its worker now."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("read\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline().strip()
        assert line, f"the client died: {self.close()}"
        return bytes.fromhex(line)

    def close(self) -> str:
        return close_client(self.proc)


@pytest.mark.full
@pytest.mark.parametrize("confine", [False, True], ids=["no-confine", "confined"])
@pytest.mark.slow_on(confine=False)  # (the full run: the default, confined workers)
def test_a_raw_uct_put_from_the_clients_address_writes_into_its_worker(confine):
    """The positive control: a client holds a buffer of known bytes on a served CPU device; the attacker, run as the
    test's own user (root here and in CI) on the client's address (127.0.0.1), PUTs other bytes to the buffer's address
    through each port the worker listens on. Exactly one of them is UCX's tcp iface port, where the put lands (the
    other, UCP's listener, speaks another protocol: no UCT handshake completes), and the client reads the attacker's
    bytes back at that spot, the rest unchanged. `--no-confine`: the worker's ports are not even filtered (its
    process lacks CAP_NET_ADMIN to attach the filter). Confined: the port filter passes the client's address, and so
    anyone sending from it: the attacker here is the same user as the server, as trusted as its door (whatever keeps
    other users out must still let this one in, or this control no longer applies there)."""
    build_uct_put()  # (skips here, before any server starts, where it cannot be built)
    s = Served(args=() if confine else ("--no-confine",))
    victim = None
    try:
        victim = Victim(s.device(0))
        assert victim.read() == BEFORE
        ports = sorted(_listening_ports(victim.pid))
        assert len(ports) >= 2, f"the worker listens on {ports}: expected its UCP listener and UCX's tcp port"
        results = _put_each(ports, "127.0.0.1", victim.addr)
        report = "\n".join(f"{port}: rc {r.returncode}: {r.stdout.strip()} {r.stderr.strip()[-500:]}" for port, r in results.items())
        landed = [port for port, r in results.items() if r.returncode == DONE]
        assert len(landed) == 1 and results[landed[0]].stdout.startswith("put done"), report
        after = victim.read()
        want = BEFORE[:OFFSET] + PAYLOAD + BEFORE[OFFSET + len(PAYLOAD):]
        assert after == want, f"the put said it landed ({report}) but the buffer reads {after[:OFFSET + 32].hex()}"
    finally:
        err = victim.close() if victim is not None else ""
        log = s.close()
    assert "Traceback" not in log + err, (log + err)[-3000:]


def _put_each(ports: list[int], host: str, addr: int, **how: object) -> dict[int, subprocess.CompletedProcess]:
    """The attacker's PUT of PAYLOAD at addr + OFFSET through each of `ports` (all at once, each its own process with its
    own 1.5 s: a port that never completes the handshake costs that once, not once per port)."""
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(max(1, len(ports))) as pool:
        done = pool.map(lambda port: uct_put(host, port, addr + OFFSET, PAYLOAD, timeout=1.5, **how), ports)  # type: ignore[arg-type]
        return dict(zip(ports, done))


def _puts(victim_pid: int, host: str, addr: int, **how: object) -> dict[int, subprocess.CompletedProcess]:
    return _put_each(sorted(_listening_ports(victim_pid)), host, addr, **how)


def _report(results: dict[int, subprocess.CompletedProcess]) -> str:
    return "\n".join(f"{port}: rc {r.returncode}: {r.stdout.strip()} {r.stderr.strip()[-300:]}" for port, r in results.items())


@pytest.mark.skipif(__import__("os").geteuid() != 0, reason="a root server's workers are the ones guarded by user")
def test_a_raw_uct_put_from_another_local_user_writes_nothing():
    """Issue 40, 2, as another user of the server's host: a client on 127.0.0.1 (whose address every local user has)
    holds a buffer on a confined server; the attacker as uid 65534 PUTs into it through each of its worker's ports.
    Before the connect guard the put landed (the port filter passes 127.0.0.1); now each connect() is refused (EPERM)
    and the buffer is unchanged, while the same attacker as the server's own user (root) still lands its put through
    the same ports: the barrier is the guard, not a broken attacker."""
    build_uct_put()
    s = Served()
    victim = None
    try:
        if "cannot be kept from other users" in s.stderr(): pytest.skip("this kernel takes no cgroup BPF connect guard")
        victim = Victim(s.device(0))
        other = _puts(victim.pid, "127.0.0.1", victim.addr, user=65534)
        assert not [p for p, r in other.items() if r.returncode == DONE], f"another local user wrote into the worker:\n{_report(other)}"
        assert all("not permitted" in r.stdout for r in other.values()), _report(other)
        assert victim.read() == BEFORE, "the buffer changed"
        own = _puts(victim.pid, "127.0.0.1", victim.addr)
        assert [r.returncode for r in own.values()].count(DONE) == 1, _report(own)
        assert victim.read() == BEFORE[:OFFSET] + PAYLOAD + BEFORE[OFFSET + len(PAYLOAD):]
    finally:
        err = victim.close() if victim is not None else ""
        log = s.close()
    assert "Traceback" not in log + err, (log + err)[-3000:]


@pytest.mark.full
def test_a_raw_uct_put_from_another_network_namespace_writes_nothing():
    """Issue 40, 2, from another host: two network namespaces joined by a veth pair, a server at 192.0.2.101 and its
    client at 192.0.2.102 holding a buffer. The attacker PUTs into the worker from the server's namespace (another
    address than the client's): the port filter drops its SYN, nothing is written. From the client's own namespace
    and address, as root, the put lands (what the token cannot guard: whatever sends from a remote client's address;
    README), and as another user there it is refused (the kernel is the server's too: the connect guard applies)."""
    import os
    from test_remote import Netns, protocol_token
    build_uct_put()
    net = Netns()
    server = victim = None
    try:
        token = {protocol_token(): "uct-" + os.urandom(8).hex()}
        server = net.popen(net.srv, [sys.executable, "-m", "hcq", "serve", "--listen", "192.0.2.101:0"], token,
                           stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True)
        line = server.stdout.readline()
        assert "listening on" in line, line
        device = f"CPU:0@{line.split('listening on ')[1].split()[0]}"
        victim = net.popen(net.cli, [sys.executable, "-c", VICTIM, device], {**token, "UCX_TLS": "tcp"},
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        got = victim.stdout.readline().split()
        assert got, victim.stderr.read() if victim.poll() is not None else "no pid"
        pid, addr = int(got[0]), int(got[1])
        from test_serve_portfilter import _listening_in_its_netns
        ports = _listening_in_its_netns(pid)

        def attack(ns: str, **how: object) -> dict[int, subprocess.CompletedProcess]:
            return _put_each(ports, "192.0.2.101", addr, netns=ns, **how)

        def read() -> bytes:
            victim.stdin.write("read\n")
            victim.stdin.flush()
            return bytes.fromhex(victim.stdout.readline().strip())
        stranger = attack(net.srv)
        assert not [p for p, r in stranger.items() if r.returncode == DONE], _report(stranger)
        assert read() == BEFORE, "a put from another address changed the buffer"
        own = attack(net.cli)
        assert [r.returncode for r in own.values()].count(DONE) == 1, _report(own)
        assert read() == BEFORE[:OFFSET] + PAYLOAD + BEFORE[OFFSET + len(PAYLOAD):]
    finally:
        for proc in (victim, server):
            if proc is None: continue
            if proc is victim and proc.stdin: proc.stdin.close()
            else: proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
        net.close()
