"""HCQGraph (issue 3): random DAGs of kernels and copies over 1..3 CPU devices checked against sequential
execution and against a symbolic run of the static queues (every hazard ordered, no wait on a queue's own
order, no wait an earlier one implies); input replacement; Variables in vals, grids and copy sizes; a graph
reused many times; graphs interleaved with ordinary submits; ordering against earlier and later work;
queue binding; copy queues and HCQ_NUM_SDMA; profile entries; dot(); the capture and jit front ends."""
import gc
import re
import threading

import numpy as np
import pytest

import hcq
from hcq import (
    BufferSpec,
    CopyItem,
    ExecItem,
    HCQError,
    HCQGraph,
    UnboundVariableError,
    Variable,
)

N = 256  # float32 elements per pool buffer
NBUF = 8  # pool buffers per device
SLOW_ITERS = 20_000_000  # ~tens of ms of a volatile loop: long enough that later submits arrive while it runs

KERNELS = r"""
HCQ_KERNEL void add(float *out, const float *a, const float *b, int n) { long i = hcq_global_id(0); if (i < n) out[i] = a[i] + b[i]; }
HCQ_KERNEL void axpb(float *out, const float *x, float k, float c, int n) { long i = hcq_global_id(0); if (i < n) out[i] = x[i] * k + c; }
HCQ_KERNEL void vmax(float *out, const float *a, const float *b, int n) {
  long i = hcq_global_id(0); if (i < n) out[i] = a[i] > b[i] ? a[i] : b[i];
}
HCQ_KERNEL void sadd(float *out, const float *a, const float *b, int iters, int n) {
  /* add, after a short busy loop in every thread: widens the window for a missing wait to show */
  long i = hcq_global_id(0); volatile int s = 0; for (int k = 0; k < iters; k++) s += k; if (i < n) out[i] = a[i] + b[i];
}
HCQ_KERNEL void acc(float *out, int n) { long i = hcq_global_id(0); if (i < n) out[i] += 1.0f; }
HCQ_KERNEL void fill(float *out, int v, int n) { long i = hcq_global_id(0); if (i < n) out[i] = (float)v; }
HCQ_KERNEL void slow_axpb(float *out, const float *x, float k, float c, long iters, int n) {
  /* one thread: spin first, then read x and write out, so whatever it reads or writes is touched late */
  volatile long s = 0; for (long j = 0; j < iters; j++) s += j;
  for (int i = 0; i < n; i++) out[i] = x[i] * k + c;
}
HCQ_KERNEL void slow_fill(float *out, int v, long iters, int n) {
  volatile long s = 0; for (long j = 0; j < iters; j++) s += j;
  for (int i = 0; i < n; i++) out[i] = (float)v;
}
HCQ_KERNEL void e(int *x) { }
"""
NAMES = ("add", "axpb", "vmax", "sadd", "acc", "fill", "slow_axpb", "slow_fill", "e")
TIMEOUT_MS = "10000"


@pytest.fixture(autouse=True)
def _graph_short_waits(monkeypatch):
    """A broken graph fails in seconds instead of the default 30 s per wait."""
    monkeypatch.setenv("HCQDEV_WAIT_TIMEOUT_MS", TIMEOUT_MS)


@pytest.fixture
def dev2(open_device, dev1):
    """A third fresh CPU device (CPU:2, after dev and dev1)."""
    return open_device()


@pytest.fixture
def devs(dev, dev1, dev2):
    return [dev, dev1, dev2]


class _Kernels(dict):
    """The kernels of KERNELS (NAMES) on one device, each compiled when first used (tests get fresh devices)."""

    def __init__(self, d):
        super().__init__()
        self.d = d

    def __missing__(self, name):
        if name not in NAMES: raise KeyError(name)
        self[name] = self.d.compile(KERNELS, name)
        return self[name]


_prg_cache = {}


def prgs_of(d):
    for closed in [k for k in _prg_cache if k.closed]: del _prg_cache[closed]  # (earlier tests' devices)
    if d not in _prg_cache: _prg_cache[d] = _Kernels(d)
    return _prg_cache[d]


@pytest.fixture
def P(devs):
    """P[i][name]: the kernels on CPU:i."""
    return [prgs_of(d) for d in devs]


def alloc(d, n=N, fill=0.0):
    buf = d.allocator.alloc(n * 4, BufferSpec(cpu_access=True))
    arr(buf)[:] = fill  # buffers may come back from the LRU cache with old bytes
    return buf


def arr(buf, dtype=np.float32):
    return np.frombuffer(buf.cpu_view().mv, dtype=dtype)


