"""Who may open a TCP connection to this process: a source-address filter, enforced by the kernel, on every listening
TCP socket of a worker (docs/design.md, "Threat model": "Where a worker is reachable").

UCX's tcp transport executes a raw PUT frame (a write to any address in the process) from any peer that completes
UCT's tcp handshake on one of the process's ports, whatever the receiver's settings. So a worker attaches a classic
BPF socket filter to each of its listening TCP sockets (UCT's tcp interface ports, from the moment its UCX worker
exists, and the UCP listener once it has one) that passes packets only from the addresses allowed to reach it: its
client's, and those of the servers its client announced links with. A SYN from any other address is dropped by the
kernel, so no connection, and no UCX frame, ever comes from there. Connections accepted on a listening socket inherit
its filter. A connection that completed its handshake before the filter was attached is shut down by `apply`'s sweep.

Since Linux commit 5d39580f68e6 attaching a filter to a TCP socket needs CAP_NET_ADMIN (over the socket's
network namespace), which a confined worker does not have. So a confined worker hands its listening sockets (SCM_RIGHTS,
over a socket pair made before it forked) to its stand-in, the process the door started, which attaches the filter
(`serve_attach`): run by root, it has that capability. Otherwise (an older kernel, or no stand-in) a worker attaches
the filter itself, where the kernel lets it.

It also says which addresses `hcq serve` takes at all (`ipv4_addresses`: IPv4 only, NO_IPV6 says why).
"""
from __future__ import annotations

import ctypes
import ipaddress
import json
import os
import socket
import threading
import time
from typing import Iterable

from hcq.backends.remote.connectguard import allow_uids  # (here: a stand-in imports nothing once its worker changes the mounts)

SO_ATTACH_FILTER = 26  # <asm-generic/socket.h> (Python's socket module does not name it)
SKF_NET_OFF = -0x100000  # a BPF load at SKF_NET_OFF + n reads byte n of the network (IP) header
BPF_LD, BPF_ALU, BPF_JMP, BPF_RET = 0x00, 0x04, 0x05, 0x06
BPF_W, BPF_B, BPF_ABS, BPF_K = 0x00, 0x10, 0x20, 0x00
BPF_AND, BPF_JA, BPF_JEQ, BPF_JGE, BPF_JSET = 0x50, 0x00, 0x10, 0x30, 0x40
ACCEPT, DROP = 0xFFFFFFFF, 0  # a socket filter's verdict: bytes of the packet to keep (all of it, or none)
MAX_ALLOWED = 1024  # addresses one filter holds (about 1,040 instructions; the kernel takes up to 4,096)
CHUNK = 254  # addresses compared before a jump to the chunk's ACCEPT (a conditional jump reaches at most 255 ahead)

Insn = tuple[int, int, int, int]  # (code, jt, jf, k): one struct sock_filter


class _SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_uint16), ("filter", ctypes.POINTER(_SockFilter))]


def ipv4(address: str) -> str:
    """`address` as an IPv4 literal; ValueError for anything else (a name, IPv6): a filter holds addresses, never names."""
    return str(ipaddress.IPv4Address(str(address).strip()))


NO_IPV6 = ("IPv6 is not supported: a stranger's connection to a worker listening on IPv6 can corrupt the worker's memory "
           "(a UCX defect), and such workers would listen on every interface. Listen on an IPv4 address instead (127.0.0.1, "
           "this host's IPv4 address, or 0.0.0.0 for all of them)")


def ipv4_addresses(host: str) -> list[str]:
    """The IPv4 addresses `host` names (where the door and its workers listen); ValueError for an IPv6 address, or a
    name with IPv6 addresses only (NO_IPV6 says why)."""
    bare = host.strip("[]").split("%")[0]
    if ":" in bare: raise ValueError(f"hcq serve: cannot listen on {host}: {NO_IPV6}")
    try:
        return list(dict.fromkeys(str(ai[4][0]) for ai in socket.getaddrinfo(bare, None, family=socket.AF_INET, type=socket.SOCK_STREAM)))
    except socket.gaierror as e:
        try:
            v6 = bool(socket.getaddrinfo(bare, None, family=socket.AF_INET6, type=socket.SOCK_STREAM))
        except socket.gaierror:
            v6 = False
        raise ValueError(f"hcq serve: cannot listen on {host}: {NO_IPV6 if v6 else e}") from None


def resolve_ipv4(host: str) -> list[str]:
    """The IPv4 addresses `host` (a name or a literal) resolves to here; [] when it resolves to none."""
    try:
        return ipv4_addresses(host)
    except (ValueError, UnicodeError):
        return []


