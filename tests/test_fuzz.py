"""The queue fuzzer (hcq/fuzz.py): a bounded seeded slice of random programs checked against the reference
model, fixed regression seeds, checks that the oracle and the watchdog catch what they should, and the hcq
bugs found while building it (at the end of this file; they fail until fixed).

The long run is `python -m hcq.fuzz --programs 10000 --seed 1`; a failing program prints its own repro,
`python -m hcq.fuzz --seed S --programs 1`."""
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest

import hcq
from hcq import BufferSpec, Variable, fuzz

SLICE_SEED, SLICE_PROGRAMS = 0, 300
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def runner():
    return fuzz.Runner()


def failures_text(st):
    return "\n".join(str(f) for f in st.failures)


def test_bounded_seeded_slice():
    st = fuzz.run(SLICE_SEED, SLICE_PROGRAMS)
    print(f"\nfuzz slice: {st.programs} programs, {st.commands} device commands in {st.seconds:.1f} s "
          f"({st.programs / st.seconds:.0f} programs/s)")
    assert not st.failures, failures_text(st)
    assert st.programs == SLICE_PROGRAMS


# seed -> (what it once caught or what it covers, allocator settings for the run)
REGRESSION_SEEDS = {
    4483: ("a symbolic exec whose n is 0 placed its region at word 64 (the offset Variable's range was too small)", {}),
    20297: ("staged copyin returns before its copy ran; the model once assumed it waited", {"direct_copy": False}),
    1932: ("bound and kernargs-patched templates, 64-bit gate values, copies >= 4 MiB (split across two threads)", {}),
    2717: ("three devices with transfers, partial gate openings, polls on flags", {}),
}


@pytest.mark.parametrize("seed", sorted(REGRESSION_SEEDS))
def test_regression_seed(runner, seed):
    _, settings = REGRESSION_SEEDS[seed]
    prog = fuzz.generate(seed)
    devs = [runner.device(d) for d in range(prog.ndev)]
    saved = [d.allocator.direct_copy for d in devs]
    try:
        for d in devs: d.allocator.direct_copy = settings.get("direct_copy", d.allocator.direct_copy)
        for _ in range(3):  # timing varies from run to run
            fuzz.run_one(seed, runner=runner)
    finally:
        for d, s in zip(devs, saved): d.allocator.direct_copy = s


def test_valid_programs_pass_validation_mode():
    """Validation mode (HCQ_VALIDATE=1) must not reject valid programs (symbolic addresses, virtual signals,
    views, transfers...), and results must not change with it on."""
    from hcq import validation
    was = validation.enabled
    validation.set_enabled(True)
    try:
        st = fuzz.run(50_000, 100)
    finally:
        validation.set_enabled(was)
    assert not st.failures, failures_text(st)


def test_programs_are_deterministic_and_cover_every_command():
    dumps = [fuzz.dump(fuzz.generate(s)) for s in range(40)]
    assert dumps == [fuzz.dump(fuzz.generate(s)) for s in range(40)]
    seen = set()
    for s in range(SLICE_SEED, SLICE_SEED + SLICE_PROGRAMS):
        prog = fuzz.generate(s)
        for st in prog.steps:
            seen.add(st[0])
            if st[0] == "submit":
                seen.update(c[0] for c in st[2])
                seen.add("template" if "tmpl" in st[3] else "concrete")
                if st[3].get("bind") or ("tmpl" in st[3] and prog.templates[st[3]["tmpl"]].bound): seen.add("bound")
        seen.add(f"{prog.ndev} devices")
    for want in ("wait", "signal", "ts", "write", "poll", "copy", "exec", "barrier", "template", "concrete", "bound", "prg", "copyin",
                 "copyout", "transfer", "sync", "gate", "hwait", "hcheck", "hwrite", "1 devices", "2 devices", "3 devices"):
        assert want in seen, want


def test_model_rejects_a_wrong_answer(runner, monkeypatch):
    """The oracle is live: a model that computes one kernel wrongly makes the run fail, naming the seed."""
    seed = next(s for s in range(10_000, 20_000) if any(st[0] == "submit" and any(c[0] == "exec" and c[1] == "fz_fill" for c in st[2])
                                                       for st in fuzz.generate(s).steps))
    kernel = fuzz.Model.kernel

    def wrong(self, kname, regions, vals, gs, ls):
        return kernel(self, kname, regions, ((vals[0] + 1) & fuzz.M32,) + vals[1:] if kname == "fz_fill" else vals, gs, ls)

    monkeypatch.setattr(fuzz.Model, "kernel", wrong)
    with pytest.raises(fuzz.FuzzFailure, match=rf"seed={seed} failed: .*differs(.|\n)*repro: python -m hcq.fuzz --seed {seed} --programs 1"):
        fuzz.run_one(seed, runner=runner)
    assert runner.broken is None


def test_watchdog_ends_a_hung_program_and_the_devices_recover(monkeypatch):
    """A program whose gates are never opened hangs; the watchdog ends it, names the hang, and the runner drains
    the devices so the next program runs."""
    def gated(prog):
        return any(st[0] == "submit" and any(c[0] == "wait" and prog.sigs[c[1]].kind == "g" for c in st[2]) for st in prog.steps)

    seed = next(s for s in range(30_000, 40_000) if gated(fuzz.generate(s)))
    r = fuzz.Runner(timeout_ms=300)
    step = fuzz.Runner.step
    monkeypatch.setattr(fuzz.Runner, "step", lambda self, i, st: None if st[0] == "gate" else step(self, i, st))
    t0 = time.monotonic()
    with pytest.raises(fuzz.FuzzFailure, match=r"watchdog(.|\n)*timed out after 300 ms(.|\n)*repro: python -m hcq.fuzz --seed"):
        fuzz.run_one(seed, runner=r)
    assert time.monotonic() - t0 < 10
    monkeypatch.setattr(fuzz.Runner, "step", step)
    assert r.broken is None
    fuzz.run_one(seed + 1, runner=r)
    fuzz.run_one(seed, runner=r)


