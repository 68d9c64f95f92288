"""Shared pieces of the benchmark: repetition counts, statistics, machine facts and a sampler of how much
CPU other processes took while we measured (this machine is shared: other jobs add noise)."""
from __future__ import annotations

import datetime
import math
import os
import platform
import statistics
import subprocess
import time
from array import array
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

SOURCE = Path(__file__).resolve().parents[2]  # the source checkout (or site-packages), for the commit id
MB = 1 << 20
KB = 1 << 10
GRAPH_KS = (1, 10, 100, 1000)
COPY_SIZES = (1 * KB, 16 * KB, 256 * KB, 4 * MB, 16 * MB, 64 * MB, 256 * MB)
SECTIONS = ("rt", "pipe", "graph", "copy", "compute", "signal")


@dataclass
class Config:
    """Repetition counts. Medians are taken over the samples; `quick` shrinks everything for a smoke run."""
    rt_samples: int = 3000          # round trips, each timed on its own
    pipe_kernels: int = 5000        # kernels per pipelined batch
    pipe_batches: int = 7
    resubmits: int = 500            # re-submits of the built queue per batch (the ring holds them all)
    graph_replays: dict[int, int] = field(default_factory=lambda: {1: 400, 10: 400, 100: 300, 1000: 150})
    tinygrad_replays: dict[int, int] = field(default_factory=lambda: {1: 200, 10: 100, 100: 30, 1000: 7})
    copy_sizes: tuple[int, ...] = COPY_SIZES
    copy_bytes_per_point: int = 768 * MB  # bytes moved per (direction, size): small sizes get more repetitions
    copy_min_reps: int = 5
    copy_max_reps: int = 400
    compute_blocks: int = 256
    compute_iters: int = 100_000
    compute_repeats: int = 5
    signal_round_trips: tuple[int, int] = (100, 4000)  # (warm-up, timed) round trips
    signal_repeats: int = 7

    @classmethod
    def quick(cls) -> Config:
        return cls(rt_samples=300, pipe_kernels=1000, pipe_batches=3, resubmits=200, graph_replays={1: 50, 10: 50, 100: 30, 1000: 10},
                   tinygrad_replays={1: 20, 10: 10, 100: 5, 1000: 3}, copy_sizes=(1 * KB, 1 * MB, 16 * MB, 64 * MB),
                   copy_bytes_per_point=128 * MB, copy_min_reps=3, copy_max_reps=50, compute_iters=30_000, compute_repeats=3,
                   signal_round_trips=(100, 1000), signal_repeats=3)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["graph_replays"] = {str(k): v for k, v in self.graph_replays.items()}
        d["tinygrad_replays"] = {str(k): v for k, v in self.tinygrad_replays.items()}
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Config:
        d = dict(d)
        d["graph_replays"] = {int(k): v for k, v in d["graph_replays"].items()}
        d["tinygrad_replays"] = {int(k): v for k, v in d["tinygrad_replays"].items()}
        d["copy_sizes"] = tuple(d["copy_sizes"])
        d["signal_round_trips"] = tuple(d["signal_round_trips"])
        return cls(**d)

    def copy_reps(self, size: int) -> int:
        return max(self.copy_min_reps, min(self.copy_max_reps, self.copy_bytes_per_point // size))


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))


def quantile(xs: Sequence[float], q: float) -> float:
    """The q-quantile (0..1) of xs: the sorted sample at index round(q * (n - 1)) (no interpolation)."""
    s = sorted(xs)
    return float(s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))])


# ---------------------------------------------------------------- tails (issue 46)
COLLAPSE_RATIO = 6.0
"""A run's tail *collapsed* when its p90 is more than COLLAPSE_RATIO times its own median (p50). A *run* is one
set of samples taken in one go: a round of a section (rt, pipe), a repeat of the signal ping-pong, or one fresh
process of `--processes`. The issue 46 target: the round trip collapses in none of 30 fresh processes."""
TAIL_QS = (0.5, 0.9, 0.99)
PIPE_CHUNK = 100   # pipelined: a timestamp every this many launches (the tail's samples: per-kernel time of each chunk)
SIGNAL_CHUNK = 100  # signal latency: a device timestamp every this many round trips (the tail's samples)


def is_collapsed(p50: float, p90: float) -> bool:
    return p90 > COLLAPSE_RATIO * p50


def tail(samples: Sequence[float], scale: float = 1.0) -> dict[str, Any]:
    """One run's tail: p50, p90, p99 of the samples (times `scale`, e.g. 1e-3 for ns -> us), p90 / p50 and
    whether it collapsed. The layout is a runs summary (see `runs_summary`) of this one run."""
    p50, p90, p99 = (quantile(samples, q) * scale for q in TAIL_QS)
    return runs_summary([{"p50": p50, "p90": p90, "p99": p99, "samples": len(samples)}])


