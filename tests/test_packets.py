"""The packet format is defined once (hcq/packets.py): headers round-trip, the C side is generated from it (cp.c
defines none of it), describe() reads packets for hang reports, and the POLL conditions mean what they say on the
CPU device's command processor."""
import pathlib
import random
import re

import pytest

import hcq
from hcq import packets
from hcq.backends.cpu import native
from hcq.packets import FLAG_B64, FLAG_GUARD, Op, PollCondition, decode_header, header


@pytest.mark.parametrize("op", list(Op))
def test_header_round_trips(op):
    h = header(op, flags=FLAG_B64, cond=PollCondition.NOR)
    assert decode_header(h) == (op, packets.PACKET_WORDS[op], FLAG_B64, PollCondition.NOR)
    assert decode_header(header(Op.COPY, flags=FLAG_GUARD))[1] == packets.PACKET_WORDS[Op.COPY] + 1


def test_c_side_is_generated_not_copied():
    cp = pathlib.Path(native.__file__).with_name("cp.c").read_text()
    assert not re.search(r"\bOP_WAIT\s*=|\bFLAG_B64\s*=|POISON_TAG\s+0x|\bSUBMIT_OK\s*=", cp), "cp.c must take the packet format from hcq_shared.h"
    source = native.cp_source()
    for op in Op: assert f"OP_{op.name} = {int(op)}" in source
    for c in PollCondition: assert f"POLL_{c.name} = {int(c)}" in source
    assert '#include "hcq_shared.h"' not in source


def test_c_files_restate_no_rule_of_the_packet_format_or_the_protocol():
    """The poll conditions, the poison tag and the remote protocol's numbers have one definition each (the generated
    headers): no C file spells a condition's test, the tag's test or a message number itself."""
    root = pathlib.Path(hcq.__file__).parent
    sources = {p.name: p.read_text() for p in (root / "backends" / "cpu" / "cp.c", root / "backends" / "vk" / "vk.c", root / "backends" / "remote" / "serve.c",
                                               root / "_hotpath.c")}
    for name, text in sources.items():
        assert not re.search(r"case\s+POLL_\w+\s*:", text), f"{name} restates a POLL condition (use hcq_poll_holds)"
        assert not re.search(r"(POISON_MASK|poison_mask)\)\s*[!=]=\s*(POISON_TAG|\w*->poison_tag)", text), f"{name} restates the poison test (use hcq_is_poisoned)"
    assert '#include "hcq_packets.h"' in sources["_hotpath.c"]  # (setup.py writes it from packets.c_header())
    serve = sources["serve.c"]
    assert not re.search(r"#define\s+HS_(SUBMIT|STORE|PUSH|WAKE|SYNC|RING_WORDS|FLAG_SIGNAL|POISON_\w+|STORE_\w+)\s", serve), \
        "serve.c restates the protocol (hcq.backends.remote.protocol.c_header generates it)"
    assert "HS_SUBMIT_CLOSED = 16" not in serve
    from hcq.backends.remote import protocol
    header = protocol.c_header()
    assert f"#define HS_SUBMIT {protocol.SUBMIT}" in header and f"HS_SUBMIT_CLOSED = {protocol.FIRST_CLIENT_SUBMIT_STATUS}" in header
    assert "hcq_poll_holds" in packets.c_header() and "hcq_is_poisoned" in packets.c_header()


@pytest.mark.parametrize("cond", list(PollCondition))
def test_the_c_poll_rule_is_the_python_one(cond, tmp_path):
    """hcq_poll_holds (C, generated) and packets.poll_holds (Python) agree on every condition, width and edge value."""
    from hcq.toolchain import build_shared_object
    import ctypes
    src = packets.c_header() + "\nint holds(uint64_t c, uint64_t v, uint64_t value, uint64_t mask, uint64_t full) { return hcq_poll_holds(c, v, value, mask, full); }\n"
    lib = ctypes.CDLL(str(build_shared_object(src, ("-O2", "-std=c11"), "hcq-poll-rule-test")))
    lib.holds.restype, lib.holds.argtypes = ctypes.c_int, [ctypes.c_uint64] * 5
    edges = [0, 1, 2, 3, 0x7F, 0xFF, 0xFFFF_FFFF, 0x1_0000_0000, 0x1_0000_0005, 2**63, 2**64 - 1]
    rng = random.Random(int(cond))
    randoms = [rng.getrandbits(64) for _ in range(12)]
    for bits in (32, 64):
        full = (1 << bits) - 1
        for v in edges + randoms:
            for value in edges + randoms:
                for mask in (full, 0xFF, 0, 2**64 - 1, randoms[0]):  # (values and masks past a 32-bit word are cut to it)
                    vv = v & full  # (the word read has the POLL's width)
                    assert bool(lib.holds(int(cond), vv, value, mask, full)) == packets.poll_holds(cond, vv, value, mask, bits), (cond, bits, vv, value, mask)
    assert packets.poll_holds(PollCondition.EQ, 5, 2**32 + 5, 2**40 - 1, bits=32)  # (the low 32 bits, as every executor reads them)
    assert not packets.poll_holds(PollCondition.EQ, 5, 2**32 + 5, 2**40 - 1, bits=64)


