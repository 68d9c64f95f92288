"""tinygrad on DEV=HCQ vs DEV=CPU (tinygrad's own CPU device), side by side in one run.

    python -m hcq.bench.tinygrad_jit [--ks 1,8,32,128] [--calls 200] [--beam-rounds 5] [--beam-only] [--json hcq-bench-tinygrad.json]

Measures: TinyJit replay of K tiny dependent kernels (time per call; fixed cost and cost per kernel from a
least-squares line over K), a small MLP training step under TinyJit (Adam, batch 64), and the time to build a
kernel tinygrad has not seen (render + compile + load + run). Where a replay's time goes on HCQ is timed
directly: the whole TinyJit call, the graph runner tinygrad calls (hcq.tinygrad's adapter) and the hcq graph
replay inside it; the rest is tinygrad's own Python. cProfile shares (tinygrad / hcq / other) are given for
both devices too (cProfile slows everything: shares, not times).

BEAM=1 search (compile-heavy: tinygrad renders, compiles, loads and times every candidate kernel): each round
runs one fresh process per device, the devices alternating which goes first. A process warms up with a BEAM=1
search of a BEAM_WARM x BEAM_WARM matmul (device open, imports, compile cache directory), then times the BEAM=1
search of a BEAM_N x BEAM_N matmul with new compile workers (tinygrad replaces each worker after 16 compiles; left
over from the warm-up, those restarts would fall anywhere in the timed search). Both devices search cold:
CACHELEVEL=0 turns off tinygrad's disk cache (BEAM results and DEV=CPU's compiled objects) and every process gets
an empty HCQ_CACHE_DIR, so the timed search compiles every candidate on both devices (the warm-up's kernels have
other sizes). All processes read Python bytecode from one cache of the bench's, as from an installed package (with
PYTHONDONTWRITEBYTECODE set, each new worker would compile hcq's modules from source). A search runs until a round
finds nothing faster, so its length varies with the timings: rounds, candidates and the time per compiled
candidate are reported too. The two devices time kernels differently (HCQ by device timestamps, tinygrad's CPU
device by the host clock around the call), so their searches can take different paths. A second search per process
kind takes the same path on both: every candidate is still compiled, loaded and timed (three runs, no early stop),
but its score is a fixed number drawn from its options, so both devices pick the same kernels round after round
(`same path` rows: the cost of BEAM's machinery alone)."""
from __future__ import annotations

import argparse
import cProfile
import hashlib
import json
import math
import os
import pstats
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

DEVICES = ("HCQ", "CPU")
BEAM_N, BEAM_WARM = 32, 24  # matmul sizes of the timed BEAM search and of the warm-up search before it


def _setup() -> Any:
    import hcq.tinygrad  # noqa: F401  (registers HCQ)
    import tinygrad
    return tinygrad


def chain_jit(tg: Any, dev: str, k: int) -> Callable[[], Any]:
    """A TinyJit of k dependent elementwise kernels on 16 floats, captured and ready to replay."""
    Tensor, TinyJit = tg.Tensor, tg.TinyJit

    @TinyJit
    def f(x: Any) -> Any:
        for _ in range(k): x = (x + 1).contiguous()
        return x.realize()
    x = Tensor.zeros(16, device=dev).contiguous().realize()
    for _ in range(3): f(x)
    expect = 16 * k
    got = f(x).sum().item()
    if got != expect: raise AssertionError(f"{dev}: chain of {k} kernels gave {got}, expected {expect}")
    return lambda: f(x)


def time_calls(fn: Callable[[], Any], sync: Callable[[], None], calls: int, rounds: int = 5) -> float:
    """Seconds per call: the best of `rounds` rounds of `calls` back-to-back calls (ending with a synchronize)."""
    best = float("inf")
    for _ in range(rounds):
        sync()
        t0 = time.perf_counter()
        for _ in range(calls): fn()
        sync()
        best = min(best, (time.perf_counter() - t0) / calls)
    return best


def fit_line(xs: list[int], ys: list[float]) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line through (xs, ys)."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - slope * mx, slope


