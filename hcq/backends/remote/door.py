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
import pwd
import secrets
import selectors
import signal
import socket
import struct
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from hcq.backends.remote import protocol
from hcq.backends.remote.connectguard import ConnectGuard, local_peer_uid
from hcq.backends.remote.portfilter import ipv4_addresses
from hcq.backends.remote.sandbox import can_confine, not_dumpable, UidPool
from hcq.helpers import getenv

HELLO_BYTES = 4096     # a client's hello line, at most
HELLO_S = 5.0          # ...and the time it has to send it
PENDING_MAX = 64       # connections at the door at once (a newcomer beyond makes room: the oldest still sending its hello goes)
PEER_PENDING_MAX = 8   # connections from one address still sending their hello (a newcomer beyond: its oldest goes)
PEER_UNCONNECTED_MAX = 4  # workers handed to one address that nobody connected to yet (its next knocks wait)
WORKER_START_S = 60.0  # how long a client may wait for a worker to start
RELAY_BYTES = 1 << 20  # of a worker's stderr put into the door's log, at most
ASSIGNED_S = 10.0      # how long a worker waits for its client once handed out (then it exits)


@dataclass
class Worker:
    """A worker process: started (it says "started"), then handed to one client ("assigned ADDR" on its stdin: the client
    comes from ADDR), and only then listening (it says "listening PORT": a spare is reachable by nobody), then connected
    to ("connected"). It listens on `ip`, and UCX's transports use only that address's interface: a worker is reachable
    where its client reaches it, not elsewhere; and its TCP ports take connections only from its client's address (and
    the addresses of servers its client links it with), filtered in the kernel (portfilter). With --isolation none the
    door has it let in each client's address ("allow ADDR"; it says "allowed ADDR") before it gives that client a ticket."""
    proc: subprocess.Popen
    ticket: str
    ip: str
    shm: bool = True  # UCX's shared-memory transports on (off for a client in another network namespace: see knock)
    port: int = 0
    assigned: bool = False
    buf: bytes = b""
    uid_lock: int = -1  # (a confined worker of a root server) the lock that holds its uid for it
    uid: int = -1  # (a root server's confined worker) its uid, whose ports the connect guard watches
    errbuf: bytes = b""  # its stderr, short of a whole line
    relayed: int = 0  # bytes of its stderr put into the door's log
    pid: int = 0  # the worker itself (a confined one forks into its PID namespace, leaving `proc` as its stand-in)
    started: bool = False
    client: Hello | None = None  # (assigned) the hello waiting for its port
    peer_ip: str = ""  # (assigned) the address of the client it was handed to
    connected: bool = False  # its client said hello to it
    allowed: set[str] = field(default_factory=set)  # (--isolation none) clients ("ADDR UID") it lets connect (it said so)
    asked: set[str] = field(default_factory=set)  # (--isolation none) ...and those it was asked to let in
    refused: set[str] = field(default_factory=set)  # (--isolation none) ...and those it cannot (its filter is full)


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
    peer_ip: str = ""  # the client's address
    uid: int | None = None  # the client's uid, when it is a local user (its end of the connection is on this host)
    worker: Worker | None = None  # the worker handed to it, until it says its port

    @property
    def who(self) -> str:
        """"ADDR UID" ("-": not a local user), as the door tells a worker whom to let in."""
        return f"{self.peer_ip} {'-' if self.uid is None else self.uid}"


