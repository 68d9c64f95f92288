"""What `hcq serve` does to its own processes so that a client's code (a kernel is arbitrary native code) reaches
nothing but its own worker (docs/design.md, "Threat model"). A worker is confined like a login session:
- its own unprivileged uid, allocated per worker from a range no user owns (`UidPool`, as systemd's DynamicUser does),
  with `no_new_privs` and an empty capability bounding set; run by an ordinary user, a user namespace instead, where
  the kernel allows one;
- its own mount, IPC and PID namespaces (`confine`): the system read-only, a private /tmp, /var/tmp, /dev/shm and /run,
  the server user's home hidden (what the interpreter and hcq need from it bound back read-only), a /proc that shows
  only the worker's own processes, and so no signal, ptrace or shared memory reaching the door or another worker;
- not dumpable, and killed with the process that started it."""
from __future__ import annotations

import ctypes
import errno
import fcntl
import grp
import os
import pwd
import random
import resource
import signal
import socket
import sys
from typing import Iterable

_libc = ctypes.CDLL(None, use_errno=True)
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_CAPBSET_DROP, PR_SET_SECUREBITS, PR_SET_NO_NEW_PRIVS = 1, 4, 24, 28, 38
PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 47, 4
# SECBIT_NOROOT, _LOCKED, SECBIT_NO_SETUID_FIXUP, _LOCKED: uid 0 gets no capabilities from exec, for good
SECURE_NOROOT = 0x01 | 0x02 | 0x04 | 0x08
CAPABILITY_VERSION_3 = 0x20080522


def _prctl(option: int, arg: int = 0) -> None:
    if _libc.prctl(option, ctypes.c_ulong(arg), 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl({option}): {os.strerror(err)}")


def not_dumpable() -> None:
    """No core dumps, and no ptrace, /proc/PID/mem or process_vm_* access by processes without CAP_SYS_PTRACE."""
    _prctl(PR_SET_DUMPABLE, 0)


def die_with_parent() -> None:
    """SIGKILL when the process that started this one goes (a worker outlives no `hcq serve`)."""
    parent = os.getppid()
    _prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL))
    if os.getppid() != parent: os._exit(1)  # it went before the line above


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def drop_root(user: str | None) -> str:
    """As root: become `user` (no supplementary groups), or with no user, keep uid 0 without any capability (nor a way
    back through exec: the bounding set is emptied and root's exec privileges turned off). No-op for other users.
    Returns what was done, for the server's log."""
    if os.geteuid() != 0: return "runs as its user"
    if user:
        pw = pwd.getpwnam(user)
        os.setgroups([])
        os.setgid(pw.pw_gid)
        os.setuid(pw.pw_uid)  # (real, effective and saved: no way back)
        _prctl(PR_SET_NO_NEW_PRIVS, 1)
        for need in (os.path.dirname(os.__file__), os.path.dirname(os.path.dirname(__file__))):  # the standard library, hcq
            if not os.access(need, os.R_OK | os.X_OK):
                raise PermissionError(f"worker user {user!r} cannot read {need}: install Python and hcq where that user can read "
                                      "them, or leave --worker-user out")
        return f"runs as {user} (uid {pw.pw_uid})"
    try:
        _prctl(PR_SET_SECUREBITS, SECURE_NOROOT)
        _prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL)
        _drop_capabilities()
    except OSError as e:  # (a sandbox that forbids it: say so rather than fail every worker)
        return f"runs as root WITH its capabilities: dropping them failed ({e}); name --worker-user"
    return "runs as root without capabilities"


def _drop_capabilities() -> None:
    _drop_bounding_set()
    header, data = _CapHeader(CAPABILITY_VERSION_3, 0), (_CapData * 2)()
    if _libc.capset(ctypes.byref(header), data) != 0:
        raise OSError(ctypes.get_errno(), f"capset: {os.strerror(ctypes.get_errno())}")
    _prctl(PR_SET_NO_NEW_PRIVS, 1)


def capabilities() -> int:
    """This process's effective capabilities (a bit mask), from /proc/self/status."""
    with open("/proc/self/status") as f:
        return next(int(ln.split()[1], 16) for ln in f if ln.startswith("CapEff:"))


