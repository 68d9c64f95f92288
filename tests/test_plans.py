"""Launch plans (hcq.packet_queue.LaunchPlan, hcq.program.KernargsLayout): the checked Python path resolves a program's
plain launch once, and both runs of it (the Python one, FastLauncher, and the native one, hcq/_hotpath.c) take the
words to patch and where the arguments go from the plan, and only the arguments the plan's rule accepts."""
import dataclasses
import gc
import struct
import weakref

import numpy as np
import pytest

import hcq
from hcq import BufferSpec, Variable, hotpath, packet_queue
from hcq.packet_queue import H_BARRIER, LaunchPlan
from hcq.packets import EXEC_DIMS_AT, PACKET_WORDS, Op, decode_header

SPEC = BufferSpec(cpu_access=True, nolru=True)
ROOT_HCQ = __import__("pathlib").Path(hcq.__file__).parent
ADD = "HCQ_KERNEL void add(int *a, int v) { a[hcq_global_id(0)] += v; }"
KINDS = """HCQ_KERNEL void kinds(int8_t b, double *out, uint8_t B, int16_t h, int64_t *o2, uint16_t H, int i, float f,
                      unsigned I, _Bool t, long long q, uint64_t Q, double d, const float *in) { out[0] = f; o2[0] = b; }"""
KIND_VALS = (-128, 255, -32768, 65535, -(1 << 31), 0.25, (1 << 32) - 1, 7, -(1 << 63), (1 << 64) - 1, 1 / 3)


def packets_of(words):
    """[(opcode, index of its first word)] of a run of packets."""
    out, i = [], 0
    while i < len(words):
        op, n, _, _ = decode_header(words[i])
        out.append((Op(op), i))
        i += n
    assert i == len(words)
    return out


@pytest.mark.parametrize("timed", [False, True])
def test_a_launch_plan_names_every_word_a_launch_patches(dev, timed):
    prg = dev.compile(ADD, "add")
    plan = LaunchPlan.build(prg, timed)
    ops = packets_of(plan.words)
    want = [Op.WAIT, Op.BARRIER] + [Op.TIMESTAMP] * timed + [Op.EXEC] + [Op.TIMESTAMP] * timed + [Op.SIGNAL]
    assert [op for op, _ in ops] == want
    wait, signal, exe = ops[0][1], ops[-1][1], dict(ops)[Op.EXEC]
    assert plan.timeline_at == (wait + 1, signal + 1) and (plan.wait_at, plan.signal_at) == (wait + 2, signal + 2)
    assert plan.words[exe + 1] == prg.entry and plan.kernargs_at == exe + 2 and plan.dims_at == exe + EXEC_DIMS_AT
    assert plan.native is not timed  # (the native run takes untimed launches; timed ones need the timing signals read back)
    if timed:
        st, en = prg.timing_signals()
        assert [plan.words[i + 1] for op, i in ops if op == Op.TIMESTAMP] == [st.timestamp_addr, en.timestamp_addr]
    assert plan.layout == prg.kernargs_layout() and plan.layout.size == prg.kernargs_alloc_size


def test_a_plan_that_would_patch_outside_its_words_is_refused():
    layout = hcq.program.KernargsLayout(16, (0,), ())
    words = (1,) * 12
    with pytest.raises(ValueError, match="patches words outside them: .*wait_at=12"):
        LaunchPlan(words, (1, 10), 12, 11, 5, 6, layout, True)
    with pytest.raises(ValueError, match="dims_at=7"):
        LaunchPlan(words, (1, 10), 2, 11, 5, 7, layout, True)


def test_the_plans_kernargs_hold_what_the_checked_path_writes(dev):
    """The plan's layout packs every parameter kind to the same bytes as the checked path's args state."""
    prg = dev.compile(KINDS, "kinds")
    out, o2, inp = (dev.allocator.alloc(n, SPEC) for n in (64, 128, 8))
    layout = prg.kernargs_layout()
    assert layout.accepts(dev, (out, o2, inp), KIND_VALS) == 2  # (taken, with a float)
    raw = bytearray(layout.size)
    assert layout.pack_into(raw, 0, (out, o2, inp), KIND_VALS)
    checked = bytes(prg.fill_kernargs((out, o2, inp), KIND_VALS).buf.cpu_view()[:layout.size])
    fields = [(off, "Q") for off in layout.pointers] + list(layout.scalars)
    assert len(fields) == len(prg.arg_slots)
    for off, fmt in fields:
        assert struct.unpack_from("=" + fmt, raw, off) == struct.unpack_from("=" + fmt, checked, off), (off, fmt)
    for b in (out, o2, inp): dev.allocator.free(b, b.size, SPEC)


