"""`hcq serve`: hosts devices for remote clients (docs/design.md, "Remote devices" and "Threat model"), of one backend that
names a DEVICE_HOST (hcq.interfaces.DeviceHost: hcq/backends/cpu/hosting.py, hcq/backends/vk/hosting.py), opened through
the registry: this module imports no backend.

`hcq serve` itself is a front door (`door.py`: a plain TCP socket, no network engine) that hands each client that
authenticates a worker process of its own; a worker is this module's `Server`, serving one client (and the links
other servers' workers make to it for that client) and ending with it. `--isolation none` runs one worker `Server` for
every client instead (trusted, single-user setups only); either way no client's code runs in the door.

A Server is the hardware of its clients' devices: memory, a command processor and a kernel loader, all the host's
(for the CPU: guard-paged mappings, cp.c and its loader), and nothing of the core. Each client connection gets its own instance
of every device it opens (its own queue threads, memory and failure state). Hot messages (SUBMIT, STORE) and the
store hook that mirrors device stores into client memory run in C (serve.c); this Python thread answers CALLs (open,
alloc, free, load, rings, states, failures) and cleans up after clients that close or die. Connections are strangers
to the network engine until their hello (small, few messages, no C handler, closed after 5 s)."""
from __future__ import annotations

import ctypes
import hmac
import ipaddress
import json
import os
import pwd
import secrets
import signal
import socket
import struct
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from hcq.backends.remote import protocol
from hcq.backends.remote.net import NetEngine, net_lib
from hcq.backends.remote.portfilter import ipv4_addresses, PortFilter
from hcq.backends.remote.sandbox import host_pid
from hcq.errors import CompileError, HCQError
from hcq.helpers import env_flag
from hcq.hostmap import check_sealed_memfd, libc as _libc, MAP_FAILED, PROT_RW
from hcq.interfaces import COMPUTE, COPY, DeviceHost, HostedMemory
from hcq.packets import Op, decode_header
from hcq.registry import device_host, device_host_class, unavailable_reason

SHARE_MIN = 1 << 20  # device allocations from this size up are memfd-backed: a server on the same host can map them
MAX_GIVEN, GIVEN_S = 256, 20.0  # memfds given over the unix socket that may wait for the CALL that maps them, and how long
MAX_TICKETS = 1024  # (--isolation none) tickets the door gave that no client used yet
MAX_EXPECTED_LINKS = 64  # link keys one client may have announced that no link used yet
MAX_LINK_ADDRESSES = 16  # addresses one link CALL may name for the server at its other end
INSTANT = (Op.SIGNAL, Op.TIMESTAMP, Op.WRITE, Op.BARRIER)  # packets that never wait


class _Attachment:
    """Another server's shared device memory (or a client's status page), mapped here (released when the client that
    asked detaches or leaves)."""

    def __init__(self, fd: int, size: int):
        self.size = size
        addr = _libc.mmap(None, size, PROT_RW, 0x01, fd, 0)  # MAP_SHARED
        if addr in (None, MAP_FAILED): raise MemoryError(f"cannot map {size} bytes of another server's memory ({os.strerror(ctypes.get_errno())})")
        self.addr = int(addr)

    def close(self) -> None:
        if self.addr: _libc.munmap(self.addr, self.size)
        self.addr = 0


@dataclass
class ServedDevice:
    """One client's instance of a served device."""
    name: str
    executor: Any  # the host's (DeviceHost.open_device)
    copy_engines: int
    rings: list[Any] = field(default_factory=list)
    ring_ids: list[int] = field(default_factory=list)  # each ring's id for SUBMIT messages (hs_ring_add)
    ring_keys: set[tuple[str, int]] = field(default_factory=set)  # (kind, index) of the rings open


@dataclass
class Client:
    conn: int
    authed: bool = False
    devices: dict[str, ServedDevice] = field(default_factory=dict)
    mappings: dict[int, tuple[HostedMemory, bool]] = field(default_factory=dict)  # address -> (mapping, mirrored)
    programs: list[Any] = field(default_factory=list)  # loaded libraries, kept while the client lives
    attachments: dict[int, _Attachment] = field(default_factory=dict)  # address here -> another server's memory mapped
    registered: set[int] = field(default_factory=set)  # addresses of its memory registered for other servers' puts
    rkeys: dict[tuple[int, int], int] = field(default_factory=dict)  # (window, destination) -> remote key of the destination
    # "host:port" of another server -> (this server's connection to it, the key of that link: another key is a new server there)
    links: dict[str, tuple[int, str]] = field(default_factory=dict)
    link_key: str | None = None  # set when this connection is another server's link, made for one of its clients
    link_from: str = ""  # (a link's) the address of the server at its other end
    link_owner: int = -1  # (a link's) the connection of the client here that announced it
    failed_id: int = -1  # the poison id naming its side when a device there failed (made at first use)
    status_page: _Attachment | None = None  # (a client on this host) its status page, mapped here: its memory is shared
    status_page_client: int = 0  # the page's address in the client
    replicas: list[tuple[int, int]] = field(default_factory=list)  # (a link's) replica slots it feeds, with their owner's connection