@dataclass
class FrontDoor:
    """Listens on host:port (port 0: any free one) and hands each authorised client a worker serving `devices`."""
    host: str
    port: int
    devices: tuple[str, ...]
    token: str | None
    worker_user: str | None = None
    confinement: bool = True  # False (--no-confine): workers keep the server's user (trusted single-user setups)
    shared: bool = False  # --isolation none: one worker serves every client (trusted, single-user setups only)
    spare: int = field(default_factory=lambda: getenv("HCQ_SERVE_SPARE", 1, lo=0))
    max_workers: int = field(default_factory=lambda: getenv("HCQ_SERVE_MAX_CLIENTS", 256, lo=1))

    def __post_init__(self) -> None:
        not_dumpable()
        self.confine = self.confinement and can_confine()
        self.uids = UidPool() if self.confine and os.geteuid() == 0 and not self.worker_user else None
        self.guard: ConnectGuard | None = None  # (a root server's) which local users may connect to workers' ports
        if self.confine and os.geteuid() == 0:
            try:
                self.guard = ConnectGuard()
            except OSError as e:
                print(f"hcq serve: WARNING: workers' ports cannot be kept from other users of this host ({e}): a local user can "
                      "open TCP connections to the worker of a client on this host (see the threat model)", file=sys.stderr, flush=True)
        if self.confinement and not self.confine:
            print(f"hcq serve: WARNING: workers cannot be confined here ({'namespaces are refused' if os.geteuid() == 0 else 'no unprivileged user namespaces'}): "
                  f"clients' kernels run with all the rights of user {pwd.getpwuid(os.geteuid()).pw_name}", file=sys.stderr, flush=True)
        ipv4_addresses(self.host)  # (ValueError for IPv6)
        infos = socket.getaddrinfo(self.host, self.port, family=socket.AF_INET, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
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
        self.warned_unfiltered = False  # (a worker said its ports could not be filtered by address: said once)
        # addresses clients come to, each with spare workers kept started (a wildcard listen learns them from clients)
        self.ips: list[str] = [] if _wildcard(self.host) else [_numeric(self.host)]
        # The address clients use (printed, and in every worker's messages): for a wildcard listen, this host's address
        # on its default route, looked up once (a name like 0.0.0.0 reaches nobody).
        named = routable_host() if _wildcard(self.host) else self.host
        self.address = f"[{named}]:{self.port}" if ":" in named else f"{named}:{self.port}"

    # ---- workers
    def _start_worker(self, ip: str, shm: bool = True) -> None:
        ticket = secrets.token_hex(16)
        config = {"devices": list(self.devices), "host": ip, "ticket": None if self.shared else ticket, "user": self.worker_user,
                  "door": self.address, "assigned_s": ASSIGNED_S, "net_device": interface_of(ip), "confine": self.confine}
        uid, uid_lock = (None, -1)
        if self.uids is not None:
            uid, uid_lock = self.uids.take()
            config["uid"] = uid
        elif self.worker_user and os.geteuid() == 0:
            try:
                uid = pwd.getpwnam(self.worker_user).pw_uid
            except KeyError:
                pass  # (the worker says there is no such user, and ends)
        keep: tuple[int, ...] = ()
        if self.guard is not None and uid is not None:
            self.guard.add_worker(uid)  # (before it binds a port)
            config["guard_fd"] = self.guard.allowed
            keep = (self.guard.allowed,)
        env = worker_environment()
        if not shm and "UCX_TLS" not in env: env["UCX_TLS"] = "^sm"  # (see _check)
        try:  # (a session of its own: no controlling terminal, no process group shared with the door or other workers)
            proc = subprocess.Popen([sys.executable, "-m", "hcq.backends.remote.server", "--worker"], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, close_fds=True, pass_fds=keep, env=env, start_new_session=True)
        except BaseException:
            if uid_lock >= 0: os.close(uid_lock)
            raise
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(json.dumps(config).encode() + b"\n")  # (the ticket never appears in argv or the environment)
        proc.stdin.flush()
        os.set_blocking(proc.stdout.fileno(), False)
        assert proc.stderr is not None
        os.set_blocking(proc.stderr.fileno(), False)
        w = Worker(proc, ticket, ip, shm, uid_lock=uid_lock, uid=uid if keep and uid is not None else -1)
        self.workers[proc.pid] = w
        self.sel.register(proc.stdout, selectors.EVENT_READ, w)
        self.sel.register(proc.stderr, selectors.EVENT_READ, (w, "stderr"))

    def _worker_said(self, w: Worker) -> None:
        assert w.proc.stdout is not None
        try:
            chunk = os.read(w.proc.stdout.fileno(), 4096)
        except BlockingIOError:
            return
        if not chunk:  # it exited (or closed its stdout)
            self.sel.unregister(w.proc.stdout)
            return
        if w.connected and not self.shared: return  # (anything after its "connected" line is not ours to keep)
        w.buf = (w.buf + chunk)[-4096:]
        for line in w.buf.split(b"\n")[:-1]:  # (UCX may print a warning to stdout first)
            words = line.decode(errors="replace").split()
            if len(words) == 2 and words[0] == "pid" and words[1].isdigit() and not w.pid: w.pid = int(words[1])
            if words == ["started"]: w.started = True
            if len(words) == 2 and words[0] == "listening" and words[1].isdigit() and w.assigned and not w.port: w.port = int(words[1])
            if words == ["connected"] and w.port: w.connected = True
            if len(words) == 3 and words[0] in ("allowed", "refused") and (who := " ".join(words[1:])) in w.asked:
                (w.allowed if words[0] == "allowed" else w.refused).add(who)
            if words[:1] == ["unfiltered"] and not self.warned_unfiltered:
                self.warned_unfiltered = True
                print(f"hcq serve: WARNING: workers' TCP ports cannot be limited to their clients' addresses here ({' '.join(words[1:])[:300]}): "
                      "current kernels let only CAP_NET_ADMIN filter a TCP socket, which a worker has at hand only when confined by a "
                      "root server (its stand-in does it); any host that reaches a worker's network can connect to its ports (see the "
                      "threat model)", file=self.log, flush=True)
        if w.port and (h := w.client) is not None:  # its client learns the port now
            w.client = h.worker = None
            if self.hellos.get(h.sock) is h and not h.out: self._answer(h, {"ok": True, "port": w.port, "ticket": w.ticket, "pid": w.pid or w.proc.pid})

    def _relay(self, w: Worker) -> None:
        """A worker's stderr, into the door's log: whole lines, control characters replaced (a client's code writes
        there: it must not drive the admin's terminal), at most RELAY_BYTES a worker."""
        if w.proc.stderr is None or w.proc.stderr.closed: return
        try:
            chunk = os.read(w.proc.stderr.fileno(), 65536)
        except (BlockingIOError, OSError):
            return
        if not chunk:
            try:
                self.sel.unregister(w.proc.stderr)
            except (KeyError, ValueError):
                pass
            return
        if w.relayed >= RELAY_BYTES: return
        w.errbuf += chunk
        *lines, w.errbuf = w.errbuf.split(b"\n")
        if len(w.errbuf) > 4096: lines, w.errbuf = [*lines, w.errbuf[:4096]], b""
        for line in lines:
            text = "".join(c if c.isprintable() or c == "\t" else "?" for c in line.decode(errors="replace"))
            w.relayed += len(text) + 1
            print(text if w.relayed < RELAY_BYTES else f"hcq serve: worker {w.pid or w.proc.pid} said more than {RELAY_BYTES} bytes; "
                  "the rest is dropped", file=self.log, flush=True)
            if w.relayed >= RELAY_BYTES: break

    def _reap(self) -> None:
        for pid, w in list(self.workers.items()):
            if w.proc.poll() is None: continue
            del self.workers[pid]
            if self.guard is not None and w.uid >= 0 and not any(o.uid == w.uid for o in self.workers.values()):
                self.guard.remove_worker(w.uid)  # (its ports, and what it let in, go before its uid is free again)
            if w.uid_lock >= 0: os.close(w.uid_lock)  # (its uid is free again: everything that ran as it is gone)
            if w.client is not None: w.client.worker = None  # (its client waits for another)
            if not w.started or (w.assigned and not w.port):  # it never got ready: try again later, not in a loop
                self.failed_starts += 1
                self.next_start = time.monotonic() + min(30.0, 0.5 * 2 ** self.failed_starts)
                print(f"hcq serve: a worker could not start (exit code {w.proc.returncode}); trying again in "
                      f"{self.next_start - time.monotonic():.0f} s", file=self.log, flush=True)
            else:
                self.failed_starts = 0
            self._relay(w)  # (what it said last)
            for f in (w.proc.stdin, w.proc.stdout, w.proc.stderr):
                if f is None: continue
                try:
                    self.sel.unregister(f)
                except (KeyError, ValueError):
                    pass
                f.close()

    def _keep_spares(self) -> None:
        if time.monotonic() < self.next_start or self.stopping: return
        if self.shared:  # (the one worker, started again if it ends)
            if not self.workers: self._start_worker(self.host if _wildcard(self.host) else _numeric(self.host))
            return
        held = self._unconnected()
        wanting = [h for h in self.hellos.values() if h.waiting_since and not h.out and h.worker is None and held.get(h.peer_ip, 0) < PEER_UNCONNECTED_MAX]
        kinds = {(ip, True) for ip in self.ips} | {(h.ip, h.shm) for h in wanting}
        for ip, shm in kinds:
            idle = sum(1 for w in self.workers.values() if not w.assigned and (w.ip, w.shm) == (ip, shm))
            waiting = sum(1 for h in wanting if (h.ip, h.shm) == (ip, shm))
            spare = self.spare if shm else 0  # (workers for clients of other namespaces start on demand)
            while idle < spare + waiting and len(self.workers) < self.max_workers and not self.stopping:
                self._start_worker(ip, shm)
                idle += 1

    def _hand_out_shared(self, waiting: list[Hello]) -> None:
        """--isolation none: every client goes to the one worker, with a one-time ticket the door gives it first."""
        w = next((w for w in self.workers.values() if w.started and w.proc.poll() is None), None)
        if w is None:
            if self.failed_starts >= 3: self._refuse_all(waiting)
            return
        assert w.proc.stdin is not None
        try:
            if not w.assigned: w.proc.stdin.write(b"assigned\n")  # (it listens from now on)
            w.assigned = True
            for h in waiting if w.port else []:
                # Its address first: the worker's ports drop a SYN from an address it does not let in yet (the client's
                # connect would wait for the kernel to send it again, a second later).
                if h.who in w.refused:
                    self._answer(h, {"ok": False, "kind": "HCQError", "error": f"hcq server {self.address} lets no more client addresses in"})
                    continue
                if h.who not in w.allowed:
                    if h.who not in w.asked: w.proc.stdin.write(f"allow {h.who}\n".encode())
                    w.asked.add(h.who)
                    continue
                ticket = secrets.token_hex(16)
                w.proc.stdin.write(f"ticket {ticket}\n".encode())  # (before the client can present it: it goes the worker's way after this)
                w.proc.stdin.flush()
                self._answer(h, {"ok": True, "port": w.port, "ticket": ticket, "pid": w.pid or w.proc.pid})
            w.proc.stdin.flush()
        except OSError:
            pass  # (it ended: reaped, then started again)

    def _refuse_all(self, waiting: list[Hello]) -> None:
        """Workers cannot be started (several failed in a row): the clients waiting hear so instead of waiting a minute."""
        for h in waiting:
            self._answer(h, {"ok": False, "kind": "HCQError", "error": f"hcq server {self.address} cannot start worker processes "
                             f"({self.failed_starts} failed in a row; its log says why)"})

    def _unconnected(self) -> dict[str, int]:
        """Client address -> how many workers handed to it nobody connected to yet (live ones)."""
        out: dict[str, int] = {}
        for w in self.workers.values():
            if w.assigned and not w.connected and w.proc.poll() is None: out[w.peer_ip] = out.get(w.peer_ip, 0) + 1
        return out

    def _hand_out(self) -> None:
        """Give started workers to the clients waiting for one (oldest first; an address that holds
        PEER_UNCONNECTED_MAX workers nobody connected to waits). A worker starts listening once handed out: its client
        is answered when it says its port (_worker_said)."""
        waiting = sorted((h for h in self.hellos.values() if h.waiting_since and not h.out and h.worker is None), key=lambda h: h.waiting_since)
        if self.shared:
            self._hand_out_shared(waiting)
            return
        ready = [w for w in self.workers.values() if w.started and not w.assigned and w.proc.poll() is None]
        held = self._unconnected()
        for h in waiting:
            if held.get(h.peer_ip, 0) >= PEER_UNCONNECTED_MAX: continue
            w = next((w for w in ready if (w.ip, w.shm) == (h.ip, h.shm)), None)
            if w is None: continue
            ready.remove(w)
            w.assigned, w.peer_ip = True, h.peer_ip
            held[h.peer_ip] = held.get(h.peer_ip, 0) + 1
            assert w.proc.stdin is not None
            try:
                w.proc.stdin.write(f"assigned {h.who}\n".encode())  # (its ports let that address (and local user) in, and no other)
                w.proc.stdin.flush()
            except OSError:
                continue
            w.client, h.worker = h, w
        waiting = [h for h in waiting if h.worker is None]
        if self.failed_starts >= 3 and not any(w.started and not w.assigned for w in self.workers.values()): self._refuse_all(waiting)
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
        sock.setblocking(False)
        peer_ip = str(peer[0])
        # Room for it: a newcomer beyond the bounds pushes out the oldest connection still sending its hello (from its
        # own address when that address has its share), so idle connections cannot keep clients out.
        reading = [h for h in self.hellos.values() if not h.waiting_since and not h.out]
        if len(mine := [h for h in reading if h.peer_ip == peer_ip]) >= PEER_PENDING_MAX: self._drop(min(mine, key=lambda h: h.deadline))
        elif len(self.hellos) >= PENDING_MAX:
            if not reading:  # (all of them authorised, waiting for workers)
                try:  # (one small line, if the socket takes it at once)
                    sock.send(json.dumps({"ok": False, "kind": "HCQError", "error": f"too many clients at the hcq server {self.address} "
                                          "at once; try again"}).encode() + b"\n")
                except OSError:
                    pass
                sock.close()
                return
            self._drop(min(reading, key=lambda h: h.deadline))
        self.hellos[sock] = Hello(sock, str(peer), sock.getsockname()[0], time.monotonic() + HELLO_S, peer_ip=peer_ip)
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
        h.uid = local_peer_uid(h.sock)  # (a local user: only that user's connections reach its worker)
        if h.ip not in self.ips and len(self.ips) < 16: self.ips.append(h.ip)  # (spares from now on for this address too: a client came)
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
                elif isinstance(key.data, tuple): self._relay(key.data[0])
                elif (h := self.hellos.get(key.fileobj)) is not None:  # type: ignore[call-overload]
                    {"hello": self._read_hello, "answer": self._write, "waiting": self._drop}[key.data](h)
            self._reap()
            self._hand_out()
            now = time.monotonic()
            late = [h for h in self.hellos.values() if now > h.deadline]
            held = self._unconnected() if late else {}
            for h in late:
                if h.waiting_since and not h.out and held.get(h.peer_ip, 0) >= PEER_UNCONNECTED_MAX:
                    self._answer(h, _refusal(TimeoutError(f"{h.peer_ip} holds {PEER_UNCONNECTED_MAX} workers of this server that nobody "
                                                          f"connected to (at most that many per address): connect to them, or wait {ASSIGNED_S:.0f} s for them to go")))
                elif h.waiting_since and not h.out: self._answer(h, _refusal(TimeoutError(f"no worker started within {WORKER_START_S:.0f} s")))
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
            except subprocess.TimeoutExpired:  # (a client's code may ignore SIGTERM: the worker itself goes too)
                if w.pid:
                    try:
                        os.kill(w.pid, signal.SIGKILL)
                    except OSError:
                        pass
                w.proc.kill()
                w.proc.wait()
        if self.guard is not None: self.guard.close()


# What a worker inherits of the door's environment: nothing else (credentials, session buses, the token...).
WORKER_ENV = ("PATH", "HOME", "XDG_CACHE_HOME", "TMPDIR", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "CC", "CFLAGS", "LD_LIBRARY_PATH",
              "OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE",
              "VK_ICD_FILENAMES", "VK_DRIVER_FILES", "VK_LOADER_DEBUG", "LP_NUM_THREADS")  # (which Vulkan driver a served VK device is)
WORKER_ENV_PREFIXES = ("HCQ_", "UCX_", "MESA_")


def worker_environment() -> dict[str, str]:
    """The environment a worker starts with: WORKER_ENV and HCQ_*/UCX_* settings of the door's, never the token."""
    return {k: v for k, v in os.environ.items() if (k in WORKER_ENV or k.startswith(WORKER_ENV_PREFIXES)) and k != protocol.TOKEN_ENV}


def _wildcard(host: str) -> bool:
    return host in ("", "0.0.0.0", "*")


def routable_host() -> str:
    """This host's IPv4 address on its default route (a UDP socket's source address: nothing is sent), else its name."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))
            return str(s.getsockname()[0])
    except OSError:
        return socket.gethostname()


def _numeric(host: str) -> str:
    """The IPv4 address `host` names (the worker binds to the same one the door did)."""
    return ipv4_addresses(host)[0]


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
