"""The first-GPU check: one command that, on a machine with an NVIDIA GPU (or the emulated one, `HCQ_NV_EMULATE=1`),
reports the driver and whether its kernel modules are the open ones, opens NV, runs the conformance kit, a saxpy,
copies both ways, a graph across NV and CPU, and the NV benchmark rows (launch round trip, pipelined launches, copy
bandwidth), and writes everything as JSON:

    python -m hcq.bench.gpu_check --out DIR [--budget SECONDS]

Each step is timed and recorded with its error, so one failing step leaves the others' results; the exit status is
nonzero when any step failed."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from typing import Any, Callable

import numpy as np

SAXPY = ("HCQ_KERNEL void saxpy(float *y, const float *x, float a, uint32_t n) {\n"
         "  int64_t i = hcq_global_id(0);\n  if (i < (int64_t)n) y[i] = a * x[i] + y[i];\n}\n")
EMPTY = "HCQ_KERNEL void empty(uint32_t *unused) { }\n"


def driver_facts() -> dict[str, Any]:
    """The driver's version and kind, as the kernel reports them."""
    facts: dict[str, Any] = {"emulated": os.environ.get("HCQ_NV_EMULATE", "") not in ("", "0")}
    try:
        with open("/proc/driver/nvidia/version") as f: text = f.read()
        facts["proc_version"] = text.strip()
        facts["open_kernel_modules"] = "Open Kernel Module" in text
    except OSError as e:
        facts["proc_version"] = f"unreadable: {e}"
    try:
        with open("/sys/module/nvidia/version") as f: facts["driver_version"] = f.read().strip()
    except OSError as e:
        facts["driver_version"] = f"unreadable: {e}" if not facts["emulated"] else "emulated (see the open step)"
    return facts


def conformance(budget_s: float) -> dict[str, Any]:
    r = subprocess.run([sys.executable, "-m", "hcq.conformance", "NV", "-q", "--", "-rs", "-p", "no:cacheprovider"], capture_output=True, text=True,
                       timeout=budget_s)
    tail = (r.stdout + r.stderr).strip().splitlines()[-30:]
    return {"returncode": r.returncode, "summary": tail[-1] if tail else "", "tail": tail}


