"""The raw UCT PUT attacker (tests/uct_put.c) for tests: built once per session against the libucx wheel's headers and
libraries, and run as the caller, as another uid, and/or inside another network namespace.

    build_uct_put() -> str
        The attacker binary's path (compiled on first use, then cached for the session). It lies in a private, world-
        readable temporary directory beside copies of the UCX libraries it needs (libuct, libucs, libucm; found through
        an $ORIGIN rpath), so any uid can run it even where the wheel sits in a home other users cannot enter. Skips
        the calling test (pytest.skip, with the reason) where libucx, its headers or a C compiler is missing.

    uct_put(host, port, address, data, *, user=None, netns=None, timeout=10, device=None) -> subprocess.CompletedProcess
        PUTs `data` (bytes) to `address` (an int: an address in the process that owns the UCT tcp iface listening on
        host:port). `user`: run as that uid (an int, or a user name), with that user's primary group (the uid itself
        as gid for a uid no user has) and no supplementary groups. `netns`: run inside that network namespace (a name
        for `ip netns exec`, or a path such as /proc/PID/ns/net or /run/netns/NAME for `nsenter --net=`). `timeout`:
        seconds the attacker progresses before it gives up (the process is killed 10 s after that whatever happens).
        `device`: the network device for UCT's tcp transport (default: the one that has host, or that the kernel
        routes host through, or "lo" for 127.0.0.0/8).
        The result's returncode is one of DONE, CONNECT_FAILED, PUT_FAILED, SETUP_FAILED (or TIMED_OUT: killed), and
        its stdout one line saying so ("put done: ...", "connect failed: ...", "put failed: ...", "setup failed: ...").
"""
from __future__ import annotations

import atexit
import importlib
import os
import pwd
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

import pytest

SOURCE = Path(__file__).resolve().parent / "uct_put.c"

DONE = 0            # the target acknowledged the put: the bytes are written
USAGE = 2
CONNECT_FAILED = 3  # no UCT tcp handshake completed (refused, dropped by a filter, or not a UCT tcp port)
PUT_FAILED = 4      # connected, but the put was not acknowledged in time
SETUP_FAILED = 5    # no tcp transport or no network device for the host here: nothing was tried
TIMED_OUT = -9      # killed after timeout + 10 s (uct_put.c's own alarm should have ended it before)

_LIBS = ("libuct.so.0", "libucs.so.0", "libucm.so.0")
_built: str | None = None


def _libucx_root() -> Path:
    try:
        libucx = importlib.import_module("libucx")
    except ImportError:
        pytest.skip("the UCT PUT attacker needs UCX: the libucx-cu12 wheel (pip install 'hcq[remote]') is not installed")
    return Path(str(libucx.__file__)).parent


def build_uct_put() -> str:
    """The attacker binary (see the module's docstring); built once per session."""
    global _built
    if _built is not None and os.path.exists(_built): return _built
    root = _libucx_root()
    include, lib = root / "include", root / "lib"
    for header in ("uct/api/uct.h", "ucs/async/async_fwd.h"):
        if not (include / header).exists():
            pytest.skip(f"the UCT PUT attacker needs UCX's headers, and {include / header} is missing (the libucx wheel at {root} has none)")
    for name in _LIBS:
        if not (lib / name).exists(): pytest.skip(f"the UCT PUT attacker needs {lib / name}, which the libucx wheel at {root} lacks")
    cc = next((c for c in (os.environ.get("CC"), "cc", "gcc", "clang") if c and shutil.which(c)), None)
    if cc is None: pytest.skip("the UCT PUT attacker is built at test time and needs a C compiler (cc, gcc or clang; or $CC)")
    where = tempfile.mkdtemp(prefix="hcq-uct-put-")
    atexit.register(shutil.rmtree, where, True)
    os.chmod(where, 0o755)  # (mkdtemp makes it 0700: other uids must reach the binary and the libraries)
    for name in _LIBS:
        shutil.copy(lib / name, os.path.join(where, name))  # (follows the wheel's symlinks to the real files)
        os.chmod(os.path.join(where, name), 0o755)
    out = os.path.join(where, "uct_put")
    cmd = [cc, "-std=c11", "-O1", "-Wall", "-o", out, str(SOURCE), f"-I{include}", f"-L{lib}", "-Wl,-rpath,$ORIGIN", "-luct", "-lucs"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        raise AssertionError(f"building the UCT PUT attacker failed ({' '.join(cmd)}):\n{r.stdout}{r.stderr}")
    os.chmod(out, stat.S_IRWXU | stat.S_IRGRP | stat.S_IXGRP | stat.S_IROTH | stat.S_IXOTH)
    _built = out
    return out


def _ids(user: int | str) -> tuple[int, int]:
    """(uid, gid) for a uid or a user name: the user's primary group, or the uid itself where no user has it."""
    if isinstance(user, str):
        pw = pwd.getpwnam(user)
        return pw.pw_uid, pw.pw_gid
    try:
        return user, pwd.getpwuid(user).pw_gid
    except KeyError:
        return user, user


def uct_put(host: str, port: int, address: int, data: bytes, *, user: int | str | None = None, netns: str | None = None,
            timeout: float = 10, device: str | None = None) -> subprocess.CompletedProcess:
    """Write `data` at `address` in the process listening (UCT tcp) on host:port: see the module's docstring."""
    binary = build_uct_put()
    argv = [binary, "-t", f"{timeout:g}", *(["-d", device] if device else []), host, str(int(port)), hex(address), data.hex()]
    kw: dict = {}
    if user is not None:
        uid, gid = _ids(user)
        if netns is not None:  # entering the namespace takes root: drop to the uid after it, in the namespace
            if shutil.which("setpriv") is None: pytest.skip("running the attacker as another uid in a network namespace needs setpriv (util-linux)")
            argv = ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups", "--inh-caps=-all", *argv]
        else:
            kw = {"user": uid, "group": gid, "extra_groups": []}
    if netns is not None:
        if netns.startswith("/"):
            if shutil.which("nsenter") is None: pytest.skip("entering a network namespace by path needs nsenter (util-linux)")
            argv = ["nsenter", f"--net={netns}", "--", *argv]
        else:
            if shutil.which("ip") is None: pytest.skip("entering a named network namespace needs iproute2's ip")
            argv = ["ip", "netns", "exec", netns, *argv]
    env = {k: v for k, v in os.environ.items() if not k.startswith("UCX_")}  # (the target's settings are not the attacker's)
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout + 10, env=env, cwd="/", **kw)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        err = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
        return subprocess.CompletedProcess(argv, TIMED_OUT, out + f"timed out: killed after {timeout + 10:g} s\n", err)
