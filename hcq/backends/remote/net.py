"""The network engine of remote devices: net.c (plain C over UCX's UCP API) built with the machine's C compiler on
first use, cached on disk, and loaded through ctypes, plus a thin Pythonic wrapper.

An engine is a UCP context, a worker and a progress thread. A client engine (`NetEngine()`) connects out; a server
engine (`NetEngine(listen="127.0.0.1", port=0)`) also accepts connections. On a connection (`Conn`): requests with
replies, one-way messages, puts, gets, 64-bit atomic stores, fences and flushes into memory the peer registered with
`mem_map`. Messages that reach a server go to `next()` (or to a C handler set with `set_handler`, run without
Python). Every call releases the GIL while it waits; no call touches the caller's buffer after it returns.

UCX comes from the libucx-cu12 wheel: `pip install 'hcq[remote]'`."""
from __future__ import annotations

import ctypes
import functools
import importlib
import mmap
import os
import threading
import weakref
from pathlib import Path
from typing import Any, Union

from hcq import packet_queue, packets
from hcq.backends.remote import protocol
from hcq.errors import DeviceError, HCQError, HCQTimeoutError
from hcq.helpers import getenv
from hcq.toolchain import build_shared_object, inline_include

NET_SOURCE = Path(__file__).with_name("net.c")
# The remote server's C handlers (serve.c) use net.c's functions directly, so they are compiled into the same
# library, after net.c, when they are there.
SERVE_SOURCE = Path(__file__).with_name("serve.c")
NET_FLAGS = ("-O2", "-std=c11", "-pthread", "-fvisibility=hidden")
INSTALL_HINT = "pip install 'hcq[remote]' (the libucx-cu12 wheel)"

ETIMEDOUT, EDEAD, EFAIL = -1, -2, -3  # net.c's return codes (hn_next: EDEAD = engine closed, EFAIL = a closed event)
HN_RMA = 1  # hn_create's flag for one-sided operations
DEFAULT_TIMEOUT_MS = 30_000
CONNECT_TIMEOUT_MS = 10_000
DEFAULT_REPLY_CAP = 64 << 20  # the largest reply request() takes by default (virtual memory, touched as used)
RKEY_CAP = 4096  # room for a packed remote key

Buffer = Union[bytes, bytearray, memoryview, mmap.mmap, "ctypes.Array[Any]"]
Local = Union[int, Buffer]  # a local address, or a buffer whose memory is used


class PeerLostError(DeviceError):
    """The connection is dead: its peer died or closed it, or it was closed here. Sticky for that connection."""


def _libucx_dir() -> str:
    """The libucx wheel's directory, with its libraries loaded; HCQError naming the install command without it.
    UCX's memory events are off unless the environment asks for them (UCX_MEM_EVENTS): installing their hooks is most of
    what loading UCX costs (0.4 s of every client's and server worker's start, against 3 ms), and hcq needs none of what
    they serve: it registers memory explicitly, and without events UCX keeps no registration cache that could go stale."""
    try:
        libucx = importlib.import_module("libucx")
    except ImportError as e:
        raise HCQError(f"remote devices need UCX, which is not installed: {INSTALL_HINT}") from e
    os.environ.setdefault("UCX_MEM_EVENTS", "no")  # (read by libucs as it loads)
    libucx.load_library()
    root = os.path.dirname(str(libucx.__file__))
    if not os.path.exists(os.path.join(root, "lib", "libucp.so")):
        raise HCQError(f"the libucx package at {root} has no lib/libucp.so; reinstall it: {INSTALL_HINT}")
    return root