def program(allowed: Iterable[str]) -> list[Insn]:
    """The classic BPF program that passes IPv4 packets from `allowed` (IPv4 literals) and drops every other packet
    (IPv6 ones too; on a dual-stack socket an IPv4 client's packets are IPv4). No address: drop everything."""
    keys = sorted({int(ipaddress.IPv4Address(ipv4(a))) for a in allowed})
    if not keys: return [(BPF_RET | BPF_K, 0, 0, DROP)]
    if len(keys) > MAX_ALLOWED: raise ValueError(f"a port filter holds at most {MAX_ALLOWED} addresses, not {len(keys)}")
    prog: list[Insn] = [
        (BPF_LD | BPF_B | BPF_ABS, 0, 0, (SKF_NET_OFF + 0) & 0xFFFFFFFF),  # the IP version, in the first byte's high nibble
        (BPF_ALU | BPF_AND | BPF_K, 0, 0, 0xF0),
        (BPF_JMP | BPF_JEQ | BPF_K, 1, 0, 0x40),  # IPv4: on; else the drop below
        (BPF_RET | BPF_K, 0, 0, DROP),
        (BPF_LD | BPF_W | BPF_ABS, 0, 0, (SKF_NET_OFF + 12) & 0xFFFFFFFF),  # the source address (host order, as the keys)
    ]
    for start in range(0, len(keys), CHUNK):
        chunk = keys[start:start + CHUNK]
        # each compare jumps to the chunk's ACCEPT on a match; past the chunk, "ja 1" skips that ACCEPT
        prog += [(BPF_JMP | BPF_JEQ | BPF_K, len(chunk) - i, 0, key) for i, key in enumerate(chunk)]
        prog += [(BPF_JMP | BPF_JA, 0, 0, 1), (BPF_RET | BPF_K, 0, 0, ACCEPT)]
    return prog + [(BPF_RET | BPF_K, 0, 0, DROP)]


def sock_fprog(prog: list[Insn]) -> tuple[ctypes.Structure, ctypes.Array]:
    """`prog` as the struct sock_fprog the kernel takes (socket filters, seccomp), with the instruction array it points
    to (keep both alive until the kernel copied them)."""
    insns = (_SockFilter * len(prog))(*(_SockFilter(*insn) for insn in prog))
    return _SockFprog(len(prog), insns), insns


def attach(sock: socket.socket, prog: list[Insn]) -> None:
    """Attach `prog` to `sock` (SO_ATTACH_FILTER); it replaces the socket's filter, if any, atomically."""
    fprog, _insns = sock_fprog(prog)
    sock.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER, bytes(fprog))  # (_insns stays alive across the call: the kernel copies it)


def _attach_via(channel: socket.socket, socks: list[socket.socket], allowed: set[str], uids: set[int]) -> None:
    """Have the stand-in at the other end of `channel` let `uids` connect (connectguard) and attach the filter of
    `allowed` to `socks` (see `serve_attach`)."""
    message = json.dumps({"addresses": sorted(allowed), "uids": sorted(uids)}).encode()
    socket.send_fds(channel, [message], [s.fileno() for s in socks])
    reply = channel.recv(4096)
    if reply != b"ok": raise OSError(reply.decode(errors="replace") or "the stand-in that attaches port filters is gone")


def serve_attach(channel: socket.socket, guard: int = -1, owner: int = -1) -> None:
    """(A confined worker's stand-in, until the worker is gone) Let the uids the worker names connect to the ports of
    uid `owner` (the worker's: the uid is this process's to say, not the worker's), in the connect guard's map of
    allowances `guard` (connectguard; -1: none), then attach to the listening TCP sockets the worker sends (SCM_RIGHTS)
    the filter of the addresses it names ({"addresses": [...], "uids": [...]}); answer "ok" or the error. It does
    nothing else with them: other sockets are closed untouched."""
    while True:
        try:
            msg, fds, _, _ = socket.recv_fds(channel, 1 << 16, 16)
        except OSError:
            return
        if not msg and not fds: return  # (the worker is gone)
        reply = b"ok"
        try:
            request = json.loads(msg)
            uids = [int(u) for u in request["uids"]][:MAX_ALLOWED]
            if uids and guard >= 0: allow_uids(guard, owner, uids)
            prog = program(request["addresses"])
            for i, fd in enumerate(fds):
                fds[i] = -1
                try:
                    sock = socket.socket(fileno=fd)
                except OSError:
                    os.close(fd)
                    continue
                with sock:
                    if sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM and _listens(sock): attach(sock, prog)
        except Exception as e:  # noqa: BLE001 - whatever the worker sent (it runs a client's code), this process goes on
            reply = f"cannot attach the port filter: {type(e).__name__}: {e}".encode()[:4096]
        finally:
            for fd in fds:
                if fd >= 0: os.close(fd)
        try:
            channel.send(reply)
        except OSError:
            return


def _tcp_sockets() -> list[socket.socket]:
    """A handle (a dup: close it) on each TCP socket of this process."""
    out = []
    for name in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{name}").startswith("socket:["): continue
            fd = os.dup(int(name))
        except (OSError, ValueError):
            continue  # (closed meanwhile)
        try:
            sock = socket.socket(fileno=fd)  # (the same kernel socket; its family and type are read from it)
        except OSError:
            os.close(fd)
            continue
        if sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM: out.append(sock)
        else: sock.close()
    return out


def _listens(sock: socket.socket) -> bool:
    try:
        return sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) != 0
    except OSError:
        return False