class Server:
    """Serves `devices` (names like "CPU:0") on `host:port` (port 0: any free one)."""

    def __init__(self, host: str = protocol.DEFAULT_HOST, port: int = 0, devices: tuple[str, ...] = ("CPU:0", "CPU:1"),
                 token: str | None = None, ticket: str | None = None, door: str | None = None, listen: bool = True,
                 shared: bool = False, port_filter: PortFilter | None = None):
        """`ticket`: a worker's, for its one client (whose hello must carry it); `door`: the address clients name;
        `listen` False: nobody can connect until `listen()` (a spare worker, until the door hands it to a client);
        `shared`: the one worker of `--isolation none`, whose clients present tickets the door gave it (`add_ticket`);
        `port_filter` (a worker's): who may open a TCP connection to this process, applied as soon as the network engine
        (and so UCX's tcp ports) exists; links add the addresses of the servers at their other end."""
        self.listen_ip, self._listen_port = check_listen_address(host, token, door_checked=ticket is not None or shared), port
        self.tickets: dict[str, None] | None = {} if shared else None  # (shared) one-time tickets, oldest first
        self.devices = self.check_devices(devices)
        self.device_host: DeviceHost = device_host(self.devices[0].partition(":")[0])
        self.token, self.ticket = token, ticket
        self.instance = secrets.token_hex(8)  # (this server process, among all that ever listen at its address: links are keyed by it)
        self.client_conn: int | None = None  # (a worker's) its client's connection, once it said hello
        self.client_deadline: float | None = None  # (a worker's) when to give up waiting for it
        self.on_client: Callable[[], None] | None = None  # (a worker's) called once, when its client said hello
        global hosting
        # One-sided operations (puts into memory other servers registered) only where they are asked for: over TCP, UCX
        # lets any peer that reaches the port write anywhere in a process that has them (see the threat model).
        self.net = NetEngine(listen=self.listen_ip if listen else None, port=port, rma=env_flag("HCQ_REMOTE_PUT", False))
        self.port_filter = port_filter
        if port_filter is not None: port_filter.apply()  # (UCX's tcp ports listen from now on: for nobody yet, in a spare)
        self.net.limit_strangers()
        hosting += 1
        self.host, self.port = host, self.net.port
        self.door = door or f"{host}:{self.port}"
        self.lib = net_lib()
        submit, store, rptr = self.device_host.native_functions()  # (its store is quiet: serve.c pushes a STORE to replicas itself)
        self.hs = self.lib.hs_create(self.net.handle, submit, store, rptr)
        if not self.hs: raise MemoryError("hcq serve: cannot create the server state")
        self.net.set_handler(protocol.SUBMIT, ctypes.cast(self.lib.hs_on_submit, ctypes.c_void_p).value, self.hs)
        self.net.set_handler(protocol.STORE, ctypes.cast(self.lib.hs_on_store, ctypes.c_void_p).value, self.hs)
        self.net.set_handler(protocol.PUSH, ctypes.cast(self.lib.hs_on_push, ctypes.c_void_p).value, self.hs)  # into accepted ranges
        self.net.set_placer(ctypes.cast(self.lib.hs_place_ok, ctypes.c_void_p).value, self.hs)  # bulk copyin, into device memory
        self.lib.hs_set_poison(self.hs, self.device_host.stores.poison())
        self.lib.hn_set_waker(self.device_host.stores.waker())  # (pushes into replicas wake only sleepers)
        self.device_host.stores.set_hook(ctypes.cast(self.lib.hs_store_hook, ctypes.c_void_p).value, self.hs)
        if env_flag("HCQ_REMOTE_LEND", True): self.device_host.set_idle_hook(ctypes.cast(self.lib.hs_idle_hook, ctypes.c_void_p).value, self.hs)
        self.clients: dict[int, Client] = {}
        self.link_keys: dict[str, int] = {}  # key a client gave two servers -> the link connection it names here
        self.expected_links: dict[str, int] = {}  # key a client announced -> its connection (until the link comes)
        self._links_lock = threading.Lock()
        # Shared device memory for servers on this host: a ticket (from a "share" CALL) buys the memfd of an allocation
        # over this abstract unix socket, once.
        self.share = env_flag("HCQ_REMOTE_SHARE", True)
        self.share_runtime = self.share and not self.device_host.stores_before_hook  # (clients' runtime memory: see DeviceHost)
        self._tickets: dict[str, tuple[int, float]] = {}  # ticket -> (a dup of the memfd, when it expires)
        # ...and clients on this host give the memfds of their runtime memory the same way (see _give_memory)
        self._given: dict[str, tuple[int, float]] = {}
        self.share_socket = f"hcq-serve-{self.port}-{host_pid()}-{secrets.token_hex(8)}"
        self._share_listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._share_listener.bind("\0" + self.share_socket)
        self._share_listener.listen(16)
        self._share_listener.settimeout(0.2)
        self.workers, self.copy_engines = self.device_host.queue_settings()
        self.descriptions: dict[str, dict[str, Any]] = {}  # device name -> what a client that opens it is told (made at its first open)
        self._stop = threading.Event()
        threading.Thread(target=self._serve_shares, name="hcq-serve-shares", daemon=True).start()
        self.calls: dict[str, Callable[[Client, dict[str, Any]], Any]] = {
            "hello": self._hello, "open": self._open, "alloc": self._alloc, "free": self._free, "load": self._load,
            "open_ring": self._open_ring, "ring_state": self._ring_state, "error": self._error, "recover": self._recover,
            "cas": self._cas, "status_mirror": self._status_mirror, "link": self._link, "accept": self._accept,
            "forward": self._forward, "unforward": self._unforward, "share": self._share, "attach": self._attach,
            "detach": self._detach, "status_page": self._status_page, "stats": self._stats, "read": self._read, "expect_link": self._expect_link,
            "close": self._close_device}

    @staticmethod
    def check_devices(devices: tuple[str, ...]) -> tuple[str, ...]:
        """The device names, normalised (KIND:n), all of one kind whose backend can be served (it names a DEVICE_HOST:
        `hcq.registry.device_host`); ValueError naming what is wrong otherwise."""
        if not devices: raise ValueError("hcq serve needs at least one device to serve (e.g. --devices CPU:0,CPU:1)")
        names = []
        for name in devices:
            kind, _, index = name.strip().partition(":")
            if not kind.isidentifier() or not index.isdigit(): raise ValueError(f"hcq serve: bad device name {name!r}; expected KIND:INDEX, e.g. CPU:0")
            names.append(f"{kind.upper()}:{int(index)}")
        kinds = sorted({n.partition(":")[0] for n in names})
        if len(kinds) > 1: raise ValueError(f"one hcq serve hosts devices of one backend, not of {', '.join(kinds)}: start one server per backend")
        device_host_class(kinds[0])  # (refused here, naming what the backend lacks, rather than when the first client comes)
        if (why := unavailable_reason(kinds[0])) is not None: raise ValueError(f"hcq serve cannot host {kinds[0]} devices here: {why}")
        return tuple(names)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def listen(self) -> int:
        """Start accepting connections (a Server made with listen=False); returns the port."""
        self.port = self.net.start_listening(self.listen_ip, self._listen_port)
        return self.port

    # ---- the loop
    def serve_forever(self) -> None:
        """Answer CALLs until `stop()` (or SIGTERM / Ctrl-C in `main`)."""
        while not self._stop.is_set():
            event = self.net.next(200)
            self.net.expire_strangers()
            if self.client_deadline is not None and self.client_conn is None and time.monotonic() > self.client_deadline:
                print(f"hcq serve worker {host_pid()}: no client came; leaving", file=sys.stderr, flush=True)
                self.stop()
            if event is None: continue
            if len(event) == 2:  # ("closed", conn)
                self._drop_client(int(event[1]))
                continue
            conn, req_id, msg = event
            client = self.clients.setdefault(conn, Client(conn))
            answer = self._answer(client, msg, req_id)
            if self.client_conn is not None and self.on_client is not None:
                self.on_client()
                self.on_client = None
            if answer is None: continue
            try:
                self.net.reply(conn, req_id, answer)
            except HCQError:  # the connection is gone (a stranger closed past its limits, a client that died): its loss only
                if not client.authed: self.clients.pop(conn, None)  # (its "closed" may have come already)

    def stop(self) -> None:
        self._stop.set()

    def close(self) -> None:
        """Release every client's devices, then the network engine."""
        for conn in list(self.clients): self._drop_client(conn)
        global hosting
        self._share_listener.close()
        self.device_host.stores.set_hook(None, None)
        self.device_host.set_idle_hook(None, None)  # (waits until no queue thread is inside the engine through it)
        hosting -= 1
        self.net.close()
        self.lib.hs_destroy(self.hs)

    def _answer(self, client: Client, msg: bytes, req_id: int = 0) -> bytes | ctypes.Array | None:
        """The answer to a CALL; None when a thread answers it later (a link: connecting may wait on the other server,
        which may be linking to this one at the same time)."""
        try:
            req = protocol.parse_call(msg)
            op = req["op"]
            if op != "hello" and not client.authed: raise PermissionError("say hello first (with the server's token, if it has one)")
            if op == "hello" and client.authed: raise PermissionError("this connection said hello already")
            if client.link_key is not None: raise PermissionError(f"a link between servers only pushes and places into what its client accepted, not {op!r}")
            if op not in self.calls: raise ValueError(f"unknown call {op!r}")
            if op == "link":
                threading.Thread(target=self._answer_later, args=(client, req, req_id), name="hcq-serve-link", daemon=True).start()
                return None
            if op == "read": return self._read(client, req)
            return _result(self.calls[op](client, req))
        except Exception as e:  # noqa: BLE001 - every failure goes back to the client, named
            return _failure(e)

    def _answer_later(self, client: Client, req: dict[str, Any], req_id: int) -> None:
        try:
            answer = _result(self.calls[req["op"]](client, req))
        except Exception as e:  # noqa: BLE001 - named to the client
            answer = _failure(e)
        try:
            self.net.reply(client.conn, req_id, answer)
        except HCQError:
            pass  # the client is gone

    # ---- calls
    def _hello(self, client: Client, req: dict[str, Any]) -> dict[str, Any]:
        if req.get("version") != protocol.VERSION:
            raise ValueError(f"protocol version {req.get('version')} does not match the server's {protocol.VERSION}: use the same hcq on both sides")
        if req.get("link_key") is not None:  # another server, linking itself to this one for a client of this one
            key = str(req["link_key"])
            with self._links_lock:
                owner = next((c for k, c in self.expected_links.items() if hmac.compare_digest(k, key)), None)
                if owner is not None:
                    del self.expected_links[key]
                    self.link_keys[key] = client.conn
            if owner is None:
                self._refuse(client)
                raise PermissionError("no client of this server announced that link key")
            client.link_key, client.link_from, client.link_owner = key, str(req.get("link_from", "?")), owner
        elif self.ticket is not None:  # a worker serves the one client the door handed it (the door checked its token)
            if self.client_conn is not None or not hmac.compare_digest(str(req.get("ticket") or ""), self.ticket):
                self._refuse(client)
                raise PermissionError("this worker serves another client (or the ticket is wrong): knock at the server's door")
            self.client_conn = client.conn
        elif self.tickets is not None:  # the one worker of every client: each comes with a ticket of its own
            given = str(req.get("ticket") or "")
            with self._links_lock:
                ticket = next((t for t in self.tickets if hmac.compare_digest(t, given)), None)
                if ticket is not None: del self.tickets[ticket]
            if ticket is None:
                self._refuse(client)
                raise PermissionError("that ticket was not given to this server (or was used already): knock at the server's door")
        elif self.token is not None and not hmac.compare_digest(str(req.get("token") or ""), self.token):
            self._refuse(client)
            raise PermissionError(f"wrong or missing token (set {protocol.TOKEN_ENV})")
        client.authed = True
        self.net.authenticate(client.conn)
        return {"devices": list(self.devices), "pid": host_pid(), "uid": os.getuid(), "instance": self.instance, "host": socket.gethostname(), "workers": self.workers,
                "copy_engines": self.copy_engines, "queue_state": list(self.device_host.queue_state_fields), "clock_ns": self.device_host.now_ns(),
                "share_socket": self.share_socket if self.share_runtime else None}

    def add_ticket(self, ticket: str) -> None:
        """(shared) A client the door let in will say hello with `ticket` (once); at most MAX_TICKETS wait."""
        assert self.tickets is not None, "only a shared worker takes tickets from the door"
        with self._links_lock:
            self.tickets[ticket] = None
            while len(self.tickets) > MAX_TICKETS: del self.tickets[next(iter(self.tickets))]

    def _refuse(self, client: Client) -> None:
        """A hello that failed: the connection is closed once the refusal is out."""
        threading.Timer(0.5, self._close_quietly, args=(client.conn,)).start()

    def _close_quietly(self, conn: int) -> None:
        try:
            self.net.conn(conn).close(200)
        except HCQError:
            pass

    def _stats(self, client: Client, req: dict[str, Any]) -> dict[str, int]:
        """The server's network engine counters (messages in, handled, sent, progress thread sleeps and wakeups...)."""
        return self.net.counters()

    def _device(self, client: Client, req: dict[str, Any]) -> ServedDevice:
        name = req.get("device")
        if name not in client.devices: raise ValueError(f"device {name!r} is not open on this connection")
        return client.devices[name]

    def _open(self, client: Client, req: dict[str, Any]) -> dict[str, Any]:
        name = req.get("device")
        if name not in self.devices: raise ValueError(f"it serves {', '.join(self.devices)}, not {name!r}")
        if name not in client.devices:
            if client.devices and not self.device_host.devices_share_memory:
                raise ValueError(f"this connection has {', '.join(client.devices)} open, and the {self.device_host.kind} devices this server "
                                 f"hosts reach no memory of each other (one peer group needs that): a client opens one of them at a time "
                                 f"(serve each with a server of its own to use several; transfers between servers go over their links)")
            # (named as its clients name it: a peer's fault report, "released by CPU:0@HOST:PORT after ...", reaches them)
            client.devices[name] = ServedDevice(name, self.device_host.open_device(f"{name}@{self.door}", self.workers), self.copy_engines)
        sd = client.devices[name]
        if name not in self.descriptions: self.descriptions[name] = {"kind": self.device_host.kind, **self.device_host.describe(sd.executor)}
        return {"device_id": sd.executor.device_id, "copy_engines": sd.copy_engines, "workers": self.workers, **self.descriptions[name]}

    def _status_page(self, client: Client, req: dict[str, Any]) -> None:
        """A client on this host shares its runtime memory (all of it, from now on): map its status page (the memfd it
        gave with `ticket`), whose first word counts the client's sleepers (hn_set_sleep_word)."""
        if client.status_page is not None or client.mappings: raise ValueError("a client shares its memory from the start, once")
        if not self.share_runtime:
            raise ValueError(f"this server's {self.device_host.kind} devices store into memory before its store hook hears of it: runtime memory is "
                             "mirrored by messages, not shared" if self.share else "this server shares no memory (HCQ_REMOTE_SHARE=0)")
        size = int(req["size"])
        fd = self._given_fd(str(req["ticket"]))
        try:
            check_sealed_memfd(fd, size)
            att = _Attachment(fd, size)
        finally:
            os.close(fd)
        client.attachments[att.addr] = att
        client.status_page = att
        client.status_page_client = int(req["client_addr"])
        if self.lib.hs_conn_set_shared(self.hs, client.conn) != 0: raise MemoryError("cannot note the client's shared memory")

    def _status_mirror(self, client: Client, req: dict[str, Any]) -> None:
        """Mirror the device's failure word into the client (at `client_addr`): copied into its status page, mapped
        here, when it shares its memory; else pushed."""
        sd = self._device(client, req)
        flag, at = self.device_host.failed_flag(sd.executor), int(req["client_addr"])
        page = client.status_page
        if page is not None:
            offset = at - client.status_page_client
            if not 8 <= offset <= page.size - 4: raise ValueError(f"0x{at:x} is not in the client's status page")
            rc = self.lib.hs_mirror_add_shared(self.hs, flag, 4, client.conn, at, page.addr + offset, page.addr)
        else:
            rc = self.lib.hs_mirror_add(self.hs, flag, 4, client.conn, at)
        if rc != 0: raise HCQError("cannot mirror the device's failure word")

    def _alloc(self, client: Client, req: dict[str, Any]) -> int:
        executor = self._device(client, req).executor
        size = int(req["size"])
        if not 0 < size <= 1 << 40: raise ValueError(f"cannot allocate {size} bytes")
        mirror, page = req.get("mirror"), client.status_page
        if mirror is None:  # a user buffer (`host` False) may be device-local memory; a window or a landing buffer may not
            mapping = self.device_host.memory(size, executor, shareable=size >= SHARE_MIN and self.share, host=bool(req.get("host", True)))
        elif page is None:  # the server's copy, kept equal by messages
            mapping = self.device_host.memory(size, executor)
            rc = self.lib.hs_mirror_add(self.hs, mapping.addr, size, client.conn, int(mirror["client_addr"]))
        else:  # the client's own memory, mapped here: one copy, shared
            if "ticket" not in mirror: raise ValueError("a client that shares its memory must give each mirrored allocation's memfd")
            mapping = self.device_host.memory(size, executor, fd=self._given_fd(str(mirror["ticket"])))
            rc = self.lib.hs_mirror_add_shared(self.hs, mapping.addr, size, client.conn, int(mirror["client_addr"]), mapping.addr, page.addr)
        if mirror is not None and rc != 0: raise HCQError(f"cannot mirror {size} bytes at 0x{mapping.addr:x}")
        if mirror is None and mapping.host_visible and self.lib.hs_place_add(self.hs, mapping.addr, size, client.conn) != 0:
            raise HCQError(f"cannot take copies into {size} bytes at 0x{mapping.addr:x}")
        client.mappings[mapping.addr] = (mapping, mirror is not None)
        return mapping.addr

    def _read(self, client: Client, req: dict[str, Any]) -> ctypes.Array:
        """The bytes of [addr, addr + size) of this connection's device memory, as the raw answer (bulk copyout: the
        reply is sent from the memory itself and lands in the client's destination)."""
        addr, size = int(req["addr"]), int(req["size"])
        self._owned(client, addr, size, device_only=True, host=True)
        return (ctypes.c_char * size).from_address(addr)

    def _free(self, client: Client, req: dict[str, Any]) -> None:
        addr = int(req["addr"])
        if addr not in client.mappings: raise ValueError(f"0x{addr:x} is not an allocation of this connection")
        mapping, mirrored = client.mappings.pop(addr)
        # no more pushes or placements into it, nor forwards out of it; then wait for what still lands in it
        landing = self.lib.hs_accept_remove_range(self.hs, addr, mapping.size) != 0
        if mirrored: self.lib.hs_mirror_remove(self.hs, addr)
        elif mapping.host_visible and self.lib.hs_place_remove(self.hs, addr) == -1: landing = True
        if landing: _leaked.append(mapping)  # a copy still lands in it: it stays mapped
        for r in [r for r in client.rkeys if _inside(r[0], 1, addr, mapping)]: self.net.rkey_release(client.rkeys.pop(r))
        if addr in client.registered:  # (after the accepts went: no put arrives for it now... from a well-behaved peer)
            client.registered.discard(addr)
            self.net.mem_unmap(addr)
        for c in self.clients.values():  # a replica slot in it is no link's to poison any more (the address may be reused)
            if c.replicas: c.replicas = [(r, o) for r, o in c.replicas if not (o == client.conn and _inside(r, 16, addr, mapping))]

    # ---- links between servers: replicas of signals and windows for transfers, pushed server to server
    def _expect_link(self, client: Client, req: dict[str, Any]) -> None:
        """This client will have another server link itself here saying `key` (once): only such a link is let in."""
        key = str(req["key"])
        if len(key) < 32: raise ValueError("a link key has at least 32 characters")
        with self._links_lock:
            if sum(1 for c in self.expected_links.values() if c == client.conn) >= MAX_EXPECTED_LINKS:
                raise ValueError(f"this connection announced {MAX_EXPECTED_LINKS} links that never came")
        self._let_in(req.get("from_ips"), req.get("from_uids"))  # (the linking server's addresses: its connection comes from one of them)
        with self._links_lock: self.expected_links[key] = client.conn

    def _let_in(self, addresses: Any, uids: Any = None) -> None:
        """Let the server at the other end of a link (at `addresses`, IPv4 literals its client resolved; running as
        `uids`, its worker's uid, for a server on this host) open TCP connections to this process: a worker's ports take
        none from an address not allowed (portfilter), nor from another local user (connectguard)."""
        if self.port_filter is None or not addresses: return
        if not isinstance(addresses, list) or len(addresses) > MAX_LINK_ADDRESSES:
            raise ValueError(f"a link names at most {MAX_LINK_ADDRESSES} addresses of the other server, as a list")
        if not isinstance(uids or [], list) or len(uids or []) > MAX_LINK_ADDRESSES or not all(isinstance(u, int) and u >= 0 for u in uids or []):
            raise ValueError(f"a link names at most {MAX_LINK_ADDRESSES} uids of the other server, as a list of numbers")
        self.port_filter.allow((str(a) for a in addresses), uids or ())
        self.port_filter.apply()

    def _link(self, client: Client, req: dict[str, Any]) -> None:
        """Connect to the server at `peer` for this client (once), saying `key` there; run on a thread of its own."""
        peer, key = str(req["peer"]), str(req["key"])
        if client.links.get(peer, (0, None))[1] == key: return  # (another key: a new server at that address)
        # (the other server's engine connects back to this one's tcp port as part of the handshake, from its address)
        self._let_in(req.get("peer_ips"), req.get("peer_uids"))
        host, _, port = peer.rpartition(":")
        conn = self.net.connect(host.strip("[]"), int(port), 10_000)
        try:
            answer = json.loads(conn.request(protocol.call_message("hello", version=protocol.VERSION, link_key=key,
                                                                     link_from=self.door), timeout_ms=30_000))
            if not answer.get("ok"): raise PermissionError(f"hcq server {peer} refused the link from {self.door}: {answer.get('error')}")
        except BaseException:
            conn.close()
            raise
        with self._links_lock:
            if client.conn not in self.clients:  # the client left meanwhile
                conn.close()
                return
            old = client.links.get(peer)
            client.links[peer] = (conn.id, key)
        if old is not None: self._close_link(old[0])  # (to the server that was at that address before)

    def _close_link(self, conn: int) -> None:
        """Close this server's connection `conn` to another server (briefly flushed; gone already is fine)."""
        try:
            self.net.conn(conn).close(200)
        except HCQError:
            pass

    # ---- device memory shared with servers on this host
    def _share(self, client: Client, req: dict[str, Any]) -> dict[str, Any] | None:
        """A ticket for the memfd of the allocation at `addr` (None when it is not shareable: small, or sharing off)."""
        addr = int(req["addr"])
        mapping = client.mappings.get(addr, (None, False))[0]
        if mapping is None or mapping.fd < 0: return None
        ticket = secrets.token_hex(16)
        with self._links_lock: self._tickets[ticket] = (os.dup(mapping.fd), time.monotonic() + 60)
        return {"socket": self.share_socket, "ticket": ticket, "size": mapping.size}

    def _serve_shares(self) -> None:
        while not self._stop.is_set():
            self._expire_tickets()
            try:
                conn, _ = self._share_listener.accept()
            except (TimeoutError, socket.timeout):
                continue
            except OSError:
                return  # closed
            with conn:
                conn.settimeout(1)
                try:
                    if _same_user(conn):
                        msg, fds, _, _ = socket.recv_fds(conn, 80, 1)  # (more fds in one message: the kernel closes the rest)
                    else:  # another user (another server's confined worker) only redeems a ticket: no fd of it is ever taken
                        msg, fds = conn.recv(80), []  # (fds sent along are discarded by the kernel: no room for them; a "give"
                                                      # without one is refused below as an unknown ticket)
                    if msg.startswith(b"give ") and len(fds) == 1:
                        conn.sendall(b"ok" if self._give_memory(msg[5:].decode(errors="replace"), fds[0]) else b"no")
                        continue
                    for fd in fds: os.close(fd)
                    ticket = msg.decode(errors="replace")
                    with self._links_lock: fd = self._tickets.pop(ticket, (-1, 0.0))[0]
                    if fd < 0:
                        conn.sendall(b"no")
                        continue
                    try:
                        socket.send_fds(conn, [b"ok"], [fd])
                    finally:
                        os.close(fd)
                except OSError:
                    pass

    def _give_memory(self, ticket: str, fd: int) -> bool:
        """A client on this host gave the memfd of its runtime memory, named by `ticket` in the CALL that maps it. At
        most MAX_GIVEN wait for their CALL (for GIVEN_S seconds): past that the fd is closed and False returned."""
        with self._links_lock:
            old = self._given.pop(ticket, None)
            if old is not None: os.close(old[0])
            if len(self._given) >= MAX_GIVEN or not self.share_runtime:  # (a server sharing no runtime memory takes none)
                os.close(fd)
                return False
            self._given[ticket] = (fd, time.monotonic() + GIVEN_S)
            return True

    def _given_fd(self, ticket: str) -> int:
        with self._links_lock: fd = self._given.pop(ticket, (-1, 0.0))[0]
        if fd < 0: raise PermissionError("no memory was given for that ticket (or it expired)")
        return fd

    def _expire_tickets(self) -> None:
        now = time.monotonic()
        with self._links_lock:
            for fds in (self._tickets, self._given):
                for t in [t for t, (_, until) in fds.items() if until < now]: os.close(fds.pop(t)[0])

    def _attach(self, client: Client, req: dict[str, Any]) -> int | None:
        """Map another server's shared allocation (by its ticket) into this process; its address here, or None when
        that server cannot be reached this way (another host)."""
        size = int(req["size"])
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(10)
            try:
                sock.connect("\0" + str(req["socket"]))
                sock.sendall(str(req["ticket"]).encode())
                msg, fds, _, _ = socket.recv_fds(sock, 16, 1)
            except OSError:
                return None  # not on this host (or gone): the caller uses a window
        if msg != b"ok" or not fds: raise PermissionError("the other server refused the ticket for its memory")
        try:
            att = _Attachment(fds[0], size)
        finally:
            for fd in fds: os.close(fd)
        client.attachments[att.addr] = att
        return att.addr

    def _detach(self, client: Client, req: dict[str, Any]) -> None:
        addr = int(req["addr"])
        att = client.attachments.get(addr)
        if att is None or att is client.status_page: raise ValueError(f"0x{addr:x} is not memory this connection attached")  # (mirrors point into the page)
        del client.attachments[addr]
        att.close()

    def _poison(self, link: Client) -> None:
        """A link died: the replicas it fed will never move again. Release their waiters poisoned, so the devices
        waiting fail (recoverably) naming the lost server, rather than waiting forever."""
        lost_id = self.device_host.stores.name_feeder(f"the hcq server at {link.link_from} that fed it was lost")
        for addr, owner in link.replicas:  # slots their owner still has (it may have freed them, or left)
            mine = self.clients.get(owner)
            if mine is not None and any(_inside(addr, 16, a, m) for a, (m, _) in mine.mappings.items()):
                self.device_host.poison(addr, (1 << 64) - 1, lost_id)

    def _owned(self, client: Client, addr: int, size: int, device_only: bool = False, host: bool = False) -> None:
        """ValueError unless [addr, addr + size) lies in one allocation of this connection (`device_only`: device memory,
        not a mirrored range of runtime memory; `host`: memory this process reaches, not device-local memory)."""
        inside = [m for a, (m, mirrored) in client.mappings.items() if not (device_only and mirrored) and _inside(addr, size, a, m)]
        if size <= 0 or not inside:
            raise ValueError(f"[0x{addr:x}, +{size}) is not {'device ' if device_only else ''}memory of this connection")
        if host and not inside[0].host_visible:
            raise ValueError(f"[0x{addr:x}, +{size}) is device-local memory, which this server's host cannot reach: its bytes move only "
                             "through the device's own queues (copies through staging, transfers through a landing buffer)")

    def _accept(self, client: Client, req: dict[str, Any]) -> str | None:
        """Let the link named `key` (or, with no key, this client itself) push into [addr, addr + size) of its memory;
        with `rkey`, also register the range for puts and return its packed remote key (None where it cannot)."""
        addr, size, key = int(req["addr"]), int(req["size"]), req.get("key")
        self._owned(client, addr, size, host=True)
        with self._links_lock:
            conn = client.conn if key is None else self.link_keys.get(str(key))
            if conn is None or conn not in self.clients or (key is not None and self.clients[conn].link_owner != client.conn):
                raise ValueError("no server linked itself here with that key for this client")
            source = self.clients[conn]
            if req.get("signal"): source.replicas.append((addr, client.conn))
        if source.failed_id < 0:
            source.failed_id = self.device_host.stores.name_feeder(f"a device of the hcq server at {source.link_from} failed" if source.link_key
                                           else "a device of the client driving it failed")
        if self.lib.hs_accept_add(self.hs, addr, size, conn, client.conn, source.failed_id) != 0: raise MemoryError("cannot accept pushes")
        if not req.get("rkey") or not self.net.rma: return None
        try:
            packed = self.net.mem_map(addr, size)
        except HCQError:
            return None  # pushed as messages instead
        client.registered.add(addr)
        return packed.hex()

    def _forward(self, client: Client, req: dict[str, Any]) -> None:
        """Push what is stored into [addr, addr + size) to `dest` as well: on the server `peer` (linked first), or, with
        no peer, in this client. A window's pages are dropped once pushed; a signal's value is pushed at once."""
        addr, size, dest, window = int(req["addr"]), int(req["size"]), int(req["dest"]), bool(req.get("window"))
        self._owned(client, addr, size, host=True)
        peer = req.get("peer")
        conn = client.conn if peer is None else client.links.get(str(peer), (None, ""))[0]
        if conn is None: raise ValueError(f"this connection has no link to {peer}")
        rkey = -1
        if window and req.get("rkey") and peer is not None:
            try:
                rkey = client.rkeys[(addr, dest)] = self.net.rkey(conn, bytes.fromhex(str(req["rkey"])))
            except HCQError:
                rkey = -1  # pushed as messages instead
        if self.lib.hs_forward_add(self.hs, addr, size, None, conn, dest, client.conn, 1 if window else 0, rkey) != 0:
            raise MemoryError("cannot forward")
        if not window: self.lib.hs_push_now(self.hs, addr, size, 2 if size == 16 else 0)  # (FLAG_SIGNAL) the value now

    def _unforward(self, client: Client, req: dict[str, Any]) -> None:
        self._owned(client, int(req["addr"]), 1)
        self.lib.hs_forward_remove(self.hs, int(req["addr"]), int(req["dest"]))
        if (rkey := client.rkeys.pop((int(req["addr"]), int(req["dest"])), None)) is not None: self.net.rkey_release(rkey)

    def _load(self, client: Client, req: dict[str, Any]) -> dict[str, Any]:
        executor = self._device(client, req).executor
        name, source = str(req["name"]), str(req["source"])
        entry, size, slots, loaded, bindings = self.device_host.load(source, name, executor)
        client.programs.append(loaded)
        return {"entry": entry, "kernargs_size": size, "bindings": bindings.to_wire() if bindings is not None else None,
                "arg_slots": [[s.name, s.ctype, s.is_pointer, s.offset, s.fmt, s.read_only] for s in slots]}

    def _open_ring(self, client: Client, req: dict[str, Any]) -> int:
        sd = self._device(client, req)
        kind, index = req["kind"], int(req["index"])
        if kind not in (COMPUTE, COPY) or not 0 <= index < (1 if kind == COMPUTE else sd.copy_engines):
            raise ValueError(f"{sd.name} has no {kind} queue {index}")
        # one ring per queue: two rings feeding one queue (its engine, a device's one worker pool) would race in it
        if (kind, index) in sd.ring_keys: raise ValueError(f"{sd.name}'s {kind} queue {index} is open already")
        handle = sd.executor.open_ring(kind, index)
        sd.ring_keys.add((kind, index))
        sd.rings.append(handle)
        ring_id = self.lib.hs_ring_add(self.hs, handle, client.conn)
        if ring_id < 0: raise MemoryError("cannot register the ring")
        sd.ring_ids.append(ring_id)
        return (ring_id << 32) | len(sd.rings) - 1

    def _ring(self, client: Client, req: dict[str, Any]) -> tuple[ServedDevice, Any]:
        sd = self._device(client, req)
        index = int(req["ring"]) & 0xFFFFFFFF
        if not 0 <= index < len(sd.rings): raise ValueError(f"{sd.name} has no ring {index}")
        return sd, sd.rings[index]

    def _ring_state(self, client: Client, req: dict[str, Any]) -> list[Any]:
        sd, handle = self._ring(client, req)
        # A client sees a signal's value as soon as the store hook pushed it, which is before the queue thread moved
        # past the SIGNAL: a ring in the middle of a packet that cannot block is given a moment to finish it, so a
        # client that waited for the last signal finds the ring idle, as it would locally.
        deadline = time.monotonic() + 0.01
        while (st := sd.executor.ring_state(handle)).current and decode_header(st.current[0])[0] in INSTANT and time.monotonic() < deadline:
            time.sleep(0)
        return [st.rptr, st.wptr, st.packets_done, st.current, st.position, st.indirect_index]

    def _error(self, client: Client, req: dict[str, Any]) -> str | None:
        return self._device(client, req).executor.error()

    def _recover(self, client: Client, req: dict[str, Any]) -> None:
        self._device(client, req).executor.recover()

    def _cas(self, client: Client, req: dict[str, Any]) -> int:
        addr = int(req["addr"])
        if not any(_inside(addr, 16, a, m) for a, (m, mirrored) in client.mappings.items() if mirrored):
            raise ValueError(f"0x{addr:x} is not a signal of this connection")
        return self.device_host.cas64(addr, int(req["expected"]), int(req["desired"]))

    # ---- devices and clients that go away
    def _stop_device(self, sd: ServedDevice) -> bool:
        """Stop a served device, then free it where every thread was joined (else it is left: a kernel still runs). True
        when its queue threads stopped (no packet of it runs any more). Its rings must take no more submissions."""
        stopped = self.device_host.stop_device(sd.executor, sd.rings)
        sd.rings, sd.ring_ids = [], []
        return stopped

    def _close_device(self, client: Client, req: dict[str, Any]) -> bool:
        """The client closed the device (dev.close(), after its work finished or was dropped): its rings take no more
        SUBMITs and it is stopped and freed; `open` makes a new one. Its memory is the client's (freed by `free`)."""
        sd = self._device(client, req)
        for ring_id in sd.ring_ids: self.lib.hs_ring_remove(self.hs, ring_id)  # (a SUBMIT under way finishes first)
        self.lib.hs_mirror_remove(self.hs, self.device_host.failed_flag(sd.executor))  # (its failure word goes with it)
        del client.devices[sd.name]
        return self._stop_device(sd)

    def _drop_client(self, conn: int) -> None:
        if conn == self.client_conn: self.stop()  # a worker's client left: so does the worker (its links with it)
        with self._links_lock:
            client = self.clients.pop(conn, None)
            for key in [k for k, c in self.link_keys.items() if c == conn]: del self.link_keys[key]
            for key in [k for k, c in self.expected_links.items() if c == conn]: del self.expected_links[key]
            for c in self.clients.values():  # a link of this server that died
                for peer in [p for p, (lc, _) in c.links.items() if lc == conn]: del c.links[peer]
        landing = self.lib.hs_conn_remove(self.hs, conn) != 0  # no more pushes to it, nor submissions or copies from it
        if client is None: return
        if client.replicas: self._poison(client)
        for link, _ in client.links.values(): self._close_link(link)
        stuck = False
        for sd in client.devices.values(): stuck |= not self._stop_device(sd)
        for addr in client.registered:  # (its accepts went with the connection: no put comes now)
            try:
                self.net.mem_unmap(addr)
            except HCQError:
                pass  # (the engine is closing)
        client.registered = set()  # (else a later allocation at a reused address could not be registered)
        if stuck or landing: _leaked.append((client.mappings, client.attachments))  # a kernel still runs, or a copy lands: memory stays mapped
        else:
            for att in client.attachments.values(): att.close()
        client.mappings, client.attachments = {}, {}


