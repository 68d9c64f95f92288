"""The backend conformance kit (`python -m hcq.conformance DEVICE`) passes on the CPU device, refuses a device that
does not open with a one-line message, counts a run with no tests as a failure, and its pytest plugin does nothing
in runs without --hcq-device."""
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def clean_env():
    env = {k: v for k, v in os.environ.items() if k not in ("PROFILE", "PROFILE_PATH", "PYTEST_ADDOPTS")}
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    return env


def run(tmp_path, *args, timeout=300):
    # from a directory of its own: the kit must not depend on the repository's pytest settings
    return subprocess.run([sys.executable, *args], cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=timeout)


@pytest.mark.full
def test_conformance_suite_passes_on_the_cpu_device(tmp_path):
    r = run(tmp_path, "-m", "hcq.conformance", "CPU", "-q")
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert " passed" in out and " failed" not in out and " error" not in out, out
    assert "testing CPU:0" in out


def test_bogus_device_fails_with_a_message(tmp_path):
    r = run(tmp_path, "-m", "hcq.conformance", "NO_SUCH_BACKEND_XYZ")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "cannot open device 'NO_SUCH_BACKEND_XYZ'" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and "INTERNALERROR" not in r.stdout + r.stderr


def test_a_run_without_tests_is_a_failure(tmp_path):
    r = run(tmp_path, "-m", "hcq.conformance", "CPU", "-k", "no_test_has_this_name_xyz")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "no tests ran" in r.stderr, r.stderr


def test_plugin_is_inert_without_the_option(tmp_path):
    (tmp_path / "test_mine.py").write_text("def test_mine(request):\n"
                                           "    assert request.config.getoption('hcq_device') is None\n"
                                           "    assert request.config.pluginmanager.get_plugin('hcq-conformance-fixtures') is None\n")
    r = run(tmp_path, "-m", "pytest", "-p", "hcq.conformance.plugin", "-q", "test_mine.py", "--pyargs", "hcq.conformance.suite")
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert "1 passed" in out and "skipped" in out, out  # the suite itself skips: there is no device to test


def test_kit_tests_the_named_device_from_a_project_with_its_own_conftest():
    """Run from the repository root, whose tests/conftest.py has a `dev` fixture of its own (CPU:0): the kit must
    still test the device it was given, with its own fixtures."""
    r = subprocess.run([sys.executable, "-m", "hcq.conformance", "CPU:1", "-q", "-k", "test_queue_states_of_an_idle_device", "--",
                        "--fixtures-per-test"], cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert "testing CPU:1" in out, out
    assert "dev -- hcq/conformance/plugin.py" in out and "tests/conftest.py" not in out, out
