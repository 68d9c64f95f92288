"""The suite does not depend on how it was started. A background job of a non-interactive shell (`cmd &` in a script,
`nohup cmd &`) starts with SIGINT ignored, and Python keeps it so: SIGINT then never raises KeyboardInterrupt, and the
Ctrl-C tests failed (and, failing, left devices wedged for later tests). conftest.py gives SIGINT Python's handler for
the session; these tests run a few Ctrl-C tests in a pytest started that way."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Ctrl-C tests that fail at once where SIGINT is ignored (none waits for an interrupt that does not come, none leaves
# a device wedged), in the process itself, in the fuzzer's interrupt, and in a Python child the test starts
SELECTION = [
    "tests/test_reliability.py::test_interrupts_only_defer_inside_sections",
    "tests/test_reliability.py::test_ctrl_c_while_the_staging_ring_is_made_leaves_it_whole",
    "tests/test_fuzz.py::test_an_interrupt_anywhere_in_a_call_leaves_it_whole_or_undone[launch]",
    "tests/test_started_in_background.py::test_a_python_child_of_the_suite_hears_ctrl_c",
]


def started_in_background(*cmd: str) -> list[str]:
    """`cmd` as a background job of a script starts it: with SIGINT ignored (a shell's `trap '' INT` does what job
    control does to it, and `exec` keeps the command this process's child, for the timeout to kill)."""
    return ["/bin/sh", "-c", "trap '' INT; exec \"$@\"", "sh", *cmd]


def test_a_python_child_of_the_suite_hears_ctrl_c():
    """A Python process a test starts raises KeyboardInterrupt on SIGINT (what test_remote's Ctrl-C clients need)."""
    code = ("import os, signal, time\n"
            "try:\n"
            "    os.kill(os.getpid(), signal.SIGINT)\n"
            "    time.sleep(5)\n"
            "    print('SIGINT did nothing:', signal.getsignal(signal.SIGINT))\n"
            "except KeyboardInterrupt:\n"
            "    print('interrupted')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.stdout.strip() == "interrupted", r.stdout + r.stderr


@pytest.mark.full
def test_the_ctrl_c_tests_pass_in_a_run_started_in_the_background():
    ignored = "import signal; print(signal.getsignal(signal.SIGINT) is signal.SIG_IGN)"
    probe = subprocess.run(started_in_background(sys.executable, "-c", ignored), capture_output=True, text=True, timeout=60)
    assert probe.stdout.strip() == "True", probe.stdout + probe.stderr  # (the run below starts so)
    r = subprocess.run(started_in_background(sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *SELECTION),
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert f"{len(SELECTION)} passed" in r.stdout, r.stdout[-4000:]
