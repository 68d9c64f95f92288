"""Soak runs (many submits and graph replays with flat memory) and the thread-safety statement.

Soak. `test_soak_submits` makes 1,000,000 submissions (fresh queues, re-submitted symbolic queues, bound queues,
program calls; compute and copy rings of two devices) and `test_soak_graph_replays` 10,000 replays of a
two-device HCQGraph, both checking the data as they go; `test_kernargs_ring_laps` sends 400,000 launches with
512-byte kernargs round the 16 MiB kernargs ring (9 laps), each launch logging the arguments it read. VmRSS is
read (after gc) once the warm-up is done (for the ring: after its first lap, which touches its pages) and at
the end, and must grow by less than 64 MiB; the submit soak also checks that signal pages and live allocations
stay constant while signals and bound queues come and go. These are `@pytest.mark.slow` (skipped unless
HCQ_SLOW=1); bounded versions (20,000 submits, 500 replays, one lap of the ring, the same checks scaled)
always run. The numbers are printed (`pytest -s` shows them):

    HCQ_SLOW=1 python3 -m pytest tests/test_soak.py -q -s

Thread safety: what may be called from several Python threads at once is stated in docs/design.md ("Threads
calling hcq"); the tests below check the "safe" part, tests/test_reliability.py the rings under several submitters.
"""
import gc
import threading
import time

import numpy as np
import pytest

import hcq
from hcq import BufferSpec, Variable
from hcq.device import HCQCompiled
from hcq.graph import CopyItem, ExecItem, HCQGraph

TIMEOUT = 10000  # ms without progress; only reached when something is broken
M32 = (1 << 32) - 1
KERNELS = r"""
HCQ_KERNEL void sk_fill(unsigned *out, unsigned v, int n) { long i = hcq_global_id(0); if (i < n) out[i] = v + (unsigned)i; }
HCQ_KERNEL void sk_scale(unsigned *out, const unsigned *a, unsigned k, int n) { long i = hcq_global_id(0); if (i < n) out[i] = a[i] * k; }
"""
SLOW_SUBMITS, FAST_SUBMITS = 1_000_000, 20_000
SLOW_REPLAYS, FAST_REPLAYS = 10_000, 500
RSS_BOUND_MIB = 64  # for the slow runs; the bounded runs scale it (with a floor for allocator noise)


def rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"): return int(line.split()[1])
    raise RuntimeError("no VmRSS in /proc/self/status")


def measured_rss() -> int:
    gc.collect()
    return rss_kib()


def live_allocations(devs) -> list[int]:
    """Allocations not freed, once everything submitted ran and finished submissions let go of what they held
    (slow-path launches own kernargs blocks until then)."""
    for d in devs:
        d.synchronize(timeout=TIMEOUT)
        for rings in d.rings.values():
            for ring in rings:
                ring.fence.wait(ring.count, timeout=TIMEOUT)
                ring.retire()
    gc.collect()
    return [d.allocator.live for d in devs]


def u32(buf, n=None):
    return np.frombuffer(buf.cpu_view().mv, dtype=np.uint32, count=-1 if n is None else n)


def alloc(dev, nbytes):
    buf = dev.allocator.alloc(nbytes, BufferSpec(cpu_access=True))
    buf.cpu_view().mv[:] = bytes(nbytes)
    return buf


@pytest.fixture
def soak_devs(dev, dev1):
    devs = [dev, dev1]
    prgs = [{name: d.compile(KERNELS, name) for name in ("sk_fill", "sk_scale")} for d in devs]
    return devs, prgs


