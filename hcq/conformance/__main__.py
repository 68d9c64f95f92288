"""`python -m hcq.conformance DEVICE`: run the conformance suite against DEVICE with pytest (see hcq.conformance)."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

NO_TESTS = 5  # pytest.ExitCode.NO_TESTS_COLLECTED


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m hcq.conformance",
                                description="Run the hcq backend conformance suite against one device.",
                                epilog="Arguments after -- go to pytest unchanged, e.g. -- --tb=long -p my_backend_plugin.")
    p.add_argument("device", metavar="DEVICE", help="the device to test, as hcq.Device() names it (CPU, CPU:1, ...)")
    p.add_argument("-k", metavar="EXPR", dest="keyword", help="only run tests matching the expression (as pytest -k)")
    p.add_argument("-x", "--exitfirst", action="store_true", help="stop at the first failure")
    verbosity = p.add_mutually_exclusive_group()
    verbosity.add_argument("-q", "--quiet", action="store_true", help="less output")
    verbosity.add_argument("-v", "--verbose", action="store_true", help="one line per test")
    return p


def pytest_args(args: argparse.Namespace, extra: list[str]) -> list[str]:
    """The pytest command line for `args`: the plugin, the device and the suite, isolated from the ini file and
    conftest.py files of the directory it is run from (so a project's own pytest settings do not leak in)."""
    here = Path(__file__).resolve().parent
    out = ["-p", "hcq.conformance.plugin", f"--hcq-device={args.device}", "--pyargs", "hcq.conformance.suite",
           "-c", os.devnull, "--rootdir", str(here), "--noconftest", "-p", "no:cacheprovider", "-rfEs",
           "-W", "ignore::pytest.PytestAssertRewriteWarning"]  # hcq is imported before pytest starts: nothing to rewrite
    if args.keyword: out += ["-k", args.keyword]
    if args.exitfirst: out.append("-x")
    if args.quiet: out.append("-q")
    if args.verbose: out.append("-v")
    return out + extra


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:  # the rest goes to pytest as it is
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    args = build_parser().parse_args(argv)
    try:
        import pytest
    except ImportError:
        print("hcq.conformance: the conformance suite needs pytest (pip install pytest)", file=sys.stderr)
        return 1
    import hcq
    try:
        dev = hcq.Device(args.device)
    except Exception as e:  # noqa: BLE001 - report any failure to open the device as a message, not a traceback
        print(f"hcq.conformance: cannot open device {args.device!r}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(f"hcq.conformance: testing {dev.device}", flush=True)
    rc = int(pytest.main(pytest_args(args, extra)))
    if rc == NO_TESTS:
        print(f"hcq.conformance: no tests ran{' (no test matches -k ' + repr(args.keyword) + ')' if args.keyword else ''}; "
              "that counts as a failure", file=sys.stderr)
        return 1
    return rc


if __name__ == "__main__":
    sys.exit(main())
