"""A client's kernel is code: `hcq serve` runs each client's worker like a login session (issue 40, 3), and these
tests are the client that tries to get out of it. Each probe is a kernel the attacker sends, run by its worker; the
server runs as root (as the tests do), its interpreter where other users cannot read it (a venv in root's home)."""
from __future__ import annotations

import ctypes
import os
import secrets
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

pytest.importorskip("libucx", reason="remote devices need hcq[remote] (libucx-cu12)")

from test_remote import ROOT, Served, _children, _idle_worker_socket, _workers, client  # noqa: E402

ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="a root server confines its workers with uids of their own")

IPC_CREAT, IPC_RMID = 0o1000, 0
_libc = ctypes.CDLL(None, use_errno=True)


@pytest.fixture(scope="module")
def isolation_server():
    """The server these tests attack (one for the module: starting one takes seconds), its door's environment holding
    PROBE_DOOR_SECRET for the probes to look for."""
    s = Served({"PROBE_DOOR_SECRET": "1"})
    yield s
    s.close()


PROBE = r"""
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/syscall.h>
#include <stdlib.h>
#include <stdio.h>
#include <string.h>
#include <sys/ipc.h>
#include <sys/shm.h>
#include <unistd.h>
long syscall(long number, ...);
static int opens(const char *path, int flags) { int fd = open(path, flags, 0644); if (fd < 0) return 0; close(fd); return 1; }
HCQ_KERNEL void probe(long *res, int door, int shm_id) {
  res[0] = kill(door, 0) == 0;                                        /* a signal reaches the door */
  res[1] = opens("@SECRET@", O_RDONLY);                               /* reads root's 0600 file */
  res[2] = opens("@PUBLIC@", O_WRONLY | O_APPEND);                    /* appends to root's file */
  res[3] = opens("@HOST_TMP@", O_WRONLY | O_CREAT);                   /* a file in /tmp: lands in its own, not the host's */
  DIR *d = opendir("@CACHE@"); res[4] = d != 0; if (d) closedir(d);   /* the server user's compile cache */
  res[5] = opens("@CACHE@/planted.so", O_WRONLY | O_CREAT);
  void *p = shmat(shm_id, 0, 0); res[6] = p != (void *)-1;            /* a world-writable SysV segment of the host */
  res[7] = opens("/usr/lib/hcq-planted", O_WRONLY | O_CREAT);         /* the system */
  res[8] = getuid(); res[9] = geteuid();
  long procs = 0; d = opendir("/proc");                               /* the processes it can see */
  if (d) { struct dirent *e; while ((e = readdir(d))) procs += e->d_name[0] >= '0' && e->d_name[0] <= '9'; closedir(d); }
  res[10] = procs;
  res[11] = opens("/tmp/mine", O_WRONLY | O_CREAT);                   /* its own private /tmp works */
  res[12] = syscall(SYS_unshare, 0x10000000) == 0;  /* CLONE_NEWUSER */                              /* a user namespace: capabilities over new namespaces */
  res[13] = opens("/dev/tty", O_RDWR);                                /* the terminal the server was started from */
  res[14] = getenv("PROBE_DOOR_SECRET") != 0;                     /* the door's environment */
  const char say[] = "\x1b[2Jhcq-probe-said\n"; res[15] = write(2, say, sizeof say - 1) > 0;  /* the door's log, escapes and all */
}
"""

PROBE_CLIENT = """
import sys, hcq, numpy as np
dev = hcq.Device(sys.argv[1])
prg = dev.compile(open(sys.argv[2]).read(), "probe")
res = dev.allocator.alloc(16 * 8)
prg(res, vals=(int(sys.argv[3]), int(sys.argv[4])), wait=True)
out = np.zeros(16, np.int64); dev.allocator.copyout(memoryview(out), res)
print("probe", *out.tolist(), flush=True)
"""


