"""Matrix multiply on the CPU device: a naive kernel, a fast one, and numpy, timed in one run.

    python -m hcq.bench.matmul [--n 512 1024] [--reps 10] [--rounds 3] [--naive-reps 2] [--no-naive] [--quiet-wait S]

C = A @ B for n x n float32 matrices, row-major, any n >= 1. The fast kernel is the teaching example of
docs/kernels.md ("Writing fast kernels for the CPU device"); read its comments with that page.

- `matmul_naive`: one thread per element of C, blocks of 16 x 16 threads (the CUDA habit). The body runs
  once per (block, thread) on one worker, so each element is a scalar dot product reading B down a column.
- `matmul_fast`: one block (of one thread) per 96 x 128 tile of C, so a 512 x 512 product is 24 blocks and
  a 1024 x 1024 one 88, spread over the worker threads. Inside a block: slices of B are copied ("packed")
  into a local buffer laid out in the order the inner loop reads them, and each 6 x 16 piece of the tile
  is accumulated in 12 vector registers of 8 floats with fused multiply-adds.

Each kernel is checked against a float64 product (np.allclose, rtol 1e-4, atol 1e-4 * sqrt(n)) and timed
`--reps` times per round, best device time (`prg(..., wait=True)`) and best host wall time (launch +
wait) kept; numpy's `a @ b` is timed in the same rounds. The machine is shared, so the rounds alternate
(fast, numpy, then a pause for OpenBLAS's threads to stop spinning) and the bench prints the share of the
CPU that other processes took."""
from __future__ import annotations

import argparse
import os
import platform
import re
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import hcq
from hcq import arrays
from hcq.bench.common import LoadSampler, cpu_model, wait_for_quiet