def test_command_line_runs_and_reports():
    out = subprocess.run([sys.executable, "-m", "hcq.fuzz", "--programs", "5", "--seed", "7", "--devices", "2"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "hcq.fuzz: 5 programs" in out.stdout and "0 failure(s)" in out.stdout


# ====================================================================== hcq bugs found while building the fuzzer
def test_resubmitting_a_queue_keeps_each_submits_kernarg_values(monkeypatch):
    """A queue whose exec has symbolic kernargs patches them in place (one kernargs block), so a re-submit
    waits for the queue's previous run before patching: each run keeps its own values, and a previous run
    that cannot finish makes the re-submit time out with a message saying so, instead of silently
    changing the earlier run's arguments."""
    dev = hcq.Device("CPU:30")
    fill = dev.compile("HCQ_KERNEL void f(unsigned *out, unsigned v, int n) { long i = hcq_global_id(0); if (i < n) out[i] = v; }", "f")
    out, snap = dev.allocator.alloc(16, BufferSpec(cpu_access=True)), dev.allocator.alloc(16, BufferSpec(cpu_access=True))
    gate, done = dev.new_signal(value=0), dev.new_signal(value=0)
    v, s = Variable("v", 0, 100), Variable("s", 0, 100)
    q = dev.hw_compute_queue_t().wait(gate, 1).exec(fill, fill.fill_kernargs((out,), (v, 4)), (1, 1, 1), (4, 1, 1)).signal(done, s)
    q.submit(dev, {"v": 7, "s": 1})  # held back by the gate
    dev.hw_copy_queue_t().wait(done, 1).copy(snap.va_addr, out.va_addr, 16).signal(done, 2).submit(dev)  # what run 1 wrote
    dev.hw_compute_queue_t().wait(done, 2).submit(dev)
    monkeypatch.setenv("HCQDEV_WAIT_TIMEOUT_MS", "300")
    with pytest.raises(hcq.HCQTimeoutError, match="waits for its previous run"):
        q.submit(dev, {"v": 9, "s": 3})  # the gate is shut: run 1 cannot finish
    opener = threading.Timer(0.2, lambda: setattr(gate, "value", 1))
    opener.start()
    monkeypatch.setenv("HCQDEV_WAIT_TIMEOUT_MS", "10000")
    q.submit(dev, {"v": 9, "s": 3})  # waits for run 1 (the gate opens meanwhile), then patches
    done.wait(3, timeout=5000)
    opener.join()
    assert list(snap.cpu_view().view(0, 16, "I")[:]) == [7] * 4, "the first submission ran with the second submission's kernargs"
    assert list(out.cpu_view().view(0, 16, "I")[:]) == [9] * 4


def test_dropping_a_bound_queue_before_it_ran_does_not_crash():
    """BUG: a bound queue that is garbage-collected while its INDIRECT packet still waits in a ring frees (munmaps)
    the memory its words live in: HWQueue.__del__ -> allocator.free -> _free_now only synchronizes the device
    *timeline*, which a user queue need not signal. The command processor then reads the unmapped words outside
    any fault guard and the whole process dies with SIGSEGV (the issue asks that a user's mistake never becomes
    a segfault, and that freed memory is never reused while unfinished work uses it)."""
    code = textwrap.dedent("""
        import gc, hcq
        from hcq import BufferSpec
        dev = hcq.Device("CPU:30")
        gate, done = dev.new_signal(value=0), dev.new_signal(value=0)
        buf = dev.allocator.alloc(64, BufferSpec(cpu_access=True))
        q = dev.hw_compute_queue_t().wait(gate, 1).write(buf, 5).signal(done, 1).bind(dev)
        q.submit(dev)
        del q
        gc.collect()
        gate.value = 1
        try:
            done.wait(1, timeout=2000)
            print("ran", buf.cpu_view().view(0, 4, "I")[0])
        except hcq.HCQError as e:
            print("raised", type(e).__name__, e)
        print("process survived")
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "process survived" in out.stdout, f"exit status {out.returncode}\n{out.stdout}{out.stderr[-2000:]}"


def test_signal_slot_is_not_reused_while_a_queue_still_writes_it():
    """BUG: queues keep no reference to the signals their packets name, and a signal's 16-byte slot goes back to
    the peer group's pool when the Python object is collected, even while a submitted packet still waits to write
    it. The next new_signal() gets the same slot, and the old packet later overwrites the new signal's value:
    a fresh signal jumps to a value nothing gave it (waits on it pass early, silently). The issue asks that
    "the signal pool never reuse memory still in use by unfinished work"."""
    import gc
    dev = hcq.Device("CPU:31")
    gate = dev.new_signal(value=0)
    dev.hw_compute_queue_t().wait(gate, 1).signal(dev.new_signal(value=0), 5).submit(dev)  # that signal object is dropped at once
    gc.collect()
    fresh = [dev.new_signal(value=0) for _ in range(4)]
    gate.value = 1
    done = dev.new_signal(value=0)
    dev.hw_compute_queue_t().wait(gate, 1).signal(done, 1).submit(dev)
    done.wait(1, timeout=5000)
    assert [s.value for s in fresh] == [0, 0, 0, 0], "a new signal was written by an older queue through a recycled slot"
