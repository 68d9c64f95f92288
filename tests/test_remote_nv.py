"""NV devices served by `hcq serve` (the emulated GPU, HCQ_NV_EMULATE=1): the client's hcq packets are translated into
the GPU's methods on the server (hcq.backends.nv.hosting). The conformance kit and the fuzzer through it, graphs with
transfers between a served NV device, a served CPU device and a local one, one NV device per client at a time, GPU
faults and poisoned waits as device errors, and packets a hostile client crafts by hand."""
import os
import sys
import time
from array import array

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_remote import CLIENTS, ROOT, TRANSPORTS, Served, client, three_device_graph  # noqa: E402

from hcq.backends.nv import abi  # noqa: E402
from hcq.backends.nv.compiler import NVCompiler  # noqa: E402

WHY_NOT = abi.unavailable_reason() or NVCompiler.unavailable_reason()
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=f"NV cannot be emulated here: {WHY_NOT}")
EMULATE = {"HCQ_NV_EMULATE": "1"}


@pytest.fixture(params=list(TRANSPORTS), scope="module")
def served_nv(request):
    """`hcq serve --devices NV:0,NV:1` on the emulated GPU, workers unconfined (a confined one is tested below)."""
    s = Served({**TRANSPORTS[request.param], **EMULATE}, args=("--devices", "NV:0,NV:1", "--no-confine"))
    s.transport, s.server_env, s.transport_env = request.param, TRANSPORTS[request.param], {**CLIENTS[request.param], **EMULATE}
    yield s
    s.close()


def nv(served, index=0):
    return f"NV:{index}@{served.address}"


@pytest.mark.full
@pytest.mark.slow_on(served_nv="shm")  # (the full run: over TCP; an NV server's clients mirror runtime memory by messages on both)
def test_conformance_kit_passes_against_a_served_nv_device(served_nv):
    import subprocess
    r = subprocess.run([sys.executable, "-m", "hcq.conformance", nv(served_nv), "-q", "--", "-rs"], capture_output=True, text=True,
                       timeout=600, cwd=ROOT, env={**os.environ, **served_nv.transport_env})
    assert r.returncode == 0 and " passed" in r.stdout and " failed" not in r.stdout, r.stdout[-6000:] + r.stderr[-3000:]
    skips = [ln for ln in r.stdout.splitlines() if ln.startswith("SKIPPED")]
    assert all("capability" in ln or "reach no memory of each other" in ln or "is a served device" in ln for ln in skips), skips


@pytest.mark.full
def test_launches_keep_their_arguments_when_the_client_sends_its_runtime_memory_again():
    """Without hcq's extension (HCQ_HOTPATH=0), on client and server, a thousand launches in a row: the server used to
    write each launch's QMD into the client's kernargs block, which the client's copy of its runtime memory then
    overwrote (the GPU read a QMD of zeros: 76 of the kit's 90 tests failed). It now builds launches in memory of its own."""
    import subprocess
    s = Served({**TRANSPORTS["tcp"], **EMULATE, "HCQ_HOTPATH": "0"}, args=("--devices", "NV:0", "--no-confine"))
    try:
        r = subprocess.run([sys.executable, "-m", "hcq.conformance", f"NV:0@{s.address}", "-q", "-k", "accumulate or many_launches or graph"],
                           capture_output=True, text=True, timeout=300, cwd=ROOT, env={**os.environ, **CLIENTS["tcp"], **EMULATE, "HCQ_HOTPATH": "0"})
    finally:
        s.close()
    assert r.returncode == 0 and " passed" in r.stdout and " failed" not in r.stdout, r.stdout[-4000:] + r.stderr[-2000:]


@pytest.mark.slow_on(served_nv="shm")  # (the daily and full runs: over TCP; an NV server's clients mirror runtime memory on both)
def test_kernels_copies_and_a_client_opens_one_nv_device_of_a_server_at_a_time(served_nv):
    """A kernel and copies both ways through device memory the server's host does not map; a second NV device of the
    same server is refused while the first is open (GPUs reach no memory of each other), and opens once it closed."""
    r = client(f"""
        import numpy as np, hcq
        d = hcq.Device("{nv(served_nv)}")
        assert d.peer_group == "NV@{served_nv.address}" and not d.capabilities.recover and not d.memory_host_visible
        fill = d.compile(*d.CONFORMANCE_KERNELS["fill"])
        n = 300_000
        buf = d.allocator.alloc(4 * n)
        fill(buf, vals=(7, n), global_size=((n + 63) // 64, 1, 1), local_size=(64, 1, 1), wait=True)
        out = np.zeros(n, np.uint32)
        d.allocator.copyout(memoryview(out).cast("B"), buf)
        assert (out == 7).all(), out[:4]
        data = np.arange(n, dtype=np.uint32)
        d.allocator.copyin(buf, memoryview(data).cast("B"))
        d.allocator.copyout(memoryview(out).cast("B"), buf)
        assert (out == data).all()
        try:
            hcq.Device("{nv(served_nv, 1)}")
            raise SystemExit("a second NV device opened")
        except ValueError as e:
            assert "reach no memory of each other" in str(e) and "NV:0" in str(e), e
        d.close()
        fills(hcq.Device("{nv(served_nv, 1)}"), 3, 16)
        print("ok")
    """, env=served_nv.transport_env)
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout + r.stderr


