"""A fork server for the C compiler: compile steps (`cc ... -c ...`) run forked off a compiler process that has
already started up, instead of starting the compiler anew.

A clang linked against shared LLVM libraries spends 30-40 ms of every run before main() (relocating those libraries,
running their static constructors), about half of a small kernel's compile. compile_server.c, preloaded into the
compiler, stops it just before main() and serves requests from there (see the protocol in that file). Each process
that compiles starts its own server on its first compile step and talks to it over a private socket pair; the server
exits when that process closes the socket, or after two idle minutes.

What runs is the compiler's own main() with the request's arguments, environment and working directory, so results
are those of a fresh run. Anything the server cannot serve runs the compiler directly, as before: a compiler that is
not an ELF executable (a wrapper script), one the preload does not reach (static, setuid), a request while another
thread's is in flight, a server that died. HCQ_COMPILE_SERVER=0 turns the server off."""
from __future__ import annotations

import atexit
import errno
import os
import socket
import struct
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

from hcq.helpers import env_flag, kill_process_group

ENABLE_VAR = "HCQ_COMPILE_SERVER"
SOURCE = Path(__file__).with_name("compile_server.c")
FD_VAR = "HCQ_COMPILE_SERVER_FD"
PROTOCOL = 1
HELLO, STARTED, EXITED, REFUSED = 0, 1, 2, 3
HELLO_TIMEOUT_S = 30.0
CLOSE_WAIT_S = 10.0  # how long close() waits for the killed server to be reaped
_REPLY = struct.Struct("ii")


class Unavailable(Exception):
    """The server cannot take this request (it is gone, or never started): run the compiler directly."""


class NotServed(Exception):
    """This request cannot go to the server (e.g. an environment too large for one message); the server is fine."""


class CompileServer:
    """One compiler process (`compiler`, with `shim` preloaded) waiting before main() to fork compiles on request."""

    def __init__(self, compiler: str, shim: Path, group: dict[str, Any]):
        self.compiler, self.owner = compiler, os.getpid()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        preload = " ".join(filter(None, (str(shim), os.environ.get("LD_PRELOAD"))))
        env = {**os.environ, "LD_PRELOAD": preload, FD_VAR: str(theirs.fileno())}
        try:
            self.proc = subprocess.Popen([compiler, "--version"], env=env, pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL,
                                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, **group)
        except BaseException as e:
            ours.close()
            if isinstance(e, OSError): raise NotServed(f"cannot start {compiler}: {e}") from None  # (e.g. EAGAIN: try again next time)
            raise
        finally:
            theirs.close()
        self.sock = ours
        try:
            self._hello()
        except BaseException:
            self.close()
            raise

    def _hello(self) -> None:
        self.sock.settimeout(HELLO_TIMEOUT_S)
        try:
            msg = self.sock.recv(8 + 4096)
        except OSError as e:  # (socket.timeout included)
            raise Unavailable(f"no hello from {self.compiler} ({e})") from None
        if len(msg) < _REPLY.size:  # it ran as a plain compiler: the preload did not take
            raise Unavailable(f"{self.compiler} did not load the compile server")
        kind, version = _REPLY.unpack_from(msg)
        exe = msg[_REPLY.size:].decode(errors="replace")
        if kind != HELLO or version != PROTOCOL: raise Unavailable(f"unexpected hello {kind}/{version} from {self.compiler}")
        if exe != os.path.realpath(self.compiler):  # e.g. an interpreter that runs the compiler path as a script
            raise Unavailable(f"{self.compiler} runs as {exe}")

    def run(self, cmd: list[str], timeout: float) -> tuple[int, str]:
        """(exit status, output) of compiler command `cmd`, run by the server. Past `timeout` seconds the server and
        the compile are killed and subprocess.TimeoutExpired raised; Unavailable when the server is gone."""
        deadline = time.monotonic() + timeout
        with tempfile.TemporaryFile(prefix="hcq-compile-") as out:
            try:
                payload = b"\0".join([os.fsencode(os.getcwd()), str(len(cmd)).encode(), *map(os.fsencode, cmd),
                                      *(os.fsencode(k) + b"=" + os.fsencode(v) for k, v in os.environ.items())]) + b"\0"
                try:
                    socket.send_fds(self.sock, [payload], [out.fileno()])
                except OSError as e:
                    if e.errno == errno.EMSGSIZE: raise NotServed(f"a request of {len(payload)} bytes") from None
                    raise
                kind, value = self._reply(deadline, cmd, timeout)
                if kind == REFUSED: raise Unavailable(f"request refused: {os.strerror(value)}")
                if kind != STARTED: raise Unavailable(f"unexpected reply {kind}")
                kind, status = self._reply(deadline, cmd, timeout)
                if kind != EXITED: raise Unavailable(f"unexpected reply {kind}")
            except OSError as e:  # (EPIPE, ECONNRESET: the server left; ENOENT: the working directory was removed meanwhile)
                raise Unavailable(f"{type(e).__name__}: {e}") from None
            out.seek(0)
            return os.waitstatus_to_exitcode(status), out.read().decode(errors="replace")

    def _reply(self, deadline: float, cmd: list[str], timeout: float) -> tuple[int, int]:
        self.sock.settimeout(max(deadline - time.monotonic(), 1e-3))
        try:
            msg = self.sock.recv(64)
        except socket.timeout:
            raise subprocess.TimeoutExpired(cmd, timeout) from None
        if len(msg) != _REPLY.size: raise Unavailable("the server left" if not msg else f"a reply of {len(msg)} bytes")
        kind, value = _REPLY.unpack(msg)
        return kind, value

    def close(self) -> None:
        """Stop the server and any compile it runs (the whole process group), and reap it."""
        self.sock.close()
        if self.owner != os.getpid(): return  # (a forked child's copy: the server is its parent's)
        kill_process_group(self.proc, CLOSE_WAIT_S)


