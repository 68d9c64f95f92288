"""The front door of `hcq serve` (docs/design.md, "Threat model"): the process that listens on the address clients
name, with a plain TCP socket and no network engine, so nothing a stranger sends can reach memory. A client says
hello in one small JSON line (bounded in size and time); with the right version and token it is handed a worker: a
process of its own (`python -m hcq.backends.remote.server --worker`, started ahead so a client does not wait for
it) that serves only that client, behind its own UCX listener and a one-time ticket. The worker ends with its
client; one client's kernels, faults and leaks never share a process with another's.

Wire format, both ways one line of JSON ending in a newline:
  client -> door  {"hcq": VERSION, "token": str | null, "kernel": boot id, "netns": inode}   (at most HELLO_BYTES, within HELLO_S)
  door -> client  {"ok": true, "port": worker's UCX port, "ticket": str, "pid": worker's pid}
                  {"ok": false, "kind": exception name, "error": why}
The client then connects to the worker at the door's host and that port, and presents the ticket in its first CALL."""
from __future__ import annotations

import fcntl
import hmac
import json
import os
import secrets
import selectors
import socket
import struct
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from hcq.backends.remote import protocol
from hcq.backends.remote.sandbox import not_dumpable
from hcq.helpers import getenv

HELLO_BYTES = 4096     # a client's hello line, at most
HELLO_S = 5.0          # ...and the time it has to send it
PENDING_MAX = 64       # hellos being read at once (more connections are closed at once)
WORKER_START_S = 60.0  # how long a client may wait for a worker to start
ASSIGNED_S = 30.0      # how long a worker waits for its client once handed out (then it exits)


@dataclass
class Worker:
    """A worker process: started, ready (its UCX port known), then handed to one client. It listens on `ip`, and UCX's
    transports use only that address's interface: a worker is reachable where its client reaches it, not elsewhere."""
    proc: subprocess.Popen
    ticket: str
    ip: str
    shm: bool = True  # UCX's shared-memory transports on (off for a client in another network namespace: see knock)
    port: int = 0
    assigned: bool = False
    buf: bytes = b""


@dataclass
class Hello:
    """A client connection at the door: reading its hello, then (authorised) waiting for a worker."""
    sock: socket.socket
    peer: str
    ip: str  # the address of ours it came to (its worker listens there)
    deadline: float
    shm: bool = True  # whether its worker may use UCX's shared-memory transports (see _check)
    buf: bytes = b""
    waiting_since: float = 0.0  # authorised, waiting for a ready worker (0: still reading)
    out: bytes = b""


