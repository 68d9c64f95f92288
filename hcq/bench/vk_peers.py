"""The peers of the Vulkan benchmark, each measured in its own process so that a driver crash cannot take the
bench down:

    python -m hcq.bench.vk_peers raw|wgpu [--quick]     (prints one JSON line)

raw   hcq/bench/vk_raw.c, plain C against the Vulkan API (the floor): one instance, one device, one compute queue,
      one command buffer recorded once per measurement, completion through a timeline semaphore (vkWaitSemaphores)
wgpu  the wgpu Python package (wgpu-native) on its Vulkan adapter; not a dependency of hcq: absent, it is skipped

Both measure the same four things (medians):
  rt_us            one empty dispatch (local size 1): submit + wait for completion
  per_dispatch_us  K in DISPATCH_KS dispatches in one command buffer, each ordered after the previous by a barrier,
                   submit + wait: the slope of time over K (common.slope_fit), and fixed_us, its intercept
  pipelined_us     N single-dispatch submits back to back, one wait at the end: time per dispatch
  copy_gbps        64 MiB buffer -> buffer copy on the device (device-local memory), submit + wait: bytes / time
Commands are recorded (wgpu: encoded; its command buffers are single-use, so one per submit) before the clock
starts; wgpu's encoding cost is reported apart (encode_us, encode_per_dispatch_us).
"""
from __future__ import annotations

import argparse
import ctypes
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Protocol

from hcq.bench.common import MB, Config, median, quantile, slope_fit

PEER_NAMES = ("raw", "wgpu")
DISPATCH_KS = (1, 2, 4, 8, 16, 32)
COPY_BYTES = 64 * MB
VULKAN_LIB = "libvulkan.so.1"
GLSL_EMPTY = "#version 450\nlayout(local_size_x = 1) in;\nvoid main() {}\n"
# The binding is unused by the shader, but wgpu tracks a read_write storage buffer bound to a dispatch and puts
# a barrier between consecutive dispatches that use it: the order the raw peer gets from its explicit barriers.
WGSL_EMPTY = "@group(0) @binding(0) var<storage, read_write> unused: array<u32>;\n@compute @workgroup_size(1) fn main() {}\n"
RAW_WAIT = "timeline semaphore: vkQueueSubmit signals value n, vkWaitSemaphores waits for it"


# ---------------------------------------------------------------- availability
@functools.lru_cache(maxsize=None)
def missing_vulkan_reason() -> str | None:
    """Why Vulkan cannot be used here (no libvulkan.so.1, no Vulkan physical device, no glslangValidator on
    PATH), or None. The device probe creates a bare VkInstance in this process; the answer is cached."""
    try:
        lib = ctypes.CDLL(VULKAN_LIB)
    except OSError as e:
        return f"the Vulkan loader {VULKAN_LIB} cannot be loaded ({e}); apt-get install libvulkan1 mesa-vulkan-drivers"
    n = _count_physical_devices(lib)
    if isinstance(n, str): return n
    if n == 0: return "the Vulkan loader finds no physical device (no ICD installed? apt-get install mesa-vulkan-drivers for lavapipe)"
    if shutil.which("glslangValidator") is None: return "glslangValidator is not on PATH (apt-get install glslang-tools)"
    return None


class _VkInstanceCreateInfo(ctypes.Structure):
    _fields_ = [("sType", ctypes.c_int), ("pNext", ctypes.c_void_p), ("flags", ctypes.c_uint32), ("pApplicationInfo", ctypes.c_void_p),
                ("enabledLayerCount", ctypes.c_uint32), ("ppEnabledLayerNames", ctypes.c_void_p),
                ("enabledExtensionCount", ctypes.c_uint32), ("ppEnabledExtensionNames", ctypes.c_void_p)]


