"""Built-in profiling: device events (kernels, copies, graph items with their dependencies) from timestamp
signals, host spans, per-queue calibration onto the host clock, the Chrome/Perfetto trace and the text
summary, nesting of `with hcq.profile()`, the CPU fast path while profiling, and PROFILE=1 at exit."""
import json
import math
import os
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict

import numpy as np
import pytest

import hcq
from hcq import BufferSpec, CopyItem, ExecItem, HCQGraph, Variable, profiler

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KERNELS = r"""
HCQ_KERNEL void padd(float *out, const float *in, float k, int n) { long i = hcq_global_id(0); if (i < n) out[i] = in[i] + k; }
HCQ_KERNEL void pinc(int *out, int n) { long i = hcq_global_id(0); if (i < n) out[i] += 1; }
HCQ_KERNEL void pbusy(long *out, long iters) { long acc = 0; for (long k = 0; k < iters; k++) acc += k ^ (acc >> 3); out[0] = acc; }
HCQ_KERNEL void pempty(int *unused) { }
"""
N = 1024
NB = N * 4
EPS = 1e-3  # us: float rounding of timestamps around 1e9 us


@pytest.fixture
def prof_prgs(dev):
    return {name: dev.compile(KERNELS, name) for name in ("padd", "pinc", "pbusy", "pempty")}


@pytest.fixture
def prof_prgs1(dev1):
    return {name: dev1.compile(KERNELS, name) for name in ("padd", "pinc")}


@pytest.fixture(autouse=True)
def no_profiler_left_on():
    """Every test starts and ends with profiling off (a test that leaks a profiler must not spoil the others)."""
    saved = (profiler.active, list(profiler._stack))
    assert profiler.active is None, "a profiler was left active by an earlier test"
    yield
    profiler.active, profiler._stack[:] = saved[0], saved[1]


def alloc(dev, nbytes=NB):
    return dev.allocator.alloc(nbytes, BufferSpec(cpu_access=True))


def fview(buf, dtype=np.float32):
    return np.frombuffer(buf.cpu_view().mv, dtype=dtype)


def put(dev, buf, arr):
    dev.allocator.copyin(buf, memoryview(np.ascontiguousarray(arr)).cast("B"))


def get(dev, buf, dtype=np.float32, n=N):
    out = np.empty(n, dtype=dtype)
    dev.allocator.copyout(memoryview(out).cast("B"), buf)
    return out