SOURCE = r"""
#include <string.h>

/* ---------------------------------------------------------------- naive: one thread per element of C */
HCQ_KERNEL void matmul_naive(float *c, const float *a, const float *b, int n) {
  int64_t i = hcq_global_id(1), j = hcq_global_id(0);
  if (i >= n || j >= n) return;
  float acc = 0.0f;
  for (int64_t k = 0; k < n; k++) acc += a[i * n + k] * b[k * n + j];
  c[i * n + j] = acc;
}

/* ---------------------------------------------------------------- fast: one block per BM x BN tile of C */
#define MR 6     /* register tile: MR rows x NR columns of C, held in MR * NR / 8 = 12 vector registers */
#define NR 16
#define BM 96    /* a block computes a BM x BN tile of C; the grid is (ceil(n / BN), ceil(n / BM)) blocks */
#define BN 128
#define KC 256   /* the k dimension is walked in slices of KC */
_Static_assert(BM % MR == 0 && BN % NR == 0, "a block tile holds whole register tiles");

/* 8 floats, one AVX register. Arithmetic on it is element-wise, and `scalar * vector` broadcasts the scalar.
   Without AVX enabled the compiler splits each operation into two SSE ones. f8u reads and writes 8 floats
   at any float address (aligned(4)) through any float pointer (may_alias). */
typedef float f8 __attribute__((vector_size(32)));
typedef float f8u __attribute__((vector_size(32), aligned(4), may_alias));
#define LOAD8(p) (*(const f8u *)(p))
#define STORE8(p, v) (*(f8u *)(p) = (v))

static inline int64_t imin(int64_t x, int64_t y) { return x < y ? x : y; }

/* B[k0:k0+kc, j:j+nr] -> dst[kc][NR]: the NR values one step of k needs are adjacent; zero-padded to NR. */
static inline __attribute__((always_inline))
void pack_b(float *restrict dst, const float *restrict src, int64_t n, int kc, int nr) {
  if (nr == NR) {
    for (int k = 0; k < kc; k++) memcpy(dst + k * NR, src + k * n, NR * sizeof(float));
  } else {
    for (int k = 0; k < kc; k++)
      for (int j = 0; j < NR; j++) dst[k * NR + j] = j < nr ? src[k * n + j] : 0.0f;
  }
}

/* C[0:mr, 0:nr] = (first ? 0 : C) + A[0:mr, 0:kc] @ bp, where bp is a packed kc x NR slice of B and A is
   read in place, MR rows at once (rows past mr re-read row 0; their sums are dropped). The k loop is the
   whole computation: 2 vector loads of B, MR scalars of A, 2 * MR fused multiply-adds. */
static inline __attribute__((always_inline))
void micro_tile(int kc, const float *restrict a, const float *restrict bp, float *restrict c, int64_t n,
                int mr, int nr, bool first) {
  const float *ar[MR];
  for (int r = 0; r < MR; r++) ar[r] = a + (r < mr ? r : 0) * n;
  f8 acc[MR][2] = {{{0}}};
  for (int k = 0; k < kc; k++) {
    f8 b0 = LOAD8(bp + k * NR), b1 = LOAD8(bp + k * NR + 8);
#pragma GCC unroll 8   /* -O2 does not unroll it (code growth), and a rolled loop keeps acc in memory */
    for (int r = 0; r < MR; r++) {
      acc[r][0] += ar[r][k] * b0;  /* scalar * vector: the scalar is broadcast */
      acc[r][1] += ar[r][k] * b1;
    }
  }
  if (mr == MR && nr == NR) {  /* a whole tile: vector loads and stores */
#pragma GCC unroll 8
    for (int r = 0; r < MR; r++) {
      float *cr = c + r * n;
      if (!first) { acc[r][0] += LOAD8(cr); acc[r][1] += LOAD8(cr + 8); }
      STORE8(cr, acc[r][0]);
      STORE8(cr + 8, acc[r][1]);
    }
  } else {                     /* an edge tile: element by element */
    for (int r = 0; r < mr; r++)
      for (int j = 0; j < nr; j++) {
        float v = acc[r][j / 8][j % 8];
        c[r * n + j] = first ? v : c[r * n + j] + v;
      }
  }
}

/* One block's work: C[i0:i0+BM, j0:j0+BN] = A[i0:i0+BM, :] @ B[:, j0:j0+BN], clipped to n. The packed
   slice of B lives on the worker thread's stack (KC * BN * 4 = 128 KB). */
static inline __attribute__((always_inline))
void matmul_tile(float *restrict c, const float *restrict a, const float *restrict b, int64_t n, int64_t i0, int64_t j0) {
  float bp[KC * BN] __attribute__((aligned(64)));
  int64_t m = imin(BM, n - i0), w = imin(BN, n - j0);
  for (int64_t k0 = 0; k0 < n; k0 += KC) {
    int kc = (int)imin(KC, n - k0);
    for (int64_t jp = 0; jp < w; jp += NR) pack_b(bp + jp * KC, b + k0 * n + j0 + jp, n, kc, (int)imin(NR, w - jp));
    for (int64_t jp = 0; jp < w; jp += NR)    /* one KC x NR slice of B (16 KB, in L1), used by every MR rows */
      for (int64_t ip = 0; ip < m; ip += MR)
        micro_tile(kc, a + (i0 + ip) * n + k0, bp + jp * KC, c + (i0 + ip) * n + j0 + jp, n,
                   (int)imin(MR, m - ip), (int)imin(NR, w - jp), k0 == 0);
  }
}

/* The same C compiled twice: for AVX2 + FMA (x86-64-v3; chosen at run time when the CPU has them) and for
   the compiler's default target (x86-64 means SSE2: 4-float vectors, separate multiply and add). Both are
   real calls, not inlined: a kernel body is inlined into hcq's trampoline, which is built for the default
   target, and code for AVX2 cannot be inlined into it. */
#if defined(__x86_64__) && !defined(MATMUL_PORTABLE)
__attribute__((target("avx2,fma"), noinline))
static void matmul_tile_avx2(float *restrict c, const float *restrict a, const float *restrict b, int64_t n, int64_t i0, int64_t j0) {
  matmul_tile(c, a, b, n, i0, j0);
}
#endif
__attribute__((noinline))
static void matmul_tile_portable(float *restrict c, const float *restrict a, const float *restrict b, int64_t n, int64_t i0, int64_t j0) {
  matmul_tile(c, a, b, n, i0, j0);
}

HCQ_KERNEL void matmul_fast(float *restrict c, const float *restrict a, const float *restrict b, int n) {
  int64_t i0 = hcq_group_id(1) * BM, j0 = hcq_group_id(0) * BN;
#if defined(__x86_64__) && !defined(MATMUL_PORTABLE)
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
    matmul_tile_avx2(c, a, b, n, i0, j0);
    return;
  }
#endif
  matmul_tile_portable(c, a, b, n, i0, j0);
}
"""

TILE_M = int(re.search(r"#define BM (\d+)", SOURCE)[1])  # type: ignore[index]
TILE_N = int(re.search(r"#define BN (\d+)", SOURCE)[1])  # type: ignore[index]
NAIVE_LOCAL = 16