def _same_user(conn: socket.socket) -> bool:
    """Whether the peer of a unix socket runs as this process's user (or as root): the abstract socket's name is public
    (/proc/net/unix), so anyone on the host can connect."""
    pid, uid, gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return uid in (os.geteuid(), 0)


_leaked: list[Any] = []
_terminated = threading.Event()  # (a worker) SIGTERM came before it served
hosting = 0  # Servers alive in this process (they own the local command processor's store hook)
_KNOWN = (HCQError, CompileError, ValueError, MemoryError, PermissionError, KeyError)


def _inside(addr: int, size: int, start: int, mapping: HostedMemory) -> bool:
    """Whether [addr, addr + size) lies in the usable bytes of `mapping` (at `start`)."""
    return start <= addr and addr + size <= start + mapping.size


def _result(value: Any) -> bytes:
    return json.dumps({"ok": True, "result": value}).encode()


def _failure(e: BaseException) -> bytes:
    if not isinstance(e, _KNOWN): traceback.print_exc(file=sys.stderr)
    return json.dumps({"ok": False, "kind": type(e).__name__, "error": str(e)}).encode()


def check_listen_address(host: str, token: str | None, door_checked: bool = False) -> str:
    """The IPv4 address to listen on for `host`. Refused: IPv6 (portfilter.NO_IPV6 says why), and beyond loopback without a
    token (clients send C code the server runs), unless `door_checked` (a worker: its door checks the token)."""
    addrs = ipv4_addresses(host)
    if door_checked or all(ipaddress.ip_address(a).is_loopback for a in addrs): return addrs[0]
    if not token:
        raise PermissionError(f"hcq serve: listening on {host} (not loopback) needs a token: set {protocol.TOKEN_ENV} on the server and "
                              "on its clients. Clients run arbitrary C code on the server: use trusted networks only")
    return addrs[0]