def _count_physical_devices(lib: ctypes.CDLL) -> int | str:
    """The number of Vulkan physical devices, or why they could not be counted."""
    VK_STRUCTURE_TYPE_INSTANCE_CREATE_INFO = 1
    inst, count = ctypes.c_void_p(), ctypes.c_uint32(0)
    lib.vkCreateInstance.argtypes = [ctypes.POINTER(_VkInstanceCreateInfo), ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p)]
    lib.vkEnumeratePhysicalDevices.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint32), ctypes.c_void_p]
    lib.vkDestroyInstance.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    r = lib.vkCreateInstance(ctypes.byref(_VkInstanceCreateInfo(sType=VK_STRUCTURE_TYPE_INSTANCE_CREATE_INFO)), None, ctypes.byref(inst))
    if r != 0: return f"vkCreateInstance failed (VkResult {r}; {'no Vulkan driver (ICD) installed' if r == -9 else 'see VK_LOADER_DEBUG=all'})"
    try:
        r = lib.vkEnumeratePhysicalDevices(inst, ctypes.byref(count), None)
        return count.value if r == 0 else f"vkEnumeratePhysicalDevices failed (VkResult {r})"
    finally:
        lib.vkDestroyInstance(inst, None)


# ---------------------------------------------------------------- the measurements, shared by both peers
class _Peer(Protocol):
    """What a peer provides; _measure turns it into the numbers. All times in nanoseconds."""

    def time_dispatches(self, k: int, reps: int) -> list[float]: ...   # each submit+wait of k ordered dispatches
    def pipelined(self, n: int) -> float: ...                         # n single-dispatch submits + one wait, total
    def time_copy(self, reps: int) -> list[float]: ...                # each submit+wait of a COPY_BYTES copy


K_ROUNDS = 3  # the per-K round trips are taken in this many interleaved rounds


