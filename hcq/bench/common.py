"""Shared pieces of the benchmark: repetition counts, statistics, machine facts and a sampler of how much
CPU other processes took while we measured (this machine is shared: other jobs add noise)."""
from __future__ import annotations

import datetime
import os
import platform
import statistics
import subprocess
import time
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
    s = sorted(xs)
    return float(s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))])


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


def time_each(fn: Callable[[], Any], n: int, warmup: int = 0) -> list[int]:
    """Nanoseconds of each of `n` calls of fn (after `warmup` untimed calls)."""
    for _ in range(warmup): fn()
    out = []
    pc = time.perf_counter_ns
    for _ in range(n):
        t = pc()
        fn()
        out.append(pc() - t)
    return out


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