def net_source() -> str:
    """net.c, followed by serve.c when it exists (with #line markers so compiler messages name the right file)."""
    net = inline_include(NET_SOURCE.read_text(), "relax.h", packets.RELAX_HEADER.read_text(), NET_SOURCE.name)
    parts = [f'#line 1 "{NET_SOURCE.name}"\n' + net]
    if SERVE_SOURCE.exists():
        serve = inline_include(SERVE_SOURCE.read_text(), "hcq_shared.h", packet_queue.c_header(), SERVE_SOURCE.name)
        serve = inline_include(serve, "hcq_protocol.h", protocol.c_header(), SERVE_SOURCE.name)
        parts.append(f'#line 1 "{SERVE_SOURCE.name}"\n' + serve)
    return "\n".join(parts)


def net_flags(ucx_root: str) -> tuple[str, ...]:
    """Compiler flags: UCX's headers and libraries (found at run time through an rpath)."""
    lib = os.path.join(ucx_root, "lib")
    return (*NET_FLAGS, f"-I{os.path.join(ucx_root, 'include')}", f"-L{lib}", f"-Wl,-rpath,{lib}", "-Wl,--no-as-needed", "-lucp", "-lucs")


@functools.lru_cache(maxsize=None)
def net_lib() -> ctypes.CDLL:
    """The network engine library (built on first use), with the hn_* signatures declared."""
    root = _libucx_dir()
    lib = ctypes.CDLL(str(build_shared_object(net_source(), net_flags(root), "hcq-net")))
    vp, cp, i32, i64, u32, u64 = ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int, ctypes.c_int64, ctypes.c_uint32, ctypes.c_uint64
    pi32, pu64 = ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_uint64)
    sigs: dict[str, tuple[Any, list[Any]]] = {
        "hn_create": (vp, [cp, i32, i32, cp, i32]),
        "hn_set_preauth": (None, [vp, u64, i32, i32, i32]),
        "hn_set_liveness": (None, [vp, i32]),
        "hn_authenticate": (i32, [vp, i32]),
        "hn_preauth_expire": (i32, [vp]),
        "hn_port": (i32, [vp]),
        "hn_listen": (i32, [vp, cp, i32, cp, i32]),
        "hn_destroy": (None, [vp]),
        "hn_connect": (i32, [vp, cp, i32, i32, cp, i32]),
        "hn_alive": (i32, [vp, i32]),
        "hn_conn_error": (i32, [vp, i32, cp, i32]),
        "hn_conn_peer": (i32, [vp, i32, cp, i32]),
        "hn_conn_transports": (i32, [vp, i32, cp, i32]),
        "hn_conn_count": (i32, [vp]),
        "hn_close": (i32, [vp, i32, i32]),
        "hn_mem_map": (i32, [vp, u64, u64, vp, i32]),
        "hn_mem_unmap": (i32, [vp, u64]),
        "hn_rkey": (i32, [vp, i32, vp, i32]),
        "hn_rkey_release": (None, [vp, i32]),
        "hn_put": (i32, [vp, i32, vp, u64, i32, u64, i32]),
        "hn_put_nb": (i32, [vp, i32, vp, u64, i32, u64]),
        "hn_fence": (i32, [vp]),
        "hn_store64": (i32, [vp, i32, u64, i32, u64]),
        "hn_flush": (i32, [vp, i32, i32]),
        "hn_get": (i32, [vp, i32, vp, u64, i32, u64, i32]),
        "hn_request": (i64, [vp, i32, vp, u64, vp, u64, i32]),
        "hn_send": (i32, [vp, i32, vp, u64]),
        "hn_place": (i32, [vp, i32, u64, vp, u64, i32]),
        "hn_set_placer": (None, [vp, vp, vp]),
        "hn_next": (i64, [vp, i32, pi32, pu64, vp, u64]),
        "hn_reply": (i32, [vp, i32, u64, vp, u64]),
        "hn_set_handler": (None, [vp, u32, vp, vp]),
        "hn_last_error": (cp, []),
        "hn_counter": (u64, [vp, i32]),
        "hn_counter_name": (cp, [i32]),
        "hn_inflight": (i64, [vp]),
        "hn_wait_ge64": (i32, [vp, vp, u64, i32]),
        "hn_lend": (i32, [vp, i32, i64]),
        "hn_store_local64": (None, [vp, u64]),
        "hn_wake_local64": (None, [vp, u64]),
        "hn_set_sleep_word": (None, [vp, vp]),
        "hn_set_waker": (None, [vp]),
        # serve.c (built into the same library): the mirror and ring tables, the hook and the handlers
        "hs_create": (vp, [vp, vp, vp, vp]),
        "hs_destroy": (None, [vp]),
        "hs_mirror_add": (i32, [vp, u64, u64, i32, u64]),
        "hs_mirror_add_shared": (i32, [vp, u64, u64, i32, u64, u64, vp]),
        "hs_conn_set_shared": (i32, [vp, i32]),
        "hs_mirror_remove": (i32, [vp, u64]),
        "hs_ring_add": (i32, [vp, vp, i32]),
        "hs_ring_remove": (None, [vp, i32]),
        "hs_conn_remove": (i32, [vp, i32]),
        "hs_place_add": (i32, [vp, u64, u64, i32]),
        "hs_place_remove": (i32, [vp, u64]),
        "hs_forward_add": (i32, [vp, u64, u64, vp, i32, u64, i32, u32, i32]),
        "hs_forward_remove": (i32, [vp, u64, u64]),
        "hs_accept_add": (i32, [vp, u64, u64, i32, i32, u32]),
        "hs_set_poison": (None, [vp, vp]),
        "hs_accept_remove_range": (i32, [vp, u64, u64]),
        "hs_store_hook": (None, [vp, u64, u64, u32, u64]),
        "hs_push_now": (None, [vp, u64, u64, u32]),
        "hs_idle_hook": (i32, [vp, i32, i64]),
        "hs_exec_create": (vp, [vp, i32, vp]),
        "hs_exec_state": (i32, [vp]),
        "hs_exec_close": (None, [vp, i32]),
        "hs_exec_free": (None, [vp]),
        "hs_exec_ring": (vp, [vp, u32]),
        "hs_exec_range_add": (i32, [vp, u64, u64, u64, i32]),
        "hs_exec_range_remove": (None, [vp, u64]),
        "hs_exec_kargs": (i32, [vp, u64, u64]),
        "hs_exec_submit": (i32, [vp, vp, u64, i64]),
    }
    for name, (res, args) in sigs.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = res, args
    return lib


