"""The compile server (hcq.compile_server): compile steps forked off a compiler that has already started up give the
results a fresh run gives, honour the caller's environment and working directory, and a timeout or Ctrl-C stops the
compile; anything it cannot serve runs the compiler directly."""
from __future__ import annotations

import os
import signal
import socket
import struct
import subprocess
import threading
import time
from pathlib import Path

import pytest

from hcq import compile_server, toolchain
from hcq.errors import CompileError
from helpers import wait_gone

# A stand-in compiler (a dynamically linked ELF, as compilers are) whose behaviour the arguments choose.
FAKE_CC = r"""
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
int main(int argc, char **argv) {
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--pidfile")) { FILE *f = fopen(argv[++i], "w"); fprintf(f, "%d", (int)getpid()); fclose(f); }
    else if (!strcmp(argv[i], "--hang")) for (;;) pause();
    else if (!strcmp(argv[i], "--env")) { const char *v = getenv(argv[++i]); printf("env=%s\n", v ? v : "(unset)"); }
    else if (!strcmp(argv[i], "--cwd")) { char b[4096]; printf("cwd=%s\n", getcwd(b, sizeof b)); }
    else if (!strcmp(argv[i], "--stdin")) printf("stdin=%d\n", (int)read(0, (char[8]){0}, 8));
    else if (!strcmp(argv[i], "--exit")) { fprintf(stderr, "leaving with %s\n", argv[i + 1]); return atoi(argv[++i]); }
  }
  return 0;
}
"""


@pytest.fixture(autouse=True)
def fresh_servers(monkeypatch):
    monkeypatch.delenv(compile_server.ENABLE_VAR, raising=False)
    compile_server.close_all()
    compile_server.stats.update(started=0, served=0)
    yield
    compile_server.close_all()