@dataclass
class FrontDoor:
    """Listens on host:port (port 0: any free one) and hands each authorised client a worker serving `devices`."""
    host: str
    port: int
    devices: tuple[str, ...]
    token: str | None
    worker_user: str | None = None
    shared_port: int = 0  # --isolation none: every client goes to the one server listening there (no workers)
    spare: int = field(default_factory=lambda: max(0, getenv("HCQ_SERVE_SPARE", 1)))
    max_workers: int = field(default_factory=lambda: max(1, getenv("HCQ_SERVE_MAX_CLIENTS", 256)))

    def __post_init__(self) -> None:
        not_dumpable()
        infos = socket.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, _, _, _, addr = infos[0]
        self.listener = socket.socket(family, socket.SOCK_STREAM)
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(addr)
        self.listener.listen(128)
        self.listener.setblocking(False)
        self.port = self.listener.getsockname()[1]
        self.sel = selectors.DefaultSelector()
        self.sel.register(self.listener, selectors.EVENT_READ, "listen")
        self.workers: dict[int, Worker] = {}  # by pid
        self.hellos: dict[socket.socket, Hello] = {}
        self.stopping = False
        self.log = sys.stderr
        self.failed_starts, self.next_start = 0, 0.0
        # addresses clients come to, each with spare workers kept started (a wildcard listen learns them from clients)
        self.ips: list[str] = [] if _wildcard(self.host) else [_numeric(self.host)]
        # The address clients use (printed, and in every worker's messages): for a wildcard listen, this host's address
        # on its default route, looked up once (a name like 0.0.0.0 reaches nobody).
        named = routable_host() if _wildcard(self.host) else self.host
        self.address = f"[{named}]:{self.port}" if ":" in named else f"{named}:{self.port}"

    # ---- workers
    def _start_worker(self, ip: str, shm: bool = True) -> None:
        ticket = secrets.token_hex(16)
        config = {"devices": list(self.devices), "host": ip, "token": self.token, "ticket": ticket, "user": self.worker_user,
                  "door": self.address, "assigned_s": ASSIGNED_S, "net_device": interface_of(ip)}
        env = dict(os.environ)
        if not shm and "UCX_TLS" not in env: env["UCX_TLS"] = "^sm"  # (see _check)
        proc = subprocess.Popen([sys.executable, "-m", "hcq.backends.remote.server", "--worker"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, close_fds=True, env=env)
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(json.dumps(config).encode() + b"\n")  # (the token and ticket never appear in argv or the environment)
        proc.stdin.flush()
        os.set_blocking(proc.stdout.fileno(), False)
        w = Worker(proc, ticket, ip, shm)
        self.workers[proc.pid] = w
        self.sel.register(proc.stdout, selectors.EVENT_READ, w)

    def _worker_said(self, w: Worker) -> None:
        assert w.proc.stdout is not None
        try:
            chunk = os.read(w.proc.stdout.fileno(), 4096)
        except BlockingIOError:
            return
        if not chunk:  # it exited (or closed its stdout)
            self.sel.unregister(w.proc.stdout)
            return
        if w.port: return  # (anything after its "ready" line is not ours to keep)
        w.buf = (w.buf + chunk)[-4096:]
        for line in w.buf.split(b"\n")[:-1]:  # (UCX may print a warning to stdout first)
            words = line.decode(errors="replace").split()
            if len(words) == 2 and words[0] == "ready" and words[1].isdigit(): w.port = int(words[1])

    def _reap(self) -> None:
        for pid, w in list(self.workers.items()):
            if w.proc.poll() is None: continue
            del self.workers[pid]
            if not w.port:  # it never got ready: try again later, not in a loop
                self.failed_starts += 1
                self.next_start = time.monotonic() + min(30.0, 0.5 * 2 ** self.failed_starts)
                print(f"hcq serve: a worker could not start (exit code {w.proc.returncode}); trying again in "
                      f"{self.next_start - time.monotonic():.0f} s", file=self.log, flush=True)
            else:
                self.failed_starts = 0
            for f in (w.proc.stdin, w.proc.stdout):
                if f is None: continue
                try:
                    self.sel.unregister(f)
                except (KeyError, ValueError):
                    pass
                f.close()

    def _keep_spares(self) -> None:
        if self.shared_port or time.monotonic() < self.next_start: return
        kinds = {(ip, True) for ip in self.ips} | {(h.ip, h.shm) for h in self.hellos.values() if h.waiting_since}
        for ip, shm in kinds:
            idle = sum(1 for w in self.workers.values() if not w.assigned and (w.ip, w.shm) == (ip, shm))
            waiting = sum(1 for h in self.hellos.values() if h.waiting_since and (h.ip, h.shm) == (ip, shm))
            spare = self.spare if shm else 0  # (workers for clients of other namespaces start on demand)
            while idle < spare + waiting and len(self.workers) < self.max_workers and not self.stopping:
                self._start_worker(ip, shm)
                idle += 1

    def _hand_out(self) -> None:
        """Give ready workers to the clients waiting for one (oldest first)."""
        waiting = sorted((h for h in self.hellos.values() if h.waiting_since and not h.out), key=lambda h: h.waiting_since)
        if self.shared_port:
            for h in waiting: self._answer(h, {"ok": True, "port": self.shared_port, "ticket": None, "pid": os.getpid()})
            return
        ready = [w for w in self.workers.values() if w.port and not w.assigned and w.proc.poll() is None]
        for h in waiting:
            w = next((w for w in ready if (w.ip, w.shm) == (h.ip, h.shm)), None)
            if w is None: continue
            ready.remove(w)
            w.assigned = True
            assert w.proc.stdin is not None
            try:
                w.proc.stdin.write(b"assigned\n")
                w.proc.stdin.flush()
            except OSError:
                continue
            self._answer(h, {"ok": True, "port": w.port, "ticket": w.ticket, "pid": w.proc.pid})
        if self.failed_starts >= 3 and not any(w.port and not w.assigned for w in self.workers.values()):
            for h in waiting:
                self._answer(h, {"ok": False, "kind": "HCQError", "error": f"hcq server {self.address} cannot start worker processes "
                                 f"({self.failed_starts} failed in a row; its log says why)"})
        elif len(self.workers) >= self.max_workers and not ready:
            for h in waiting:
                self._answer(h, {"ok": False, "kind": "HCQError", "error": f"hcq server {self.address} serves {self.max_workers} "
                                 "clients already (HCQ_SERVE_MAX_CLIENTS)"})

    # ---- hellos
    def _accept(self) -> None:
        try:
            sock, peer = self.listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        if len(self.hellos) >= PENDING_MAX:
            sock.close()
            return
        sock.setblocking(False)
        ip = sock.getsockname()[0]
        if ip not in self.ips and len(self.ips) < 16: self.ips.append(ip)  # (spares from now on for this address too)
        self.hellos[sock] = Hello(sock, str(peer), ip, time.monotonic() + HELLO_S)
        self.sel.register(sock, selectors.EVENT_READ, "hello")

    def _read_hello(self, h: Hello) -> None:
        try:
            chunk = h.sock.recv(HELLO_BYTES + 1 - len(h.buf))
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            chunk = b""
        if not chunk:
            self._drop(h)
            return
        h.buf += chunk
        if b"\n" not in h.buf:
            if len(h.buf) > HELLO_BYTES: self._answer(h, _refusal(ValueError("hello line too long")))
            return
        self.sel.modify(h.sock, selectors.EVENT_READ, "waiting")  # (readable again only if the client leaves or talks out of turn)
        try:
            h.shm = self._check(json.loads(h.buf.split(b"\n", 1)[0]))
        except Exception as e:  # noqa: BLE001 - what is wrong goes back to the client
            self._answer(h, _refusal(e))
            return
        h.waiting_since = time.monotonic()
        h.deadline = h.waiting_since + WORKER_START_S

    def _check(self, hello: Any) -> bool:
        """Refuse a hello with another version or a wrong token; returns whether the client's worker may use UCX's
        shared-memory transports. Not for a client on this kernel but in another network namespace (containers, `ip
        netns`): the memory is shared, but the wake-up UCX sends with it goes to an abstract unix socket, which is
        per namespace, so it is lost, and every large message waited for a timer (copyin at 0.002 GB/s)."""
        if not isinstance(hello, dict): raise ValueError("the hello is not a JSON object")
        if hello.get("hcq") != protocol.VERSION:
            raise ValueError(f"protocol version {hello.get('hcq')} does not match the server's {protocol.VERSION}: use the same hcq on both sides")
        if self.token is not None and not hmac.compare_digest(str(hello.get("token") or ""), self.token):
            raise PermissionError(f"wrong or missing token (set {protocol.TOKEN_ENV})")
        mine = where_am_i()
        return not (hello.get("kernel") == mine["kernel"] and hello.get("netns") != mine["netns"])

    def _answer(self, h: Hello, answer: dict[str, Any]) -> None:
        h.out = json.dumps(answer).encode() + b"\n"
        h.deadline = time.monotonic() + HELLO_S
        self.sel.modify(h.sock, selectors.EVENT_WRITE, "answer")
        self._write(h)

    def _write(self, h: Hello) -> None:
        if not h.out: return
        try:
            n = h.sock.send(h.out)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            n = len(h.out)
        h.out = h.out[n:]
        if not h.out: self._drop(h)

    def _drop(self, h: Hello) -> None:
        self.hellos.pop(h.sock, None)
        try:
            self.sel.unregister(h.sock)
        except (KeyError, ValueError):
            pass
        h.sock.close()

    # ---- the loop
    def serve_forever(self) -> None:
        """Until stop(): hellos, workers starting and ending, spares kept ready."""
        while not self.stopping:
            self._keep_spares()
            for key, _ in self.sel.select(timeout=0.2):
                if key.data == "listen": self._accept()
                elif isinstance(key.data, Worker): self._worker_said(key.data)
                elif (h := self.hellos.get(key.fileobj)) is not None:  # type: ignore[call-overload]
                    {"hello": self._read_hello, "answer": self._write, "waiting": self._drop}[key.data](h)
            self._reap()
            self._hand_out()
            now = time.monotonic()
            for h in [h for h in self.hellos.values() if now > h.deadline]:
                if h.waiting_since and not h.out: self._answer(h, _refusal(TimeoutError(f"no worker started within {WORKER_START_S:.0f} s")))
                else: self._drop(h)

    def stop(self) -> None:
        self.stopping = True

    def close(self) -> None:
        """Stop listening; the workers (and so their clients' devices) end."""
        self.stopping = True
        for h in list(self.hellos.values()): self._drop(h)
        self.sel.close()
        self.listener.close()
        for w in self.workers.values():
            if w.proc.poll() is None: w.proc.terminate()
        deadline = time.monotonic() + 5
        for w in self.workers.values():
            try:
                w.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                w.proc.kill()
                w.proc.wait()


def _wildcard(host: str) -> bool:
    return host in ("", "0.0.0.0", "::", "*")


def routable_host() -> str:
    """This host's address on its default route (a UDP socket's source address: nothing is sent), else its name."""
    for family, probe in ((socket.AF_INET, "192.0.2.1"), (socket.AF_INET6, "2001:db8::1")):
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.connect((probe, 9))
                return str(s.getsockname()[0])
        except OSError:
            continue
    return socket.gethostname()


def _numeric(host: str) -> str:
    """The address `host` names (the worker binds to the same one the door did)."""
    return str(socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0])