def runs_summary(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Several runs' tails as one: p50 / p90 / p99 are medians over the runs; `collapsed` is how many runs
    collapsed (is_collapsed), `collapsed_share` that share, `worst_p90_over_p50` the largest ratio of a run;
    `per_run` keeps each run's (p50, p90, p99, samples). Summaries can be merged again: runs_summary(a + b per_run)."""
    per = [{k: r[k] for k in ("p50", "p90", "p99", "samples")} for r in runs]
    ratios = [r["p90"] / r["p50"] if r["p50"] > 0 else math.inf for r in per]
    bad = sum(is_collapsed(r["p50"], r["p90"]) for r in per)
    return {"p50": median([r["p50"] for r in per]), "p90": median([r["p90"] for r in per]), "p99": median([r["p99"] for r in per]),
            "runs": len(per), "collapsed": bad, "collapsed_share": bad / len(per), "worst_p90_over_p50": max(ratios),
            "collapse_ratio": COLLAPSE_RATIO, "per_run": per}


def merge_tails(tails: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The runs of several summaries (e.g. the rounds of a section) as one summary."""
    return runs_summary([r for t in tails for r in t["per_run"]])


def chunk_times(stamps: Sequence[int], per: int) -> list[float]:
    """Per-item nanoseconds of each chunk between consecutive timestamps, `per` items a chunk."""
    return [(b - a) / per for a, b in zip(stamps, stamps[1:])]


def slope_fit(ks: Sequence[int], ys: Sequence[float]) -> tuple[float | None, float | None]:
    """(fixed, per-item) cost from the two largest K: the per-item slope between them and the intercept
    it implies. Small-K points carry the most noise from the fixed part, so they are left out. A slope
    that noise made negative gives (None, None)."""
    (k1, y1), (k2, y2) = sorted(zip(ks, ys))[-2:]
    slope = (y2 - y1) / (k2 - k1)
    if slope <= 0: return None, None
    return y1 - slope * k1, slope


def run_time(t: float | None) -> float:
    """The device seconds a `wait=True` launch or graph call returned (None only when it did not run, e.g.
    while a graph is being captured: not something the bench does)."""
    if t is None: raise RuntimeError("a wait=True launch returned no run time")
    return t


def time_each(fn: Callable[[], Any], n: int, warmup: int = 0) -> array[int]:
    """Nanoseconds of each of `n` calls of fn (after `warmup` untimed calls), in an array made before the timed
    loop (nothing grows or is kept per sample; the store happens after the second clock read)."""
    for _ in range(warmup): fn()
    out = array("q", bytes(8 * n))
    pc = time.perf_counter_ns
    for i in range(n):
        t = pc()
        fn()
        out[i] = pc() - t
    return out


def rt_result(ns: Any, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The round-trip figures of nanosecond samples (hcq's and the peers'): median, p10, p90 in us, and the tail."""
    return {"us": median(ns) / 1e3, "p10_us": quantile(ns, 0.1) / 1e3, "p90_us": quantile(ns, 0.9) / 1e3, "samples": len(ns),
            "tail": tail(ns, 1e-3), **(extra or {})}


def chunk_sizes(n: int, chunk: int) -> list[int]:
    """The sizes of the chunks that n items fall into, `chunk` a chunk (the last one may be short)."""
    return [min(chunk, n - i) for i in range(0, n, chunk)]


def signal_result(dev_ns: Sequence[float], wall_ns: Sequence[float], warm: int, n: int, tails: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The signal figures of one ping-pong (hcq's and PoCL's): round trips per second from the median repeat's device time
    (dev_ns: each repeat's n timed round trips), and the tail, each repeat a run, its samples the ns per round trip of
    each chunk of SIGNAL_CHUNK round trips."""
    rt_ns = median(dev_ns) / n
    return {"round_trip_ns": rt_ns, "per_s": 1e9 / rt_ns, "round_trips": n, "warm_up": warm,
            "wall_per_s_incl_wakeups": (warm + n) / (median(wall_ns) / 1e9), "samples_ns": [round(x / n, 1) for x in dev_ns],
            "tail": merge_tails(tails), "tail_chunk": SIGNAL_CHUNK}


def pipelined_batches(launch: Any, finish: Any, cfg: Config) -> tuple[list[float], list[float]]:
    """Nanoseconds per launch of `pipe_kernels` launches and one finish(), per batch; and per launch of each chunk of
    PIPE_CHUNK launches (a timestamp after each chunk, into an array made before the batch), all batches together."""
    for _ in range(200): launch()
    finish()
    per: list[float] = []
    chunks: list[float] = []
    pc, n_chunks = time.perf_counter_ns, cfg.pipe_kernels // PIPE_CHUNK
    rest = range(cfg.pipe_kernels - n_chunks * PIPE_CHUNK)
    for _ in range(cfg.pipe_batches):
        stamps = array("q", bytes(8 * (n_chunks + 1)))
        t = stamps[0] = pc()
        for j in range(1, n_chunks + 1):
            for _ in range(PIPE_CHUNK): launch()
            stamps[j] = pc()
        for _ in rest: launch()
        finish()
        per.append((pc() - t) / cfg.pipe_kernels)
        chunks += chunk_times(stamps, PIPE_CHUNK)
    return per, chunks


def size_name(n: int) -> str:
    return f"{n // MB} MB" if n >= MB else f"{n // KB} KB"


# ---------------------------------------------------------------- machine and noise
def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"): return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=SOURCE, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def machine_info() -> dict[str, Any]:
    import numpy as np
    dirty = _git("status", "--porcelain", "--untracked-files=no", "--", "hcq")
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "nproc": len(os.sched_getaffinity(0)),
        "cpu_model": cpu_model(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "kernel": platform.release(),
        "hcq_commit": _git("rev-parse", "--short", "HEAD"),
        "hcq_tree": "modified (uncommitted changes under hcq/)" if dirty else "clean",
        "cc": os.environ.get("CC") or ("clang" if _which("clang") else "cc"),
    }


def _which(name: str) -> bool:
    return any(os.access(os.path.join(p, name), os.X_OK) for p in os.environ.get("PATH", "").split(os.pathsep))


def _jiffies_total() -> tuple[int, int]:
    """(busy, total) jiffies of the whole machine from /proc/stat."""
    vals = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = vals[3] + (vals[4] if len(vals) > 4 else 0)
    return sum(vals) - idle, sum(vals)


def _jiffies_ours(children_pids: list[int]) -> int:
    """utime+stime (all threads) of this process, its reaped children and the live peer processes."""
    def proc(pid: int | str) -> int:
        try:
            f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            return 0
        return int(f[11]) + int(f[12]) + int(f[13]) + int(f[14])  # utime stime cutime cstime
    return proc("self") + sum(proc(p) for p in children_pids)


class LoadSampler:
    """How busy the machine was with other processes during a section: the share of all CPU time that
    neither this process nor its peer processes used (0 = quiet; 0.5 on 2 cores = one core taken)."""

    def __init__(self) -> None:
        self.children: list[int] = []
        self.sections: dict[str, float] = {}
        self._start: tuple[int, int, int] | None = None

    def start(self) -> None:
        busy, total = _jiffies_total()
        self._start = (busy, total, _jiffies_ours(self.children))

    def stop(self, name: str) -> float | None:
        if self._start is None: return None
        busy, total = _jiffies_total()
        ours = _jiffies_ours(self.children)
        b0, t0, o0 = self._start
        self._start = None
        if total - t0 <= 0: return None
        share = max(0.0, ((busy - b0) - (ours - o0)) / (total - t0))
        self.sections[name] = round(share, 3)
        return share


def other_processes_busy(threshold: float = 5.0) -> list[str]:
    """Processes (not ours) using more than `threshold` % CPU right now, as 'pid name %'. Sampled over 0.5 s."""
    def snap() -> dict[int, tuple[str, int]]:
        out = {}
        for p in Path("/proc").iterdir():
            if not p.name.isdigit(): continue
            try:
                raw = (p / "stat").read_text()
                name = raw[raw.index("(") + 1:raw.rindex(")")]
                f = raw.rsplit(")", 1)[1].split()
                out[int(p.name)] = (name, int(f[11]) + int(f[12]))
            except (OSError, ValueError, IndexError):
                continue
        return out
    a = snap()
    time.sleep(0.5)
    b = snap()
    hz = os.sysconf("SC_CLK_TCK")
    me = os.getpid()
    busy = []
    for pid, (name, j) in b.items():
        if pid == me or pid not in a: continue
        pct = (j - a[pid][1]) / hz / 0.5 * 100
        if pct >= threshold: busy.append(f"{pid} {name} {pct:.0f}%")
    return busy


def wait_for_quiet(sampler: LoadSampler, max_wait_s: float, threshold: float = 0.05, window_s: float = 0.5) -> float:
    """Wait (at most max_wait_s) until other processes use less than `threshold` of the CPU over a window.
    Returns the last share seen."""
    end = time.monotonic() + max_wait_s
    while True:
        busy0, total0 = _jiffies_total()
        ours0 = _jiffies_ours(sampler.children)
        time.sleep(window_s)
        busy1, total1 = _jiffies_total()
        share = max(0.0, ((busy1 - busy0) - (_jiffies_ours(sampler.children) - ours0)) / max(1, total1 - total0))
        if share < threshold or time.monotonic() >= end: return share
