"""Before/after the hot paths, alternated in fresh processes (source checkout only):

    python -m tools.hotpath_ab DIR_BEFORE DIR_AFTER [--rounds 5] [--no-ext-rounds 3]

DIR_BEFORE and DIR_AFTER are checkouts of two commits (`git worktree add DIR REV`), each with its extension built
(`python setup.py build_ext --inplace` there). Each round runs one fresh process per side, before then after (after then before in odd rounds), with the
extension and then (`HCQ_HOTPATH=0`) without it; every process measures the rows below on a fresh CPU:0 and prints
them as JSON. The table gives each row's median over the rounds and its range, in microseconds:

    rt            prg(buf); dev.synchronize()  (empty kernel, median of 3000)
    pipe, pipe4   prg(...) back to back, per launch (1 buffer; 4 buffers + 4 values), best of 7 x 5000
    resubmit      a built 10-command queue re-submitted with its Variable changed, best of 7 x 500
    graph_g       g() of a one-kernel HCQGraph (median of 2000, each followed by g.synchronize())
    graph_wait    g(); g.synchronize()
    copyin4k      allocator.copyin / copyout of 4 KiB (median of 2000)
    timed_launch  prg(buf, wait=True) (the Python run of a timed plan; median of 300)"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

MEASURE = r"""
import json, statistics, time
import numpy as np
import hcq
from hcq import HCQGraph, ExecItem, Variable
med = statistics.median
dev = hcq.Device("CPU:0")
spec = hcq.BufferSpec(cpu_access=True)
prg = dev.compile("HCQ_KERNEL void empty(float *a) { }", "empty")
prg4 = dev.compile("HCQ_KERNEL void four(float *a, float *b, float *c, float *d, int w, int x, int y, int z) { }", "four")
buf = dev.allocator.alloc(64, spec)
bufs = [dev.allocator.alloc(64, spec) for _ in range(4)]
out = {}
def per(fn, n, reps=7):
    r = []
    for _ in range(reps):
        t = time.perf_counter_ns()
        for _ in range(n): fn()
        dev.synchronize()
        r.append((time.perf_counter_ns() - t) / n / 1e3)
    return min(r)
def each(fn, n, after=None):
    r = []
    for _ in range(n):
        t = time.perf_counter_ns(); fn(); r.append((time.perf_counter_ns() - t) / 1e3)
        if after is not None: after()
    return med(r)
for _ in range(500): prg(buf)
dev.synchronize()
out["rt"] = each(lambda: (prg(buf), dev.synchronize()), 3000)
out["pipe"] = per(lambda: prg(buf), 5000)
out["pipe4"] = per(lambda: prg4(*bufs, vals=(1, 2, 3, 4)), 5000)
v, sig = Variable("v", 0, 1000), dev.new_signal()
q = dev.hw_compute_queue_t().wait(dev.timeline_signal, 0).memory_barrier()
for _ in range(7): q.write(sig.value_addr, v)
q.signal(sig, v)
q.submit(dev, {"v": 1}); dev.synchronize()
out["resubmit"] = per(lambda: q.submit(dev, {"v": 5}), 500)
a = dev.allocator.alloc(64, spec)
g = HCQGraph([ExecItem(prg, (a,), (), 1)])
g(); g.synchronize()
out["graph_g"] = each(g, 2000, g.synchronize)
out["graph_wait"] = each(lambda: (g(), g.synchronize()), 2000)
host = memoryview(np.zeros(1024, np.float32)).cast("B")
d = dev.allocator.alloc(4096, spec)
out["copyin4k"] = each(lambda: dev.allocator.copyin(d, host), 2000)
out["copyout4k"] = each(lambda: dev.allocator.copyout(host, d), 2000)
out["timed_launch"] = each(lambda: prg(buf, wait=True), 300)
print(json.dumps(out))
"""


def run(src: str, extension: bool) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": os.path.abspath(src), "HCQ_HOTPATH": "1" if extension else "0"}
    proc = subprocess.run([sys.executable, "-c", MEASURE], env=env, cwd="/", capture_output=True, text=True, timeout=600)
    if proc.returncode != 0: raise SystemExit(f"{src}: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("before"), ap.add_argument("after")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--no-ext-rounds", type=int, default=3)
    args = ap.parse_args()
    for extension, rounds in ((True, args.rounds), (False, args.no_ext_rounds)):
        got: dict[str, list[dict[str, float]]] = {"before": [], "after": []}
        if not rounds: continue
        for r in range(rounds):  # (the order alternates too: the second process of a pair may find the machine otherwise)
            for side in ("before", "after")[::1 if r % 2 == 0 else -1]: got[side].append(run(getattr(args, side), extension))
        print(f"\n{'with' if extension else 'without'} the extension ({rounds} alternated rounds; us, median [range])")
        print(f"  {'':13s} {'before':>24s}  {'after':>24s}")
        for row in got["before"][0]:
            cells = []
            for side in ("before", "after"):
                xs = [r[row] for r in got[side]]
                cells.append(f"{statistics.median(xs):7.2f} [{min(xs):.2f}-{max(xs):.2f}]")
            print(f"  {row:13s} {cells[0]:>24s}  {cells[1]:>24s}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