def add_command(sub: Any, common: Any) -> None:
    """`hcq serve` (registered through the entry point group hcq.commands, so the core's CLI imports no backend)."""
    p = sub.add_parser("serve", parents=[common], help="host CPU devices for other processes and hosts: clients open "
                       "hcq.Device('CPU:0@HOST:PORT') (needs hcq[remote]; see the threat model in docs/design.md)")
    _add_arguments(p)
    p.set_defaults(fn=_run)


def _add_arguments(p: Any) -> None:
    """`hcq serve`'s options (also those of `python -m hcq.backends.remote.server`)."""
    p.add_argument("--listen", default="127.0.0.1:0", help="HOST:PORT to listen on (default 127.0.0.1 and a free port; beyond "
                   "loopback only with HCQ_REMOTE_TOKEN set)")
    p.add_argument("--devices", default="CPU:0,CPU:1", help="comma list of devices of one backend to serve (default CPU:0,CPU:1; VK:0 serves a Vulkan device)")
    p.add_argument("--isolation", choices=("process", "none"), default="process",
                   help="process (default): every client gets a worker process of its own; none: one process serves every "
                        "client (no isolation between them: a single trusted user only)")
    p.add_argument("--no-confine", action="store_true", help="trusted single-user setups: workers keep the server's user (as "
                   "root: uid 0 without capabilities) and no namespaces of their own, so clients on this host reach them over "
                   "UCX's shared memory (round trip about 3 us instead of 10; BENCHMARKS.md). Default: each worker confined as "
                   "an unprivileged user of its own (docs/design.md, threat model)")
    p.add_argument("--worker-user", default=None, help="run as root: the user every worker runs as (default: a uid of its own "
                   "for each worker; with --no-confine, root without capabilities)")
    p.add_argument("--address-file", default=None, help="also write the device names clients open (one a line) to this file, "
                   "once the server listens (for launchers)")


