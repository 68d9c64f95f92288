"""Which local users may open a TCP connection to a worker (docs/design.md, "Threat model": "Where a worker is
reachable"): the kernel checks every connect() on the host against the sockets workers listen on.

The port filter (portfilter) passes a worker's connections only from its client's address. Every user of the host has
the host's addresses, though: a client on 127.0.0.1 shares its address with every other local user, each of whom could
then complete UCT's tcp handshake with the worker and write into its memory with a raw PUT frame. So a root server
attaches cgroup BPF programs to the root of the cgroup v2 hierarchy (every process of the host runs them):

- sock-create: a TCP socket made by a process whose uid is a worker's (in WORKERS) carries that uid as its owner
  (OWNERS, socket storage: it lives and dies with the socket, so no entry outlives its socket), from before it can
  bind or listen: no connection to a worker's socket ever exists that was not checked. A socket that cannot be marked
  is refused (socket() fails with EPERM): the guard fails closed.
- connect (IPv4, and IPv6 for IPv4-mapped addresses): the kernel looks up the socket the connection would reach in
  the caller's network namespace (bpf_sk_lookup_tcp); if it is a worker's, the connect() is refused with EPERM (no SYN
  is sent) unless the caller is root, the owner itself, or a uid in ALLOWED for that owner: its client's (the door
  finds it from the client's own connection, `local_peer_uid`) and those of the workers its client linked it with.
  A remote client's uid is not known: no local user is let in for it.

The programs are held by BPF links the door owns: they go away with the door (whose workers go with it too). The door
adds a worker's uid before the worker starts and removes the uid and its allowances when it ends; a worker's stand-in
(root) adds the uids its worker's client names (`allow_uids`: for that worker's own uid only, which the stand-in knows;
the worker never holds the map). Needs root, a kernel with cgroup BPF, BPF links and socket storage for these
programs (Linux 5.10 or later) and cgroup v2 (mounted here briefly if the host has none mounted). A program attached
lower in the cgroup tree with BPF_F_ALLOW_OVERRIDE (root's doing) would take the guard out for that subtree.
"""
from __future__ import annotations

import ctypes
import errno
import os
import platform
import socket
import struct
import tempfile
from typing import Any, Iterable

# bpf(2) commands, map and program types, attach types (<linux/bpf.h>)
MAP_CREATE, MAP_LOOKUP, MAP_UPDATE, MAP_DELETE, MAP_NEXT_KEY, PROG_LOAD, BTF_LOAD, LINK_CREATE = 0, 1, 2, 3, 4, 5, 18, 28
MAP_HASH, MAP_SK_STORAGE, F_NO_PREALLOC, SK_STORAGE_CREATE = 1, 24, 1, 1
PROG_CGROUP_SOCK, PROG_CGROUP_SOCK_ADDR = 9, 18
SOCK_CREATE, INET4_CONNECT, INET6_CONNECT = 2, 10, 11
HELPER_MAP_LOOKUP, HELPER_UID_GID, HELPER_SK_LOOKUP_TCP, HELPER_SK_RELEASE, HELPER_SK_STORAGE_GET = 1, 15, 84, 86, 107
_SYSCALL = {"x86_64": 321, "aarch64": 280}
ENTRIES = 1 << 16  # entries each map holds
_libc = ctypes.CDLL(None, use_errno=True)

# eBPF instruction classes and fields (<linux/bpf_common.h>, <linux/bpf.h>)
LDX_W, STX_W, ST_W = 0x61, 0x63, 0x62
MOV64_X, MOV64_K, ADD64_K, LSH64_K, MOV32_X = 0xBF, 0xB7, 0x07, 0x67, 0xBC
JEQ_K, JNE_K, JNE32_K, JEQ_X, CALL, EXIT, LD_IMM64 = 0x15, 0x55, 0x56, 0x1D, 0x85, 0x95, 0x18
PSEUDO_MAP_FD = 1
R0, R1, R2, R3, R4, R5, R6, R7, R8, R9, FP = 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10

Insn = tuple[int, int, int, int, int]  # (code, dst, src, off, imm)
Asm = list[tuple[Any, ...]]  # instructions whose jump offsets may be label names, and ("label",) markers


def _bpf(cmd: int, attr: bytes) -> int:
    """bpf(2); OSError (with the errno) on failure."""
    number = _SYSCALL.get(platform.machine())
    if number is None: raise OSError(errno.ENOSYS, f"no bpf syscall number known for {platform.machine()}")
    buf = ctypes.create_string_buffer(attr, max(len(attr), 128))
    ret = _libc.syscall(number, cmd, buf, len(buf))
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return int(ret)