def test_the_plans_rule_decides_what_both_runs_take(dev, dev1, python_launches):
    """What `KernargsLayout.accepts` refuses is left to the checked path by the native run too (counted launches), and
    what it takes runs there without Python."""
    prg = dev.compile(ADD, "add")
    buf, spare, other = dev.allocator.alloc(256, SPEC), dev.allocator.alloc(64, SPEC), dev1.allocator.alloc(256, SPEC)
    host = np.zeros(64, np.int32)
    ro = dev.allocator.wrap_host(host.ctypes.data, host.nbytes, host, readonly=True)
    dev.allocator.free(spare, 64, SPEC)
    layout = prg.kernargs_layout()
    cases = {"plain": ((buf,), (1,)), "numpy value": ((buf,), (np.int32(1),)), "bool value": ((buf,), (True,)),
             "freed": ((spare,), (1,)), "a peer's": ((other,), (1,)), "too few values": ((buf,), ()), "not a buffer": ((b"x",), (1,))}
    if ro is not None: cases["read-only"] = ((ro,), (1,))
    prg(buf, vals=(1,))  # (the plan is loaded)
    for name, (bufs, vals) in cases.items():
        taken = bool(layout.accepts(dev, bufs, vals))
        assert taken == (name == "plain"), name
        python_launches.clear()
        try:
            prg(*bufs, vals=vals)
        except (TypeError, ValueError):
            pass  # (the checked path's verdict)
        if hotpath.available(): assert len(python_launches) == (0 if taken else 1), name
    dev.synchronize()
    dev1.allocator.free(other, 256, SPEC)
    dev.allocator.free(buf, 256, SPEC)


def shifted(plan: LaunchPlan) -> LaunchPlan:
    """The same launch with a BARRIER in front: every word a launch patches moves by one."""
    return dataclasses.replace(plan, words=(H_BARRIER, *plan.words), timeline_at=tuple(i + 1 for i in plan.timeline_at),
                               wait_at=plan.wait_at + 1, signal_at=plan.signal_at + 1, kernargs_at=plan.kernargs_at + 1,
                               dims_at=plan.dims_at + 1)


def test_both_runs_patch_the_words_the_plan_names(dev, monkeypatch, python_launches):
    """A plan laid out differently (here, one word longer in front) runs as it says on both runs: nothing assumes where
    the WAIT, EXEC or SIGNAL words sit."""
    build = LaunchPlan.build
    monkeypatch.setattr(LaunchPlan, "build", staticmethod(lambda prg, timed: (p := build(prg, timed)) and shifted(p)))
    prg = dev.compile(ADD, "add")
    buf = dev.allocator.alloc(4 * 64, SPEC)
    buf.cpu_view()[:] = bytes(buf.size)
    tv = dev.timeline_value
    for i in range(200): prg(buf, global_size=(64, 1, 1), vals=(1,))  # the native run (the Python one without the extension)
    assert prg(buf, global_size=(64, 1, 1), vals=(1,), wait=True) > 0  # the Python run (timed)
    dev.synchronize(timeout=20_000)
    assert (np.frombuffer(buf.cpu_view().mv, np.int32) == 201).all()
    assert dev.timeline_value == tv + 201
    assert len(python_launches) == (201 if not hotpath.available() else 1)
    assert prg._launch_runs[False].plan.words[0] == H_BARRIER
    dev.allocator.free(buf, buf.size, SPEC)


@pytest.mark.skipif(not hotpath.available(), reason=f"extension not in use: {hotpath.why_not}")
def test_the_native_run_refuses_a_plan_it_cannot_trust(dev, monkeypatch):
    """A plan object that is not what LaunchPlan makes (here one whose fields were forced past its checks) is refused
    with an error naming the field, and nothing is submitted."""
    build = LaunchPlan.build

    def broken(prg, timed):
        plan = build(prg, timed)
        object.__setattr__(plan, "signal_at", 10_000)
        return plan
    monkeypatch.setattr(LaunchPlan, "build", staticmethod(broken))
    prg = dev.compile(ADD, "add")
    buf = dev.allocator.alloc(256, SPEC)
    tv = dev.timeline_value
    with pytest.raises(ValueError, match=r"launch plan: signal_at is not an int in \[0, "):
        prg(buf, vals=(1,))
    assert dev.timeline_value == tv
    dev.allocator.free(buf, 256, SPEC)


