"""The `hcq` command line (`python -m hcq ...`): demo, info, profile, and one-line errors (tracebacks with -v)."""
import json
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter

import pytest

import hcq
from hcq.cli import main

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = r'''
import sys
from array import array
import hcq
n, rc = int(sys.argv[1]), int(sys.argv[2])
d = hcq.Device("CPU:0")
prg = d.compile("HCQ_KERNEL void cli_probe_kernel(int *out, int n) { long i = hcq_global_id(0); if (i < n) out[i] += 1; }",
                "cli_probe_kernel")
buf = d.allocator.alloc(4096)
d.allocator.copyin(buf, memoryview(array("i", [0] * 1024)).cast("B"))
for _ in range(n): prg(buf, vals=(1024,), global_size=(4, 1, 1), local_size=(256, 1, 1))
out = array("i", [0] * 1024)
d.allocator.copyout(memoryview(out).cast("B"), buf)
assert out[0] == n
print("probe done")
sys.exit(rc)
'''
NO_HCQ = 'print("this script never imports hcq")\n'


def clean_env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in ("PROFILE", "PROFILE_PATH")}
    env.update(PYTHONPATH=REPO + os.pathsep + env.get("PYTHONPATH", ""), **extra)
    return env


def hcq_cli(tmp_path, *args, **env):
    return subprocess.run([sys.executable, "-m", "hcq", *args], cwd=tmp_path, env=clean_env(**env), capture_output=True,
                          text=True, timeout=300)


def lines(text):
    return [ln for ln in text.splitlines() if ln.strip()]


def error_lines(text):
    return [ln for ln in lines(text) if "error" in ln.lower()]