def _run(args: Any) -> int:
    return main(args.listen, args.devices, args.isolation, args.worker_user, args.address_file, confine=not args.no_confine)


def _split_listen(listen: str) -> tuple[str, int]:
    host, _, port = listen.rpartition(":") if ":" in listen else (listen, "", "0")
    return (host or protocol.DEFAULT_HOST).strip("[]"), int(port or 0)


def main(listen: str, devices: str, isolation: str = "process", worker_user: str | None = None, address_file: str | None = None,
         confine: bool = True) -> int:
    """`hcq serve`: print the address, then serve until SIGTERM or Ctrl-C."""
    host, port = _split_listen(listen)
    names = tuple(d.strip() for d in devices.split(",") if d.strip())
    token = os.environ.get(protocol.TOKEN_ENV) or None
    check_listen_address(host, token)
    from hcq.backends.remote.door import FrontDoor
    names = Server.check_devices(names)
    # (--isolation none: one worker process for every client; the door runs no client's code either way)
    server = FrontDoor(host, port, names, token, worker_user=worker_user, shared=isolation == "none", confinement=confine)
    if address_file: _write_atomically(address_file, "".join(f"{n}@{server.address}\n" for n in names))  # (before the line below)
    print(f"hcq serve: listening on {server.address} ({', '.join(names)}); clients open e.g. "
          f"hcq.Device(\"{names[0]}@{server.address}\")", flush=True)
    _serve_until_stopped(server)
    return 0