def test_a_program_without_a_plan_launches_on_the_checked_path(dev, monkeypatch, python_launches):
    monkeypatch.setattr(packet_queue.LaunchPlan, "build", staticmethod(lambda prg, timed: None))
    prg = dev.compile(ADD, "add")
    buf = dev.allocator.alloc(256, SPEC)
    buf.cpu_view()[:] = bytes(256)
    for _ in range(3): prg(buf, global_size=64, vals=(2,))
    dev.synchronize()
    assert (np.frombuffer(buf.cpu_view().mv, np.int32) == 6).all() and len(python_launches) == 3
    dev.allocator.free(buf, 256, SPEC)


def test_the_state_words_native_code_reads_are_the_devices_state(open_device):
    """hcq.device_state's words are where the device keeps its timeline value, whether it is open and its timeline's
    address: Python's properties and the native runs read and step the same words."""
    from hcq import device_state as ds
    d = open_device()
    words = d._state
    assert (words[ds.TIMELINE_VALUE], words[ds.OPEN], words[ds.TIMELINE_ADDRESS]) == (d.timeline_value, 1, d.timeline_signal.value_addr)
    prg = d.compile(ADD, "add")
    buf = d.allocator.alloc(256, SPEC)
    tv = d.timeline_value
    for _ in range(10): prg(buf, vals=(1,))
    assert words[ds.TIMELINE_VALUE] == d.timeline_value == tv + 10
    d.timeline_value = 77
    assert words[ds.TIMELINE_VALUE] == 77
    d.timeline_value = tv + 10
    d.synchronize()
    # a wrap swaps the timeline signal: the launch words then carry the other one's address
    d.hw_compute_queue_t().wait(d.timeline_signal, d.timeline_value - 1).signal(d.timeline_signal, (1 << 31) + 4).submit(d)
    d.timeline_value = (1 << 31) + 5
    d.synchronize()
    assert words[ds.TIMELINE_ADDRESS] == d.timeline_signal.value_addr and words[ds.TIMELINE_VALUE] == 1
    prg(buf, vals=(1,))
    d.synchronize(timeout=10_000)
    assert d.timeline_signal.value == 1
    d.close()
    assert words[ds.OPEN] == 0
    with pytest.raises(hcq.HCQError, match=r"was closed \(dev.close\(\)\)"):
        prg(buf, vals=(1,))


@pytest.mark.skipif(not hotpath.available(), reason=f"extension not in use: {hotpath.why_not}")
def test_the_native_state_refuses_words_of_another_layout(dev):
    from hcq import device_state as ds
    from array import array
    for bad in (array("Q", bytes(8 * (ds.WORDS + 1))), array("q", bytes(8 * ds.WORDS)), bytearray(8 * ds.WORDS)):
        with pytest.raises(ValueError, match=f"array\\('Q'\\) of {ds.WORDS} words"):
            hotpath.device_state(dev, bad, set())
    assert dev.native_state() is dev.native_state()  # made once


