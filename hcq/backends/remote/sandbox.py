"""What `hcq serve` does to its own processes so that one client's code cannot reach another's memory through the
operating system (docs/design.md, "Threat model"): not dumpable (no ptrace, no /proc/PID/mem, no process_vm_* for
processes without CAP_SYS_PTRACE), workers die with the process that started them, and a server run as root gives its
workers up: another user's uid when one is named, else no capabilities at all (they cannot be regained through exec)."""
from __future__ import annotations

import ctypes
import os
import pwd
import signal

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
    cap = 0
    while True:  # every capability the kernel knows, out of the bounding set
        if _libc.prctl(PR_CAPBSET_DROP, ctypes.c_ulong(cap), 0, 0, 0) != 0:
            if ctypes.get_errno() == 22: break  # EINVAL: past the last one
            raise OSError(ctypes.get_errno(), f"prctl(PR_CAPBSET_DROP, {cap}): {os.strerror(ctypes.get_errno())}")
        cap += 1
    header, data = _CapHeader(CAPABILITY_VERSION_3, 0), (_CapData * 2)()
    if _libc.capset(ctypes.byref(header), data) != 0:
        raise OSError(ctypes.get_errno(), f"capset: {os.strerror(ctypes.get_errno())}")
    _prctl(PR_SET_NO_NEW_PRIVS, 1)


def capabilities() -> int:
    """This process's effective capabilities (a bit mask), from /proc/self/status."""
    with open("/proc/self/status") as f:
        return next(int(ln.split()[1], 16) for ln in f if ln.startswith("CapEff:"))
