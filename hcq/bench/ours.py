"""hcq's side of the benchmark: each function measures one section on the CPU device and returns plain
numbers (microseconds, GB/s, ms) for the report. Kernels match the peers' (hcq/bench/peers.py) semantics."""
from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import numpy as np

import hcq
from hcq import arrays
from hcq.bench.common import (GRAPH_KS, PIPE_CHUNK, SIGNAL_CHUNK, Config, chunk_sizes, median, pipelined_batches, quantile, rt_result, run_time,
                              signal_result, slope_fit, tail, time_each)
from hcq.graph import ExecItem, HCQGraph

EMPTY = "HCQ_KERNEL void empty(float *a) { }"
EMPTY4 = "HCQ_KERNEL void empty4(float *a, float *b, float *c, float *d, int i, int j, float x, long k) { }"
PAUSE_S = 200e-6  # the host pause before each replay of the graph-after-a-pause figure
# The graph's tiny kernel: 1 block of 16 threads, a[i] += 1 (tinygrad's `(x + 1).realize()` on 16 floats).
INC = "HCQ_KERNEL void inc(float *a) { a[hcq_local_id(0)] += 1.0f; }"


class Ours:
    """Devices and programs shared by the sections (opened once)."""

    def __init__(self) -> None:
        self.dev0 = hcq.Device("CPU:0")
        self.dev1 = hcq.Device("CPU:1")
        self.empty = self.dev0.compile(EMPTY, "empty")
        self.empty4 = self.dev0.compile(EMPTY4, "empty4")
        self.inc = self.dev0.compile(INC, "inc")
        self.small = self.dev0.allocator.alloc(64, hcq.BufferSpec(cpu_access=True))

    def info(self) -> dict[str, Any]:
        d = self.dev0
        return {"device": d.device, "workers": getattr(d, "num_workers", None), "copy_engines": d.capabilities.queue_count("copy"),
                "env": {k: v for k, v in os.environ.items() if k.startswith("HCQ") or k in ("CC", "OPENBLAS_NUM_THREADS")}}

    # ------------------------------------------------------------ 1. round trip
    def round_trip(self, cfg: Config) -> dict[str, Any]:
        """One empty kernel (1 block, 1 thread) submitted and waited for, each timed on its own."""
        prg, buf, dev = self.empty, self.small, self.dev0

        def once() -> None:
            prg(buf)
            dev.synchronize()
        return rt_result(time_each(once, cfg.rt_samples, warmup=200))

    # ------------------------------------------------------------ 2. pipelined
    def pipelined(self, cfg: Config) -> dict[str, Any]:
        """`pipe_kernels` empty kernels back to back, one synchronize; per kernel, median over batches. The same with 4
        buffers and 4 values per launch, and the re-submit of a built 10-command queue with a changed variable."""
        dev, bufs = self.dev0, [self.small] * 4
        e, e4 = self.empty, self.empty4
        per, chunks = self._per_call(lambda: e(bufs[0]), cfg)
        vals: tuple[Any, ...] = (1, 2, 3.0, 4)  # ints and a float, packed as the kernel declares them
        per4, _ = self._per_call(lambda: e4(*bufs, vals=vals), cfg)
        sig, v = dev.new_signal(value=0), hcq.Variable("v", 0, (1 << 32) - 1)
        q = dev.hw_compute_queue_t().wait(sig, 0).memory_barrier()
        for k in range(7): q.write(self.small.va_addr + 4 * k, v if k % 2 else k)
        q.signal(sig, v)
        values = [{"v": i} for i in range(cfg.resubmits)]
        resub = []
        for _ in range(cfg.pipe_batches):  # (host time only: the ring holds a batch)
            dev.synchronize()
            t = time.perf_counter_ns()
            for vv in values: q.submit(dev, vv)
            resub.append((time.perf_counter_ns() - t) / len(values))
            sig.wait(len(values) - 1)
        dev.synchronize()
        return {"us_per_kernel": median(per) / 1e3, "batches_us": [round(p / 1e3, 3) for p in per], "kernels": cfg.pipe_kernels,
                "us_per_kernel_4x4": median(per4) / 1e3, "resubmit_us": median(resub) / 1e3, "resubmit_queue_words": len(q),
                "tail": tail(chunks, 1e-3), "tail_chunk": PIPE_CHUNK}

    def _per_call(self, launch: Any, cfg: Config) -> tuple[list[float], list[float]]:
        """Nanoseconds per launch of `pipe_kernels` launches and one synchronize, per batch; and per launch within
        each chunk of PIPE_CHUNK launches (host time, the synchronize left out), all batches together."""
        return pipelined_batches(launch, self.dev0.synchronize, cfg)

    # ------------------------------------------------------------ 3. graph replay
    def graph_replay(self, cfg: Config) -> dict[str, Any]:
        """HCQGraph of K tiny kernels (all on one buffer, so no cross-queue waits). Per replay: host time
        (the g() call: patch + submit + kickoff), wall time (g() + synchronize) and device time (first queue
        start to last queue end, from the graph's timestamps) divided by K."""
        prg, dev = self.inc, self.dev0
        out: dict[str, Any] = {"K": {}}
        for K in GRAPH_KS:
            buf = dev.allocator.alloc(64, hcq.BufferSpec(cpu_access=True))
            arrays.view(buf, np.float32, (16,))[:] = 0
            t = time.perf_counter()
            g = HCQGraph([ExecItem(prg, (buf,), local_size=(16, 1, 1)) for _ in range(K)])
            build_s = time.perf_counter() - t
            for _ in range(10):
                g()
                g.synchronize()
            host, wall, devt = [], [], []
            pc = time.perf_counter_ns
            for _ in range(cfg.graph_replays[K]):
                t0 = pc()
                g()
                t1 = pc()
                g.synchronize()
                t2 = pc()
                host.append(t1 - t0)
                wall.append(t2 - t0)
                devt.append(g.device_time())
            runs = 10 + cfg.graph_replays[K]
            got = float(arrays.view(buf, np.float32, (16,))[0])
            if got != K * runs: raise AssertionError(f"graph K={K}: a[0] = {got}, expected {K * runs}: kernels were lost")
            out["K"][K] = {"host_us": median(host) / 1e3, "host_p90_us": quantile(host, 0.9) / 1e3, "wall_us": median(wall) / 1e3,
                           "device_us": median(devt) * 1e6, "device_us_per_kernel": median(devt) * 1e6 / K, "build_ms": build_s * 1e3,
                           "replays": len(host)}
            del g
            dev.allocator.free(buf, 64, hcq.BufferSpec(cpu_access=True))
        out["paused"] = self._graph_after_pause(cfg)
        ks = list(GRAPH_KS)
        out["wall_fixed_us"], out["wall_us_per_kernel"] = slope_fit(ks, [out["K"][k]["wall_us"] for k in ks])
        out["host_fixed_us"], out["host_us_per_kernel"] = slope_fit(ks, [out["K"][k]["host_us"] for k in ks])
        out["device_fixed_us"], out["device_us_per_kernel_slope"] = slope_fit(ks, [out["K"][k]["device_us"] for k in ks])
        return out

    def _graph_after_pause(self, cfg: Config) -> dict[str, Any]:
        """K=1 replays that each follow a 200 us pause of the host (`time.sleep`): replay + wait, median."""
        prg, dev = self.inc, self.dev0
        buf = dev.allocator.alloc(64, hcq.BufferSpec(cpu_access=True))
        g = HCQGraph([ExecItem(prg, (buf,), local_size=(16, 1, 1))])
        pc, wall = time.perf_counter_ns, []
        for i in range(cfg.graph_replays[1] + 20):
            time.sleep(PAUSE_S)
            t0 = pc()
            g()
            g.synchronize()
            if i >= 20: wall.append(pc() - t0)
        del g
        dev.allocator.free(buf, 64, hcq.BufferSpec(cpu_access=True))
        return {"pause_us": PAUSE_S * 1e6, "wall_us": median(wall) / 1e3, "wall_p90_us": quantile(wall, 0.9) / 1e3, "replays": len(wall)}

    # ------------------------------------------------------------ 4. copies
    def copies(self, cfg: Config) -> dict[str, Any]:
        """copyin (host -> CPU:0), copyout (CPU:0 -> host), d2d (CPU:0 -> CPU:1 on CPU:0's copy engine, waited
        on CPU:1) and numpy copyto (memcpy) at each size, in GB/s (median time of the repetitions)."""
        d0, d1 = self.dev0, self.dev1
        res: dict[str, Any] = {}
        for size in cfg.copy_sizes:
            reps = cfg.copy_reps(size)
            src = np.full(size, 7, np.uint8)
            dst = np.ones(size, np.uint8)  # written, so its pages exist before timing
            b0, b1 = d0.allocator.alloc(size), d1.allocator.alloc(size)
            src_mv, dst_mv = src.data, dst.data

            def cin() -> None: d0.allocator.copyin(b0, src_mv)

            def cout() -> None: d0.allocator.copyout(dst_mv, b0)

            def d2d() -> None:
                d0.allocator.transfer(b1, b0, size, src_dev=d0, dest_dev=d1)
                d1.synchronize()

            def memcpy() -> None: np.copyto(dst, src)
            row = {}
            for name, fn in (("copyin", cin), ("copyout", cout), ("d2d", d2d), ("memcpy", memcpy)):
                ns = time_each(fn, reps, warmup=2)
                row[name] = size / (median(ns) / 1e9) / 1e9
                row[f"{name}_us"] = median(ns) / 1e3  # per copy
            dst[:] = 0
            d1.allocator.copyout(dst_mv, b1)
            if not (dst[0] == 7 and dst[-1] == 7 and (size > 64 << 20 or np.array_equal(dst, src))):
                raise AssertionError(f"copy of {size} bytes: CPU:1 does not hold the source bytes")
            row["reps"] = reps
            res[str(size)] = row
            d0.allocator.free(b0, size)
            d1.allocator.free(b1, size)
        d0.allocator.free_cache()
        d1.allocator.free_cache()
        return res

    # ------------------------------------------------------------ 5. compute scaling
    def compute(self, cfg: Config) -> dict[str, Any]:
        """hcq/bench/grid_speedup.py's compute-bound kernel on a device with 1 worker and one with all cores
        (fresh device names, HCQ_CPU_WORKERS set before opening), launched alternately so that drift in the
        machine's speed hits both alike. Best of `compute_repeats` device times each."""
        from hcq.bench.grid_speedup import KERNEL, open_device
        n = len(os.sched_getaffinity(0))
        devs = {1: open_device("CPU:6", 1), n: open_device("CPU:7", n)}
        blocks, iters = cfg.compute_blocks, cfg.compute_iters
        runs: dict[int, tuple[hcq.HCQProgram, hcq.HCQBuffer, list[float]]] = {}
        for w, d in devs.items():
            prg = d.compile(KERNEL, "spin")
            buf = d.allocator.alloc(blocks * 8, hcq.BufferSpec(cpu_access=True))
            prg(buf, global_size=(blocks, 1, 1), local_size=(1, 1, 1), vals=(iters,), wait=True)  # warm-up
            runs[w] = (prg, buf, [])
        for _ in range(cfg.compute_repeats):
            for prg, buf, times in runs.values():
                times.append(run_time(prg(buf, global_size=(blocks, 1, 1), local_size=(1, 1, 1), vals=(iters,), wait=True)))
        outs = {w: arrays.download(buf, np.float64, blocks) for w, (_, buf, _) in runs.items()}
        if not np.array_equal(outs[1], outs[n]): raise AssertionError("compute: 1-worker and all-worker results differ")
        t1, tn = runs[1][2], runs[n][2]
        for w, (_, buf, _) in runs.items(): devs[w].allocator.free(buf, blocks * 8, hcq.BufferSpec(cpu_access=True))
        return {"workers": n, "ms_1": min(t1) * 1e3, "ms_all": min(tn) * 1e3, "median_ms_1": median(t1) * 1e3, "median_ms_all": median(tn) * 1e3,
                "speedup": min(t1) / min(tn), "speedup_of_medians": median(t1) / median(tn), "checksum": float(outs[n].sum())}

    # ------------------------------------------------------------ 6. signal latency
    def signal_latency(self, cfg: Config) -> dict[str, Any]:
        """Ping-pong between two queues through two signals, fully pre-encoded: queue A waits ping >= i then
        signals pong = i; queue B signals ping = i then waits pong >= i. Both start behind a gate the host
        opens; after `warm` round trips (both threads are awake and spinning by then) A takes a timestamp,
        and another after the last one: round trips per second from those device timestamps, so the host's
        wake-ups are not in the figure. cross-queue: CPU:0 compute <-> CPU:0 copy engine 0; cross-device:
        CPU:0 compute <-> CPU:1 compute."""
        d0, d1 = self.dev0, self.dev1
        if d0.hw_copy_queue_t is None: raise RuntimeError(f"{d0.device} has no copy queue for the cross-queue case")
        pairs = {"cross_queue": (d0, d0.hw_compute_queue_t, d0, d0.hw_copy_queue_t),
                 "cross_device": (d0, d0.hw_compute_queue_t, d1, d1.hw_compute_queue_t)}
        warm, n = cfg.signal_round_trips
        out: dict[str, Any] = {}
        for name, (da, qa_t, db, qb_t) in pairs.items():
            gate, ping, pong, en, done_a, done_b = (d0.new_signal(value=0) for _ in range(6))
            marks = [d0.new_signal(value=0) for _ in range(-(-n // SIGNAL_CHUNK))]  # marks[0]: the start of the timed part
            st = marks[0]
            qa, qb = qa_t().wait(gate, 1), qb_t().wait(gate, 1)
            for i in range(1, warm + n + 1):
                if i > warm and (i - warm - 1) % SIGNAL_CHUNK == 0: qa.timestamp(marks[(i - warm - 1) // SIGNAL_CHUNK])
                qa.wait(ping, i).signal(pong, i)
                qb.signal(ping, i).wait(pong, i)
            qa.timestamp(en).signal(done_a, 1)
            qb.signal(done_b, 1)  # both queues are past their last wait: the signals may be reset
            dev_ns, wall_ns, tails = [], [], []
            for _ in range(cfg.signal_repeats):
                for s in (gate, ping, pong, done_a, done_b): s.value = 0
                qa.submit(da)
                qb.submit(db)
                t = time.perf_counter_ns()
                gate.value = 1
                pong.wait(warm + n)
                wall_ns.append(time.perf_counter_ns() - t)
                done_a.wait(1)
                done_b.wait(1)
                dev_ns.append(float(en.timestamp - st.timestamp) * 1e3)
                us = [m.timestamp for m in marks] + [en.timestamp]  # device microseconds
                tails.append(tail([float(b - a) * 1e3 / k for a, b, k in zip(us, us[1:], chunk_sizes(n, SIGNAL_CHUNK))]))
            out[name] = signal_result(dev_ns, wall_ns, warm, n, tails)
        return out


def rt_process_main(argv: list[str]) -> int:
    """`python -m hcq.bench.ours rt CFG_JSON`: the round trip in this (fresh) process; one JSON line on stdout."""
    cfg = Config.from_json(json.loads(argv[1]))
    print(json.dumps(Ours().round_trip(cfg)), flush=True)
    return 0


SECTION_FUNCS = {"rt": "round_trip", "pipe": "pipelined", "graph": "graph_replay", "copy": "copies", "compute": "compute", "signal": "signal_latency"}

if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "rt": sys.exit(rt_process_main(sys.argv[1:]))
    print("usage: python -m hcq.bench.ours rt CFG_JSON", file=sys.stderr)
    sys.exit(2)
