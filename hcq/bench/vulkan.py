"""The Vulkan section of `python -m hcq.bench` (`--only vk`): hcq's VK device against the raw Vulkan loop in C
(hcq/bench/vk_raw.c, the floor) and wgpu, both run by hcq/bench/vk_peers.py. What is measured (medians):

  round trip    hcq: `prg(); dev.synchronize()` of an empty kernel (1 invocation).
                Peers: submit + wait of one dispatch.
  pipelined     hcq: `pipe_kernels` launches back to back, one synchronize; per launch.
                Peers: as many one-dispatch submits, one wait; per dispatch.
  graph replay  hcq: an HCQGraph of K empty launches (K in GRAPH_KS), replay + wait; the cost per extra kernel is
                the slope of that time over K (common.slope_fit: the two largest K).
                Peers: K dispatches (each behind a barrier) in one command buffer, submit + wait; the slope over K
                (vk_peers.DISPATCH_KS).
  copy          hcq: 64 MiB from one buffer of the device to another on its copy queue (copy, then a signal the
                host waits for). Peers: vkCmdCopyBuffer / copy_buffer_to_buffer of 64 MiB, submit + wait.

The run alternates in rounds: each round measures hcq with the round's share of the repetitions, then runs each
peer in a fresh process with the same share (the order rotates from round to round), so that the three see the
same machine conditions; every figure is the median over the rounds. The CPUs the bench may run on are recorded
(a run pinned by `taskset` or the like says so); the bench itself does not pin."""
from __future__ import annotations

import os
import statistics
import time
import traceback
from typing import Any, Callable

import numpy as np

import hcq
from hcq.bench.common import GRAPH_KS, Config, median, quantile, slope_fit, time_each
from hcq.bench.report import VK_HEADLINES, VK_SECTION, get_in
from hcq.bench.vk_peers import COPY_BYTES, PEER_NAMES, measure_peer
from hcq.graph import ExecItem, HCQGraph

__all__ = ["PEER_NAMES", "SECTION", "TITLES", "VKSide", "merge_medians", "run"]

SECTION = VK_SECTION
ROUNDS = {False: 5, True: 2}  # rounds of a full run and of a --quick one
TITLES = {"raw": "raw Vulkan (C)", "wgpu": "wgpu"}
# The empty kernel: no argument block (no push constants), its local size specialised by the launch (1 x 1 x 1).
EMPTY_GLSL = "#version 460\nlayout(local_size_x_id = 0, local_size_y_id = 1, local_size_z_id = 2) in;\nvoid main() {}\n"


def skip_reason() -> str | None:
    """Why the section cannot run here (hcq's VK backend is unavailable: no Vulkan driver, no glslangValidator...)."""
    from hcq.registry import unavailable_reason
    return unavailable_reason("VK")


def pinning() -> dict[str, Any]:
    """The CPUs this process (and so the peers it starts) may run on, whether that is fewer than the machine has
    (pinned), and lavapipe's thread count setting (LP_NUM_THREADS; unset: one thread per CPU)."""
    cpus = sorted(os.sched_getaffinity(0))
    online = os.cpu_count() or len(cpus)
    return {"cpus": cpus, "online_cpus": online, "pinned": len(cpus) < online, "LP_NUM_THREADS": os.environ.get("LP_NUM_THREADS")}


