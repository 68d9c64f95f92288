"""The hcq packet format: the one definition of what a queue of encoded commands looks like, shared by the
core's `PacketQueue` (which encodes) and every executor that runs packets (the CPU device's command processor
gets its C header from `c_header()`, so the two sides cannot drift apart).

A packet is a run of 64-bit words: a header word, then operands. Header bits 0-7 hold the opcode, 8-15 the
packet's length in words (header included), 16-23 flags, 24-27 the condition of a POLL.

    WAIT      [hdr, signal address, value]                   until *signal >= value (64-bit)
    SIGNAL    [hdr, signal address, value]                   *signal = value, once earlier packets finished
    TIMESTAMP [hdr, address]                                 *address = device time in ns
    BARRIER   [hdr]                                          earlier writes visible to every agent
    EXEC      [hdr, entry, kernargs, gx, gy, gz, lx, ly, lz] run a kernel over a grid
    COPY      [hdr, dest, src, nbytes (, guard address)]     copy bytes; with FLAG_GUARD cancellable
    WRITE     [hdr, address, value]                          32-bit store (64-bit with FLAG_B64)
    POLL      [hdr, address, value, mask]                    until the condition holds (see PollCondition)
    INDIRECT  [hdr, address, nwords]                         run nwords of packets from memory

WAIT and SIGNAL on 16-byte signals carry FLAG_SIGNAL: an executor whose device failed still stores such
signals (so nothing waits forever on dropped work) but tags the signal's timestamp word with
POISON_TAG | device id, and a WAIT released by a poisoned value fails its own device too."""
from __future__ import annotations

import enum
from pathlib import Path
from typing import Callable, Mapping

WORD_BITS = 64
WORD_BYTES = WORD_BITS // 8
WORD_MAX = (1 << WORD_BITS) - 1
SIGNAL_SIZE = 16  # a signal: 64-bit value at +0, 64-bit timestamp at +8
SIGNAL_TIMESTAMP_OFFSET = 8
RING_HEADER = Path(__file__).with_name("ring.h")  # a submission ring's producer side, for the C executors that own rings (cp.c, vk.c)
RELAX_HEADER = Path(__file__).with_name("relax.h")  # cpu_relax(), the pause inside a spin-wait loop, for native code that spins


class Op(enum.IntEnum):
    WAIT = 1
    SIGNAL = 2
    TIMESTAMP = 3
    BARRIER = 4
    EXEC = 5
    COPY = 6
    WRITE = 7
    POLL = 8
    INDIRECT = 9


class PollCondition(enum.IntEnum):
    """What a POLL waits for, with v the polled word: the conditions command processors offer (NVIDIA's semaphore
    acquire has GEQ, EQ, AND and NOR; AMD's WAIT_REG_MEM has masked EQ)."""
    EQ = 0   # (each one's test: POLL_TESTS below)
    GEQ = 1
    AND = 2
    NOR = 3


FLAG_B64 = 1     # WRITE / POLL: the word is 64-bit (else 32-bit)
FLAG_SIGNAL = 2  # WAIT / SIGNAL: the address is a 16-byte signal (poison is checked / set)
FLAG_GUARD = 4   # COPY: a fifth word holds the address of a guard word that makes the copy cancellable
# A store hook's flag (hcq.interfaces.HostStores), not a packet's: with FLAG_SIGNAL, `value` is the value to forward
# (else the hook reads the word itself, under its own lock, so two threads' stores reach a follower in order).
HOOK_VALUE = 0x100

# Packet lengths in words (header included); COPY with FLAG_GUARD has one more.
PACKET_WORDS = {Op.WAIT: 3, Op.SIGNAL: 3, Op.TIMESTAMP: 2, Op.BARRIER: 1, Op.EXEC: 9, Op.COPY: 4, Op.WRITE: 3, Op.POLL: 4,
                Op.INDIRECT: 3}
EXEC_DIMS_AT = 3  # EXEC: the six launch dims start at this word

