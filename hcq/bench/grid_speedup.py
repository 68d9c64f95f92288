"""2-core grid speed-up benchmark (not a test): the same compute-bound kernel on a CPU device with one
worker and on one with two workers, timed by device timestamps. The target (issue 2) is >= 1.8x.

    python3 hcq/bench/grid_speedup.py [--blocks 256] [--iters 200000] [--repeats 5]

HCQ_CPU_WORKERS is read when a device is opened, so each device gets the variable set just before its
first open (distinct device names, fresh in this process)."""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

import hcq
from hcq.bench.common import run_time

KERNEL = r"""
HCQ_KERNEL void spin(double *out, int iters) {
  /* One long dependent floating-point chain per thread: compute-bound, no memory traffic. */
  size_t g = hcq_global_id(0);
  double x = 1.0 + (double)g * 1e-3, y = 0.5;
  for (int i = 0; i < iters; i++) {
    x = x * 0.9999997 + 1e-7;
    y = y * 0.999999 + x * 1e-6;
  }
  out[g] = x + y;
}
"""


def open_device(name: str, workers: int) -> hcq.HCQCompiled:
    """Open `name` with HCQ_CPU_WORKERS=workers (the variable is restored afterwards)."""
    old = os.environ.get("HCQ_CPU_WORKERS")
    os.environ["HCQ_CPU_WORKERS"] = str(workers)
    try:
        dev = hcq.Device(name)
    finally:
        if old is None: os.environ.pop("HCQ_CPU_WORKERS", None)
        else: os.environ["HCQ_CPU_WORKERS"] = old
    if (got := getattr(dev, "num_workers", workers)) != workers:
        raise RuntimeError(f"{name} was already open with {got} workers; use a fresh device name")
    return dev


def run(dev: hcq.HCQCompiled, blocks: int, iters: int, repeats: int = 1, local: int = 1) -> tuple[list[float], np.ndarray]:
    """Run the kernel over `blocks` blocks of `local` threads `repeats` times (after one warm-up run).
    Returns the device times in seconds and the output."""
    n = blocks * local
    prg = dev.compile(KERNEL, "spin")
    spec = hcq.BufferSpec(cpu_access=True)
    buf = dev.allocator.alloc(n * 8, spec)
    try:
        prg(buf, global_size=(blocks, 1, 1), local_size=(local, 1, 1), vals=(iters,), wait=True)  # warm-up
        times = [run_time(prg(buf, global_size=(blocks, 1, 1), local_size=(local, 1, 1), vals=(iters,), wait=True))
                 for _ in range(repeats)]
        out = np.empty(n, np.float64)
        dev.allocator.copyout(out.data, buf)
        return times, out
    finally:
        dev.allocator.free(buf, n * 8, spec)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=256)
    ap.add_argument("--iters", type=int, default=200_000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--target", type=float, default=1.8)
    args = ap.parse_args()

    d1 = open_device("CPU:1", 1)
    d2 = open_device("CPU:2", 2)
    results: dict[int, tuple[float, np.ndarray]] = {}
    for workers, dev in ((1, d1), (2, d2)):  # open_device checked each one's worker count
        t0 = time.perf_counter()
        times, out = run(dev, args.blocks, args.iters, args.repeats)
        wall = time.perf_counter() - t0
        results[workers] = (min(times), out)
        print(f"{dev.device}: {workers} worker(s): best {min(times) * 1e3:9.2f} ms, median "
              f"{sorted(times)[len(times) // 2] * 1e3:9.2f} ms over {len(times)} runs ({wall:.2f} s wall incl. warm-up)")
    (t1, o1), (t2, o2) = results[1], results[2]
    if not np.array_equal(o1, o2):
        print("ERROR: results differ between 1 and 2 workers", file=sys.stderr)
        return 1
    ratio = t1 / t2
    print(f"speed-up 2 workers vs 1: {ratio:.2f}x (target >= {args.target}x: {'met' if ratio >= args.target else 'NOT met'}); "
          f"cores available: {len(os.sched_getaffinity(0))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
