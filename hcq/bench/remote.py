"""Remote devices against in-process ones, side by side in one run on one host (not a test):

    python -m hcq.bench.remote [--transports shm,shm-messages,tcp] [--json FILE]

For each UCX transport (shm: UCX's choice on one host, the client sharing its runtime memory with the server;
shm-messages: the same with HCQ_REMOTE_SHARE=0 in the client, its runtime memory mirrored by messages; tcp:
UCX_TLS=tcp and messages, the path between hosts; shm-unconfined: `hcq serve --no-confine`, workers that keep the
server's user and so reach their clients over UCX's shared memory; shm-one-process: `hcq serve --isolation none`, every client in
the server's one process, for the cost of a worker process per client) an `hcq serve` is started and a client
process measures, against CPU:0 of this process measured in the same client:
  round trip      launch of an empty kernel + synchronize, median (target: remote <= 3x in-process)
  pipelined       empty launches back to back, per launch
  payload->signal a kernel on the server writes 64 bytes after a ~30 us delay (so the client already spins on its
                  copy of the signal), then a TIMESTAMP and a SIGNAL: server timestamp of the store -> client clock
                  when it sees the value (one host, one clock); median (target <= 2 us on shared memory)
  copyin/copyout  64 MiB host <-> device, GB/s, against memcpy of the same size in the client
  transfer        64 MiB between the two devices of one server (on the server's copy engine), GB/s against memcpy
  server->server  64 MiB from a device of one server to a device of another, never through the client, GB/s against
                  memcpy (target >= 0.8x). mapped: on one host the first server maps the destination (its memfd) and
                  its copy engine writes it directly. As between hosts (destination started with HCQ_REMOTE_SHARE=0):
                  pushed (the default): the copy engine writes a window whose bytes go as messages; put (both servers
                  with HCQ_REMOTE_PUT=1, trusted networks): the window is put into the destination's registered memory
--vk: the same server-side device kinds for Vulkan: `hcq serve --devices VK:0` (lavapipe here) against VK:0 of the client
itself, per transport (shm, tcp): round trip and pipelined launches of a GLSL kernel with no work, copyin / copyout of
64 MiB (a worker confined or not: --no-confine; see BENCHMARKS.md), and with user buffers in device memory on both
sides (HCQ_VK_HOST_VISIBLE=0: the served side's copies then go through the staging ring and its copy queue).
tcp-netns (root only): a server and the client in two network namespaces joined by a veth pair (TCP, as between
hosts), a second server beside the client: round trip, copyin / copyout and server -> server of 64 MiB against a
plain Python TCP stream between the same namespaces in the same run (target: >= 0.7x the stream)
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import textwrap
import time
from typing import Any

TRANSPORTS = {"shm": {}, "shm-messages": {}, "tcp": {"UCX_TLS": "tcp"}, "shm-one-process": {}, "shm-unconfined": {}}  # the servers' environment
CLIENTS = {"shm": {}, "shm-messages": {"HCQ_REMOTE_SHARE": "0"}, "tcp": {"UCX_TLS": "tcp", "HCQ_REMOTE_SHARE": "0"},
           "shm-one-process": {}, "shm-unconfined": {}}  # the client's
SERVE_ARGS = {"shm-one-process": ("--isolation", "none"), "shm-unconfined": ("--no-confine",)}  # (the others: a worker process per client, the default)
NETNS = "tcp-netns"  # a row of its own (run_netns): server and client in two network namespaces

CLIENT = r"""
import ctypes, json, statistics, sys, time
import numpy as np, hcq
remote, local = hcq.Device(sys.argv[1]), hcq.Device("CPU:0")
out = {}
def round_trip(dev, n=400):
    prg = dev.compile("HCQ_KERNEL void e(int *a) { }", "e")
    buf = dev.allocator.alloc(64)
    for _ in range(50): prg(buf); dev.synchronize()
    ts = []
    for _ in range(n):
        t = time.perf_counter_ns(); prg(buf); dev.synchronize(); ts.append(time.perf_counter_ns() - t)
    t = time.perf_counter_ns()
    for _ in range(n): prg(buf)
    dev.synchronize()
    return statistics.median(ts) / 1e3, (time.perf_counter_ns() - t) / n / 1e3
for name, dev in (("remote", remote), ("local", local)):
    out[f"rt_{name}_us"], out[f"pipe_{name}_us"] = round_trip(dev)
