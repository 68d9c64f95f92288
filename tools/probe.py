"""Reproductions behind the analysis in BENCHMARKS.md (not part of `python -m hcq.bench`):

    python -m tools.probe launch        host cost of one launch, split into its parts
    python -m tools.probe graph [K]     host cost of one graph replay, split into its parts
    python -m tools.probe contention    round trip and pipelined launches with 0 and 1 busy-looping processes
    python -m tools.probe placement     the same with the Python thread and the compute-queue thread pinned to given CPUs
    python -m tools.probe align         copyout and plain memmove from a device buffer into host memory at three alignments
    python -m tools.probe loop WHAT S   run WHAT (launch | launch-py | graph) in a loop for S seconds, for py-spy/perf

Each figure is the best (and median) of several batches, in microseconds per call."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from array import array
from typing import Any, Callable

import hcq
from hcq.packet_queue import SUBMIT_SLICE_NS
from hcq.bench.common import median
from hcq.graph import ExecItem, HCQGraph


def _best(fn: Callable[[], Any], n: int, reps: int = 7, after: Callable[[], Any] | None = None) -> tuple[float, float]:
    r = []
    for _ in range(reps):
        t = time.perf_counter_ns()
        for _ in range(n): fn()
        r.append((time.perf_counter_ns() - t) / n / 1e3)
        if after is not None: after()
    return min(r), median(r)


def _setup() -> tuple[Any, Any, Any]:
    dev = hcq.Device("CPU:0")
    prg = dev.compile("HCQ_KERNEL void empty(float *a) { }", "empty")
    buf = dev.allocator.alloc(64, hcq.BufferSpec(cpu_access=True))
    return dev, prg, buf


def launch() -> None:
    from hcq.backends.cpu.native import engine
    dev, prg, buf = _setup()
    lib = engine()
    sync = dev.synchronize
    rows = []
    rows.append(("prg(buf), device consuming (= pipelined cost)", _best(lambda: prg(buf), 20000, after=sync)))
    launcher = dev.fast_launch
    real = launcher.try_submit
    ring, to = launcher.handle, SUBMIT_SLICE_NS
    empty = array("Q", [0])
    addr0 = empty.buffer_info()[0]
    rows.append(("  ctypes hcq_queue_submit(ring, words, 0, timeout): 4 converted args, lock + doorbell only",
                 _best(lambda: real(ring, addr0, 0, to), 50000)))
    rows.append(("  ctypes call with 0 args (hcq_now_ns)", _best(lambda: lib.hcq_now_ns(), 50000)))
    rows.append(("  ctypes call with 1 arg (hcq_queue_rptr(ring))", _best(lambda: lib.hcq_queue_rptr(ring), 50000)))
    tv = dev.timeline_value
    rows.append(("  array('Q', 17-word tuple) (the packet template)",
                 _best(lambda: array("Q", (1, 2, tv - 1, 3, 4, 5, 6, 1, 1, 1, 1, 1, 1, 7, 8, tv)), 50000)))
    kr = prg._fast_kernargs
    rows.append(("  prg._fast_kernargs((buf,), (), tag) (reused block: retag)", _best(lambda: kr((buf,), (), dev.timeline_value), 50000)))
    sync()
    saved = dev.timeline_value
    launcher.try_submit = lambda *a: 0
    try:
        rows.append(("  prg(buf) with the native submit stubbed out (Python part)", _best(lambda: prg(buf), 20000)))
    finally:
        launcher.try_submit = real
        dev.timeline_value = saved
    for name, (b, m) in rows: print(f"{b:7.3f} us best  {m:7.3f} us median   {name}")
    # The round trip, split: the launch call, then synchronize (device work + the host's wait).
    launch_ns, sync_ns = [], []
    for _ in range(3000):
        t0 = time.perf_counter_ns()
        prg(buf)
        t1 = time.perf_counter_ns()
        sync()
        t2 = time.perf_counter_ns()
        launch_ns.append(t1 - t0)
        sync_ns.append(t2 - t1)
    print(f"round trip split (medians of 3000): prg(buf) {median(launch_ns) / 1e3:.2f} us + synchronize {median(sync_ns) / 1e3:.2f} us")


def graph(K: int = 1000) -> None:
    dev, _, _ = _setup()
    prg = dev.compile("HCQ_KERNEL void inc(float *a) { a[hcq_local_id(0)] += 1.0f; }", "inc")
    buf = dev.allocator.alloc(64, hcq.BufferSpec(cpu_access=True))
    g = HCQGraph([ExecItem(prg, (buf,), local_size=(16, 1, 1)) for _ in range(K)])
    for _ in range(20):
        g()
        g.synchronize()

    t_host = []
    for _ in range(300):
        t = time.perf_counter_ns()
        g()
        t_host.append(time.perf_counter_ns() - t)
        g.synchronize()
    print(f"K={K}: g() host time median {median(t_host) / 1e3:.2f} us, best {min(t_host) / 1e3:.2f} us")
    q = next(iter(g.queues.values()))
    print(f"  queues: {len(g.queues)}; compute queue: {len(q)} words, {len(q.q_sints)} symbolic words, {len(q.mv_sints)} in memory")
    g1 = HCQGraph([ExecItem(prg, (buf,), local_size=(16, 1, 1))])  # the parts, on a 1-kernel graph (device work negligible)
    g1()
    g1.synchronize()
    q = next(iter(g1.queues.values()))
    sig = g1.kickoff
    rows = [("  kickoff.value = v (native store, ctypes 2 args)", _best(lambda: sig.store(sig.load()), 50000)),
            ("  dev.timeline_signal.wait(reached value)", _best(lambda: dev.timeline_signal.wait(0), 50000))]
    g1._catch_up()  # (the native runs above keep only the words current)
    vv = dict(g1._run_var_vals)
    rows.append(("  q.submit(dev, same var_vals) (no patch: the indirect packet only)", _best(lambda: q.submit(dev, vv), 20000, after=dev.synchronize)))
    for name, (b, m) in rows: print(f"{b:7.3f} us best  {m:7.3f} us median   {name}")


def contention() -> None:
    """The same round trip / pipelined loop with a busy-looping process competing for the CPUs."""
    dev, prg, buf = _setup()

    def rt() -> None:
        prg(buf)
        dev.synchronize()
    for busy in (0, 1):
        hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)]
        try:
            time.sleep(0.2)
            r = _best(rt, 2000, reps=5)
            p = _best(lambda: prg(buf), 5000, reps=5, after=dev.synchronize)
        finally:
            for h in hogs:
                h.kill()
                h.wait()
        print(f"{busy} busy process(es) on {len(os.sched_getaffinity(0))} CPUs: round trip {r[1]:8.2f} us (median of batches), "
              f"pipelined {p[1]:6.2f} us/kernel")


def placement() -> None:
    """Pin the Python thread and CPU:0's compute-queue thread (found as the busiest native thread during a
    burst of launches) to each pair of CPUs, and measure pipelined launches and round trips."""
    dev, prg, buf = _setup()
    me = os.getpid()
    tids = sorted(int(t) for t in os.listdir("/proc/self/task"))

    def ticks() -> dict[int, int]:
        return {t: sum(int(x) for x in open(f"/proc/self/task/{t}/stat").read().rsplit(")", 1)[1].split()[11:13]) for t in tids}
    a = ticks()
    for _ in range(100_000): prg(buf)
    dev.synchronize()
    b = ticks()
    qt = max((t for t in tids if t != me), key=lambda t: b[t] - a[t])
    cpus = sorted(os.sched_getaffinity(0))
    old = set(cpus)
    try:
        for hc, qc in [(h, q) for h in cpus[:2] for q in cpus[:2]]:
            os.sched_setaffinity(me, {hc})
            os.sched_setaffinity(qt, {qc})
            time.sleep(0.05)
            p = _best(lambda: prg(buf), 20000, reps=5, after=dev.synchronize)
            rt = []
            for _ in range(2000):
                t = time.perf_counter_ns()
                prg(buf)
                dev.synchronize()
                rt.append(time.perf_counter_ns() - t)
            print(f"Python thread on CPU{hc}, compute-queue thread on CPU{qc}: pipelined {p[1]:6.2f} us/kernel, "
                  f"round trip {median(rt) / 1e3:7.2f} us (medians)")
    finally:
        os.sched_setaffinity(me, old)
        os.sched_setaffinity(qt, old)


def align() -> None:
    """glibc's memmove from a page-aligned device buffer into host memory that is 0, 16 or 64 bytes past a
    page boundary (numpy's large arrays sit 16 bytes past one), and hcq's copyout into the same places."""
    import ctypes

    import numpy as np
    dev = hcq.Device("CPU:0")
    for size in (16 << 10, 256 << 10, 512 << 10, 4 << 20):
        buf = dev.allocator.alloc(size)
        raw = np.ones(size + 8192, np.uint8)
        cells = []
        for mis in (0, 16, 64):
            off = (-raw.ctypes.data) % 4096 + mis
            addr = raw.ctypes.data + off
            mv = memoryview(raw[off:off + size])
            mm = _best(lambda: ctypes.memmove(addr, buf.va_addr, size), 300, reps=3)[1]
            co = _best(lambda: dev.allocator.copyout(mv, buf), 300, reps=3)[1]
            cells.append(f"+{mis:<2d}: memmove {size / mm / 1e3:5.1f} GB/s, copyout {size / co / 1e3:5.1f} GB/s")
        dev.allocator.free(buf, size)
        print(f"{size >> 10:5d} KB  " + " | ".join(cells))


def loop(what: str, seconds: float) -> None:
    dev, prg, buf = _setup()
    if what == "launch-py": dev.fast_launch.try_submit = lambda *a: 0
    if what == "graph":
        inc = dev.compile("HCQ_KERNEL void inc(float *a) { a[hcq_local_id(0)] += 1.0f; }", "inc")
        g = HCQGraph([ExecItem(inc, (buf,), local_size=(16, 1, 1)) for _ in range(int(os.environ.get("K", "1000")))])

        def step() -> None:
            g()
            g.synchronize()
    else:
        def step() -> None: prg(buf)
    end, n = time.perf_counter() + seconds, 0
    while time.perf_counter() < end:
        for _ in range(1000): step()
        n += 1000
        if what == "launch": dev.synchronize()
    print(f"{what}: {seconds * 1e6 / n:.2f} us per call")


if __name__ == "__main__":
    cmd = sys.argv[1] if len(sys.argv) > 1 else "launch"
    if cmd == "launch": launch()
    elif cmd == "graph": graph(int(sys.argv[2]) if len(sys.argv) > 2 else 1000)
    elif cmd == "contention": contention()
    elif cmd == "placement": placement()
    elif cmd == "align": align()
    elif cmd == "loop": loop(sys.argv[2], float(sys.argv[3]))
    else: sys.exit(__doc__)