# The guard word of a cancellable copy: the executor moves it from PENDING to RUNNING before it touches memory and
# to DONE after; the host cancels by moving it from PENDING to CANCELLED. Whoever moves it off PENDING first wins.
GUARD_PENDING, GUARD_RUNNING, GUARD_CANCELLED, GUARD_DONE = range(4)

POISON_MASK = 0xFFFF << 48  # the timestamp word of a signal stored by a failed device: POISON_TAG | device id
POISON_TAG = 0xDEAD << 48


def header(op: Op, nwords: int | None = None, flags: int = 0, cond: PollCondition = PollCondition.EQ) -> int:
    """A packet's header word."""
    n = PACKET_WORDS[op] + (1 if op == Op.COPY and flags & FLAG_GUARD else 0) if nwords is None else nwords
    return int(op) | (n << 8) | (flags << 16) | (int(cond) << 24)


def decode_header(word: int) -> tuple[Op | int, int, int, int]:
    """(opcode, length in words, flags, poll condition) of a header word; an unknown opcode stays an int."""
    op = word & 0xFF
    return (Op(op) if op in Op._value2member_map_ else op), (word >> 8) & 0xFF, (word >> 16) & 0xFF, (word >> 24) & 0xF


def first_packet(words: list[int]) -> list[int]:
    """The packet at the start of `words` (a report of a running packet may hold fewer words than its length)."""
    return words[:max(1, min(len(words), decode_header(words[0])[1]))]


# What each POLL condition tests, once, in the syntax Python and C share (every `&`, `|` and `~` in parentheses: their
# precedence against `==` differs between the two). v: the polled word; full: the word's width as a mask. Everything
# is cut to the word's width, so a 32-bit POLL given a value or mask above 32 bits means the same on every executor.
# `poll_holds` runs these expressions, and `c_header` writes the same text into hcq_poll_holds for the C executors.
POLL_TESTS: dict[PollCondition, str] = {
    PollCondition.EQ: "((v & mask) & full) == (value & full)",
    PollCondition.GEQ: "(v & full) >= (value & full)",
    PollCondition.AND: "((v & value) & full) != 0",
    PollCondition.NOR: "(~(v | value) & full) != 0",
}
assert set(POLL_TESTS) == set(PollCondition), "every POLL condition needs its test"
_POLL_RUNS: dict[int, Callable[[int, int, int, int], bool]] = {
    int(cond): eval(f"lambda v, value, mask, full: {test}")  # noqa: S307 - the module's own constant expressions
    for cond, test in POLL_TESTS.items()}


def poll_holds(cond: PollCondition, v: int, value: int, mask: int, bits: int = 64) -> bool:
    """Whether a POLL of word `v` is satisfied (the reference for executors written in Python; `c_header` gives C
    executors the same rule as hcq_poll_holds: both run POLL_TESTS)."""
    return _POLL_RUNS[cond](v, value, mask, (1 << bits) - 1)


def describe(words: list[int], kernel_names: Mapping[int, str] | None = None) -> str:
    """A packet as text, e.g. 'WAIT for 0x7f.. >= 5' (for hang reports); `kernel_names` names EXECs by entry."""
    if not words: return "nothing"
    op, n, flags, cond = decode_header(words[0])
    ops = words[1:n]
    if op == Op.WAIT and len(ops) >= 2: return f"WAIT for 0x{ops[0]:x} >= {ops[1]}"
    if op == Op.POLL and len(ops) >= 3:
        what = {int(PollCondition.EQ): f"(v & 0x{ops[2]:x}) == {ops[1]}", int(PollCondition.GEQ): f"v >= {ops[1]}",
                int(PollCondition.AND): f"(v & 0x{ops[1]:x}) != 0", int(PollCondition.NOR): f"~(v | 0x{ops[1]:x}) != 0"}.get(cond, f"condition {cond}")
        return f"POLL of 0x{ops[0]:x} until {what}"
    if op == Op.EXEC and ops:
        kernel = f"kernel {kernel_names[ops[0]]!r}" if kernel_names and ops[0] in kernel_names else f"kernel at entry 0x{ops[0]:x}"
        return f"EXEC of {kernel}" + (f" over {tuple(ops[2:5])} x {tuple(ops[5:8])}" if len(ops) >= 8 else "")
    if op == Op.COPY and len(ops) >= 3: return f"COPY of {ops[2]} bytes 0x{ops[1]:x} -> 0x{ops[0]:x}"
    return op.name if isinstance(op, Op) else f"unknown opcode {op}"