@pytest.mark.full
@ROOT_ONLY
def test_a_clients_kernel_reaches_nothing_of_the_host_or_the_door(isolation_server, tmp_path):
    """The kernel of a logged-in client tries what issue 40 found a root worker could do: signal the door, read root's
    0600 file, append to root's file, leave a file in the host's /tmp, open and plant into the server user's compile
    cache, attach a world-writable SysV segment of the host, write into the system. Every one fails; it runs as an
    unprivileged uid of its own, sees only its own processes, and its own /tmp works."""
    from hcq.toolchain import configured_cache_dir
    secret_dir = Path(tempfile.mkdtemp(dir=ROOT, prefix=".confine-"))  # (a place the worker can see: the checkout)
    try:
        secret, public = secret_dir / "secret", secret_dir / "public"
        secret.write_text("root only")
        secret.chmod(0o600)
        public.write_text("root's\n")
        public.chmod(0o644)
        secret_dir.chmod(0o755)
        host_tmp = f"/tmp/hcq-escaped-{secrets.token_hex(4)}"
        cache = configured_cache_dir()
        os.makedirs(cache, exist_ok=True)
        planted = os.path.join(cache, "planted.so")
        if os.path.exists(planted): os.unlink(planted)  # (left by a run against an unconfined server)
        source = (PROBE.replace("@SECRET@", str(secret)).replace("@PUBLIC@", str(public)).replace("@HOST_TMP@", host_tmp)
                  .replace("@CACHE@", cache))
        probe = tmp_path / "probe.c"
        probe.write_text(source)
        probe.chmod(0o644)
        shm_id = _libc.shmget(0, 4096, IPC_CREAT | 0o666)  # IPC_PRIVATE
        assert shm_id >= 0
        try:
            r = subprocess.run([sys.executable, "-c", PROBE_CLIENT, isolation_server.device(0), str(probe), str(isolation_server.proc.pid),
                                str(shm_id)], capture_output=True, text=True, cwd=ROOT, timeout=120)
        finally:
            _libc.shmctl(shm_id, IPC_RMID, None)
        line = next((ln.split()[1:] for ln in r.stdout.splitlines() if ln.startswith("probe")), None)
        assert line, r.stdout + r.stderr
        got = dict(zip(["signal door", "read secret", "append", "host tmp", "see cache", "plant cache", "attach shm",
                        "write system", "uid", "euid", "processes", "own tmp", "user namespace", "tty", "door env", "wrote log"], map(int, line)))
        assert not any(got[k] for k in ("signal door", "read secret", "append", "see cache", "plant cache", "attach shm", "write system",
                                        "user namespace", "tty", "door env")), got
        assert got["wrote log"] and "?[2Jhcq-probe-said" in isolation_server.stderr() and "\x1b[2J" not in isolation_server.stderr()
        assert not os.path.exists(host_tmp) and not os.path.exists(os.path.join(cache, "planted.so")), got
        assert public.read_text() == "root's\n"
        assert got["uid"] == got["euid"] and 61184 <= got["uid"] <= 65519, got
        assert got["processes"] <= 8 and got["own tmp"] == 1, got  # (itself, a compiler or two)
    finally:
        for f in secret_dir.iterdir(): f.unlink()
        secret_dir.rmdir()


def _worker_uids(served) -> dict[int, int]:
    """The live workers of `served` and their uids; a worker that exits between the listing and the look (a session
    of an earlier test ending) is left out rather than failing the look."""
    uids = {}
    for pid in _workers(served):
        try:
            uids[pid] = os.stat(f"/proc/{pid}").st_uid
        except FileNotFoundError:
            pass
    return uids