def copyout(buf):
    out = np.empty(buf.size // 4, np.float32)
    buf.owner.allocator.copyout(memoryview(out), buf)
    return out


def grid(n, local=64):
    return (-(-n // local), 1, 1), (local, 1, 1)


def qname(key):
    d, kind, idx = key
    return f"{d.device} {kind}" + (f"{idx}" if kind == "copy" else "")


# ------------------------------------------------------------------ symbolic run of the static queues
WAIT_RE = re.compile(r"wait (.+) >= (\d+)")
SIGNAL_RE = re.compile(r"signal (.+) = (\d+)")


class Sim:
    """Runs g.text symbolically with vector clocks. A wait `Q >= v` passes once Q executed a `signal Q = v'`
    with v' >= v and teaches the waiting queue what Q knew at that signal. Records each item's knowledge
    when it starts, what each device's compute queue knows when it signals its timeline, and problems:
    waits on the own queue, waits already implied by earlier ones (split into per-item and end-of-graph),
    signals of a foreign queue or of a value that is not the queue's item count, queues that never finish."""

    def __init__(self, g):
        text = {qname(k): list(v) for k, v in g.text.items()}
        self.text = text
        pc, count = dict.fromkeys(text, 0), dict.fromkeys(text, 0)
        known = {q: {} for q in text}
        sig_hist = {q: [] for q in text}
        last_item_pc = {q: max([i for i, c in enumerate(cmds) if c.startswith(("exec ", "copy "))], default=-1) for q, cmds in text.items()}
        self.pre, self.end, self.problems, self.redundant_item, self.redundant_end = {}, {}, [], [], []
        progress = True
        while progress:
            progress = False
            for q, cmds in text.items():
                while pc[q] < len(cmds):
                    c = cmds[pc[q]]
                    if c == "wait kickoff" or (c.startswith("wait ") and c.endswith(" timeline")):
                        pass
                    elif m := WAIT_RE.fullmatch(c):
                        other, v = m[1], int(m[2])
                        if other == q: self.problems.append(f"{q} waits on its own queue: {c!r}")
                        if other not in sig_hist:
                            self.problems.append(f"{q} waits on unknown queue: {c!r}")
                        else:
                            hit = next((clk for val, clk in sig_hist[other] if val >= v), None)
                            if hit is None: break  # blocked until `other` gets there
                            if known[q].get(other, 0) >= v:
                                (self.redundant_item if pc[q] < last_item_pc[q] else self.redundant_end).append(f"{q}: {c!r} (#{pc[q]})")
                            for k, val in hit.items():
                                if val > known[q].get(k, 0): known[q][k] = val
                    elif c.startswith(("exec ", "copy ")):
                        self.pre[(q, count[q] + 1)] = dict(known[q])
                        count[q] += 1
                        known[q][q] = count[q]
                    elif m := SIGNAL_RE.fullmatch(c):
                        if m[1] != q: self.problems.append(f"{q} signals another queue's signal: {c!r}")
                        if int(m[2]) != count[q]: self.problems.append(f"{q}: {c!r} after {count[q]} items")
                        sig_hist[q].append((int(m[2]), dict(known[q])))
                    elif c.startswith("signal ") and c.endswith(" timeline"):
                        self.end[q] = dict(known[q])
                    else:
                        self.problems.append(f"{q}: unknown command {c!r}")
                    pc[q] += 1
                    progress = True
        self.count = count
        for q, cmds in text.items():
            if pc[q] < len(cmds): self.problems.append(f"{q} never gets past {cmds[pc[q]]!r} (deadlock)")

    def check_hazards(self, g, accesses):
        """accesses[i] = (reads, writes) as sets of buffer keys. Every conflicting earlier item must be known
        to item i's queue when i starts; every device's final timeline signal must know every queue's end."""
        bad = []
        for j, (rj, wj) in enumerate(accesses):
            qj, vj = qname(g.plan[j].queue), g.plan[j].value
            for i in range(j):
                ri, wi = accesses[i]
                if not (wi & (rj | wj) or ri & wj): continue
                qi, vi = qname(g.plan[i].queue), g.plan[i].value
                if self.pre[(qj, vj)].get(qi, 0) < vi: bad.append(f"item {j} on {qj} may run before item {i} on {qi}")
        for d in g.devices:
            q = f"{d.device} compute"
            fin = self.end.get(q)
            if fin is None:
                bad.append(f"{q} never signals its timeline")
                continue
            for other, n in self.count.items():
                if fin.get(other, 0) < n: bad.append(f"{d.device} timeline signalled before {other} finished")
        return bad


# ------------------------------------------------------------------ random DAGs
def random_ops(rng, ndev, nitems):
    """Abstract items: ("exec", dev, kernel, out, ins, vals, n, local) or ("copy", sdev, sbuf, soff, ddev, dbuf, doff, nelem)."""
    ops = []
    for _ in range(nitems):
        d = int(rng.integers(ndev))
        if rng.random() < 0.65:
            kind = str(rng.choice(["add", "axpb", "vmax", "sadd"], p=[0.35, 0.3, 0.25, 0.1]))
            out, a, b = (int(x) for x in rng.integers(NBUF, size=3))
            n = int(rng.integers(1, N + 1)) if rng.random() < 0.5 else N
            local = int(rng.choice([1, 8, 32, 64]))
            if kind == "axpb":
                ins, vals = (a,), (float(rng.choice([-0.75, -0.5, 0.25, 0.5, 0.75])), float(rng.integers(-4, 5)), n)
            elif kind == "sadd":
                ins, vals = (a, b), (int(rng.integers(100, 400)), n)
            else:
                ins, vals = (a, b), (n,)
            ops.append(("exec", d, kind, out, ins, vals, n, local))
        else:
            dd = d if ndev == 1 or rng.random() < 0.5 else int((d + rng.integers(1, ndev)) % ndev)
            sb, db = (int(x) for x in rng.integers(NBUF, size=2))
            if dd == d and sb == db: db = (sb + 1) % NBUF
            nel = N if rng.random() < 0.4 else int(rng.integers(1, N + 1))
            so, do = int(rng.integers(0, N - nel + 1)), int(rng.integers(0, N - nel + 1))
            ops.append(("copy", d, sb, so, dd, db, do, nel))
    return ops


def op_accesses(op):
    if op[0] == "exec":
        _, d, _, out, ins, *_ = op
        return {(d, b) for b in ins}, {(d, out)}
    _, sd, sb, _, dd, db, _, _ = op
    return {(sd, sb)}, {(dd, db)}


def make_items(ops, pools, P):
    items = []
    for op in ops:
        if op[0] == "exec":
            _, d, kind, out, ins, vals, n, local = op
            gs, ls = grid(n, local)
            items.append(ExecItem(P[d][kind], (pools[d][out],) + tuple(pools[d][b] for b in ins), vals, gs, ls))
        else:
            _, sd, sb, so, dd, db, do, nel = op
            items.append(CopyItem(dest=pools[dd][db].offset(do * 4, nel * 4), src=pools[sd][sb].offset(so * 4, nel * 4), nbytes=nel * 4))
    return items


def run_sequential(ops, pools, P, devs):
    """The reference: each item on its own, waiting for it before the next."""
    for op in ops:
        if op[0] == "exec":
            _, d, kind, out, ins, vals, n, local = op
            gs, ls = grid(n, local)
            P[d][kind](pools[d][out], *(pools[d][b] for b in ins), vals=vals, global_size=gs, local_size=ls, wait=True)
        else:
            _, sd, sb, so, dd, db, do, nel = op
            src, dst = pools[sd][sb].offset(so * 4, nel * 4), pools[dd][db].offset(do * 4, nel * 4)
            if sd == dd:
                d = devs[sd]
                d.hw_copy_queue_t().wait(d.timeline_signal, d.timeline_value - 1).copy(dst.va_addr, src.va_addr, nel * 4) \
                    .signal(d.timeline_signal, d.next_timeline()).submit(d)
                d.synchronize()
            else:
                devs[sd].allocator.transfer(dst, src, nel * 4, devs[sd], devs[dd])
                devs[sd].synchronize()
                devs[dd].synchronize()


def new_pools(devs, ndev, init):
    pools = [[alloc(devs[d]) for _ in range(NBUF)] for d in range(ndev)]
    for d in range(ndev):
        for b in range(NBUF): arr(pools[d][b])[:] = init[d][b]
    return pools


def random_init(rng, ndev):
    return rng.integers(-8, 9, size=(ndev, NBUF, N)).astype(np.float32)


DAG_CASES = [(0, 1, 1), (1, 5, 2), (2, 17, 3), (3, 40, 1), (4, 64, 2), (5, 120, 3), (6, 200, 1), (7, 200, 2), (8, 200, 3)]


@pytest.mark.parametrize("seed,nitems,ndev", DAG_CASES)
def test_random_dag_matches_sequential(devs, P, seed, nitems, ndev):
    rng = np.random.default_rng(seed)
    ops = random_ops(rng, ndev, nitems)
    init = random_init(rng, ndev)
    gp, rp = new_pools(devs, ndev, init), new_pools(devs, ndev, init)
    g = HCQGraph(make_items(ops, gp, P))
    sim = Sim(g)
    assert sim.problems == []
    assert sim.check_hazards(g, [op_accesses(op) for op in ops]) == []
    assert g(wait=False) is None  # two runs back to back: the second waits for the first before patching
    t = g(wait=True)
    assert isinstance(t, float) and t > 0
    run_sequential(ops, rp, P, devs)
    run_sequential(ops, rp, P, devs)
    for d in range(ndev):
        for b in range(NBUF):
            np.testing.assert_array_equal(arr(gp[d][b]).view(np.uint32), arr(rp[d][b]).view(np.uint32), err_msg=f"CPU:{d} buffer {b}")


@pytest.mark.parametrize("seed,nitems,ndev", [(11, 60, 2), (12, 150, 3)])
def test_random_dag_with_input_replaced(devs, P, seed, nitems, ndev):
    """Pool buffer 0 of CPU:0 is the graph's input (reads, writes, copies and views of it become symbolic);
    each run passes a fresh buffer with the same contents: it ends up like the reference's buffer 0 and the
    build-time buffer is never touched."""
    rng = np.random.default_rng(seed)
    ops = random_ops(rng, ndev, nitems)
    ops.insert(0, ("exec", 0, "add", 1, (0, 0), (N,), N, 64))  # make sure the input is used
    init = random_init(rng, ndev)
    gp, rp = new_pools(devs, ndev, init), new_pools(devs, ndev, init)
    g = HCQGraph(make_items(ops, gp, P), inputs=(gp[0][0],))
    assert Sim(g).problems == []
    x = alloc(devs[0], N + 16, fill=-1.0)  # bigger than the placeholder is fine
    arr(x)[:N] = init[0][0]
    g(inputs=(x,), wait=True)
    run_sequential(ops, rp, P, devs)
    np.testing.assert_array_equal(arr(gp[0][0]), init[0][0])  # the placeholder itself is untouched
    np.testing.assert_array_equal(arr(x)[:N].view(np.uint32), arr(rp[0][0]).view(np.uint32))
    assert (arr(x)[N:] == -1).all()
    for d in range(ndev):
        for b in range(NBUF):
            if (d, b) != (0, 0): np.testing.assert_array_equal(arr(gp[d][b]).view(np.uint32), arr(rp[d][b]).view(np.uint32), err_msg=f"CPU:{d} buffer {b}")
    # a second input buffer in the next run: the graph follows it, the first is left alone
    x2 = alloc(devs[0])
    arr(x2)[:] = arr(rp[0][0])
    before_x = arr(x).copy()
    g(inputs=(x2,), wait=True)
    run_sequential(ops, rp, P, devs)
    np.testing.assert_array_equal(arr(x), before_x)
    np.testing.assert_array_equal(arr(x2).view(np.uint32), arr(rp[0][0]).view(np.uint32))
    for d in range(ndev):
        for b in range(1 if d == 0 else 0, NBUF): np.testing.assert_array_equal(arr(gp[d][b]).view(np.uint32), arr(rp[d][b]).view(np.uint32))


@pytest.mark.parametrize("seed,nitems,ndev", [(21, 80, 1), (22, 120, 2), (23, 200, 3), (24, 200, 2)])
def test_random_dag_no_redundant_item_waits(devs, P, seed, nitems, ndev):
    """The waits in front of items skip what earlier waits of the same queue already imply."""
    rng = np.random.default_rng(seed)
    ops = random_ops(rng, ndev, nitems)
    pools = new_pools(devs, ndev, random_init(rng, ndev))
    g = HCQGraph(make_items(ops, pools, P))
    sim = Sim(g)
    assert sim.problems == []
    assert sim.redundant_item == []
    for p in g.plan: assert all(q != p.queue for q, _ in p.waits)


@pytest.mark.parametrize("seed,nitems,ndev", [(31, 60, 2), (32, 150, 3)])
def test_random_dag_no_redundant_final_waits(devs, P, seed, nitems, ndev):
    """The end of each device's compute queue (wait for every graph queue, then signal the timeline) also
    skips waits that its earlier waits imply."""
    rng = np.random.default_rng(seed)
    ops = random_ops(rng, ndev, nitems)
    g = HCQGraph(make_items(ops, new_pools(devs, ndev, random_init(rng, ndev)), P))
    sim = Sim(g)
    assert sim.problems == []
    assert sim.redundant_end == []


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(100, 140))
def test_random_dag_soak(devs, P, seed):
    rng = np.random.default_rng(seed)
    ndev, nitems = int(rng.integers(1, 4)), int(rng.integers(1, 201))
    ops = random_ops(rng, ndev, nitems)
    init = random_init(rng, ndev)
    gp, rp = new_pools(devs, ndev, init), new_pools(devs, ndev, init)
    g = HCQGraph(make_items(ops, gp, P))
    sim = Sim(g)
    assert sim.problems == [] and sim.check_hazards(g, [op_accesses(op) for op in ops]) == []
    for _ in range(5): g()
    g(wait=True)
    for _ in range(6): run_sequential(ops, rp, P, devs)
    for d in range(ndev):
        for b in range(NBUF): np.testing.assert_array_equal(arr(gp[d][b]).view(np.uint32), arr(rp[d][b]).view(np.uint32))


# ------------------------------------------------------------------ waits: chains, own queue, redundancy
def test_chain_across_two_queues_has_only_needed_waits(dev, dev1, P):
    """A(q0) -> B(q1) -> C(q0) -> D(q1): B waits for q0 >= 1, C for q1 >= 1, D for q0 >= 2 only (q0 >= 1 is
    implied by its own order); C's read of A's output needs no wait (same queue); nobody waits on itself."""
    x, a, c, y = alloc(dev, fill=1), alloc(dev), alloc(dev), alloc(dev1)
    b = alloc(dev1)
    items = [ExecItem(P[0]["axpb"], (a, x), (2.0, 1.0, N), *grid(N)),  # A on CPU:0 compute: a = 3
             ExecItem(P[1]["axpb"], (b, a), (1.0, 1.0, N), *grid(N)),  # B on CPU:1 compute: b = 4
             ExecItem(P[0]["add"], (c, b, a), (N,), *grid(N)),  # C on CPU:0: c = 7 (reads a: own queue)
             ExecItem(P[1]["add"], (y, c, a), (N,), *grid(N))]  # D on CPU:1: y = 10 (a is implied by c)
    g = HCQGraph(items)
    sim = Sim(g)
    assert sim.problems == [] and sim.redundant_item == [] and sim.redundant_end == []
    assert [p.waits for p in g.plan] == [[], [((dev, "compute", 0), 1)], [((dev1, "compute", 0), 1)], [((dev, "compute", 0), 2)]]
    waits = {qname(k): [c for c in cmds if WAIT_RE.fullmatch(c)] for k, cmds in g.text.items()}
    assert waits["CPU:0 compute"] == ["wait CPU:1 compute >= 1", "wait CPU:1 compute >= 2"]
    assert waits["CPU:1 compute"] == ["wait CPU:0 compute >= 1", "wait CPU:0 compute >= 2"]
    for q, ws in waits.items(): assert not any(w.startswith(f"wait {q} ") for w in ws)
    assert "wait CPU:0 compute >= 1" in str(g) and "wait CPU:0 compute >= 2" in str(g)
    g(wait=True)
    np.testing.assert_array_equal(arr(c), 7)
    np.testing.assert_array_equal(arr(y), 10)


def test_chain_compute_copy_compute_on_one_device(dev, P):
    """q0 = compute, q1 = copy0 of one device: A(q0) -> B(q1) -> C(q0) -> D(q1)."""
    x, a, b, c, d = alloc(dev, fill=2), alloc(dev), alloc(dev), alloc(dev), alloc(dev)
    items = [ExecItem(P[0]["axpb"], (a, x), (3.0, 0.0, N), *grid(N)),  # a = 6
             CopyItem(b, a, N * 4),  # b = 6
             ExecItem(P[0]["add"], (c, b, a), (N,), *grid(N)),  # c = 12
             CopyItem(d, c, N * 4)]  # d = 12
    g = HCQGraph(items)
    sim = Sim(g)
    assert sim.problems == [] and sim.redundant_item == [] and sim.redundant_end == []
    assert [qname(p.queue) for p in g.plan] == ["CPU:0 compute", "CPU:0 copy0", "CPU:0 compute", "CPU:0 copy0"]
    assert [p.waits for p in g.plan] == [[], [((dev, "compute", 0), 1)], [((dev, "copy", 0), 1)], [((dev, "compute", 0), 2)]]
    assert "wait CPU:0 compute >= 2" in str(g) and "wait CPU:0 copy0 >= 1" in str(g)
    g(wait=True)
    np.testing.assert_array_equal(arr(d), 12)


def test_final_waits_skip_what_earlier_final_waits_imply(dev, dev1, P):
    """CPU:1's compute queue waits for its copy queue before its last item, so at the end CPU:0's compute
    queue needs only `wait CPU:1 compute >= 2`; a further `wait CPU:1 copy0 >= 1` is implied by it."""
    p1, q1, r1, s1, t1 = (alloc(dev1, fill=i) for i in range(5))
    u0, w0 = alloc(dev), alloc(dev, fill=5)
    items = [ExecItem(P[1]["axpb"], (p1, q1), (1.0, 0.0, N), *grid(N)),
             CopyItem(r1, s1, N * 4),
             ExecItem(P[1]["axpb"], (t1, r1), (1.0, 0.0, N), *grid(N)),
             ExecItem(P[0]["axpb"], (u0, w0), (1.0, 0.0, N), *grid(N))]
    g = HCQGraph(items)
    sim = Sim(g)
    assert sim.problems == []
    assert sim.check_hazards(g, [({"q1"}, {"p1"}), ({"s1"}, {"r1"}), ({"r1"}, {"t1"}), ({"w0"}, {"u0"})]) == []
    assert sim.redundant_end == [], str(g)
    g(wait=True)
    np.testing.assert_array_equal(arr(t1), 3)
    np.testing.assert_array_equal(arr(u0), 5)


# ------------------------------------------------------------------ queues: binding, copy queues, HCQ_NUM_SDMA
def test_every_queue_is_bound_after_build(dev, dev1, dev2, P):
    a, b, c = alloc(dev, fill=1), alloc(dev1), alloc(dev2)
    g = HCQGraph([ExecItem(P[0]["acc"], (a,), (N,), *grid(N)), CopyItem(b, a, N * 4), CopyItem(c, b, N * 4), CopyItem(a.offset(0, 64), b.offset(64, 64), 64)])
    assert set(g.queues) >= {(dev, "compute", 0), (dev1, "compute", 0), (dev2, "compute", 0), (dev, "copy", 0), (dev1, "copy", 0)}
    for (d, _, _), q in g.queues.items(): assert q.binded_device is d
    with pytest.raises(HCQError, match="bound"):
        next(iter(g.queues.values())).signal(dev.new_signal(), 1)  # bound queues are fixed
    g(wait=True)
    np.testing.assert_array_equal(arr(c), 2)
    np.testing.assert_array_equal(arr(a)[:16], 2)
    np.testing.assert_array_equal(arr(a)[16:], 2)


def test_copy_queues_are_created_lazily(dev, P, monkeypatch):
    monkeypatch.delenv("HCQ_NUM_SDMA", raising=False)
    a, b = alloc(dev, fill=1), alloc(dev)
    g = HCQGraph([ExecItem(P[0]["acc"], (a,), (N,), *grid(N)), ExecItem(P[0]["add"], (b, a, a), (N,), *grid(N))])
    assert [k[1] for k in g.queues] == ["compute"]
    assert "copy" not in str(g)
    g2 = HCQGraph([ExecItem(P[0]["acc"], (a,), (N,), *grid(N)), CopyItem(b, a, N * 4), CopyItem(a, b, N * 4)])
    assert sorted(qname(k) for k in g2.queues) == ["CPU:0 compute", "CPU:0 copy0"]  # default: one copy queue


@pytest.mark.parametrize("nsdma,expect", [("1", ["copy0"] * 5), ("2", ["copy0", "copy1"] * 2 + ["copy0"]), ("7", ["copy0", "copy1"] * 2 + ["copy0"])])
def test_copies_spread_over_hcq_num_sdma_queues(dev, P, monkeypatch, nsdma, expect):
    """HCQ_NUM_SDMA copy queues (at most the device's copy engines) take copies in turn; hazards between
    copies on different copy queues are still ordered (x -> y, then z -> y (WAW), y -> w (RAW), w -> x (WAR))."""
    monkeypatch.setenv("HCQ_NUM_SDMA", nsdma)
    x, y, z, w, v = alloc(dev, fill=1), alloc(dev, fill=0), alloc(dev, fill=3), alloc(dev, fill=0), alloc(dev, fill=0)
    items = [CopyItem(y, x, N * 4), CopyItem(y, z, N * 4), CopyItem(w, y, N * 4), CopyItem(v, x, N * 4), CopyItem(x, w, N * 4),
             ExecItem(P[0]["add"], (v, v, x), (N,), *grid(N))]
    g = HCQGraph(items)
    assert [p.queue[2] for p in g.plan[:5]] == [int(s[-1]) for s in expect]
    assert sorted({qname(p.queue) for p in g.plan[:5]}) == sorted({f"CPU:0 {s}" for s in expect})
    sim = Sim(g)
    assert sim.problems == [] and sim.redundant_item == []
    assert sim.check_hazards(g, [op_accesses(("copy", 0, s, 0, 0, d, 0, N)) for s, d in [(0, 1), (2, 1), (1, 3), (0, 4), (3, 0)]]
                             + [({(0, 4), (0, 0)}, {(0, 4)})]) == []
    g(wait=True)
    np.testing.assert_array_equal(arr(y), 3)
    np.testing.assert_array_equal(arr(w), 3)
    np.testing.assert_array_equal(arr(x), 3)
    np.testing.assert_array_equal(arr(v), 4)  # v = 1 (copied before x changed) + 3


def test_cross_device_copies_run_on_the_source_device(dev, dev1, dev2, P):
    a, b, c = alloc(dev, fill=4), alloc(dev1), alloc(dev2)
    g = HCQGraph([CopyItem(b, a, N * 4), CopyItem(c, b, N * 4), ExecItem(P[2]["acc"], (c,), (N,), *grid(N))])
    assert [qname(p.queue) for p in g.plan] == ["CPU:0 copy0", "CPU:1 copy0", "CPU:2 compute"]
    assert g.devices == [dev, dev1, dev2]
    g(wait=True)
    np.testing.assert_array_equal(arr(c), 5)


# ------------------------------------------------------------------ inputs
def test_input_replacement(dev, P):
    x, out = alloc(dev, fill=1), alloc(dev, fill=-1)
    g = HCQGraph([ExecItem(P[0]["axpb"], (out, x), (2.0, 1.0, N), *grid(N)),
                  ExecItem(P[0]["acc"], (x,), (N,), *grid(N))], inputs=(x,))  # reads and writes the input
    x2 = alloc(dev)
    arr(x2)[:] = np.arange(N)
    g(inputs=(x2,), wait=True)
    np.testing.assert_array_equal(arr(out), np.arange(N) * 2 + 1)
    np.testing.assert_array_equal(arr(x2), np.arange(N) + 1)
    np.testing.assert_array_equal(arr(x), 1)  # the build-time buffer is untouched
    big = alloc(dev, 2 * N, fill=7)
    g(inputs=(big,), wait=True)
    np.testing.assert_array_equal(arr(out), 15)
    np.testing.assert_array_equal(arr(big)[:N], 8)
    np.testing.assert_array_equal(arr(big)[N:], 7)
    g(inputs=(x,), wait=True)  # the original may be passed too
    np.testing.assert_array_equal(arr(out), 3)
    np.testing.assert_array_equal(arr(x), 2)


def test_input_views_and_copies_follow_the_input(dev, dev1, P):
    """Views of an input (at an offset) and copies from/to it use the run's buffer at the same offset."""
    x, out, far = alloc(dev, fill=0), alloc(dev, fill=-1), alloc(dev1, fill=-1)
    half = (N // 2) * 4
    g = HCQGraph([ExecItem(P[0]["axpb"], (out.offset(0, half), x.offset(half)), (1.0, 100.0, N // 2), *grid(N // 2)),
                  CopyItem(x.offset(0, half), x.offset(half), half),  # within the input
                  CopyItem(far, x, N * 4)], inputs=(x,))  # from the input to another device
    x2 = alloc(dev)
    arr(x2)[:] = np.arange(N)
    g(inputs=(x2,), wait=True)
    np.testing.assert_array_equal(arr(out)[:N // 2], np.arange(N // 2, N) + 100)
    np.testing.assert_array_equal(arr(out)[N // 2:], -1)
    np.testing.assert_array_equal(arr(x2), np.concatenate([np.arange(N // 2, N), np.arange(N // 2, N)]))
    np.testing.assert_array_equal(arr(far), arr(x2))
    np.testing.assert_array_equal(arr(x), 0)


def test_input_given_as_a_view_is_replaced_by_the_run_buffer(dev, P):
    """An input that is itself a view (offset 64 bytes into an allocation): the run's buffer takes the
    view's place, so the kernel must read the run's buffer from its start."""
    base, out = alloc(dev, 2 * 16), alloc(dev, 16, fill=-1)
    arr(base)[:] = np.arange(32)
    view = base.offset(64, 64)
    g = HCQGraph([ExecItem(P[0]["axpb"], (out, view), (1.0, 0.0, 16), (16, 1, 1), (1, 1, 1))], inputs=(view,))
    g(wait=False, inputs=(view,))
    g.synchronize()
    np.testing.assert_array_equal(arr(out), np.arange(16, 32))
    x2 = alloc(dev, 16 + 64)  # room past the end, so reading at a wrong offset shows instead of faulting
    arr(x2)[:] = 1000
    arr(x2)[:16] = 500 + np.arange(16)
    g(inputs=(x2,), wait=True)
    np.testing.assert_array_equal(arr(out), 500 + np.arange(16))


def test_sibling_views_of_an_input_allocation_are_not_replaced(dev, P):
    """Only the input and views inside it follow the run's buffer; other views of the same allocation (an
    arena holding several tensors) keep their own addresses."""
    arena = alloc(dev, 3 * 64)
    w, x, out = (arena.offset(i * 256, 256) for i in range(3))
    arr(w)[:], arr(x)[:], arr(out)[:] = 1, 10, -1
    g = HCQGraph([ExecItem(P[0]["add"], (out, x, w), (64,), (64, 1, 1))], inputs=(x,))
    g(inputs=(x,), wait=True)
    np.testing.assert_array_equal(arr(out), 11)
    # the run's buffer sits in the middle of a padded allocation: an address computed from it for `w` or
    # `out` lands in memory this test owns instead of faulting
    pad = alloc(dev, 5 * 64, fill=0)
    x2 = pad.offset(2 * 256, 256)
    arr(x2)[:] = 100
    arr(out)[:] = -1
    g(inputs=(x2,), wait=True)
    np.testing.assert_array_equal(arr(out), 101)
    np.testing.assert_array_equal(arr(w), 1)
    np.testing.assert_array_equal(arr(x), 10)
    np.testing.assert_array_equal(arr(pad)[:2 * 64], 0)
    np.testing.assert_array_equal(arr(pad)[3 * 64:], 0)


def test_input_errors(dev, P):
    x, out = alloc(dev), alloc(dev)
    g = HCQGraph([ExecItem(P[0]["add"], (out, x, x), (N,), *grid(N))], inputs=(x,))
    with pytest.raises(ValueError, match="smaller"):
        g(inputs=(alloc(dev, N - 1),))
    with pytest.raises(ValueError, match=r"takes 1 input buffer\(s\), got 2"):
        g(inputs=(x, x))
    with pytest.raises(ValueError, match=r"takes 1 input buffer\(s\), got 0"):
        g()
    with pytest.raises(TypeError, match="HCQBuffer"):
        g(inputs=(np.zeros(N, np.float32),))
    freed = dev.allocator.alloc(N * 4, BufferSpec(cpu_access=True, nolru=True))
    dev.allocator.free(freed, N * 4, BufferSpec(cpu_access=True, nolru=True))
    with pytest.raises(ValueError, match="freed"):
        g(inputs=(freed,))
    arr(x)[:] = 2
    g(inputs=(x,), wait=True)  # still usable after the refusals
    np.testing.assert_array_equal(arr(out), 4)


def test_build_errors(dev, P):
    a = alloc(dev)
    with pytest.raises(ValueError, match="at least one item"):
        HCQGraph([])
    with pytest.raises(TypeError, match="ExecItem or CopyItem"):
        HCQGraph([("not", "an item")])
    with pytest.raises(ValueError, match="overruns"):
        HCQGraph([CopyItem(alloc(dev, 4), a, N * 4)])
    with pytest.raises(ValueError, match="takes 3 buffer"):
        HCQGraph([ExecItem(P[0]["add"], (a, a), (N,))])


# ------------------------------------------------------------------ variables
def test_symbolic_n_and_grid_dims_change_each_run(dev, dev1, P):
    n, l = Variable("n", 1, N), Variable("l", 1, 64)
    x, out, far = alloc(dev), alloc(dev), alloc(dev1)
    arr(x)[:] = np.arange(N)
    nbytes = Variable("nb", 4, N * 4)
    g = HCQGraph([ExecItem(P[0]["axpb"], (out, x), (2.0, 1.0, n), ((n + 63) // 64, 1, 1), (64, 1, 1)),
                  ExecItem(P[0]["acc"], (x,), (n,), (n // l, 1, 1), (l, 1, 1)),  # exactly n threads when l divides n
                  CopyItem(far, out, nbytes)])
    xs = np.arange(N, dtype=np.float32)
    for nv, lv in [(256, 64), (1, 1), (100, 4), (256, 1), (37, 37), (200, 8)]:
        arr(out)[:], arr(far)[:] = -1, -1
        assert g(var_vals={"n": nv, "l": lv, "nb": nv * 4}, wait=True) > 0
        exp = np.full(N, -1, np.float32)
        exp[:nv] = xs[:nv] * 2 + 1
        np.testing.assert_array_equal(arr(out), exp)
        np.testing.assert_array_equal(arr(far), exp)
        xs[:nv] += 1
        np.testing.assert_array_equal(arr(x), xs)


_KEEP_ALIVE = []  # graphs of the isolated-device tests: if a regression leaves a queue stuck in a ring, its
# memory (bound queue words, kernargs, kickoff signal slot) must not be freed or reused under it


def unstick(d):
    """Let waits on `d`'s timeline pass again when a refused submit left it short of a value nobody will
    signal (see test_refused_runs_leave_devices_usable), so graph destructors do not sit out timeouts."""
    d.timeline_signal.value = max(d.timeline_signal.value, d.timeline_value - 1)


def test_missing_variable_raises(open_device, monkeypatch):
    monkeypatch.setenv("HCQDEV_WAIT_TIMEOUT_MS", "1000")
    d = open_device()  # (see test_refused_runs_leave_devices_usable)
    n = Variable("n", 1, N)
    out = alloc(d)
    g = HCQGraph([ExecItem(prgs_of(d)["fill"], (out,), (5, n), (n, 1, 1))])
    try:
        with pytest.raises(UnboundVariableError, match="'n'"):
            g(var_vals={"m": 3})
    finally:
        _KEEP_ALIVE.append(g)
        unstick(d)


def test_refused_runs_leave_devices_usable(open_device, monkeypatch):
    """A run refused for a missing or out-of-range variable must leave both devices (and the graph) as they
    were: nothing of it runs, ordinary launches afterwards complete, the graph's next run works. Here the
    variable is only used on the second device, so the first device's queue is looked at first."""
    monkeypatch.setenv("HCQDEV_WAIT_TIMEOUT_MS", "2000")
    d3, d4 = open_device(), open_device()  # (a regression would leave them stuck)
    p3, p4 = prgs_of(d3), prgs_of(d4)
    n = Variable("n", 1, N)
    a3, b4 = alloc(d3, fill=1), alloc(d4, fill=-1)
    g = HCQGraph([ExecItem(p3["acc"], (a3,), (N,), *grid(N)), CopyItem(b4, a3, N * 4), ExecItem(p4["fill"], (b4,), (5, n), (n, 1, 1))])
    try:
        with pytest.raises(UnboundVariableError, match="'n'"):
            g()
        with pytest.raises(ValueError, match="outside its range"):
            g(var_vals={"n": N + 1})
        for d, p, buf in ((d3, p3, a3), (d4, p4, b4)):
            p["acc"](buf, vals=(N,), global_size=(N, 1, 1), wait=True)  # ordinary launches after the refusals
            d.synchronize()
        np.testing.assert_array_equal(arr(a3), 2)  # nothing of the refused runs ran
        np.testing.assert_array_equal(arr(b4), 0)
        g(var_vals={"n": 10}, wait=True)
        np.testing.assert_array_equal(arr(a3), 3)
        np.testing.assert_array_equal(arr(b4)[:10], 5)
        np.testing.assert_array_equal(arr(b4)[10:], 3)
        g(var_vals={"n": 20}, wait=True)
        np.testing.assert_array_equal(arr(b4)[:20], 5)
        np.testing.assert_array_equal(arr(b4)[20:], 4)
    finally:
        _KEEP_ALIVE.append(g)
        unstick(d3)
        unstick(d4)


def test_user_variables_may_use_any_name(open_device, monkeypatch):
    """Variables named like the graph's own symbols (kickoff, inputs, timelines) are the user's."""
    monkeypatch.setenv("HCQDEV_WAIT_TIMEOUT_MS", "2000")
    dev = open_device()  # (a clash can make a run refuse, or worse, on it)
    P = [prgs_of(dev)]
    names = ["kickoff", "graph_input0", "graph_tl_addr0", "graph_tl_wait0", "graph_tl_signal0"]
    x, outs = alloc(dev), [alloc(dev) for _ in names]
    items = [ExecItem(P[0]["fill"], (o,), (k, Variable(nm, 1, N)), (Variable(nm, 1, N), 1, 1)) for k, (o, nm) in enumerate(zip(outs, names))]
    g = HCQGraph(items + [ExecItem(P[0]["acc"], (x,), (N,), *grid(N))], inputs=(x,))
    try:
        for run, nv in enumerate((5, 17, 3)):
            for o in outs: arr(o)[:] = -1
            g(inputs=(x,), var_vals={nm: nv + k for k, nm in enumerate(names)}, wait=True)
            for k, o in enumerate(outs):
                np.testing.assert_array_equal(arr(o)[:nv + k], k, err_msg=names[k])
                np.testing.assert_array_equal(arr(o)[nv + k:], -1, err_msg=names[k])
            np.testing.assert_array_equal(arr(x), run + 1)
    finally:
        _KEEP_ALIVE.append(g)
        unstick(dev)


# ------------------------------------------------------------------ reuse, wait, interleaving, ordering
@pytest.mark.parametrize("runs", [1000, pytest.param(20000, marks=pytest.mark.slow)])
def test_graph_reused_many_times(dev, dev1, P, runs):
    a, b = alloc(dev), alloc(dev1)
    g = HCQGraph([ExecItem(P[0]["acc"], (a,), (N,), *grid(N)), CopyItem(b, a, N * 4), ExecItem(P[1]["acc"], (b,), (N,), *grid(N))])
    single = alloc(dev)
    g1 = HCQGraph([ExecItem(P[0]["acc"], (single,), (N,), *grid(N, 16))])
    for _ in range(runs):
        assert g() is None
        g1()
    g.synchronize()
    g1.synchronize()
    np.testing.assert_array_equal(arr(a), runs)
    np.testing.assert_array_equal(arr(b), runs + 1)
    np.testing.assert_array_equal(arr(single), runs)


def test_wait_returns_device_seconds(dev, P):
    a = alloc(dev)
    g = HCQGraph([ExecItem(P[0]["acc"], (a,), (N,), *grid(N))])
    t = g(wait=True)
    assert isinstance(t, float) and 0 < t < 10
    assert g() is None
    g.synchronize()
    assert isinstance(g.device_time(), float) and g.device_time() > 0
    np.testing.assert_array_equal(arr(a), 2)
    gs = HCQGraph([ExecItem(P[0]["slow_fill"], (a,), (1, SLOW_ITERS // 4, N))])
    assert gs(wait=True) >= t  # loose sanity: a spinning kernel takes longer than a tiny one


def test_next_run_waits_for_previous_before_patching(dev, P):
    """Two runs issued back to back with different inputs and variables: each sees its own values even
    though the first is still running when the second is issued."""
    v = Variable("v", 0, 1000)
    x = alloc(dev)
    g = HCQGraph([ExecItem(P[0]["slow_fill"], (x,), (v, SLOW_ITERS // 2, N))], inputs=(x,))
    outs = [alloc(dev, fill=-1) for _ in range(4)]
    for i, o in enumerate(outs): g(inputs=(o,), var_vals={"v": 10 + i})
    g.synchronize()
    for i, o in enumerate(outs): np.testing.assert_array_equal(arr(o), 10 + i)


def test_runs_from_two_threads(dev, dev1, P):
    a, b = alloc(dev), alloc(dev1)
    g = HCQGraph([ExecItem(P[0]["acc"], (a,), (N,), *grid(N)), CopyItem(b, a, N * 4), ExecItem(P[1]["acc"], (b,), (N,), *grid(N))])
    errors = []

    def worker():
        try:
            for _ in range(200): g()
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(2)]
    for t in threads: t.start()
    for t in threads: t.join()
    assert errors == []
    g.synchronize()
    np.testing.assert_array_equal(arr(a), 400)
    np.testing.assert_array_equal(arr(b), 401)


def test_graph_dropped_while_running(dev, P):
    a = alloc(dev)
    g = HCQGraph([ExecItem(P[0]["slow_fill"], (a,), (9, SLOW_ITERS // 4, N)), ExecItem(P[0]["acc"], (a,), (N,), *grid(N))])
    g()
    del g
    gc.collect()
    np.testing.assert_array_equal(copyout(a), 10)
    g2 = HCQGraph([ExecItem(P[0]["acc"], (a,), (N,), *grid(N))])
    g2(wait=True)
    np.testing.assert_array_equal(arr(a), 11)


@pytest.mark.parametrize("seed", [0, 1])
def test_two_graphs_interleaved_with_ordinary_submits(dev, dev1, P, seed):
    rng = np.random.default_rng(seed)
    a0, e0 = alloc(dev), alloc(dev)
    b1, c1 = alloc(dev1), alloc(dev1)
    m = {"a0": np.arange(N, dtype=np.float32), "e0": np.zeros(N, np.float32), "b1": np.ones(N, np.float32), "c1": np.zeros(N, np.float32)}
    for k, buf in (("a0", a0), ("e0", e0), ("b1", b1), ("c1", c1)): arr(buf)[:] = m[k]
    g1 = HCQGraph([ExecItem(P[0]["acc"], (a0,), (N,), *grid(N)), CopyItem(b1, a0, N * 4),
                   ExecItem(P[1]["axpb"], (c1, b1), (1.0, 3.0, N), *grid(N, 32))])

    def run_g1():
        m["a0"] += 1
        m["b1"][:] = m["a0"]
        m["c1"][:] = m["b1"] + 3
        assert g1() is None

    g2 = HCQGraph([ExecItem(P[1]["vmax"], (c1, c1, b1), (N,), *grid(N)), CopyItem(e0, c1, N * 4),
                   ExecItem(P[0]["acc"], (e0,), (N,), *grid(N, 8))])

    def run_g2():
        m["c1"][:] = np.maximum(m["c1"], m["b1"])
        m["e0"][:] = m["c1"] + 1
        assert g2() is None

    def prg_a0():
        m["a0"] += 1
        P[0]["acc"](a0, vals=(N,), global_size=(4, 1, 1), local_size=(64, 1, 1))

    def prg_b1():
        m["b1"][:] = m["b1"] * 0.5 + 2
        P[1]["axpb"](b1, b1, vals=(0.5, 2.0, N), global_size=(N, 1, 1))

    def copyin_a0():
        new = rng.integers(0, 100, N).astype(np.float32)
        m["a0"][:] = new
        dev.allocator.copyin(a0, memoryview(new))

    def transfer_e0_b1():
        m["b1"][:] = m["e0"]
        dev.allocator.transfer(b1, e0, N * 4, dev, dev1)

    def check():
        for k, buf in (("a0", a0), ("e0", e0), ("b1", b1), ("c1", c1)): np.testing.assert_array_equal(copyout(buf), m[k], err_msg=k)

    steps = [run_g1, run_g2, prg_a0, prg_b1, copyin_a0, transfer_e0_b1, check]
    for _ in range(80): steps[int(rng.choice(len(steps), p=[0.2, 0.2, 0.15, 0.15, 0.08, 0.12, 0.1]))]()
    run_g2()
    run_g1()
    check()


def test_graph_runs_after_earlier_work(dev, dev1, P):
    """A slow kernel launched without waiting writes x1 (CPU:1) and x0 (CPU:0); the graph reads both (a
    cross-device copy of x1 and a kernel on x0) and must see the finished data."""
    x0, x1, y0, z0 = alloc(dev, fill=-1), alloc(dev1, fill=-1), alloc(dev, fill=-1), alloc(dev, fill=-1)
    g = HCQGraph([CopyItem(y0, x1, N * 4), ExecItem(P[0]["add"], (z0, y0, x0), (N,), *grid(N))])
    for rep in range(2):
        P[1]["slow_fill"](x1, vals=(7 + rep, SLOW_ITERS, N), wait=False)
        P[0]["slow_fill"](x0, vals=(100, SLOW_ITERS // 2, N), wait=False)
        g(wait=True)
        np.testing.assert_array_equal(arr(y0), 7 + rep)
        np.testing.assert_array_equal(arr(z0), 107 + rep)
        arr(x0)[:], arr(x1)[:] = -1, -1


def test_later_work_runs_after_graph(dev, dev1, P):
    """After g() (no wait): a kernel on CPU:1 reading the graph's output, copyout on each device, and a
    kernel on CPU:0 overwriting what the graph's slow kernel still has to read, all see graph order."""
    inp, x0, y1, z1 = alloc(dev, fill=2), alloc(dev, fill=-1), alloc(dev1, fill=-1), alloc(dev1, fill=-1)
    g = HCQGraph([ExecItem(P[0]["slow_axpb"], (x0, inp), (3.0, 1.0, SLOW_ITERS, N)), CopyItem(y1, x0, N * 4)])
    assert g() is None
    P[1]["axpb"](z1, y1, vals=(1.0, 1.0, N), global_size=(N, 1, 1))  # reads the graph's result
    P[0]["fill"](inp, vals=(50, N), global_size=(N, 1, 1))  # WAR: must not overtake the graph's read
    np.testing.assert_array_equal(copyout(x0), 7)
    np.testing.assert_array_equal(copyout(z1), 8)
    np.testing.assert_array_equal(copyout(y1), 7)
    np.testing.assert_array_equal(copyout(inp), 50)
    assert g() is None  # and again, with a copyout right away on the other device
    out = np.empty(N, np.float32)
    dev1.allocator.copyout(memoryview(out), y1)
    np.testing.assert_array_equal(out, 151)


def test_transfer_after_graph_sees_results(dev, dev1, P):
    a0, b1 = alloc(dev), alloc(dev1, fill=-1)
    g = HCQGraph([ExecItem(P[0]["slow_fill"], (a0,), (42, SLOW_ITERS // 2, N))])
    g()
    dev.allocator.transfer(b1, a0, N * 4, dev, dev1)
    dev1.synchronize()
    np.testing.assert_array_equal(arr(b1), 42)


# ------------------------------------------------------------------ profile and dot
def _profile_graph(dev, dev1, P, profile=True):
    a, b, c, d1 = alloc(dev, fill=1), alloc(dev), alloc(dev), alloc(dev1)
    items = [ExecItem(P[0]["axpb"], (b, a), (2.0, 0.0, N), *grid(N)),  # 0
             ExecItem(P[0]["acc"], (b,), (N,), *grid(N)),  # 1: chained on the same queue, no wait
             ExecItem(P[0]["sadd"], (c, b, a), (200, N), *grid(N)),  # 2: chained
             CopyItem(d1, c, N * 4),  # 3: CPU:0 copy0, waits for 2
             ExecItem(P[1]["acc"], (d1,), (N,), *grid(N)),  # 4: CPU:1 compute, waits for 3
             ExecItem(P[0]["add"], (a, a, a), (N,), *grid(N))]  # 5: CPU:0 compute, WAR on a (read by 0 and 2): own queue
    return HCQGraph(items, profile=profile), (b, c, d1, a)


def test_profile_entries(dev, dev1, P):
    g, (_, c, d1, a) = _profile_graph(dev, dev1, P)
    assert len(g.prof_entries) == 6
    assert [e.index for e in g.prof_entries] == list(range(6))
    queues = [("compute", 0)] * 3 + [("copy", 0), ("compute", 0), ("compute", 0)]
    for e, p, (kind, idx) in zip(g.prof_entries, g.plan, queues):
        assert p.queue[1:] == (kind, idx)
        assert e.queue in ((kind, idx), qname(p.queue))  # (kind, index), or the queue's name
    assert [e.device for e in g.prof_entries] == ["CPU:0"] * 4 + ["CPU:1", "CPU:0"]
    assert g.prof_entries[0].name == "axpb" and g.prof_entries[3].nbytes == N * 4
    for i, e in enumerate(g.prof_entries):
        assert all(0 <= d < i for d in e.deps)
    assert 2 in g.prof_entries[3].deps and 3 in g.prof_entries[4].deps
    # chained items on one queue (no waits between) start at the previous item's end signal
    assert g.prof_entries[1].st is g.prof_entries[0].en and g.prof_entries[2].st is g.prof_entries[1].en
    assert g.prof_entries[3].st is not g.prof_entries[2].en and g.prof_entries[4].st is not g.prof_entries[3].en
    for run in range(3):
        g(wait=True)
        for e in g.prof_entries:
            assert 0 < e.st.timestamp <= e.en.timestamp
            for d in e.deps: assert g.prof_entries[d].en.timestamp <= e.st.timestamp
    assert g.prof_entries[5].st is g.prof_entries[2].en  # back on CPU:0 compute without a wait
    # three runs: a = 1, 2, 4 at the start of each; b = 2a + 1, c = b + a, d1 = c + 1, then a doubles
    np.testing.assert_array_equal(arr(c), 13)
    np.testing.assert_array_equal(arr(d1), 14)
    np.testing.assert_array_equal(arr(a), 8)


def test_profile_default_follows_the_profiler(dev, dev1, P):
    """profile=None: entries only while a profiler is active (PROFILE=1 or `with hcq.profile()`)."""
    if hcq.profiler.active is None:
        g, _ = _profile_graph(dev, dev1, P, profile=None)
        assert g.prof_entries == []
        g(wait=True)
    with hcq.profile():
        g, _ = _profile_graph(dev, dev1, P, profile=None)
        assert len(g.prof_entries) == 6
        g(wait=True)
    g, _ = _profile_graph(dev, dev1, P, profile=False)
    assert g.prof_entries == []


def test_profile_random_dag(devs, P):
    rng = np.random.default_rng(77)
    ops = random_ops(rng, 3, 80)
    g = HCQGraph(make_items(ops, new_pools(devs, 3, random_init(rng, 3)), P), profile=True)
    assert len(g.prof_entries) == 80 and Sim(g).problems == []
    g()
    g(wait=True)
    for i, e in enumerate(g.prof_entries):
        assert e.st.timestamp <= e.en.timestamp
        for d in e.deps:
            assert d < i
            assert g.prof_entries[d].en.timestamp <= e.st.timestamp


def test_dot_mentions_every_item_and_queue(dev, dev1, P):
    g, _ = _profile_graph(dev, dev1, P, profile=False)
    dot = g.dot()
    assert dot.startswith("digraph") and dot.rstrip().endswith("}")
    assert dot.count("{") == dot.count("}")
    for i, it in enumerate(g.items): assert f'"item{i}"' in dot and it.name in dot
    for k in g.queues: assert qname(k) in dot
    assert '"item2" -> "item3"' in dot and '"item3" -> "item4"' in dot
    s = str(g)
    for k in g.queues: assert f"{qname(k)}:" in s


# ------------------------------------------------------------------ capture
def test_capture_records_and_replays(dev, dev1, P):
    x, out, far = alloc(dev, fill=1), alloc(dev, fill=-1), alloc(dev1, fill=-1)
    with hcq.capture(inputs=(x,)) as g:
        assert P[0]["axpb"](out, x, vals=(2.0, 1.0, N), global_size=grid(N)[0], local_size=grid(N)[1]) is None
        assert P[0]["acc"](out, vals=(N,), global_size=(N, 1, 1), wait=True) is None
        dev.allocator.transfer(far, out, N * 4, dev, dev1)
        np.testing.assert_array_equal(arr(out), -1)  # nothing ran
    np.testing.assert_array_equal(arr(out), -1)
    np.testing.assert_array_equal(arr(far), -1)
    assert len(g.graph.items) == 3 and isinstance(g.graph.items[2], CopyItem)
    dev.synchronize()
    dev1.synchronize()
    np.testing.assert_array_equal(arr(out), -1)  # still nothing ran
    x2 = alloc(dev)
    arr(x2)[:] = np.arange(N)
    assert g(inputs=(x2,), wait=True) > 0
    np.testing.assert_array_equal(arr(out), np.arange(N) * 2 + 2)
    np.testing.assert_array_equal(arr(far), np.arange(N) * 2 + 2)
    assert g() is None  # the captured inputs by default
    g.graph.synchronize()
    np.testing.assert_array_equal(arr(far), 4)
    np.testing.assert_array_equal(arr(x2), np.arange(N))


def test_capture_with_variables(dev, P):
    n = Variable("n", 1, N)
    out = alloc(dev, fill=0)
    with hcq.capture() as g:
        P[0]["acc"](out, vals=(n,), global_size=(n, 1, 1))
    for nv in (N, 10, 1):
        g(var_vals={"n": nv}, wait=True)
    exp = np.zeros(N, np.float32)
    exp[:N] += 1
    exp[:10] += 1
    exp[:1] += 1
    np.testing.assert_array_equal(arr(out), exp)


def test_capture_refuses_host_copies(dev):
    a = alloc(dev, fill=1)
    host = np.zeros(N, np.float32)
    with pytest.raises(HCQError, match="cannot be captured"), hcq.capture():
        dev.allocator.copyin(a, memoryview(np.ones(N, np.float32)))
    with pytest.raises(HCQError, match="cannot be captured"), hcq.capture():
        dev.allocator.copyout(memoryview(host), a)
    dev.allocator.copyout(memoryview(host), a)  # no capture is left active
    np.testing.assert_array_equal(host, 1)


def test_nested_and_empty_captures_raise(dev, P):
    a = alloc(dev)
    with hcq.capture() as outer:
        with pytest.raises(HCQError, match="nest"), hcq.capture():
            pass
        P[0]["acc"](a, vals=(N,), global_size=(N, 1, 1))
    np.testing.assert_array_equal(arr(a), 0)
    outer(wait=True)
    np.testing.assert_array_equal(arr(a), 1)
    with pytest.raises(HCQError, match="nothing was captured"), hcq.capture():
        pass
    failed = hcq.capture()
    with pytest.raises(RuntimeError, match="boom"), failed:
        P[0]["acc"](a, vals=(N,), global_size=(N, 1, 1))
        raise RuntimeError("boom")
    with pytest.raises(HCQError, match="no graph"):
        failed()
    P[0]["acc"](a, vals=(N,), global_size=(N, 1, 1), wait=True)  # runs normally again
    np.testing.assert_array_equal(arr(a), 2)


def test_capture_is_per_thread(dev, P):
    """Another thread's launches run while this thread captures."""
    mine, theirs = alloc(dev), alloc(dev)
    with hcq.capture() as g:
        P[0]["acc"](mine, vals=(N,), global_size=(N, 1, 1))
        t = threading.Thread(target=lambda: P[0]["acc"](theirs, vals=(N,), global_size=(N, 1, 1), wait=True))
        t.start()
        t.join()
        np.testing.assert_array_equal(arr(theirs), 1)
    np.testing.assert_array_equal(arr(mine), 0)
    assert len(g.graph.items) == 1
    g(wait=True)
    np.testing.assert_array_equal(arr(mine), 1)


# ------------------------------------------------------------------ jit
def test_jit_runs_then_captures_then_replays(dev, dev1, P):
    calls = []
    far = alloc(dev1)

    @hcq.jit
    def step(buf, other):
        calls.append(1)
        P[0]["acc"](buf, vals=(N,), global_size=(N, 1, 1))
        P[0]["add"](other, other, buf, vals=(N,), global_size=grid(N)[0], local_size=grid(N)[1])
        dev.allocator.transfer(far, other, N * 4, dev, dev1)

    a, o = alloc(dev), alloc(dev)
    assert step(a, o) is None  # 1st: runs normally
    dev.synchronize()
    dev1.synchronize()
    np.testing.assert_array_equal(arr(a), 1)
    np.testing.assert_array_equal(arr(o), 1)
    assert step(a, o) is None  # 2nd: captured and run
    assert len(calls) == 2
    for _ in range(3): step(a, o)  # replays
    assert len(calls) == 2
    t = step(a, o, wait=True)
    assert isinstance(t, float) and t > 0
    np.testing.assert_array_equal(arr(a), 6)
    np.testing.assert_array_equal(arr(o), 1 + 2 + 3 + 4 + 5 + 6)
    np.testing.assert_array_equal(arr(far), 21)
    b, o2 = alloc(dev, fill=10), alloc(dev)  # other buffers replace the captured ones
    step(b, o2, wait=True)
    np.testing.assert_array_equal(arr(b), 11)
    np.testing.assert_array_equal(arr(o2), 11)
    np.testing.assert_array_equal(arr(a), 6)
    np.testing.assert_array_equal(arr(o), 21)
    with pytest.raises(ValueError, match="captured with 2 buffers"):
        step(a)


def test_jit_with_variables(open_device, monkeypatch):
    """`pass var_vals= for Variables used inside` (jit's docstring): every call, the first included."""
    monkeypatch.setenv("HCQDEV_WAIT_TIMEOUT_MS", "2000")
    d = open_device()  # (a refused first call leaves it waiting on an unsignalled timeline)
    p = prgs_of(d)
    n = Variable("n", 1, N)

    @hcq.jit
    def step(buf):
        p["acc"](buf, vals=(n,), global_size=(n, 1, 1))

    a = alloc(d)
    try:
        for nv in (N, 100, 10, 1): step(a, var_vals={"n": nv})
        d.synchronize()
    finally:
        _KEEP_ALIVE.append(step)
        unstick(d)
    exp = np.zeros(N, np.float32)
    for nv in (N, 100, 10, 1): exp[:nv] += 1
    np.testing.assert_array_equal(arr(a), exp)


def test_runs_that_change_nothing_patch_only_kickoff_and_timelines_and_every_change_is_seen(open_device, monkeypatch):
    """A run with the same inputs and var_vals as the last writes the kickoff and timeline words straight into the
    bound queues (no general patch); new inputs, new variable values, a timeline wrap and a failed patch in between
    all go through the general patch, and every run computes with what it was given."""
    d0, d1 = open_device(), open_device()
    prgs = {n: d0.compile(KERNELS, n) for n in ("fill", "axpb")}
    spec = BufferSpec(cpu_access=True)
    a, b, c = (d0.allocator.alloc(4 * 64, spec) for _ in range(3))
    remote = d1.allocator.alloc(4 * 64, spec)
    v = Variable("v", 0, 1000)
    g = HCQGraph([ExecItem(prgs["fill"], (a,), (v, 64), 64), ExecItem(prgs["axpb"], (b, a), (2.0, 1.0, 64), 64),
                  CopyItem(dest=remote, src=b, nbytes=4 * 64)], inputs=(a,))
    prepares = []
    real = hcq.HWQueue._prepare
    monkeypatch.setattr(hcq.HWQueue, "_prepare", lambda self, *args, **kw: (prepares.append(self), real(self, *args, **kw))[1])

    def run(inp, val, expect_general):
        prepares.clear()
        g((inp,), var_vals={"v": val}, wait=True)
        assert bool(prepares) == expect_general, (val, len(prepares))
        got = np.frombuffer(remote.cpu_view().mv, np.float32)
        assert (got == 2.0 * val + 1.0).all() and (np.frombuffer(inp.cpu_view().mv, np.float32) == val).all()

    run(a, 1, True)       # the first run
    run(a, 1, False)      # nothing changed
    run(a, 1, False)
    run(c, 1, True)       # another input buffer
    run(c, 1, False)
    run(c, 7, True)       # another value
    run(c, 7, False)
    with pytest.raises(ValueError, match="outside its range"):
        g((c,), var_vals={"v": 5000})  # refused half way through the patch: nothing ran
    run(c, 7, True)       # so the next run patches everything again
    for dev in (d0, d1):  # the timelines wrap: the timeline signals swap
        dev.hw_compute_queue_t().wait(dev.timeline_signal, dev.timeline_value - 1).signal(dev.timeline_signal, (1 << 31) + 3).submit(dev)
        dev.timeline_value = (1 << 31) + 4
        dev.synchronize()
    run(c, 7, True)
    run(c, 7, False)
    assert d0.timeline_signal.value == d0.timeline_value - 1 and d1.timeline_signal.value == d1.timeline_value - 1


# ------------------------------------------------------------------ freed buffers: a replay must not write the next allocation
@pytest.mark.parametrize("how", ["one queue (native run)", "two devices", "validating"])
def test_replay_after_free_raises_and_leaves_the_next_allocation_alone(dev, dev1, how):
    """A graph built on `y` (not an input), replayed, then `free(y)` and an allocation of the same size: the replay
    raises, naming the freed buffer, and writes nothing, on the native one-queue run and the Python path alike. Before,
    the LRU cache handed back `y` itself as the new buffer, and the replay overwrote it."""
    spec = BufferSpec(cpu_access=True)
    was = hcq.validation.enabled
    hcq.validation.set_enabled(how == "validating")
    try:
        y, x = alloc(dev), alloc(dev, fill=3.0)
        items = [ExecItem(prgs_of(dev)["fill"], (y,), (5, N), (N, 1, 1))]
        if how == "two devices": items.append(CopyItem(alloc(dev1), x, N * 4))
        g = HCQGraph(items, inputs=(x,))
        for _ in range(3): g((x,), wait=True)  # (later runs of a one-queue graph are native where the extension is)
        if how.startswith("one queue") and hcq.hotpath.available(): assert g._native
        for d in (dev, dev1): d.synchronize()
        dev.allocator.free(y, N * 4, spec)
        z = dev.allocator.alloc(N * 4, spec)
        arr(z)[:] = 0
        with pytest.raises(ValueError, match=r"item 0 .*freed"):
            g((x,), wait=True)
        for d in (dev, dev1): d.synchronize()
        np.testing.assert_array_equal(arr(z), 0)
        assert z is not y
        dev.allocator.free(z, N * 4, spec)
    finally:
        hcq.validation.set_enabled(was)


def test_a_freed_input_replaced_at_run_time_is_fine(dev, P):
    """Only buffers the graph bakes in must stay allocated: a build-time input that was freed, replaced by the run's
    buffer, is not used, and the run goes ahead."""
    spec = BufferSpec(cpu_access=True)
    x, out = alloc(dev), alloc(dev)
    g = HCQGraph([ExecItem(P[0]["axpb"], (out, x), (2.0, 1.0, N), *grid(N))], inputs=(x,))
    dev.allocator.free(x, N * 4, spec)
    x2 = alloc(dev, fill=4.0)
    g((x2,), wait=True)
    np.testing.assert_array_equal(arr(out), 9)


@pytest.mark.parametrize("refused", ["the only queue", "the second queue"])
def test_a_run_a_ring_refuses_leaves_no_hole_in_the_timelines(open_device, monkeypatch, refused):
    """A run whose submission a ring refuses (here: publish raises, as for a stopped ring) after it took its timeline
    values: later waits on the devices still end (before, they timed out), the queues that went in run to their end,
    and the graph runs again once the ring takes submissions."""
    monkeypatch.setenv("HCQDEV_WAIT_TIMEOUT_MS", "3000")
    two = refused == "the second queue"
    d0, d1 = open_device(), open_device()
    a, b = alloc(d0), alloc(d1)
    items = [ExecItem(prgs_of(d0)["acc"], (a,), (N,), *grid(N))] + ([CopyItem(b, a, N * 4)] if two else [])
    g = HCQGraph(items)
    _KEEP_ALIVE.append(g)
    for _ in range(2): g(wait=True)
    real, calls = hcq.packet_queue.publish, []
    g._native = None  # (the native one-queue run submits in C: a ring it finds full or stopped leaves the run to Python)

    def publish(dev, ring, words):
        calls.append(dev)
        if len(calls) == 1 + two: raise HCQError(f"{dev.device} {ring.name}: the ring was stopped; nothing was queued")
        real(dev, ring, words)
    with monkeypatch.context() as m:
        m.setattr(hcq.packet_queue, "publish", publish)
        with pytest.raises(HCQError, match="the ring was stopped"):
            g()
    for d in (d0, d1): d.synchronize()  # (timed out before)
    np.testing.assert_array_equal(arr(a), 2 + two)  # the compute queue ran in the partial run
    g(wait=True)
    np.testing.assert_array_equal(arr(a), 3 + two)
    if two: np.testing.assert_array_equal(arr(b), 3 + two)