def _encode(prog: list[Insn]) -> bytes:
    return b"".join(struct.pack("<BBhi", code, dst | (src << 4), off, imm - (1 << 32) if imm >= 1 << 31 else imm) for code, dst, src, off, imm in prog)


def _load_map(dst: int, fd: int) -> list[Insn]:
    """dst = the map of `fd` (a 64-bit immediate load: two instructions)."""
    return [(LD_IMM64, dst, PSEUDO_MAP_FD, 0, fd), (0, 0, 0, 0, 0)]


def _lookup(fd: int, key_at: int) -> list[Insn]:
    """r0 = the value of the map of `fd` at the key on the stack at fp + `key_at` (NULL: none)."""
    return [*_load_map(R1, fd), (MOV64_X, R2, FP, 0, 0), (ADD64_K, R2, 0, 0, key_at), (CALL, 0, 0, 0, HELPER_MAP_LOOKUP)]


def connect_program(owners: int, allowed: int, ip_offset: int, v4_mapped: bool) -> list[Insn]:
    """The connect check (module docstring): ctx is a struct bpf_sock_addr, the destination's IPv4 address at
    `ip_offset` (user_ip4, or the last word of user_ip6 when `v4_mapped`: then only an IPv4-mapped address is checked).
    Stack: fp-16 the lookup's struct bpf_sock_tuple (saddr 0, daddr, sport 0, dport), fp-24 ALLOWED key (owner, caller).
    r6 ctx, r7 the caller's uid, r8 the socket found, r9 its owner."""
    head: Asm = [(MOV64_X, R6, R1, 0, 0)]
    if v4_mapped:  # ::ffff:a.b.c.d: words 0 and 1 zero, word 2 0x0000ffff in network order; other IPv6: not ours
        head += [(LDX_W, R2, R6, 8, 0), (JNE_K, R2, 0, "allow", 0), (LDX_W, R2, R6, 12, 0), (JNE_K, R2, 0, "allow", 0),
                 (LDX_W, R2, R6, 16, 0), (JNE32_K, R2, 0, "allow", socket.htonl(0xFFFF))]
    body: Asm = [
        (CALL, 0, 0, 0, HELPER_UID_GID), (MOV32_X, R0, R0, 0, 0), (MOV64_X, R7, R0, 0, 0),
        (JEQ_K, R7, 0, "allow", 0),                                   # root
        (ST_W, FP, 0, -16, 0), (LDX_W, R2, R6, ip_offset, 0), (STX_W, FP, R2, -12, 0),
        (LDX_W, R2, R6, 24, 0), (LSH64_K, R2, 0, 0, 16), (STX_W, FP, R2, -8, 0),   # user_port (network order) as dport
        (MOV64_X, R1, R6, 0, 0), (MOV64_X, R2, FP, 0, 0), (ADD64_K, R2, 0, 0, -16), (MOV64_K, R3, 0, 0, 12),
        (MOV64_K, R4, 0, 0, -1), (MOV64_K, R5, 0, 0, 0), (CALL, 0, 0, 0, HELPER_SK_LOOKUP_TCP),   # (BPF_F_CURRENT_NETNS)
        (JEQ_K, R0, 0, "allow", 0),                                   # nobody listens there
        (MOV64_X, R8, R0, 0, 0),
        *_load_map(R1, owners), (MOV64_X, R2, R8, 0, 0), (MOV64_K, R3, 0, 0, 0), (MOV64_K, R4, 0, 0, 0),
        (CALL, 0, 0, 0, HELPER_SK_STORAGE_GET),
        (MOV64_K, R9, 0, 0, -1), (JEQ_K, R0, 0, "release", 0), (LDX_W, R9, R0, 0, 0),
        ("release",),
        (MOV64_X, R1, R8, 0, 0), (CALL, 0, 0, 0, HELPER_SK_RELEASE),
        (JEQ_K, R9, 0, "allow", -1),                                  # not a worker's socket
        (JEQ_X, R9, R7, "allow", 0),                                  # the owner itself
        (STX_W, FP, R9, -24, 0), (STX_W, FP, R7, -20, 0),
        *_lookup(allowed, -24),
        (JNE_K, R0, 0, "allow", 0),
        (MOV64_K, R0, 0, 0, 0), (EXIT, 0, 0, 0, 0),                   # refused: connect() fails with EPERM
        ("allow",),
        (MOV64_K, R0, 0, 0, 1), (EXIT, 0, 0, 0, 0)]
    return _resolve(head + body)


