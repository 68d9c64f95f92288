"""Remote devices: `hcq.Device("CPU:0@HOST:PORT")` is device CPU:0 of the `hcq serve` process at HOST:PORT, driven
through the network engine (net.c, over UCX) with the whole HCQ API: the core runs here as for any device, and the
server is the hardware (memory, command processor, kernel loader). docs/design.md, "Remote devices", has the
protocol; in short:

- Device memory lives on the server; the client has no view of it (copies go through the staging ring).
- Runtime memory (signals, kernargs, staging buffers, bound queue words: what the core reads and writes through
  the host) is mirrored: the host reads and writes the client's copy; a submission carries the mirrored bytes its
  packets read (kernargs, copy sources, bound words) ahead of its words; the server pushes what its packets store
  (signals, copy results, the device's failure word) back in messages applied in order, a signal's value last.
  So a host wait spins on local memory (progressing the engine) and never polls the server.
- A server that dies makes every wait on its devices raise DeviceError within a wait slice or two; the
  connection's death is noticed by the network engine's keepalive."""
from __future__ import annotations

import atexit
import contextlib
import ctypes
import fcntl
import json
import mmap
import os
import re
import secrets
import socket
import sys
import threading
import time
import weakref
from typing import Any, Iterator, Sequence, cast

from hcq import interrupts, profiler
from hcq.allocator import HCQAllocator
from hcq.backends.remote import protocol
from hcq.device import HCQCompiled
from hcq.errors import CompileError, DeviceError, HCQError
from hcq.helpers import env_flag
from hcq.hostmap import libc, MAP_FIXED, MAP_PRIVATE_ANON, PROT_RW
from hcq.interfaces import COMPUTE, COPY, Capabilities, HostStores
from hcq.memory import BufferSpec, HCQBuffer, host_address, iter_chunks, MMIOInterface, NotHostVisibleError
from hcq.packet_queue import Executor, PacketComputeQueue, PacketCopyQueue, RingState, SubmitStatus
from hcq.program import ArgSlot, BufferBindings, CLikeArgsState, HCQProgram
from hcq.signal import HCQSignal, SignalReplica

RING_WORDS = protocol.RING_WORDS  # the server's rings (cp.c)
CONNECT_TIMEOUT_MS = 10_000
CALL_TIMEOUT_MS = 120_000  # a CALL may compile a kernel on the server
SUBMIT_TIMEOUT_MS = 30_000
BULK_MIN_BYTES = 256 << 10  # host copies from this size on go straight to / from device memory (RemoteAllocator)
BULK_CHUNK_BYTES = 16 << 20  # ...in pieces of at most this size (each one message, or one read and its reply)
LANDED_CHUNK_BYTES = 4 << 20  # ...or, into device memory the server's host cannot reach, through two buffers of this size
PAGE = mmap.PAGESIZE
NAME = re.compile(r"(?P<dev>[A-Za-z_][A-Za-z0-9_]*:\d+)@(?P<host>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):(?P<port>\d+)")
_ERRORS: dict[str, type[Exception]] = {"HCQError": HCQError, "CompileError": CompileError, "ValueError": ValueError,
                                       "MemoryError": MemoryError, "PermissionError": PermissionError, "KeyError": KeyError}


def parse_name(name: str) -> tuple[str, str, int]:
    """"CPU:0@127.0.0.1:5555" -> ("CPU:0", "127.0.0.1", 5555)."""
    m = NAME.fullmatch(name.strip())
    if not m: raise ValueError(f"bad remote device name {name!r}; expected KIND:INDEX@HOST:PORT, e.g. 'CPU:0@127.0.0.1:5555'")
    return m.group("dev").upper(), m.group("host").strip("[]"), int(m.group("port"))