# ------------------------------------------------------------------ demo
def test_demo_runs_checks_and_writes_a_trace(tmp_path):
    r = hcq_cli(tmp_path, "demo", "--n", "4096", "--trace", str(tmp_path / "t.json"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "demo OK" in r.stdout
    assert "Traceback" not in r.stderr
    assert str(tmp_path / "t.json") in r.stdout  # where the trace went
    trace = json.loads((tmp_path / "t.json").read_text())
    evs = trace["traceEvents"]
    xs = [e for e in evs if e["ph"] == "X"]
    cats = Counter(e["cat"] for e in xs)
    assert cats["kernel"] >= 1 and cats["copy"] >= 1 and cats["graph"] >= 1 and cats["host"] >= 1, cats
    assert {e["name"] for e in xs if e["cat"] == "kernel"} == {"saxpy"}
    assert any(e["name"].startswith("transfer CPU:0->CPU:1") for e in xs if e["cat"] == "copy")
    for e in xs:
        if e["cat"] == "copy": assert e["args"]["bytes"] == 4096 * 4
    graph = [e for e in xs if e["cat"] == "graph"]
    assert len(graph) % 3 == 0 and {e["name"] for e in graph} >= {"saxpy", "scale_add"}
    # graph dependencies became flow arrows, in pairs
    flows = Counter((e["id"], e["ph"]) for e in evs if e["ph"] in ("s", "f"))
    ids = {i for i, _ in flows}
    assert ids and all(flows[(i, "s")] == 1 and flows[(i, "f")] == 1 for i in ids)
    assert len(ids) == sum(len(e["args"].get("deps", ())) for e in graph)
    names = {(e["name"], e["args"]["name"]) for e in evs if e["ph"] == "M"}
    assert {("process_name", "CPU:0"), ("process_name", "CPU:1"), ("process_name", "host"), ("thread_name", "compute")} <= names


# ------------------------------------------------------------------ info
def test_info_lists_device_queues_workers_compiler_peers_and_env(tmp_path):
    r = hcq_cli(tmp_path, "info", HCQ_LRU="1", HCQ_CPU_WORKERS="2")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "CPU:0" in out
    assert re.search(r"^\s*queue compute0?: ", out, re.M), out
    for q in ("copy0", "copy1"): assert re.search(rf"^\s*queue {q}: ", out, re.M), out
    assert "worker threads: 2" in out
    assert any(ln.startswith("compiler: ") and "(" in ln for ln in out.splitlines())
    assert "peer groups: CPU: ['CPU:0']" in out
    env_line = next(ln for ln in out.splitlines() if ln.startswith("environment:"))
    assert "HCQ_LRU=1" in env_line and "HCQ_CPU_WORKERS=2" in env_line


def test_info_in_process_several_devices(capsys, monkeypatch, dev, dev1):
    for k in list(os.environ):
        if k.startswith("HCQ") or k in ("DEV", "CC"): monkeypatch.delenv(k)
    assert main(["info", dev.device, dev1.device.lower()]) == 0
    out = capsys.readouterr().out
    assert f"{dev.device}: CPUDevice" in out and f"{dev1.device}: CPUDevice" in out
    assert len(re.findall(r"^\s*queue compute0?: ", out, re.M)) == 2
    assert f"worker threads: {dev.num_workers}" in out
    peers = next(ln for ln in out.splitlines() if ln.startswith("peer groups:"))
    assert f"'{dev.device}'" in peers and f"'{dev1.device}'" in peers
    assert "environment: (no HCQ variables set)" in out


def test_info_unknown_device_is_one_error_line(capsys):
    assert main(["info", "GPU:0"]) == 1
    cap = capsys.readouterr()
    err = lines(cap.err)
    assert len(err) == 1, cap.err
    assert "error" in err[0] and "GPU:0" in err[0]
    assert "Traceback" not in cap.err and cap.out == ""


def test_info_unknown_device_with_verbose_shows_traceback(capsys):
    assert main(["-v", "info", "GPU:0"]) == 1
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "GPU:0" in err


def test_errors_from_the_real_command(tmp_path):
    r = hcq_cli(tmp_path, "info", "GPU:0")
    assert r.returncode == 1
    assert len(lines(r.stderr)) == 1 and "error" in r.stderr and "GPU:0" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_bad_device_name_is_one_error_line(capsys):
    assert main(["info", "CPU:x:y"]) == 1
    err = lines(capsys.readouterr().err)
    assert len(err) == 1 and "error" in err[0] and "CPU:x:y" in err[0]


def test_no_subcommand_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        main([])
    assert e.value.code == 2
    assert "usage" in capsys.readouterr().err


# ------------------------------------------------------------------ profile
def test_profile_runs_script_prints_summary_and_returns_its_exit_code(tmp_path):
    (tmp_path / "probe.py").write_text(SCRIPT)
    r = hcq_cli(tmp_path, "profile", "--", sys.executable, "probe.py", "4", "3", TMPDIR=str(tmp_path))
    assert r.returncode == 3, r.stdout + r.stderr
    assert "probe done" in r.stdout
    assert "Traceback" not in r.stderr
    rows = [ln.split() for ln in r.stdout.splitlines() if ln.split()[:1] == ["cli_probe_kernel"]]
    assert len(rows) == 1 and rows[0][1] == "4", r.stdout  # named, with its launch count
    assert any(ln.startswith("kernels: 4 launches") for ln in r.stdout.splitlines())
    assert "copies:" in r.stdout and "copyin" in r.stdout
    trace_line = next(ln for ln in r.stdout.splitlines() if ln.startswith("trace: "))
    path = trace_line[len("trace: "):]
    trace = json.loads(open(path).read())
    assert sum(1 for e in trace["traceEvents"] if e.get("cat") == "kernel") == 4
    assert not (tmp_path / "hcq-profile.json").exists()  # the trace went to the profile command's path
    assert os.path.dirname(path).startswith(str(tmp_path / "hcq-profile-"))


@pytest.fixture
def child_env(monkeypatch):
    """In-process `main(["profile", ...])` starts its child with this process's environment."""
    for k in ("PROFILE", "PROFILE_PATH"): monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("PYTHONPATH", REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))


def test_profile_in_process_with_output_path(tmp_path, capfd, child_env):
    (tmp_path / "probe.py").write_text(SCRIPT)
    out = tmp_path / "trace.json"
    rc = main(["profile", "-o", str(out), "--top", "1", "--", sys.executable, str(tmp_path / "probe.py"), "2", "0"])
    cap = capfd.readouterr()
    assert rc == 0, cap.err
    assert out.exists() and f"trace: {out}" in cap.out
    assert "cli_probe_kernel" in cap.out


def test_profile_of_a_script_without_hcq_is_one_error_line(tmp_path, capfd, child_env, monkeypatch):
    (tmp_path / "plain.py").write_text(NO_HCQ)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    rc = main(["profile", "--", sys.executable, str(tmp_path / "plain.py")])
    assert not list(tmp_path.glob("hcq-profile-*")), "the empty trace folder was left behind"
    cap = capfd.readouterr()
    assert rc == 1
    assert "never imports hcq" in cap.out  # the script itself ran
    errs = error_lines(cap.err)
    assert len(errs) == 1 and "import hcq" in errs[0], cap.err
    assert "Traceback" not in cap.err


def test_profile_without_hcq_fails_even_if_the_output_file_exists(tmp_path, capfd, child_env):
    """A trace left at -o's path by an earlier run must not be summarised as this run's."""
    (tmp_path / "plain.py").write_text(NO_HCQ)
    out = tmp_path / "old.json"
    out.write_text(json.dumps({"traceEvents": [{"ph": "X", "cat": "kernel", "name": "old_kernel", "ts": 0, "dur": 5,
                                                "pid": 1, "tid": 1, "args": {}}]}))
    rc = main(["profile", "-o", str(out), "--", sys.executable, str(tmp_path / "plain.py")])
    cap = capfd.readouterr()
    assert "old_kernel" not in cap.out, cap.out
    assert rc == 1 and len(error_lines(cap.err)) == 1, cap.err


def test_profile_with_nothing_to_run_is_one_error_line(capsys):
    assert main(["profile"]) == 1
    err = lines(capsys.readouterr().err)
    assert len(err) == 1 and "error" in err[0] and "nothing to run" in err[0]
    assert main(["profile", "--"]) == 1
    assert len(lines(capsys.readouterr().err)) == 1


def test_cli_leaves_profiling_off_in_process(capsys, dev):
    assert main(["info"]) == 0  # (the default device, CPU:0: `dev`, which is closed after the test)
    assert hcq.profiler.active is None


# ------------------------------------------------------------------ bench
def test_bench_help_is_the_bench_help(tmp_path):
    """`hcq bench --help` is `python -m hcq.bench --help` (found beside the hcq in use, from any directory)."""
    r = hcq_cli(tmp_path, "bench", "--help")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "--quick" in r.stdout and "--only" in r.stdout and "python -m hcq.bench" in r.stdout, r.stdout


def test_bench_gets_every_option_untouched(tmp_path):
    """Options after `bench`, a leading one included, go to the bench as given (it refuses the section: nothing runs)."""
    r = hcq_cli(tmp_path, "bench", "--quick", "--only", "nosuch", "--peers", "")
    assert r.returncode == 2, r.stdout + r.stderr
    assert "unknown section 'nosuch'" in r.stderr and "unrecognized arguments" not in r.stderr, r.stderr


def test_bench_runs_from_an_installed_package_anywhere(tmp_path):
    """The benchmarks ship with the package: `hcq bench` works from any directory, and writes its results there."""
    r = hcq_cli(tmp_path, "bench", "--quick", "--only", "signal", "--peers", "", "--quiet-wait", "0")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "signal round trips" in r.stdout and (tmp_path / "hcq-bench.json").is_file(), r.stdout


def test_bench_arguments_are_not_read_by_hcq(monkeypatch):
    """In process: `hcq [-v] bench ARGS` hands ARGS on whole (a `-v` before the command is hcq's), and other
    commands still refuse options they do not know."""
    from hcq import cli
    seen = []
    monkeypatch.setattr(cli, "bench_cmd", lambda args: seen.append((args.rest, args.verbose)) or 0)
    assert cli.main(["bench", "--quick", "--only", "rt"]) == 0
    assert cli.main(["-v", "bench", "--help", "-v", "--", "x"]) == 0
    assert cli.main(["bench"]) == 0
    assert seen == [(["--quick", "--only", "rt"], False), (["--help", "-v", "--", "x"], True), ([], False)]
    with pytest.raises(SystemExit) as e:
        cli.main(["info", "--quick"])
    assert e.value.code == 2