# ---- confinement: namespaces, a private file system view, an unprivileged uid
CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWPID, CLONE_NEWUSER = 0x00020000, 0x08000000, 0x20000000, 0x10000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_MOVE, MS_REC, MS_PRIVATE = 1, 2, 4, 8, 32, 4096, 8192, 16384, 1 << 18
# (the same numbers on x86-64 and in the generic table that arm64 uses)
SYS_OPEN_TREE, SYS_MOVE_MOUNT, SYS_MOUNT_SETATTR = 428, 429, 442
AT_FDCWD, AT_RECURSIVE, OPEN_TREE_CLONE, O_CLOEXEC, MOVE_MOUNT_F_EMPTY_PATH, MOUNT_ATTR_RDONLY = -100, 0x8000, 1, 0o2000000, 0x4, 0x1
UID_RANGE = (61184, 65519)  # the range systemd gives DynamicUser services: no user of the system owns one
PRIVATE_DIRS = ("/tmp", "/var/tmp", "/dev/shm", "/run")  # replaced by empty, private ones
# ...of these sizes (a worker fills no more of the host's memory through them; the home is only paths to what is kept)
_TMPFS = {"/tmp": "mode=1777,size=25%", "/var/tmp": "mode=1777,size=64m", "/dev/shm": "mode=1777,size=64m", "/run": "mode=0755,size=16m"}
_host_pid = 0  # this worker's pid as the rest of the host sees it (set by confine: inside its namespace it is 1)
# (a confined worker) its end of a socket pair with its stand-in, which attaches port filters for it (see portfilter)
port_filter_channel: socket.socket | None = None


class _MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64), ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    enc = lambda v: None if v is None else v.encode()  # noqa: E731
    _check(_libc.mount(enc(source), target.encode(), enc(fstype), ctypes.c_ulong(flags), enc(data)), f"mount {target}")


def host_pid() -> int:
    """This process's pid as the host sees it (a confined worker is pid 1 of its own PID namespace)."""
    return _host_pid or os.getpid()