# payload -> signal: the server's timestamp of the store against the client's clock when it sees the value. The
# kernel's delay lets the client reach its wait first, so what is measured is the way back, not the client's own
# Python after it sent the launch
sig, ts_sig = remote.new_signal(value=0), remote.new_signal(value=0)
dst = remote.allocator.alloc(64)
write = remote.compile("HCQ_KERNEL void w(unsigned long long *d, unsigned long long n) { "
                       "for (volatile unsigned long long k = 0; k < n; k++) {} for (int i = 0; i < 8; i++) d[i] = n + i; }", "w")
per_iter = min(write(dst, vals=(100000,), wait=True) for _ in range(5)) / 100000
delay = max(1000, int(30e-6 / per_iter))
lat = []
for i in range(1, 400):
    q = remote.hw_compute_queue_t().exec(write, write.fill_kernargs((dst,), (delay,)), (1, 1, 1), (1, 1, 1))
    q.timestamp(ts_sig).signal(sig, i).submit(remote)
    remote.connection.wait(sig._local_addr, i, 1000)  # spins progressing the engine (the PUSH is handled here)
    seen = time.monotonic_ns()  # (the command processor's clock: CLOCK_MONOTONIC; cheaper than a ctypes call)
    lat.append((seen - ts_sig.load_timestamp()) / 1e3)
out["payload_signal_us"] = statistics.median(lat)
size = 64 << 20
host = np.ones(size, np.uint8); host2 = np.empty_like(host)
def gbps(fn, reps=7):
    fn(); best = 1e9
    for _ in range(reps):
        t = time.perf_counter(); fn(); best = min(best, time.perf_counter() - t)
    return size / best / 1e9
a, b = remote.allocator.alloc(size), hcq.Device(sys.argv[2]).allocator.alloc(size)
putter = hcq.Device(sys.argv[6])  # (a server with HCQ_REMOTE_PUT=1, as is the destination of the put row)
pa = putter.allocator.alloc(size)
putter.allocator.copyin(pa, memoryview(host))
out["copyin_gbps"] = gbps(lambda: (remote.allocator.copyin(a, memoryview(host)), remote.synchronize()))
out["copyout_gbps"] = gbps(lambda: remote.allocator.copyout(memoryview(host2), a))
dev1 = b.owner
out["transfer_gbps"] = gbps(lambda: (dev1.allocator.transfer(b, a, size, remote, dev1), dev1.synchronize()))
for key, src, name in (("s2s_gbps", remote, sys.argv[3]), ("s2s_put_gbps", putter, sys.argv[4]), ("s2s_net_gbps", remote, sys.argv[5])):
    other, s = hcq.Device(name), (a if src is remote else pa)
    c = other.allocator.alloc(size)
    out[key] = gbps(lambda: (src.allocator.transfer(c, s, size, src, other), other.synchronize()))
out["memcpy_gbps"] = gbps(lambda: np.copyto(host2, host))
print("RESULT " + json.dumps(out))
"""


VK_CLIENT = r"""
import json, statistics, sys, time
import numpy as np, hcq
remote, local = hcq.Device(sys.argv[1]), hcq.Device("VK:0")
out = {}
for name, dev in (("remote", remote), ("local", local)):
    prg, buf = dev.compile(*dev.CONFORMANCE_KERNELS["fill"]), dev.allocator.alloc(64)
    launch = lambda: prg(buf, vals=(0, 0), global_size=(1, 1, 1), local_size=(1, 1, 1))  # (no invocation writes anything)
    for _ in range(30): launch(); dev.synchronize()
    ts = []
    for _ in range(200):
        t = time.perf_counter_ns(); launch(); dev.synchronize(); ts.append(time.perf_counter_ns() - t)
    t = time.perf_counter_ns()
    for _ in range(200): launch()
    dev.synchronize()
    out[f"rt_{name}_us"], out[f"pipe_{name}_us"] = statistics.median(ts) / 1e3, (time.perf_counter_ns() - t) / 200 / 1e3
    size = 64 << 20
    host, back, a = np.ones(size, np.uint8), np.empty(size, np.uint8), dev.allocator.alloc(size)
    def gbps(fn, reps=5):
        fn(); best = 1e9
        for _ in range(reps):
            t = time.perf_counter(); fn(); best = min(best, time.perf_counter() - t)
        return size / best / 1e9
    out[f"copyin_{name}_gbps"] = gbps(lambda: (dev.allocator.copyin(a, memoryview(host)), dev.synchronize()))
    out[f"copyout_{name}_gbps"] = gbps(lambda: dev.allocator.copyout(memoryview(back), a))
    assert (back == 1).all()