# ====================================================================== soak: submits
class Lane:
    """One stream of submissions to one ring, ordered by its own signal; writes its own 64-word buffer."""

    def __init__(self, dev, kind, idx):
        self.dev, self.kind, self.idx = dev, kind, idx
        self.sig = dev.new_signal(value=0)
        self.v = 0  # last value submitted on sig
        self.buf = alloc(dev, 256)
        self.src = alloc(dev, 256)  # copy lanes copy src -> buf
        u32(self.src)[:] = np.arange(64, dtype=np.uint32) * 7 + idx
        self.expect = {}  # word -> value, for writes
        o, x, v = Variable("o", 0, 63), Variable("x", 0, M32), Variable("v", 0, 2**62)
        self.sym = self.q().write(self.buf.va_addr + o * 4, x).signal(self.sig, v)  # re-submitted, unbound
        ob, xb, vb = Variable("ob", 0, 63), Variable("xb", 0, M32), Variable("vb", 0, 2**62)
        self.bound = self.q().wait(self.sig, vb - 1).write(self.buf.va_addr + ob * 4, xb).signal(self.sig, vb).bind(dev)
        self.bound_v = 0  # the value its last run signals

    def q(self):
        return self.dev.hw_compute_queue_t() if self.kind == "compute" else self.dev.hw_copy_queue_t(self.idx)

    def submit(self, i: int) -> None:
        """One submission, of a kind picked by i."""
        self.v += 1
        slot, x = (i * 7) % 64, (i * 2654435761) & M32
        k = i % 5
        if k == 3 and self.sig.value >= self.bound_v:  # a bound queue, only when its previous run finished
            self.bound.submit(self.dev, {"ob": slot, "xb": x, "vb": self.v})
            self.bound_v = self.v
        elif k in (1, 3):
            self.sym.submit(self.dev, {"o": slot, "x": x, "v": self.v})
        elif k == 4 and self.kind == "copy":
            q = self.q().copy(self.buf.va_addr + 4 * slot, self.src.va_addr + 4 * slot, 4).signal(self.sig, self.v)
            q.submit(self.dev)
            x = int(u32(self.src)[slot])
        else:
            self.q().write(self.buf.va_addr + 4 * slot, x).signal(self.sig, self.v).submit(self.dev)
        self.expect[slot] = x

    def check(self) -> None:
        self.sig.wait(self.v, timeout=TIMEOUT)
        got = u32(self.buf)
        for slot, x in self.expect.items(): assert got[slot] == x, (self.dev.device, self.kind, self.idx, slot, int(got[slot]), x)