def test_every_name_the_extension_reads_is_there(dev):
    """hcq/_hotpath.c reads some attributes of hcq's objects by name: each one must exist on an object of the kind it is
    read from, so a rename in Python fails here instead of silently turning a native path off."""
    import re
    from hcq import HCQGraph, ExecItem, lifetimes
    source = (ROOT_HCQ / "_hotpath.c").read_text()
    body = source[source.index("static int intern_all(void)"):]
    names = set(re.findall(r'\{&s_\w+, "(\w+)"\}', body[:body.index("};")]))
    names |= set(re.findall(r'GetAttrString\(\w+, "(\w+)"\)', source))
    names |= set(re.findall(r'plan_(?:int|tuple)\(\w+, "(\w+)"', source))
    keywords = {"global_size", "local_size", "vals", "wait", "timeout", "append"}  # call keywords and list.append
    prg = dev.compile(ADD, "add")
    buf = dev.allocator.alloc(256, SPEC)
    prg(buf, vals=(1,))
    q = dev.hw_compute_queue_t().signal(dev.new_signal(), 1)
    q.submit(dev)
    g = HCQGraph([ExecItem(prg, (buf,), (1,), 1)])
    g()
    objects = [dev, buf, dev.kernargs_allocator, dev.ring("compute", 0), q, g, dev.timeline_signal, dev.allocator, prg,
               dev.fast_launch, LaunchPlan.build(prg, False), prg.kernargs_layout(), buf.view, g._run_plan,
               prg.kernargs_layout().values_packer[0]]
    missing = sorted(n for n in names - keywords if not any(hasattr(o, n) for o in objects))
    assert not missing, f"hcq/_hotpath.c reads {missing}, which no hcq object has (renamed?)"
    assert isinstance(dev.ring("compute", 0), lifetimes.Ring)
    g.synchronize()
    dev.allocator.free(buf, 256, SPEC)


def test_a_graph_run_plan_holds_only_for_what_it_noted(open_device):
    """RunPlan.holds is the rule for a run that changes only the per-run values: the same input objects, live, the same
    variables, the devices open on the same timeline signals, validation off."""
    from hcq import ExecItem, HCQGraph, Variable
    d = open_device()
    prg = d.compile(ADD, "add")
    a, b, spare = (d.allocator.alloc(256, SPEC) for _ in range(3))
    g = HCQGraph([ExecItem(prg, (a,), (Variable("v", 0, 9),), 64)], inputs=(a,))
    g((a,), {"v": 1})
    plan = g._run_plan
    assert plan is not None and plan.inputs == (a,) and plan.user_vals == {"v": 1}
    assert plan.holds(g.devices, (a,), {"v": 1})
    assert not plan.holds(g.devices, (b,), {"v": 1}) and not plan.holds(g.devices, (a,), {"v": 2}) and not plan.holds(g.devices, (), {"v": 1})
    d.allocator.free(spare, 256, SPEC)  # a free elsewhere: the inputs are looked at again, and still hold
    assert plan.holds(g.devices, (a,), {"v": 1}) and plan.frees == hcq.lifetimes.FREES[0]
    was = hcq.validation.enabled
    hcq.validation.set_enabled(True)
    try:
        assert not plan.holds(g.devices, (a,), {"v": 1})
    finally:
        hcq.validation.set_enabled(was)
    g.synchronize()
    d.allocator.free(a, 256, SPEC)
    assert not plan.holds(g.devices, (a,), {"v": 1})
    with pytest.raises(ValueError, match="freed"):
        g((a,), {"v": 1})
    d.allocator.free(b, 256, SPEC)


def test_both_graph_runs_follow_the_plan_and_a_free_elsewhere_keeps_it(open_device, monkeypatch):
    """After one run through Python, replays with the same inputs and variables follow the plan (natively where the
    extension is); freeing an unrelated buffer re-checks the inputs without leaving the fast run; new values make a
    new plan."""
    from hcq import ExecItem, HCQGraph, Variable
    d = open_device()
    prg = d.compile(ADD, "add")
    a = d.allocator.alloc(256, SPEC)
    a.cpu_view()[:] = bytes(256)
    g = HCQGraph([ExecItem(prg, (a,), (Variable("v", 0, 9),), 64)], inputs=(a,))
    general = []
    real = HCQGraph._patch_and_submit
    monkeypatch.setattr(HCQGraph, "_patch_and_submit", lambda self, *args: (general.append(self._fast_patch(*args[:2]) is None), real(self, *args))[1])
    g((a,), {"v": 1})
    first = g._run_plan
    for _ in range(20):
        d.allocator.free(d.allocator.alloc(64, SPEC), 64, SPEC)  # frees elsewhere
        g((a,), {"v": 1})
    g((a,), {"v": 2})
    g.synchronize()
    assert (np.frombuffer(a.cpu_view().mv, np.int32) == 21 + 2).all()
    assert g._run_plan is not first and g._run_plan.user_vals == {"v": 2}
    # through Python: the first run and the one with new values; the other 20 natively (or, without the extension,
    # through Python's fast patch, which follows the same plan)
    assert len(general) == (2 if hotpath.available() else 22) and sum(general) == 2
    d.allocator.free(a, 256, SPEC)


