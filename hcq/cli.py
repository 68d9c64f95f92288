"""The `hcq` command line: `hcq demo` (the main job for a newcomer), `hcq info`, `hcq profile`, `hcq bench`."""
from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from array import array
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Callable, cast

if TYPE_CHECKING:
    from hcq.symbolic import sint

SAXPY = """
HCQ_KERNEL void saxpy(float *y, const float *x, float a, int n) {
  long i = hcq_global_id(0);
  if (i < n) y[i] = a * x[i] + y[i];
}
"""
SCALE_ADD = """
HCQ_KERNEL void scale_add(float *out, const float *in, float s, float b, int n) {
  long i = hcq_global_id(0);
  if (i < n) out[i] = in[i] * s + b;
}
"""
EMPTY = "HCQ_KERNEL void empty(int *unused) { }"

COMMANDS_GROUP = "hcq.commands"  # entry points: name = command, value = add_command(subparsers, common_parser)


def _step(msg: str) -> None:
    print(f"  {msg}", flush=True)


def _floats(n: int, f: Callable[[int], float]) -> array:
    return array("f", (f(i) for i in range(n)))


def _vals(*vals: float | sint) -> tuple[sint, ...]:
    """Scalar kernel arguments: floats go to float parameters (the runtime's `vals` annotations name sint only)."""
    return cast("tuple[sint, ...]", vals)


def _seconds(t: float | None) -> float:
    """The device time a call made with wait=True returns."""
    if t is None: raise RuntimeError("a call made with wait=True returned no time")
    return t