@pytest.mark.slow_on(served_nv="shm")
def test_loading_a_kernel_does_not_wait_behind_the_clients_queued_waits(served_nv):
    """A client's copy and compute queues wait on a signal the host sets only after compiling a new kernel: the load
    (whose image the server copies to the GPU) must not queue behind those waits, and a thousand segments queued behind
    one wait run once it is released."""
    r = client(f"""
        import hcq
        V = hcq.Device("{nv(served_nv)}")
        gate, done = V.new_signal(value=0), V.new_signal(value=0)
        V.hw_copy_queue_t(0).wait(gate, 1).signal(done, 1).submit(V)
        q = V.hw_compute_queue_t().wait(gate, 1)
        for i in range(1200): q.signal(done, 2 + i)  # (a segment each)
        q.submit(V)
        src = "HCQ_KERNEL void twice(uint32_t *p, uint32_t n) {{ uint32_t i = hcq_global_id(0); if (i < n) p[i] *= 2; }}"
        twice = V.compile(src, "twice")
        gate.store(1)
        done.wait(1201, timeout=30_000)
        buf = fills(V, 21, 64)
        twice(buf, vals=(64,), global_size=(1, 1, 1), local_size=(64, 1, 1), wait=True)
        import numpy as np
        out = np.zeros(64, np.uint32)
        V.allocator.copyout(memoryview(out).cast("B"), buf)
        assert (out == 42).all(), out[:4]
        print("ok")
    """, env=served_nv.transport_env)
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout + r.stderr


@pytest.mark.full
@pytest.mark.slow_on(served_nv="shm")
def test_a_graph_over_a_served_nv_device_a_served_cpu_device_and_a_local_one(served_nv):
    """NV on one server, CPU on another, a local CPU device: kernels on each, transfers between them all (server to
    server over a link, server to this process and back), a variable patched into the NV kernel each replay."""
    cpu = Served(served_nv.server_env)
    try:
        r = client(three_device_graph(nv(served_nv), cpu.device(0)), env=served_nv.transport_env)
    finally:
        cpu.close()
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout + r.stderr


@pytest.mark.slow_on(served_nv="shm")
def test_a_gpu_fault_fails_the_served_device_and_what_waits_on_it(served_nv):
    """A kernel that writes outside every allocation: the GPU stops the channel, the device fails naming the fault, a
    signal its queues would have set comes back poisoned (a DeviceError, not a hang), and a local device whose queue
    waits on that signal fails too instead of running on stale data."""
    r = client(f"""
        import hcq
        V, L = hcq.Device("{nv(served_nv)}"), hcq.Device("CPU:0")
        src = "HCQ_KERNEL void poke(uint32_t *p, uint64_t off) {{ p[off] = 1; }}"
        poke = V.compile(src, "poke")
        buf = V.allocator.alloc(256)
        done = V.new_signal(value=0)
        poke(buf, vals=(1 << 40,))
        V.hw_compute_queue_t().signal(done, 1).submit(V)
        L.submit_timeline(L.hw_compute_queue_t().wait(L.replica(done), 1).signal(L.timeline_signal, L.timeline_value))
        for what, wait in (("V", V.synchronize), ("done", lambda: done.wait(1, timeout=20_000)), ("L", L.synchronize)):
            try:
                wait()
                raise SystemExit(what + " did not fail")
            except hcq.DeviceError as e:
                print(what, "failed:", e)
                assert what == "L" or "fault" in str(e), e
        print("ok")
    """, env=served_nv.transport_env)
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout + r.stderr


