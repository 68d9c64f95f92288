"""The peers: installation (behind `--install-peers`), detection, and their measurements. Each peer runs in
its own process (`python -m hcq.bench.peers serve NAME`) so its environment (tinygrad's DEV=CPU), threads and
crashes stay out of the hcq process; the driver sends it one section at a time, right after measuring hcq's
side of that section, so both sides see the same machine conditions.

Protocol: the peer writes one JSON line per message on its original stdout (fd 1 is moved to stderr, so
library chatter cannot corrupt it): first {"ready": bool, "info"|"reason": ...}; then for each request line
{"section": s, "cfg": {...}} it answers {"ok": true, "result": {...}} or {"ok": false, "error": "..."}."""
from __future__ import annotations

import importlib.util
import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import IO, Any, Callable

from hcq.bench.common import (GRAPH_KS, SIGNAL_CHUNK, Config, chunk_sizes, median, merge_tails, pipelined_batches, rt_result, signal_result,
                              slope_fit, tail, time_each)

PEERS = ("pocl", "tinygrad")
TITLES = {"pocl": "PoCL", "tinygrad": "tinygrad", "memcpy": "memcpy"}

# ---------------------------------------------------------------- installation and detection
APT_PACKAGES = {"pocl": ["pocl-opencl-icd"], "tinygrad": ["clang"]}
PIP_PACKAGES = {"pocl": ("pyopencl", "pyopencl"), "tinygrad": ("tinygrad", "tinygrad")}  # (distribution, module)


