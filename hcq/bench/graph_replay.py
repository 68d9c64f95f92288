"""Graph replay benchmark (issue 3; not a test): K empty kernels in one HCQGraph on CPU:0, for K in
1, 10, 100, 1000.

    python3 hcq/bench/graph_replay.py [--calls 300] [--device-runs 50] [--ks 1,10,100,1000]

Host time is what `g(inputs=...)` costs the caller without waiting: the median over many calls, each made
once the previous run has finished (so it is patching and submitting only). Three cases:
  same    every kernel takes the graph's input; each call passes the same buffer (only the kickoff and
          timeline words change): what the issue's "host cost must not grow with the kernels" is about;
  1 new   only the first kernel takes the input, the others a fixed buffer; calls alternate between two
          input buffers (one kernargs word to patch);
  K new   every kernel takes the input and calls alternate between two buffers: K kernargs words change
          per call, so this one is expected to grow with K (shown for reference, not judged).
"b2b" is the mean per call of a loop of calls that never wait (each call still waits for the previous run
of the same graph, so it includes the device time the host cannot hide), for the "same" case.

Device time is what `g(wait=True)` returns (device seconds from the graph's first queue start to its last
queue end), divided by K; min and median over runs.

Targets from the issue: host time of the 1000-kernel run < 2x the 10-kernel run (judged on "same" and
"1 new"); <= 0.1 us per kernel of device time in a replay."""
from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time

import hcq
from hcq import BufferSpec, ExecItem, HCQBuffer, HCQGraph
from hcq.bench.common import run_time

KERNEL = "HCQ_KERNEL void e(int *x) { }"
HOST_RATIO_TARGET = 2.0
DEVICE_US_PER_KERNEL_TARGET = 0.1


def _host_median(g: HCQGraph, inputs: list[HCQBuffer], calls: int) -> float:
    """Median host microseconds of one call made after the previous run finished."""
    for i in range(5): g(inputs=(inputs[i % len(inputs)],), wait=True)  # warm-up: every symbol patched at least once
    g(inputs=(inputs[-1],), wait=True)
    times = []
    for i in range(calls):
        g.synchronize()
        t0 = time.perf_counter_ns()
        g(inputs=(inputs[i % len(inputs)],))
        times.append(time.perf_counter_ns() - t0)
    g.synchronize()
    return statistics.median(times) / 1e3


def measure(dev: hcq.HCQCompiled, prg: hcq.HCQProgram, k: int, calls: int, device_runs: int) -> dict[str, float]:
    spec = BufferSpec(cpu_access=True)
    x, y, fixed = (dev.allocator.alloc(64, spec) for _ in range(3))
    t_build = time.perf_counter()
    g_all = HCQGraph([ExecItem(prg, (x,)) for _ in range(k)], inputs=(x,))
    build_s = time.perf_counter() - t_build
    g_one = HCQGraph([ExecItem(prg, (x,))] + [ExecItem(prg, (fixed,)) for _ in range(k - 1)], inputs=(x,))
    gc_was = gc.isenabled()
    gc.disable()
    try:
        same = _host_median(g_all, [x], calls)
        one_new = _host_median(g_one, [x, y], calls)
        k_new = _host_median(g_all, [x, y], calls)
        g_all(inputs=(x,), wait=True)
        t0 = time.perf_counter_ns()
        for _ in range(calls): g_all(inputs=(x,))  # back to back, never waiting
        b2b = (time.perf_counter_ns() - t0) / calls
        g_all.synchronize()
        dev_s = [run_time(g_all(inputs=(x,), wait=True)) for _ in range(device_runs)]
    finally:
        if gc_was: gc.enable()
    return {"k": k, "build_ms": build_s * 1e3, "same_us": same, "one_us": one_new, "knew_us": k_new, "b2b_us": b2b / 1e3,
            "dev_min_us": min(dev_s) * 1e6, "dev_med_us": statistics.median(dev_s) * 1e6}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=300, help="host-timed calls per K (median taken)")
    ap.add_argument("--device-runs", type=int, default=50, help="g(wait=True) runs per K for the device time")
    ap.add_argument("--ks", default="1,10,100,1000", help="comma-separated kernel counts")
    args = ap.parse_args()
    ks = [int(x) for x in args.ks.split(",")]

    dev = hcq.Device("CPU:0")
    prg = dev.compile(KERNEL, "e")
    print(f"device {dev.device}: {getattr(dev, 'num_workers', '?')} workers; {args.calls} host calls, {args.device_runs} device runs per K")
    rows = [measure(dev, prg, k, args.calls, args.device_runs) for k in ks]

    hdr = (f"{'K':>5} {'build ms':>9} {'host us: same':>14} {'1 new':>8} {'K new':>9} {'b2b us':>8} {'dev min us':>11} "
           f"{'dev med us':>11} {'dev ns/kernel min/med':>22}")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        per_min, per_med = r["dev_min_us"] / r["k"] * 1e3, r["dev_med_us"] / r["k"] * 1e3
        print(f"{r['k']:>5} {r['build_ms']:>9.2f} {r['same_us']:>14.2f} {r['one_us']:>8.2f} {r['knew_us']:>9.2f} {r['b2b_us']:>8.2f} "
              f"{r['dev_min_us']:>11.2f} {r['dev_med_us']:>11.2f} {per_min:>10.1f} / {per_med:<10.1f}")

    by_k = {r["k"]: r for r in rows}
    print()
    if 10 in by_k and 1000 in by_k:
        for key, what in (("same_us", "same inputs"), ("one_us", "1 kernel's input changes")):
            ratio = by_k[1000][key] / by_k[10][key]
            print(f"host(1000)/host(10), {what}: {by_k[1000][key]:.2f} us / {by_k[10][key]:.2f} us = {ratio:.2f}x "
                  f"(target < {HOST_RATIO_TARGET:g}x): {'MET' if ratio < HOST_RATIO_TARGET else 'NOT MET'}")
        ratio = by_k[1000]["knew_us"] / by_k[10]["knew_us"]
        print(f"  for reference, every kernel's input changes (K words to patch): {ratio:.2f}x; "
              f"back to back (same inputs, waits for the previous run): {by_k[1000]['b2b_us'] / by_k[10]['b2b_us']:.2f}x")
    big = by_k[max(by_k)]
    per_min, per_med = big["dev_min_us"] / big["k"], big["dev_med_us"] / big["k"]
    ok = per_min <= DEVICE_US_PER_KERNEL_TARGET
    print(f"device time per kernel at K={big['k']}: min {per_min * 1e3:.1f} ns, median {per_med * 1e3:.1f} ns "
          f"(target <= {DEVICE_US_PER_KERNEL_TARGET * 1e3:.0f} ns, judged on the min): {'MET' if ok else 'NOT MET'}"
          + ("" if not ok or per_med <= DEVICE_US_PER_KERNEL_TARGET else " (median above target)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