print("RESULT " + json.dumps(out))
"""
_DEVICE_MEMORY = {"HCQ_VK_HOST_VISIBLE": "0"}  # (user buffers in device memory, served and local alike)
VK_ROWS: dict[str, tuple[str, tuple[str, ...], dict[str, str]]] = {
    "shm": ("shm", (), {}), "shm-unconfined": ("shm", ("--no-confine",), {}), "tcp-unconfined": ("tcp", ("--no-confine",), {}),
    "shm-unconfined, device memory": ("shm", ("--no-confine",), _DEVICE_MEMORY),
    "tcp-unconfined, device memory": ("tcp", ("--no-confine",), _DEVICE_MEMORY)}


def run_vk(name: str) -> dict[str, Any]:
    """A served VK:0 against the client's own VK:0 (row `name` of VK_ROWS: its transport, server arguments and the
    environment of both sides)."""
    transport, args, extra = VK_ROWS[name]
    env = {**os.environ, **TRANSPORTS[transport], **extra}
    server, addr, log = _serve(env, ("--devices", "VK:0", *args))
    try:
        if addr is None:
            log.seek(0)
            return {"error": f"hcq serve did not start: {log.read()[-1500:]}"}
        r = subprocess.run([sys.executable, "-c", VK_CLIENT, f"VK:0@{addr}"], capture_output=True, text=True,
                           env={**env, **CLIENTS[transport]}, timeout=600)
        line = next((ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")), None)
        return dict(json.loads(line[7:])) if line else {"error": (r.stderr or r.stdout)[-2000:]}
    finally:
        server.terminate()
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            server.kill()


def report_vk(results: dict[str, dict[str, Any]]) -> str:
    lines = ["| served VK:0, transport | round trip served / local (us) | pipelined served / local (us) | copyin served / local (GB/s) | "
             "copyout served / local (GB/s) |", "|---|---|---|---|---|"]
    for name, r in results.items():
        if "error" in r:
            lines.append(f"| {name} | failed: {r['error'].splitlines()[-1] if r['error'] else '?'} ||||")
            continue
        lines.append(f"| {name} | {r['rt_remote_us']:.0f} / {r['rt_local_us']:.0f} | {r['pipe_remote_us']:.0f} / {r['pipe_local_us']:.0f} | "
                     f"{r['copyin_remote_gbps']:.2f} / {r['copyin_local_gbps']:.2f} | {r['copyout_remote_gbps']:.2f} / {r['copyout_local_gbps']:.2f} |")
    return "\n".join(lines)


def _serve(env: dict[str, str], args: tuple[str, ...] = ()) -> tuple[subprocess.Popen, str | None, Any]:
    """An `hcq serve` process, its address (None if it did not start) and its log."""
    log = tempfile.TemporaryFile(mode="w+")
    server = subprocess.Popen([sys.executable, "-m", "hcq.backends.remote.server", *args], stdout=subprocess.PIPE, stderr=log, text=True,
                              env=env, start_new_session=True)
    assert server.stdout is not None
    m = re.search(r"listening on (\S+:\d+)", server.stdout.readline())
    return server, m.group(1) if m else None, log


def run_transport(name: str, env_extra: dict[str, str], client_extra: dict[str, str], args: tuple[str, ...] = ()) -> dict[str, Any]:
    env = {**os.environ, **env_extra}
    servers = [_serve(env, args), _serve(env, args), _serve({**env, "HCQ_REMOTE_SHARE": "0", "HCQ_REMOTE_PUT": "1"}, args),
               _serve({**env, "HCQ_REMOTE_SHARE": "0"}, args), _serve({**env, "HCQ_REMOTE_PUT": "1"}, args)]
    try:
        for _, addr, log in servers:
            if addr is None:
                log.seek(0)
                return {"error": f"hcq serve did not start: {log.read()[-1500:]}"}
        a1, a2, a3, a4, a5 = (addr for _, addr, _ in servers)
        r = subprocess.run([sys.executable, "-c", textwrap.dedent(CLIENT), f"CPU:0@{a1}", f"CPU:1@{a1}", f"CPU:0@{a2}", f"CPU:0@{a3}", f"CPU:0@{a4}",
                            f"CPU:0@{a5}"],
                           capture_output=True, text=True, env={**env, **client_extra}, timeout=600)
        line = next((ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if line is None: return {"error": (r.stderr or r.stdout)[-2000:]}
        return dict(json.loads(line[7:]))
    finally:
        for server, _, _ in servers:
            server.terminate()
            try:
                server.wait(10)
            except subprocess.TimeoutExpired:
                server.kill()


NETNS_CLIENT = r"""
import sys, time, statistics, numpy as np, hcq
dev, other = hcq.Device(sys.argv[1]), hcq.Device(sys.argv[2])
prg = dev.compile("HCQ_KERNEL void e(int *a) { }", "e"); buf = dev.allocator.alloc(64)
for _ in range(50): prg(buf); dev.synchronize()
ts = []
for _ in range(300):
    t = time.perf_counter_ns(); prg(buf); dev.synchronize(); ts.append(time.perf_counter_ns() - t)