@pytest.mark.full
@ROOT_ONLY
def test_a_worker_runs_as_its_own_uid_in_namespaces_of_its_own(isolation_server):
    """What any local user sees of an idle worker: a uid of its own from the dynamic range (not the door's, no
    capabilities, no new privileges) in mount, IPC and PID namespaces that are not the door's; two workers never
    share a uid."""
    pid, _ = _idle_worker_socket(isolation_server)
    status = dict(ln.split(":", 1) for ln in open(f"/proc/{pid}/status") if ":" in ln)
    uid = int(status["Uid"].split()[0])
    assert 61184 <= uid <= 65519 and len(set(status["Uid"].split())) == 1, status["Uid"]
    assert int(status["CapEff"], 16) == 0 and int(status["CapBnd"], 16) == 0 and status["NoNewPrivs"].strip() == "1", status
    for ns in ("mnt", "ipc", "pid"):
        assert os.readlink(f"/proc/{pid}/ns/{ns}") != os.readlink(f"/proc/{isolation_server.proc.pid}/ns/{ns}"), ns
    holder = subprocess.Popen([sys.executable, "-c", "import sys, hcq; d = hcq.Device(sys.argv[1]); print('in', flush=True); sys.stdin.readline()",
                               isolation_server.device(0)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert holder.stdout.readline().strip() == "in"
        deadline = time.monotonic() + 30
        while len(uids := _worker_uids(isolation_server)) < 2 and time.monotonic() < deadline: time.sleep(0.1)  # (a new spare)
        assert len(uids) >= 2 and len(set(uids.values())) == len(uids), uids
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.full
@ROOT_ONLY
def test_the_token_reaches_no_worker(tmp_path):
    """Issue 40, 7: the token is in the door's environment only; a worker (and so every compiler it starts) has none."""
    s = Served({"HCQ_REMOTE_TOKEN": "sekrit-" + secrets.token_hex(8)})
    try:
        pid, _ = _idle_worker_socket(s)
        with open(f"/proc/{pid}/environ", "rb") as f: env = f.read()
        assert b"HCQ_REMOTE_TOKEN" not in env and b"sekrit-" not in env
        stand_in = next(p for p in _children(s.proc.pid) if pid in _children(p))
        with open(f"/proc/{stand_in}/environ", "rb") as f: assert b"sekrit-" not in f.read()
        # a session of its own: no signal to the door's process group, no controlling terminal of the door's
        assert os.getsid(stand_in) == stand_in != os.getsid(s.proc.pid) and os.getpgid(pid) != os.getpgid(s.proc.pid)
    finally:
        s.close()


@pytest.mark.full
@ROOT_ONLY
def test_the_python_a_worker_runs_may_live_where_other_users_cannot_enter(isolation_server):
    """The interpreter here lives in root's home (0700): the confined worker still starts, with what it needs bound
    read-only into its own mount namespace, and the rest of that home is not there (not even a world-readable file)."""
    home = os.path.expanduser("~")
    if not (sys.prefix.startswith(home + "/") and not stat.S_IMODE(os.stat(home).st_mode) & 0o001):
        pytest.skip("Python does not live in a home other users cannot enter")
    planted = Path(home) / f".hcq-confine-{secrets.token_hex(4)}"
    planted.write_text("readable by all")
    planted.chmod(0o644)
    try:
        r = client(f"""
            import hcq
            dev = hcq.Device("{isolation_server.device(0)}")
            prg = dev.compile('#include <fcntl.h>\\nHCQ_KERNEL void look(long *res) {{ res[0] = open("{planted}", O_RDONLY) >= 0; }}', "look")
            res = dev.allocator.alloc(8)
            prg(res, wait=True)
            out = bytearray(8); dev.allocator.copyout(memoryview(out), res)
            print("opened", int.from_bytes(out, "little"))
        """)
    finally:
        planted.unlink()
    assert "opened 0" in r.stdout, r.stdout + r.stderr


HOLDER = """
import sys, hcq
dev = hcq.Device(sys.argv[1])
key = "k" * 8 + __import__("secrets").token_hex(16)
dev.connection.call("expect_link", key=key)
print(dev.connection.worker_address, key, flush=True)
sys.stdin.readline()
"""


def test_a_link_hello_needs_a_key_the_workers_client_announced(isolation_server):
    """Issue 40, 1, as a hand-written UCX peer at a client's worker: a hello with a made-up link key is refused (it once
    let the stranger open devices, load and run kernels in another client's worker); one with the key the client
    announced is let in once, and may then only push and place, never open, alloc, load or free."""
    import json
    from hcq.backends.remote import protocol
    from hcq.backends.remote.net import NetEngine
    from hcq.errors import HCQError
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, isolation_server.device(0)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, cwd=ROOT)
    try:
        address, key = holder.stdout.readline().split()
        host, port = address.rsplit(":", 1)

        def hello(engine: NetEngine, link_key: str) -> tuple[object, dict]:
            conn = engine.connect(host, int(port), 5000)
            return conn, json.loads(conn.request(protocol.call_message("hello", version=protocol.VERSION, link_key=link_key,
                                                                       link_from="attacker:1"), timeout_ms=10_000))

        def call(conn: object, op: str, **args: object) -> dict:
            try:
                return json.loads(conn.request(protocol.call_message(op, **args), timeout_ms=10_000))  # type: ignore[attr-defined]
            except HCQError as e:
                return {"ok": False, "error": str(e)}
        with NetEngine() as attacker:
            forged, answer = hello(attacker, "f" * 32)
            assert not answer["ok"] and "announced" in answer["error"], answer
            assert not call(forged, "open", device="CPU:0")["ok"]
            link, answer = hello(attacker, key)
            assert answer["ok"], answer
            for op, args in (("open", {"device": "CPU:0"}), ("alloc", {"device": "CPU:0", "size": 4096}),
                             ("load", {"device": "CPU:0", "name": "k", "source": "HCQ_KERNEL void k(int *a) { a[0] = 1; }"}),
                             ("free", {"addr": 4096}), ("expect_link", {"key": "x" * 32})):
                got = call(link, op, **args)
                assert not got["ok"] and "only pushes and places" in got["error"], (op, got)
            again, answer = hello(attacker, key)
            assert not answer["ok"], "a link key was taken twice"
        holder.stdin.write("\n")
        holder.stdin.flush()
        assert holder.wait(30) == 0
    finally:
        holder.kill()
        holder.wait()


def test_the_launchers_result_does_not_show_the_token():
    """Issue 40, 7: repr() of what the Ray launcher returns (printed, logged) carried the token."""
    from hcq.backends.remote.cluster import RayServers
    servers = RayServers("sekrit-token", [], ["CPU:0@10.0.0.1:5000"])
    assert "sekrit" not in repr(servers) and "CPU:0@10.0.0.1:5000" in repr(servers)
    assert servers.token == "sekrit-token"


def _as_nobody_with_python_visible(keep: list[str]):
    """A preexec_fn (run as root): a mount namespace of its own where root's home is an empty tmpfs with `keep` bound
    back read-only (nobody cannot enter the real one), then uid and gid 65534."""
    def run() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        mount = lambda src, dst, fs, flags, data=None: libc.mount(src and src.encode(), dst.encode(), fs and fs.encode(),  # noqa: E731
                                                                   ctypes.c_ulong(flags), data and data.encode())
        home = os.path.expanduser("~")
        assert libc.unshare(0x00020000) == 0 and mount(None, "/", None, 16384 | (1 << 18)) == 0  # CLONE_NEWNS; MS_REC|MS_PRIVATE
        staged = []
        for i, path in enumerate(keep):
            stage = f"/dev/shm/.keep-{os.getpid()}-{i}"
            os.mkdir(stage)
            assert mount(path, stage, None, 4096 | 16384) == 0  # MS_BIND|MS_REC
            staged.append((stage, path))
        assert mount("tmpfs", home, "tmpfs", 0, "mode=0755") == 0
        for stage, path in staged:
            os.makedirs(path, exist_ok=True)
            assert mount(stage, path, None, 8192) == 0  # MS_MOVE
            os.rmdir(stage)
        os.setgroups([])
        os.setgid(65534)
        os.setuid(65534)
    return run


@pytest.mark.full
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root, to start the server as another user")
def test_a_server_run_by_an_ordinary_user_confines_its_workers_in_a_user_namespace():
    """Issue 40, 3, without root: `hcq serve` run by an ordinary user (nobody here) confines each worker in user, mount,
    IPC and PID namespaces of its own. Its client's kernel cannot write a file its own user owns (the system is read-only
    to it), leaves nothing in the host's /tmp, and sees no process but its worker's."""
    if not (shutil.which("setpriv") and shutil.which("unshare")): pytest.skip("util-linux's setpriv and unshare are not installed")
    probe = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "unshare", "--user", "--mount", "--ipc",
                            "--pid", "--fork", "true"], capture_output=True)
    if probe.returncode != 0: pytest.skip("this kernel gives an ordinary user no user namespaces")
    home = os.path.expanduser("~")
    import hcq
    keep = sorted({os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, os.path.dirname(os.path.dirname(hcq.__file__)))
                   if os.path.realpath(p).startswith(home + "/")})
    keep = [p for p in keep if not any(p != o and p.startswith(o + "/") for o in keep)]
    tmp_path = Path(tempfile.mkdtemp(dir="/var/tmp" if os.path.isdir("/var/tmp") else None, prefix="hcq-nobody-"))  # (nobody reaches it)
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    owned = tmp_path / "owned-by-nobody"
    owned.write_text("nobody's\n")
    for p in (tmp_path, cache, owned): os.chown(p, 65534, 65534)
    tmp_path.chmod(0o755)
    host_tmp = f"/tmp/hcq-escaped-{secrets.token_hex(4)}"
    env = {**os.environ, "HCQ_CACHE_DIR": str(cache), "HOME": str(tmp_path)}
    log = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen([sys.executable, "-m", "hcq", "serve"], stdout=subprocess.PIPE, stderr=log, text=True, env=env, cwd="/",
                            preexec_fn=_as_nobody_with_python_visible(keep), start_new_session=True)
    try:
        line = proc.stdout.readline()
        log.seek(0)
        assert "listening on" in line, line + log.read()
        address = line.split("listening on ")[1].split()[0]
        source = (r"""#include <dirent.h>
#include <fcntl.h>
#include <sys/syscall.h>
#include <signal.h>
#include <unistd.h>
long syscall(long number, ...);
HCQ_KERNEL void probe(long *res, int door) {
  int fd = open("@OWNED@", O_WRONLY | O_APPEND); res[0] = fd >= 0; if (fd >= 0) close(fd);
  fd = open("@HOST_TMP@", O_WRONLY | O_CREAT, 0644); if (fd >= 0) close(fd);
  res[1] = kill(door, 0) == 0; res[2] = getuid();
  long procs = 0; DIR *d = opendir("/proc"); struct dirent *e;
  if (d) { while ((e = readdir(d))) procs += e->d_name[0] >= '0' && e->d_name[0] <= '9'; closedir(d); }
  res[3] = procs;
  res[4] = syscall(SYS_unshare, 0x10000000) == 0;  /* CLONE_NEWUSER */
}""").replace("@OWNED@", str(owned)).replace("@HOST_TMP@", host_tmp)
        path = tmp_path / "probe.c"
        path.write_text(source)
        r = subprocess.run([sys.executable, "-c", PROBE_CLIENT.replace("int(sys.argv[3]), int(sys.argv[4])", "int(sys.argv[3]),"), f"CPU:0@{address}",
                            str(path), str(proc.pid)], capture_output=True, text=True, cwd=ROOT, timeout=180)
        got = next((ln.split()[1:] for ln in r.stdout.splitlines() if ln.startswith("probe")), None)
        log.seek(0)
        assert got, r.stdout + r.stderr + log.read()
        appended, signalled, uid, procs, userns = map(int, got[:5])
        assert not appended and not signalled and not userns and uid == 65534 and procs <= 8, got
        assert owned.read_text() == "nobody's\n" and not os.path.exists(host_tmp)
        log.seek(0)
        assert "cannot be confined" not in log.read()
    finally:
        os.killpg(proc.pid, 9)
        proc.wait()
        shutil.rmtree(tmp_path, ignore_errors=True)