@pytest.fixture(scope="module")
def fake_cc(tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("fakecc")
    (d / "fakecc.c").write_text(FAKE_CC)
    subprocess.run([toolchain.find_compiler()[0], "-O1", "-o", str(d / "fakecc"), str(d / "fakecc.c")], check=True)
    return str(d / "fakecc")


def compile_c(tmp_path: Path, source: str, name: str = "k") -> tuple[int, str, bytes]:
    src, obj = tmp_path / f"{name}.c", tmp_path / f"{name}.o"
    src.write_text(source)
    rc, out = toolchain.run_compiler([toolchain.find_compiler()[0], "-O2", "-c", "-fPIC", "-o", str(obj), str(src)], name)
    return rc, out, obj.read_bytes() if rc == 0 else b""


KERNEL = "float scale(float *a, int n) { float s = 0; for (int i = 0; i < n; i++) s += a[i] * 3.0f; return s; }\n"


def test_served_compile_gives_what_a_direct_run_gives(tmp_path, monkeypatch):
    assert compile_server.describe(toolchain.find_compiler()[0]) == "on (started by a process's first compile step)"
    rc, out, served = compile_c(tmp_path, KERNEL)
    assert rc == 0, out
    assert compile_server.stats == {"started": 1, "served": 1}
    assert compile_server.describe(toolchain.find_compiler()[0]) == "on (running, 1 compile steps served)"
    monkeypatch.setenv(compile_server.ENABLE_VAR, "0")
    rc, out, direct = compile_c(tmp_path, KERNEL)
    assert rc == 0 and served == direct
    assert compile_server.stats["served"] == 1


def test_diagnostics_and_exit_status_come_back(tmp_path, fake_cc):
    rc, out, _ = compile_c(tmp_path, "int f(void) { return undeclared_thing; }\n", "broken")
    assert rc != 0 and "undeclared_thing" in out and "broken.c" in out
    assert toolchain.run_compiler([fake_cc, "-c", "--exit", "3"], "x") == (3, "leaving with 3\n")
    assert toolchain.run_compiler([fake_cc, "-c", "--stdin"], "x") == (0, "stdin=0\n")  # stdin is /dev/null
    assert compile_server.stats["served"] == 3


def test_each_request_gets_the_callers_environment_and_directory(tmp_path, fake_cc, monkeypatch):
    cmd = [fake_cc, "-c", "--env", "HCQ_TEST_VALUE", "--cwd"]
    assert toolchain.run_compiler(cmd, "x") == (0, f"env=(unset)\ncwd={os.getcwd()}\n")
    monkeypatch.setenv("HCQ_TEST_VALUE", "two words")
    monkeypatch.chdir(tmp_path)
    assert toolchain.run_compiler(cmd, "x") == (0, f"env=two words\ncwd={tmp_path}\n")
    assert compile_server.stats == {"started": 1, "served": 2}


@pytest.mark.full
@pytest.mark.parametrize("how", ["timeout", "ctrl-c"])
def test_a_stopped_compile_does_not_outlive_the_call(tmp_path, fake_cc, monkeypatch, how):
    pidfile = tmp_path / "pid"
    cmd = [fake_cc, "-c", "--pidfile", str(pidfile), "--hang"]
    toolchain.run_compiler([fake_cc, "-c"], "warm-up")
    server = compile_server._servers[fake_cc].proc.pid
    t0 = time.monotonic()
    if how == "timeout":
        monkeypatch.setenv(toolchain.TIMEOUT_VAR, "1")
        with pytest.raises(CompileError, match="did not finish compiling hang within 1 s"): toolchain.run_compiler(cmd, "hang")
    else:
        def interrupt_once_running() -> None:  # (the compile has written its pid: it runs)
            deadline = time.monotonic() + 60
            while not pidfile.exists() and time.monotonic() < deadline: time.sleep(0.01)
            time.sleep(0.2)
            os.kill(os.getpid(), signal.SIGINT)

        threading.Thread(target=interrupt_once_running, daemon=True).start()
        with pytest.raises(KeyboardInterrupt): toolchain.run_compiler(cmd, "hang")
    assert time.monotonic() - t0 < 30
    assert wait_gone([int(pidfile.read_text()), server])
    assert fake_cc not in compile_server._servers
    assert toolchain.run_compiler([fake_cc, "-c", "--exit", "0"], "after") == (0, "leaving with 0\n")
    assert compile_server.stats == {"started": 2, "served": 2}


def test_a_server_that_died_is_replaced(tmp_path, fake_cc):
    assert toolchain.run_compiler([fake_cc, "-c"], "x") == (0, "")
    os.kill(compile_server._servers[fake_cc].proc.pid, signal.SIGKILL)
    for _ in range(3): assert toolchain.run_compiler([fake_cc, "-c", "--exit", "0"], "x") == (0, "leaving with 0\n")
    assert compile_server.stats["started"] == 2 and compile_server.stats["served"] >= 3  # (one may have run directly)


def test_threads_compiling_at_once(tmp_path):
    results: list[tuple[int, str, bytes]] = []

    def work(i: int) -> None:
        for j in range(3): results.append(compile_c(tmp_path, KERNEL.replace("3.0f", f"{i}.{j}f"), f"t{i}_{j}"))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads: t.start()
    for t in threads: t.join()
    assert len(results) == 12 and all(rc == 0 and obj[:4] == b"\x7fELF" for rc, _, obj in results)
    assert compile_server.stats["started"] == 1 and 1 <= compile_server.stats["served"] <= 12  # the others ran directly


def test_a_forked_child_starts_its_own_server(tmp_path, fake_cc):
    assert toolchain.run_compiler([fake_cc, "-c"], "x") == (0, "")
    parent_server = compile_server._servers[fake_cc].proc.pid
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover (the child reports through the pipe)
        try:
            ok = toolchain.run_compiler([fake_cc, "-c", "--exit", "0"], "x") == (0, "leaving with 0\n")
            mine = compile_server._servers[fake_cc].proc.pid
            os.write(w, f"{ok} {compile_server.stats['started']} {mine != parent_server}".encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r) as f: report = f.read()
    os.waitpid(pid, 0)
    assert report == "True 2 True"  # (the child's count includes the parent's start, copied at fork)
    assert toolchain.run_compiler([fake_cc, "-c", "--exit", "0"], "x") == (0, "leaving with 0\n")
    assert compile_server._servers[fake_cc].proc.pid == parent_server and compile_server.stats == {"started": 1, "served": 2}


def test_what_the_server_cannot_take_runs_directly(tmp_path, fake_cc, monkeypatch):
    script = tmp_path / "cc.sh"  # a wrapper script: its interpreter would be what the server forks
    script.write_text(f'#!/bin/sh\nexec {fake_cc} "$@"\n')
    script.chmod(0o755)
    assert toolchain.run_compiler([str(script), "-c", "--exit", "0"], "x") == (0, "leaving with 0\n")
    assert toolchain.run_compiler([fake_cc, "--exit", "0"], "x") == (0, "leaving with 0\n")  # not a compile step (-c)
    assert compile_server.describe(str(script)) == f"not used: {script} is not an ELF executable (a wrapper script?)"
    monkeypatch.setenv(compile_server.ENABLE_VAR, "0")
    assert toolchain.run_compiler([fake_cc, "-c", "--exit", "0"], "x") == (0, "leaving with 0\n")
    assert compile_server.stats == {"started": 0, "served": 0}
    assert compile_server.describe(fake_cc) == f"off ({compile_server.ENABLE_VAR}=0)"


def test_a_compiler_the_preload_cannot_reach_runs_directly(tmp_path):
    static = tmp_path / "static-cc"
    (tmp_path / "s.c").write_text("#include <stdio.h>\nint main(void) { puts(\"static\"); return 0; }\n")
    built = subprocess.run([toolchain.find_compiler()[0], "-static", "-o", str(static), str(tmp_path / "s.c")], capture_output=True)
    if built.returncode != 0: pytest.skip("no static C library to link a static program")
    for _ in range(2): assert toolchain.run_compiler([str(static), "-c"], "x") == (0, "static\n")
    assert compile_server.stats == {"started": 0, "served": 0}
    assert compile_server.describe(str(static)) == f"not used: {static} did not load the compile server"


def test_malformed_requests_are_refused_and_the_server_goes_on(fake_cc):
    assert toolchain.run_compiler([fake_cc, "-c"], "x") == (0, "")
    sock = compile_server._servers[fake_cc].sock
    sock.settimeout(10)
    reply = lambda: struct.unpack("ii", sock.recv(64))
    sock.send(b"/\x001\x00cc\x00")  # no file descriptor for the output
    assert reply() == (compile_server.REFUSED, 9)  # EBADF
    with open(os.devnull, "wb") as out:
        for bad in (b"/\x000\x00", b"/\x0099\x00cc\x00", b"no terminator", b"/\x00x1\x00cc\x00"):
            socket.send_fds(sock, [bad], [out.fileno(), out.fileno()])  # (the extra descriptor is closed)
            assert reply() == (compile_server.REFUSED, 22)  # EINVAL
    assert toolchain.run_compiler([fake_cc, "-c", "--exit", "4"], "x") == (4, "leaving with 4\n")
    assert compile_server.stats == {"started": 1, "served": 2}


def test_a_removed_working_directory_runs_the_compiler_directly(tmp_path, fake_cc, monkeypatch):
    assert toolchain.run_compiler([fake_cc, "-c"], "x") == (0, "")
    gone = tmp_path / "gone"
    gone.mkdir()
    monkeypatch.chdir(gone)
    gone.rmdir()
    assert toolchain.run_compiler([fake_cc, "-c", "--exit", "0"], "x") == (0, "leaving with 0\n")
    assert toolchain.run_compiler([fake_cc, "-c", "--exit", "0"], "x") == (0, "leaving with 0\n")
    assert compile_server.stats == {"started": 1, "served": 1}


def test_an_environment_too_large_for_one_request_runs_directly(fake_cc, monkeypatch):
    assert toolchain.run_compiler([fake_cc, "-c"], "x") == (0, "")
    huge = [f"HCQ_TEST_HUGE{i}" for i in range(8)]  # (800 KB in all: more than one socket message, less than exec takes)
    for name in huge: monkeypatch.setenv(name, "x" * (100 << 10))
    for _ in range(2): assert toolchain.run_compiler([fake_cc, "-c", "--exit", "0"], "x") == (0, "leaving with 0\n")
    for name in huge: monkeypatch.delenv(name)
    assert toolchain.run_compiler([fake_cc, "-c", "--exit", "0"], "x") == (0, "leaving with 0\n")
    assert compile_server.stats == {"started": 1, "served": 2}  # (the same server throughout)


def test_a_server_that_cannot_start_now_is_tried_again_later(fake_cc, monkeypatch):
    real_popen = subprocess.Popen

    def no_processes_left(*a, **kw):
        if kw.get("env", {}).get(compile_server.FD_VAR): raise BlockingIOError(11, "Resource temporarily unavailable")
        return real_popen(*a, **kw)

    monkeypatch.setattr(subprocess, "Popen", no_processes_left)
    assert toolchain.run_compiler([fake_cc, "-c", "--exit", "0"], "x") == (0, "leaving with 0\n")  # (directly)
    assert compile_server.stats == {"started": 0, "served": 0} and fake_cc not in compile_server._unavailable
    monkeypatch.setattr(subprocess, "Popen", real_popen)
    assert toolchain.run_compiler([fake_cc, "-c", "--exit", "0"], "x") == (0, "leaving with 0\n")
    assert compile_server.stats == {"started": 1, "served": 1}


def test_a_bad_switch_value_is_named(fake_cc, monkeypatch):
    monkeypatch.setenv(compile_server.ENABLE_VAR, "sometimes")
    with pytest.raises(ValueError, match="HCQ_COMPILE_SERVER='sometimes' is not a valid int"):
        toolchain.run_compiler([fake_cc, "-c"], "x")