class UidPool:
    """Unprivileged uids for workers, one per worker, from UID_RANGE: a uid is taken while its lock file (in a root-only
    directory) is locked, so several servers on one host never hand out the same one; one a user or a process
    already has is skipped. `take` returns (uid, the lock's fd: closing it gives the uid back)."""

    def __init__(self, directory: str | None = None):
        self.directory = directory or next((d for d in ("/run/hcq-serve-uids", "/var/lock/hcq-serve-uids", "/tmp/hcq-serve-uids")
                                            if os.path.isdir(os.path.dirname(d))), "/tmp/hcq-serve-uids")
        os.makedirs(self.directory, mode=0o700, exist_ok=True)
        st = os.lstat(self.directory)
        if st.st_uid != 0 or st.st_mode & 0o077 or not os.path.isdir(self.directory):
            raise PermissionError(f"{self.directory} must be a directory only root can use (it holds the locks of workers' uids)")

    def take(self) -> tuple[int, int]:
        low, high = UID_RANGE
        busy = _uids_in_use()
        start = random.randrange(high - low + 1)
        for i in range(high - low + 1):
            uid = low + (start + i) % (high - low + 1)
            if uid in busy or _named(uid): continue
            fd = os.open(os.path.join(self.directory, str(uid)), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            return uid, fd
        raise OSError(errno.EAGAIN, f"every uid in {low}-{high} is in use by a worker")


def _named(uid: int) -> bool:
    """Whether a user or a group of the system has this number (a worker's uid is its gid too)."""
    for lookup in (pwd.getpwuid, grp.getgrgid):
        try:
            lookup(uid)
            return True
        except KeyError:
            pass
    return False


def _uids_in_use() -> set[int]:
    """The real uids of the host's processes (a uid a process still has is not handed out, whoever left it)."""
    out = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            out.add(os.stat(f"/proc/{pid}").st_uid)
        except OSError:
            pass
    return out


def _namespace_flags() -> int:
    return CLONE_NEWNS | CLONE_NEWIPC | CLONE_NEWPID | (0 if os.geteuid() == 0 else CLONE_NEWUSER)


def can_confine() -> bool:
    """Whether this process may make the namespaces a confined worker needs (as an ordinary user: whether the kernel
    allows unprivileged user namespaces)."""
    pid = os.fork()
    if pid == 0: os._exit(0 if _libc.unshare(_namespace_flags()) == 0 else 1)
    return os.waitpid(pid, 0)[1] == 0


def confine(uid: int | None, keep: Iterable[str], guard: int = -1) -> str:
    """Confine this process (a worker, not yet threaded) and return what was done, for the server's log.

    In new mount, IPC and PID namespaces (and, run by an ordinary user, a user namespace): this process forks, and
    stays behind as a stand-in (it reports the worker's pid on stdout as "pid N", passes SIGTERM/SIGINT on and exits
    with the worker's status) while the child, pid 1 of the new PID namespace, goes on as the worker: the system
    read-only, PRIVATE_DIRS and the server user's home replaced by empty ones, the directories of `keep` that lay in
    them put back read-only, a /proc of its own; then, as root, uid `uid` (no groups, no capabilities,
    no_new_privs); as an ordinary user, no capabilities in its user namespace. `guard` (a root server's): the fd of the
    connect guard's map of allowances (connectguard), which only the stand-in keeps."""
    global _host_pid, port_filter_channel
    import threading
    if threading.active_count() > 1: raise RuntimeError("confine() must run before any thread starts (it forks)")
    root = os.geteuid() == 0
    outer_uid, outer_gid = os.geteuid(), os.getegid()
    home = os.path.realpath(pwd.getpwuid(outer_uid).pw_dir if root else os.path.expanduser("~"))
    _check(_libc.unshare(_namespace_flags()), "unshare")
    if not root:  # (/proc/self's files belong to root while this process is not dumpable: it may not write its maps then)
        _prctl(PR_SET_DUMPABLE, 1)
        _map_own_ids(outer_uid, outer_gid)
        not_dumpable()
    sys.stdout.flush()
    sys.stderr.flush()
    worker_end, stand_in_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    child = os.fork()
    if child:
        worker_end.close()
        _stand_in(child, stand_in_end, guard, -1 if uid is None else uid)
    if guard >= 0: os.close(guard)  # (a worker holding it could let anyone in)
    stand_in_end.close()
    port_filter_channel = worker_end
    _host_pid = int(os.readlink("/proc/self"))  # (the host's /proc still: its pid there)
    die_with_parent()
    hidden = _private_file_system(home if home not in ("/", "") else None, keep)
    os.chdir("/")
    if root:
        if uid is None: raise ValueError("a root server's confined worker needs a uid")
        _drop_bounding_set()
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)  # (capabilities go with uid 0)
        _prctl(PR_SET_NO_NEW_PRIVS, 1)
        _prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL))  # (a change of uid cleared it)
        limit = max(1024, 16 * (os.cpu_count() or 1))  # (threads count too: a device's queue and worker threads)
        resource.setrlimit(resource.RLIMIT_NPROC, (limit, limit))  # (per uid, and the uid is this worker's alone: no fork bomb)
        how = f"runs as uid {uid}"
    else:
        _prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL)
        _drop_capabilities()
        how = f"runs as {pwd.getpwuid(outer_uid).pw_name} in a user namespace"
    _forbid_user_namespaces()
    not_dumpable()
    return f"{how}, in namespaces of its own (system read-only, private /tmp{', ' + hidden + ' hidden' if hidden else ''})"


# seccomp: no new user namespace (the usual way from an unprivileged process to capabilities over fresh namespaces,
# and so to the kernel's less trodden code); clone3 says ENOSYS, so that libc falls back to clone, whose flags a filter
# can read. Calls of another ABI (32-bit, x32) are refused outright.
_ARCH = {"x86_64": (0xC000003E, 272, 56, 435), "aarch64": (0xC00000B7, 97, 220, 435)}  # audit arch; unshare, clone, clone3
SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 0x7FFF0000, 0x00050000, 22, 2