def sock_create_program(owners: int, workers: int) -> list[Insn]:
    """The marking (module docstring): ctx is a struct bpf_sock (type at 8); a TCP socket a worker's uid makes gets its
    owner in OWNERS, for as long as the socket lives. Stack: fp-4 the uid (WORKERS key, and the storage's first value)."""
    return _resolve([
        (MOV64_X, R6, R1, 0, 0),
        (LDX_W, R2, R6, 8, 0), (JNE_K, R2, 0, "done", socket.SOCK_STREAM),
        (CALL, 0, 0, 0, HELPER_UID_GID), (MOV32_X, R0, R0, 0, 0), (STX_W, FP, R0, -4, 0),
        *_lookup(workers, -4),
        (JEQ_K, R0, 0, "done", 0),                                    # not a worker's
        *_load_map(R1, owners), (MOV64_X, R2, R6, 0, 0), (MOV64_X, R3, FP, 0, 0), (ADD64_K, R3, 0, 0, -4),
        (MOV64_K, R4, 0, 0, SK_STORAGE_CREATE), (CALL, 0, 0, 0, HELPER_SK_STORAGE_GET),
        (JNE_K, R0, 0, "done", 0),
        (MOV64_K, R0, 0, 0, 0), (EXIT, 0, 0, 0, 0),                   # not marked: socket() fails (closed, not open)
        ("done",),
        (MOV64_K, R0, 0, 0, 1), (EXIT, 0, 0, 0, 0)])


def _resolve(prog: Asm) -> list[Insn]:
    """Replace ("label",) markers and jump offsets given as label names by instruction offsets."""
    out: Asm = []
    labels: dict[str, int] = {}
    for insn in prog:
        if len(insn) == 1: labels[insn[0]] = len(out)
        else: out.append(insn)
    return [(c, d, s, labels[o] - i - 1 if isinstance(o, str) else o, k) for i, (c, d, s, o, k) in enumerate(out)]


def _map_create(key_size: int, value_size: int, entries: int) -> int:
    return _bpf(MAP_CREATE, struct.pack("<IIIII", MAP_HASH, key_size, value_size, entries, 0))


def _int_btf() -> int:
    """A BTF object with one type, id 1: a 32-bit int (socket storage maps must name their key and value types)."""
    strings = b"\0int\0"
    types = struct.pack("<III", 1, 1 << 24, 4) + struct.pack("<I", (1 << 24) | 32)  # name "int", kind INT, size 4; signed, 32 bits
    header = struct.pack("<HBBIIIII", 0xEB9F, 1, 0, 24, 0, len(types), len(types), len(strings))
    blob = ctypes.create_string_buffer(header + types + strings)
    return _bpf(BTF_LOAD, struct.pack("<QQIII", ctypes.addressof(blob), 0, len(blob) - 1, 0, 0))


def _owners_map(btf: int) -> int:
    """A socket storage map: a u32 (the owning worker's uid) on each socket that has one; it goes with the socket."""
    return _bpf(MAP_CREATE, struct.pack("<IIIIIII16sIIII", MAP_SK_STORAGE, 4, 4, 0, F_NO_PREALLOC, 0, 0, b"hcq_owners", 0, btf, 1, 1))


def _prog_load(prog_type: int, attach_type: int, prog: list[Insn], name: bytes) -> int:
    code = ctypes.create_string_buffer(_encode(prog))
    license = ctypes.create_string_buffer(b"GPL")
    log = ctypes.create_string_buffer(1 << 16)
    attr = struct.pack("<IIQQIIQII16sII", prog_type, len(prog), ctypes.addressof(code), ctypes.addressof(license),
                       1, len(log), ctypes.addressof(log), 0, 0, name[:15], 0, attach_type)
    try:
        return _bpf(PROG_LOAD, attr)
    except OSError as e:
        raise OSError(e.errno, f"the kernel refused the {name.decode()} program: {e.strerror}: {log.value.decode(errors='replace')[-500:]}") from None


def _map_call(cmd: int, fd: int, key: bytes | None, value: ctypes.Array | None = None) -> None:
    """A map command on key `key` (None: the first, for MAP_NEXT_KEY) and value (or next key) buffer `value`."""
    k = ctypes.create_string_buffer(key, len(key)) if key is not None else None
    _bpf(cmd, struct.pack("<IIQQQ", fd, 0, ctypes.addressof(k) if k is not None else 0, ctypes.addressof(value) if value is not None else 0, 0))


def map_update(fd: int, key: bytes, value: bytes) -> None:
    _map_call(MAP_UPDATE, fd, key, ctypes.create_string_buffer(value, len(value)))


def map_delete(fd: int, key: bytes) -> None:
    try:
        _map_call(MAP_DELETE, fd, key)
    except FileNotFoundError:
        pass


def map_keys(fd: int, key_size: int) -> list[bytes]:
    """Every key of the map (a snapshot)."""
    keys: list[bytes] = []
    nxt = ctypes.create_string_buffer(key_size)
    while len(keys) < 4 * ENTRIES:
        try:
            _map_call(MAP_NEXT_KEY, fd, keys[-1] if keys else None, nxt)
        except FileNotFoundError:
            break
        keys.append(nxt.raw)
    return keys