def launch(prg, *bufs, vals=(), n=N, wait=False):
    return prg(*bufs, vals=vals, global_size=((n + 255) // 256, 1, 1), local_size=(256, 1, 1), wait=wait)


def of(p, kind=None, name=None):
    return [e for e in p.events if (kind is None or e.kind == kind) and (name is None or e.name == name)]


def chrome(p):
    """The trace as a file would hold it (a JSON round trip: everything in it must serialise)."""
    return json.loads(json.dumps(p.to_chrome()))


def slices(trace):
    return [e for e in trace["traceEvents"] if e["ph"] == "X"]


def track_names(trace):
    procs = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"}
    return procs, threads


def assert_nested(xs, what):
    """Slices on one track either nest or are disjoint: never a partial overlap."""
    by_track = defaultdict(list)
    for s in xs: by_track[(s["pid"], s["tid"])].append(s)
    for track, ss in by_track.items():
        ss.sort(key=lambda s: (s["ts"], -s["dur"]))
        stack = []
        for s in ss:
            while stack and s["ts"] >= stack[-1]["ts"] + stack[-1]["dur"] - EPS: stack.pop()
            if stack:
                top = stack[-1]
                assert s["ts"] + s["dur"] <= top["ts"] + top["dur"] + EPS, \
                    f"{what} track {track}: {s['name']!r} [{s['ts']}, +{s['dur']}] partially overlaps {top['name']!r} [{top['ts']}, +{top['dur']}]"
            stack.append(s)


def assert_disjoint(events, what):
    """Events (sorted by start) that follow one another without overlapping."""
    for a, b in zip(events, events[1:]):
        assert b.start_us >= a.end_us - EPS, f"{what}: {b.name} starts at {b.start_us} before {a.name} ends at {a.end_us}"


def raw(p, ev):
    """An event's (start, end) back on its device's clock, undoing the calibration offset."""
    off = p.offsets_ns[ev.device] / 1000
    return ev.start_us - off, ev.end_us - off


def graph_items(dev, dev1, prgs, prgs1):
    """Four items over dev and dev1 with known dependencies: 0 -> 1 -> 2 and 0 -> 3."""
    a, b, e = alloc(dev), alloc(dev), alloc(dev)
    c, d = alloc(dev1), alloc(dev1)
    put(dev, a, np.arange(N, dtype=np.float32))
    grid, block = ((N + 255) // 256, 1, 1), (256, 1, 1)
    items = [ExecItem(prgs["padd"], (b, a), (1.0, N), grid, block),     # b = a + 1
             CopyItem(c, b, NB),                                        # c = b      (reads b: after 0)
             ExecItem(prgs1["padd"], (d, c), (2.0, N), grid, block),    # d = c + 2  (reads c: after 1)
             ExecItem(prgs["padd"], (e, b), (3.0, N), grid, block)]     # e = b + 3  (reads b: after 0)
    return items, (a, b, c, d, e)


EXPECTED_DEPS = [(), (0,), (1,), (0,)]
GRAPH_RUNS = 3


@pytest.fixture
def mixed(dev, dev1, prof_prgs, prof_prgs1):
    """One profile holding every kind of event: copies, kernels (one with wait=True), a transfer, a graph
    built and run inside the profile, and host spans."""
    a, b, out = alloc(dev), alloc(dev), alloc(dev1)
    src = np.arange(N, dtype=np.float32)
    with hcq.profile() as p:
        put(dev, a, src)
        for _ in range(3): launch(prof_prgs["padd"], b, a, vals=(1.0, N))
        waited = launch(prof_prgs["padd"], b, b, vals=(1.0, N), wait=True)
        dev1.allocator.transfer(out, b, NB, src_dev=dev, dest_dev=dev1)
        items, bufs = graph_items(dev, dev1, prof_prgs, prof_prgs1)
        g = HCQGraph(items)
        for _ in range(GRAPH_RUNS): g()
        res = get(dev1, out)
        gd = get(dev1, bufs[3])
    np.testing.assert_array_equal(res, src + 2)  # profiling changes no result
    np.testing.assert_array_equal(gd, np.arange(N, dtype=np.float32) + 3)
    return p, g, waited


# ------------------------------------------------------------------ kernel events
def test_one_kernel_event_per_launch(dev, prof_prgs):
    a, b = alloc(dev), alloc(dev)
    put(dev, a, np.arange(N, dtype=np.float32))
    with hcq.profile() as p:
        for k in range(5): launch(prof_prgs["padd"], b, a, vals=(float(k), N))
    assert profiler.active is None
    ks = of(p, "kernel")
    assert len(ks) == 5
    for e in ks:
        assert (e.name, e.device, e.queue) == ("padd", dev.device, "compute")
        assert e.dur_us >= 0 and e.nbytes is None
        assert e.args["global_size"] == "(4, 1, 1)" and e.args["local_size"] == "(256, 1, 1)"
    assert len(of(p, "host", "launch padd")) == 5
    assert len([e for e in of(p, "host") if e.name.startswith("submit ")]) >= 5
    np.testing.assert_array_equal(get(dev, b), np.arange(N, dtype=np.float32) + 4)


def test_wait_true_returns_its_time_while_profiling(dev, prof_prgs):
    out = alloc(dev, 8)
    with hcq.profile() as p:
        t = prof_prgs["pbusy"](out, vals=(20000,), wait=True)
        assert launch(prof_prgs["pempty"], out, n=1) is None
    assert isinstance(t, float) and 0 < t < 10
    (busy,) = of(p, "kernel", "pbusy")
    assert busy.dur_us == pytest.approx(t * 1e6, abs=0.01)  # the same timestamps, on the host clock


def test_kernels_on_one_queue_in_submission_order_without_overlap(dev, prof_prgs):
    out = alloc(dev)
    with hcq.profile() as p:
        for g in range(1, 7): prof_prgs["pinc"](out, vals=(N,), global_size=(g, 1, 1), local_size=(1, 1, 1))
    ks = sorted(of(p, "kernel"), key=lambda e: e.start_us)
    assert [e.args["global_size"] for e in ks] == [f"({g}, 1, 1)" for g in range(1, 7)]
    assert_disjoint(ks, f"{dev.device} compute")
    launches = sorted(of(p, "host", "launch pinc"), key=lambda e: e.start_us)
    assert len(launches) == 6
    for h, k in zip(launches, ks): assert k.start_us >= h.start_us - 5000  # device work follows its launch (loose)


# ------------------------------------------------------------------ copy events
def test_copy_events_with_bytes_and_bandwidth(dev, dev1):
    n = 1 << 18
    a, b = alloc(dev, n * 4), alloc(dev1, n * 4)
    src = np.random.default_rng(1).standard_normal(n).astype(np.float32)
    with hcq.profile() as p:
        put(dev, a, src)
        dev1.allocator.transfer(b, a, n * 2, src_dev=dev, dest_dev=dev1)
        back = get(dev1, b, n=n // 2)
        back_a = get(dev, a, n=n)
    np.testing.assert_array_equal(back, src[:n // 2])
    np.testing.assert_array_equal(back_a, src)
    cs = of(p, "copy")
    assert sorted((e.name, e.device, e.queue, e.nbytes) for e in cs) == sorted([
        ("copyin", dev.device, "copy0", n * 4), (f"transfer {dev.device}->{dev1.device}", dev.device, "copy0", n * 2),
        ("copyout", dev1.device, "copy0", n * 2), ("copyout", dev.device, "copy0", n * 4)])
    for h in ("copyin", "transfer"): assert len(of(p, "host", h)) == 1
    assert len(of(p, "host", "copyout")) == 2
    assert p.offsets_ns[dev.device] == p.offsets_ns[dev1.device]  # both CPU devices stamp one clock: calibrated once
    xs = [s for s in slices(chrome(p)) if s["cat"] == "copy"]
    assert len(xs) == 4
    for s in xs:
        assert s["args"]["bytes"] in (n * 4, n * 2)
        if s["dur"] > 0: assert s["args"]["GB/s"] == pytest.approx(s["args"]["bytes"] / (s["dur"] * 1e3), rel=1e-3, abs=2e-3)


def test_staged_copies_report_every_chunk(dev, monkeypatch):
    monkeypatch.setattr(dev.allocator, "direct_copy", False)  # as on a device whose copy engine cannot reach host memory
    bs = dev.allocator.batch_size
    nbytes = 2 * bs + bs // 2
    buf = alloc(dev, nbytes)
    src = np.frombuffer(os.urandom(nbytes), dtype=np.uint8)
    out = np.zeros(nbytes, dtype=np.uint8)
    with hcq.profile() as p:
        dev.allocator.copyin(buf, memoryview(src))
        dev.allocator.copyout(memoryview(out), buf)
    np.testing.assert_array_equal(out, src)
    ins, outs = of(p, "copy", "copyin (staged)"), of(p, "copy", "copyout (staged)")
    assert sorted(e.nbytes for e in ins) == sorted(e.nbytes for e in outs) == sorted([bs, bs, bs // 2])
    assert len(of(p, "copy")) == 6
    assert_disjoint(sorted(of(p, "copy"), key=lambda e: e.start_us), f"{dev.device} copy0")


# ------------------------------------------------------------------ graph events
def test_graph_item_events_one_per_item_per_run(mixed, dev, dev1):
    p, g, _ = mixed
    gs = sorted(of(p, "graph"), key=lambda e: e.ident)
    assert len(gs) == GRAPH_RUNS * len(g.items)
    names = ["padd", f"copy 4096B {dev.device}->{dev1.device}", "padd", "padd"]
    places = [(dev.device, "compute"), (dev.device, "copy0"), (dev1.device, "compute"), (dev.device, "compute")]
    by_ident = {e.ident: e for e in gs}
    assert len(by_ident) == len(gs)  # idents are unique
    runs = defaultdict(list)
    for e in gs: runs[e.ident - e.args["item"]].append(e)
    assert len(runs) == GRAPH_RUNS
    for base, evs in runs.items():
        assert sorted(e.args["item"] for e in evs) == list(range(len(g.items)))
        for e in evs:
            i = e.args["item"]
            assert e.name == names[i] and (e.device, e.queue) == places[i]
            assert e.nbytes == (NB if i == 1 else None)
            assert e.deps == tuple(base + d for d in EXPECTED_DEPS[i])  # earlier events of the same run
            for d in e.deps: assert d < e.ident and d in by_ident and by_ident[d].ident - by_ident[d].args["item"] == base


def test_graph_dependencies_ordered_on_the_device_clock(mixed):
    p, _, _ = mixed
    by_ident = {e.ident: e for e in of(p, "graph")}
    for e in by_ident.values():
        for d in e.deps:
            src = by_ident[d]
            # every CPU queue stamps the same clock: exact once the calibration offset is taken off
            assert raw(p, e)[0] >= raw(p, src)[1] - EPS, f"item {e.args['item']} starts before its dependency {src.args['item']} ends"
            assert e.start_us >= src.end_us - 1000  # and on the host clock, within calibration error (loose)
    runs = sorted({e.ident - e.args["item"] for e in by_ident.values()})
    for r0, r1 in zip(runs, runs[1:]):  # a run follows the previous one
        assert min(raw(p, by_ident[r1 + i])[0] for i in range(4)) >= max(raw(p, by_ident[r0 + i])[1] for i in range(4)) - EPS


def test_graph_flows_in_chrome_trace(mixed):
    p, _, _ = mixed
    trace = chrome(p)
    xs = slices(trace)
    by_ident = {s["args"]["id"]: s for s in xs if "id" in s["args"]}
    flows = defaultdict(dict)
    for f in trace["traceEvents"]:
        if f["ph"] in ("s", "f"):
            assert f["ph"] not in flows[f["id"]], f"flow id {f['id']} used by two {f['ph']!r} events"
            flows[f["id"]][f["ph"]] = f
    want = sorted((d, s["args"]["id"]) for s in xs for d in s["args"].get("deps", ()))
    assert len(want) == GRAPH_RUNS * sum(len(d) for d in EXPECTED_DEPS)
    got = []
    for fid, pair in flows.items():
        assert set(pair) == {"s", "f"}, f"flow {fid} is not a pair: {pair}"
        s, f = pair["s"], pair["f"]
        assert (s["cat"], s["name"]) == (f["cat"], f["name"])
        assert f.get("bp") == "e"
        src = next(x for x in xs if (x["pid"], x["tid"]) == (s["pid"], s["tid"]) and x["ts"] <= s["ts"] <= x["ts"] + x["dur"] and "id" in x["args"])
        dst = next(x for x in xs if (x["pid"], x["tid"]) == (f["pid"], f["tid"]) and x["ts"] == f["ts"] and "id" in x["args"])
        assert src["args"]["id"] in dst["args"]["deps"]
        got.append((src["args"]["id"], dst["args"]["id"]))
    assert sorted(got) == want
    for (src_id, dst_id) in got:
        assert by_ident[src_id]["cat"] == by_ident[dst_id]["cat"] == "graph"


def test_graph_built_in_profile_is_collected_when_runs_split_between_nested_profiles(dev, dev1, prof_prgs, prof_prgs1):
    with hcq.profile() as outer:
        items, _ = graph_items(dev, dev1, prof_prgs, prof_prgs1)
        g = HCQGraph(items)
        g()
        with hcq.profile() as inner:
            g()
        g()
    assert len(of(inner, "graph")) == len(items)
    assert len(of(outer, "graph")) == 2 * len(items)
    for p in (inner, outer):
        idents = {e.ident for e in of(p, "graph")}
        for e in of(p, "graph"): assert set(e.deps) <= idents  # dependencies point into the same profile


def test_graph_copy_with_symbolic_size_reports_its_bytes(dev, dev1):
    """A graph copy sized by a Variable moves var_vals' bytes each run: its event must say how many, and the
    summary must list it with the copies, not as a kernel."""
    a, c = alloc(dev, 8192), alloc(dev1, 8192)
    nb = Variable("nb", 4, 8192)
    with hcq.profile() as p:
        g = HCQGraph([CopyItem(c, a, nb)])
        g(var_vals={"nb": 4096})
        g(var_vals={"nb": 8192})
    evs = sorted(of(p, "graph"), key=lambda e: e.ident)
    assert [e.nbytes for e in evs] == [4096, 8192]
    summary = p.summary()
    assert summary.splitlines()[0].startswith("kernels: 0 launches"), summary


# ------------------------------------------------------------------ the Chrome trace
def test_chrome_trace_structure(mixed, dev, dev1, tmp_path):
    p, _, _ = mixed
    trace = chrome(p)
    assert isinstance(trace["traceEvents"], list)
    xs = slices(trace)
    assert len(xs) == len(p.events)
    assert Counter(s["cat"] for s in xs) == Counter(e.kind for e in p.events)
    for s in xs:
        for k in ("ph", "ts", "dur", "pid", "tid", "name"): assert k in s, f"{k} missing from {s}"
        assert isinstance(s["ts"], (int, float)) and isinstance(s["dur"], (int, float)) and s["dur"] >= 0
        assert math.isfinite(s["ts"]) and math.isfinite(s["dur"])
    procs, threads = track_names(trace)
    used = {(e["pid"], e["tid"]) for e in trace["traceEvents"] if e["ph"] in ("X", "s", "f")}
    assert used <= set(threads), f"tracks without a thread_name: {used - set(threads)}"
    assert {pid for pid, _ in used} <= set(procs)
    # one track per device queue (and per host thread), each named after it
    named = {(procs[pid], threads[(pid, tid)]) for pid, tid in used}
    assert len(named) == len(used)
    assert {(e.device, e.queue) for e in p.events} == named
    assert {(dev.device, "compute"), (dev.device, "copy0"), (dev1.device, "compute"), (dev1.device, "copy0"), ("host", "MainThread")} == named
    for s in xs: assert (procs[s["pid"]] == "host") == (s["cat"] == "host")
    path = p.write(str(tmp_path / "t.json"))
    with open(path) as f: assert json.load(f) == trace


def test_host_spans_nest_per_thread(mixed):
    p, _, _ = mixed
    xs = slices(chrome(p))
    host = [s for s in xs if s["cat"] == "host"]
    assert_nested(host, "host")
    names = Counter(s["name"].split(" ")[0] for s in host)
    for kind in ("submit", "copyin", "copyout", "transfer", "launch", "graph"): assert names[kind] >= 1, names
    assert names["launch"] == 4 and names["graph"] == GRAPH_RUNS
    # each launch holds its own submit; each graph run holds one submit per static queue
    submits = [s for s in host if s["name"].startswith("submit ")]
    inside = lambda outer, s: outer["ts"] <= s["ts"] and s["ts"] + s["dur"] <= outer["ts"] + outer["dur"]  # noqa: E731
    for l in (s for s in host if s["name"].startswith("launch ")): assert sum(inside(l, s) for s in submits) == 1
    _, g, _ = mixed
    for r in (s for s in host if s["name"].startswith("graph run")): assert sum(inside(r, s) for s in submits) == len(g.queues)


def test_device_events_never_overlap_on_a_queue(mixed, dev, dev1):
    p, _, _ = mixed
    tracks = defaultdict(list)
    for e in p.events:
        if e.kind != "host": tracks[(e.device, e.queue)].append(e)
    assert set(tracks) == {(dev.device, "compute"), (dev.device, "copy0"), (dev1.device, "compute"), (dev1.device, "copy0")}
    for key, evs in tracks.items(): assert_disjoint(sorted(evs, key=lambda e: e.start_us), f"{key}")
    ks = [e for e in tracks[(dev.device, "compute")] if e.kind == "kernel"]
    assert len(ks) == 4


def test_calibration_offsets_for_every_device_used(mixed):
    p, _, _ = mixed
    used = {e.device for e in p.events if e.kind != "host"}
    assert set(p.offsets_ns) == used
    for key, off in p.offsets_ns.items():
        # the CPU device stamps CLOCK_MONOTONIC, perf_counter's clock: the offset is only calibration error
        assert math.isfinite(off) and abs(off) < 50e6, (key, off)


def test_kernel_between_timestamp_signals_and_host_clock(dev, prof_prgs):
    out = alloc(dev, 8)
    s1, s2, c1, c2, d1, d2, d3, d4 = (dev.new_signal(value=0) for _ in range(8))
    a = alloc(dev, 1 << 16)
    src = bytes(range(256)) * 256
    with hcq.profile() as p:
        t0 = time.perf_counter_ns() / 1000
        dev.hw_compute_queue_t().timestamp(s1).signal(d1, 1).submit(dev)
        dev.hw_copy_queue_t().timestamp(c1).signal(d2, 1).submit(dev)
        prof_prgs["pbusy"](out, vals=(50000,))
        dev.allocator.copyin(a, memoryview(src))  # on copy queue 0, after c1; returns once copied
        dev.hw_compute_queue_t().timestamp(s2).signal(d3, 1).submit(dev)
        dev.hw_copy_queue_t().timestamp(c2).signal(d4, 1).submit(dev)
        for d in (d1, d2, d3, d4): d.wait(1, timeout=10000)
        t1 = time.perf_counter_ns() / 1000
    (k,) = of(p, "kernel")
    (c,) = of(p, "copy")
    off_k = off_c = p.offsets_ns[dev.device] / 1000  # one clock per device
    assert float(s1.timestamp) + off_k <= k.start_us + EPS and k.end_us <= float(s2.timestamp) + off_k + EPS
    assert float(c1.timestamp) + off_c <= c.start_us + EPS and c.end_us <= float(c2.timestamp) + off_c + EPS
    assert k.dur_us > 0
    slack = 5000  # us: calibration error is a fraction of a round trip; this is only a sanity bound
    for e in (k, c): assert t0 - slack <= e.start_us <= e.end_us <= t1 + slack, (e, t0, t1)


# ------------------------------------------------------------------ summary
def parse_rows(lines):
    rows = []
    for ln in lines:
        parts = ln.split()
        rows.append((" ".join(parts[:-4]), parts[-4:]))
    return rows


def test_summary_top_kernels_and_copies(dev, prof_prgs):
    out, a = alloc(dev, 8), alloc(dev, 1 << 20)
    src = bytes(1 << 20)
    with hcq.profile() as p:
        for _ in range(2): prof_prgs["pbusy"](out, vals=(200000,))
        for _ in range(5): launch(prof_prgs["pempty"], out, n=1)
        for _ in range(3): launch(prof_prgs["pinc"], a, vals=(N,))
        for _ in range(2): dev.allocator.copyin(a, memoryview(src))
        dev.allocator.copyout(memoryview(bytearray(1 << 20)), a)
    text = p.summary()
    lines = text.splitlines()
    assert lines[0].startswith("kernels: 10 launches"), text
    ci = lines.index("copies:")
    krows = parse_rows(lines[2:ci])
    totals = defaultdict(list)
    for e in of(p, "kernel"): totals[e.name].append(e.dur_us)
    assert [name for name, _ in krows] == sorted(totals, key=lambda n: -sum(totals[n]))  # by total device time
    for name, (count, total_ms, mean_us, share) in krows:
        assert int(count) == len(totals[name])
        assert float(total_ms) == pytest.approx(sum(totals[name]) / 1000, abs=1e-3)
        assert float(mean_us) == pytest.approx(sum(totals[name]) / len(totals[name]), abs=0.01)
    assert {n: int(c) for n, (c, *_) in krows} == {"pbusy": 2, "pempty": 5, "pinc": 3}
    crows = dict(parse_rows(lines[ci + 2:]))
    assert set(crows) == {"copyin", "copyout"}
    assert crows["copyin"][0] == "2" and crows["copyout"][0] == "1"
    assert float(crows["copyin"][1]) == pytest.approx(2 * (1 << 20) / 1e6, abs=0.01)
    for name, (count, mb, total_ms, gbs) in crows.items():
        evs = of(p, "copy", name)
        dur, nbytes = sum(e.dur_us for e in evs), sum(e.nbytes for e in evs)
        assert float(gbs) == pytest.approx(nbytes / (dur * 1e3), rel=0.01, abs=0.01)
    top1 = p.summary(top=1).splitlines()
    assert len(parse_rows(top1[2:top1.index("copies:")])) == 1


# ------------------------------------------------------------------ nesting, fast path, on/off
def test_nested_profiles(dev, prof_prgs):
    out = alloc(dev)
    with hcq.profile() as outer:
        assert profiler.active is outer
        for _ in range(2): launch(prof_prgs["pinc"], out, vals=(N,))
        with hcq.profile() as inner:
            assert profiler.active is inner
            for _ in range(3): launch(prof_prgs["pempty"], out, n=1)
        assert profiler.active is outer
        launch(prof_prgs["pinc"], out, vals=(N,))
    assert profiler.active is None
    assert Counter(e.name for e in of(outer, "kernel")) == {"pinc": 3}
    assert Counter(e.name for e in of(inner, "kernel")) == {"pempty": 3}
    assert Counter(e.name for e in of(inner, "host") if e.name.startswith("launch")) == {"launch pempty": 3}
    assert not [e for e in of(outer, "host") if e.name == "launch pempty"]
    assert np.all(get(dev, out, np.int32) >= 3)


def test_fast_path_bypassed_while_profiling_then_used_again(dev, prof_prgs, monkeypatch):
    if hcq.validation.enabled: pytest.skip("validation mode turns the launch fast path off")
    calls = []
    base = hcq.HCQProgram.fill_kernargs  # only the checked launch path fills kernargs through an args state

    def counting(self, *a, **kw):
        calls.append(self.name)
        return base(self, *a, **kw)

    monkeypatch.setattr(hcq.HCQProgram, "fill_kernargs", counting)
    out = alloc(dev)
    fview(out, np.int32)[:] = 0
    launch(prof_prgs["pinc"], out, vals=(N,))
    dev.synchronize()
    assert calls == []  # not profiling: the launch fast path, which never reaches the checked launch
    with hcq.profile() as p:
        for _ in range(3): launch(prof_prgs["pinc"], out, vals=(N,))
    assert calls == ["pinc"] * 3 and len(of(p, "kernel")) == 3
    for _ in range(2): launch(prof_prgs["pinc"], out, vals=(N,))
    assert launch(prof_prgs["pinc"], out, vals=(N,), wait=True) > 0
    assert calls == ["pinc"] * 3  # fast again
    np.testing.assert_array_equal(get(dev, out, np.int32), 7)
    assert len(of(p, "kernel")) == 3  # nothing more was collected after the block


def test_nothing_recorded_when_not_profiling(dev, prof_prgs):
    p = hcq.profile()  # made but never entered
    out = alloc(dev)
    launch(prof_prgs["pinc"], out, vals=(N,), wait=True)
    put(dev, out, np.zeros(N, dtype=np.int32))
    assert profiler.active is None and p.events == []
    with hcq.profile() as q:
        launch(prof_prgs["pinc"], out, vals=(N,))
    n = len(q.events)
    launch(prof_prgs["pinc"], out, vals=(N,), wait=True)
    assert len(q.events) == n


def test_profile_block_ends_even_when_finishing_fails(open_device, monkeypatch):
    """If resolving the events raises (here a wait that times out), the block must still end: profiling
    stays on otherwise, for everything after it."""
    d = open_device()
    prg = d.compile(KERNELS, "pempty")
    buf = alloc(d, 64)
    gate = d.new_signal(value=0)
    monkeypatch.setenv("HCQDEV_WAIT_TIMEOUT_MS", "300")
    try:
        with pytest.raises(hcq.HCQTimeoutError):
            with hcq.profile():
                d.hw_compute_queue_t().wait(gate, 1).signal(d.timeline_signal, d.next_timeline()).submit(d)
                prg(buf)
        left_on = profiler.active
    finally:
        gate.value = 1
        profiler.active = None
        try:
            d.synchronize(timeout=5000)
        except hcq.HCQError:
            pass  # (not expected once the gate is open; the check below is what this test is about)
    assert left_on is None, "the profiler stayed active after its `with` block raised"


# ------------------------------------------------------------------ threads
def test_host_spans_of_other_threads_on_their_own_track(dev):
    a = alloc(dev, 1 << 16)
    src = bytes(1 << 16)
    with hcq.profile() as p:
        t = threading.Thread(target=lambda: [dev.allocator.copyin(a, memoryview(src)) for _ in range(2)], name="hcq-prof-side")
        t.start()
        t.join()
    spans = of(p, "host", "copyin")
    assert len(spans) == 2 and {e.queue for e in spans} == {"hcq-prof-side"}
    trace = chrome(p)
    _, threads = track_names(trace)
    assert "hcq-prof-side" in threads.values()
    assert_nested([s for s in slices(trace) if s["cat"] == "host"], "host")


def test_threads_with_the_same_name_do_not_share_a_track(dev):
    """Thread names are not unique: two threads called alike must still get tracks of their own, or their
    spans partially overlap on one track."""
    sa, sb = dev.new_signal(value=0), dev.new_signal(value=0)
    ta = threading.Thread(target=lambda: sa.wait(1, timeout=20000), name="hcq-prof-twin")
    tb = threading.Thread(target=lambda: sb.wait(1, timeout=20000), name="hcq-prof-twin")
    with hcq.profile() as p:
        try:
            ta.start()
            time.sleep(0.15)
            tb.start()
            time.sleep(0.15)
            sa.value = 1  # a ends while b still waits: a starts first and ends first
            time.sleep(0.15)
        finally:
            sa.value = 1
            sb.value = 1
            ta.join()
            tb.join()
    waits = sorted((e for e in of(p, "host") if e.name.startswith("wait ")), key=lambda e: e.start_us)
    assert len(waits) == 2
    wa, wb = waits
    assert wa.start_us < wb.start_us < wa.end_us < wb.end_us  # the scenario: the two spans overlap partially
    host = [s for s in slices(chrome(p)) if s["cat"] == "host"]
    assert_nested(host, "host")
    assert len({(s["pid"], s["tid"]) for s in host}) == 2


# ------------------------------------------------------------------ PROFILE=1
SCRIPT = r'''
import sys
from array import array
import hcq
d = hcq.Device("CPU:0")
prg = d.compile("HCQ_KERNEL void envk(int *out, int n) { long i = hcq_global_id(0); if (i < n) out[i] += 1; }", "envk")
buf = d.allocator.alloc(4096)
d.allocator.copyin(buf, memoryview(array("i", [0] * 1024)).cast("B"))
for _ in range(3): prg(buf, vals=(1024,), global_size=(4, 1, 1), local_size=(256, 1, 1))
d.synchronize()
print("script done")
'''


def run_py(tmp_path, args, **env):
    e = {k: v for k, v in os.environ.items() if k not in ("PROFILE", "PROFILE_PATH")}
    e.update(PYTHONPATH=REPO + os.pathsep + e.get("PYTHONPATH", ""), **env)
    return subprocess.run([sys.executable, *args], cwd=tmp_path, env=e, capture_output=True, text=True, timeout=120)


def test_profile_env_writes_default_path_at_exit(tmp_path):
    (tmp_path / "s.py").write_text(SCRIPT)
    r = run_py(tmp_path, ["s.py"], PROFILE="1")
    assert r.returncode == 0, r.stderr
    assert "script done" in r.stdout
    path = tmp_path / "hcq-profile.json"
    assert path.exists()
    assert str(path) in r.stderr  # the path is printed (absolute)
    trace = json.loads(path.read_text())
    xs = slices(trace)
    assert Counter(s["name"] for s in xs if s["cat"] == "kernel") == {"envk": 3}
    (c,) = [s for s in xs if s["cat"] == "copy"]
    assert c["name"] == "copyin" and c["args"]["bytes"] == 4096
    assert_nested([s for s in xs if s["cat"] == "host"], "host")


def test_profile_env_honours_profile_path(tmp_path):
    (tmp_path / "s.py").write_text(SCRIPT)
    (tmp_path / "out").mkdir()
    r = run_py(tmp_path, ["s.py"], PROFILE="1", PROFILE_PATH="out/p.json")
    assert r.returncode == 0, r.stderr
    assert not (tmp_path / "hcq-profile.json").exists()
    assert str(tmp_path / "out" / "p.json") in r.stderr
    trace = json.loads((tmp_path / "out" / "p.json").read_text())
    assert sum(1 for s in slices(trace) if s["cat"] == "kernel") == 3
    r = run_py(tmp_path, ["s.py"])  # without PROFILE nothing is written
    assert r.returncode == 0 and "profile" not in r.stderr
    assert not (tmp_path / "hcq-profile.json").exists()


def test_profile_env_writes_a_trace_even_if_no_device_was_opened(tmp_path):
    """PROFILE=1 profiles the whole process: a program that imports hcq but opens no device still gets its
    (empty) trace, so `hcq profile` can summarise it instead of claiming hcq was never imported."""
    r = run_py(tmp_path, ["-c", "import hcq; print('imported')"], PROFILE="1")
    assert r.returncode == 0 and "imported" in r.stdout, r.stderr
    path = tmp_path / "hcq-profile.json"
    assert path.exists(), f"no trace written; stderr: {r.stderr!r}"
    assert json.loads(path.read_text())["traceEvents"] is not None


# ---------------------------------------------------------------- hand-built queues
def test_hand_built_queues_are_profiled_by_program_and_queue(dev, prof_prgs):
    """Queues a program builds itself (no runtime launch) show their kernels and copies, named by program, on the
    device queue they ran on; re-submits report each run (42 kernels: 42 events)."""
    out, src = alloc(dev), alloc(dev)
    with hcq.profile() as p:
        args = prof_prgs["pinc"].fill_kernargs((out,), vals=(N,))
        q = dev.hw_compute_queue_t().exec(prof_prgs["pinc"], args, (1, 1, 1), (1, 1, 1))
        for _ in range(42):
            q.submit(dev)
        cq = dev.hw_copy_queue_t(1).copy(out, src, 256)
        cq.submit(dev)
        dev.synchronize()
    kernels = [e for e in of(p, "kernel") if e.name == "pinc"]
    assert len(kernels) == 42 and all(e.device == dev.device and e.queue == "compute" and e.dur_us >= 0 for e in kernels)
    assert len({e.start_us for e in kernels}) == 42  # each run's own times, not the last run's 42 times
    copies = of(p, "copy")
    assert [(e.queue, e.nbytes) for e in copies] == [("copy1", 256)]
    assert "pinc" in p.summary()


def test_user_timestamps_around_a_command_make_its_event(dev, prof_prgs):
    """A queue built before profiling started, with its own timestamps around an exec, is reported with them."""
    out = alloc(dev)
    st, en = dev.new_signal(), dev.new_signal()
    q = dev.hw_compute_queue_t(profile=True).timestamp(st).exec(prof_prgs["pinc"], prof_prgs["pinc"].fill_kernargs((out,), vals=(N,)),
                                                                (1, 1, 1), (1, 1, 1)).timestamp(en)
    with hcq.profile() as p:
        q.submit(dev)
    (e,) = [e for e in of(p, "kernel") if e.name == "pinc"]
    assert e.dur_us == pytest.approx(float(en.timestamp - st.timestamp), abs=0.01)


def test_queues_of_the_runtime_are_not_reported_twice(dev, prof_prgs):
    out = alloc(dev)
    with hcq.profile() as p:
        launch(prof_prgs["pinc"], out, vals=(N,))
        dev.allocator.copyin(out, memoryview(bytearray(64)))
        dev.synchronize()
    assert len([e for e in of(p, "kernel") if e.name == "pinc"]) == 1 and len(of(p, "copy")) == 1


def test_host_waits_are_named_by_kind_with_details_as_args(dev, prof_prgs):
    out = alloc(dev)
    with hcq.profile() as p:
        for _ in range(20):
            launch(prof_prgs["pinc"], out, vals=(N,))
            dev.synchronize()
        sig = dev.new_signal(value=0)
        dev.hw_compute_queue_t().signal(sig, 1).submit(dev)
        sig.wait(1)
    waits = [e for e in of(p, "host") if e.name.startswith("wait ")]
    assert {e.name for e in waits} <= {f"wait timeline {dev.device}", f"wait signal {dev.device}"}, {e.name for e in waits}
    assert all(e.args["signal"].startswith("0x") and isinstance(e.args["value"], int) for e in waits)


def test_events_of_one_device_share_one_clock_so_dependencies_never_overlap(dev, prof_prgs):
    """Graph items on the compute queue and a copy queue of one device: an item never starts before an item it
    depends on ends (both queues are calibrated as one clock); across devices an overlap would be marked."""
    a, b, c = alloc(dev), alloc(dev), alloc(dev)
    g = HCQGraph([ExecItem(prof_prgs["pinc"], (a,), (N,), (4, 1, 1), (256, 1, 1)), CopyItem(b, a, NB), ExecItem(prof_prgs["pinc"], (b,), (N,)),
                  CopyItem(c, b, NB)], profile=True)
    with hcq.profile() as p:
        for _ in range(200): g()
        g.synchronize()
    items = {e.ident: e for e in of(p, "graph")}
    assert len(items) == 800
    for e in items.values():
        for d in e.deps: assert e.start_us >= items[d].end_us - 1e-6, (e, items[d])
        assert "clock_error_us" not in e.args


def test_an_apparent_overlap_across_devices_is_marked():
    from hcq.profiler import Event, _mark_clock_error
    a = Event("graph", "a", "CPU:0", "compute", 10.0, 5.0, ident=1)
    b = Event("graph", "b", "CPU:1", "compute", 14.2, 1.0, ident=2, deps=(1,))
    c = Event("graph", "c", "CPU:1", "compute", 16.0, 1.0, ident=3, deps=(1, 2))
    _mark_clock_error([a, b, c])
    assert b.args == {"clock_error_us": 0.8} and "clock_error_us" not in c.args