class _ClientMemory:
    """Pages of this process: the client's copy of a mirrored range (the server pushes into it), or, `shared` (client
    and server on one host), the range itself: a memfd, sealed against shrinking, that the server maps too."""

    def __init__(self, size: int, shared: bool = False):
        self.size = -(-max(size, 1) // PAGE) * PAGE
        self.fd = -1
        self.unregister: weakref.finalize | None = None  # what takes its mirror registration away once it is collected
        if shared:
            self.fd = os.memfd_create("hcq-remote-runtime", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
            try:
                os.ftruncate(self.fd, self.size)
                fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
                self.mm = mmap.mmap(self.fd, self.size)
            except BaseException:
                os.close(self.fd)
                raise
            _shared_memory.add(self)
        else:  # (private: a fork() child's writes stay its own)
            self.mm = mmap.mmap(-1, self.size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.window = (ctypes.c_char * self.size).from_buffer(self.mm)
        self.addr = ctypes.addressof(self.window)

    def give(self, share_socket: str) -> str:
        """Pass the memfd to the server over its unix socket (then close it here); the ticket that names it there."""
        ticket = secrets.token_hex(16)
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.settimeout(10)
                sock.connect("\0" + share_socket)
                socket.send_fds(sock, [b"give " + ticket.encode()], [self.fd])
                if sock.recv(16) != b"ok": raise ConnectionError("the server did not take the memory")
        finally:
            os.close(self.fd)
            self.fd = -1
        return ticket

    def make_private(self) -> None:
        """In a fork() child: the shared pages become private copies, so that nothing the child does reaches the parent's
        signals or its server (the child cannot use the devices anyway)."""
        keep = ctypes.string_at(self.addr, self.size)
        if libc.mmap(self.addr, self.size, PROT_RW, MAP_PRIVATE_ANON | MAP_FIXED, -1, 0) != self.addr: return  # (left shared)
        ctypes.memmove(self.addr, keep, self.size)


_shared_memory: weakref.WeakSet[_ClientMemory] = weakref.WeakSet()  # made private in a fork() child


class Connection:
    """One client connection to an `hcq serve` process, shared by the devices of that server opened here."""

    def __init__(self, host: str, port: int):
        from hcq.backends.remote.door import knock
        from hcq.backends.remote.net import NetEngine, net_lib  # the engine is built at first use
        self.address, self.host = f"{host}:{port}", host
        token = os.environ.get(protocol.TOKEN_ENV)
        door = knock(host, port, token, CONNECT_TIMEOUT_MS / 1000)  # a worker of our own, at this port, with this ticket
        self.worker_address = f"[{host}]:{door['port']}" if ":" in host else f"{host}:{door['port']}"
        self.lib = net_lib()
        self.engine = NetEngine()
        self.table = self.lib.hs_create(self.engine.handle, None, None, None)  # the client's copies of mirrored ranges
        if not self.table: raise MemoryError("cannot create the remote client's mirror table")
        self.engine.set_handler(protocol.PUSH, ctypes.cast(self.lib.hs_on_push, ctypes.c_void_p).value, self.table)
        self.engine.set_handler(protocol.WAKE, ctypes.cast(self.lib.hs_on_wake, ctypes.c_void_p).value, self.table)
        self.engine.set_handler(protocol.SYNC, ctypes.cast(self.lib.hs_on_sync, ctypes.c_void_p).value, self.table)
        self.engine.set_placer(ctypes.cast(self.lib.hs_place_ok, ctypes.c_void_p).value, self.table)  # windows into accepted ranges
        self._failed_id: int | None = None
        if _followed: self.lib.hs_set_poison(self.table, _followed[0].poison())  # (pushes a failed device stored, into local memory)
        elif not _hosting():  # no local backend's threads sleep on what is pushed here (yet): no futex call per push
            self.lib.hn_set_waker(ctypes.cast(self.lib.hn_no_other_sleepers, ctypes.c_void_p).value)
        self.conn = self.engine.connect(host, int(door["port"]), CONNECT_TIMEOUT_MS)
        self.lock = threading.Lock()
        self.info: dict[str, Any] = self.call("hello", version=protocol.VERSION, token=token, ticket=door.get("ticket"))
        # Client and server on one host share the runtime memory (one copy: what the server's queues store is here at
        # once, and submissions carry no bytes); else it is mirrored by messages. All or nothing: a signal seen in
        # shared memory must not overtake bytes still on their way in a message.
        # The server offers its unix socket unless HCQ_REMOTE_SHARE=0 there; a server on another host cannot be reached
        # through it (an abstract socket name is local to its host).
        self.share_socket: str | None = self.info.get("share_socket") if env_flag("HCQ_REMOTE_SHARE", True) else None
        self.status = self._status_page()  # word 0: our sleepers (shared); then a failure word per device
        self.shared = self.share_socket is not None
        self.add_mirror(self.status.addr, self.status.size, 0)
        self.status_used = 8
        self.status_free: list[int] = []  # slots of closed devices
        self.links: dict[str, str] = {}  # another server this one pushes to (its instance) -> the key naming that link there

    def link_to(self, other: Connection) -> str:
        """Have this connection's server connect to `other`'s (once); returns the key that names the link there."""
        from hcq.backends.remote.portfilter import resolve_ipv4
        with self.lock:
            if other.instance not in self.links:
                key = secrets.token_hex(16)
                # The other server lets in no link its client did not announce, and its ports take TCP connections only
                # from the addresses it was told of: this server's (as this process resolves its host); this server, in
                # turn, lets the other's in (its engine connects back to this one's as part of the handshake). On one
                # host, each also lets the other's uid in (another local user is refused: connectguard).
                other.call("expect_link", key=key, from_ips=resolve_ipv4(self.host), from_uids=self._uids())
                self.call("link", peer=other.worker_address, key=key, peer_ips=resolve_ipv4(other.host), peer_uids=other._uids())
                self.links[other.instance] = key
            return self.links[other.instance]

    @property
    def instance(self) -> str:
        """The server process at the other end, as its hello named it: a server started again at the same address is
        another one, linked anew."""
        return str(self.info.get("instance") or self.worker_address)

    def _uids(self) -> list[int]:
        """The uid this connection's worker runs as (as its hello said), for a server to let it in."""
        uid = self.info.get("uid")
        return [uid] if isinstance(uid, int) and uid >= 0 else []

    def _status_page(self) -> _ClientMemory:
        """The page of the devices' failure words; shared with the server (which then maps all runtime memory of this
        connection) when it is on this host."""
        if self.share_socket is not None:
            page = _ClientMemory(PAGE, shared=True)
            try:
                ticket = page.give(self.share_socket)
            except OSError:
                self.share_socket = None  # another host
            else:
                self.call("status_page", client_addr=page.addr, size=page.size, ticket=ticket)
                self.lib.hn_set_sleep_word(self.engine.handle, page.addr)
                return page
        return _ClientMemory(PAGE)

    def give(self, memory: _ClientMemory) -> str:
        """Give shared runtime memory to the server (see _ClientMemory.give)."""
        assert self.share_socket is not None
        try:
            return memory.give(self.share_socket)
        except OSError as e:
            raise HCQError(f"cannot share memory with the hcq server at {self.address} on this host ({e}); "
                           "set HCQ_REMOTE_SHARE=0 to mirror it by messages instead") from None

    def add_mirror(self, client: int, size: int, server: int) -> None:
        """Let the server push into [client, client + size) (the copy of its range at `server`)."""
        if self.lib.hs_mirror_add(self.table, client, size, self.conn.id, server) != 0: raise HCQError("cannot register a mirrored range")

    def remove_mirror(self, client: int) -> None:
        self.lib.hs_mirror_remove(self.table, client)

    def wait(self, local_addr: int, value: int, ms: int) -> bool:
        """Wait up to `ms` (0: only a spin) for the word at `local_addr` to reach `value`, progressing the engine."""
        return self.lib.hn_wait_ge64(self.engine.handle, local_addr, value, ms) == 0

    @property
    def alive(self) -> bool:
        return bool(self.conn.alive)

    def why_dead(self) -> str:
        return f"the connection to the hcq server at {self.address} was lost ({self.conn.error or 'the server closed it'})"

    @contextlib.contextmanager
    def _talking(self) -> Iterator[None]:
        """Around a message to the server: DeviceError once the connection is lost (before or during it), and any other
        failure of the engine named with the server."""
        if not self.conn.alive: raise DeviceError(self.why_dead())
        try:
            yield
        except HCQError as e:
            if not self.conn.alive: raise DeviceError(self.why_dead()) from None
            raise HCQError(f"hcq server {self.address}: {e}") from None

    def send(self, msg: bytes) -> None:
        """A one-way message (delivered in order with the requests)."""
        with self._talking(): self.conn.send(msg)

    def request(self, msg: bytes, timeout_ms: int) -> bytes:
        with self._talking(): return self.conn.request(msg, timeout_ms=timeout_ms)

    def place(self, server_addr: int, host_addr: int, nbytes: int) -> None:
        """Write host memory [host_addr, +nbytes) into the server's memory at server_addr (device memory of this
        connection), in order with the messages sent after; returns once the host memory may change."""
        with self._talking(): self.conn.place(server_addr, host_addr, nbytes, timeout_ms=SUBMIT_TIMEOUT_MS)

    def read(self, host_addr: int, server_addr: int, nbytes: int) -> None:
        """Read the server's memory [server_addr, +nbytes) (device memory of this connection) into host memory; the reply
        lands there directly. Returns once the host memory is no longer written."""
        msg = protocol.call_message("read", addr=server_addr, size=nbytes)
        with self._talking(): got = self.conn.request_into(msg, host_addr, nbytes, timeout_ms=CALL_TIMEOUT_MS)
        if got != nbytes:  # a failure (JSON, shorter than any read: reads are large), or a server that broke the protocol
            try:
                answer = json.loads(ctypes.string_at(host_addr, got)) if 0 < got < nbytes else {}
            except ValueError:
                answer = {}
            raise _ERRORS.get(answer.get("kind", ""), HCQError)(f"hcq server {self.address}: {answer.get('error', f'read {got} bytes of {nbytes}')}")

    def call(self, op: str, **args: Any) -> Any:
        """A CALL: the server's result, or its error raised here as the same kind of exception."""
        answer = json.loads(self.request(protocol.call_message(op, **args), CALL_TIMEOUT_MS))
        if answer.get("ok"): return answer.get("result")
        raise _ERRORS.get(answer.get("kind", ""), HCQError)(f"hcq server {self.address}: {answer.get('error')}")

    def call_slow(self, op: str, **args: Any) -> Any:
        """A CALL that may take long (a compile on the server): on the main thread it is waited for in slices, so Ctrl-C
        raises at once. The server still finishes it (its answer is dropped), and answers later CALLs after it."""
        if threading.current_thread() is not threading.main_thread(): return self.call(op, **args)
        result: list[tuple[bool, Any]] = []
        done = threading.Event()

        def run() -> None:
            try:
                result.append((True, self.call(op, **args)))
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                result.append((False, e))
            finally:
                done.set()
        threading.Thread(target=run, name=f"hcq-remote-{op}", daemon=True).start()
        while not done.wait(0.05): pass
        ok, value = result[0]
        if ok: return value
        raise value

    def failed_id(self, stores: HostStores) -> int:
        """The poison id a push from this server carries into local memory after one of its devices failed: a WAIT of a
        local device it releases fails that device, naming this server."""
        if self._failed_id is None: self._failed_id = stores.name_feeder(f"a device of the hcq server at {self.address} failed")
        return self._failed_id

    def status_slot(self) -> int:
        """8 bytes of the status page for a device's failure word."""
        with self.lock:
            if self.status_free: return self.status_free.pop()
            if self.status_used + 8 > self.status.size: raise HCQError(f"too many devices open on {self.address}")
            self.status_used += 8
            return self.status.addr + self.status_used - 8

    def give_back_status_slot(self, addr: int) -> None:
        """A closed device's status slot (the server mirrors no failure word there any more): the next device takes it."""
        with self.lock: self.status_free.append(addr)


_connections: dict[str, Connection] = {}
_connections_lock = threading.Lock()
_engine_used = False  # this process started UCX (a network engine)
_inherited_engine = False  # ...or an ancestor did, and this process is its fork() child


def connection(host: str, port: int) -> Connection:
    global _engine_used
    if _inherited_engine:
        raise HCQError(f"cannot open a remote device ({host}:{port}) in a child forked from a process that used remote devices: UCX "
                       "does not survive fork(). Start the child with the spawn method (multiprocessing.get_context('spawn')) or exec")
    key = f"{host}:{port}"
    _engine_used = True
    with _connections_lock:
        if (old := _connections.get(key)) is not None and not old.alive:  # its server died (or restarted): a new one
            _retire_connection(old)
            del _connections[key]
        if key not in _connections: _connections[key] = Connection(host, port)
        return _connections[key]


def _retire_connection(conn: Connection) -> None:
    """A dead connection's executors refuse submissions, its forwards go, and its engine closes (its devices were
    retired by the registry: see RemoteDevice.lost)."""
    for ex in list(_executors):
        if ex.connection is conn: ex.close_native(wait=True)
    if _exports: conn.lib.hs_conn_remove(_exports[0], conn.conn.id)
    try:
        conn.engine.close()
    except Exception:  # noqa: BLE001 - it is dead already: nothing more to release
        pass


_executors: weakref.WeakSet[RemoteExecutor] = weakref.WeakSet()  # (closed before the engines close, and in a fork() child)
_exports: list[int] = []  # the table of what local devices store that servers follow (made at first use)
# The local backend whose host stores (interfaces.HostStores) remote devices follow and feed: the first one asked for.
_followed: list[HostStores] = []


def _hosting() -> bool:
    """Whether this process serves devices (hcq serve): its server owns the store hook and the waker."""
    server = sys.modules.get("hcq.backends.remote.server")
    return server is not None and bool(cast(Any, server).hosting)


def host_stores(dev: Any) -> HostStores | None:
    """The HostStores of local device `dev`'s backend, when remote devices can follow its stores and feed its waiters
    (the backend declares them; one backend per process, the first one used: a push wakes its sleepers); else None,
    and transfers and waits between `dev` and remote devices take the core's general paths."""
    stores = getattr(type(dev), "host_stores", None)  # (None for a remote device: its memory is its server's)
    if stores is None: return None
    if _followed: return stores if _followed[0] is stores else None
    with _connections_lock:
        if not _followed:
            from hcq.backends.remote.net import net_lib
            net_lib().hn_set_waker(stores.waker())  # (pushes into local memory wake only its sleepers)
            for c in _connections.values(): c.lib.hs_set_poison(c.table, stores.poison())
            _followed.append(stores)
        return stores if _followed[0] is stores else None


def exports(stores: HostStores) -> int:
    """The client's table of forwards: ranges of this process that local devices store into (signals remote devices
    wait on, windows of remote buffers) and the servers they are pushed to. Made, and set as the local backend's store
    hook, at first use."""
    with _connections_lock:
        if not _exports:
            if _hosting():
                raise HCQError("this process serves devices (hcq serve): its local devices cannot also feed remote ones")
            from hcq.backends.remote.net import net_lib
            table = net_lib().hs_create(None, None, None, None)
            if not table: raise MemoryError("cannot create the client's table of forwards")
            _exports.append(table)
            stores.set_hook(ctypes.cast(net_lib().hs_store_hook, ctypes.c_void_p).value, table)
        return _exports[0]


def _stop_exports() -> None:
    """No more pushes from local devices (before the engines they go through close, or in a fork() child)."""
    if not _exports: return
    _followed[0].set_hook(None, None)
    from hcq.backends.remote.net import net_lib
    for c in _connections.values(): net_lib().hs_conn_remove(_exports[0], c.conn.id)  # (waits for hooks under way)
    _exports.clear()


def _after_fork_in_child() -> None:
    global _inherited_engine
    for memory in list(_shared_memory): memory.make_private()
    for ex in list(_executors): ex.close_native(wait=False)  # (UCX is unusable here: refuse at once, with a clear error)
    if _exports:  # the parent's engines are not in the child: its local devices must not push through them
        _followed[0].set_hook(None, None)
        _exports.clear()
    _connections.clear()  # the parent's connections (and their engine threads) are not in the child
    _inherited_engine = _inherited_engine or _engine_used


def _close_connections() -> None:
    """At exit, after the devices shut down (atexit runs this last: registered before any device opened): close the
    engines, so the servers see the connections close at once and UCX has no transfers left in flight."""
    _stop_exports()
    for ex in list(_executors): ex.close_native(wait=True)  # no submission may reach an engine that is closing
    for c in list(_connections.values()):
        try:
            c.engine.close()
        except Exception:  # noqa: BLE001 - at exit: nothing more to do
            pass
    _connections.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)
atexit.register(_close_connections)


class RemoteSignal(HCQSignal):
    """A signal in mirrored memory: the host reads the client's copy (which the server keeps current), stores go to
    both, and waits spin then sleep on local memory."""
    _fresh = False
    stores_in_host_memory = False  # a store is a STORE message too

    def _attach_host_memory(self, base_buf: HCQBuffer) -> None:
        super()._attach_host_memory(base_buf)
        self._local_addr = base_buf.cpu_view().addr  # the client's copy of the value word (shared: the word itself)
        self._fresh = True  # the first store also resets the server's timestamp word

    def store(self, value: int, wake: bool = True) -> None:
        conn = self._connection
        if self._fresh and conn.shared and self._ts_mv is not None: self._ts_mv[0] = 0  # (the server's word too)
        super().store(value, wake)  # checks the value, writes the local copy (shared: the server's value too)
        flags = protocol.STORE_RESET_TIMESTAMP if self._fresh else 0
        self._fresh = False
        # One-way: the server applies it (shared: wakes its sleepers) before any SUBMIT sent after it (one connection,
        # in order), and it cannot be refused (the signal is in memory this connection mirrors; a server that finds
        # otherwise logs it)
        conn.send(protocol.store_message(int(self.value_addr), value, flags | protocol.STORE_ONE_WAY))

    @property
    def _connection(self) -> Connection:
        return cast(RemoteDevice, self.owner).connection

    def compare_exchange(self, expected: int, desired: int) -> int:
        found = int(self._connection.call("cas", addr=self.value_addr, expected=expected, desired=desired))
        if found == expected and not self._connection.shared: self._value_mv[0] = desired
        return found

    def _wait_slice(self, value: int, ms: int) -> bool:
        if self._value_mv is None: self._refuse_virtual()
        return self._connection.wait(self._local_addr, value, ms)


class RemoteExecutor(Executor):
    """Rings on the server, driven by serve.c's client executor (hs_exec_*): a submission is one SUBMIT message, the
    mirrored bytes its packets read, then its words. hs_exec_submit is the native submit, so the core's hot paths
    (launches, queue re-submits) reach the network without Python."""
    ring_words = RING_WORDS
    # hs_exec_submit's statuses past the core's SubmitStatus (nothing was queued with any of them; protocol.py has them)
    CLOSED, DEAD, REFUSED, LOST, TIMEOUT, ERROR = range(protocol.FIRST_CLIENT_SUBMIT_STATUS,
                                                        protocol.FIRST_CLIENT_SUBMIT_STATUS + len(protocol.CLIENT_SUBMIT_STATUSES))

    def __init__(self, dev: RemoteDevice, device_id: int):
        self.dev, self.device_id, self.connection = dev, device_id, dev.connection
        self.lib = self.connection.lib
        self.handle = self.lib.hs_exec_create(self.connection.engine.handle, self.connection.conn.id, dev.status_addr)
        if not self.handle: raise MemoryError("cannot create the remote executor")
        # freed when collected; not at exit, where the devices' shutdown may still submit after weakref's exit hook ran
        weakref.finalize(self, self.lib.hs_exec_free, self.handle).atexit = False
        self._server_rings: dict[int, int] = {}  # our ring handle -> the server's
        _executors.add(self)

    # ---- mirrored ranges and programs (what a submission's walk needs)
    def add_mirror(self, server: int, size: int, client: int) -> None:
        if self.lib.hs_exec_range_add(self.handle, server, size, client, self.connection.shared) != 0: raise MemoryError("cannot register a mirrored range")

    def remove_mirror(self, server: int) -> None:
        self.lib.hs_exec_range_remove(self.handle, server)

    def set_kernargs_size(self, entry: int, size: int) -> None:
        """An EXEC of `entry` reads `size` bytes of kernargs (sent with it)."""
        if self.lib.hs_exec_kargs(self.handle, entry, size) != 0: raise MemoryError("cannot register a program")

    def close_native(self, wait: bool) -> None:
        """Refuse submissions from now on (the connection is closing; or this is a fork() child, wait False)."""
        self.lib.hs_exec_close(self.handle, int(wait))

    # ---- Executor
    def close(self, handles: Sequence[Any], release: bool = False) -> bool:
        """No more submissions; `release` (dev.close()): the server stops and frees the device too."""
        self.close_native(wait=True)
        if not release or not self.connection.alive: return True
        return bool(self.connection.call("close", device=self.dev.remote_name))

    def native_submit_address(self) -> int | None:
        return ctypes.cast(self.lib.hs_exec_submit, ctypes.c_void_p).value

    def open_ring(self, kind: str, index: int) -> int:
        server = int(self.connection.call("open_ring", device=self.dev.remote_name, kind=kind, index=index))
        handle = self.lib.hs_exec_ring(self.handle, server >> 32)
        if not handle: raise MemoryError("cannot register the ring")
        self._server_rings[handle] = server
        return int(handle)

    def try_submit(self, handle: Any, addr: int, nwords: int, timeout_ns: int) -> int:
        return int(self.lib.hs_exec_submit(handle, addr, nwords, timeout_ns))

    def ring_state(self, handle: Any) -> RingState:
        rptr, wptr, done, current, position, indirect = self.connection.call("ring_state", device=self.dev.remote_name,
                                                                              ring=self._server_rings[handle])
        return RingState(rptr, wptr, done, current, position, indirect)

    def consumed(self, handle: Any) -> int:
        return self.ring_state(handle).rptr

    def room(self, handle: Any) -> int:
        st = self.ring_state(handle)
        return RING_WORDS - (st.wptr - st.rptr)

    def error(self) -> str | None:
        state = self.lib.hs_exec_state(self.handle)  # (one call: this runs after every synchronize)
        if state == 0: return None
        if state != 1 or not self.connection.alive: return self.connection.why_dead()
        return self.connection.call("error", device=self.dev.remote_name) or None

    def recover(self) -> None:
        self.connection.call("recover", device=self.dev.remote_name)
        ctypes.c_int.from_address(self.dev.status_addr).value = 0

    def submit_error(self, handle: Any, status: int) -> str:
        where = f"hcq server {self.connection.address}"
        if status == self.DEAD or (status == self.CLOSED and not self.connection.alive): raise DeviceError(self.connection.why_dead())
        texts = {SubmitStatus.TOO_BIG: f"the submission exceeds the ring's {RING_WORDS} words",
                 self.CLOSED: f"the connection to the {where} is closed (at exit; or in a fork() child: UCX does not survive fork(), "
                              "start such children with spawn or exec)",
                 self.REFUSED: f"the {where} refused a malformed submission",
                 self.LOST: f"a submission to the {where} sent without waiting was refused, so its work was lost; the ring takes no more",
                 self.TIMEOUT: f"the {where} did not answer a submission within {SUBMIT_TIMEOUT_MS} ms"}
        if status in texts: return texts[status]
        if status == self.ERROR: return f"{where}: {self.lib.hn_last_error().decode(errors='replace')}"
        return super().submit_error(handle, status)


_OWN = BufferSpec(nolru=True)


@contextlib.contextmanager
def _given_back_on_error(allocator: RemoteAllocator, buf: HCQBuffer) -> Iterator[None]:
    """Give `buf` (from `_own`) back if what sets it up fails."""
    try:
        yield
    except BaseException:
        allocator._give_back(buf)
        raise


class RemoteAllocator(HCQAllocator["RemoteDevice"]):
    """Device memory on the server (no host view); runtime memory mirrored in this process. Large host copies over a
    connection that mirrors by messages go straight between the caller's memory and the device memory, or, where the
    server's host cannot reach that memory, through buffers of the server's own that the device's copy queue copies
    (see `_copyin_staged`); smaller ones, and all where client and server share runtime memory, take the staging ring."""
    _landings: list[HCQBuffer]
    _landing_tags: list[int]  # the timeline value of the copy that last read or wrote each landing buffer
    _landing_next: int

    def _timeline_wrapped(self) -> None:
        super()._timeline_wrapped()
        if "_landing_tags" in self.__dict__: self._landing_tags = [0, 0]

    def _close(self, stopped: bool, runtime: list[HCQBuffer]) -> None:
        super()._close(stopped, runtime + (self.__dict__.pop("_landings", []) if stopped else []))

    def _bulk(self, nbytes: int) -> bool:
        """Whether a host copy of `nbytes` goes over the network engine rather than through the staging ring."""
        return nbytes >= BULK_MIN_BYTES and not self.dev.connection.shared and env_flag("HCQ_REMOTE_BULK", True)

    def _landing_buffer(self) -> tuple[int, HCQBuffer]:
        """The next of two landing buffers (server memory its host reaches; both made at the first use, given back when
        the device closes) for bulk copies of device memory it cannot reach, once the copy that last used it finished;
        its index."""
        if "_landings" not in self.__dict__:
            with interrupts.deferred():  # (both or neither: a Ctrl-C between them would leave one nobody gives back)
                landings = [self._own(LANDED_CHUNK_BYTES)]
                try:
                    landings.append(self._own(LANDED_CHUNK_BYTES))
                except BaseException:
                    self._give_back(landings[0])
                    raise
                self._landings, self._landing_tags, self._landing_next = landings, [0, 0], 0
        k = self._landing_next
        self.dev.timeline_signal.wait(self._landing_tags[k])
        self._landing_next = k ^ 1
        return k, self._landings[k]

    def _copyin_staged(self, dest: HCQBuffer, src: memoryview) -> None:
        """A large copyin is placed into the device memory by the network engine (net.c, AM_PLACE: sent from `src`,
        received straight into place on the server), after the work submitted before it (waited for here) and ahead of
        what is submitted after it (the same connection, in order). No staging buffer, no copy engine, no memcpy. Into
        device memory the server's host cannot reach, each piece is placed into a landing buffer instead, and the
        device's copy queue moves it into place (ordered on the timeline, as a staged copy is)."""
        if not self._bulk(src.nbytes): return super()._copyin_staged(dest, src)
        if not self.dev.memory_host_visible: return self._copyin_landed(dest, src)
        self.dev.synchronize()
        addr, nbytes, keep = host_address(src)
        for off, size in iter_chunks(nbytes, BULK_CHUNK_BYTES):
            with self._network_copy("copyin (network)", size):
                self.dev.connection.place(cast(int, dest.va_addr) + off, addr + off, size)
        del keep

    def _copyin_landed(self, dest: HCQBuffer, src: memoryview) -> None:
        addr, nbytes, keep = host_address(src)
        for off, size in iter_chunks(nbytes, LANDED_CHUNK_BYTES):
            k, landing = self._landing_buffer()
            with self._network_copy("copyin (network)", size):
                self.dev.connection.place(cast(int, landing.va_addr), addr + off, size)
            self._tagged_copy(self._landing_tags, k, cast(int, dest.va_addr) + off, cast(int, landing.va_addr), size, "copyin (landed)")
        del keep

    def _copyout_landed(self, dest: memoryview, src: HCQBuffer) -> None:
        """The device's copy queue copies each piece into a landing buffer (one piece ahead of the reads), which the
        server reads and sends as the reply, received straight into `dest`."""
        addr, nbytes, keep = host_address(dest)
        ahead: list[tuple[int, int, HCQBuffer, int]] = []
        for off, size in iter_chunks(nbytes, LANDED_CHUNK_BYTES):
            k, landing = self._landing_buffer()
            done = self._tagged_copy(self._landing_tags, k, cast(int, landing.va_addr), cast(int, src.va_addr) + off, size, "copyout (landed)")
            ahead.append((off, size, landing, done))
            if len(ahead) == 2: self._read_landed(addr, *ahead.pop(0))
        while ahead: self._read_landed(addr, *ahead.pop(0))
        del keep

    def _read_landed(self, addr: int, off: int, size: int, landing: HCQBuffer, done: int) -> None:
        self.dev.timeline_signal.wait(done)
        with self._network_copy("copyout (network)", size):
            self.dev.connection.read(addr + off, cast(int, landing.va_addr), size)

    def _copyout_staged(self, dest: memoryview, src: HCQBuffer) -> None:
        """A large copyout (the device is synchronized already) is read by the server from the device memory and sent as
        the reply, which the network engine receives straight into `dest` (from device memory the server's host cannot
        reach, through landing buffers: `_copyout_landed`)."""
        if not self._bulk(dest.nbytes): return super()._copyout_staged(dest, src)
        if not self.dev.memory_host_visible: return self._copyout_landed(dest, src)
        addr, nbytes, keep = host_address(dest)
        for off, size in iter_chunks(nbytes, BULK_CHUNK_BYTES):
            with self._network_copy("copyout (network)", size):
                self.dev.connection.read(addr + off, cast(int, src.va_addr) + off, size)
        del keep

    @contextlib.contextmanager
    def _network_copy(self, name: str, nbytes: int) -> Iterator[None]:
        """A copy event for the profiler (on the device's "network" track, timed on the host: no queue runs it)."""
        start = time.perf_counter_ns()
        yield
        if (prof := profiler.active) is not None: prof.span_event("copy", name, self.dev.device, "network", start, nbytes)

    def alloc(self, size: int, options: BufferSpec | None = None, *, internal: bool = False) -> HCQBuffer:
        if options is not None and (options.cpu_access or options.host) and not internal:
            raise NotHostVisibleError(f"{self.dev.device}: memory of a remote device has no host view (it is on the server); "
                                      "allocate device memory and use copyin / copyout")
        return super().alloc(size, options, internal=internal)

    def _alloc(self, size: int, options: BufferSpec) -> HCQBuffer:
        dev = self.dev
        if not (options.cpu_access or options.host):  # (a user buffer may be device-local on the server; its own memory may not)
            addr = int(dev.connection.call("alloc", device=dev.remote_name, size=size, host=options is _OWN))
            return HCQBuffer(addr, size, meta=options, view=None, owner=dev)
        local = _ClientMemory(size, dev.connection.shared)
        mirror: dict[str, Any] = {"client_addr": local.addr}
        if dev.connection.shared: mirror["ticket"] = dev.connection.give(local)
        addr = int(dev.connection.call("alloc", device=dev.remote_name, size=size, mirror=mirror))
        buf = HCQBuffer(addr, size, meta=options, view=MMIOInterface(local.addr, size, keepalive=local), owner=dev)
        try:
            dev.connection.add_mirror(local.addr, size, addr)
            # (a buffer never freed, of a closed device, goes when collected: so does its registration, before the address can be reused)
            local.unregister = weakref.finalize(local, dev.connection.remove_mirror, local.addr)
            buf._remote_local = local  # type: ignore[attr-defined]  # (from here on _free unregisters both)
            dev.executor.add_mirror(addr, size, local.addr)  # type: ignore[union-attr]
        except BaseException:  # a registration left behind would refuse the next range at the same address
            self._free(buf, options)
            raise
        return buf

    def _free(self, buf: HCQBuffer, options: BufferSpec) -> None:
        dev = self.dev
        if dev.connection.alive: dev.connection.call("free", device=dev.remote_name, addr=buf.va_addr)
        local = getattr(buf, "_remote_local", None)
        if local is not None:
            dev.executor.remove_mirror(buf.va_addr)  # type: ignore[union-attr]
            if local.unregister is not None: local.unregister.detach()
            dev.connection.remove_mirror(local.addr)
            buf.view = None

    def _map_into(self, buf: HCQBuffer) -> HCQBuffer:
        owner = buf.owner
        if isinstance(owner, RemoteDevice) and owner.connection is self.dev.connection: return buf  # one server, one address space
        raise HCQError(f"{self.dev.device} cannot map {buf!r}: it is not memory of the server at {self.dev.connection.address}")

    def _import(self, buf: HCQBuffer) -> HCQBuffer | None:
        """A window on this device's server: what its copy engine writes there is pushed on to `buf`, on another
        server (over a link between the two) or in this process (a local device's host memory: `host_stores`), ahead of the
        signals the copy's queue stores next; the window's pages are dropped once pushed."""
        dev, owner = self.dev, buf.owner
        conn = dev.connection
        if isinstance(owner, RemoteDevice) and (mapping := self._attach(buf, owner)) is not None: return mapping
        rkey, landing, owner_alloc = None, None, cast(RemoteAllocator, owner.allocator) if isinstance(owner, RemoteDevice) else None
        if isinstance(owner, RemoteDevice) and owner_alloc is not None:  # (the owner registers the buffer, so the window is put there where it can)
            key = conn.link_to(owner.connection)
            landing = owner_alloc._landing(buf)
            try:
                rkey = owner.connection.call("accept", key=key, addr=(landing or buf).va_addr, size=buf.size, rkey=True)
            except BaseException:
                if landing is not None: owner_alloc._give_back(landing)
                raise
            dest, peer = cast(int, (landing or buf).va_addr), owner.connection.worker_address
        elif (stores := host_stores(owner)) is not None and buf.cpu_view().addr == buf.va_addr:
            dest, peer = buf.va_addr, None
            if conn.lib.hs_accept_add(conn.table, dest, buf.size, conn.conn.id, -1, conn.failed_id(stores)) != 0: raise MemoryError("cannot accept pushes")
        else:
            return None

        def release() -> None:
            if peer is None: conn.lib.hs_accept_remove_range(conn.table, dest, buf.size)
            if window is not None: self._give_back(window)  # (the server drops the window's forward with it)
            if landing is not None and owner_alloc is not None: owner_alloc._give_back(landing)  # (and the accept into it)
        window: HCQBuffer | None = None
        try:
            window = self._own(buf.size)
            conn.call("forward", peer=peer, addr=window.va_addr, size=buf.size, dest=dest, window=True, rkey=rkey)
        except BaseException:
            release()
            raise
        mapping = HCQBuffer(window.va_addr, buf.size, meta="window: put" if rkey else "window: pushed", owner=dev)
        mapping.on_release, mapping.lands_in = release, landing
        return mapping

    def _landing(self, buf: HCQBuffer) -> HCQBuffer | None:
        """Where writes meant for `buf` (this device's) land when the server's host cannot reach `buf` (device-local
        memory): memory of this device's own that the host reaches, from which a transfer's copy on this device moves
        them into place (`HCQBuffer.lands_in`). None: they go straight to `buf`."""
        return None if self.dev.memory_host_visible else self._own(buf.size)

    def _own(self, size: int) -> HCQBuffer:
        """Server memory of its own (a window, a replica slot, a landing buffer): never cut from a slab nor kept in the LRU
        cache, so the server drops what forwards into or out of it when it goes; indexed with the device's allocations
        (validation finds the copies into and out of it in bounds) until it is released."""
        with interrupts.deferred():  # (whole: one split before the index would leave it out)
            buf = self._alloc(size, _OWN)
            self._index(cast(int, buf.va_addr), buf)
        return buf

    def _give_back(self, buf: HCQBuffer) -> None:
        """Free memory from `_own` once no submitted work of the peer group can still use it."""
        self._release(buf, _OWN)

    def _attach(self, buf: HCQBuffer, owner: RemoteDevice) -> HCQBuffer | None:
        """`buf`'s own memory mapped into this device's server, when both servers share a host (the memfd of the
        allocation passes between them over a unix socket): the copy engine then writes it directly. None otherwise."""
        share = owner.connection.call("share", addr=buf.va_addr)
        if share is None: return None
        conn = self.dev.connection
        addr = conn.call("attach", **share)
        if addr is None: return None
        mapping = HCQBuffer(int(addr), buf.size, meta="shared memory", owner=self.dev)

        def release() -> None:
            if conn.alive: conn.call("detach", addr=addr)
        mapping.on_release = release
        return mapping

    def _export_to(self, buf: HCQBuffer, dev: Any) -> HCQBuffer | None:
        """A window in a local device's memory (one whose stores remote devices follow): what its copy engine writes
        there is pushed on to `buf`. Not for runtime memory (signals, kernargs), whose stores the server makes: a window
        would never show them. A device whose stores remote devices follow waits on such a signal through a slot of its
        own the server pushes into (`_export_signal`, which names this server in a poisoned value), so mapping it is
        refused; another device maps its mirror here."""
        if (stores := host_stores(dev)) is None: return None
        if buf.view is not None:
            raise HCQError(f"{dev.device} reaches {buf!r} (runtime memory of {self.dev.device}) only through replicas of its signals")
        conn = self.dev.connection
        window = dev.allocator.alloc(buf.size, internal=True)
        landing: HCQBuffer | None = None

        def release() -> None:
            if table: conn.lib.hs_forward_remove(table, window.va_addr, dest)
            dev.allocator.free(window, window.size)
            if landing is not None: self._give_back(landing)
        table, dest = 0, cast(int, buf.va_addr)
        if window.cpu_view().addr != window.va_addr:  # (its command processor stores device addresses: host ones here)
            release()
            return None
        try:
            landing = self._landing(buf)
            dest = cast(int, (landing or buf).va_addr)
            table = exports(stores)
            conn.call("accept", addr=dest, size=buf.size)
            if conn.lib.hs_forward_add(table, window.va_addr, buf.size, conn.engine.handle, conn.conn.id, dest, conn.conn.id, 1, -1) != 0:
                raise MemoryError("cannot forward")
        except BaseException:
            release()
            raise
        mapping = HCQBuffer(window.va_addr, buf.size, meta="window: pushed", owner=dev)
        mapping.on_release, mapping.lands_in = release, landing
        return mapping


class RemoteCompiler:
    """Kernels are compiled on the server (and cached there by content): the 'library' is the C source."""

    def compile(self, source: str) -> bytes:
        if not isinstance(source, str): raise TypeError(f"kernel source must be a str, got {type(source).__name__}")
        return source.encode()


class RemoteProgram(HCQProgram):
    """A kernel compiled and loaded by the server; its EXEC entry word is the server's entry address."""

    def __init__(self, dev: RemoteDevice, name: str, lib: bytes):
        res = dev.connection.call_slow("load", device=dev.remote_name, name=name, source=lib.decode())
        self.arg_slots = [ArgSlot(n, ctype, bool(ptr), int(off), fmt, read_only=bool(ro)) for n, ctype, ptr, off, fmt, ro in res["arg_slots"]]
        self.entry = int(res["entry"])
        self.bindings = BufferBindings.from_wire(res["bindings"])  # (buffers bound with their sizes: the server's VK kernels)
        size = max(int(res["kernargs_size"]), 8)
        if (bound := self.bindings) is not None and (bound.count != sum(s.is_pointer for s in self.arg_slots) or bound.sizes_offset + 8 * bound.count > size):
            raise HCQError(f"{dev.device}: the server described kernel {name!r}'s buffer bindings ({bound}) in a way that does not fit its "
                           f"{len(self.arg_slots)} parameters and {size}-byte arguments")
        cast(RemoteExecutor, dev.executor).set_kernargs_size(self.entry, size)
        super().__init__(CLikeArgsState, dev, name, kernargs_alloc_size=size, lib=lib, base=self.entry)


class RemoteComputeQueue(PacketComputeQueue):
    """Compute queue of a remote device (hcq packets, run by the server's command processor)."""


class RemoteCopyQueue(PacketCopyQueue):
    """Copy queue `index` of a remote device (a copy engine of the server)."""


def _dims(value: Any) -> tuple[int, int, int]:
    """Three positive ints (a launch limit a server described), or ValueError."""
    dims = tuple(value) if isinstance(value, list) else ()
    if len(dims) != 3 or any(type(n) is not int or n <= 0 for n in dims): raise ValueError(f"a launch limit must be three positive ints, not {value!r}")
    return cast(tuple[int, int, int], dims)


class RemoteDevice(HCQCompiled[RemoteSignal]):
    """`KIND:N@HOST:PORT`: device KIND:N of the `hcq serve` process at HOST:PORT. The devices of one server form one
    peer group (they share the server's address space). What the device is (its kind, word size, block limit, kernel
    language and compiler, and the kernels the conformance kit runs on it) comes from the server's `open` reply."""

    def __init__(self, device: str):
        self.remote_name, host, port = parse_name(device)
        self.connection = connection(host, port)
        info = self.connection.call("open", device=self.remote_name)
        try:
            self.kind, self.language, self.compiler_identity = str(info["kind"]), str(info["language"]), str(info["compiler"])
            self.max_block_threads, self.num_copy_engines = int(info["max_block_threads"]), int(info["copy_engines"])
            self.max_grid, self.max_block = _dims(info["max_grid"]), _dims(info["max_block"])
            self.timestamp_divider = info["timestamp_divider"]
            if type(self.timestamp_divider) not in (int, float) or not 0 < self.timestamp_divider < float("inf"):
                raise ValueError(f"timestamp_divider {self.timestamp_divider!r} is not a positive number")
            self.CONFORMANCE_KERNELS = {name: (str(src), str(entry)) for name, (src, entry) in info["conformance_kernels"].items()}
            self.memory_host_visible = info["memory_host_visible"]  # whether the server's host reaches user buffers (else device-local)
            if type(self.memory_host_visible) is not bool: raise ValueError(f"memory_host_visible {self.memory_host_visible!r} is not a bool")
            # what the server's device can do, but through this connection: its memory has no host view here, and its
            # queues are hcq packets the server's command processor runs
            caps = Capabilities.from_wire(info["capabilities"], queues={COMPUTE: 1, COPY: self.num_copy_engines}, host_visible_memory=False,
                                          host_copies=False, packets=True)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            try:
                self.connection.call("close", device=self.remote_name)  # (the server's instance of it goes)
            except HCQError:
                pass
            raise HCQError(f"{device}: the server described the device in a way this client cannot use ({e!r})") from None
        self.status_addr = self.connection.status_slot()
        self.connection.call("status_mirror", device=self.remote_name, client_addr=self.status_addr)
        super().__init__(f"{self.remote_name}@{host}:{port}", RemoteAllocator(self), RemoteCompiler(), RemoteProgram, RemoteSignal,
                         RemoteComputeQueue, RemoteCopyQueue, capabilities=caps, executor=RemoteExecutor(self, int(info["device_id"])),
                         peer_group=f"{self.kind}@{self.connection.address}")
        self.clock_domain = f"hcq serve {self.connection.address}"  # one calibration per server (its devices share its clock)

    @classmethod
    def precompile(cls, source: str) -> None:
        """Nothing to warm here: kernels are compiled (and cached) by the server."""

    def _release(self, stopped: bool) -> None:
        super()._release(stopped)
        self.connection.give_back_status_slot(self.status_addr)

    def lost(self) -> str | None:
        """Why this device cannot be reached any more (its connection died: the server was killed or restarted), else
        None. Its memory and queues went with the server."""
        return None if self.connection.alive else self.connection.why_dead()

    def recover(self, timeout: int | None = None) -> None:
        if (why := self.lost()) is not None:
            raise DeviceError(f"{self.device} cannot recover: {why}. Its memory and queues on the server are gone; "
                              f"hcq.Device({self.device!r}) opens it again once the server is back")
        super().recover(timeout)

    # ---- signals of other peer groups
    def _import_signal(self, signal: HCQSignal) -> SignalReplica | None:
        """A 16-byte slot in this server's memory that the signal's stores are pushed into: from its server over a
        link, or from this process (a local device's signal: its backend's store hook, `host_stores`)."""
        owner, conn, allocator = signal.owner, self.connection, cast(RemoteAllocator, self.allocator)
        addr = cast(int, signal.value_addr)
        if isinstance(owner, RemoteDevice):
            key = owner.connection.link_to(conn)
            slot = allocator._own(16)
            with _given_back_on_error(allocator, slot):
                conn.call("accept", key=key, addr=slot.va_addr, size=16, signal=True)
                owner.connection.call("forward", peer=conn.worker_address, addr=addr, size=16, dest=slot.va_addr)  # (pushes the value now)

            def release() -> None:
                if owner.connection.alive: owner.connection.call("unforward", addr=addr, dest=slot.va_addr)
                allocator._give_back(slot)  # (once queues that may wait on it are past)
        elif (stores := host_stores(owner)) is not None and signal.base_buf.cpu_view().addr == addr:
            table = exports(stores)
            slot = allocator._own(16)
            with _given_back_on_error(allocator, slot):
                conn.call("accept", addr=slot.va_addr, size=16)
                if conn.lib.hs_forward_add(table, addr, 16, conn.engine.handle, conn.conn.id, slot.va_addr, conn.conn.id, 0, -1) != 0:
                    raise MemoryError("cannot forward")
            conn.lib.hs_push_now(table, addr, 16, 2)  # (FLAG_SIGNAL) the value now; later stores follow

            def release() -> None:
                conn.lib.hs_forward_remove(table, addr, slot.va_addr)
                allocator._give_back(slot)
        else:
            return None
        return SignalReplica(signal, cast(int, slot.va_addr), self, release)

    def _export_signal(self, signal: HCQSignal, waiter: HCQCompiled) -> SignalReplica | None:
        """A 16-byte slot in a local device's memory that the server pushes the signal's stores into (besides the
        client's mirror of it: a value a failed device stored arrives there poisoned in the name of this server)."""
        if (stores := host_stores(waiter)) is None: return None
        conn, addr = self.connection, cast(int, signal.value_addr)
        slot = waiter.allocator.alloc(16, internal=True)
        local = slot.cpu_view().addr
        if waiter.allocator._use_host(local, 16) != slot.va_addr:  # (the command processor stores device addresses)
            waiter.allocator.free(slot, 16)
            return None

        def release() -> None:
            if conn.alive: conn.call("unforward", addr=addr, dest=local)
            conn.lib.hs_accept_remove_range(conn.table, local, 16)
            waiter.allocator.free(slot, 16)
        try:
            if conn.lib.hs_accept_add(conn.table, local, 16, conn.conn.id, -1, conn.failed_id(stores)) != 0: raise MemoryError("cannot accept pushes")
            conn.call("forward", addr=addr, size=16, dest=local)  # (pushes the value now)
        except BaseException:
            release()
            raise
        return SignalReplica(signal, slot.va_addr, waiter, release)

    def describe(self) -> list[str]:
        i = self.connection.info
        return super().describe() + [f"served by hcq serve at {self.connection.address} (pid {i['pid']} on {i['host']}, "
                                     f"{i['workers']} workers)"]


DEVICE_CLASS = RemoteDevice