def last_error() -> str:
    """What the last failed hn_* call of this thread said."""
    return (net_lib().hn_last_error() or b"").decode(errors="replace")


def _raise(code: int, what: str = "") -> None:
    """Raise the exception for a negative return code of net.c (its message from hn_last_error)."""
    msg = last_error() or what or f"network engine error {code}"
    if code == ETIMEDOUT: raise HCQTimeoutError(msg)
    if code == EDEAD: raise PeerLostError(msg)
    raise HCQError(msg)


def _check(rc: int) -> int:
    if rc < 0: _raise(rc)
    return rc


def _span(local: Local, length: int | None, writable: bool = False) -> tuple[Any, int]:
    """_pointer for RMA: an address needs an explicit length; a buffer's length defaults to its size."""
    ptr, n = _pointer(local, writable)
    if length is None:
        if isinstance(local, int): raise ValueError("a length is needed with a local address")
        return ptr, n
    if length < 0 or (not isinstance(local, int) and length > n): raise ValueError(f"length {length} is outside the buffer ({n} bytes)")
    return ptr, int(length)


def _pointer(data: Local | None, writable: bool = False) -> tuple[Any, int]:
    """(what ctypes passes as a void*, the byte count) for an address or a buffer; the first item keeps the buffer's
    memory alive for the call. bytes are passed without a copy (read-only uses only)."""
    if data is None: return None, 0
    if isinstance(data, int): return data, 0
    if isinstance(data, bytes) and not writable: return data, len(data)
    if isinstance(data, ctypes.Array): return ctypes.addressof(data), ctypes.sizeof(data)
    view = memoryview(data).cast("B")
    n = view.nbytes
    if view.readonly:
        if writable: raise TypeError("a writable buffer is needed here")
        return bytes(view), n
    return (ctypes.c_char * n).from_buffer(view) if n else None, n