def test_graph_runs_keep_their_state_in_the_run_state_words_and_python_catches_up(open_device):
    """A graph's kickoff value and last-run mark live in its run state words (hcq.graph_state), which the native run
    advances in place; the Python bookkeeping of the per-run values (the last values, each queue's patched words) catches
    up from them before Python patches again, so a general patch after native runs writes every word it must."""
    from hcq import ExecItem, HCQGraph, Variable, graph_state
    d = open_device()
    prg = d.compile(ADD, "add")
    a = d.allocator.alloc(256, SPEC)
    a.cpu_view()[:] = bytes(256)
    g = HCQGraph([ExecItem(prg, (a,), (Variable("v", 0, 9),), 64)], inputs=(a,))
    for _ in range(5): g((a,), {"v": 1})  # the first through Python, the others natively where the extension is
    g.synchronize()
    marks = g._marks
    assert g.kickoff_value == marks[graph_state.KICKOFF] == 5
    [(sig, value)] = g._last_run
    assert sig is d.timeline_signal and marks[graph_state.LAST_RUN] == sig.value_addr
    assert value == marks[graph_state.LAST_RUN + 1] == d.timeline_value - 1 and sig.value >= value
    g._catch_up()
    q = next(iter(g.queues.values()))
    words = q._q.mv
    for i, (idx, _) in enumerate(q.q_sints):
        assert q._prev_q[i] == words[idx], (i, idx)  # the bookkeeping is what the words hold
    assert g._run_var_vals[g._kickoff_name] == 5 == q._last_var_vals[g._kickoff_name]
    g._catch_up()  # (idempotent)
    g((a,), {"v": 2})  # new values: a general patch through Python
    g((a,), {"v": 2})
    g.synchronize()
    assert (np.frombuffer(a.cpu_view().mv, np.int32) == 5 + 4).all()
    assert g.kickoff_value == 7 and g._last_run[0][1] == d.timeline_value - 1
    d.allocator.free(a, 256, SPEC)


@pytest.mark.skipif(not hotpath.available(), reason=f"extension not in use: {hotpath.why_not}")
def _gated_queue_submitted_once(dev):
    """(gate, done, q, ring, count): q waits for `gate` to reach Variable v, then signals `done` with v; submitted once
    (checked) with v=0 as the ring's submission `count`."""
    if not hotpath.available(): pytest.skip(f"extension not in use: {hotpath.why_not}")
    gate, done = dev.new_signal(value=0), dev.new_signal(value=0)
    v = Variable("v", 0, 1000)
    q = dev.hw_compute_queue_t().wait(gate, v).signal(done, v)
    q.submit(dev, {"v": 0})
    ring = dev.ring("compute")
    return gate, done, q, ring, ring.count


def test_a_native_resubmit_advances_the_fence_words_and_holds_what_it_references(dev):
    """A native re-submit numbers its submission from the ring's count word and advances it with the queue's last fence
    word (the words Ring.note writes), and holds the queue's keepalive itself instead of adding a ring entry per
    submission: the queue's signal stays alive while the re-submission waits in the ring, even once the queue and its
    re-submit are gone (Ring.held_by hands the keepalive to the ring), and goes once the fence passes."""
    gate, done, q, ring, count = _gated_queue_submitted_once(dev)
    assert q._last_fence == (ring, count) and ring.inflight and ring.inflight[-1][0] == count
    ring.fence.wait(count, timeout=10_000)
    ring.retire()
    assert not ring.inflight
    q.submit(dev, {"v": 1})  # waits for the gate in the ring
    assert q._native is not None and ring.count == count + 1 and q._last_fence == (ring, count + 1)
    assert not ring.inflight, "the native re-submit added a ring entry"
    alive = weakref.ref(done)
    del q, done
    gc.collect()
    assert alive() is not None, "the signal a submission in the ring writes was let go with its queue"
    assert [c for c, _ in ring.inflight] == [count + 1]
    gate.value = 1
    ring.fence.wait(count + 1, timeout=10_000)
    ring.retire()
    gc.collect()
    assert alive() is None and not ring.inflight