def demo(args: argparse.Namespace) -> int:
    """Compile kernels, run them on CPU:0 and CPU:1 with copies between, replay a bound symbolic queue and
    an HCQGraph, check every result against Python, print timings and write a trace."""
    import hcq
    n = args.n
    d0, d1 = hcq.Device("CPU:0"), hcq.Device("CPU:1")
    print(f"hcq demo: {d0.device} and {d1.device}, peer group {d0.peer_group!r}, n={n}")
    for line in d0.describe(): _step(line)
    t = time.perf_counter()
    saxpy, scale_add = d0.compile(SAXPY, "saxpy"), d1.compile(SCALE_ADD, "scale_add")
    _step(f"compiled saxpy and scale_add ({time.perf_counter() - t:.2f} s, cached on disk after the first run)")

    x, y = _floats(n, lambda i: float(i % 1000)), _floats(n, lambda i: 1.0)
    nbytes = n * 4
    bx, by = d0.allocator.alloc(nbytes), d0.allocator.alloc(nbytes)
    d0.allocator.copyin(bx, memoryview(x).cast("B"))
    d0.allocator.copyin(by, memoryview(y).cast("B"))
    block = 256
    grid = (n + block - 1) // block
    kt = _seconds(saxpy(by, bx, vals=_vals(2.0, n), global_size=(grid, 1, 1), local_size=(block, 1, 1), wait=True))
    _step(f"saxpy on {d0.device}: {kt * 1e6:.0f} us ({nbytes * 3 / kt / 1e9:.1f} GB/s)")

    b1_in, b1_out = d1.allocator.alloc(nbytes), d1.allocator.alloc(nbytes)
    d1.allocator.transfer(b1_in, by, nbytes, src_dev=d0, dest_dev=d1)
    kt = _seconds(scale_add(b1_out, b1_in, vals=_vals(0.5, 3.0, n), global_size=(grid, 1, 1), local_size=(block, 1, 1), wait=True))
    _step(f"transferred {nbytes / 1024:.0f} KiB {d0.device} -> {d1.device}, scale_add on {d1.device}: {kt * 1e6:.0f} us")
    out = array("f", bytes(nbytes))
    d1.allocator.copyout(memoryview(out).cast("B"), b1_out)
    bad = sum(1 for i in range(n) if out[i] != (2.0 * (i % 1000) + 1.0) * 0.5 + 3.0)
    if bad: raise AssertionError(f"{bad} of {n} results differ from Python")
    _step(f"checked {n} results against Python: all equal")

    # A queue built once with symbols, bound to device memory, replayed with only changed words patched.
    nv = hcq.Variable("n", 1, n)
    sig = d0.new_signal(value=0)
    args_state = saxpy.fill_kernargs((by, bx), vals=_vals(1.0, nv))
    q = d0.hw_compute_queue_t().wait(d0.timeline_signal, d0.timeline_value - 1) \
        .exec(saxpy, args_state, ((nv + block - 1) // block, 1, 1), (block, 1, 1)).signal(sig, hcq.Variable("k", 0, 1 << 40))
    q.bind(d0)
    d0.synchronize()
    replays = 8
    for k in range(1, replays + 1):
        q.submit(d0, {"n": n // k, "k": k})
        sig.wait(k)
    d0.allocator.copyout(memoryview(out).cast("B"), by)
    expect = lambda i: 2.0 * (i % 1000) + 1.0 + (i % 1000) * sum(1 for k in range(1, replays + 1) if i < n // k)  # noqa: E731
    bad = sum(1 for i in range(0, n, 97) if out[i] != expect(i))
    if bad: raise AssertionError(f"bound-queue replay: {bad} sampled results differ from Python")
    _step(f"bound symbolic queue replayed {replays}x with n = n/1..n/{replays}: results checked")

    # The same pipeline as an HCQGraph: static queues on both devices, replayed with a new input each run.
    out_g = d1.allocator.alloc(nbytes)
    graph = hcq.HCQGraph([hcq.ExecItem(saxpy, (by, bx), _vals(2.0, n), (grid, 1, 1), (block, 1, 1)),
                          hcq.CopyItem(b1_in, by, nbytes),
                          hcq.ExecItem(scale_add, (out_g, b1_in), _vals(0.5, 3.0, n), (grid, 1, 1), (block, 1, 1))], inputs=(bx,))
    d0.allocator.copyin(by, memoryview(y).cast("B"))
    bx2 = d0.allocator.alloc(nbytes)
    d0.allocator.copyin(bx2, memoryview(_floats(n, lambda i: 1.0)).cast("B"))
    runs = 50
    t = time.perf_counter()
    for _ in range(runs): graph(inputs=(bx2,))
    host = (time.perf_counter() - t) / runs
    gt = _seconds(graph(inputs=(bx2,), wait=True))
    d1.allocator.copyout(memoryview(out).cast("B"), out_g)
    bad = sum(1 for i in range(0, n, 31) if out[i] != (1.0 + 2.0 * (runs + 1)) * 0.5 + 3.0)
    if bad: raise AssertionError(f"graph replay: {bad} sampled results differ from Python")
    _step(f"HCQGraph over {d0.device} and {d1.device} (3 items) replayed {runs + 1}x with a new input: "
          f"{host * 1e6:.0f} us per run back to back (each waits for the previous), {gt * 1e6:.0f} us device time per run; "
          "results checked")

    empty = d0.compile(EMPTY, "empty")
    reps = 2000
    for _ in range(100): empty(bx)
    d0.synchronize()
    t = time.perf_counter()
    for _ in range(reps): empty(bx); d0.synchronize()
    rt = (time.perf_counter() - t) / reps
    t = time.perf_counter()
    for _ in range(reps): empty(bx)
    d0.synchronize()
    pl = (time.perf_counter() - t) / reps
    _step(f"empty kernel: submit+wait round trip {rt * 1e6:.1f} us, pipelined {pl * 1e6:.1f} us per kernel")

    big = 64 << 20
    src = bytearray(os.urandom(1 << 20)) * 64
    bb = d0.allocator.alloc(big)
    d0.allocator.copyin(bb, memoryview(src))  # first touch of fresh pages costs page faults; time the steady state
    t = time.perf_counter()
    d0.allocator.copyin(bb, memoryview(src))
    cin = big / (time.perf_counter() - t) / 1e9
    dst = bytearray(big)
    d0.allocator.copyout(memoryview(dst), bb)
    t = time.perf_counter()
    d0.allocator.copyout(memoryview(dst), bb)
    cout = big / (time.perf_counter() - t) / 1e9
    if dst != src: raise AssertionError("64 MiB copy round trip differs")
    _step(f"64 MiB copyin {cin:.1f} GB/s, copyout {cout:.1f} GB/s (round trip checked)")

    with hcq.profile() as prof:
        for _ in range(3): saxpy(by, bx, vals=_vals(1.0, n), global_size=(grid, 1, 1), local_size=(block, 1, 1))
        d1.allocator.transfer(b1_in, by, nbytes, src_dev=d0, dest_dev=d1)
        traced = hcq.HCQGraph(graph.items, inputs=(bx,))  # built while profiling: per-item events with dependencies
        for _ in range(2): traced(inputs=(bx2,))
        d0.allocator.copyout(memoryview(out).cast("B"), by)
    path = prof.write(args.trace)
    _step(f"trace of {len(prof.events)} events written to {os.path.abspath(path)} (open it in ui.perfetto.dev or chrome://tracing)")
    print("demo OK")
    return 0


def info(args: argparse.Namespace) -> int:
    """Devices, queues, workers, compiler and environment in force."""
    import hcq
    from hcq.toolchain import cache_dir, find_compiler
    names = args.devices or ["CPU:0"]
    for name in names:
        dev = hcq.Device(name)
        print(f"{dev.device}: {type(dev).__name__}, peer group {dev.peer_group!r}")
        for line in dev.describe(): print(f"  {line}")
        for st in (dev.queue_states() if dev.capabilities.queue_states else []):
            cur = st["current"]
            now = "idle" if cur is None else f"running {cur['op']} at ring word {cur['ring_word']}" + \
                (f" (indirect packet {cur['indirect_index']})" if cur["indirect_index"] is not None else "")
            line = f"  queue {st['queue']}: {st['wptr']} words submitted, {st['rptr']} consumed, {st['packets_done']} packets done"
            print(line + (f", {now}" if args.queues else ""))
        if dev.error_state is not None: print(f"  error: {dev.error_state}")
    cc, ver = find_compiler()
    print(f"compiler: {cc} ({ver})")
    from hcq import compile_server
    print(f"compile server: {compile_server.describe(cc)}")
    print(f"kernel cache: {cache_dir()}")
    from hcq import hotpath
    print(f"launch hot path: {'CPython extension (hcq._hotpath)' if hotpath.available() else 'ctypes: the extension is ' + hotpath.why_not}")
    for kind, why in hcq.registry.unavailable_backends().items(): print(f"backend {kind}: unavailable: {why}")
    print(f"peer groups: {', '.join(f'{g}: {[d.device for d in ds]}' for g, ds in hcq.HCQCompiled.peer_groups.items())}")
    env = {k: v for k, v in os.environ.items() if k.startswith("HCQ") or k in ("DEV", "CC")}
    print("environment: " + (", ".join(f"{k}={v}" for k, v in sorted(env.items())) or "(no HCQ variables set)"))
    return 0


def profile_cmd(args: argparse.Namespace) -> int:
    """Run a command with PROFILE=1 and print the summary of the trace it leaves."""
    import json
    import shutil
    import subprocess
    import tempfile

    from hcq.profiler import summarize
    cmd = list(args.cmd)
    if cmd and cmd[0] == "--": cmd = cmd[1:]
    if not cmd: raise ValueError("nothing to run: hcq profile -- python script.py args")
    own_dir = None if args.output else tempfile.mkdtemp(prefix="hcq-profile-")  # kept with the trace in it, for the user
    path = args.output or os.path.join(str(own_dir), "hcq-profile.json")
    if os.path.exists(path): os.remove(path)  # never report an old trace as this run's
    env = dict(os.environ, PROFILE="1", PROFILE_PATH=path)
    print(f"hcq profile: running {' '.join(cmd)}", file=sys.stderr, flush=True)
    rc = subprocess.call(cmd, env=env)
    if not os.path.exists(path):
        if own_dir is not None: shutil.rmtree(own_dir, ignore_errors=True)  # no trace: nothing worth keeping
        raise RuntimeError(f"no profile was written to {path}: did the command import hcq and exit normally? (exit code {rc})")
    with open(path) as f: trace = json.load(f)
    print(summarize(trace, args.top))
    print(f"trace: {path}")
    return rc


def bench_cmd(args: argparse.Namespace) -> int:
    """Run the benchmark suite (`python -m hcq.bench`) with every argument after `hcq bench`."""
    from hcq.bench.__main__ import main as bench_main
    return bench_main(args.rest)


def main(argv: list[str] | None = None) -> int:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help="full tracebacks on errors")
    parser = argparse.ArgumentParser(prog="hcq", description="hcq: compute through hardware command queues", parents=[common])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", parents=[common], help="compile and run kernels on CPU:0 and CPU:1, check results, print timings")
    p.add_argument("--n", type=int, default=1 << 18, help="elements per array (default 262144)")
    p.add_argument("--trace", default="hcq-demo-trace.json", help="where to write the demo's trace (default hcq-demo-trace.json)")
    p.set_defaults(fn=demo)
    p = sub.add_parser("profile", parents=[common], help="run a command under PROFILE=1 and print the summary: hcq profile -- python x.py")
    p.add_argument("-o", "--output", help="trace path (default: a temporary file)")
    p.add_argument("--top", type=int, default=10, help="kernels to list (default 10)")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="the command, after --")
    p.set_defaults(fn=profile_cmd)
    # every argument after `bench` goes to the bench untouched (main splits them off: `hcq bench --help` is the bench's help)
    p = sub.add_parser("bench", add_help=False, help="run the benchmarks against the peers (python -m hcq.bench): "
                       "hcq bench [its options], e.g. --quick --only rt")
    p.set_defaults(fn=bench_cmd, rest=[])
    p = sub.add_parser("info", parents=[common], help="devices, queues, compiler and environment")
    p.add_argument("devices", nargs="*", help="device names (default CPU:0)")
    p.add_argument("--queues", action="store_true", help="also show the packet each queue is running")
    p.set_defaults(fn=info)
    for ep in entry_points(group=COMMANDS_GROUP):  # commands of backends (e.g. `hcq serve`), which the core does not import
        try:
            ep.load()(sub, common)
        except Exception as e:  # noqa: BLE001 - a broken plugin must not take the other commands down
            print(f"hcq: command {ep.name!r} ({ep.value}) is unavailable: {type(e).__name__}: {e}", file=sys.stderr)
    argv = sys.argv[1:] if argv is None else list(argv)
    command_at = next((i for i, a in enumerate(argv) if not a.startswith("-")), len(argv))
    bench_args = argv[command_at + 1:] if argv[command_at:command_at + 1] == ["bench"] else None
    args = parser.parse_args(argv if bench_args is None else argv[:command_at + 1])
    if bench_args is not None: args.rest = bench_args
    args.verbose = getattr(args, "verbose", False)
    try:
        rc: int = args.fn(args)
        sys.stdout.flush()  # a reader that went away shows here, not at exit
        return rc
    except BrokenPipeError:  # `hcq info | head`: the reader stopped reading, which is not an error of ours
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # the interpreter's final flush must not fail again
        return 0
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - one clear line unless -v
        if args.verbose: traceback.print_exc()
        else: print(f"hcq {args.command}: error: {type(e).__name__}: {e} (run with -v for the traceback)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