_lock = threading.Lock()
_servers: dict[str, CompileServer] = {}  # compiler path -> its server in this process
_unavailable: dict[str, str] = {}  # compilers that cannot be served -> why
stats = {"started": 0, "served": 0}  # (for tests and benchmarks)


def enabled() -> bool:
    return env_flag(ENABLE_VAR, True)


def servable(cmd: list[str]) -> bool:
    """Whether `cmd` is a compile step the server may take: compiling only (-c), with an ELF executable."""
    return "-c" in cmd and cmd[0] not in _unavailable and _is_elf(cmd[0])


def _is_elf(path: str) -> bool:
    try:
        with open(path, "rb") as f: return f.read(4) == b"\x7fELF"
    except OSError:
        return False


def run(cmd: list[str], timeout: float, shim: Callable[[], Path], group: dict[str, Any]) -> tuple[int, str] | None:
    """(exit status, output) of `cmd` run by this process's server for its compiler (started on first use, preloading
    shim(); `group`: Popen's arguments for a process group of its own), or None: run it directly. Raises
    subprocess.TimeoutExpired past `timeout` seconds (the compile is killed)."""
    if not enabled() or not servable(cmd) or not _cwd_exists() or not _lock.acquire(blocking=False): return None
    try:
        server = _servers.get(cmd[0])
        try:
            if server is None:
                try:
                    path = shim()
                except Exception as e:  # (e.g. a compiler that cannot build it)
                    raise Unavailable(f"cannot build the compile server: {e}") from None
                if any(c in str(path) for c in " :"): raise Unavailable(f"LD_PRELOAD cannot name {path}")
                server = _servers[cmd[0]] = CompileServer(cmd[0], path, group)
                stats["started"] += 1
            result = server.run(cmd, timeout)
        except NotServed:
            return None
        except Unavailable as e:
            _discard(cmd[0], why_not=str(e) if server is None else None)
            return None
        except BaseException:  # timeout, Ctrl-C: the compile must not outlive the call
            _discard(cmd[0])
            raise
        stats["served"] += 1
        return result
    finally:
        _lock.release()


def _cwd_exists() -> bool:
    try:
        os.getcwd()
        return True
    except OSError:  # (removed: a compiler started directly does not mind, a forked one could not enter it)
        return False


def _discard(compiler: str, why_not: str | None = None) -> None:
    """Stop `compiler`'s server; with `why_not`, never start one for it again in this process."""
    if (server := _servers.pop(compiler, None)) is not None: server.close()
    if why_not is not None: _unavailable[compiler] = why_not


def describe(compiler: str) -> str:
    """Whether compile steps with `compiler` go to a compile server in this process, and if not, why."""
    if not enabled(): return f"off ({ENABLE_VAR}=0)"
    if compiler in _unavailable: return f"not used: {_unavailable[compiler]}"
    if not _is_elf(compiler): return f"not used: {compiler} is not an ELF executable (a wrapper script?)"
    state = f"running, {stats['served']} compile steps served" if compiler in _servers else "started by a process's first compile step"
    return f"on ({state})"


def close_all(wait_s: float = -1) -> None:
    """Stop this process's servers, waiting up to `wait_s` seconds (-1: as long as it takes) for a compile another
    thread has in flight; past that it is stopped too (that thread's compile then runs directly)."""
    held = _lock.acquire(timeout=wait_s)
    try:
        for compiler in list(_servers): _discard(compiler)
    finally:
        if held: _lock.release()


def _after_fork_in_child() -> None:
    global _lock
    _lock = threading.Lock()  # (another thread of the parent may have held it)
    for server in _servers.values(): server.sock.close()  # the parent's servers stay the parent's
    _servers.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)
atexit.register(close_all, 1.0)  # (at exit a hung compile in a daemon thread must not hold the process)