def _k_reps(cfg: Config) -> int:
    """Round trips per K of the per-dispatch fit (a fifth of the round-trip samples, at least 60)."""
    return max(60, cfg.rt_samples // 5) // K_ROUNDS * K_ROUNDS


def _measure(peer: _Peer, cfg: Config) -> dict[str, Any]:
    """The four measurements (see the module's docstring) in microseconds and GB/s."""
    peer.time_dispatches(1, max(20, cfg.rt_samples // 20))  # warm-up: first submits, page faults
    rt = peer.time_dispatches(1, cfg.rt_samples)
    k_ns: dict[int, list[float]] = {k: [] for k in DISPATCH_KS}
    for _ in range(K_ROUNDS):  # interleaved, so that a change in the machine's speed hits every K alike
        for k in DISPATCH_KS: k_ns[k] += peer.time_dispatches(k, _k_reps(cfg) // K_ROUNDS)
    k_us = {k: median(v) / 1e3 for k, v in k_ns.items()}
    fixed, per = slope_fit(list(k_us), list(k_us.values()))
    pipe = [peer.pipelined(cfg.pipe_kernels) / cfg.pipe_kernels / 1e3 for _ in range(cfg.pipe_batches)]
    copy_reps = cfg.copy_reps(COPY_BYTES)
    copy = peer.time_copy(copy_reps)
    return {"rt_us": median(rt) / 1e3, "rt_p10_us": quantile(rt, 0.1) / 1e3, "rt_p90_us": quantile(rt, 0.9) / 1e3,
            "dispatch_us": {str(k): v for k, v in k_us.items()}, "fixed_us": fixed, "per_dispatch_us": per,
            "pipelined_us": median(pipe), "copy_gbps": COPY_BYTES / (median(copy) / 1e9) / 1e9, "copy_bytes": COPY_BYTES,
            "reps": {"rt": cfg.rt_samples, "per_k": _k_reps(cfg), "pipelined": [cfg.pipe_kernels, cfg.pipe_batches], "copy": copy_reps}}


# ---------------------------------------------------------------- raw: vk_raw.c through ctypes
def _spirv(glsl: str) -> bytes:
    """SPIR-V of a GLSL compute shader, compiled by glslangValidator -V."""
    with tempfile.TemporaryDirectory(prefix="hcq-vk-") as tmp:
        src, out = Path(tmp) / "shader.comp", Path(tmp) / "shader.spv"
        src.write_text(glsl)
        r = subprocess.run(["glslangValidator", "-V", "-o", str(out), str(src)], capture_output=True, text=True, timeout=60)
        if r.returncode: raise RuntimeError(f"glslangValidator failed ({r.returncode}): {(r.stdout + r.stderr).strip()[-800:]}")
        return out.read_bytes()


def _load_raw_library() -> ctypes.CDLL:
    """vk_raw.c built (or taken from hcq's compile cache) and loaded, with its functions' signatures set."""
    from hcq.toolchain import build_shared_object
    source = Path(__file__).with_name("vk_raw.c").read_text()
    path = build_shared_object(source, ("-O2", "-std=c11", "-Wall", "-Wl,--no-as-needed", "-lvulkan"), "vk_raw")
    lib = ctypes.CDLL(str(path))
    vp, dp = ctypes.c_void_p, ctypes.POINTER(ctypes.c_double)
    for name, res, args in (("vkb_open", vp, [ctypes.c_int, vp, ctypes.c_size_t, ctypes.c_uint64, ctypes.c_char_p, ctypes.c_size_t]),
                            ("vkb_close", None, [vp]), ("vkb_error", ctypes.c_char_p, [vp]), ("vkb_device_name", ctypes.c_char_p, [vp]),
                            ("vkb_copy_memory_flags", ctypes.c_uint32, [vp]), ("vkb_time_dispatches", ctypes.c_int, [vp, ctypes.c_int, ctypes.c_int, dp]),
                            ("vkb_pipelined", ctypes.c_int, [vp, ctypes.c_int, dp]), ("vkb_time_copy", ctypes.c_int, [vp, ctypes.c_int, dp])):
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = res, args
    return lib


class RawVulkan:
    """The C floor (vk_raw.c) on physical device `index`; close() destroys its Vulkan objects."""

    def __init__(self, index: int = 0) -> None:
        self.lib = _load_raw_library()
        spv = _spirv(GLSL_EMPTY)
        words = (ctypes.c_uint32 * (len(spv) // 4)).from_buffer_copy(spv)  # SPIR-V is read as 32-bit words: aligned
        err = ctypes.create_string_buffer(512)
        self.h = self.lib.vkb_open(index, ctypes.addressof(words), len(spv), COPY_BYTES, err, len(err))
        if not self.h: raise RuntimeError(f"vk_raw: {err.value.decode(errors='replace')}")

    def _samples(self, fn: Callable[..., int], n: int, *args: int) -> list[float]:
        out = (ctypes.c_double * n)()
        if fn(self.h, *args, out) != 0: raise RuntimeError(f"vk_raw: {self.lib.vkb_error(self.h).decode(errors='replace')}")
        return list(out)

    def time_dispatches(self, k: int, reps: int) -> list[float]:
        return self._samples(self.lib.vkb_time_dispatches, reps, k, reps)

    def pipelined(self, n: int) -> float:
        return self._samples(self.lib.vkb_pipelined, 1, n)[0]

    def time_copy(self, reps: int) -> list[float]:
        return self._samples(self.lib.vkb_time_copy, reps, reps)

    def info(self) -> dict[str, Any]:
        flags = self.lib.vkb_copy_memory_flags(self.h)
        names = [n for bit, n in ((1, "DEVICE_LOCAL"), (2, "HOST_VISIBLE"), (4, "HOST_COHERENT"), (8, "HOST_CACHED")) if flags & bit]
        return {"device": self.lib.vkb_device_name(self.h).decode(), "copy_memory": "|".join(names) or hex(flags)}

    def close(self) -> None:
        if self.h: self.lib.vkb_close(self.h)
        self.h = None


def raw_vulkan(cfg: Config, index: int = 0) -> dict[str, Any]:
    """The raw Vulkan floor's numbers on physical device `index` (in this process: see measure_peer)."""
    peer = RawVulkan(index)
    try:
        return {"peer": "raw", **peer.info(), "wait": RAW_WAIT, **_measure(peer, cfg)}
    finally:
        peer.close()


# ---------------------------------------------------------------- wgpu-py
class WgpuPeer:
    """wgpu-py on its first Vulkan adapter (llvmpipe here: wgpu takes a CPU adapter without being forced)."""

    def __init__(self, wgpu: Any) -> None:
        self.wgpu = wgpu
        adapters = [a for a in wgpu.gpu.enumerate_adapters_sync() if a.info.get("backend_type") == "Vulkan"]
        if not adapters: raise RuntimeError("wgpu finds no Vulkan adapter (adapters: " +
                                            ", ".join(f"{a.info['device']} ({a.info['backend_type']})" for a in wgpu.gpu.enumerate_adapters_sync()) + ")")
        self.adapter = adapters[0]
        self.device = self.adapter.request_device_sync()
        bu, su = wgpu.BufferUsage, wgpu.ShaderStage
        self.scratch = self.device.create_buffer(size=256, usage=bu.STORAGE)
        bgl = self.device.create_bind_group_layout(entries=[{"binding": 0, "visibility": su.COMPUTE, "buffer": {"type": "storage"}}])
        self.bind_group = self.device.create_bind_group(layout=bgl, entries=[{"binding": 0, "resource": {"buffer": self.scratch}}])
        self.pipeline = self.device.create_compute_pipeline(
            layout=self.device.create_pipeline_layout(bind_group_layouts=[bgl]),
            compute={"module": self.device.create_shader_module(code=WGSL_EMPTY), "entry_point": "main"})
        self.src, self.dst = (self.device.create_buffer(size=COPY_BYTES, usage=bu.COPY_SRC | bu.COPY_DST) for _ in range(2))
        self.encode_ns: dict[int, list[float]] = {}  # k -> encode time of each k-dispatch command buffer
        self.wait, self.wait_kind = self._waiter()

    def _waiter(self) -> tuple[Callable[[], None], str]:
        """How to wait for submitted work: queue.on_submitted_work_done_sync() (resolved by wgpu-py's poll thread)
        where it works; else wgpuDevicePoll(wait=true) through the device's _poll_wait(), which returns when the
        queue is empty: the same here, where one submit at a time is waited for (the pipelined one waits last)."""
        q = self.device.queue
        try:
            q.on_submitted_work_done_sync()
            return q.on_submitted_work_done_sync, "queue.on_submitted_work_done_sync()"
        except TypeError as e:  # wgpu-py 0.32.0 builds its callback with the wrong signature (pygfx/wgpu-py#834)
            poll = getattr(self.device, "_poll_wait", None)
            if poll is None: raise RuntimeError(f"queue.on_submitted_work_done_sync() fails ({e}) and there is no device._poll_wait") from e
            poll()
            return poll, f"device._poll_wait() = wgpuDevicePoll(wait=true): on_submitted_work_done_sync() fails in wgpu {self.wgpu.__version__} ({str(e)[:60]}...)"

    def _dispatches(self, k: int) -> Any:
        """A command buffer with k dispatches in one compute pass (timed into encode_ns)."""
        t = time.perf_counter_ns()
        enc = self.device.create_command_encoder()
        cp = enc.begin_compute_pass()
        cp.set_pipeline(self.pipeline)
        cp.set_bind_group(0, self.bind_group)
        for _ in range(k): cp.dispatch_workgroups(1, 1, 1)
        cp.end()
        cb = enc.finish()
        self.encode_ns.setdefault(k, []).append(time.perf_counter_ns() - t)
        return cb

    def _copy(self) -> Any:
        enc = self.device.create_command_encoder()
        enc.copy_buffer_to_buffer(self.src, 0, self.dst, 0, COPY_BYTES)
        return enc.finish()

    def _round_trips(self, cbs: list[Any]) -> list[float]:
        q, out, pc = self.device.queue, [], time.perf_counter_ns
        for cb in cbs:
            t = pc()
            q.submit([cb])
            self.wait()
            out.append(float(pc() - t))
        return out

    def time_dispatches(self, k: int, reps: int) -> list[float]:
        return self._round_trips([self._dispatches(k) for _ in range(reps)])

    def pipelined(self, n: int) -> float:
        cbs, q = [self._dispatches(1) for _ in range(n)], self.device.queue
        t = time.perf_counter_ns()
        for cb in cbs: q.submit([cb])
        self.wait()
        return float(time.perf_counter_ns() - t)

    def time_copy(self, reps: int) -> list[float]:
        """Copies of a patterned source (checked once through read_buffer before timing)."""
        pattern = bytes(range(251)) * (COPY_BYTES // 251 + 1)
        self.device.queue.write_buffer(self.src, 0, pattern[:COPY_BYTES])
        self._round_trips([self._copy()])
        back = self.device.queue.read_buffer(self.dst)
        if bytes(back[:4096]) != pattern[:4096] or bytes(back[-4096:]) != pattern[COPY_BYTES - 4096:COPY_BYTES]:
            raise RuntimeError("wgpu copy_buffer_to_buffer check: the destination does not hold the source bytes")
        return self._round_trips([self._copy() for _ in range(reps)])

    def info(self) -> dict[str, Any]:
        import importlib.metadata as md
        i = self.adapter.info
        return {"device": i.get("device"), "adapter": {k: i.get(k) for k in ("device", "description", "adapter_type", "backend_type", "vendor")},
                "wgpu": md.version("wgpu")}

    def encode_stats(self) -> dict[str, Any]:
        """Median encode time of a 1-dispatch command buffer and the per-dispatch slope of encoding (us)."""
        meds = {k: median(v) / 1e3 for k, v in self.encode_ns.items()}
        _, per = slope_fit(list(meds), list(meds.values()))
        return {"encode_us": meds[1], "encode_per_dispatch_us": per}

    def close(self) -> None:
        for b in (self.src, self.dst, self.scratch): b.destroy()
        self.device.destroy()


def wgpu_peer(cfg: Config) -> dict[str, Any]:
    """wgpu-py's numbers (in this process: see measure_peer); {"skipped": reason} without the wgpu package."""
    try:
        import wgpu  # type: ignore[import-not-found, import-untyped, unused-ignore]  # optional: not a dependency of hcq
    except ImportError as e:
        return {"skipped": f"the wgpu package is not installed ({e}); pip install wgpu to measure it"}
    peer = WgpuPeer(wgpu)
    try:
        res = _measure(peer, cfg)
        return {"peer": "wgpu", **peer.info(), "wait": peer.wait_kind, **res, **peer.encode_stats()}
    finally:
        peer.close()


# ---------------------------------------------------------------- each peer in its own process
def measure_peer(name: str, quick: bool, timeout_s: float | None = None, cfg: Config | None = None) -> dict[str, Any]:
    """Run peer `name` ("raw" or "wgpu") in a child process (`python -m hcq.bench.vk_peers NAME`) and return its
    numbers, or {"skipped": reason} when it cannot run, crashes, prints no result or outlives `timeout_s`
    (default 120 s quick, 600 s full). `cfg` sets the repetition counts (default: Config.quick() or Config())."""
    if name not in PEER_NAMES: raise ValueError(f"unknown Vulkan peer {name!r}; choose from {', '.join(PEER_NAMES)}")
    if (why := missing_vulkan_reason()) is not None: return {"skipped": why}
    timeout_s = timeout_s or (120.0 if quick else 600.0)
    cmd = [sys.executable, "-m", "hcq.bench.vk_peers", name, *(["--quick"] if quick else []),
           *(["--cfg", json.dumps(cfg.to_json())] if cfg is not None else [])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH")]))}
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env, start_new_session=True)
    except subprocess.TimeoutExpired:
        return {"skipped": f"the {name} peer did not finish within {timeout_s:g} s"}
    for line in reversed(r.stdout.splitlines()):
        if line.startswith("{"):
            try:
                return dict(json.loads(line))
            except json.JSONDecodeError:
                break
    tail = " | ".join([ln for ln in (r.stderr + r.stdout).splitlines() if ln.strip() and "XDG_RUNTIME_DIR" not in ln][-4:])
    return {"skipped": f"the {name} peer exited with code {r.returncode} and no result: {tail or 'no output'}"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hcq.bench.vk_peers", description=__doc__.splitlines()[0])
    ap.add_argument("peer", choices=PEER_NAMES)
    ap.add_argument("--quick", action="store_true", help="fewer repetitions (a smoke run)")
    ap.add_argument("--device", type=int, default=0, help="Vulkan physical device index (raw peer)")
    ap.add_argument("--cfg", default=None, help="repetition counts as Config JSON (overrides --quick's)")
    args = ap.parse_args(argv)
    cfg = Config.from_json(json.loads(args.cfg)) if args.cfg else Config.quick() if args.quick else Config()
    t = time.perf_counter()
    res: dict[str, Any]
    try:
        if (why := missing_vulkan_reason()) is not None: res = {"skipped": why}
        else: res = raw_vulkan(cfg, args.device) if args.peer == "raw" else wgpu_peer(cfg)
    except Exception as e:  # noqa: BLE001  # reported as the peer's skip reason, one line
        res = {"skipped": f"{type(e).__name__}: {e}"}
    res["wall_s"] = round(time.perf_counter() - t, 2)
    res["lp_num_threads"] = os.environ.get("LP_NUM_THREADS")
    print(json.dumps(res), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