def _write_atomically(path: str, text: str) -> None:
    """`text` into `path`, whole or not at all (a launcher polling for the file never reads half of it)."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f: f.write(text)
    os.replace(tmp, path)


def _serve_until_stopped(server: Any) -> None:
    """Serve until stop(), SIGTERM or Ctrl-C, then close."""
    signal.signal(signal.SIGTERM, lambda *_: server.stop())
    if _terminated.is_set(): server.stop()  # (a worker's SIGTERM that came while it started)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.close()


def _stdin_lines() -> Iterator[bytes]:
    """The lines of fd 0, read without sys.stdin's buffered reader: a daemon thread blocked in that reader when the
    interpreter exits makes it abort ("could not acquire lock for <_io.BufferedReader name='<stdin>'>")."""
    pending = b""
    while chunk := os.read(0, 4096):
        *lines, pending = (pending + chunk).split(b"\n")
        yield from lines
    if pending: yield pending


def _confine(config: dict[str, Any]) -> str:
    """Confine this worker (sandbox.confine) as `config` says: uid `uid` (or `user`'s); returns what was done. The
    native libraries are loaded first (from the server user's compile cache, which the worker no longer sees); what it
    compiles later (its client's kernels) goes to a private cache in its private /tmp, which no other worker reads."""
    from hcq.backends.remote import sandbox
    for kind in sorted({str(d).partition(":")[0] for d in config.get("devices", ())}): device_host(kind).preload()
    net_lib()
    uid = int(config["uid"]) if config.get("uid") is not None else None
    if uid is None and config.get("user") and os.geteuid() == 0: uid = pwd.getpwnam(str(config["user"])).pw_uid
    how = sandbox.confine(uid, keep=_needed_directories(), guard=int(config.get("guard_fd", -1)))
    os.environ.update(HOME="/tmp", TMPDIR="/tmp", HCQ_CACHE_DIR="/tmp/hcq-cache")
    os.environ.setdefault("UCX_TLS", "^sm")  # (its IPC namespace and /dev/shm are its own: no shared-memory lane reaches its client)
    for need in (os.path.dirname(os.__file__), hcq_root()):
        if not os.access(need, os.R_OK | os.X_OK): raise PermissionError(f"the worker cannot read {need}")
    return how


def _needed_directories() -> list[str]:
    """What a confined worker needs to see of the directories confinement covers (the server user's home, /tmp...):
    the interpreter's prefixes (the standard library, site-packages), installed packages' directories on sys.path
    (site- and dist-packages) and the hcq package itself; not the door's working directory or other sys.path entries,
    whose other files would then be readable by the worker."""
    prefixes = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    packages = [p for p in sys.path if os.path.basename(p.rstrip("/")) in ("site-packages", "dist-packages")]
    return [*prefixes, *packages, os.path.dirname(os.path.realpath(sys.executable)), hcq_root()]


def _uids(words: list[str]) -> list[int]:
    """The local users a door's line names ("-": none)."""
    return [int(w) for w in words if w.isdigit()]


def hcq_root() -> str:
    """The directory of the hcq package."""
    import hcq
    return os.path.dirname(os.path.abspath(hcq.__file__))


def worker_main() -> int:
    """A worker (started by the front door, its configuration on stdin): serves one client, then exits."""
    from hcq.backends.remote import sandbox
    door = _stdin_lines()
    config = json.loads(next(door, b"{}"))
    # A confined worker is pid 1 of its PID namespace, where a signal without a handler is dropped: the door's SIGTERM
    # (passed on by the stand-in) would be lost until serving starts, and the door would wait for it in vain. So a
    # handler from the start, noting it (a worker told to stop leaves at its next step), and SIGTERM blocked across
    # confinement: the stand-in it forks takes it only once it passes it on, and the worker once it is confined.
    signal.signal(signal.SIGTERM, lambda *_: _terminated.set())
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    sandbox.die_with_parent()
    sandbox.not_dumpable()
    if not config.get("confine") and int(config.get("guard_fd", -1)) >= 0: os.close(int(config["guard_fd"]))  # (only a stand-in keeps it)
    try:
        how = _confine(config) if config.get("confine") else sandbox.drop_root(config.get("user"))
    except (OSError, KeyError) as e:  # (KeyError: no such user)
        print(f"hcq serve worker: cannot become {config.get('user') or config.get('uid')!r}: {e}", file=sys.stderr, flush=True)
        return 1
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})  # (one that came meanwhile is noted now)
    if _terminated.is_set(): return 0
    if config.get("net_device") and not os.environ.get("UCX_NET_DEVICES"):  # (UCX reads it when the engine starts)
        os.environ["UCX_NET_DEVICES"] = str(config["net_device"])  # transports only where the client reaches the worker
    # A spare is unreachable (no listener: no stranger can take its places for strangers) until the door hands it out,
    # and its UCX tcp ports (there from the start) take a connection from nobody: each is filtered by source address,
    # in the kernel, from then on (portfilter: UCX's tcp transport executes a raw PUT frame from any peer that connects).
    shared = config.get("ticket") is None  # (--isolation none: it serves every client the door lets in)
    ports = PortFilter(sandbox.port_filter_channel)  # (a confined worker's stand-in attaches the filters)
    server = Server(config["host"], 0, tuple(config["devices"]), ticket=config.get("ticket"), door=config["door"], listen=False,
                    shared=shared, port_filter=ports)
    ports.keep_applied()

    def tell_door(line: str) -> None:  # (one write per line: two threads tell it things)
        sys.stdout.write(line + "\n")
        sys.stdout.flush()

    def filter_ports() -> None:  # (a filter that cannot be attached leaves the ports open: the door warns, once)
        if not ports.apply(): tell_door(f"unfiltered {ports.error}")
    if ports.error: tell_door(f"unfiltered {ports.error}")

    def watch_door() -> None:
        # "assigned ADDR UID": its client comes from ADDR (as local user UID; "-": not local): let it in, listen, and it
        # has a while to come; (shared) "allow ADDR UID": another client comes from there; end of input: the door is
        # gone. The filter is applied before the door hears.
        for line in door:
            words = [w.decode(errors="replace") for w in line.split()]
            if shared and len(words) == 2 and words[0] == "ticket": server.add_ticket(words[1])
            if shared and len(words) == 3 and words[0] == "allow":
                try:
                    ports.allow([words[1]], _uids(words[2:]))
                    filter_ports()
                    tell_door(f"allowed {words[1]} {words[2]}")
                except ValueError as e:
                    print(f"hcq serve worker {host_pid()}: cannot let {words[1]!r} in: {e}", file=sys.stderr, flush=True)
                    tell_door(f"refused {words[1]} {words[2]}")
            if words[:1] != ["assigned"] or len(words) not in (1, 3) or server.client_deadline is not None or (shared and server.port): continue
            if not shared: server.client_deadline = time.monotonic() + float(config.get("assigned_s", 10))
            try:
                ports.allow(words[1:2], _uids(words[2:]))
                port = server.listen()
                filter_ports()  # (the UCP listener too, before its client or anyone learns its port)
                tell_door(f"listening {port}")
            except (HCQError, ValueError) as e:
                print(f"hcq serve worker {host_pid()}: {e}", file=sys.stderr, flush=True)
                break
        server.stop()
    server.on_client = lambda: tell_door("connected")  # (the door counts the workers handed out that nobody connected to)
    threading.Thread(target=watch_door, name="hcq-serve-door", daemon=True).start()
    if os.environ.get("HCQ_SERVE_DEBUG") or "WITH" in how: print(f"hcq serve worker {host_pid()} {how}", file=sys.stderr, flush=True)
    tell_door("started")
    _serve_until_stopped(server)
    return 0


if __name__ == "__main__":  # python -m hcq.backends.remote.server: `hcq serve` without an installed package (or a worker)
    import argparse
    if sys.argv[1:] == ["--worker"]: sys.exit(worker_main())
    ap = argparse.ArgumentParser(prog="python -m hcq.backends.remote.server", description="hcq serve")
    _add_arguments(ap)
    sys.exit(_run(ap.parse_args()))