@pytest.mark.full
@ROOT_ONLY
def test_with_isolation_none_no_clients_code_runs_in_the_door():
    """`--isolation none` serves every client from one process: a worker of its own (confined too), never the door, so
    a client's kernel cannot reach the door there either; each client still needs a ticket the door gave it."""
    s = Served(args=("--isolation", "none"))
    try:
        r = client(f"""
            import hcq
            a, b = hcq.Device("{s.device(0)}"), hcq.Device("{s.device(1)}")
            print("pids", a.connection.info["pid"], b.connection.info["pid"])
        """)
        assert "pids" in r.stdout, r.stdout + r.stderr
        worker, again = map(int, r.stdout.split()[1:3])
        assert worker == again and worker != s.proc.pid and 61184 <= os.stat(f"/proc/{worker}").st_uid <= 65519
        r2 = client(f"""
            import hcq
            print("pid", hcq.Device("{s.device(0)}").connection.info["pid"])
        """)
        assert f"pid {worker}" in r2.stdout, r2.stdout + r2.stderr  # (the same one process serves the next client)
    finally:
        s.close()


@pytest.mark.full
@ROOT_ONLY
def test_a_server_whose_hcq_lives_in_tmp_still_starts_workers():
    """The worker's /tmp is a fresh one of its own: hcq (a checkout, say) under the host's /tmp is put back read-only at
    its place, or the worker could not import itself."""
    import hcq
    base = Path(tempfile.mkdtemp(dir="/tmp", prefix="hcq-in-tmp-"))
    try:
        shutil.copytree(os.path.dirname(hcq.__file__), base / "hcq", ignore=shutil.ignore_patterns("__pycache__"))
        base.chmod(0o755)
        s = Served.__new__(Served)  # (started from `base`, so that the server and its workers import the copy)
        s.env, s.log = os.environ.copy(), tempfile.TemporaryFile(mode="w+")
        s.proc = subprocess.Popen([sys.executable, "-m", "hcq", "serve"], stdout=subprocess.PIPE, stderr=s.log, text=True, cwd=base,
                                  start_new_session=True)
        line = s.proc.stdout.readline()
        s.address = line.split("listening on ")[1].split()[0] if "listening on" in line else "?"
        try:
            assert s.address != "?", line + s.stderr()
            r = subprocess.run([sys.executable, "-c", "import hcq, numpy as np\n"
                                f"dev = hcq.Device('{s.device(0)}')\n"
                                "prg = dev.compile('HCQ_KERNEL void k(int *a) { a[0] = 42; }', 'k')\n"
                                "b = dev.allocator.alloc(64); prg(b, wait=True)\n"
                                "out = np.zeros(1, np.int32); dev.allocator.copyout(memoryview(out), b); print('got', out[0])"],
                               capture_output=True, text=True, cwd=ROOT, timeout=120)
            assert "got 42" in r.stdout, r.stdout + r.stderr + s.stderr()[-2000:]
            assert str(base) in open(f"/proc/{s.proc.pid}/cmdline").read() or os.readlink(f"/proc/{s.proc.pid}/cwd") == str(base)
        finally:
            s.close()
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.full
@ROOT_ONLY
def test_no_confine_keeps_the_servers_user_and_shared_memory_lanes():
    """`--no-confine` (trusted single-user setups): the worker keeps uid 0 (without capabilities) in the door's
    namespaces, so its client on this host reaches it over UCX's shared memory, not only TCP."""
    s = Served(args=("--no-confine",))
    try:
        pid, _ = _idle_worker_socket(s)
        assert os.stat(f"/proc/{pid}").st_uid == 0 and os.readlink(f"/proc/{pid}/ns/mnt") == os.readlink(f"/proc/{s.proc.pid}/ns/mnt")
        r = client(f"""
            import hcq
            dev = hcq.Device("{s.device(0)}")
            print("lanes", dev.connection.conn.transports)
        """)
        assert "lanes" in r.stdout, r.stdout + r.stderr
        lanes = r.stdout.split("lanes", 1)[1]
        assert any(t in lanes for t in ("sysv", "posix", "cma", "xpmem", "knem")), lanes
    finally:
        s.close()