def round_config(cfg: Config, rounds: int) -> Config:
    """`cfg` with each repetition count shared out over `rounds` rounds (never below what a median needs)."""
    c = Config.from_json(cfg.to_json())
    c.rt_samples = max(50, cfg.rt_samples // rounds)
    c.pipe_batches = max(1, -(-cfg.pipe_batches // rounds))
    c.graph_replays = {k: max(3, -(-v // rounds)) for k, v in cfg.graph_replays.items()}
    c.copy_bytes_per_point = cfg.copy_bytes_per_point // rounds
    return c


def merge_medians(parts: list[Any]) -> Any:
    """Results of several rounds as one: numbers become their median (over the rounds that have them), dicts merge
    key by key, lists are joined; anything else (names, flags) is the first round's."""
    first = parts[0]
    if isinstance(first, dict):
        keys = list(dict.fromkeys(k for p in parts if isinstance(p, dict) for k in p))
        return {k: merge_medians([p[k] for p in parts if isinstance(p, dict) and p.get(k) is not None] or [None]) for k in keys}
    if isinstance(first, list): return [x for p in parts if isinstance(p, list) for x in p]
    nums = [p for p in parts if isinstance(p, (int, float)) and not isinstance(p, bool)]
    if nums and len(nums) == len(parts): return float(statistics.median(nums))
    return first


def _pattern() -> np.ndarray:
    """The copy source's contents: COPY_BYTES of consecutive 32-bit words."""
    return np.arange(COPY_BYTES // 4, dtype=np.uint32)


class VKSide:
    """hcq's side: the VK device, the empty kernel, and (made on first use, kept over the rounds) the graphs and the
    copy buffers. close() frees them."""

    def __init__(self, device: str = "VK") -> None:
        self.dev = hcq.Device(device)
        self.empty = self.dev.compile(EMPTY_GLSL, "empty")
        if self.dev.hw_copy_queue_t is None: raise RuntimeError(f"{self.dev.device} has no copy queue")
        self.copy_queue_t = self.dev.hw_copy_queue_t
        self.graphs: dict[int, HCQGraph] = {}
        self.copy_bufs: tuple[hcq.HCQBuffer, hcq.HCQBuffer] | None = None
        self.copy_signal = self.dev.new_signal(value=0)
        self.copies_done = 0

    def info(self) -> dict[str, Any]:
        """The device (hcq's name, Vulkan's), whether user memory is host-visible, and the environment that shapes it."""
        d = self.dev
        return {"device": d.device, "vulkan_device": getattr(d, "vk_name", None),
                "user_memory_host_visible": getattr(d, "user_host_visible", None), "describe": d.describe(),
                "env": {k: v for k, v in os.environ.items() if k.startswith(("HCQ", "LP_", "VK_", "MESA"))}}

    def measure(self, cfg: Config) -> dict[str, Any]:
        """All four measurements with `cfg`'s repetition counts."""
        return {"rt": self.round_trip(cfg), "pipe": self.pipelined(cfg), "graph": self.graph_replay(cfg), "copy": self.copy(cfg)}

    def round_trip(self, cfg: Config) -> dict[str, Any]:
        """One empty launch and `dev.synchronize()`, each timed on its own (after untimed warm-up ones)."""
        prg, dev = self.empty, self.dev

        def once() -> None:
            prg()
            dev.synchronize()
        ns = time_each(once, cfg.rt_samples, warmup=max(20, cfg.rt_samples // 20))
        return {"us": median(ns) / 1e3, "p10_us": quantile(ns, 0.1) / 1e3, "p90_us": quantile(ns, 0.9) / 1e3, "samples": len(ns)}

    def pipelined(self, cfg: Config) -> dict[str, Any]:
        """`pipe_kernels` empty launches back to back and one synchronize, per launch; median over the batches."""
        prg, dev, n = self.empty, self.dev, cfg.pipe_kernels
        for _ in range(200): prg()
        dev.synchronize()
        per = []
        for _ in range(cfg.pipe_batches):
            t = time.perf_counter_ns()
            for _ in range(n): prg()
            dev.synchronize()
            per.append((time.perf_counter_ns() - t) / n / 1e3)
        return {"us_per_dispatch": median(per), "batches_us": [round(p, 3) for p in per], "launches": n}

    def _graph(self, k: int) -> HCQGraph:
        if k not in self.graphs:
            g = self.graphs[k] = HCQGraph([ExecItem(self.empty, ()) for _ in range(k)])
            for _ in range(3): g(wait=True)  # first runs: pipelines, command buffers
        return self.graphs[k]

    def graph_replay(self, cfg: Config) -> dict[str, Any]:
        """Each graph of K empty launches replayed `graph_replays[K]` times: host time of `g()`, wall time of `g()` +
        `g.synchronize()`, and device time (the graph's timestamps); the fixed and per-kernel costs of the wall time
        (and of the device time) from slope_fit."""
        out: dict[str, Any] = {"K": {}}
        pc = time.perf_counter_ns
        for k in GRAPH_KS:
            g = self._graph(k)
            host, wall, devt = [], [], []
            for _ in range(cfg.graph_replays[k]):
                t0 = pc()
                g()
                t1 = pc()
                g.synchronize()
                wall.append(pc() - t0)
                host.append(t1 - t0)
                devt.append(g.device_time() * 1e6)
            out["K"][str(k)] = {"host_us": median(host) / 1e3, "wall_us": median(wall) / 1e3, "wall_p90_us": quantile(wall, 0.9) / 1e3,
                                "device_us": median(devt), "replays": len(wall)}
        ks = list(GRAPH_KS)
        out["wall_fixed_us"], out["wall_us_per_kernel"] = slope_fit(ks, [out["K"][str(k)]["wall_us"] for k in ks])
        out["device_fixed_us"], out["device_us_per_kernel"] = slope_fit(ks, [out["K"][str(k)]["device_us"] for k in ks])
        return out

    def _copy_buffers(self) -> tuple[hcq.HCQBuffer, hcq.HCQBuffer]:
        """Source and destination (device memory, as `allocator.alloc` gives); the source holds _pattern()."""
        if self.copy_bufs is None:
            alloc = self.dev.allocator
            src, dst = alloc.alloc(COPY_BYTES), alloc.alloc(COPY_BYTES)
            alloc.copyin(src, _pattern().data.cast("B"))
            self.copy_bufs = (src, dst)
        return self.copy_bufs

    def _copy_once(self) -> None:
        src, dst = self._copy_buffers()
        self.copies_done += 1
        self.copy_queue_t().copy(dst, src, COPY_BYTES).signal(self.copy_signal, self.copies_done).submit(self.dev)
        self.copy_signal.wait(self.copies_done)

    def copy(self, cfg: Config) -> dict[str, Any]:
        """A 64 MiB device-to-device copy on the copy queue, each timed from building the queue to the host seeing its
        signal; GB/s of the median time. Checked once: the destination then holds the source's pattern."""
        _, dst = self._copy_buffers()
        self.dev.synchronize()
        self._copy_once()
        back = np.zeros(COPY_BYTES // 4, np.uint32)
        self.dev.allocator.copyout(back.data.cast("B"), dst)
        if not np.array_equal(back, _pattern()): raise AssertionError("VK copy: the destination does not hold the source's bytes")
        reps = cfg.copy_reps(COPY_BYTES)
        ns = time_each(self._copy_once, reps, warmup=1)
        return {"gbps": COPY_BYTES / (median(ns) / 1e9) / 1e9, "bytes": COPY_BYTES, "reps": reps}

    def close(self) -> None:
        """Free the graphs and the copy buffers (the device stays open: devices live for the process)."""
        self.dev.synchronize()
        self.graphs.clear()
        if self.copy_bufs is not None:
            for b in self.copy_bufs: self.dev.allocator.free(b, COPY_BYTES)
            self.copy_bufs = None


def run(cfg: Config, quick: bool, say: Callable[[str], None], peers: tuple[str, ...] = PEER_NAMES) -> dict[str, Any]:
    """The section's results: {"skipped": reason} when hcq's VK device cannot run here; else hcq's and each peer's
    figures (medians over the rounds), the headline figures of every round, why a peer was skipped, errors, and
    how the run was pinned."""
    if (why := skip_reason()) is not None: return {"skipped": why}
    try:
        ours = VKSide()
    except Exception as e:  # noqa: BLE001 - the section is skipped, the rest of the bench goes on
        traceback.print_exc()
        return {"skipped": f"VK device did not open: {type(e).__name__}: {e}"}
    rounds = ROUNDS[quick]
    rcfg = round_config(cfg, rounds)
    parts: dict[str, list[dict[str, Any]]] = {"hcq": [], **{p: [] for p in peers}}
    skipped: dict[str, str] = {}
    errors: dict[str, str] = {}

    def measure(side: str) -> None:
        if side in skipped or f"{SECTION}.{side}" in errors: return
        if side == "hcq":
            try:
                parts["hcq"].append(ours.measure(rcfg))
            except Exception as e:  # noqa: BLE001 - one broken side must not lose the others
                traceback.print_exc()
                errors[f"{SECTION}.hcq"] = f"{type(e).__name__}: {e}"
            return
        res = measure_peer(side, quick, cfg=rcfg)
        if "skipped" not in res: parts[side].append(res)
        elif parts[side]: errors[f"{SECTION}.{side}"] = f"round {len(parts[side]) + 1}: {res['skipped']}"
        else:
            skipped[side] = res["skipped"]
            say(f"  {TITLES[side]} skipped: {res['skipped']}")

    sides = ["hcq", *peers]
    try:
        for r in range(rounds):
            t = time.perf_counter()
            for side in sides[r % len(sides):] + sides[:r % len(sides)]: measure(side)
            say(f"  vk round {r + 1}/{rounds}: {time.perf_counter() - t:.1f} s")
        info = ours.info()
    finally:
        ours.close()
    merged = {side: merge_medians(p) for side, p in parts.items() if p}
    per_round = {side: {row: [get_in(p, *hp) if side == "hcq" else p.get(pk) for p in ps] for row, (hp, pk) in VK_HEADLINES.items()}
                 for side, ps in parts.items() if ps}
    return {"hcq": merged.get("hcq"), "peers": {p: m for p, m in merged.items() if p != "hcq"}, "skipped_peers": skipped,
            "errors": errors, "per_round": per_round, "rounds": rounds, "round_config": rcfg.to_json(), "hcq_info": info,
            "pinning": pinning()}