def _peer_ipv4(sock: socket.socket) -> str | None:
    """The IPv4 address of `sock`'s peer (an IPv4-mapped IPv6 one unmapped); None when not connected, or IPv6."""
    try:
        peer = ipaddress.ip_address(str(sock.getpeername()[0]).split("%")[0])
    except (OSError, ValueError):
        return None
    if isinstance(peer, ipaddress.IPv6Address): return str(peer.ipv4_mapped) if peer.ipv4_mapped is not None else None
    return str(peer)


def apply(allowed: Iterable[str], channel: socket.socket | None = None, skip: set[int] | None = None,
          uids: Iterable[int] = ()) -> dict[int, int]:
    """Let only `allowed` (IPv4 literals; none: nobody) open TCP connections to this process: the filter is attached to
    every listening TCP socket (by the stand-in at the other end of `channel`, when given and it can; else here), then
    every established connection to one of their ports whose peer is not allowed (it came in before the filter) is shut
    down, so its owner (UCX) sees it close. Returns {socket inode: port} of the listening sockets; those whose inode is
    in `skip` (filtered with this set already) are not attached again. `uids` (local users let in as well: a client on
    this host shares its address with every other local user) are handed to the stand-in first, sockets or not; without
    a stand-in there is no guard by user (connectguard). OSError when the filter cannot be attached."""
    ok = {ipv4(a) for a in allowed}
    prog = program(ok)
    listening: dict[int, int] = {}
    socks = _tcp_sockets()
    try:
        todo = []
        for sock in socks:
            if _listens(sock):
                inode = os.fstat(sock.fileno()).st_ino
                listening[inode] = int(sock.getsockname()[1])
                if inode not in (skip or set()): todo.append(sock)
        by_user = set(uids)
        if (todo or by_user) and channel is not None:
            try:
                _attach_via(channel, todo, ok, by_user)
                todo = []
            except OSError:
                pass  # (then here, if this process may)
        for sock in todo: attach(sock, prog)
    finally:
        for sock in socks: sock.close()
    ports = set(listening.values())
    socks = _tcp_sockets()  # (again: a connection accepted meanwhile is among these)
    try:
        for sock in socks:
            if _listens(sock) or _peer_ipv4(sock) in ok: continue
            try:
                if int(sock.getsockname()[1]) in ports and sock.getpeername(): sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # (not connected, or gone)
    finally:
        for sock in socks: sock.close()
    return listening


class PortFilter:
    """The addresses allowed to open TCP connections to this process (none at first), applied to every listening TCP
    socket by `apply` (attached by the stand-in at the other end of `channel`, if any: see the module's docstring).
    Thread-safe: a worker's door thread, its Python thread and its link threads all allow addresses. Addresses are only
    ever added: a connection of a client or link is never cut by a later change."""

    def __init__(self, channel: socket.socket | None = None) -> None:
        self._allowed: dict[str, None] = {}
        self._uids: set[int] = set()  # local users to let in too, not yet handed to the stand-in (connectguard)
        self._lock = threading.Lock()
        self._channel = channel
        self._filtered: set[int] = set()  # inodes of the listening sockets that have the filter of the current set
        self.error: str | None = None  # why the filter could not be attached, at the last try (None: it was)

    @property
    def allowed(self) -> frozenset[str]:
        return frozenset(self._allowed)

    def allow(self, addresses: Iterable[str], uids: Iterable[int] = ()) -> None:
        """Allow `addresses` (IPv4 literals; ValueError for anything else, or past MAX_ALLOWED), and local users `uids`
        (where a stand-in guards the ports by user), from the next `apply`."""
        new = [ipv4(a) for a in addresses]
        users = {int(u) for u in uids if int(u) >= 0}
        with self._lock:
            self._uids |= users
            if len(self._allowed.keys() | set(new)) > MAX_ALLOWED:
                raise ValueError(f"this server lets at most {MAX_ALLOWED} addresses connect to it")
            if not self._allowed.keys() >= set(new): self._filtered = set()  # (attached anew at the next apply)
            self._allowed.update(dict.fromkeys(new))

    def apply(self) -> bool:
        """Attach the filter to every listening TCP socket of this process that lacks it and sweep (see `apply` above);
        False when the filter could not be attached (why: `error`; the sockets take connections from anyone then)."""
        with self._lock:
            try:
                self._filtered = set(apply(self._allowed, self._channel, self._filtered, self._uids))
                self._uids = set()
            except OSError as e:
                self.error = str(e)
                return False
            self.error = None
            return True

    def keep_applied(self, interval_s: float = 1.0) -> threading.Thread:
        """Apply again every `interval_s` on a daemon thread: a connection that completed its handshake before a filter
        was attached but was accepted after the sweep is shut down at the next pass (and a listening socket made later
        gets the filter); a pass that finds every listening socket filtered attaches nothing."""
        def run() -> None:
            while True:
                time.sleep(interval_s)
                self.apply()
        thread = threading.Thread(target=run, name="hcq-serve-portfilter", daemon=True)
        thread.start()
        return thread