DEAF_CLIENT = r"""
import sys, hcq
dev = hcq.Device(sys.argv[1])
prg = dev.compile('''
#include <dlfcn.h>
#include <signal.h>
#include <sys/prctl.h>
#include <unistd.h>
HCQ_KERNEL void deaf(int *a) {
  signal(SIGTERM, SIG_IGN); signal(SIGINT, SIG_IGN);
  void *(*take_gil)(void) = (void *(*)(void))dlsym(RTLD_DEFAULT, "PyGILState_Ensure");
  if (take_gil) take_gil();  /* no Python line of the worker runs again: it never hears the door go */
  prctl(PR_SET_NAME, "hcq-deaf");  /* (for the test to see: it holds the GIL now) */
  for (;;) pause();
}''', "deaf")
prg(dev.allocator.alloc(64))
print(dev.connection.info["pid"], flush=True)
sys.stdin.readline()
"""


@pytest.mark.full
@ROOT_ONLY
def test_a_worker_whose_code_ignores_sigterm_does_not_outlive_the_server():
    """A client's kernel ignores SIGTERM, takes the worker's GIL and never returns, so the worker's Python never hears
    the door go (nor runs a signal handler). Stopping `hcq serve` still ends that worker, its stand-in and every other
    worker: no client's code outlives the server (nor keeps its uid)."""
    s = Served()
    holder = subprocess.Popen([sys.executable, "-c", DEAF_CLIENT, s.device(0)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        line = holder.stdout.readline()
        assert line.strip(), holder.stderr.read() if holder.poll() is not None else "no pid"
        worker = int(line)

        def deaf() -> bool:  # the kernel runs, SIGTERM ignored, and holds the worker's GIL (it named its thread after)
            for t in os.listdir(f"/proc/{worker}/task"):
                try:
                    with open(f"/proc/{worker}/task/{t}/comm") as f:
                        if f.read().strip() == "hcq-deaf": return True
                except FileNotFoundError:
                    pass  # (a thread that ended)
            return False
        deadline = time.monotonic() + 30  # (a hang guard) until then, and until a spare worker is up beside it
        while not (deaf() and set(_workers(s)) - {worker}) and time.monotonic() < deadline: time.sleep(0.02)
        assert deaf(), "the client's kernel did not take the worker's GIL"
        everyone = set(_workers(s)) | set(_children(s.proc.pid)) | {worker}
        with open(f"/proc/{worker}/status") as f:
            assert any(ln.startswith("SigIgn:") and int(ln.split()[1], 16) & (1 << 14) for ln in f)  # (SIGTERM is 15: bit 14)
        s.close()
        deadline = time.monotonic() + 15
        alive = lambda p: os.path.exists(f"/proc/{p}") and "zombie" not in open(f"/proc/{p}/status").read()  # noqa: E731
        while time.monotonic() < deadline and any(alive(p) for p in everyone): time.sleep(0.1)
        left = [p for p in everyone if alive(p)]
        assert not left, f"processes of the server outlived it: {left}"
    finally:
        holder.kill()
        holder.wait()
        s.close()


@pytest.mark.full
def test_link_announcements_are_bounded_and_checked(isolation_server):
    """`expect_link` from a client: a key shorter than 32 characters is refused, and at most 64 announcements that no
    link used may wait per client (a client cannot grow the worker's table without bound)."""
    r = client(f"""
        import hcq
        dev = hcq.Device("{isolation_server.device(0)}")
        try:
            dev.connection.call("expect_link", key="short")
        except ValueError as e:
            print("short:", e)
        for i in range(64): dev.connection.call("expect_link", key=f"{{i:040d}}")
        try:
            dev.connection.call("expect_link", key="x" * 40)
        except ValueError as e:
            print("65th:", e)
    """)
    assert "short: " in r.stdout and "at least 32 characters" in r.stdout, r.stdout + r.stderr
    assert "65th: " in r.stdout and "64 links that never came" in r.stdout, r.stdout + r.stderr


@ROOT_ONLY
def test_a_confined_worker_told_to_stop_while_it_starts_stops():
    """A confined worker is pid 1 of its PID namespace, where a signal without a handler is dropped: the door's SIGTERM,
    passed on by the stand-in while the worker was still starting (a spare, when the door closes), was lost, and the
    door waited its 5 s before killing it; one that came before the stand-in passed signals on killed the stand-in.
    The worker notes SIGTERM from its first line (blocked across the fork) and leaves, status 0, when it can."""
    import json
    config = {"devices": ["CPU:0"], "host": "127.0.0.1", "ticket": secrets.token_hex(16), "user": None, "uid": 65534,
              "door": "127.0.0.1:1", "assigned_s": 10, "net_device": None, "confine": True}
    proc = subprocess.Popen([sys.executable, "-m", "hcq.backends.remote.server", "--worker"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT, start_new_session=True)
    try:
        proc.stdin.write((json.dumps(config) + "\n").encode())
        proc.stdin.flush()  # (stdin stays open: a worker whose door is gone would stop by itself)
        first = proc.stdout.readline()
        assert first.startswith(b"pid "), first + proc.stderr.read()
        proc.terminate()  # the stand-in passes it on (or takes it first), the worker still starting
        try:
            status = proc.wait(20)
        except subprocess.TimeoutExpired:
            raise AssertionError("a worker told to stop as it started did not stop") from None
        assert status == 0, (status, proc.stderr.read()[-2000:])
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