class _Scratch(threading.local):
    """A per-thread receive buffer (anonymous pages: untouched room costs nothing), grown on demand."""

    def __init__(self) -> None:
        self.size = 0
        self.window: Any = None
        self.addr = 0

    def room(self, n: int) -> int:
        if n > self.size:
            size = max(n, 1 << 16)
            mm = mmap.mmap(-1, size)
            self.window = (ctypes.c_char * size).from_buffer(mm)  # keeps the pages alive
            self.size, self.addr = size, ctypes.addressof(self.window)
        return self.addr


_scratch = _Scratch()


class NetEngine:
    """A network engine: a client (`listen=None`) or a server listening on `listen:port` (port 0: any free one). With
    `rma=False` it has no one-sided operations: no peer can put, get or store into this process (puts, gets and
    store64 here raise), and messages are all there is."""

    def __init__(self, listen: str | None = None, port: int = 0, *, rma: bool = False) -> None:
        self.lib = net_lib()
        err = ctypes.create_string_buffer(512)
        h = self.lib.hn_create(listen.encode() if listen is not None else None, int(port), HN_RMA if rma else 0, err, len(err))
        if not h:
            where = f" on {listen}:{port}" if listen is not None else ""
            raise HCQError(f"cannot start the network engine{where}: {err.value.decode(errors='replace')}")
        self._h: int | None = h
        self.listen, self.rma = listen, rma
        self.set_dead_after(getenv("HCQ_REMOTE_DEAD_S", 2.0, lo=0))
        self.port = int(self.lib.hn_port(h)) if listen is not None else 0
        self._finalizer = weakref.finalize(self, self.lib.hn_destroy, h)

    def start_listening(self, ip: str, port: int = 0) -> int:
        """Start accepting connections on ip:port (port 0: any free one) in an engine made without `listen` (a server
        that nobody may reach until then); returns the port."""
        err = ctypes.create_string_buffer(512)
        port = self.lib.hn_listen(self.handle, ip.encode(), int(port), err, len(err))
        if port < 0: raise HCQError(f"cannot listen on {ip}: {err.value.decode(errors='replace')}")
        self.listen, self.port = ip, int(port)
        return self.port

    @classmethod
    def create(cls, listen: str | None = None, port: int = 0, *, rma: bool = False) -> NetEngine:
        """The same as NetEngine(listen, port, rma=rma)."""
        return cls(listen, port, rma=rma)

    def set_dead_after(self, seconds: float) -> None:
        """Fail a connection from which nothing came for `seconds` (probes go out after a quarter of that); 0: never.
        Default HCQ_REMOTE_DEAD_S, 2 s: a peer behind a link that went down is noticed where TCP stays silent."""
        if seconds < 0: raise ValueError(f"dead time must be >= 0 s, got {seconds}")
        self.lib.hn_set_liveness(self.handle, int(seconds * 1000))

    # ---- strangers (a server's connections before they authenticate)
    def limit_strangers(self, max_bytes: int = 16 << 10, max_messages: int = 8, max_connections: int = 64, deadline_ms: int = 5000) -> None:
        """From now on an accepted connection is a stranger until `authenticate(conn)`: it may send at most
        `max_messages` messages of at most `max_bytes` (more, or a larger one, closes it unread), none reaches a C
        handler, at most `max_connections` strangers are accepted at a time, and `expire_strangers()` closes those
        older than `deadline_ms`. Enforced in the engine, before Python sees anything."""
        self.lib.hn_set_preauth(self.handle, int(max_bytes), int(max_messages), int(max_connections), int(deadline_ms))

    def authenticate(self, conn: int) -> None:
        """Trust connection `conn` (it proved who it is)."""
        _check(self.lib.hn_authenticate(self.handle, int(conn)))

    def expire_strangers(self) -> int:
        """Close the strangers whose time to authenticate is up; how many were closed."""
        return int(self.lib.hn_preauth_expire(self.handle))

    @property
    def handle(self) -> int:
        """The engine's C handle (void *), for C code that calls hn_* itself."""
        if self._h is None: raise HCQError("the network engine is closed")
        return self._h

    @property
    def closed(self) -> bool:
        return self._h is None

    def close(self) -> None:
        """Flush and close every connection (bounded waits: dead peers do not hold it up), stop the progress thread
        and free the engine. Idempotent."""
        if self._h is None: return
        self._h = None
        self._finalizer()

    def __enter__(self) -> NetEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        where = f"listening on {self.listen}:{self.port}" if self.listen is not None else "client"
        return f"<NetEngine {where}{' closed' if self.closed else ''}>"

    # ---- connections
    def connect(self, ip: str, port: int, timeout_ms: int = CONNECT_TIMEOUT_MS) -> Conn:
        """Connect to the engine listening at ip:port; returns once the connection is wired up (a handshake)."""
        err = ctypes.create_string_buffer(512)
        cid = self.lib.hn_connect(self.handle, ip.encode(), int(port), int(timeout_ms), err, len(err))
        if cid < 0:
            msg = err.value.decode(errors="replace") or f"connect to {ip}:{port} failed"
            raise HCQTimeoutError(msg) if cid == ETIMEDOUT else HCQError(msg)
        return Conn(self, cid, f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}")

    def conn(self, conn_id: int) -> Conn:
        """The connection `conn_id` (e.g. one a server accepted, as next() reports it)."""
        buf = ctypes.create_string_buffer(128)
        if self.lib.hn_conn_peer(self.handle, int(conn_id), buf, len(buf)) < 0: raise HCQError(f"no connection {conn_id}")
        return Conn(self, int(conn_id), buf.value.decode(errors="replace"))

    def connection_count(self) -> int:
        """Live connections."""
        return int(self.lib.hn_conn_count(self.handle))

    # ---- memory
    def mem_map(self, addr: int, length: int) -> bytes:
        """Register [addr, addr + length) of this process for remote access; returns its packed remote key (for the
        peer's `Conn.rkey`)."""
        out = ctypes.create_string_buffer(RKEY_CAP)
        n = _check(self.lib.hn_mem_map(self.handle, int(addr), int(length), out, RKEY_CAP))
        return out.raw[:n]

    def mem_unmap(self, addr: int) -> None:
        """Unregister the range mem_map registered at addr."""
        _check(self.lib.hn_mem_unmap(self.handle, int(addr)))

    def rkey(self, conn: int, packed: bytes) -> int:
        """Unpack a peer's remote key for use on connection `conn`; returns its id."""
        return _check(self.lib.hn_rkey(self.handle, int(conn), packed, len(packed)))

    def rkey_release(self, rkey: int) -> None:
        self.lib.hn_rkey_release(self.handle, int(rkey))

    def fence(self) -> None:
        """Order the puts and atomics issued before (on any connection) before those issued after."""
        _check(self.lib.hn_fence(self.handle))

    # ---- messages (server side)
    def next(self, timeout_ms: int = -1) -> tuple[int, int, bytes] | tuple[str, int] | None:
        """The next message: (conn, req_id, bytes) (req_id 0: one-way, else answer it with reply()), or
        ("closed", conn) when a connection died or was closed, or None after timeout_ms (-1: no timeout)."""
        h = self.handle
        conn, req_id = ctypes.c_int(-1), ctypes.c_uint64(0)
        cap = max(_scratch.size, 1 << 20)
        while True:
            addr = _scratch.room(cap)
            n = self.lib.hn_next(h, int(timeout_ms), ctypes.byref(conn), ctypes.byref(req_id), addr, _scratch.size)
            if n == ETIMEDOUT: return None
            if n == EFAIL: return ("closed", conn.value)
            if n == EDEAD: raise HCQError("the network engine is closed")
            if n <= _scratch.size: return (conn.value, req_id.value, ctypes.string_at(addr, n))
            cap = n  # did not fit: nothing was taken; again with room for it

    def reply(self, conn: int, req_id: int, data: Buffer) -> None:
        """Answer request req_id of connection conn."""
        ptr, n = _pointer(data)
        _check(self.lib.hn_reply(self.handle, int(conn), int(req_id), ptr, n))

    def set_handler(self, msg_type: int, fn: int | None, ctx: int | None = 0) -> None:
        """Messages whose first u32 is msg_type go to the C function at address fn (hn_handler_fn: int64_t
        fn(void *ctx, int conn, const void *msg, uint64_t len, void *reply, uint64_t cap), returning the reply's length
        or a negative error), called on the thread that progresses the engine, without Python. fn None: back to
        next()."""
        self.lib.hn_set_handler(self.handle, int(msg_type), fn, ctx)

    def set_placer(self, fn: int | None, ctx: int | None = 0) -> None:
        """Who may write where in this process with `Conn.place`: the C function at address fn (hn_placer_fn: int
        fn(void *ctx, int conn, uint64_t addr, uint64_t len, int done), 0 to allow), called inside UCX's callbacks.
        None: nobody (a placement then fails its connection). Set it before peers connect."""
        self.lib.hn_set_placer(self.handle, fn, ctx)

    def counters(self) -> dict[str, int]:
        """The engine's statistics (messages in, handled in C, sent at once / copied / zero-copy, wakeups, ...)."""
        out, i = {}, 0
        while (name := self.lib.hn_counter_name(i)) is not None:
            out[name.decode()] = int(self.lib.hn_counter(self.handle, i))
            i += 1
        out["inflight"] = int(self.lib.hn_inflight(self.handle))
        return out