def c_header() -> str:
    """The packet format as C declarations, for executors written in C (prepended to their source at build)."""
    lines = ["/* Generated by hcq.packets.c_header(): the hcq packet format. Do not edit; change hcq/packets.py. */",
             "#include <stdatomic.h>",
             "#include <stdint.h>",
             f"#define HCQ_WORD_BITS {WORD_BITS}",
             f"#define HCQ_SIGNAL_SIZE {SIGNAL_SIZE}",
             f"#define HCQ_SIGNAL_TIMESTAMP_OFFSET {SIGNAL_TIMESTAMP_OFFSET}",
             "enum { " + ", ".join(f"OP_{op.name} = {int(op)}" for op in Op) + ", OP_COUNT };",
             "enum { " + ", ".join(f"POLL_{c.name} = {int(c)}" for c in PollCondition) + f", POLL_COUNT = {len(PollCondition)} }};",
             f"enum {{ FLAG_B64 = {FLAG_B64}, FLAG_SIGNAL = {FLAG_SIGNAL}, FLAG_GUARD = {FLAG_GUARD}, HOOK_VALUE = {HOOK_VALUE} }};",
             f"enum {{ GUARD_PENDING = {GUARD_PENDING}, GUARD_RUNNING = {GUARD_RUNNING}, GUARD_CANCELLED = {GUARD_CANCELLED}, "
             f"GUARD_DONE = {GUARD_DONE} }};",
             f"#define POISON_MASK 0x{POISON_MASK:X}ULL",
             f"#define POISON_TAG 0x{POISON_TAG:X}ULL",
             f"#define EXEC_DIMS_AT {EXEC_DIMS_AT}",
             "static const uint8_t packet_words[OP_COUNT] = {" + ", ".join(f"[OP_{op.name}] = {n}" for op, n in PACKET_WORDS.items()) + "};",
             "static inline uint64_t hdr_op(uint64_t h) { return h & 0xFF; }",
             "static inline uint64_t hdr_words(uint64_t h) { return (h >> 8) & 0xFF; }",
             "static inline uint64_t hdr_flags(uint64_t h) { return (h >> 16) & 0xFF; }",
             "static inline uint64_t hdr_cond(uint64_t h) { return (h >> 24) & 0xF; }",
             "/* A signal's timestamp word tagged POISON_TAG | device id: a failed device stored the value (see POISON_TAG). A",
             "   healthy store clears the tag first (relaxed: the value's release store follows and publishes it). */",
             "static inline int hcq_is_poisoned(uint64_t ts) { return (ts & POISON_MASK) == POISON_TAG; }",
             "static inline uint32_t hcq_poisoner(uint64_t ts) { return (uint32_t)ts; }",
             "static inline void hcq_clear_poison(_Atomic uint64_t *ts) {",
             "  if (hcq_is_poisoned(atomic_load_explicit(ts, memory_order_relaxed))) atomic_store_explicit(ts, 0, memory_order_relaxed);",
             "}",
             "/* Whether a POLL of word v holds (hcq/packets.py's POLL_TESTS, as poll_holds runs them); full: the word's width as",
             "   a mask. A condition outside POLL_TESTS never holds (executors refuse it before they poll). */",
             "static inline int hcq_poll_holds(uint64_t cond, uint64_t v, uint64_t value, uint64_t mask, uint64_t full) {",
             "  (void)mask; (void)full;",
             "  switch (cond) {",
             *(f"    case POLL_{c.name}: return {test};" for c, test in POLL_TESTS.items()),
             "    default: return 0;",
             "  }",
             "}",
             ""]
    return "\n".join(lines)