@pytest.mark.slow_on(served_nv="shm")
def test_a_wait_released_by_a_poisoned_signal_fails_the_served_device(served_nv):
    """A local CPU device's kernel faults; the served NV device's queue waits on the local device's signal, which its
    server gets poisoned. The GPU's semaphore acquire cannot see poison: the server checks it once the wait passed, and
    the NV device fails, saying so, rather than report the work after it as done."""
    r = client(f"""
        import hcq
        V, L = hcq.Device("{nv(served_nv)}"), hcq.Device("CPU:0")
        bad = L.compile("HCQ_KERNEL void bad(int *p) {{ *(volatile int *)0x10 = 1; }}", "bad")
        buf = L.allocator.alloc(64)
        sig = L.new_signal(value=0)
        after = V.new_signal(value=0)
        V.hw_compute_queue_t().wait(V.replica(sig), 1).signal(after, 1).submit(V)
        bad(buf)
        L.hw_compute_queue_t().signal(sig, 1).submit(L)
        try:
            after.wait(1, timeout=20_000)
            raise SystemExit("the NV device's signal after the wait reached its value")
        except hcq.DeviceError as e:
            print("after:", e)
        try:
            V.synchronize()
            raise SystemExit("the NV device did not fail")
        except hcq.DeviceError as e:
            assert "poisoned" in str(e), e
        print("ok")
    """, env=served_nv.transport_env)
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout + r.stderr


CRAFTED = {  # case -> (packets sent by hand on the compute ring, then more after them, what the device fails with or None)
    "exec": ("[hcq.packets.header(Op.EXEC), prg.entry, 0x1000, 1, 1, 1, 1, 1, 1]", "[]", "not in this device's runtime memory"),
    "indirect": ("[hcq.packets.header(Op.INDIRECT), 0x1000, 4]", "[]", "not in this device's runtime memory"),
    "poll": ("[hcq.packets.header(Op.POLL, cond=hcq.packets.PollCondition.EQ), sig.value_addr, 1, 0xF]", "[]", "masked POLL"),
    # after the failure, a signal at an address of no memory: the server stores signals poisoned only into the client's
    "opcode": ("[0x3F | (1 << 8)]", "[hcq.packets.header(Op.SIGNAL, flags=FLAG_SIGNAL), 0x1000, 1]", "unknown opcode"),
    # a wait on a signal in device memory (which the server's host does not map): the GPU runs it, nothing reads it here
    "wait": ("[hcq.packets.header(Op.WAIT, flags=FLAG_SIGNAL), buf.va_addr, 0]", "[]", None),
    "address": ("[hcq.packets.header(Op.WAIT, flags=FLAG_SIGNAL), 1 << 60, 0]", "[]", "does not fit"),
    "copy": ("[hcq.packets.header(Op.COPY), 1 << 63, buf.va_addr, 1 << 62]", "[]", "past the GPU's 49-bit address space"),
}


@pytest.mark.parametrize("case", list(CRAFTED))
@pytest.mark.slow_on(served_nv="shm")  # (what the server does with a packet does not depend on the transport)
def test_packets_a_client_crafts_fail_its_device_and_reach_no_memory_but_its_own(served_nv, case):
    """Packets sent by hand, past the client's checks: an EXEC whose kernargs are not this client's memory, an INDIRECT
    run from outside it, a masked POLL the GPU cannot run, an unknown opcode followed by a signal the failed device would
    store poisoned at an address of no memory, a wait on a signal in device memory, a semaphore address wider than the
    GPU's, a copy past the end of the address space. The bad ones fail the device with a
    message naming the packet; the server writes and reads nothing outside the client's memory, and its worker lives on."""
    first, then, expected = CRAFTED[case]
    r = client(f"""
        import hcq, hcq.packets
        from array import array
        from hcq.packets import FLAG_SIGNAL, Op
        V = hcq.Device("{nv(served_nv)}")
        prg = V.compile(*V.CONFORMANCE_KERNELS["fill"])
        sig, buf = V.new_signal(value=0), V.allocator.alloc(4096)
        ring = V.ring("copy" if {case == "copy"} else "compute", 0)
        for words in (array("Q", {first}), array("Q", {then})):
            if words: assert V.executor.try_submit(ring.handle, words.buffer_info()[0], len(words), 10**9) == 0
        V.submit_timeline(V.hw_compute_queue_t().signal(V.timeline_signal, V.timeline_value))  # (stored poisoned if the device failed)
        try:
            V.synchronize(timeout=20_000)
            print("no failure")
        except hcq.DeviceError as e:
            print("failed:", e)
            assert "stopped" not in str(e), e  # (the packet failed the device; no thread of the server died)
        import time
        deadline = time.monotonic() + 20
        while {case != "opcode"} and V.timeline_signal.load() < V.timeline_value - 1 and time.monotonic() < deadline: time.sleep(0.01)
        # (the ring drains on: the signal comes, poisoned where the device failed; words that do not decode end what the
        # server had read of the ring with them, whose signals then never come: the failure is what waits see)
        assert {case == "opcode"} or V.timeline_signal.load() >= V.timeline_value - 1, "the ring did not drain on"
        V.allocator.alloc(64)  # (the worker still answers)
        print("ok")
    """, env=served_nv.transport_env)
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout + r.stderr
    assert (expected in r.stdout) if expected is not None else "no failure" in r.stdout, r.stdout