def fast_dims(n: int) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """(global_size, local_size) for matmul_fast: one block of one thread per TILE_M x TILE_N tile of C."""
    return ((n + TILE_N - 1) // TILE_N, (n + TILE_M - 1) // TILE_M, 1), (1, 1, 1)


def naive_dims(n: int) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """(global_size, local_size) for matmul_naive: 16 x 16 threads per block, one thread per element."""
    g = (n + NAIVE_LOCAL - 1) // NAIVE_LOCAL
    return (g, g, 1), (NAIVE_LOCAL, NAIVE_LOCAL, 1)


def compile_kernels(dev: Any, portable: bool = False) -> dict[str, Any]:
    """{'naive': program, 'fast': program}. portable=True compiles without the AVX2 path (for tests)."""
    src = ("#define MATMUL_PORTABLE 1\n" if portable else "") + SOURCE
    return {"naive": dev.compile(src, "matmul_naive"), "fast": dev.compile(src, "matmul_fast")}


def matmul(dev: Any, prg: Any, a: np.ndarray, b: np.ndarray, kind: str = "fast") -> np.ndarray:
    """C = a @ b on `dev` with the compiled `prg` ('fast' or 'naive' launch shape); returns C."""
    n = a.shape[0]
    if a.shape != (n, n) or b.shape != (n, n): raise ValueError(f"square matrices of one size only, got {a.shape} and {b.shape}")
    ab, bb = arrays.upload(dev, a.astype(np.float32)), arrays.upload(dev, b.astype(np.float32))
    cb = dev.allocator.alloc(n * n * 4)
    try:
        gs, ls = fast_dims(n) if kind == "fast" else naive_dims(n)
        prg(cb, ab, bb, vals=(n,), global_size=gs, local_size=ls, wait=True)
        return arrays.download(cb, np.float32, (n, n))
    finally:
        for buf in (ab, bb, cb): dev.allocator.free(buf, buf.size)


def check(c: np.ndarray, ref64: np.ndarray) -> bool:
    """float32 result against a float64 reference: rtol 1e-4, atol 1e-4 * sqrt(n) (the entries are ~sqrt(n))."""
    return bool(np.allclose(c, ref64, rtol=1e-4, atol=1e-4 * np.sqrt(ref64.shape[0])))


@dataclass
class Result:
    name: str
    n: int
    device_s: list[float] = field(default_factory=list)
    wall_s: list[float] = field(default_factory=list)
    ok: bool | None = None

    def gflops(self, secs: float) -> float:
        return 2.0 * self.n ** 3 / secs / 1e9

    @property
    def best_device(self) -> float:
        return min(self.device_s) if self.device_s else float("nan")

    @property
    def best_wall(self) -> float:
        return min(self.wall_s) if self.wall_s else float("nan")


def _time_kernel(dev: Any, prg: Any, bufs: tuple, n: int, dims: tuple, reps: int, res: Result) -> None:
    gs, ls = dims
    for _ in range(reps):
        t0 = time.perf_counter()
        secs = prg(*bufs, vals=(n,), global_size=gs, local_size=ls, wait=True)  # launch + wait: device seconds
        res.wall_s.append(time.perf_counter() - t0)
        res.device_s.append(float(secs))


def run(n: int, reps: int = 10, rounds: int = 3, naive_reps: int = 2, naive: bool = True, dev: Any = None,
        sampler: LoadSampler | None = None, quiet: float = 5.0) -> dict[str, Any]:
    """Check and time the kernels and numpy at size n; returns {'results': [Result...], 'other_load': share}."""
    dev = dev or hcq.Device("CPU")
    prgs = compile_kernels(dev)
    rng = np.random.default_rng(n)
    A = rng.standard_normal((n, n), dtype=np.float32)
    B = rng.standard_normal((n, n), dtype=np.float32)
    ref = A.astype(np.float64) @ B.astype(np.float64)
    ab, bb = arrays.upload(dev, A), arrays.upload(dev, B)
    cb = dev.allocator.alloc(n * n * 4)
    res = {"naive": Result("naive", n), "fast": Result("fast", n), "numpy": Result("numpy", n)}
    sampler = sampler or LoadSampler()
    try:
        # correctness first (this is also the warm-up launch)
        for name in ("naive", "fast") if naive else ("fast",):
            arrays.copyin(cb, np.full(n * n, np.nan, np.float32))  # the kernel must overwrite all of C
            gs, ls = fast_dims(n) if name == "fast" else naive_dims(n)
            prgs[name](cb, ab, bb, vals=(n,), global_size=gs, local_size=ls, wait=True)
            res[name].ok = check(arrays.download(cb, np.float32, (n, n)), ref)
        res["numpy"].ok = check(A @ B, ref)
        time.sleep(0.25)
        wait_for_quiet(sampler, quiet)
        sampler.start()
        if naive: _time_kernel(dev, prgs["naive"], (cb, ab, bb), n, naive_dims(n), naive_reps, res["naive"])
        for _ in range(rounds):
            _time_kernel(dev, prgs["fast"], (cb, ab, bb), n, fast_dims(n), reps, res["fast"])
            for _ in range(reps):
                t0 = time.perf_counter()
                A @ B
                res["numpy"].wall_s.append(time.perf_counter() - t0)
            time.sleep(0.25)  # OpenBLAS's threads spin for a while after a call; let them sleep before hcq runs
        share = sampler.stop(f"matmul{n}")
    finally:
        for buf in (ab, bb, cb): dev.allocator.free(buf, buf.size)
    return {"results": [r for k, r in res.items() if naive or k != "naive"], "other_load": share}


def machine_line(dev: Any) -> str:
    from hcq.toolchain import find_compiler
    blas = ""
    try:
        cfg = np.show_config(mode="dicts")  # numpy >= 1.25
        b = cfg.get("Build Dependencies", {}).get("blas", {})
        blas = f", BLAS {b.get('name', '?')} {b.get('version', '')}".rstrip()
    except Exception:  # older numpy: no dict mode
        pass
    flags = " ".join(getattr(dev.compiler, "flags", ())) if hasattr(dev, "compiler") else ""
    return (f"{len(os.sched_getaffinity(0))} CPUs ({cpu_model()}), {getattr(dev, 'num_workers', '?')} hcq workers; "
            f"Linux {platform.release()}; Python {platform.python_version()}, numpy {np.__version__}{blas}; "
            f"kernels: {find_compiler()[1]}" + (f" [{flags}]" if flags else ""))


def report(out: dict[str, Any]) -> list[str]:
    rs = {r.name: r for r in out["results"]}
    npf = rs["numpy"].gflops(rs["numpy"].best_wall)
    lines = []
    for r in out["results"]:
        dev_g, wall_g = r.gflops(r.best_device), r.gflops(r.best_wall)
        if r.name == "numpy":  # host code: its wall time is its run time
            lines.append(f"n={r.n:<5} {r.name:<6} {wall_g:8.1f} GFLOP/s (a @ b, wall)  {'':>21}  1.00x numpy  ok={r.ok}  "
                         f"(best of {len(r.wall_s)}: {r.best_wall * 1e3:.2f} ms)")
            continue
        lines.append(f"n={r.n:<5} {r.name:<6} {dev_g:8.1f} GFLOP/s device  {wall_g:8.1f} GFLOP/s host wall  "
                     f"{dev_g / npf:5.2f}x numpy  ok={r.ok}  (best of {len(r.device_s)}: {r.best_device * 1e3:.2f} ms)")
    if out.get("other_load") is not None: lines.append(f"        other processes took {out['other_load'] * 100:.0f}% of the CPU meanwhile")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hcq.bench.matmul", description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, nargs="+", default=[512], help="matrix sizes (default 512)")
    p.add_argument("--reps", type=int, default=10, help="timed launches of the fast kernel (and numpy calls) per round")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds of fast kernel and numpy")
    p.add_argument("--naive-reps", type=int, default=2, help="timed launches of the naive kernel (it is slow)")
    p.add_argument("--no-naive", action="store_true", help="skip the naive kernel")
    p.add_argument("--quiet-wait", type=float, default=5.0, metavar="S",
                   help="wait up to S seconds for other processes to use < 5%% of the CPU before timing each size")
    args = p.parse_args(argv)
    dev = hcq.Device("CPU")
    print(machine_line(dev))
    sampler = LoadSampler()
    failed = False
    for n in args.n:
        if n < 1: p.error("--n must be >= 1")
        out = run(n, args.reps, args.rounds, args.naive_reps, not args.no_naive and n <= 2048, dev, sampler, args.quiet_wait)
        for line in report(out): print(line, flush=True)
        failed |= any(r.ok is False for r in out["results"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