def _dpkg_installed(pkg: str) -> bool:
    try:
        r = subprocess.run(["dpkg-query", "-W", "-f=${Status}", pkg], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return False
    return r.returncode == 0 and "install ok installed" in r.stdout


def install_peers(peers: list[str], log: Callable[[str], None]) -> None:
    """apt-get the system parts (PoCL's ICD, clang for tinygrad's CPU device) and pip-install the Python
    parts into this interpreter's environment. Only what is missing; `apt-get update` runs once first."""
    apt = [p for name in peers for p in APT_PACKAGES.get(name, []) if not _dpkg_installed(p)]
    if apt:
        if shutil.which("apt-get") is None:
            log(f"install: apt-get not found; install {' '.join(apt)} with your package manager")
        else:
            env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
            log("install: apt-get update")
            subprocess.run(["apt-get", "update"], env=env, check=False, stdout=subprocess.DEVNULL)
            log(f"install: apt-get install -y {' '.join(apt)}")
            r = subprocess.run(["apt-get", "install", "-y", "--no-install-recommends", *apt], env=env, check=False,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            if r.returncode: log(f"install: apt-get failed ({r.returncode}): {r.stderr.strip()[-400:]}")
    pip = [dist for name in peers for dist, mod in [PIP_PACKAGES[name]] if importlib.util.find_spec(mod) is None]
    if pip:
        log(f"install: {sys.executable} -m pip install {' '.join(pip)}")
        r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", *pip], check=False, stderr=subprocess.PIPE, text=True)
        if r.returncode: log(f"install: pip failed ({r.returncode}): {r.stderr.strip()[-400:]}")
        importlib.invalidate_caches()
    if not apt and not pip: log(f"install: {', '.join(peers)} already installed")


def missing_reason(name: str) -> str | None:
    """Why a peer cannot run (checked cheaply, before starting its process), or None."""
    dist, mod = PIP_PACKAGES[name]
    if importlib.util.find_spec(mod) is None:
        return f"{mod} is not installed (python -m hcq.bench --install-peers installs it: pip install {dist}" + \
               (", apt-get install pocl-opencl-icd)" if name == "pocl" else ", apt-get install clang)")
    if name == "tinygrad" and shutil.which("clang") is None:
        return "clang is not on PATH; tinygrad's CPU device compiles with it (apt-get install clang, or --install-peers)"
    return None


class PeerProcess:
    """A running peer server; `request` sends one section and waits (bounded) for its answer."""

    def __init__(self, name: str, timeout_s: float = 120.0):
        self.name = name
        env = dict(os.environ)
        if name == "tinygrad":
            env.pop("CPU", None)  # tinygrad 0.14 refuses CPU=1 ("deprecated, use DEV=CPU")
            env["DEV"] = "CPU"
        self.log = tempfile.NamedTemporaryFile(prefix=f"bench-{name}-", suffix=".log", delete=False)  # the peer's stderr
        self.proc = subprocess.Popen([sys.executable, "-m", "hcq.bench.peers", "serve", name], env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, text=True, bufsize=1)
        self._stdout_junk: list[str] = []
        hello = self._read(timeout_s)
        self.ready = bool(hello and hello.get("ready"))
        self.info: dict[str, Any] = hello.get("info", {}) if hello else {}
        self.reason = (hello or {}).get("reason") or (None if self.ready else f"did not start: {self.stderr_tail()}")
        if not self.ready: self.close()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _read(self, timeout_s: float) -> dict[str, Any] | None:
        """The next protocol line (the peer writes one and then waits for us, so a line is never split
        across select wake-ups), or None on timeout or exit."""
        assert self.proc.stdout is not None
        end = time.monotonic() + timeout_s
        while (left := end - time.monotonic()) > 0:
            r, _, _ = select.select([self.proc.stdout], [], [], left)
            if not r: continue
            line = self.proc.stdout.readline()
            if not line: return None  # exited
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                self._stdout_junk.append(line.rstrip())
        return None

    def stderr_tail(self) -> str:
        try:
            lines = [ln for ln in Path(self.log.name).read_text(errors="replace").splitlines() if ln.strip()]
        except OSError:
            lines = []
        tail = " | ".join((lines + self._stdout_junk)[-4:])
        return f"{tail or 'no output'} (exit code {self.proc.poll()}; log {self.log.name})"

    def request(self, section: str, cfg: Config, timeout_s: float = 300.0) -> dict[str, Any]:
        if not self.ready: return {"ok": False, "error": self.reason}
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps({"section": section, "cfg": cfg.to_json()}) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            self.ready, self.reason = False, f"exited: {self.stderr_tail()}"
            return {"ok": False, "error": self.reason}
        ans = self._read(timeout_s)
        if ans is None:
            self.ready, self.reason = False, f"no answer within {timeout_s:.0f} s or exited ({self.stderr_tail()})"
            self.close()
            return {"ok": False, "error": self.reason}
        return ans

    def close(self) -> None:
        """End the peer process (it exits when its stdin closes); its log is kept only if something failed."""
        if self.proc.poll() is None:
            try:
                if self.proc.stdin: self.proc.stdin.close()
                self.proc.wait(timeout=10)
            except (subprocess.TimeoutExpired, BrokenPipeError, OSError):
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        if self.ready and not self._stdout_junk:
            try:
                os.unlink(self.log.name)
            except OSError:
                pass


# ---------------------------------------------------------------- PoCL (PyOpenCL)
CL_EMPTY = "__kernel void empty(__global float *a) { }"
CL_SPIN = r"""
#pragma OPENCL EXTENSION cl_khr_fp64 : enable
__kernel void spin(__global double *out, int iters) {
  size_t g = get_global_id(0);
  double x = 1.0 + (double)g * 1e-3, y = 0.5;
  for (int i = 0; i < iters; i++) {
    x = x * 0.9999997 + 1e-7;
    y = y * 0.999999 + x * 1e-6;
  }
  out[g] = x + y;
}
"""


class PoCLPeer:
    """PyOpenCL on PoCL's CPU device. Kernel arguments are set once; launches are enqueue_nd_range_kernel."""

    def __init__(self) -> None:
        import numpy as np
        import pyopencl as cl  # type: ignore[import-not-found, unused-ignore]  # untyped; absent unless --install-peers
        self.cl, self.np = cl, np
        devs = [(p, d) for p in cl.get_platforms() for d in p.get_devices() if "portable" in p.name.lower() or "pocl" in p.name.lower()]
        if not devs:
            plats = ", ".join(p.name for p in cl.get_platforms()) or "none"
            raise RuntimeError(f"no PoCL platform (platforms: {plats}); apt-get install pocl-opencl-icd")
        self.platform, self.device = devs[0]
        self.ctx = cl.Context([self.device])
        self.q = cl.CommandQueue(self.ctx)
        self.buf = cl.Buffer(self.ctx, cl.mem_flags.READ_WRITE, 64)
        self.empty = cl.Kernel(cl.Program(self.ctx, CL_EMPTY).build(), "empty")
        self.empty.set_arg(0, self.buf)

    def info(self) -> dict[str, Any]:
        import importlib.metadata as md
        return {"pyopencl": md.version("pyopencl"), "platform": f"{self.platform.name} {self.platform.version}",
                "device": self.device.name, "compute_units": self.device.max_compute_units}

    def rt(self, cfg: Config) -> dict[str, Any]:
        cl, q, k = self.cl, self.q, self.empty

        def once() -> None:
            cl.enqueue_nd_range_kernel(q, k, (1,), (1,))
            q.finish()
        return rt_result(time_each(once, cfg.rt_samples, warmup=100))

    def pipe(self, cfg: Config) -> dict[str, Any]:
        cl, q, k = self.cl, self.q, self.empty
        per, chunks = pipelined_batches(lambda: cl.enqueue_nd_range_kernel(q, k, (1,), (1,)), q.finish, cfg)
        return {"us_per_kernel": median(per) / 1e3, "tail": tail(chunks, 1e-3)}

    def copy(self, cfg: Config) -> dict[str, Any]:
        """copyin = blocking enqueue_copy host -> buffer, copyout = buffer -> host, d2d = buffer -> buffer on the
        one PoCL device (+ finish): PoCL has no second device to copy to."""
        cl, np, q = self.cl, self.np, self.q
        res = {}
        for size in cfg.copy_sizes:
            reps = cfg.copy_reps(size)
            src, dst = np.full(size, 7, np.uint8), np.ones(size, np.uint8)
            b0 = cl.Buffer(self.ctx, cl.mem_flags.READ_WRITE, size)
            b1 = cl.Buffer(self.ctx, cl.mem_flags.READ_WRITE, size)

            def d2d() -> None:
                cl.enqueue_copy(q, b1, b0)
                q.finish()
            row = {}
            for name, fn in (("copyin", lambda: cl.enqueue_copy(q, b0, src, is_blocking=True)),
                             ("copyout", lambda: cl.enqueue_copy(q, dst, b0, is_blocking=True)), ("d2d", d2d)):
                ns = time_each(fn, reps, warmup=2)
                row[name] = size / (median(ns) / 1e9) / 1e9
            dst[:] = 0
            cl.enqueue_copy(q, dst, b1, is_blocking=True)
            if not (dst[0] == 7 and dst[-1] == 7): raise AssertionError(f"PoCL copy of {size} bytes lost data")
            res[str(size)] = row
            b0.release()
            b1.release()
        return res

    def compute(self, cfg: Config) -> dict[str, Any]:
        """The same compute-bound kernel over compute_blocks work-items (PoCL picks the work-group size and
        uses all cores). Best of compute_repeats wall times (enqueue + finish)."""
        cl, np, q = self.cl, self.np, self.q
        n = cfg.compute_blocks
        out = cl.Buffer(self.ctx, cl.mem_flags.READ_WRITE, n * 8)
        k = cl.Kernel(cl.Program(self.ctx, CL_SPIN).build(), "spin")
        k.set_args(out, np.int32(cfg.compute_iters))
        times = []
        for i in range(cfg.compute_repeats + 1):
            t = time.perf_counter()
            cl.enqueue_nd_range_kernel(q, k, (n,), None)
            q.finish()
            if i: times.append(time.perf_counter() - t)
        host = np.empty(n, np.float64)
        cl.enqueue_copy(q, host, out, is_blocking=True)
        return {"ms_all": min(times) * 1e3, "median_ms_all": median(times) * 1e3, "checksum": float(host.sum())}

    def signal(self, cfg: Config) -> dict[str, Any]:
        """Cross-queue ping-pong: two in-order queues, markers chained through event wait lists (A_i waits
        for B_(i-1), B_i waits for A_i), all enqueued behind a user event the host then completes. Timed
        like hcq's: from the start of A's marker after `warm` round trips to the end of the last B marker,
        with PoCL's profiling timestamps. PoCL has one CPU device, so there is no cross-device case."""
        cl = self.cl
        props = cl.command_queue_properties.PROFILING_ENABLE
        qa, qb = cl.CommandQueue(self.ctx, properties=props), cl.CommandQueue(self.ctx, properties=props)
        warm, n = cfg.signal_round_trips
        dev_ns, wall_ns, tails = [], [], []
        for _ in range(cfg.signal_repeats):
            gate = cl.UserEvent(self.ctx)
            prev, marks = gate, []  # marks: A's marker at the start of each chunk of SIGNAL_CHUNK timed round trips
            for i in range(warm + n):
                a = cl.enqueue_marker(qa, wait_for=[prev])
                if i >= warm and (i - warm) % SIGNAL_CHUNK == 0: marks.append(a)
                prev = cl.enqueue_marker(qb, wait_for=[a])
            t = time.perf_counter_ns()
            gate.set_status(cl.command_execution_status.COMPLETE)
            prev.wait()
            wall_ns.append(time.perf_counter_ns() - t)
            dev_ns.append(float(prev.profile.end - marks[0].profile.start))
            ns = [m.profile.start for m in marks] + [prev.profile.end]
            tails.append(tail([(b - a) / k for a, b, k in zip(ns, ns[1:], chunk_sizes(n, SIGNAL_CHUNK))]))
            qa.finish()
            qb.finish()
        return {"cross_queue": signal_result(dev_ns, wall_ns, warm, n, tails), "cross_device": None}


# ---------------------------------------------------------------- tinygrad (TinyJit on the CPU device)
class TinygradPeer:
    """tinygrad's CPU device (DEV=CPU, compiled with clang). Graph replay: a TinyJit function running K
    separate tiny kernels, `x = (x + 1).realize()` on 16 floats (called 3 times to capture, then replayed)."""

    def __init__(self) -> None:
        from tinygrad import Device, Tensor, TinyJit  # type: ignore[import-not-found, unused-ignore]  # absent unless --install-peers
        self.Device, self.Tensor, self.TinyJit = Device, Tensor, TinyJit
        if Device.DEFAULT != "CPU": raise RuntimeError(f"tinygrad picked device {Device.DEFAULT}, not CPU (set DEV=CPU)")
        self.dev = Device["CPU"]

    def info(self) -> dict[str, Any]:
        import importlib.metadata as md
        return {"tinygrad": md.version("tinygrad"), "device": "CPU", "device_class": type(self.dev).__name__}

    def graph(self, cfg: Config) -> dict[str, Any]:
        Tensor, TinyJit = self.Tensor, self.TinyJit
        out: dict[str, Any] = {"K": {}}
        for K in GRAPH_KS:
            def body(x: Any, K: int = K) -> Any:
                for _ in range(K): x = (x + 1).realize()
                return x
            f = TinyJit(body)
            x = Tensor.zeros(16).contiguous().realize()
            t = time.perf_counter()
            for _ in range(3): r = f(x)  # run, capture, first replay
            self.dev.synchronize()
            setup_s = time.perf_counter() - t
            if float(r.numpy()[0]) != K: raise AssertionError(f"tinygrad K={K}: got {r.numpy()[0]}")
            host, wall = [], []
            pc = time.perf_counter_ns
            for _ in range(cfg.tinygrad_replays[K]):
                t0 = pc()
                f(x)
                t1 = pc()
                self.dev.synchronize()
                t2 = pc()
                host.append(t1 - t0)
                wall.append(t2 - t0)
            out["K"][K] = {"host_us": median(host) / 1e3, "wall_us": median(wall) / 1e3, "setup_ms": setup_s * 1e3, "replays": len(host)}
        ks = list(GRAPH_KS)
        out["wall_fixed_us"], out["wall_us_per_kernel"] = slope_fit(ks, [out["K"][k]["wall_us"] for k in ks])
        out["host_fixed_us"], out["host_us_per_kernel"] = slope_fit(ks, [out["K"][k]["host_us"] for k in ks])
        return out


PEER_CLASSES: dict[str, Any] = {"pocl": PoCLPeer, "tinygrad": TinygradPeer}
SECTION_METHODS = {"rt": "rt", "pipe": "pipe", "graph": "graph", "copy": "copy", "compute": "compute", "signal": "signal"}
PEER_SECTIONS = {"pocl": ("rt", "pipe", "copy", "compute", "signal"), "tinygrad": ("graph",)}  # what each peer has to compare


def serve(name: str) -> int:
    """Peer process main loop (see the module docstring)."""
    proto: IO[str] = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything the libraries print goes to stderr
    sys.stdout = sys.stderr

    def send(obj: dict[str, Any]) -> None:
        proto.write(json.dumps(obj) + "\n")
        proto.flush()
    try:
        peer = PEER_CLASSES[name]()
        send({"ready": True, "info": peer.info()})
    except Exception as e:  # noqa: BLE001 - reported to the driver as the reason the peer is skipped
        send({"ready": False, "reason": f"{type(e).__name__}: {e}"})
        return 0
    for line in sys.stdin:
        try:
            req = json.loads(line)
            method = getattr(peer, SECTION_METHODS.get(req["section"], ""), None)
            if method is None:
                send({"ok": True, "result": None})  # this peer has nothing comparable for the section
                continue
            send({"ok": True, "result": method(Config.from_json(req["cfg"]))})
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            send({"ok": False, "error": f"{type(e).__name__}: {e}"})
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "serve": sys.exit(serve(sys.argv[2]))
    print("usage: python -m hcq.bench.peers serve {pocl,tinygrad}", file=sys.stderr)
    sys.exit(2)