class Conn:
    """One connection of a NetEngine. Operations on a dead connection raise PeerLostError at once."""

    def __init__(self, engine: NetEngine, conn_id: int, peer: str):
        self.engine, self.id, self.peer = engine, conn_id, peer

    def __repr__(self) -> str:
        return f"<Conn {self.id} to {self.peer}{'' if self.alive else ' (dead)'}>"

    @property
    def _h(self) -> int:
        return self.engine.handle

    @property
    def alive(self) -> bool:
        """True until the peer died or closed the connection (or it was closed here)."""
        return not self.engine.closed and bool(self.engine.lib.hn_alive(self._h, self.id))

    @property
    def error(self) -> str:
        """Why the connection died ("" while it is alive)."""
        if self.engine.closed: return "the network engine is closed"
        buf = ctypes.create_string_buffer(512)
        self.engine.lib.hn_conn_error(self._h, self.id, buf, len(buf))
        return buf.value.decode(errors="replace")

    @property
    def transports(self) -> str:
        """The UCX transports and devices the connection uses, e.g. "tcp/lo;cma/memory"."""
        buf = ctypes.create_string_buffer(1024)
        _check(self.engine.lib.hn_conn_transports(self._h, self.id, buf, len(buf)))
        return buf.value.decode(errors="replace")

    def close(self, timeout_ms: int = 1000) -> None:
        """Close the connection (after flushing it, for at most timeout_ms); the peer sees it closed."""
        if not self.engine.closed: _check(self.engine.lib.hn_close(self._h, self.id, int(timeout_ms)))

    # ---- remote memory
    def rkey(self, packed: bytes) -> int:
        """Unpack the peer's remote key (from its mem_map) for this connection; returns its id."""
        return self.engine.rkey(self.id, packed)

    def rkey_release(self, rkey: int) -> None:
        self.engine.rkey_release(rkey)

    def put(self, local: Local, remote: int, rkey: int, length: int | None = None, wait_remote_ms: int = 0) -> None:
        """Write length bytes from local into the peer's memory at remote. Returns once local may be reused; with
        wait_remote_ms > 0, once the data is in the peer's memory (or HCQTimeoutError after that many ms)."""
        ptr, n = _span(local, length)
        _check(self.engine.lib.hn_put(self._h, self.id, ptr, int(remote), int(rkey), n, int(wait_remote_ms)))

    def put_nb(self, local: Local, remote: int, rkey: int, length: int | None = None) -> None:
        """A put that does not wait for the peer; local may change as soon as this returns."""
        ptr, n = _span(local, length)
        _check(self.engine.lib.hn_put_nb(self._h, self.id, ptr, int(remote), int(rkey), n))

    def store64(self, remote: int, rkey: int, value: int) -> None:
        """A 64-bit atomic store into the peer's memory (8-byte aligned); ordered after earlier puts only after a
        fence()."""
        _check(self.engine.lib.hn_store64(self._h, self.id, int(remote), int(rkey), int(value) & (2**64 - 1)))

    def fence(self) -> None:
        self.engine.fence()

    def flush(self, timeout_ms: int = DEFAULT_TIMEOUT_MS) -> None:
        """Wait until everything issued on this connection is complete in the peer's memory."""
        _check(self.engine.lib.hn_flush(self._h, self.id, int(timeout_ms)))

    def get(self, local: Local, remote: int, rkey: int, length: int | None = None, timeout_ms: int = DEFAULT_TIMEOUT_MS) -> None:
        """Read length bytes of the peer's memory at remote into local (an address or a writable buffer)."""
        ptr, n = _span(local, length, writable=True)
        _check(self.engine.lib.hn_get(self._h, self.id, ptr, int(remote), int(rkey), n, int(timeout_ms)))

    # ---- messages
    def request(self, data: Buffer, timeout_ms: int = DEFAULT_TIMEOUT_MS, reply_cap: int = DEFAULT_REPLY_CAP) -> bytes:
        """Send data and wait for the reply (HCQTimeoutError after timeout_ms, PeerLostError when the connection
        dies meanwhile). A reply longer than reply_cap raises HCQError."""
        ptr, n = _pointer(data)
        addr = _scratch.room(reply_cap)
        got = self.engine.lib.hn_request(self._h, self.id, ptr, n, addr, reply_cap, int(timeout_ms))
        if got < 0: _raise(got)
        if got > reply_cap: raise HCQError(f"request to {self.peer}: the reply has {got} bytes, more than reply_cap={reply_cap}")
        return ctypes.string_at(addr, got)

    def request_into(self, data: Buffer, out: Local, length: int | None = None, timeout_ms: int = DEFAULT_TIMEOUT_MS) -> int:
        """Send data and put the reply into out (a writable buffer, or an address with length; truncated to its size;
        a large reply that fits is received there directly); returns the reply's full length."""
        ptr, n = _pointer(data)
        optr, cap = _span(out, length, writable=True)
        got = self.engine.lib.hn_request(self._h, self.id, ptr, n, optr, cap, int(timeout_ms))
        if got < 0: _raise(got)
        return int(got)

    def place(self, dest: int, local: Local, length: int | None = None, timeout_ms: int = DEFAULT_TIMEOUT_MS) -> None:
        """Write local (an address, with length, or a buffer) at address dest of the peer's process, where its placer
        allows this connection to (else the peer fails the connection). Returns once local may change: the bytes are on
        their way, ahead of anything sent on this connection after them (past timeout_ms the connection is closed
        first, and HCQTimeoutError raised)."""
        ptr, n = _span(local, length)
        _check(self.engine.lib.hn_place(self._h, self.id, int(dest), ptr, n, int(timeout_ms)))

    def send(self, data: Buffer) -> None:
        """A one-way message (the peer's next() gets it with req_id 0); data may change as soon as this returns."""
        ptr, n = _pointer(data)
        _check(self.engine.lib.hn_send(self._h, self.id, ptr, n))