@pytest.mark.full
@pytest.mark.slow_on(served_nv="shm")
def test_the_fuzzer_passes_on_a_served_nv_device_beside_a_local_cpu_device(served_nv):
    import subprocess
    r = subprocess.run([sys.executable, "-m", "tools.fuzz", "--device", "NV,CPU", "--serve-kind", "NV", "--serve", served_nv.transport,
                        "--devices", "2", "--programs", "40", "--seed", "7"], capture_output=True, text=True, timeout=600, cwd=ROOT,
                       env={**os.environ, **EMULATE})
    assert r.returncode == 0 and " 0 failure(s)" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]


def test_a_served_nv_device_runs_in_a_confined_worker():
    """The default server confines an NV client's worker as it does a CPU client's (its own user, namespaces); the
    device opens, compiles and runs there."""
    s = Served({**TRANSPORTS["tcp"], **EMULATE}, args=("--devices", "NV:0"))
    try:
        r = client(f"""
            import hcq
            d = hcq.Device("NV:0@{s.address}")
            fills(d, 9, 1000)
            print(confinement(d))
            print("ok")
        """, env={**CLIENTS["tcp"], **EMULATE}, timeout=300)
    finally:
        log = s.close()
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout + r.stderr + log[-3000:]
    assert "worker True True" in r.stdout, r.stdout


def test_a_single_process_server_opens_a_gpu_for_one_client_at_a_time():
    """With --isolation none every client's device lives in one process, which opens a GPU once: a second client of the
    same GPU is refused, saying why, while the first has it; once the first left, the next opens it."""
    import subprocess
    s = Served({**TRANSPORTS["tcp"], **EMULATE}, args=("--devices", "NV:0", "--isolation", "none"))
    holder = subprocess.Popen([sys.executable, "-c", f"import hcq, sys; d = hcq.Device('NV:0@{s.address}'); print('open', flush=True); sys.stdin.read()"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT, env={**os.environ, **CLIENTS["tcp"], **EMULATE})
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "open"
        second = f"""
            import hcq
            try:
                fills(hcq.Device("NV:0@{s.address}"), 5, 64)
                print("opened")
            except hcq.HCQError as e:
                print("refused:", e)
        """
        r = client(second, env={**CLIENTS["tcp"], **EMULATE})
        assert "refused:" in r.stdout and "opens a GPU once" in r.stdout, r.stdout + r.stderr
        holder.communicate("", timeout=60)  # (it leaves)
        deadline = time.monotonic() + 30
        while "opened" not in (r := client(second, env={**CLIENTS["tcp"], **EMULATE})).stdout and time.monotonic() < deadline: time.sleep(0.2)
        assert "opened" in r.stdout, r.stdout + r.stderr
    finally:
        holder.kill()
        s.close()


def test_the_feed_ring_takes_a_submission_whole_or_not_at_all():
    """feed.c, the ring serve.c submits a served NV device's packets to: too big is refused outright, a full ring times
    out with nothing queued, words come out as they went in, and a stopped ring takes nothing more."""
    import ctypes
    from hcq.backends.nv.hosting import FEED_WORDS, feed
    from hcq.backends.remote.protocol import RING_WORDS
    from hcq.packet_queue import SubmitStatus
    assert FEED_WORDS == RING_WORDS  # (clients size their submissions for the server's rings)
    lib = feed()
    f = lib.hcq_feed_create(8)
    try:
        words = array("Q", range(1, 10))
        addr = words.buffer_info()[0]
        assert lib.hcq_feed_submit(f, addr, 9, 0) == SubmitStatus.TOO_BIG
        assert lib.hcq_feed_submit(f, addr, 6, 0) == SubmitStatus.OK
        assert lib.hcq_feed_submit(f, addr, 3, 1_000_000) == SubmitStatus.FULL and lib.hcq_feed_wptr(f) == 6
        assert lib.hcq_feed_wait(f, 0, 0) == 6 and lib.hcq_feed_wait(f, 6, 1_000_000) == 6
        ring = (ctypes.c_uint64 * 8).from_address(lib.hcq_feed_words(f))
        assert list(ring[:6]) == [1, 2, 3, 4, 5, 6]
        lib.hcq_feed_consumed(f, 6)
        assert lib.hcq_feed_submit(f, addr, 3, 0) == SubmitStatus.OK and [ring[k % 8] for k in range(6, 9)] == [1, 2, 3]
        lib.hcq_feed_stop(f)
        assert lib.hcq_feed_submit(f, addr, 1, 0) == SubmitStatus.STOPPED and lib.hcq_feed_wptr(f) == 9
    finally:
        lib.hcq_feed_destroy(f)