size = 64 << 20
host = np.ones(size, np.uint8); back = np.empty_like(host); a = dev.allocator.alloc(size)
def gbps(fn, reps=5):
    fn(); best = 1e9
    for _ in range(reps):
        t = time.perf_counter(); fn(); best = min(best, time.perf_counter() - t)
    return size / best / 1e9
b = other.allocator.alloc(size)
print("RESULT", statistics.median(ts) / 1e3, gbps(lambda: (dev.allocator.copyin(a, memoryview(host)), dev.synchronize())),
      gbps(lambda: dev.allocator.copyout(memoryview(back), a)), gbps(lambda: (dev.allocator.transfer(b, a, size, dev, other), other.synchronize())),
      flush=True)
"""
TCP_SINK = ("import socket, sys\ns = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind((sys.argv[1], 9911)); "
            "s.listen(1)\nc, _ = s.accept(); mv = memoryview(bytearray(1 << 22))\nwhile c.recv_into(mv): pass")
TCP_SOURCE = ("import socket, sys, time\ns = socket.create_connection((sys.argv[1], 9911)); b = b'x' * (1 << 22); n = 0\n"
              "t = time.perf_counter()\nwhile n < (1 << 30): s.sendall(b); n += len(b)\ns.close(); print('RESULT', n / (time.perf_counter() - t) / 1e9)")


def run_netns() -> dict[str, Any]:
    """A server and a client in two network namespaces (as two hosts: TCP), with a plain Python TCP stream between the
    same namespaces as the reference, in the same run; and a second server beside the client, for transfers from the
    first one's device to its (server to server, across the link). Needs root and iproute2."""
    from hcq.bench.netns import CLIENT_IP, SERVER_IP, Netns, NetnsUnavailable
    try:
        ns = Netns()
    except NetnsUnavailable as e:
        return {"error": str(e)}
    try:
        env = {"HCQ_REMOTE_TOKEN": "bench-netns"}
        server = ns.popen(ns.srv, [sys.executable, "-m", "hcq", "serve", "--listen", f"{SERVER_IP}:0"], env, stdout=subprocess.PIPE,
                          stderr=subprocess.DEVNULL)
        near = ns.popen(ns.cli, [sys.executable, "-m", "hcq", "serve", "--listen", f"{CLIENT_IP}:0"], env, stdout=subprocess.PIPE,
                        stderr=subprocess.DEVNULL)
        addrs = [re.search(r"listening on (\S+:\d+)", p.stdout.readline() if p.stdout else "") for p in (server, near)]
        if not all(addrs): return {"error": "hcq serve did not start in the namespaces"}
        client = ns.popen(ns.cli, [sys.executable, "-c", NETNS_CLIENT, *(f"CPU:0@{m.group(1)}" for m in addrs if m)], env,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        out, err = client.communicate(timeout=600)
        line = next((ln for ln in out.splitlines() if ln.startswith("RESULT ")), None)
        if line is None: return {"error": (err or out)[-2000:]}
        rt, cin, cout, s2s = (float(x) for x in line.split()[1:])
        sink = ns.popen(ns.srv, [sys.executable, "-c", TCP_SINK, SERVER_IP], {}, stdout=subprocess.DEVNULL)
        time.sleep(0.5)
        src = ns.popen(ns.cli, [sys.executable, "-c", TCP_SOURCE, SERVER_IP], {}, stdout=subprocess.PIPE)
        out, _ = src.communicate(timeout=300)
        sink.kill()
        stream = float(out.split()[-1]) if out.startswith("RESULT") else float("nan")
        return {"rt_us": rt, "copyin_gbps": cin, "copyout_gbps": cout, "s2s_gbps": s2s, "tcp_stream_gbps": stream}
    finally:
        ns.close()


def report_netns(r: dict[str, Any]) -> str:
    head = ("| between network namespaces (TCP) | round trip (us) | copyin (GB/s) | vs TCP stream (target >= 0.7x) | copyout (GB/s) | "
            "vs TCP stream | server -> server (GB/s) | vs TCP stream | plain Python TCP stream (GB/s) |\n|---|---|---|---|---|---|---|---|---|\n")
    if "error" in r: return head + f"| tcp-netns | failed: {r['error'].splitlines()[-1] if r['error'] else '?'} ||||||||"
    s = r["tcp_stream_gbps"]
    return head + (f"| tcp-netns | {r['rt_us']:.1f} | {r['copyin_gbps']:.2f} | {r['copyin_gbps'] / s:.2f}x | {r['copyout_gbps']:.2f} | "
                   f"{r['copyout_gbps'] / s:.2f}x | {r['s2s_gbps']:.2f} | {r['s2s_gbps'] / s:.2f}x | {s:.2f} |")


def report(results: dict[str, dict[str, Any]]) -> str:
    lines = ["| transport | round trip remote / in-process (us) | ratio (target <= 3x) | pipelined remote / in-process (us) | "
             "payload -> signal (us) | copyin / copyout (GB/s) | transfer between the server's devices (GB/s) | vs memcpy | "
             "server -> server, mapped (GB/s) | vs memcpy (target >= 0.8x) | put | vs memcpy | pushed | vs memcpy |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        if "error" in r:
            lines.append(f"| {name} | failed: {r['error'].splitlines()[-1] if r['error'] else '?'} |||||||||||||")
            continue
        lines.append(f"| {name} | {r['rt_remote_us']:.1f} / {r['rt_local_us']:.1f} | {r['rt_remote_us'] / r['rt_local_us']:.1f}x | "
                     f"{r['pipe_remote_us']:.2f} / {r['pipe_local_us']:.2f} | {r['payload_signal_us']:.2f} | "
                     f"{r['copyin_gbps']:.2f} / {r['copyout_gbps']:.2f} | {r['transfer_gbps']:.2f} | "
                     f"{r['transfer_gbps'] / r['memcpy_gbps']:.2f}x (memcpy {r['memcpy_gbps']:.1f}) | {r['s2s_gbps']:.2f} | "
                     f"{r['s2s_gbps'] / r['memcpy_gbps']:.2f}x | {r['s2s_put_gbps']:.2f} | {r['s2s_put_gbps'] / r['memcpy_gbps']:.2f}x | "
                     f"{r['s2s_net_gbps']:.2f} | {r['s2s_net_gbps'] / r['memcpy_gbps']:.2f}x |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hcq.bench.remote", description=__doc__.splitlines()[0])
    choices = [*TRANSPORTS, NETNS]
    ap.add_argument("--transports", default=",".join(choices),
                    help=f"comma list of: {', '.join(choices)} ({NETNS}: two network namespaces as two hosts; root only)")
    ap.add_argument("--json", help="also write the numbers here")
    ap.add_argument("--vk", action="store_true", help=f"also a served VK:0 against a local one ({', '.join(VK_ROWS)})")
    args = ap.parse_args(argv)
    chosen = [t for t in args.transports.split(",") if t]
    unknown = [t for t in chosen if t not in choices]
    if unknown: ap.error(f"unknown transport {unknown[0]!r}; choose from {', '.join(choices)}")
    results = {t: run_transport(t, TRANSPORTS[t], CLIENTS[t], SERVE_ARGS.get(t, ())) for t in chosen if t != NETNS}
    if results: print(report(results))
    if NETNS in chosen:
        results[NETNS] = run_netns()
        print(report_netns(results[NETNS]))
    if args.vk:
        vk = {f"vk {name}": run_vk(name) for name in VK_ROWS}
        print(report_vk({name[3:]: r for name, r in vk.items()}))
        results.update(vk)
    if args.json:
        with open(args.json, "w") as f: json.dump(results, f, indent=1)
    return 0 if all("error" not in r for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