def _u32(value: int) -> bytes:
    return struct.pack("<I", value & 0xFFFFFFFF)


def allow_uids(allowed_fd: int, owner: int, uids: Iterable[int]) -> None:
    """(A worker's stand-in) Let `uids` connect to the ports of the worker whose uid is `owner`."""
    for uid in uids: map_update(allowed_fd, _u32(owner) + _u32(int(uid)), _u32(1))


def _cgroup2_root() -> int:
    """An fd of the root of the cgroup v2 hierarchy: from a cgroup2 mount whose root is "/", else mounted for a moment."""
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            sep = fields.index("-")
            if fields[sep + 1] == "cgroup2" and fields[3] == "/": return os.open(fields[4], os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    where = tempfile.mkdtemp(prefix="hcq-cgroup2-")
    try:
        if _libc.mount(b"cgroup2", where.encode(), b"cgroup2", 0, None) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"cannot mount cgroup2: {os.strerror(err)}")
        try:
            return os.open(where, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        finally:
            _libc.umount2(where.encode(), 2)  # MNT_DETACH (the fd keeps the cgroup)
    finally:
        os.rmdir(where)


class ConnectGuard:
    """The maps and attached programs of the module docstring, owned by a root server's door (close(): all detached)."""

    def __init__(self) -> None:
        if os.geteuid() != 0: raise PermissionError("only root can guard workers' ports by user")
        self._fds: list[int] = []
        try:
            self.owners = self._keep(_owners_map(self._keep(_int_btf())))  # socket -> its worker's uid
            self.workers = self._keep(_map_create(4, 4, ENTRIES))   # uid -> 1
            self.allowed = self._keep(_map_create(8, 4, ENTRIES))   # (owner, uid) -> 1
            progs = [(PROG_CGROUP_SOCK, SOCK_CREATE, sock_create_program(self.owners, self.workers), b"hcq_sock_create"),
                     (PROG_CGROUP_SOCK_ADDR, INET4_CONNECT, connect_program(self.owners, self.allowed, 4, False), b"hcq_connect4"),
                     (PROG_CGROUP_SOCK_ADDR, INET6_CONNECT, connect_program(self.owners, self.allowed, 20, True), b"hcq_connect6")]
            cgroup = self._keep(_cgroup2_root())
            for prog_type, attach, prog, name in progs:
                fd = self._keep(_prog_load(prog_type, attach, prog, name))
                self._keep(_bpf(LINK_CREATE, struct.pack("<IIII", fd, cgroup, attach, 0)))
        except BaseException:
            self.close()
            raise

    def _keep(self, fd: int) -> int:
        os.set_inheritable(fd, False)
        self._fds.append(fd)
        return fd

    def add_worker(self, uid: int) -> None:
        """From now on, TCP ports `uid` binds are guarded (before the worker starts)."""
        map_update(self.workers, _u32(uid), _u32(1))

    def allow(self, owner: int, uids: Iterable[int]) -> None:
        allow_uids(self.allowed, owner, uids)

    def remove_worker(self, uid: int) -> None:
        """The worker of `uid` ended: its uid and every allowance to or from it go (its sockets went with it)."""
        map_delete(self.workers, _u32(uid))
        for key in map_keys(self.allowed, 8):
            if _u32(uid) in (key[:4], key[4:]): map_delete(self.allowed, key)

    def close(self) -> None:
        for fd in reversed(self._fds):
            try:
                os.close(fd)
            except OSError:
                pass
        self._fds = []


def local_peer_uid(sock: socket.socket) -> int | None:
    """The uid owning the other end of TCP connection `sock`, when that end is a socket of this host's network
    namespace (the client is a local user); None when it is not (a remote client) or cannot be told."""
    try:
        here, peer = sock.getsockname()[:2], sock.getpeername()[:2]
    except OSError:
        return None
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f: rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if len(fields) > 7 and _endpoint(fields[1]) == peer and _endpoint(fields[2]) == here: return int(fields[7])
    return None


def _endpoint(text: str) -> tuple[str, int] | None:
    """/proc/net/tcp's "ADDR:PORT" (hex, the address in host-order words) as (IPv4 literal, port); IPv4-mapped IPv6 too."""
    addr, _, port = text.partition(":")
    try:
        raw = bytes.fromhex(addr)
        words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4)) if socket.htonl(1) != 1 else raw
        if len(words) == 16:
            if words[:12] != b"\0" * 10 + b"\xff\xff": return None
            words = words[12:]
        return socket.inet_ntoa(words), int(port, 16)
    except (ValueError, OSError):
        return None