def test_a_queue_re_submitted_natively_then_sent_to_another_device_keeps_its_references_for_both(open_device):
    """A native re-submit hands what it held to the ring it submitted to, until that ring's fence passes its own last
    submission, not the queue's last fence (which, once the queue went to another device, is the other ring's number):
    re-submissions waiting on device A keep the queue's signal alive after the queue moved to B and was dropped."""
    a, b = open_device(), open_device()
    gate, done, q, ring_a, first = _gated_queue_submitted_once(a)
    ring_a.fence.wait(first, timeout=10_000)
    for i in range(1, 5): q.submit(a, {"v": i})  # native, each waiting for the gate
    assert ring_a.count == first + 4 and [c for c, _ in ring_a.inflight] in ([], [first])
    q.submit(b, {"v": 0})  # the checked path, to B: A's re-submit goes
    assert q._last_fence == (b.ring("compute"), b.ring("compute").count)
    alive = weakref.ref(done)
    del q, done
    gc.collect()
    assert alive() is not None, "the signal A's waiting submissions write was let go"
    assert max(c for c, _ in ring_a.inflight) == first + 4
    gate.value = 4
    ring_a.fence.wait(first + 4, timeout=10_000)
    b.ring("compute").fence.wait(b.ring("compute").count, timeout=10_000)
    ring_a.retire()
    b.ring("compute").retire()
    gc.collect()
    assert alive() is None and not ring_a.inflight


def test_native_launches_take_kernargs_blocks_as_the_rings_alloc_does(open_device, monkeypatch):
    """The extension takes a kernargs block inside the ring's current segment itself (entering the next segment is
    TimelineRing.alloc's): launches that lap a small ring leave its state words and segment tags as the same sequence of
    alloc calls leaves a twin ring, and the native launch called alloc only to enter a segment."""
    if not hotpath.available(): pytest.skip(f"extension not in use: {hotpath.why_not}")
    from tests.helpers import use_kernargs_ring
    d = open_device()
    ring, twin = (hcq.TimelineRing(1024, d._wait_for_tag, segments=4) for _ in range(2))
    calls = []
    real = hcq.TimelineRing.alloc

    def alloc(self, size, tag, alignment=16):
        if self is ring: calls.append((size, tag))
        return real(self, size, tag, alignment)
    monkeypatch.setattr(hcq.TimelineRing, "alloc", alloc)
    orig = use_kernargs_ring(d, ring)
    try:
        prg = d.compile(ADD, "add")
        buf = d.allocator.alloc(4 * 64, SPEC)
        size = prg.kernargs_layout().size
        for i in range(300):
            tag = d.timeline_value
            prg(buf, global_size=64, vals=(i % 3,))
            twin.alloc(size, tag)
            assert list(ring.state) == list(twin.state), i
        assert list(ring.seg_tags) == list(twin.seg_tags) and ring.lap >= 3
        assert 0 < len(calls) <= 4 * ring.lap + 4, len(calls)  # (about one per segment entered; the rest were the extension's)
        d.synchronize()
        assert struct.unpack_from("<I", bytes(buf.cpu_view()[:4]))[0] == sum(i % 3 for i in range(300))
        d.allocator.free(buf, buf.size, SPEC)
    finally:
        use_kernargs_ring(d, orig)


def test_buffer_bindings_travel_as_a_checked_record():
    """A program's BufferBindings (buffers bound with their sizes, as Vulkan's storage buffers are) go over the wire as
    four ints; a malformed record is refused, naming it; `problem` says why a buffer cannot be bound."""
    from hcq.program import BufferBindings
    b = BufferBindings(2, 24, 16, 1 << 20)
    assert BufferBindings.from_wire(b.to_wire()) == b and BufferBindings.from_wire(None) is None
    for bad in ([2, 24, 16], [0, 24, 16, 0], [2, 24, 0, 0], [2, -8, 16, 0], [2, 24.0, 16, 0], [True, 24, 16, 0], "2,24,16,0"):
        with pytest.raises(ValueError, match="buffer bindings must be"):
            BufferBindings.from_wire(bad)

    class Buf:
        def __init__(self, va_addr, size): self.va_addr, self.size = va_addr, size
    assert b.problem(Buf(0x1000, 64)) is None and b.problem(Buf(0x1000, 0)).startswith("is empty")
    assert "maxStorageBufferRange" in b.problem(Buf(0x1000, (1 << 20) + 1)) and "minStorageBufferOffsetAlignment" in b.problem(Buf(0x1004, 64))