def _forbid_user_namespaces() -> None:
    """A seccomp filter (this thread and every one it starts after; needs no_new_privs): unshare and clone with
    CLONE_NEWUSER fail with EPERM, clone3 with ENOSYS, any call of another ABI with EPERM."""
    machine = os.uname().machine
    if machine not in _ARCH: raise OSError(errno.ENOSYS, f"no seccomp filter for {machine}: cannot forbid user namespaces")
    from hcq.backends.remote.portfilter import BPF_ABS, BPF_JEQ, BPF_JGE, BPF_JMP, BPF_JSET, BPF_K, BPF_LD, BPF_RET, BPF_W, sock_fprog
    arch, unshare, clone, clone3 = _ARCH[machine]
    ld, ret = BPF_LD | BPF_W | BPF_ABS, BPF_RET | BPF_K
    jeq, jge, jset = BPF_JMP | BPF_JEQ | BPF_K, BPF_JMP | BPF_JGE | BPF_K, BPF_JMP | BPF_JSET | BPF_K
    eperm, enosys = SECCOMP_RET_ERRNO | errno.EPERM, SECCOMP_RET_ERRNO | errno.ENOSYS
    program = [
        (ld, 0, 0, 4), (jeq, 1, 0, arch), (ret, 0, 0, eperm),    # 0-2: the ABI
        (ld, 0, 0, 0), (jge, 6, 0, 0x40000000),                  # 3-4: the call (x32's carry this bit: refused, at 11)
        (jeq, 3, 0, unshare), (jeq, 2, 0, clone), (jeq, 5, 0, clone3), (ret, 0, 0, SECCOMP_RET_ALLOW),  # 5-8
        (ld, 0, 0, 16), (jset, 0, 1, CLONE_NEWUSER), (ret, 0, 0, eperm), (ret, 0, 0, SECCOMP_RET_ALLOW),  # 9-12: its flags
        (ret, 0, 0, enosys)]                                      # 13: clone3
    prog, _insns = sock_fprog(program)  # (_insns stays alive across the call: the kernel copies it)
    _check(_libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0), "seccomp")


def _map_own_ids(uid: int, gid: int) -> None:
    """In a new user namespace, be the same uid and gid as outside (the only mapping an ordinary user may make)."""
    for path, text in (("/proc/self/uid_map", f"{uid} {uid} 1"), ("/proc/self/setgroups", "deny"), ("/proc/self/gid_map", f"{gid} {gid} 1")):
        with open(path, "w") as f: f.write(text)


def _stand_in(child: int, port_filters: socket.socket, guard: int, uid: int) -> None:
    """The process the door started, once the worker forked off into its PID namespace: it says the worker's pid, hands
    the door's signals on and ends with the worker's status. It keeps no end of the door's pipes (the door sees the
    worker's output end when the worker's does). Until the worker's end of `port_filters` closes (it exited), it attaches
    the port filters the worker asks for there (on current kernels that takes a capability this process has and the
    worker has not: see portfilter), and lets the local users it names connect to the ports of `uid` (its own, in the
    connect guard's map `guard`: see connectguard). (It cannot start a thread: its PID namespace is not its children's.)"""
    from hcq.backends.remote.portfilter import serve_attach

    def pass_on(sig: int, _frame: object) -> None:
        try:
            os.kill(child, sig)
        except ProcessLookupError:
            pass
    passed = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
    for sig in passed: signal.signal(sig, pass_on)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, passed)  # (the worker blocked SIGTERM across the fork: passed on from now on)
    os.write(1, f"pid {child}\n".encode())
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    serve_attach(port_filters, guard, uid)
    port_filters.close()
    try:
        _, status = os.waitpid(child, 0)
    except ChildProcessError:
        os._exit(1)
    os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status))