def soak_submits(devs, prgs, total: int) -> dict:
    lanes = [Lane(d, kind, idx) for d in devs for kind, idx in (("compute", 0), ("copy", 0), ("copy", 1))]
    outs = [alloc(d, 64 * 4) for d in devs]
    last_fill = [None, None]
    warm = max(2000, total // 10)
    rss0 = None
    t0 = time.perf_counter()
    for i in range(total):
        if i == warm:
            for ln in lanes: ln.check()
            rss0, t_warm = measured_rss(), time.perf_counter()
            pages0, live0 = len(HCQCompiled.signal_pages["CPU"]), live_allocations(devs)
        if i % 64 == 17:  # a short-lived signal and a short-lived bound queue: the pool and allocator must recycle them
            dev = devs[(i // 64) % 2]
            s = dev.new_signal(value=0)
            q = dev.hw_copy_queue_t((i // 128) % 2).signal(s, i)
            if i % 1024 == 17: q.bind(dev)
            q.submit(dev)
            s.wait(i, timeout=TIMEOUT)
            del s, q
        elif i % 11 == 5:  # a program call through the fast path (every other one repeats its arguments)
            d = (i // 11) % 2
            v = (i // 22) % 1000
            prgs[d]["sk_fill"](outs[d], global_size=(4, 1, 1), local_size=(16, 1, 1), vals=(v, 64))
            last_fill[d] = v
        else:
            lanes[i % len(lanes)].submit(i)
        if i % 8192 == 8191:
            for ln in lanes: ln.check()
    for ln in lanes: ln.check()
    for d, dev in enumerate(devs):
        dev.synchronize(timeout=TIMEOUT)
        if last_fill[d] is not None: assert (u32(outs[d]) == (last_fill[d] + np.arange(64)).astype(np.uint32)).all()
    rss1, t1 = measured_rss(), time.perf_counter()
    assert len(HCQCompiled.signal_pages["CPU"]) == pages0, "signal pages grew: signals are not recycled"
    assert live_allocations(devs) == live0, "live allocations grew"
    for o, d in zip(outs, devs): d.allocator.free(o, o.size, BufferSpec(cpu_access=True))
    return {"submits": total, "rss_warm_kib": rss0, "rss_end_kib": rss1, "growth_kib": rss1 - rss0, "seconds": t1 - t0,
            "us_per_submit": (t1 - t_warm) / (total - warm) * 1e6, "signal_pages": pages0}


def report(name: str, r: dict) -> None:
    print(f"\n{name}: " + ", ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()))


def rss_bound_kib(count: int, full: int) -> int:
    return max(16 << 10, (RSS_BOUND_MIB << 10) * count // full)


@pytest.mark.full
def test_soak_submits_bounded(soak_devs):
    r = soak_submits(*soak_devs, FAST_SUBMITS)
    report("soak submits (bounded)", r)
    assert r["growth_kib"] < rss_bound_kib(FAST_SUBMITS, SLOW_SUBMITS), r


@pytest.mark.slow
def test_soak_submits(soak_devs):
    r = soak_submits(*soak_devs, SLOW_SUBMITS)
    report("soak submits", r)
    assert r["growth_kib"] < RSS_BOUND_MIB << 10, r


# ====================================================================== soak: graph replays
def soak_replays(devs, prgs, total: int) -> dict:
    """A graph over the two devices: fill (symbolic value) -> transfer -> scale -> copy back; the input buffer
    alternates between two, so input addresses, variables and timelines are patched on every replay."""
    n = 64
    d0, d1 = devs
    ins = [alloc(d0, n * 4), alloc(d0, n * 4)]
    b, c, back = alloc(d1, n * 4), alloc(d1, n * 4), alloc(d0, n * 4)
    v = Variable("v", 0, M32)
    items = [ExecItem(prgs[0]["sk_fill"], (ins[0],), (v, n), (4, 1, 1), (16, 1, 1)),
             CopyItem(b, ins[0], n * 4),
             ExecItem(prgs[1]["sk_scale"], (c, b), (3, n), (2, 1, 1), (32, 1, 1)),
             CopyItem(back, c, n * 4)]
    g = HCQGraph(items, inputs=(ins[0],))
    warm = max(100, total // 10)
    rss0 = None
    t0 = time.perf_counter()
    for i in range(total):
        if i == warm: rss0, t_warm = measured_rss(), time.perf_counter()
        g(inputs=(ins[i % 2],), var_vals={"v": i * 1000})
        if i % 97 == 0 or i == total - 1:
            g.synchronize()
            want = ((i * 1000 + np.arange(n, dtype=np.uint64)) * 3 & M32).astype(np.uint32)
            assert (u32(back) == want).all(), i
            assert (u32(ins[i % 2]) == ((i * 1000 + np.arange(n)) & M32).astype(np.uint32)).all(), i
    g.synchronize()
    rss1, t1 = measured_rss(), time.perf_counter()
    del g
    return {"replays": total, "rss_warm_kib": rss0, "rss_end_kib": rss1, "growth_kib": rss1 - rss0, "seconds": t1 - t0,
            "us_per_replay": (t1 - t_warm) / (total - warm) * 1e6}


def test_soak_graph_replays_bounded(soak_devs):
    r = soak_replays(*soak_devs, FAST_REPLAYS)
    report("soak graph replays (bounded)", r)
    assert r["growth_kib"] < rss_bound_kib(FAST_REPLAYS, SLOW_REPLAYS), r


@pytest.mark.slow
def test_soak_graph_replays(soak_devs):
    r = soak_replays(*soak_devs, SLOW_REPLAYS)
    report("soak graph replays", r)
    assert r["growth_kib"] < RSS_BOUND_MIB << 10, r


# ====================================================================== soak: the kernargs ring going round
WIDE = 62  # long parameters: about 512 bytes of kernargs per launch, so 16 MiB is one lap every ~32k launches
WIDE_SRC = ("HCQ_KERNEL void sk_wide(unsigned *log, unsigned i, " + ", ".join(f"long a{k}" for k in range(WIDE)) + ") {\n"
            "  if (hcq_global_id(0) == 0) log[i % 4096u] = i ^ (unsigned)(" + " + ".join(f"a{k}" for k in range(WIDE)) + ");\n}\n")


def soak_kernargs(dev, launches: int) -> dict:
    """Fast-path launches whose kernargs come from the wrapping ring (every fourth launch repeats the previous
    arguments, so the retag branch runs too); every launch logs what it read, and every entry is checked."""
    prg = dev.compile(WIDE_SRC, "sk_wide")
    log = alloc(dev, 4096 * 4)
    ring = dev.kernargs_allocator
    lap0, rss0, t0 = ring.lap, measured_rss(), time.perf_counter()
    rss_lap1 = None  # after the first lap every page of the ring has been touched
    i = 0
    for n in range(launches):
        if rss_lap1 is None and ring.lap > lap0: rss_lap1 = measured_rss()
        if n % 4 != 3: i += 1
        prg(log, global_size=(1, 1, 1), local_size=(2, 1, 1), vals=(i,) + tuple(i * (k + 1) for k in range(WIDE)))
        if (i % 4096 == 4095 and n % 4 == 3) or n == launches - 1:
            dev.synchronize(timeout=TIMEOUT)
            got = u32(log)
            for j in range(max(1, i - 4095), i + 1):
                assert got[j % 4096] == (j ^ (j * WIDE * (WIDE + 1) // 2)) & M32, (n, j)
    rss1, t1 = measured_rss(), time.perf_counter()
    return {"launches": launches, "kernargs_bytes": prg.kernargs_alloc_size, "laps": ring.lap - lap0, "rss_start_kib": rss0,
            "rss_first_lap_kib": rss_lap1, "rss_end_kib": rss1, "seconds": t1 - t0}


def test_kernargs_ring_laps_bounded(soak_devs):
    if hcq.validation.enabled: pytest.skip("validation mode turns the launch fast path, the ring's only user, off")
    r = soak_kernargs(soak_devs[0][1], 48_000)
    report("kernargs ring (bounded)", r)
    assert r["laps"] >= 1, r


@pytest.mark.slow
def test_kernargs_ring_laps(soak_devs):
    if hcq.validation.enabled: pytest.skip("validation mode turns the launch fast path, the ring's only user, off")
    r = soak_kernargs(soak_devs[0][1], 400_000)
    report("kernargs ring", r)
    assert r["laps"] >= 8 and r["rss_end_kib"] - r["rss_first_lap_kib"] < RSS_BOUND_MIB << 10, r


# ====================================================================== thread safety
def run_threads(fn, args_list):
    errors = []

    def wrap(*a):
        try:
            fn(*a)
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    # daemon: a thread stuck after a failure (a monitor waiting for a waiter that raised) must not keep the test
    # process from exiting once the failure is reported
    threads = [threading.Thread(target=wrap, args=a, daemon=True) for a in args_list]
    for t in threads: t.start()
    for t in threads: t.join(60)
    assert not any(t.is_alive() for t in threads), "a thread did not finish"
    if errors: raise errors[0]


def test_devices_open_once_from_several_threads(open_device):
    name = open_device().device
    hcq.Device(name).close()  # (a name no open device holds)
    got = []
    barrier = threading.Barrier(4)

    def open_it():
        barrier.wait()
        got.append(open_device(name))

    run_threads(open_it, [()] * 4)
    assert len(got) == 4 and all(d is got[0] for d in got)


def submitter(dev_of, sig, buf, iters, tid):
    """Own signal, own buffer, own queues; rings vary, so each submission waits for the previous one."""
    o, x, s = Variable("o", 0, 15), Variable("x", 0, M32), Variable("s", 0, 2**40)
    sym = {}
    for i in range(1, iters + 1):
        dev = dev_of(i)
        ring = i % 3
        mk = (lambda: dev.hw_compute_queue_t()) if ring == 0 else (lambda: dev.hw_copy_queue_t(ring - 1))
        if i % 4 == 0:  # re-submit this thread's symbolic queue for that ring
            key = (dev, ring)
            if key not in sym: sym[key] = mk().wait(sig, s - 1).write(buf.va_addr + o * 4, x).signal(sig, s)
            sym[key].submit(dev, {"o": i % 16, "x": tid * 1_000_000 + i, "s": i})
        else:
            mk().wait(sig, i - 1).write(buf.va_addr + 4 * (i % 16), tid * 1_000_000 + i).signal(sig, i).submit(dev)
        if i % 500 == 0: sig.wait(i - 250, timeout=TIMEOUT)  # keep the rings from filling up
    sig.wait(iters, timeout=TIMEOUT)
    got = u32(buf, 16)
    for slot in range(16):
        last = max(i for i in range(1, iters + 1) if i % 16 == slot)
        assert got[slot] == tid * 1_000_000 + last, (tid, slot, int(got[slot]), last)


@pytest.mark.parametrize("mode", ["one device", "different devices"])
def test_threads_submit_their_own_queues(open_device, mode):
    nthreads, iters = 4, 3000
    devs = [open_device() for _ in range(1 if mode == "one device" else 3)]
    sigs = [devs[0].new_signal(value=0) for _ in range(nthreads)]  # created before the threads start
    bufs = [alloc(devs[t % len(devs)], 64) for t in range(nthreads)]
    if mode == "one device": dev_of = [lambda i: devs[0]] * nthreads
    else: dev_of = [lambda i, t=t: devs[(t + i) % len(devs)] for t in range(nthreads)]  # each thread roams the devices
    run_threads(submitter, [(dev_of[t], sigs[t], bufs[t], iters, t) for t in range(nthreads)])
    for d in devs: assert d.error_state is None


def test_threads_wait_concurrently(dev):
    """Several threads wait on one signal and on their own, two with a short timeout that must expire, while
    the device advances the signals in steps the host releases (so the waiters sleep on the futex in between)."""
    shared, never, gate = dev.new_signal(value=0), dev.new_signal(value=0), dev.new_signal(value=0)
    own = [dev.new_signal(value=0) for _ in range(4)]
    steps, seen, timeouts = 50, [], []

    def waiter(t):
        for k in range(1, steps + 1):
            shared.wait(k, timeout=TIMEOUT)
            own[t].wait(k, timeout=TIMEOUT)
            assert shared.value >= k and own[t].value >= k
        seen.append(t)

    def timeouter():
        t0 = time.monotonic()
        with pytest.raises(hcq.HCQTimeoutError, match="timed out after 100 ms without progress"):  # the runtime's own limit
            never.wait(1, timeout=100)
        timeouts.append(time.monotonic() - t0)

    def monitor():  # reading state while others wait and submit
        while len(seen) < 4:
            assert len(dev.queue_states()) == 1 + dev.capabilities.queue_count('copy')
            assert shared.value <= steps and gate.value <= steps
            time.sleep(0.0005)

    def driver():
        for k in range(1, steps + 1):
            q = dev.hw_copy_queue_t(k % 2).wait(gate, k)
            for s in own: q.signal(s, k)
            q.signal(shared, k).submit(dev)
            time.sleep(0.001)
            gate.value = k

    run_threads(lambda kind, t: {"wait": waiter, "timeout": timeouter, "drive": driver, "monitor": monitor}[kind](*(() if t is None else (t,))),
                [("wait", t) for t in range(4)] + [("timeout", None)] * 2 + [("drive", None), ("monitor", None)])
    assert sorted(seen) == [0, 1, 2, 3]
    assert len(timeouts) == 2 and all(0.09 <= t < 30 for t in timeouts), timeouts  # not early; upper: a hang guard


def test_host_stores_from_threads_release_queues(dev, dev1):
    """Queues on two devices wait on gates; several threads open them (sig.value = v) at the same moment."""
    n = 6
    gates, done = [dev.new_signal(value=0) for _ in range(n)], [dev.new_signal(value=0) for _ in range(n)]
    all_done = dev.new_signal(value=0)
    buf = alloc(dev, 64)
    for i, g in enumerate(gates):
        d = dev if i % 2 else dev1
        d.hw_copy_queue_t(i % 2).wait(g, 2**33 + i).write(buf.va_addr + 4 * i, 100 + i).signal(done[i], 1).submit(d)
    q = dev.hw_compute_queue_t()
    for i, g in enumerate(gates): q.wait(g, 2**33 + i)
    q.signal(all_done, 1).submit(dev)
    barrier = threading.Barrier(n)

    def opener(i):
        barrier.wait()
        gates[i].value = 2**32 + 99  # the low word is above the target, the 64-bit value below: must not release
        time.sleep(0.005)
        assert done[i].value == 0
        gates[i].value = 2**33 + i

    run_threads(opener, [(i,) for i in range(n)])
    all_done.wait(1, timeout=TIMEOUT)
    for s in done: s.wait(1, timeout=TIMEOUT)
    assert list(u32(buf, n)) == [100 + i for i in range(n)]


def test_one_device_per_thread_program_calls_copies_and_graphs(open_device):
    """Each thread owns a device: fast-path program calls (some with wait=True), copyout, graph replays."""
    devs = [open_device() for _ in range(3)]
    prgs = [{name: d.compile(KERNELS, name) for name in ("sk_fill", "sk_scale")} for d in devs]
    n = 64
    outs = [alloc(d, n * 4) for d in devs]
    scaled = [alloc(d, n * 4) for d in devs]
    graphs = []
    for d, p, o, s in zip(devs, prgs, outs, scaled):
        p["sk_fill"](o, global_size=(4, 1, 1), local_size=(16, 1, 1), vals=(0, n), wait=True)  # creates its timing signals now
        v = Variable("gv", 0, M32)
        graphs.append(HCQGraph([ExecItem(p["sk_fill"], (o,), (v, n), (4, 1, 1), (16, 1, 1)),
                                ExecItem(p["sk_scale"], (s, o), (5, n), (4, 1, 1), (16, 1, 1))]))

    def work(t):
        dev, p, out, sc, g = devs[t], prgs[t], outs[t], scaled[t], graphs[t]
        host = bytearray(n * 4)
        for i in range(400):
            base = t * 100_000 + i
            if i % 3 == 0:
                g(var_vals={"gv": base})
                g.synchronize()
                assert (u32(sc) == ((base + np.arange(n, dtype=np.uint64)) * 5 & M32).astype(np.uint32)).all(), (t, i)
            else:
                p["sk_fill"](out, global_size=(4, 1, 1), local_size=(16, 1, 1), vals=(base, n), wait=i % 5 == 0)
                if i % 7 == 0:
                    dev.allocator.copyout(memoryview(host), out)
                    assert (np.frombuffer(host, np.uint32) == (base + np.arange(n)).astype(np.uint32)).all(), (t, i)
        dev.synchronize(timeout=TIMEOUT)

    run_threads(work, [(t,) for t in range(len(devs))])
    for d in devs: assert d.error_state is None