def saxpy(dev: Any) -> dict[str, Any]:
    n = 1 << 20
    prg = dev.compile(SAXPY, "saxpy")
    x, y = np.arange(n, dtype=np.float32), np.ones(n, dtype=np.float32)
    bx, by = dev.allocator.alloc(4 * n), dev.allocator.alloc(4 * n)
    dev.allocator.copyin(bx, x.data.cast("B"))
    dev.allocator.copyin(by, y.data.cast("B"))
    seconds = prg(by, bx, global_size=(n // 256,), local_size=(256,), vals=(2.0, n), wait=True)
    out = np.empty(n, np.float32)
    dev.allocator.copyout(out.data.cast("B"), by)
    ok = bool(np.array_equal(out, 2 * x + 1))
    if not ok: raise AssertionError(f"saxpy is wrong at {int(np.argmax(out != 2 * x + 1))}")
    return {"n": n, "kernel_us": seconds * 1e6 if seconds is not None else None, "correct": ok}


def copies(dev: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for size in (4 << 10, 1 << 20, 64 << 20):
        src = np.random.default_rng(size).integers(0, 255, size, dtype=np.uint8)
        back = np.empty_like(src)
        buf = dev.allocator.alloc(size)
        t0 = time.perf_counter()
        dev.allocator.copyin(buf, src.data)
        dev.synchronize()
        t1 = time.perf_counter()
        dev.allocator.copyout(back.data, buf)
        t2 = time.perf_counter()
        if not np.array_equal(src, back): raise AssertionError(f"a {size}-byte round trip through {dev.device} came back different")
        out[str(size)] = {"in_GBps": size / (t1 - t0) / 1e9, "out_GBps": size / (t2 - t1) / 1e9}
        dev.allocator.free(buf, size)
    return out


def graph(dev: Any) -> dict[str, Any]:
    import hcq
    from hcq import CopyItem, ExecItem, HCQGraph
    NV_K = type(dev).CONFORMANCE_KERNELS
    cpu, n = hcq.Device("CPU"), 4096
    fill, add = dev.compile(*NV_K["fill"]), dev.compile(*NV_K["add"])
    cfill = cpu.compile(*NV_K["fill"])
    a, b = dev.allocator.alloc(4 * n), dev.allocator.alloc(4 * n)
    c = cpu.allocator.alloc(4 * n)
    items: list[ExecItem | CopyItem] = [ExecItem(fill, (a,), (3, n), (n // 64,), (64,)), ExecItem(cfill, (c,), (4, n), (n // 64,), (64,)), CopyItem(b, c, 4 * n),
             ExecItem(add, (b, b, a), (n,), (n // 64,), (64,))]
    g = HCQGraph(items)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        g()
        dev.synchronize()
        times.append(time.perf_counter() - t0)
    out = np.empty(n, np.uint32)
    dev.allocator.copyout(out.data.cast("B"), b)
    if not (out == 7).all(): raise AssertionError(f"the NV + CPU graph computed {out[:8]}..., not 7")
    return {"replay_ms": [t * 1e3 for t in times]}


def bench_rows(dev: Any) -> dict[str, Any]:
    prg = dev.compile(EMPTY, "empty")
    buf = dev.allocator.alloc(64)
    samples = []
    for i in range(600):
        t0 = time.perf_counter_ns()
        prg(buf)
        dev.synchronize()
        if i >= 100: samples.append((time.perf_counter_ns() - t0) / 1e3)
    samples.sort()
    t0 = time.perf_counter_ns()
    for _ in range(1000): prg(buf)
    dev.synchronize()
    pipelined = (time.perf_counter_ns() - t0) / 1e3 / 1000
    return {"round_trip_us": {"p50": samples[len(samples) // 2], "p90": samples[int(len(samples) * 0.9)], "p99": samples[int(len(samples) * 0.99)]},
            "pipelined_us_per_launch": pipelined}


def run(out_dir: str, budget_s: float) -> int:
    os.makedirs(out_dir, exist_ok=True)
    report: dict[str, Any] = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "steps": {}}
    t_start = time.monotonic()

    def step(name: str, fn: Callable[[], Any]) -> None:
        t0 = time.monotonic()
        try:
            result, error = fn(), None
        except Exception as e:  # noqa: BLE001 - every step reports
            result, error = None, f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=4)}"
        report["steps"][name] = {"seconds": round(time.monotonic() - t0, 3), "result": result, "error": error}
        print(f"{name}: {'ok' if error is None else 'FAILED'} ({time.monotonic() - t0:.1f} s){'' if error is None else ': ' + error.splitlines()[0]}",
              flush=True)
        with open(os.path.join(out_dir, "gpu_check.json"), "w") as f: json.dump(report, f, indent=1, default=str)

    step("driver", driver_facts)
    import hcq
    dev: Any = None

    def open_nv() -> dict[str, Any]:
        nonlocal dev
        dev = hcq.Device("NV")
        return {"device": dev.device, "describe": dev.describe(), "driver_version": dev.driver.driver_version()}
    step("open", open_nv)
    if dev is not None:
        step("saxpy", lambda: saxpy(dev))
        step("copies", lambda: copies(dev))
        step("graph_nv_cpu", lambda: graph(dev))
        step("bench", lambda: bench_rows(dev))
    step("conformance", lambda: conformance(max(30.0, budget_s - (time.monotonic() - t_start))))
    failed = [n for n, s in report["steps"].items() if s["error"] is not None or (n == "conformance" and s["result"]["returncode"] != 0)]
    report["failed"] = failed
    with open(os.path.join(out_dir, "gpu_check.json"), "w") as f: json.dump(report, f, indent=1, default=str)
    print(f"wrote {os.path.join(out_dir, 'gpu_check.json')}; {'all steps passed' if not failed else 'failed: ' + ', '.join(failed)}")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hcq.bench.gpu_check", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="directory for gpu_check.json")
    ap.add_argument("--budget", type=float, default=270.0, help="seconds the whole check may take (the conformance kit gets what is left)")
    args = ap.parse_args(argv)
    return run(args.out, args.budget)


if __name__ == "__main__":
    sys.exit(main())