def interface_of(ip: str) -> str | None:
    """The network interface that holds IPv4 address `ip` (e.g. "lo" for 127.0.0.1), or None (IPv6, or not found:
    the worker's transports then use every interface)."""
    try:
        packed = socket.inet_aton(ip)
    except OSError:
        return None
    if packed[0] == 127: return "lo"
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:  # SIOCGIFADDR: the interface's IPv4 address, at bytes 20..24 of the ifreq
                got = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))[20:24]
            except OSError:
                continue
        if got == packed: return name
    return None


def _refusal(e: BaseException) -> dict[str, Any]:
    return {"ok": False, "kind": type(e).__name__, "error": str(e)}


def where_am_i() -> dict[str, Any]:
    """This process's kernel (its boot id) and network namespace (its inode), as the door compares them."""
    out: dict[str, Any] = {"kernel": None, "netns": None}
    try:
        with open("/proc/sys/kernel/random/boot_id") as f: out["kernel"] = f.read().strip()
        out["netns"] = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        pass
    return out


def knock(host: str, port: int, token: str | None, timeout_s: float) -> dict[str, Any]:
    """A client's hello at the door of host:port: the worker's {"port", "ticket", "pid"}, or the refusal raised."""
    from hcq.errors import HCQError
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            sock.settimeout(WORKER_START_S + 5)
            sock.sendall(json.dumps({"hcq": protocol.VERSION, "token": token, **where_am_i()}).encode() + b"\n")
            buf = b""
            while b"\n" not in buf and len(buf) < 1 << 16:
                chunk = sock.recv(4096)
                if not chunk: break
                buf += chunk
    except OSError as e:
        raise HCQError(f"cannot reach the hcq server at {host}:{port}: {e}") from None
    try:
        answer = json.loads(buf.split(b"\n", 1)[0])
    except ValueError:
        raise HCQError(f"{host}:{port} did not answer as an hcq server does (is it one, of this version?)") from None
    if not answer.get("ok"):
        kinds = {"PermissionError": PermissionError, "ValueError": ValueError, "TimeoutError": HCQError}
        raise kinds.get(str(answer.get("kind")), HCQError)(f"hcq server {host}:{port} refused the connection: {answer.get('error')}")
    return answer