def _private_file_system(home: str | None, keep: Iterable[str]) -> str:
    """The mount namespace's view (see `confine`); returns the hidden home, or "" when none was."""
    _mount(None, "/", None, MS_REC | MS_PRIVATE)  # (nothing of what follows reaches the host's mounts)
    _read_only("/")
    private = [d for d in PRIVATE_DIRS if os.path.isdir(d)]
    within_private = home and any(home == d or _below(home, d) for d in private)  # (covered with them already)
    hidden = home if home and os.path.isdir(home) and not within_private else ""
    covered = private + ([hidden] if hidden else [])
    # What the worker needs from the covered directories (Python in root's home, a checkout in /tmp...), taken as
    # detached copies of their (read-only) mounts before the tmpfs goes over them, then put back where they were.
    clones = [(_clone_tree(path), path) for path in _within(covered, keep)]
    for d in covered: _mount("tmpfs", d, "tmpfs", MS_NOSUID | MS_NODEV, _TMPFS.get(d, "mode=0755,size=1m"))
    for fd, path in clones:
        os.makedirs(path, mode=0o755, exist_ok=True)
        try:
            _check(_libc.syscall(SYS_MOVE_MOUNT, fd, b"", AT_FDCWD, path.encode(), MOVE_MOUNT_F_EMPTY_PATH), f"move_mount {path}")
        finally:
            os.close(fd)
    if hidden: _mount(None, hidden, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    try:  # (fails closed: the host's /proc would show the processes of the server user, and a way back through /proc/PID/root)
        _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    except OSError as e:
        raise OSError(e.errno, f"cannot mount a /proc of the worker's own ({e.strerror}; a container that masks parts of /proc "
                      "forbids it in a user namespace: run hcq serve as root there)") from None
    return hidden


def _clone_tree(path: str) -> int:
    """A detached copy of the mounts at and below `path` (open_tree, Linux 5.2), as an fd for move_mount."""
    fd = _libc.syscall(SYS_OPEN_TREE, AT_FDCWD, path.encode(), OPEN_TREE_CLONE | O_CLOEXEC | AT_RECURSIVE)
    if fd < 0: _check(-1, f"open_tree {path}")
    return int(fd)


def _within(covered: list[str], keep: Iterable[str]) -> list[str]:
    """The existing directories of `keep` inside one of `covered`, none inside another."""
    dirs = sorted({os.path.realpath(p) for p in keep if p and os.path.isdir(p)})
    inside = [d for d in dirs if any(_below(d, c) for c in covered)]
    return [d for d in inside if not any(_below(d, o) for o in inside)]


def _below(path: str, directory: str) -> bool:
    """Whether `path` lies strictly inside `directory` (both absolute)."""
    return path != directory and path.startswith(directory.rstrip("/") + "/")


def _read_only(path: str) -> None:
    """Every mount at and below `path` read-only (mount_setattr, Linux 5.12; else each mount remounted)."""
    attr = _MountAttr(MOUNT_ATTR_RDONLY, 0, 0, 0)
    if _libc.syscall(SYS_MOUNT_SETATTR, AT_FDCWD, path.encode(), AT_RECURSIVE, ctypes.byref(attr), ctypes.sizeof(attr)) == 0: return
    if ctypes.get_errno() not in (errno.ENOSYS, errno.EINVAL): _check(-1, "mount_setattr")
    with open("/proc/self/mountinfo") as f:
        mounts = [ln.split() for ln in f]
    flag_of = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC}
    for cols in sorted(mounts, key=lambda c: len(c[4])):
        point = cols[4].encode().decode("unicode_escape")
        if not (point == path or _below(point, path)): continue
        keep_flags = sum(flag_of.get(o, 0) for o in cols[5].split(","))  # (a locked flag must be kept)
        try:
            _mount(None, point, None, MS_BIND | MS_REMOUNT | MS_RDONLY | keep_flags)
        except OSError:
            if point == path: raise


def _drop_bounding_set() -> None:
    """Every capability the kernel knows out of the bounding set (none can come back through exec)."""
    cap = 0
    while _libc.prctl(PR_CAPBSET_DROP, ctypes.c_ulong(cap), 0, 0, 0) == 0: cap += 1
    if ctypes.get_errno() != errno.EINVAL: _check(-1, f"prctl(PR_CAPBSET_DROP, {cap})")  # (EINVAL: past the last one)