def where_time_goes(fn: Callable[[], Any], calls: int) -> dict[str, float]:
    """Shares of host time (cProfile tottime) in tinygrad, hcq and everything else."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls): fn()
    prof.disable()
    shares = {"tinygrad": 0.0, "hcq": 0.0, "other": 0.0}
    for (path, _, _), row in pstats.Stats(prof).stats.items():  # type: ignore[attr-defined]
        norm = path.replace(os.sep, "/")
        key = "tinygrad" if "/tinygrad/" in norm else "hcq" if "/hcq/" in norm else "other"
        shares[key] += row[2]
    total = sum(shares.values()) or 1.0
    return {k: v / total for k, v in shares.items()}


def replay_breakdown(tg: Any, k: int, calls: int) -> dict[str, float]:
    """Seconds per call on HCQ: the TinyJit call, the graph runner inside it, and the hcq graph replay inside that."""
    from hcq.tinygrad.graph import HCQTinyGraph
    made: list[HCQTinyGraph] = []
    seen: list[tuple[Any, Any]] = []
    real_init, real_call = HCQTinyGraph.__init__, HCQTinyGraph.__call__

    def spy_init(self: HCQTinyGraph, *a: Any, **kw: Any) -> None:
        real_init(self, *a, **kw)
        made.append(self)

    def spy_call(self: HCQTinyGraph, input_uops: Any, var_vals: Any, wait: bool = False) -> Any:
        seen.append((input_uops, var_vals))
        return real_call(self, input_uops, var_vals, wait)
    HCQTinyGraph.__init__, HCQTinyGraph.__call__ = spy_init, spy_call  # type: ignore[method-assign]
    try:
        fn = chain_jit(tg, "HCQ", k)
        fn()
    finally:
        HCQTinyGraph.__init__, HCQTinyGraph.__call__ = real_init, real_call  # type: ignore[method-assign]
    if len(made) != 1: raise AssertionError(f"expected one graph for a {k}-kernel chain, got {len(made)} (JIT_BATCH_SIZE?)")
    runner, (input_uops, var_vals) = made[0], seen[-1]
    inputs = [input_uops[slot].buffer.ensure_allocated()._buf for slot, _ in runner.input_keys]
    sync = tg.Device["HCQ"].synchronize
    return {"jit_call_s": time_calls(fn, sync, calls), "runner_s": time_calls(lambda: runner(input_uops, var_vals), sync, calls),
            "hcq_graph_s": time_calls(lambda: runner.graph(inputs, {}), sync, calls)}


def mlp_step(tg: Any, dev: str) -> Callable[[], Any]:
    """A TinyJit training step of a 784-128-10 MLP with Adam on a batch of 64, warmed up."""
    Tensor, TinyJit, nn = tg.Tensor, tg.TinyJit, tg.nn
    with tg.Context(DEV=dev):
        Tensor.manual_seed(0)
        l1, l2 = nn.Linear(784, 128), nn.Linear(128, 10)
        opt = nn.optim.Adam(nn.state.get_parameters([l1, l2]), lr=1e-3)
        x, y = Tensor.randn(64, 784).realize(), Tensor.randint(64, high=10).realize()

    @TinyJit
    def step(x: Any, y: Any) -> Any:
        with tg.Context(TRAINING=1):
            opt.zero_grad()
            loss = l2(l1(x).relu()).sparse_categorical_crossentropy(y).backward()
            opt.step()
            return loss.realize()
    for _ in range(4): step(x, y)
    return lambda: step(x, y)


def new_kernel_ms(tg: Any, dev: str, n: int) -> float:
    """Milliseconds to run a kernel tinygrad has not seen before (render, compile, load, run), median of n."""
    times = []
    salt = time.time_ns() % 1_000_000
    for i in range(n):
        t0 = time.perf_counter()
        (tg.Tensor.ones(64, device=dev).contiguous() * (salt + i + 0.5)).realize()
        tg.Device[dev].synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def beam_matmul_s(tg: Any, dev: str, n: int) -> float:
    """Seconds to realize an n x n matmul under BEAM=1 (the search, then the chosen kernel's build and run)."""
    a, b = (tg.Tensor.rand(n, n, device=dev).realize() for _ in range(2))
    tg.Device[dev].synchronize()
    t0 = time.perf_counter()
    with tg.Context(BEAM=1): (a @ b).realize()
    tg.Device[dev].synchronize()
    return time.perf_counter() - t0


def fixed_score(prg: Any) -> float:
    """A score in seconds (10-20 us) that depends only on the candidate's options, the same on every device."""
    opts = repr(prg.src[0].arg.applied_opts).encode()
    return 1e-5 * (1 + int.from_bytes(hashlib.sha256(opts).digest()[:4], "little") / 2**32)


def count_candidates(same_path: bool = False) -> dict[str, Any]:
    """Counters of BEAM's work in this process, kept up to date from now on: rounds, candidates sent to compile and
    candidates timed (each timing makes three programs and runs each once), and each round's fastest candidate (us,
    as the device timed it). With `same_path`, every candidate is timed three times (no early stop, no deadline) and
    scored by fixed_score instead of its times."""
    from tinygrad.codegen.opt import search
    counts: dict[str, Any] = {"rounds": 0, "compiled": 0, "timed": 0, "timing_s": 0.0, "best_us": []}
    actions, time_program = search.get_kernel_actions, search._time_program

    def counted_actions(*a: Any, **kw: Any) -> Any:
        found = actions(*a, **kw)
        counts["rounds"] += 1  # (BEAM=1 keeps one kernel a round, whose actions are the next candidates)
        counts["compiled"] += len(found)
        if not same_path: counts["best_us"].append(math.inf)
        return found

    def counted_timing(*a: Any, **kw: Any) -> Any:
        counts["timed"] += 1
        t0 = time.perf_counter()
        try:
            if not same_path:
                tms = time_program(*a, **kw)
                counts["best_us"][-1] = min(counts["best_us"][-1], min(tms) * 1e6)
                return tms
            tms = time_program(*a, **{**kw, "early_stop": None, "dev_timeout": False})
            return [math.inf] * len(tms) if math.inf in tms else [fixed_score(a[0])] * len(tms)
        finally:
            counts["timing_s"] += time.perf_counter() - t0
    search.get_kernel_actions, search._time_program = counted_actions, counted_timing
    return counts


def beam_child(dev: str, same_path: bool = False) -> dict[str, Any]:
    """In a fresh process: a warm-up BEAM search, then the timed one (see the module's docstring)."""
    from tinygrad.engine.worker import terminate_worker_pool
    tg = _setup()
    counts = count_candidates(same_path)
    warm_s = beam_matmul_s(tg, dev, BEAM_WARM)
    terminate_worker_pool()  # (tinygrad replaces a worker every 16 compiles: both devices' timed searches start with new ones)
    counts.update(rounds=0, compiled=0, timed=0, timing_s=0.0, best_us=[])
    return {"search_s": beam_matmul_s(tg, dev, BEAM_N), "warmup_s": warm_s, **counts,
            "best_us": [us for us in counts["best_us"] if us < math.inf]}  # (a round that timed nothing ends the search; JSON has no infinity)


def beam_process(dev: str, pycache: str, same_path: bool = False) -> dict[str, Any]:
    """beam_child(dev, same_path) in a new interpreter that imports this hcq, with tinygrad's disk cache off, an empty hcq compile
    cache (removed afterwards) and Python's bytecode cached in `pycache` (see beam_compare)."""
    import hcq
    cache = tempfile.mkdtemp(prefix="hcq-bench-beam-")
    root = os.path.dirname(os.path.dirname(os.path.abspath(hcq.__file__)))
    env = {**os.environ, "CACHELEVEL": "0", "HCQ_CACHE_DIR": cache, "PYTHONPYCACHEPREFIX": pycache,
           "PYTHONPATH": os.pathsep.join(filter(None, (root, os.environ.get("PYTHONPATH"))))}
    for var in ("BEAM", "PYTHONDONTWRITEBYTECODE"): env.pop(var, None)
    try:
        proc = subprocess.run([sys.executable, "-m", "hcq.bench.tinygrad_jit", "--beam-child", dev, *(["--same-path"] if same_path else [])], env=env, capture_output=True,
                              text=True, timeout=600)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    if proc.returncode != 0: raise RuntimeError(f"the BEAM run on {dev} failed:\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


BEAM_MODES = {"real": False, "same path": True}  # searches timed per device and round: mode -> same_path


def beam_compare(rounds: int) -> dict[str, Any]:
    """`rounds` BEAM runs per device and mode in fresh processes, alternating which device goes first; medians per
    device. All the processes share one bytecode cache: with PYTHONDONTWRITEBYTECODE set, each new compile worker would
    compile hcq's modules from source (40 ms), while tinygrad's come compiled with its install."""
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {mode: {dev: [] for dev in DEVICES} for mode in BEAM_MODES}
    pycache = tempfile.mkdtemp(prefix="hcq-bench-pycache-")
    try:
        for r in range(rounds):
            for mode, same_path in BEAM_MODES.items():
                for dev in DEVICES if r % 2 == 0 else DEVICES[::-1]: runs[mode][dev].append(beam_process(dev, pycache, same_path))
    finally:
        shutil.rmtree(pycache, ignore_errors=True)
    out: dict[str, Any] = {"n": BEAM_N, "warm_n": BEAM_WARM}
    for mode, by_dev in runs.items():
        m: dict[str, Any] = {"runs": by_dev}
        for dev, rs in by_dev.items():
            m[dev] = {key: statistics.median(x[key] for x in rs) for key in ("search_s", "rounds", "compiled", "timed", "timing_s")}
            m[dev]["per_candidate_s"] = statistics.median(x["search_s"] / max(1, x["compiled"]) for x in rs)
            if bests := [x["best_us"] for x in rs if x["best_us"]]:  # the kernel kept after the first round, and the one the search ended with
                m[dev]["first_us"] = statistics.median(b[0] for b in bests)
                m[dev]["final_us"] = statistics.median(min(b) for b in bests)
        m["hcq_over_cpu"] = m["HCQ"]["search_s"] / m["CPU"]["search_s"]
        out[mode] = m
    return out


def run(ks: list[int], calls: int) -> dict[str, Any]:
    tg = _setup()
    out: dict[str, Any] = {"ks": ks, "devices": {}}
    for dev in DEVICES:
        sync = tg.Device[dev].synchronize
        fns = {k: chain_jit(tg, dev, k) for k in ks}
        per_call = {k: time_calls(fns[k], sync, calls) for k in ks}
        fixed, per_kernel = fit_line(ks, [per_call[k] for k in ks])
        step = mlp_step(tg, dev)
        out["devices"][dev] = {
            "replay_s": per_call, "fixed_s": fixed, "per_kernel_s": per_kernel,
            "mlp_step_s": time_calls(step, sync, max(5, calls // 20)),
            "new_kernel_ms": new_kernel_ms(tg, dev, 5),
            "host_shares_kmax": where_time_goes(fns[max(ks)], max(20, calls // 5)),
        }
    out["hcq_breakdown"] = replay_breakdown(tg, 16, calls)
    return out


def report(res: dict[str, Any]) -> str:
    h, c = res["devices"]["HCQ"], res["devices"]["CPU"]
    rows = [("metric", "DEV=HCQ", "DEV=CPU", "CPU/HCQ (>1: hcq faster)")]
    for k in res["ks"]:
        rows.append((f"TinyJit replay, {k} kernels (us/call)", f"{h['replay_s'][k] * 1e6:.1f}", f"{c['replay_s'][k] * 1e6:.1f}",
                     f"{c['replay_s'][k] / h['replay_s'][k]:.2f}x"))
    rows.append(("replay fixed cost (us)", f"{h['fixed_s'] * 1e6:.1f}", f"{c['fixed_s'] * 1e6:.1f}", f"{c['fixed_s'] / h['fixed_s']:.2f}x"))
    rows.append(("replay cost per kernel (us)", f"{h['per_kernel_s'] * 1e6:.2f}", f"{c['per_kernel_s'] * 1e6:.2f}",
                 f"{c['per_kernel_s'] / h['per_kernel_s']:.2f}x"))
    rows.append(("MLP train step, TinyJit (ms)", f"{h['mlp_step_s'] * 1e3:.2f}", f"{c['mlp_step_s'] * 1e3:.2f}",
                 f"{c['mlp_step_s'] / h['mlp_step_s']:.2f}x"))
    rows.append(("new kernel: render+compile+load+run (ms)", f"{h['new_kernel_ms']:.1f}", f"{c['new_kernel_ms']:.1f}",
                 f"{c['new_kernel_ms'] / h['new_kernel_ms']:.2f}x"))
    b = res["hcq_breakdown"]
    rows.append(("HCQ, 16-kernel replay: TinyJit call (us)", f"{b['jit_call_s'] * 1e6:.1f}", "", ""))
    rows.append(("  tinygrad's own Python (us)", f"{(b['jit_call_s'] - b['runner_s']) * 1e6:.1f}", "", ""))
    rows.append(("  hcq.tinygrad graph runner (us)", f"{(b['runner_s'] - b['hcq_graph_s']) * 1e6:.1f}", "", ""))
    rows.append(("  hcq graph replay (us)", f"{b['hcq_graph_s'] * 1e6:.1f}", "", ""))
    for dev, d in res["devices"].items():
        s = d["host_shares_kmax"]
        rows.append((f"{dev}: host time of a {max(res['ks'])}-kernel replay", f"tinygrad {s['tinygrad']:.0%}", f"hcq {s['hcq']:.0%}",
                     f"other {s['other']:.0%}"))
    return table(rows)


def table(rows: list[tuple[str, str, str, str]]) -> str:
    """`rows` (the first is the header) as a markdown table with aligned columns."""
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    return "\n".join("| " + " | ".join(v.ljust(w) for v, w in zip(r, widths)) + " |" for r in rows)


def beam_report(b: dict[str, Any]) -> str:
    rows = [(f"BEAM=1 search, {b['n']}x{b['n']} matmul, fresh processes", "DEV=HCQ", "DEV=CPU", "HCQ/CPU (<=1: hcq as fast or faster)")]
    for mode in BEAM_MODES:
        m = b[mode]
        h, c = m["HCQ"], m["CPU"]
        searches = {dev: ", ".join(f"{x['search_s']:.2f}" for x in m["runs"][dev]) for dev in DEVICES}
        rows += [
            (f"{mode}: search (s, median of {len(m['runs']['HCQ'])})", f"{h['search_s']:.2f}", f"{c['search_s']:.2f}", f"{m['hcq_over_cpu']:.2f}x"),
            (f"{mode}: each search (s)", searches["HCQ"], searches["CPU"], ""),
            (f"{mode}: per candidate compiled (ms, median)", f"{h['per_candidate_s'] * 1e3:.0f}", f"{c['per_candidate_s'] * 1e3:.0f}",
             f"{h['per_candidate_s'] / c['per_candidate_s']:.2f}x"),
            (f"{mode}: timing candidates in the main process (s, median)", f"{h['timing_s']:.2f}", f"{c['timing_s']:.2f}",
             f"{h['timing_s'] / c['timing_s']:.2f}x"),
            (f"{mode}: rounds / candidates compiled / timed (medians)", f"{h['rounds']:.0f} / {h['compiled']:.0f} / {h['timed']:.0f}",
             f"{c['rounds']:.0f} / {c['compiled']:.0f} / {c['timed']:.0f}", ""),
        ]
        if "first_us" in h and "first_us" in c:
            rows.append((f"{mode}: fastest kernel after round 1 -> at the end (us, the device's own timing, medians)",
                         f"{h['first_us']:.2f} -> {h['final_us']:.2f}", f"{c['first_us']:.2f} -> {c['final_us']:.2f}", ""))
    return table(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hcq.bench.tinygrad_jit", description=__doc__.splitlines()[0])
    ap.add_argument("--ks", default="1,8,32,128", help="kernel counts of the replayed chains")
    ap.add_argument("--calls", type=int, default=200, help="replays per timing round")
    ap.add_argument("--beam-rounds", type=int, default=5, help="BEAM=1 searches per device and mode, each in a fresh process (0: none)")
    ap.add_argument("--beam-only", action="store_true", help="only the BEAM comparison")
    ap.add_argument("--beam-child", metavar="DEV", help=argparse.SUPPRESS)  # (one timed search: what beam_process runs)
    ap.add_argument("--same-path", action="store_true", help=argparse.SUPPRESS)  # (that search scored by fixed_score)
    ap.add_argument("--json", default="hcq-bench-tinygrad.json", help="where to write the results")
    args = ap.parse_args(argv)
    if args.beam_child:
        print(json.dumps(beam_child(args.beam_child, args.same_path)))
        return 0
    res = {} if args.beam_only else run([int(k) for k in args.ks.split(",")], args.calls)
    if res: print(report(res))
    if args.beam_rounds > 0:
        res["beam"] = beam_compare(args.beam_rounds)
        print(beam_report(res["beam"]))
    with open(args.json, "w") as f: json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