def test_describe_reads_packets():
    assert packets.describe([header(Op.WAIT), 0x1000, 5]) == "WAIT for 0x1000 >= 5"
    assert "(v & 0xff) == 3" in packets.describe([header(Op.POLL), 0x20, 3, 0xFF])
    assert packets.describe([header(Op.POLL, cond=PollCondition.GEQ), 0x20, 3, 2**32 - 1]).endswith("v >= 3")
    assert packets.describe([0x7F]) == "unknown opcode 127"


@pytest.mark.parametrize("cond,word,value,mask,holds", [
    (PollCondition.EQ, 0x1234, 0x34, 0xFF, True), (PollCondition.EQ, 0x1234, 0x35, 0xFF, False),
    (PollCondition.GEQ, 7, 7, None, True), (PollCondition.GEQ, 6, 7, None, False),
    (PollCondition.AND, 0b1010, 0b0010, None, True), (PollCondition.AND, 0b1010, 0b0101, None, False),
    (PollCondition.NOR, 0b1010, 0b0101, None, True), (PollCondition.NOR, 2**32 - 1, 0, None, False)])
def test_poll_conditions_on_the_command_processor(dev, cond, word, value, mask, holds):
    assert packets.poll_holds(cond, word, value, 2**32 - 1 if mask is None else mask, bits=32) == holds
    buf = dev.allocator.alloc(64, hcq.BufferSpec(cpu_access=True))
    buf.cpu_view().view(0, 4, "I")[0] = word
    done = dev.new_signal(value=0)
    q = dev.hw_compute_queue_t().poll_bit(buf, value, mask, cond=cond).signal(done, 1)
    q.submit(dev)
    if holds:
        done.wait(1, timeout=5000)
    else:
        with pytest.raises(hcq.HCQTimeoutError):
            done.wait(1, timeout=100)
        buf.cpu_view().view(0, 4, "I")[0] = value if cond != PollCondition.NOR else 0  # now it holds
        done.wait(1, timeout=5000)
    dev.allocator.free(buf, 64, hcq.BufferSpec(cpu_access=True))


@pytest.mark.parametrize("kind", ["CPU", "VK"])
def test_a_poll_with_an_unknown_condition_fails_the_device(open_device, kind):
    """Raw words (a served client can send any) with a POLL condition outside POLL_TESTS fail the device, naming it,
    rather than waiting on a test no condition defines (hcq_poll_holds holds for none of them)."""
    if kind not in hcq.available_backends(): pytest.skip(f"no {kind} here: {hcq.registry.unavailable_backends().get(kind)}")
    from array import array
    from hcq.packet_queue import publish
    d = open_device(kind)
    buf = d.allocator.alloc(64, hcq.BufferSpec(cpu_access=True))
    publish(d, d.ring("compute", 0), array("Q", [header(Op.POLL) | 7 << 24, buf.va_addr, 0, 2**32 - 1]))
    with pytest.raises(hcq.DeviceError, match="POLL with unknown condition 7"):
        d.hw_compute_queue_t().signal(d.timeline_signal, d.next_timeline()).submit(d)
        d.synchronize(timeout=5000)


def test_poll_bit_refuses_a_mask_where_the_condition_has_none(dev):
    with pytest.raises(ValueError, match="takes no mask"):
        dev.hw_compute_queue_t().poll_bit(0x1000, 1, 0xF, cond=PollCondition.GEQ)
