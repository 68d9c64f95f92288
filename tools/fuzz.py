"""A fuzzer for hcq devices' command queues, with a data oracle (in the spirit of tinygrad's hcqfuzz).

Each program is generated from one integer seed: random signals, waits, timestamps, copies, 32/64-bit writes,
poll_bit, kernel execs (small fixed kernels over uint32 buffers), memory barriers, timeline interplay with the
runtime (program calls, copyin/copyout, transfers, synchronize), host reads, writes and gate openings, and
symbolic queues (Variables in values, addresses, sizes, grid dims, kernargs and signal addresses) submitted
several times with different var_vals, some bound with `q.bind`, over 1..3 devices (KIND:0..KIND:2 with --device
KIND, or of several kinds, --device VK,CPU; CPU by default; or CPU:0..CPU:2 of an `hcq serve`, see "Remote devices"
below) and the queues each has (see "Devices" below). The same program runs in a
pure-Python reference model, and the final contents of every buffer, every signal value, host read-backs made
along the way and the order of timestamps must match.

By construction:
- no deadlock: a queue waits only on a signal value (or a poll only on a flag) that work submitted earlier
  produces, or on a gate the host opens later; the host never blocks on anything behind a closed gate (it opens
  the gates first), and every gate is open before the program ends;
- no data race: every pair of conflicting accesses (a write and any other access to the same 4-byte word) is
  ordered through signals, so the model's answer is the only possible one. The model re-checks this with vector
  clocks while it runs (a violation is reported as a generator bug, never as an hcq bug);
- a queue whose patched words live in memory (bound queues, and queues with symbolic kernargs, which are
  patched in place in the kernargs buffer) is re-submitted only after its previous run finished.

Every host wait runs under a watchdog (`sig.wait(..., timeout=...)`, default 4000 ms without progress). A failing
program prints its seed and a one-line repro.

Three more kinds of work, each on by default at a modest rate (--no-interrupts, --no-graphs, --no-threads turn
them off; with all three off a seed generates exactly the program it generated before they existed). Their
choices come from streams of their own, so programs stay deterministic per seed.

- Interrupts. Some runtime calls of the host's steps (queue submits, program calls, copyin, copyout, transfers,
  synchronize, graph runs, faulting launches) get a SIGINT: armed at the k-th line event inside hcq's code during
  the call (a sys.settrace hook; k from the program) and raised at the next point where Python really runs
  signal handlers (entering a function, a backward jump, after a call into C: see `_Tracer`), or just before or
  right after the call, or sent by a timer thread after a delay (asynchronous, like a real Ctrl-C). hcq defers it
  inside its critical sections. The runner catches the KeyboardInterrupt (it must come out of the call) and
  judges: a submit, launch, transfer or graph run happened whole (the ring's write pointer moved; every timeline
  it steps stepped once) or not at all (then the runner makes the call again); a host copy either did nothing
  or stepped its timeline once, and then its destination ends all-new or, a direct copy cancelled before the
  copy engine began it, all-old: never partly, never written after the exception left. A cancelled copyin is
  left out of the model from then on (the model is re-run with that copy's data skipped); a cancelled copyout
  has nothing to check. Some interrupted host copies have their copy ring held back for HOLD_MS by a queue
  waiting on a signal the runner sets later, so the interrupt finds the copy still waiting and can cancel it.
  Some programs use staged host copies (as HCQ_CPU_DIRECT_COPY=0). hcq's interrupt state must be clean after
  each call, nothing may be left lent to the copy engine, and the devices must go on working.
- Graphs and faults. HCQGraphs over program buffers on 1-3 devices (kernels with Variables, copies and transfers,
  at least one `fz_fault` item whose `fault` Variable makes a chosen block store to a bad address), run several
  times; some runs fault. Such a run (and a plain launch of fz_fault) starts only once everything submitted
  earlier finished; then the faulting device must fail with a DeviceError naming the kernel and block, every
  other device of the graph must fail naming a failed peer (its queues waited on poisoned signals), nothing may
  hang, and other devices must be unaffected. The runner recovers them (dev.recover()), they work again and the
  graph runs again. Graph runs are host steps in the model (the host waits for them); the bytes a faulting run
  may have written are tainted: unknown until rewritten (copies and kernels carry taint from what they read),
  and no check looks at them.
- Threads. A section runs on 2-4 Python threads at once. Each has two private buffers and a chain signal (made
  before the threads start, or by the thread under the lock); it submits its own queues to shared rings (the
  compute and copy rings of every device), each waiting for its previous one, copies from scratch buffers it
  frees right after submitting the copy (through the LRU cache or not; hcq must keep the memory until the copy
  ran), makes program calls, copyins and copyouts, and checks what it reads. What the thread-safety contract
  leaves to the caller (the device timeline, alloc/free, new_signal, fill_kernargs, bind, dropping the last
  reference to a submitted queue) is done under one lock. Afterwards every buffer must hold what the thread's
  sequence of operations gives; the timelines advanced by exactly the calls made.

Devices. Programs adapt to what each device declares (its `Shape`, from its capabilities; without devices to ask,
`generate` takes CPU devices' shapes): a compute queue and up to two copy queues (the Vulkan device has one; the
runtime's host copies use copy queue 0 too); kernels from the first set of sources its compiler takes (C, else GLSL);
EQ polls with a mask only where `poll_mask`; faulting graphs and launches only over devices that recover and whose
fault reports the runner reads (the CPU backend's, also behind the remote one: a Vulkan kernel cannot fault on
purpose, so its fz_fault never does); and one address space per peer group: a ring touches only buffers, flag words
and timestamp signals of its own peer group, and waits on another group's signals only where the runtime makes its
device replicas of them (`dev.replica`: probed for each ordered pair of devices of two groups as they open, with host
copies direct and staged, as a backend's copy mode may decide it: `Shape.replicas`); transfers and graphs join two
groups only where every device of each waits on the other's signals (the runtime orders them through replicas), the
host reaches every device, and timestamps are compared within a peer group only (each has its own clock). Interrupts
need every device to report its rings' positions (`queue_states`).

Usage:
    python -m tools.fuzz --programs 300 --seed 0          # the bounded slice tests/test_fuzz.py runs
    python -m tools.fuzz --programs 10000 --seed 1        # the long run (about 65 s on 2 cores)
    python -m tools.fuzz --seed 1234 --programs 1 --dump  # one program, printed step by step, then run
    python -m tools.fuzz --programs 1000 --validate        # with HCQ_VALIDATE's checks on (no false alarms allowed)
    python -m tools.fuzz --device KIND --programs 300      # on KIND:0..KIND:2 instead of the CPU devices
    python -m tools.fuzz --device VK --devices 1           # on the Vulkan device alone (the driver has one)
    python -m tools.fuzz --device VK,CPU --programs 3000   # on VK:0, CPU:0, CPU:1: transfers and graphs across both
    python -m tools.fuzz --serve tcp --programs 1000       # on CPU:0..2 of an `hcq serve` it starts (tcp, shm, ...)
    python -m tools.fuzz --remote HOST:PORT --programs 300 # on CPU:0..2@HOST:PORT (served with HCQ_CPU_COPY_ENGINES=3)
    python -m tools.fuzz --device VK,CPU --serve shm       # a local VK:0 beside CPU:0 and CPU:1 of the server
    python -m tools.fuzz --device VK --serve-kind VK --serve tcp --devices 1   # VK:0 of an `hcq serve --devices VK:0`
Program i of a run uses seed S + i, so `--seed S+i --programs 1` replays it alone (the repro line a failure
prints carries the feature flags it ran with, and where it ran). The run ends with counts of what the features did.

Remote devices (`CPU:i@HOST:PORT`, hcq's remote backend; UCX needed). `--serve TRANSPORT` starts an `hcq serve` on
loopback for the run and stops it at the end, with the transports of hcq.bench.remote (tcp: UCX_TLS=tcp for both
and HCQ_REMOTE_SHARE=0 in this process, runtime memory mirrored by messages as between hosts; shm: UCX's choice on
one host, runtime memory shared; shm-messages; shm-one-process); `--remote HOST:PORT` uses a running one (the
repro line then carries this process's UCX_TLS and HCQ_REMOTE_SHARE). Their memory has no host view, so the
oracle's host reads and writes (initial contents, host checks and writes, the threads' own, the final check) are
copies on the device's last copy queue, which the programs then never use, through a staging buffer the host sees
(`_Staged`): such a copy waits on nothing, so it runs while the programs' rings wait on gates the host opens later
(where a synchronize, hence allocator.copyout, would deadlock). `--serve` starts its devices with
HCQ_CPU_COPY_ENGINES=3 (two copy queues for the programs, one for the oracle); a device without a host view and with
one copy queue is refused. Every feature runs there: interrupts (ring
positions come from the server), faulting graphs and launches (the server's command processor is the CPU
backend's, and its reports name a peer as its clients name it), threads. The programs' host copies
(at most 64 bytes) go through a remote device's staging ring: an interrupted copyin whose timeline stepped must
land in full, and an interrupted copyout is found cancelled only where its host side never ran.

The runner also looks at what only hcq's own backends show (ring write pointers, staged copies, recovery, the texts
of their fault reports): each such use is one helper under "device internals" below, and `_backend` is the one
place that asks which backend a device belongs to. Where a device does not show them, interrupts and faults are
left out (see "Devices").
"""
from __future__ import annotations

import argparse
import contextlib
import dis
import importlib.util
import os
import signal
import struct
import subprocess
import sys
import threading
import time
import traceback
from collections import Counter, deque
from dataclasses import dataclass, field, replace
from random import Random
from typing import Any, Callable, Mapping

M32, M64 = (1 << 32) - 1, (1 << 64) - 1
HOST = -1  # the host's agent id (rings are 0..R-1)
DATA_BUFS, DATA_WORDS, FLAG_SLOTS = 3, 64, 16
BIG = (4 << 20) + (64 << 10)  # big buffers: copies >= 4 MiB take the split (two-thread) copy path
DEFAULT_TIMEOUT_MS = 4000

KERNELS = r"""
HCQ_KERNEL void fz_add(unsigned *out, const unsigned *a, const unsigned *b, int n) { long i = hcq_global_id(0); if (i < n) out[i] = a[i] + b[i]; }
HCQ_KERNEL void fz_scale(unsigned *out, const unsigned *a, unsigned k, int n) { long i = hcq_global_id(0); if (i < n) out[i] = a[i] * k; }
HCQ_KERNEL void fz_fill(unsigned *out, unsigned v, int n) { long i = hcq_global_id(0); if (i < n) out[i] = v + (unsigned)i; }
HCQ_KERNEL void fz_inc(unsigned *out, unsigned c, int n) { long i = hcq_global_id(0); if (i < n) out[i] += c; }
HCQ_KERNEL void fz_nd(unsigned *out, unsigned v, int w, int h, int d) {
  long x = hcq_global_id(0), y = hcq_global_id(1), z = hcq_global_id(2);
  if (x < w && y < h && z < d) { unsigned idx = (unsigned)((z * h + y) * w + x); out[idx] = v ^ (idx * 2654435761u); }
}
HCQ_KERNEL void fz_fault(unsigned *out, const unsigned *a, unsigned k, int fault, int n) {
  long i = hcq_global_id(0);
  if (fault && hcq_group_id(0) == (fault - 1) / 2) {  /* odd: a store to address 16; even: 4 TiB past out */
    if (fault & 1) *(volatile unsigned *)16 = 1; else *(volatile unsigned *)(out + (1L << 40)) = 1;
  }
  if (i < n) out[i] = a[i] * k + 1u;
}
"""
# The same kernels in GLSL (Vulkan compute shaders: the parameters are an argument struct behind the push constant, see
# docs/kernels.md), for devices whose compiler takes GLSL. A Vulkan kernel cannot fault on purpose (a bad buffer reference
# is a crash of the process on lavapipe): fz_fault computes a[i] * k + 1 whatever `fault` says, and runs only with
# `fault` 0 (faulting graphs and launches run only on devices whose Shape says they can fault).
_GLSL = """#version 460
#extension GL_EXT_buffer_reference : require
layout(local_size_x_id = 0, local_size_y_id = 1, local_size_z_id = 2) in;
layout(buffer_reference, std430, buffer_reference_align = 4) buffer U32 { uint v[]; };
layout(buffer_reference, std430, buffer_reference_align = 4) readonly buffer RO { uint v[]; };
layout(buffer_reference, std430, buffer_reference_align = 8) readonly buffer Args { %s; };
layout(push_constant) uniform Push { Args args; };
void main() { int i = int(gl_GlobalInvocationID.x); %s }
"""
GLSL_KERNELS = {name: _GLSL % body for name, body in {
    "fz_add": ("U32 out_; RO a; RO b; int n", "if (i < args.n) args.out_.v[i] = args.a.v[i] + args.b.v[i];"),
    "fz_scale": ("U32 out_; RO a; uint k; int n", "if (i < args.n) args.out_.v[i] = args.a.v[i] * args.k;"),
    "fz_fill": ("U32 out_; uint v; int n", "if (i < args.n) args.out_.v[i] = args.v + uint(i);"),
    "fz_inc": ("U32 out_; uint c; int n", "if (i < args.n) args.out_.v[i] += args.c;"),
    "fz_nd": ("U32 out_; uint v; int w; int h; int d",
              "int y = int(gl_GlobalInvocationID.y), z = int(gl_GlobalInvocationID.z);\n"
              "  if (i < args.w && y < args.h && z < args.d) { uint idx = uint((z * args.h + y) * args.w + i); args.out_.v[idx] = args.v ^ (idx * 2654435761u); }"),
    "fz_fault": ("U32 out_; RO a; uint k; int fault; int n", "if (i < args.n) args.out_.v[i] = args.a.v[i] * args.k + 1u;"),
}.items()}
# name -> (number of buffers, names of the values); the last value of the 1-D kernels is n
KERNEL_SIGS = {"fz_add": (3, ("n",)), "fz_scale": (2, ("k", "n")), "fz_fill": (1, ("v", "n")), "fz_inc": (1, ("c", "n")),
               "fz_nd": (1, ("v", "w", "h", "d"))}
VAL_RANGES = {"n": (0, 32), "k": (0, 7), "v": (0, M32), "c": (0, M32), "w": (1, 6), "h": (1, 4), "d": (1, 2)}
# fz_fault (graphs and faulting launches only; not in KERNEL_SIGS, so the older programs keep their random streams):
# `fault` 0 runs it like a kernel a[i] * k + 1; fault f > 0 makes block (f - 1) // 2 fault (f odd: a store to
# address 16, f even: a store through a pointer far out of range).
ALL_KERNELS = list(KERNEL_SIGS) + ["fz_fault"]
# Kernel sources by language (name -> source): a device runs the first set its compiler takes (`_compile_kernels`).
KERNEL_SOURCES: dict[str, dict[str, str]] = {"C": {name: KERNELS for name in ALL_KERNELS}, "GLSL": GLSL_KERNELS}
# How often the optional features appear (per program, per loop step, per step)
P_GRAPH, P_GRAPH_RERUN, P_GRAPH_FAULT, P_LAUNCH_FAULT = 0.25, 0.3, 0.45, 0.06
P_THREADS = 0.12
P_INTERRUPT, P_STAGED = 0.06, 0.15
INTERRUPTIBLE = ("submit", "prg", "copyin", "copyout", "transfer", "sync", "graph", "pfault")
HOLD_MS = 60  # how long the runner holds a copy ring back under an interrupted host copy (so the interrupt can cancel it)
THREAD_WORDS = 64  # words of each private buffer of a thread
FAULT_RE = "kernel 'fz_fault' faulted in block {block}"


@dataclass(frozen=True)
class Features:
    """What generated programs may contain besides the queue programs (each on by default; CLI --no-...).
    With all three off, a seed generates exactly the program it generated before they existed."""
    interrupts: bool = True  # SIGINT delivered inside runtime calls (the runner judges the outcome)
    graphs: bool = True  # HCQGraphs over 1-3 devices whose fz_fault item faults on some runs, plain faulting launches
    threads: bool = True  # sections run on 2-4 Python threads submitting to shared rings

    def flags(self) -> str:
        """The command-line flags that give these features."""
        return "".join(f" --{f}" for f, on in (("no-interrupts", not self.interrupts), ("no-graphs", not self.graphs),
                                                 ("no-threads", not self.threads)) if on)


DEFAULT_FEATURES = Features()
NO_FEATURES = Features(interrupts=False, graphs=False, threads=False)


@dataclass(frozen=True)
class Shape:
    """What programs use of one device, derived from its capabilities by the runner (`_shape`): a compute queue and
    copy queues 0..copies-1 (the runtime's host copies run on copy queue 0 too); whether kernels fault on it on purpose
    (faulting graphs and launches run only over such devices); whether an EQ poll takes a mask; its address space,
    `group` (devices of one peer group share one: a ring touches only buffers, flags and timestamp signals of its own
    group); and the devices of other groups whose signals its queues wait on through replicas the runtime makes
    (`dev.replica`), probed by the runner (`Runner.probe_replicas`): `replicas` with the program's host copies direct,
    `staged_replicas` with them staged (a backend's copy mode may decide what it reaches). Its queues wait on no other
    group's signals than those; transfers and graphs join two groups only where every device of each waits on the
    other's signals (the runtime orders them through replicas); the host reaches every device. `pulls`: the devices
    whose transfers into this one run on this one's copy engine (`hcq.allocator.copy_engine`: where they cannot
    reach its memory, it reads theirs), probed by the runner (`Runner.probe_pulls`); `lands`: the devices whose
    transfers into this one land in a buffer of its own that its first copy queue then moves into place (memory its
    host cannot write: `hcq.allocator.landed_view`), probed there too."""
    copies: int = 2
    faults: bool = True
    poll_mask: bool = True
    group: int = 0
    replicas: frozenset[int] = frozenset()
    staged_replicas: frozenset[int] = frozenset()
    pulls: frozenset[int] = frozenset()  # devices a transfer from which runs on this device's copy engine (a pull: they cannot reach its memory)
    lands: frozenset[int] = frozenset()  # devices a transfer from which lands in a buffer this device's first copy queue moves into place


CPU_SHAPE = Shape()  # a CPU device's (hcq's default of two copy engines): what `generate` takes without shapes


def region_words(kname: str) -> int:
    """Words a symbolic exec's buffers are declared with (the most any instance touches), so validation mode
    (HCQ_VALIDATE=1), which checks [address, address + size), accepts them."""
    return 6 * 4 * 2 if kname == "fz_nd" else 32


class GeneratorBug(AssertionError):
    """The generator produced a program that is not deadlock- or race-free (a bug in this module, not in hcq)."""


class FuzzFailure(AssertionError):
    """A program's run disagreed with the model, hung, or raised."""

    def __init__(self, seed: int, what: str, repro: str):
        super().__init__(f"fuzz program seed={seed} failed: {what}\n  repro: {repro}")
        self.seed, self.what, self.repro = seed, what, repro


@dataclass(frozen=True)
class Target:
    """The devices programs run on: KIND:0..KIND:2 of this process or, with `remote` (HOST:PORT), of the `hcq serve`
    there. `kind` may list kinds, KIND,KIND,...: device i is then of the i-th kind listed (the last one repeats),
    numbered within its kind (VK,CPU: VK:0, CPU:0, CPU:1); with a server, its kind (CPU) is the server's and other kinds
    are local (VK,CPU: a local VK:0 beside CPU:0@HOST:PORT, CPU:1@HOST:PORT). `serve`: the transport of a server this run
    started itself (--serve); its repro line starts another."""
    kind: str = "CPU"
    remote: str | None = None
    serve: str | None = None
    served_kind: str = "CPU"  # the kind the server hosts (--serve-kind)

    @staticmethod
    def of(target: Target | str) -> Target:
        """A Target, given one or a kind (or kinds, comma-separated) of local device."""
        return target if isinstance(target, Target) else Target(",".join(k.strip().upper() for k in target.split(",")))

    def device(self, i: int) -> str:
        kinds = self.kind.split(",")
        names = [kinds[min(j, len(kinds) - 1)] for j in range(i + 1)]
        return f"{names[i]}:{names[:i].count(names[i])}" + (f"@{self.remote}" if self.remote and names[i] == self.served_kind else "")

    def flags(self) -> str:
        """The command-line flags that pick these devices."""
        flags = "" if self.kind == "CPU" else f" --device {self.kind}"
        if self.served_kind != "CPU": flags += f" --serve-kind {self.served_kind}"
        if self.serve: return f"{flags} --serve {self.serve}"
        return flags + (f" --remote {self.remote}" if self.remote else "")

    def env(self) -> str:
        """What a repro line sets first: for a running server, the variables that chose this client's transport."""
        if not self.remote or self.serve: return ""
        from hcq.bench.remote import CLIENTS
        return "".join(f"{k}={os.environ[k]} " for k in sorted({k for env in CLIENTS.values() for k in env}) if k in os.environ)


def repro_command(seed: int, devices: int = 3, features: Features = DEFAULT_FEATURES, target: Target | str = "CPU") -> str:
    t = Target.of(target)
    return (f"{t.env()}python -m tools.fuzz --seed {seed} --programs 1{t.flags()}" + ("" if devices == 3 else f" --devices {devices}")
            + features.flags())


def repro_of(prog: Program, target: Target | str = "CPU") -> str:
    return repro_command(prog.seed, prog.max_devices, prog.features, target)


# ====================================================================== program representation
@dataclass
class Buf:
    dev: int
    kind: str  # "data" | "flag" | "big"
    index: int  # index among the device's buffers of that kind
    size: int
    gran: int  # bytes per location the race checker tracks


@dataclass
class Sig:
    kind: str  # "p" (a ring's progress) | "u" (user, one writer ring) | "g" (gate, host-opened) | "t" (timestamp) | "tl" (timeline)
    dev: int
    writer: int | None = None  # ring that writes it ("p", "u")
    full: int = 0  # gates: the value that opens every wait on it


@dataclass
class Template:
    """A symbolic queue: commands whose fields are expression trees over `vars` (name -> (lo, hi)).
    Trees: ("lit", x) ("var", name) ("add", a, b) ("mul", a, k) ("fdiv", a, k) ("mod", a, k).
    Signal refs: ("sig", sid) or ("svar", name) (a virtual signal whose address is a Variable).
    Address refs: ("addr", base, offset tree) with base ("buf", bid) or ("avar", name)."""
    tid: int
    ring: int
    bound: bool
    cmds: list[tuple]
    vars: dict[str, tuple[int, int]]
    instances: int
    drain: bool  # re-submit only after the previous run finished (bound, or kernargs patched in memory)
    asbuf: bool = False  # pass write targets as HCQBuffers with a symbolic address (else as the address itself)


@dataclass
class TState:
    """The generator's progress through a template's instances."""
    t: Template
    plan: list[tuple]
    flags: list[tuple[int, int]]  # flag slots reserved for its flag writes
    ts: list[int]  # timestamp signals reserved for it
    done: int = 0
    last_p: int | None = None
    prev_env: dict[str, Any] = field(default_factory=dict)


@dataclass
class GraphSpec:
    """An HCQGraph over program data buffers. Items: ("exec", dev, kname, regions, vals, gs, ls) with regions
    ((bid, off, nbytes), ...) and vals ("lit", x) | ("var", name); ("copy", dbid, doff, sbid, soff, n, nmax) with n
    ("lit", x) | ("var", name). `faulty`: item indices of fz_fault items (each has a Variable `fault`)."""
    gid: int
    devs: list[int]
    items: list[tuple]
    vars: dict[str, tuple[int, int]]
    faulty: list[int]


@dataclass
class ThreadSpec:
    """One thread of a threaded section: private buffers (device, initial bytes), its chain signal (created before
    the threads start, or by the thread under the lock), its ops, and what its buffers hold at the end."""
    bufs: list[tuple[int, bytes]]
    sig_dev: int
    sig_early: bool
    ops: list[tuple]
    final: list[bytes]
    drop: bool = False  # drop each queue once submitted (else keep it until the section ends)


@dataclass
class Program:
    seed: int
    ndev: int
    rings: list[tuple[int, str, int]]
    bufs: list[Buf]
    sigs: list[Sig]
    init: dict[int, bytes]
    steps: list[tuple] = field(default_factory=list)
    templates: dict[int, Template] = field(default_factory=dict)
    max_devices: int = 3
    features: Features = DEFAULT_FEATURES
    # step index -> k: SIGINT at the k-th line event inside hcq during the step's runtime call (0: before it), or
    # k < 0: SIGINT sent to the main thread by a timer thread -k microseconds after the call began
    interrupts: dict[int, int] = field(default_factory=dict)
    holds: set[int] = field(default_factory=set)  # copyin/copyout steps whose copy ring the runner holds back for HOLD_MS
    staged: bool = False  # host copies go through the staging ring (as HCQ_CPU_DIRECT_COPY=0) for this program
    graphs: dict[int, GraphSpec] = field(default_factory=dict)
    sections: dict[int, list[ThreadSpec]] = field(default_factory=dict)
    shapes: tuple[Shape, ...] = ()  # what the program uses of each of its devices



def ev(t: tuple, env: dict) -> Any:
    """Evaluate an expression tree with ints (the model) or hcq Variables (the runner)."""
    op = t[0]
    if op == "lit": return t[1]
    if op == "var": return env[t[1]]
    if op == "add": return ev(t[1], env) + ev(t[2], env)
    if op == "mul": return ev(t[1], env) * t[2]
    if op == "fdiv": return ev(t[1], env) // t[2]
    if op == "mod": return ev(t[1], env) % t[2]
    raise ValueError(f"bad expression tree {t!r}")


def pad3(dims: tuple) -> tuple:
    return tuple(dims) + (1,) * (3 - len(dims))


def kernel_touch(kname: str, vals: tuple, gs: tuple, ls: tuple) -> list[int]:
    """Word indices (into the output region; inputs use the same indices) the kernel touches."""
    g, l = pad3(gs), pad3(ls)
    t = [g[i] * l[i] for i in range(3)]
    if kname == "fz_nd":
        _, w, h, d = vals
        return [(z * h + y) * w + x for z in range(min(d, t[2])) for y in range(min(h, t[1])) for x in range(min(w, t[0]))]
    return list(range(max(0, min(vals[-1], t[0]))))


def step_actions(prog: Program, step: tuple, idx: int = -1) -> list[tuple]:
    """The model-level actions of a runner-level step (step number `idx`): ("submit", ring, cmds) and host actions
    ("hwait", sid, v), ("hstore", sid, v), ("hcheck", cid, bid, off, n), ("hwrite", bid, off, data),
    ("hgraph", gid, env, fault) (a graph run the host waits for), ("htaint", regions) (a faulting launch)."""
    kind = step[0]
    tl = [i for i, s in enumerate(prog.sigs) if s.kind == "tl"]
    comp = lambda d: prog.rings.index((d, "compute", 0))  # noqa: E731
    copy0 = lambda d: prog.rings.index((d, "copy", 0))  # noqa: E731
    if kind == "submit": return [("submit", step[1], step[2])]
    if kind == "gate": return [("hstore", step[1], step[2])]
    if kind in ("hwait", "hcheck", "hwrite"): return [step]
    if kind == "prg":
        _, d, kname, regions, vals, gs, ls, k = step
        return [("submit", comp(d), [("wait", tl[d], k - 1), ("barrier",), ("exec", kname, regions, vals, gs, ls), ("signal", tl[d], k)])]
    if kind == "copyin":
        _, d, bid, off, data, k = step
        # copyin may return before its copy ran (the staged path does; the direct path waits, the source must outlive it)
        return [("submit", copy0(d), [("wait", tl[d], k - 1), ("hcopyin", bid, off, data, idx), ("signal", tl[d], k)])]
    if kind == "copyout":
        _, cid, d, bid, off, n, k = step
        return [("hwait", tl[d], k - 1), ("submit", copy0(d), [("wait", tl[d], k - 1), ("hcopyout", cid, bid, off, n), ("signal", tl[d], k)]),
                ("hwait", tl[d], k)]
    if kind == "transfer":
        _, sd, dd, dbid, doff, sbid, soff, n, ks, kd_prev, kd, how = step
        if how == "land":  # sd's copy engine writes a landing buffer of dd's; dd's first copy queue moves it into place after ks
            return [("submit", copy0(sd), [("wait", tl[sd], ks - 1), ("wait", tl[dd], kd_prev), ("signal", tl[sd], ks)]),
                    ("submit", copy0(dd), [("wait", tl[sd], ks), ("copy", dbid, doff, sbid, soff, n), ("signal", tl[dd], kd)])]
        if how == "pull":  # dd's copy engine reads sd's memory, then sd's timeline steps after it
            return [("submit", copy0(dd), [("wait", tl[dd], kd - 1), ("wait", tl[sd], ks - 1), ("copy", dbid, doff, sbid, soff, n), ("signal", tl[dd], kd)]),
                    ("submit", comp(sd), [("wait", tl[dd], kd), ("signal", tl[sd], ks)])]
        return [("submit", copy0(sd), [("wait", tl[sd], ks - 1), ("wait", tl[dd], kd_prev), ("copy", dbid, doff, sbid, soff, n), ("signal", tl[sd], ks)]),
                ("submit", comp(dd), [("wait", tl[sd], ks), ("signal", tl[dd], kd)])]
    if kind == "sync":
        _, d, k = step
        return [("hwait", tl[d], k)]
    # The steps below are host-synchronous: the runner waits until their work finished before the next step, so
    # the model runs them as the host, after the timeline values they wait for, and stores the values they signal.
    if kind == "graph":
        _, gid, env, fault, ks = step
        return [("hwait", tl[d], k - 1) for d, k in ks] + [("hgraph", gid, env, fault)] + [("hstore", tl[d], k) for d, k in ks]
    if kind == "pfault":
        _, d, regions, vals, gs, ls, k = step
        return [("hwait", tl[d], k - 1), ("htaint", regions), ("hstore", tl[d], k)]
    if kind == "threads":  # the threads' own buffers and signals are checked by the runner; here only their timeline steps
        _, sec, tls = step
        return [a for d, kb, c in tls for a in (("hwait", tl[d], kb), ("hstore", tl[d], kb + c))]
    raise ValueError(f"unknown step {step!r}")


def graph_cmds(prog: Program, gid: int, env: Mapping[str, int]) -> list[tuple]:
    """A graph run's items as concrete commands ("exec", kname, regions, vals, gs, ls) / ("copy", db, do, sb, so, n),
    in item order (the graph orders conflicting items as they are listed, so this order gives its result)."""
    out = []
    for it in prog.graphs[gid].items:
        if it[0] == "exec":
            _, _, kname, regions, vals, gs, ls = it
            out.append(("exec", kname, regions, tuple(ev(v, env) for v in vals), gs, ls))
        else:
            _, db, do, sb, so, n, _ = it
            out.append(("copy", db, do, sb, so, ev(n, env)))
    return out


def whole_accesses(hb: HB, prog: Program, gid: int) -> list[tuple[list[int], list[int], list[tuple]]]:
    """Per item of a graph: (reads, writes, written regions) over the items' whole regions (what a faulting run may touch)."""
    out = []
    for it in prog.graphs[gid].items:
        if it[0] == "exec":
            regions = it[3]
            out.append(([loc for b, o, n in regions for loc in hb.locs(b, o, n)], hb.locs(*regions[0]), [regions[0]]))
        else:
            _, db, do, sb, so, _, nmax = it
            out.append((hb.locs(sb, so, nmax), hb.locs(db, do, nmax), [(db, do, nmax)]))
    return out


# ====================================================================== happens-before (vector clocks)
class HB:
    """Vector clocks over agents (rings and the host). Data locations record their last write and the reads
    since; sync keys (signals, flag words) record their writes with the writer's clock, and a wait or poll
    acquires the clock of the first write that satisfies it. `access` raises GeneratorBug on a race."""

    def __init__(self, prog: Program):
        self.prog = prog
        self.clock: dict[int, dict[int, int]] = {}
        self.lw: dict[int, tuple[int, int]] = {}
        self.rd: dict[int, dict[int, int]] = {}
        self.sw: dict[Any, list[list]] = {}  # key -> [[value, clock, agent, t, meta], ...]

    def c(self, a: int) -> dict[int, int]:
        c = self.clock.get(a)
        if c is None: c = self.clock[a] = {}
        return c

    def tick(self, a: int) -> int:
        c = self.c(a)
        t = c[a] = c.get(a, 0) + 1
        return t

    def join(self, a: int, other: dict[int, int]) -> None:
        c = self.c(a)
        for k, v in other.items():
            if c.get(k, 0) < v: c[k] = v

    def locs(self, bid: int, off: int, n: int) -> list[int]:
        if n <= 0: return []
        g = self.prog.bufs[bid].gran
        return [bid * 1_000_000 + w for w in range(off // g, (off + n - 1) // g + 1)]

    def uncovered(self, a: int, reads: list[int], writes: list[int], c: dict[int, int] | None = None) -> set[tuple[int, int]]:
        c = self.c(a) if c is None else c
        out = set()
        for loc in reads:
            w = self.lw.get(loc)
            if w is not None and c.get(w[0], 0) < w[1]: out.add(w)
        for loc in writes:
            w = self.lw.get(loc)
            if w is not None and c.get(w[0], 0) < w[1]: out.add(w)
            for ag, t in self.rd.get(loc, {}).items():
                if c.get(ag, 0) < t: out.add((ag, t))
        return out

    def access(self, a: int, reads: list[int], writes: list[int], what: Any) -> int:
        bad = self.uncovered(a, reads, writes)
        if bad: raise GeneratorBug(f"seed {self.prog.seed}: data race: agent {a} {what!r} is not ordered after {sorted(bad)}")
        t = self.tick(a)
        for loc in reads: self.rd.setdefault(loc, {})[a] = t
        for loc in writes:
            self.lw[loc] = (a, t)
            self.rd[loc] = {}
        return t

    def write_sync(self, a: int, key: Any, value: int, meta: Any = None) -> int:
        prev = self.sw.get(key)
        if prev:
            if value <= prev[-1][0] and not (isinstance(key, tuple)):
                raise GeneratorBug(f"seed {self.prog.seed}: signal {key} written {value} after {prev[-1][0]} (values must increase)")
            if self.c(a).get(prev[-1][2], 0) < prev[-1][3]:
                raise GeneratorBug(f"seed {self.prog.seed}: unordered writes to signal {key} by agents {prev[-1][2]} and {a}")
        t = self.tick(a)
        self.sw.setdefault(key, []).append([value, dict(self.c(a)), a, t, meta])
        return t

    def first_write(self, key: Any, pred: Callable[[int], bool]) -> list | None:
        """The first write that satisfies `pred`; None when the initial value (0) already does."""
        if pred(0): return None
        for w in self.sw.get(key, ()):
            if pred(w[0]): return w
        return None

    def acquire(self, a: int, key: Any, pred: Callable[[int], bool]) -> list | None:
        w = self.first_write(key, pred)
        if w is not None: self.join(a, w[1])
        self.tick(a)
        return w


def poll_pred(value: int, mask: int, b64: bool) -> Callable[[int], bool]:
    if b64: return lambda x: (x & mask) == value
    return lambda x: (x & M32 & mask) == value


def cmd_accesses(hb: HB, prog: Program, cmd: tuple) -> tuple[list[int], list[int]]:
    """(read locations, written locations) of a data-touching command."""
    op = cmd[0]
    if op == "write":
        _, bid, off, _, b64 = cmd
        return [], ([] if prog.bufs[bid].kind == "flag" else hb.locs(bid, off, 8 if b64 else 4))
    if op == "copy":
        _, db, do, sb, so, n = cmd
        return hb.locs(sb, so, n), hb.locs(db, do, n)
    if op == "exec":
        _, kname, regions, vals, gs, ls = cmd
        idx = kernel_touch(kname, vals, gs, ls)
        (ob, oo, _), ins = regions[0], regions[1:]
        w = [loc for i in idx for loc in hb.locs(ob, oo + 4 * i, 4)]
        r = [loc for (b, o, _) in ins for i in idx for loc in hb.locs(b, o + 4 * i, 4)]
        if kname == "fz_inc": r = list(w)
        return r, w
    if op == "hcopyin": return [], hb.locs(cmd[1], cmd[2], len(cmd[3]))
    if op == "htaint":  # a faulting launch: it may have written any of its output region
        regions = cmd[1]
        return [loc for b, o, n in regions for loc in hb.locs(b, o, n)], hb.locs(*regions[0])
    if op == "hcopyout": return hb.locs(cmd[2], cmd[3], cmd[4]), []
    return [], []


# ====================================================================== reference model
def run_kernel(mem: Mapping[Any, bytearray], kname: str, regions: tuple, vals: tuple, gs: tuple, ls: tuple) -> list[int]:
    """Apply a kernel launch to `mem` (buffer key -> bytes); regions are (key, offset, nbytes). Returns the word
    indices it wrote."""
    idx = kernel_touch(kname, vals, gs, ls)
    (ob, oo, _), ins = regions[0], regions[1:]
    rd = lambda bid, off, i: int.from_bytes(mem[bid][off + 4 * i:off + 4 * i + 4], "little")  # noqa: E731
    out = {}
    for i in idx:
        if kname == "fz_add": v = rd(*ins[0][:2], i) + rd(*ins[1][:2], i)
        elif kname == "fz_scale": v = rd(*ins[0][:2], i) * vals[0]
        elif kname == "fz_fill": v = vals[0] + i
        elif kname == "fz_inc": v = rd(ob, oo, i) + vals[0]
        elif kname == "fz_fault": v = rd(*ins[0][:2], i) * vals[0] + 1
        else: v = vals[0] ^ ((i & M32) * 2654435761)
        out[i] = v & M32
    for i, v in out.items(): mem[ob][oo + 4 * i:oo + 4 * i + 4] = v.to_bytes(4, "little")
    return idx


def masked_equal(got: bytes, want: bytes, mask: bytes | None) -> bool:
    """Equal on every byte the mask does not mark unknown (mask None: every byte)."""
    if mask is None or not any(mask): return got == want
    return len(got) == len(want) and all(m or g == w for g, w, m in zip(got, want, mask))


class Model:
    """Runs a program in pure Python: the host's steps in order, the rings FIFO, each command when it can run.
    Data-race freedom makes every schedule give the same memory, so the first runnable ring goes first.

    Taint: bytes a faulting graph run or launch may have written are unknown ("tainted") until something writes
    them again; copies and kernels carry taint from what they read to what they write, and checks skip tainted
    bytes. `skips`: steps whose host copy (copyin) the runner saw cancelled by an interrupt: their timeline step
    happened, their data did not."""

    def __init__(self, prog: Program, skips: frozenset[int] = frozenset()):
        self.prog, self.skips = prog, skips
        self.mem = {bid: bytearray(data) for bid, data in prog.init.items()}
        self.sig = [0] * len(prog.sigs)
        self.hb = HB(prog)
        self.checks: dict[int, bytes] = {}  # host read-backs: id -> expected bytes
        self.check_masks: dict[int, bytes | None] = {}  # id -> tainted bytes of the expected value (None: none)
        self.pre: dict[int, tuple[bytes, bytes | None]] = {}  # copyin step -> (destination before it, its taint)
        self.taint: dict[int, bytearray] | None = None  # bid -> 1 per unknown byte (None until something faults)
        self.ts_events: list[tuple[int, int, int, dict[int, int]]] = []  # (sid, agent, t, clock)
        self.cmds_run = 0

    def run(self) -> Model:
        actions = [a for idx, s in enumerate(self.prog.steps) for a in step_actions(self.prog, s, idx)]
        rings: list[deque] = [deque() for _ in self.prog.rings]
        hi = 0
        while True:
            progressed = False
            while hi < len(actions):
                act = actions[hi]
                if act[0] == "hwait" and self.sig[act[1]] < act[2]: break
                self.host(act, rings)
                hi += 1
                progressed = True
            for r, dq in enumerate(rings):
                while dq and self.runnable(dq[0][0]):
                    cmd, hclk = dq.popleft()
                    if hclk is not None: self.hb.join(r, hclk)
                    self.ring(r, cmd)
                    progressed = True
            if hi == len(actions) and not any(rings): return self
            if not progressed:
                stuck = {self.prog.rings[r]: dq[0][0] for r, dq in enumerate(rings) if dq}
                nxt = actions[hi] if hi < len(actions) else None
                raise GeneratorBug(f"seed {self.prog.seed}: the model deadlocked; host at {nxt!r}, rings at {stuck!r}")

    # ---------------------------------------------------------------- taint
    def mask(self, bid: int, off: int, n: int) -> bytes | None:
        """Which of the bytes [off, off + n) of buffer bid are unknown (None: none)."""
        if self.taint is None or bid not in self.taint: return None
        m = bytes(self.taint[bid][off:off + n])
        return m if any(m) else None

    def set_taint(self, bid: int, off: int, n: int, m: bytes | None) -> None:
        if m is None or not any(m):
            if self.taint is not None and bid in self.taint: self.taint[bid][off:off + n] = bytes(n)
            return
        if self.taint is None: self.taint = {}
        if bid not in self.taint: self.taint[bid] = bytearray(len(self.mem[bid]))
        self.taint[bid][off:off + n] = m

    def kernel_taint(self, kname: str, regions: tuple, idx: list[int], before: dict) -> None:
        """Carry taint through a kernel: an output word is unknown when a word it was computed from was."""
        (ob, oo, _), ins = regions[0], regions[1:]
        srcs = [] if kname in ("fz_fill", "fz_nd") else [(ob, oo)] if kname == "fz_inc" else [r[:2] for r in ins]
        for i in idx:
            bad = any(before.get((b, o + 4 * i)) for b, o in srcs)
            self.set_taint(ob, oo + 4 * i, 4, b"\1" * 4 if bad else None)

    def data(self, cmd: tuple) -> None:
        """Apply an exec or copy to memory (and taint)."""
        if cmd[0] == "copy":
            _, db, do, sb, so, n = cmd
            m = self.mask(sb, so, n)
            self.mem[db][do:do + n] = self.mem[sb][so:so + n]
            self.set_taint(db, do, n, m)
            return
        _, kname, regions, vals, gs, ls = cmd
        before = {}
        if self.taint is not None:  # what the kernel reads, before it writes
            for b, o, n in regions:
                for w in range(0, n, 4): before[(b, o + w)] = self.mask(b, o + w, 4) is not None
        idx = kernel_touch(kname, vals, gs, ls)
        self.kernel(kname, regions, vals, gs, ls)
        if self.taint is not None: self.kernel_taint(kname, regions, idx, before)

    def check_value(self, cid: int, bid: int, off: int, n: int) -> None:
        self.checks[cid] = bytes(self.mem[bid][off:off + n])
        self.check_masks[cid] = self.mask(bid, off, n)

    # ---------------------------------------------------------------- actions
    def load(self, bid: int, off: int, b64: bool) -> int:
        return int.from_bytes(self.mem[bid][off:off + (8 if b64 else 4)], "little")

    def runnable(self, cmd: tuple) -> bool:
        if cmd[0] == "wait": return self.sig[cmd[1]] >= cmd[2]
        if cmd[0] == "poll":
            _, bid, off, value, mask, b64 = cmd
            return (self.load(bid, off, b64) & mask) == value
        return True

    def host(self, act: tuple, rings: list[deque]) -> None:
        hb, op = self.hb, act[0]
        if op == "submit":
            hb.tick(HOST)
            snap = dict(hb.c(HOST))
            rings[act[1]].extend((c, snap if i == 0 else None) for i, c in enumerate(act[2]))
        elif op == "hwait":
            hb.acquire(HOST, act[1], lambda x, v=act[2]: x >= v)
        elif op == "hstore":
            self.sig[act[1]] = act[2]
            hb.write_sync(HOST, act[1], act[2])
        elif op == "hcheck":
            _, cid, bid, off, n = act
            hb.access(HOST, hb.locs(bid, off, n), [], act)
            self.check_value(cid, bid, off, n)
        elif op == "hwrite":
            _, bid, off, data = act
            hb.access(HOST, [], hb.locs(bid, off, len(data)), act)
            self.mem[bid][off:off + len(data)] = data
            self.set_taint(bid, off, len(data), None)
        elif op == "hgraph":
            _, gid, env, fault = act
            if fault is None:
                for c in graph_cmds(self.prog, gid, env):
                    hb.access(HOST, *cmd_accesses(hb, self.prog, c), c)
                    self.data(c)
                    self.cmds_run += 1
            else:  # a run that faulted: whatever any item may have written is unknown
                for rd, wr, regions in whole_accesses(hb, self.prog, gid):
                    hb.access(HOST, rd, wr, act)
                    for b, o, n in regions: self.set_taint(b, o, n, b"\1" * n)
        elif op == "htaint":
            hb.access(HOST, *cmd_accesses(hb, self.prog, act), act)
            b, o, n = act[1][0]
            self.set_taint(b, o, n, b"\1" * n)
        else:
            raise ValueError(f"unknown host action {act!r}")

    def ring(self, r: int, cmd: tuple) -> None:
        hb, op, prog = self.hb, cmd[0], self.prog
        self.cmds_run += 1
        if op == "wait":
            hb.acquire(r, cmd[1], lambda x, v=cmd[2]: x >= v)
        elif op == "signal":
            self.sig[cmd[1]] = cmd[2]
            hb.write_sync(r, cmd[1], cmd[2])
        elif op == "ts":
            t = hb.tick(r)
            self.ts_events.append((cmd[1], r, t, dict(hb.c(r))))
        elif op == "barrier":
            hb.tick(r)
        elif op == "poll":
            _, bid, off, value, mask, b64 = cmd
            hb.acquire(r, ("f", bid, off), poll_pred(value, mask, b64))
        elif op == "write":
            _, bid, off, value, b64 = cmd
            n = 8 if b64 else 4
            if prog.bufs[bid].kind == "flag":
                self.mem[bid][off:off + n] = value.to_bytes(n, "little")
                hb.write_sync(r, ("f", bid, off), self.load(bid, off, True))
            else:
                hb.access(r, *cmd_accesses(hb, prog, cmd), cmd)
                self.mem[bid][off:off + n] = value.to_bytes(n, "little")
                self.set_taint(bid, off, n, None)
        elif op in ("copy", "exec"):
            hb.access(r, *cmd_accesses(hb, prog, cmd), cmd)
            self.data(cmd)
        elif op == "hcopyin":
            hb.access(r, *cmd_accesses(hb, prog, cmd), cmd)
            _, bid, off, data, idx = cmd
            self.pre[idx] = (bytes(self.mem[bid][off:off + len(data)]), self.mask(bid, off, len(data)))
            if idx not in self.skips:
                self.mem[bid][off:off + len(data)] = data
                self.set_taint(bid, off, len(data), None)
        elif op == "hcopyout":
            hb.access(r, *cmd_accesses(hb, prog, cmd), cmd)
            _, cid, bid, off, n = cmd
            self.check_value(cid, bid, off, n)
        else:
            raise ValueError(f"unknown command {cmd!r}")

    def kernel(self, kname: str, regions: tuple, vals: tuple, gs: tuple, ls: tuple) -> None:
        run_kernel(self.mem, kname, regions, vals, gs, ls)


# ====================================================================== generator
def nd_launch(rng: Random, region: Callable[[int], tuple[int, int]]) -> tuple:
    """A random fz_nd launch over a w x h x d block of words in one region: (kname, regions, vals, gs, ls)."""
    w, h, d = rng.randint(1, 6), rng.randint(1, 4), rng.randint(1, 2)
    ls = (rng.choice([1, 2, 4]), rng.choice([1, 2]), 1)
    gs = tuple(max(1, -(-x // l) + rng.choice([-1, 0, 0, 1])) for x, l in zip((w, h, d), ls))
    return "fz_nd", (region(w * h * d * 4) + (w * h * d * 4,),), (rng.getrandbits(32), w, h, d), gs, ls


class Gen:
    """Builds a program step by step, keeping the happens-before state of what it generated so far (the same
    vector clocks the model checks with), so it can order every conflicting access with a wait on a signal
    value that already-submitted work produces, and track which closed gates each ring sits behind."""

    def __init__(self, seed: int, max_devices: int = 3, features: Features = DEFAULT_FEATURES, shapes: tuple[Shape, ...] | None = None):
        self.rng = rng = Random(seed)
        self.shapes = shapes if shapes is not None else (CPU_SHAPE,) * max_devices
        if len(self.shapes) < max_devices: raise ValueError(f"{len(self.shapes)} device shape(s) for up to {max_devices} devices")
        self.here: int | None = None
        # The optional features draw from their own streams: turned off, the main stream (so the program) is unchanged.
        # The "hcq.fuzz" in their seeds is part of each seed's program: it stays, whatever this module is called.
        self.grng, self.trng, self.irng = (Random(f"hcq.fuzz {what} {seed}") for what in ("graphs", "threads", "interrupts"))
        # staged host copies (as HCQ_CPU_DIRECT_COPY=0; staged copies are whole too, copyout's host side all-new or untouched):
        # the interrupts' stream's first draw, taken first, as what the program's queues may wait on depends on it (`reaches`)
        self.staged = features.interrupts and self.irng.random() < P_STAGED
        self.seed = seed
        k = rng.randint(1, max_devices)
        rings = [(d, kind, i) for d in range(k) for kind, i in (("compute", 0),) + tuple(("copy", c) for c in range(self.shapes[d].copies))]
        bufs: list[Buf] = []
        self.data: list[int] = []
        self.flagbuf: dict[int, int] = {}
        for d in range(k):
            for j in range(DATA_BUFS):
                self.data.append(len(bufs))
                bufs.append(Buf(d, "data", j, DATA_WORDS * 4, 4))
            self.flagbuf[d] = len(bufs)
            bufs.append(Buf(d, "flag", 0, FLAG_SLOTS * 8, 8))
        self.big: list[int] = []
        if rng.random() < 0.04:
            for d in range(k):
                for j in range(2):
                    self.big.append(len(bufs))
                    bufs.append(Buf(d, "big", j, BIG, BIG))
        sigs: list[Sig] = []
        self.P = []
        for r, (d, _, _) in enumerate(rings):
            self.P.append(len(sigs))
            sigs.append(Sig("p", d, writer=r))
        self.TL = []
        for d in range(k):
            self.TL.append(len(sigs))
            sigs.append(Sig("tl", d))
        self.users = []
        for _ in range(rng.randint(1, 4)):
            w = rng.randrange(len(rings))
            self.users.append(len(sigs))
            sigs.append(Sig("u", rings[w][0], writer=w))
        self.gates = []
        for _ in range(rng.choice([0, 1, 1, 2, 3])):
            full = rng.choice([rng.randint(1, 50), rng.randint(1, 1 << 40), (1 << 32) + rng.randint(0, 1000)])
            self.gates.append(len(sigs))
            sigs.append(Sig("g", rng.randrange(k), full=full))
        self.ts_free = []
        for _ in range(rng.randint(0, 6)):
            self.ts_free.append(len(sigs))
            sigs.append(Sig("t", rng.randrange(k)))
        init = {}
        for bid, b in enumerate(bufs):
            if b.kind == "data": init[bid] = struct.pack(f"<{DATA_WORDS}I", *(rng.randrange(1000) for _ in range(DATA_WORDS)))
            elif b.kind == "flag": init[bid] = bytes(b.size)
            else: init[bid] = rng.randbytes(4096) * (b.size // 4096)
        self.prog = Program(seed, k, rings, bufs, sigs, init, max_devices=max_devices, features=features, staged=self.staged,
                            shapes=self.shapes[:k])
        self.hb = HB(self.prog)
        self.R = len(rings)
        self.pcount = [0] * self.R
        self.ucur = {s: 0 for s in self.users}
        self.tlk = [0] * k
        self.gate_open = {g: 0 for g in self.gates}
        self.ring_gates: list[set[int]] = [set() for _ in range(self.R)]
        self.waitable: list[list[tuple[int, int, int, int]]] = [[] for _ in range(self.R)]  # ring -> (t, sid, value, previous value)
        self.flags: dict[tuple[int, int], tuple] = {}  # (bid, off) -> ("zero",) | ("w", slot value 64-bit, b64 write)
        self.check_id = 0
        self.live_templates: list[TState] = []

    # ---------------------------------------------------------------- bookkeeping
    def closed(self, gates: set[int] | frozenset[int]) -> set[int]:
        return {g for g in gates if self.gate_open[g] < self.prog.sigs[g].full}

    def apply_ring(self, r: int, cmd: tuple) -> None:
        """Apply one command ring r runs (in generation order) to the happens-before and gate state."""
        hb, op, prog = self.hb, cmd[0], self.prog
        if op == "wait":
            sid, v = cmd[1], cmd[2]
            if prog.sigs[sid].kind == "g":
                if self.gate_open[sid] < v: self.ring_gates[r].add(sid)  # blocked until the host opens it
                hb.acquire(r, sid, lambda x: x >= v)
            else:
                w = hb.acquire(r, sid, lambda x: x >= v)
                if w is not None and w[4]: self.ring_gates[r] |= self.closed(w[4])
        elif op == "signal":
            sid, v = cmd[1], cmd[2]
            t = hb.write_sync(r, sid, v, frozenset(self.closed(self.ring_gates[r])))
            prev = hb.sw[sid][-2][0] if len(hb.sw[sid]) > 1 else 0
            self.waitable[r].append((t, sid, v, prev))
        elif op == "poll":
            _, bid, off, value, mask, b64 = cmd
            w = hb.acquire(r, ("f", bid, off), poll_pred(value, mask, b64))
            if w is not None and w[4]: self.ring_gates[r] |= self.closed(w[4])
        elif op == "write" and prog.bufs[cmd[1]].kind == "flag":
            _, bid, off, value, b64 = cmd
            hb.write_sync(r, ("f", bid, off), value, frozenset(self.closed(self.ring_gates[r])))
        elif op in ("ts", "barrier"):
            hb.tick(r)
        else:
            hb.access(r, *cmd_accesses(hb, prog, cmd), cmd)

    def apply_host(self, act: tuple) -> None:
        hb, op = self.hb, act[0]
        if op == "hwait": hb.acquire(HOST, act[1], lambda x: x >= act[2])
        elif op == "hstore": hb.write_sync(HOST, act[1], act[2])
        elif op == "hcheck": hb.access(HOST, hb.locs(*act[2:5]), [], act)
        elif op == "hwrite": hb.access(HOST, [], hb.locs(act[1], act[2], len(act[3])), act)
        elif op == "hgraph":
            _, gid, env, fault = act
            if fault is None:
                for c in graph_cmds(self.prog, gid, env): hb.access(HOST, *cmd_accesses(hb, self.prog, c), c)
            else:
                for rd, wr, _ in whole_accesses(hb, self.prog, gid): hb.access(HOST, rd, wr, act)
        elif op == "htaint": hb.access(HOST, *cmd_accesses(hb, self.prog, act), act)
        else: raise ValueError(act)

    def add_step(self, step: tuple, applied: bool = False) -> None:
        """Append a step; unless its commands were applied while being built, apply its actions now."""
        self.prog.steps.append(step)
        if applied: return
        for act in step_actions(self.prog, step, len(self.prog.steps) - 1):
            if act[0] == "submit":
                self.begin(act[1])
                for c in act[2]: self.apply_ring(act[1], c)
            else:
                self.apply_host(act)

    def begin(self, r: int) -> None:
        """A submission to ring r runs after everything the host did before submitting it."""
        self.hb.tick(HOST)
        self.hb.join(r, self.hb.c(HOST))

    def pick_write(self, ep: tuple[int, int], r: int | None) -> tuple[int, int, list]:
        """A (signal, value) whose wait by ring r (None: the host) orders it after epoch `ep` (a command of an earlier
        submission): a later signal of ep's ring, one r may wait on (`reaches`: ep's ring is of r's peer group, or of a
        group a transfer joined to it, `linked`)."""
        a, t = ep
        cands = [w for w in self.waitable[a] if w[0] >= t and self.reaches(r, w[1])]
        if not cands: raise GeneratorBug(f"seed {self.seed}: nothing ring {r} may wait on after {ep}")
        wt, sid, v, prev = cands[0] if self.rng.random() < 0.75 else self.rng.choice(cands)
        value = v if self.prog.sigs[sid].kind != "u" else self.rng.randint(prev + 1, v)
        entry = self.hb.first_write(sid, lambda x: x >= value)
        return sid, value, entry

    def cover_plan(self, r: int, reads: list[int], writes: list[int]) -> list[tuple[int, int]]:
        """Waits that order ring r (as of a submission made now) after every conflicting earlier access."""
        c = dict(self.hb.c(r))
        for k, v in self.hb.c(HOST).items():
            if c.get(k, 0) < v: c[k] = v
        waits = []
        for ep in sorted(self.hb.uncovered(r, reads, writes, c)):
            if c.get(ep[0], 0) >= ep[1]: continue
            sid, value, entry = self.pick_write(ep, r)
            waits.append((sid, value))
            for k, v in entry[1].items():
                if c.get(k, 0) < v: c[k] = v
        return waits

    def need(self, r: int, cmds: list, reads: list[int], writes: list[int]) -> None:
        """Inside a submission being built: wait for whatever the next access conflicts with."""
        for ep in sorted(self.hb.uncovered(r, reads, writes)):
            if self.hb.c(r).get(ep[0], 0) >= ep[1]: continue
            sid, value, _ = self.pick_write(ep, r)
            self.emit(r, cmds, ("wait", sid, value))

    def emit(self, r: int, cmds: list, cmd: tuple) -> None:
        self.apply_ring(r, cmd)
        cmds.append(cmd)

    def next_p(self, r: int) -> int:
        self.pcount[r] += 1
        return self.pcount[r]

    def open_gates(self, gates: set[int]) -> None:
        for g in sorted(self.closed(gates)):
            self.gate_open[g] = self.prog.sigs[g].full
            self.add_step(("gate", g, self.prog.sigs[g].full, self.rng.choice([0, 0, 0, 200, 1000])))

    def host_wait(self, sid: int, value: int) -> None:
        entry = self.hb.first_write(sid, lambda x: x >= value)
        if entry is not None and entry[4]: self.open_gates(entry[4])
        self.add_step(("hwait", sid, value))

    def host_cover(self, reads: list[int], writes: list[int]) -> None:
        for ep in sorted(self.hb.uncovered(HOST, reads, writes)):
            if self.hb.c(HOST).get(ep[0], 0) >= ep[1]: continue
            sid, value, _ = self.pick_write(ep, None)
            self.host_wait(sid, value)

    def prefix(self, r: int, reads: list[int], writes: list[int]) -> None:
        """A submission of waits on ring r, so that the next submission to r is ordered after every conflicting access."""
        waits = self.cover_plan(r, reads, writes)
        if waits: self.sync_submission(r, waits)

    def sync_submission(self, r: int, waits: list[tuple[int, int]]) -> None:
        self.begin(r)
        cmds: list[tuple] = []
        for sid, v in waits: self.emit(r, cmds, ("wait", sid, v))
        self.emit(r, cmds, ("signal", self.P[r], self.next_p(r)))
        self.add_step(("submit", r, cmds, {}), applied=True)

    # ---------------------------------------------------------------- random pieces
    def at(self, d: int | None) -> None:
        """Generate for the rings of device d from here on (None: for the host): the buffers, flags and timestamp signals
        picked are in its address space (its Shape's group), and its polls take a mask only where it has them."""
        self.here = d

    def sees(self, d: int, e: int) -> bool:
        """Whether device d's queues may wait on device e's signals: its own peer group's, or those the runtime makes it
        replicas of (its Shape's facts, for this program's host copies)."""
        sh = self.shapes[d]
        return sh.group == self.shapes[e].group or e in (sh.staged_replicas if self.staged else sh.replicas)

    def linked(self, d: int, e: int) -> bool:
        """Whether a transfer or a graph may join devices d and e: every device of either's peer group waits on the signals
        of every device of the other's (the runtime orders the two through replicas, and the rings of both groups, which
        touch the memory it does, order themselves after each other's work)."""
        group = lambda x: [y for y in range(self.prog.ndev) if self.shapes[y].group == self.shapes[x].group]  # noqa: E731
        return all(self.sees(x, y) and self.sees(y, x) for x in group(d) for y in group(e))

    def reaches(self, r: int | None, sid: int) -> bool:
        """Whether ring r (None: the host, which waits on any) may wait on signal sid."""
        return r is None or self.sees(self.prog.rings[r][0], self.prog.sigs[sid].dev)

    def waits_for(self, r: int, sids: list[int]) -> list[int]:
        """Those signals ring r may wait on."""
        return [s for s in sids if self.reaches(r, s)]

    def mine(self, items: list[int], dev: Callable[[int], int]) -> list[int]:
        """Those of `items` (on device `dev(item)`) in the address space of the device generated for (all for the host)."""
        if self.here is None: return items
        g = self.shapes[self.here].group
        return [x for x in items if self.shapes[dev(x)].group == g]

    def my_bufs(self, bids: list[int]) -> list[int]:
        return self.mine(bids, lambda b: self.prog.bufs[b].dev)

    def ts_slots(self) -> list[int]:
        """Where in `ts_free` the free timestamp signals of the device generated for are."""
        return self.mine(list(range(len(self.ts_free))), lambda i: self.prog.sigs[self.ts_free[i]].dev)

    def take_ts(self) -> int | None:
        """A free timestamp signal of the device generated for (taken), or None."""
        idx = self.ts_slots()
        return self.ts_free.pop(idx[self.rng.randrange(len(idx))]) if idx else None

    def region(self, nbytes: int, align: int = 4) -> tuple[int, int]:
        bid = self.rng.choice(self.my_bufs(self.data))
        off = self.rng.randrange(0, DATA_WORDS * 4 - nbytes + 1, align) if nbytes <= DATA_WORDS * 4 else 0
        return bid, off

    def disjoint_or_same(self, out: tuple[int, int, int], nbytes: int) -> tuple[int, int, int]:
        if self.rng.random() < 0.25: return out
        for _ in range(20):
            bid, off = self.region(nbytes)
            if bid != out[0] or off + nbytes <= out[1] or out[1] + out[2] <= off: return (bid, off, nbytes)
        return out

    def kernel_launch(self) -> tuple:
        """A random kernel launch: (kname, regions, vals, gs, ls), regions as (bid, off, nbytes)."""
        rng = self.rng
        kname = rng.choice(list(KERNEL_SIGS))
        if kname == "fz_nd": return nd_launch(rng, self.region)
        n = rng.randint(1, 32)
        l = rng.choice([1, 2, 4, 8, 16, 32])
        gs = (max(1, -(-n // l) + rng.choice([-1, 0, 0, 0, 1, 3])),)
        ls = (l,)
        if rng.random() < 0.5: gs, ls = gs + (1, 1), ls + (1, 1)
        out = self.region(4 * n) + (4 * n,)
        regions = [out] + [self.disjoint_or_same(out, 4 * n) for _ in range(KERNEL_SIGS[kname][0] - 1)]
        if kname == "fz_add": vals = (n,)
        elif kname == "fz_scale": vals = (rng.randint(0, 7), n)
        else: vals = (rng.getrandbits(32) if rng.random() < 0.5 else rng.randint(0, 100), n)
        return kname, tuple(regions), vals, gs, ls

    def copy_args(self) -> tuple[int, int, int, int, int]:
        rng = self.rng
        if self.big and rng.random() < 0.5:
            db, sb = rng.choice(self.my_bufs(self.big)), rng.choice(self.my_bufs(self.big))
            do, so = rng.randrange(0, 1 << 15), rng.randrange(0, 1 << 15)
            return db, do, sb, so, rng.randint(4 << 20, BIG - max(do, so))
        if rng.random() < 0.5:  # word-aligned
            n = 4 * rng.randint(0, 24)
            (db, do), (sb, so) = self.region(n), self.region(n)
        else:
            n = rng.randint(0, 80)
            (db, do), (sb, so) = self.region(n, 1), self.region(n, 1)
        return db, do, sb, so, n

    def flag_write_cmd(self, b64: bool | None = None, key: tuple[int, int] | None = None) -> tuple | None:
        """A write of a flag slot (each slot is written at most once per program, so a poll on it is a clean sync)."""
        if key is None:
            free = self.free_flags()
            if not free: return None
            key = self.rng.choice(free)
        b64 = self.rng.random() < 0.5 if b64 is None else b64
        value = self.rng.getrandbits(64 if b64 else 32) | 1
        self.flags[key] = ("w", value, b64)
        return ("write", key[0], key[1], value, b64)

    def poll_cmd(self, b64: bool | None = None, key: tuple[int, int] | None = None) -> tuple | None:
        """A poll on a flag that earlier-generated work writes (it synchronizes with that write), or a poll for 0
        on a flag nobody writes (it passes at once)."""
        rng = self.rng
        b64 = rng.random() < 0.5 if b64 is None else b64
        written = self.my_flags([k for k, v in self.flags.items() if v[0] == "w" and ("f",) + k in self.hb.sw])
        if key is not None or (written and rng.random() < 0.75):
            bid, off = key if key is not None else rng.choice(written)
            slot = self.hb.sw[("f", bid, off)][0][0]  # the slot's 64-bit value after its one write
            eff = slot if b64 else slot & M32
            mask = rng.getrandbits(64 if b64 else 32) | (1 << rng.choice([i for i in range(64 if b64 else 32) if eff >> i & 1]))
            return ("poll", bid, off, eff & self.poll_mask(mask, b64), self.poll_mask(mask, b64), b64)
        zero, free = self.my_flags([k for k, v in self.flags.items() if v[0] == "zero"]), self.free_flags()
        if not zero and not free: return None
        key = rng.choice(zero) if zero and (not free or rng.random() < 0.5) else rng.choice(free)
        self.flags[key] = ("zero",)
        return ("poll", key[0], key[1], 0, self.poll_mask(rng.getrandbits(64 if b64 else 32), b64), b64)

    def poll_mask(self, mask: int, b64: bool) -> int:
        """`mask`, or all ones where the device generated for takes no mask in an EQ poll (then it waits for the whole word)."""
        return mask if self.here is None or self.shapes[self.here].poll_mask else M64 if b64 else M32

    def my_flags(self, keys: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """Those flag slots (bid, offset) in the address space of the device generated for."""
        return [keys[i] for i in self.mine(list(range(len(keys))), lambda i: self.prog.bufs[keys[i][0]].dev)]

    def extra_wait(self, r: int) -> tuple | None:
        rng = self.rng
        x = rng.random()
        if (gates := self.waits_for(r, self.gates)) and x < 0.3:
            g = rng.choice(gates)
            return ("wait", g, rng.randint(1, self.prog.sigs[g].full))
        if x < 0.45: return ("wait", rng.choice(self.waits_for(r, self.P + self.users)), 0)  # already satisfied
        others = [ws for a in range(self.R) if a != r and (ws := [w for w in self.waitable[a] if self.reaches(r, w[1])])]
        if not others: return None
        t, sid, v, prev = rng.choice(rng.choice(others))
        return ("wait", sid, v if self.prog.sigs[sid].kind != "u" else rng.randint(prev + 1, v))

    # ---------------------------------------------------------------- steps
    def concrete_submission(self) -> None:
        rng = self.rng
        r = rng.randrange(self.R)
        d, kind, _ = self.prog.rings[r]
        self.at(d)
        self.begin(r)
        cmds: list[tuple] = []
        if (gates := self.waits_for(r, self.gates)) and rng.random() < 0.3:  # held back until the host opens a gate: later work waits too
            g = rng.choice(gates)
            self.emit(r, cmds, ("wait", g, rng.randint(1, self.prog.sigs[g].full)))
        tl_join = rng.random() < 0.12
        if tl_join: self.emit(r, cmds, ("wait", self.TL[d], self.tlk[d]))
        ops = ["write", "write", "flag", "poll", "signal", "ts", "wait", "wait"] + (["exec"] * 4 + ["barrier"] if kind == "compute" else ["copy"] * 4)
        for _ in range(rng.randint(1, 6)):
            op = rng.choice(ops)
            if op == "write":
                b64 = rng.random() < 0.4
                bid, off = self.region(8 if b64 else 4, 8 if b64 else 4)
                cmd: tuple | None = ("write", bid, off, rng.getrandbits(64 if b64 else 32), b64)
            elif op == "flag": cmd = self.flag_write_cmd()
            elif op == "poll": cmd = self.poll_cmd()
            elif op == "signal":
                mine = [s for s in self.users if self.prog.sigs[s].writer == r]
                if not mine: continue
                s = rng.choice(mine)
                self.ucur[s] += rng.choice([1, rng.randint(1, 1000), rng.randint(1, 1 << 34)])
                cmd = ("signal", s, self.ucur[s])
            elif op == "ts":
                if (ts := self.take_ts()) is None: continue
                cmd = ("ts", ts)
            elif op == "wait": cmd = self.extra_wait(r)
            elif op == "barrier": cmd = ("barrier",)
            elif op == "exec": cmd = ("exec",) + self.kernel_launch()
            else: cmd = ("copy",) + self.copy_args()
            if cmd is None: continue
            self.need(r, cmds, *cmd_accesses(self.hb, self.prog, cmd))
            self.emit(r, cmds, cmd)
        if tl_join:
            self.tlk[d] += 1
            self.emit(r, cmds, ("signal", self.TL[d], self.tlk[d]))
        self.emit(r, cmds, ("signal", self.P[r], self.next_p(r)))
        opts = {"bind": rng.random() < 0.2, "asbuf": rng.random() < 0.5, "short_dims": rng.random() < 0.3}
        self.add_step(("submit", r, cmds, opts), applied=True)

    def new_template(self) -> None:
        """A symbolic queue on a random ring; its instances are submitted at this and later steps."""
        rng = self.rng
        r = rng.randrange(self.R)
        d, kind, _ = self.prog.rings[r]
        self.at(d)
        V: dict[str, tuple[int, int]] = {}
        cmds: list[tuple] = []
        plan: list[tuple] = []  # per command: (how the generator picks its per-instance values, variable prefix, ...)
        for i in range(rng.randint(0, 2)):  # wait slots: virtual signal (address Variable) and value Variable
            V[f"ws{i}"], V[f"wv{i}"] = (0, M64), (0, M64)
            cmds.append(("wait", ("svar", f"ws{i}"), ("var", f"wv{i}")))
            plan.append(("slot", "", i))
        mine = [s for s in self.users if self.prog.sigs[s].writer == r]
        choices = ["write", "write", "signal", "ts", "poll", "flag"] + (["exec"] * 3 + ["barrier"] if kind == "compute" else ["copy"] * 3)
        for j in range(rng.randint(1, 3)):
            op, p = rng.choice(choices), f"b{j}_"
            if op == "write":
                b64 = rng.random() < 0.4
                if rng.random() < 0.5:  # a fixed buffer plus a variable offset (sometimes two variables)
                    bid = rng.choice(self.my_bufs(self.data))
                    V[p + "o"], V[p + "x"] = (0, 63), (0, M64 if b64 else M32)
                    if rng.random() < 0.3:
                        V[p + "o2"] = (0, 31)
                        off = ("mul", ("add", ("var", p + "o"), ("var", p + "o2")), 8 if b64 else 4)
                    else:
                        off = ("mul", ("var", p + "o"), 8 if b64 else 4)
                    val = ("var", p + "x") if rng.random() < 0.7 else ("mod", ("var", p + "x"), 1000)
                    cmds.append(("write", ("addr", ("buf", bid), off), val, b64))
                    plan.append(("write_fixed", p, bid, b64))
                else:  # the whole address is a Variable
                    V[p + "a"], V[p + "x"] = (0, M64), (0, M64 if b64 else M32)
                    cmds.append(("write", ("addr", ("avar", p + "a"), ("lit", 0)), ("var", p + "x"), b64))
                    plan.append(("write_any", p, b64))
            elif op == "flag":
                b64 = rng.random() < 0.5
                V[p + "a"], V[p + "x"] = (0, M64), (0, M64 if b64 else M32)
                cmds.append(("write", ("addr", ("avar", p + "a"), ("lit", 0)), ("var", p + "x"), b64))
                plan.append(("flag", p, b64))
            elif op == "poll":
                b64 = rng.random() < 0.5
                V[p + "a"], V[p + "x"] = (0, M64), (0, M64 if b64 else M32)
                if self.shapes[d].poll_mask: V[p + "m"] = (0, M64 if b64 else M32)
                cmds.append(("poll", ("addr", ("avar", p + "a"), ("lit", 0)), ("var", p + "x"),
                             ("var", p + "m") if p + "m" in V else ("lit", M64 if b64 else M32), b64))
                plan.append(("poll", p, b64))
            elif op == "signal":
                if not mine: continue
                V[p + "s"], V[p + "x"] = (0, M64), (0, M64)
                cmds.append(("signal", ("svar", p + "s") if rng.random() < 0.5 else ("sig", rng.choice(mine)), ("var", p + "x")))
                plan.append(("usig", p))
            elif op == "ts":
                V[p + "s"] = (0, M64)
                cmds.append(("ts", ("svar", p + "s")))
                plan.append(("ts", p))
            elif op == "barrier":
                cmds.append(("barrier",))
                plan.append(("barrier", p))
            elif op == "copy":
                if rng.random() < 0.5:
                    db, sb = rng.choice(self.my_bufs(self.data)), rng.choice(self.my_bufs(self.data))
                    V[p + "do"], V[p + "so"], V[p + "n"] = (0, DATA_WORDS * 4), (0, DATA_WORDS * 4), (0, DATA_WORDS * 4)
                    cmds.append(("copy", ("addr", ("buf", db), ("var", p + "do")), ("addr", ("buf", sb), ("var", p + "so")), ("var", p + "n")))
                    plan.append(("copy_fixed", p, db, sb))
                else:
                    V[p + "d"], V[p + "s"], V[p + "n"] = (0, M64), (0, M64), (0, BIG)
                    cmds.append(("copy", ("addr", ("avar", p + "d"), ("lit", 0)), ("addr", ("avar", p + "s"), ("lit", 0)), ("var", p + "n")))
                    plan.append(("copy_any", p))
            else:
                cmds.append(self.exec_template(p, V))
                plan.append(("exec", p))
        V["p"] = (0, M64)
        cmds.append(("signal", ("sig", self.P[r]), ("var", "p")))
        plan.append(("progress", ""))
        ninst = rng.randint(2, 4)
        # reserve what every instance will use up: flag slots (written once per program) and timestamp signals
        nflag, nts = sum(1 for pl in plan if pl[0] == "flag") * ninst, sum(1 for pl in plan if pl[0] == "ts") * ninst
        free = self.free_flags()
        if nflag > len(free) or nts > len(self.ts_slots()): return
        rng.shuffle(free)
        flags = free[:nflag]
        for key in flags: self.flags[key] = ("reserved",)
        ts = [x for _ in range(nts) if (x := self.take_ts()) is not None]
        if any(pl[0] == "poll" for pl in plan) and not self.my_flags([k for k, v in self.flags.items() if v[0] == "zero"]):
            if not (free := self.free_flags()): return
            self.flags[rng.choice(free)] = ("zero",)  # so a poll always has a target
        bound = rng.random() < 0.35
        symbolic_kernargs = any(c[0] == "exec" and (any(v[0] != "lit" for v in c[3]) or any(rg[1][0] == "avar" or rg[2][0] != "lit" for rg in c[2]))
                                for c in cmds)
        t = Template(len(self.prog.templates), r, bound, cmds, V, ninst, bound or symbolic_kernargs, asbuf=rng.random() < 0.5)
        self.prog.templates[t.tid] = t
        st = TState(t, plan, flags=flags, ts=ts)
        self.live_templates.append(st)
        self.instance(st)

    def exec_template(self, p: str, V: dict[str, tuple[int, int]]) -> tuple:
        """An exec with symbolic kernargs (values, buffer addresses) and grid dims."""
        rng = self.rng
        kname = rng.choice(list(KERNEL_SIGS))
        nb, vnames = KERNEL_SIGS[kname]
        regions = []
        for bi in range(nb):  # each buffer: a fixed buffer plus a variable offset, or a whole-address Variable
            if rng.random() < 0.5:
                V[p + f"r{bi}"] = (0, DATA_WORDS)
                regions.append(("addr", ("buf", rng.choice(self.my_bufs(self.data))), ("mul", ("var", p + f"r{bi}"), 4)))
            else:
                V[p + f"r{bi}"] = (0, M64)
                regions.append(("addr", ("avar", p + f"r{bi}"), ("lit", 0)))
        vals = []
        for vn in vnames:
            lo, hi = VAL_RANGES[vn]
            if rng.random() < 0.7:
                V[p + vn] = (lo, hi)
                vals.append(("var", p + vn))
            else:
                vals.append(("lit", rng.randint(lo, min(hi, 32))))
        l = rng.choice([1, 2, 4, 8])
        if kname == "fz_nd":
            V[p + "gx"], V[p + "gy"] = (1, 8), (1, 4)
            gs = (("var", p + "gx"), ("var", p + "gy"), ("lit", 2))
            ls = (("lit", 1), ("lit", rng.choice([1, 2])), ("lit", 1))
        elif vals[-1][0] == "var" and rng.random() < 0.6:  # grid from n: (n + l) // l blocks of l threads
            gs, ls = (("fdiv", ("add", vals[-1], ("lit", l)), l),), (("lit", l),)
        else:
            V[p + "g"] = (1, 40)
            gs, ls = (("var", p + "g"),), (("lit", l),)
            if rng.random() < 0.3:
                V[p + "l"] = (1, 8)
                ls = (("var", p + "l"),)
        return ("exec", kname, tuple(regions), tuple(vals), gs, ls)

    def free_flags(self) -> list[tuple[int, int]]:
        return self.my_flags([(self.flagbuf[d], 8 * s) for d in range(self.prog.ndev) for s in range(FLAG_SLOTS)
                              if (self.flagbuf[d], 8 * s) not in self.flags])

    def instance(self, st: TState) -> None:
        """Submit the next instance of a template: pick its variables, order it, and record its concrete commands."""
        rng = self.rng
        t, r = st.t, st.t.ring
        if t.drain and st.last_p is not None: self.host_wait(self.P[r], st.last_p)  # its memory-resident words get patched now
        self.at(self.prog.rings[r][0])
        prev, env = st.prev_env, {}

        def keep(name: str, ok: Callable[[Any], bool] = lambda v: True) -> bool:
            return name in prev and rng.random() < 0.4 and ok(prev[name])

        body: list[Any] = []
        slots = []
        for pl, tc in zip(st.plan, t.cmds):
            kind, p = pl[0], pl[1]
            if kind == "slot":
                slots.append(pl[2])
                body.append(None)
            elif kind == "write_fixed":
                _, _, bid, b64 = pl
                width = 8 if b64 else 4
                top = DATA_WORDS * 4 // width - 1  # highest slot index
                o2 = rng.randint(0, min(31, top)) if p + "o2" in t.vars else 0
                if p + "o2" in t.vars: env[p + "o2"] = o2
                env[p + "o"] = prev[p + "o"] if keep(p + "o", lambda v: v + o2 <= top) else rng.randint(0, top - o2)
                env[p + "x"] = prev[p + "x"] if keep(p + "x") else rng.getrandbits(64 if b64 else 32)
                body.append(("write", bid, ev(tc[1][2], env), ev(tc[2], env), b64))
            elif kind == "write_any":
                b64 = pl[2]
                bid, off = self.region(8 if b64 else 4, 8 if b64 else 4)
                env[p + "a"] = ("buf", bid, off)
                env[p + "x"] = prev[p + "x"] if keep(p + "x") else rng.getrandbits(64 if b64 else 32)
                body.append(("write", bid, off, env[p + "x"], b64))
            elif kind == "flag":
                bid, off = st.flags.pop()
                c = self.flag_write_cmd(pl[2], (bid, off))
                env[p + "a"], env[p + "x"] = ("buf", bid, off), c[3]
                body.append(c)
            elif kind == "poll":
                c = self.poll_cmd(pl[2])
                assert c is not None
                env[p + "a"], env[p + "x"] = ("buf", c[1], c[2]), c[3]
                if p + "m" in t.vars: env[p + "m"] = c[4]
                body.append(c)
            elif kind == "usig":
                ref = tc[1]
                s = rng.choice([x for x in self.users if self.prog.sigs[x].writer == r]) if ref[0] == "svar" else ref[1]
                if ref[0] == "svar": env[p + "s"] = ("sig", s)
                self.ucur[s] += rng.randint(1, 1 << 33)
                env[p + "x"] = self.ucur[s]
                body.append(("signal", s, self.ucur[s]))
            elif kind == "ts":
                s = st.ts.pop()
                env[p + "s"] = ("sig", s)
                body.append(("ts", s))
            elif kind == "barrier":
                body.append(("barrier",))
            elif kind == "copy_fixed":
                _, _, db, sb = pl
                n = prev[p + "n"] if keep(p + "n", lambda v: v <= 80) else rng.randint(0, 80)
                do = prev[p + "do"] if keep(p + "do", lambda v: v + n <= DATA_WORDS * 4) else rng.randint(0, DATA_WORDS * 4 - n)
                so = prev[p + "so"] if keep(p + "so", lambda v: v + n <= DATA_WORDS * 4) else rng.randint(0, DATA_WORDS * 4 - n)
                env[p + "n"], env[p + "do"], env[p + "so"] = n, do, so
                body.append(("copy", db, do, sb, so, n))
            elif kind == "copy_any":
                db, do, sb, so, n = self.copy_args()
                env[p + "d"], env[p + "s"], env[p + "n"] = ("buf", db, do), ("buf", sb, so), n
                body.append(("copy", db, do, sb, so, n))
            elif kind == "exec":
                body.append(self.exec_instance(t, tc, p, env, prev, keep))
            elif kind == "progress":
                body.append("progress")
        # order the instance after everything it conflicts with: waits in its slots, the rest in a prefix submission
        reads: list[int] = []
        writes: list[int] = []
        for c in body:
            if isinstance(c, tuple):
                rd, wr = cmd_accesses(self.hb, self.prog, c)
                reads += rd
                writes += wr
        waits = self.cover_plan(r, reads, writes)
        rng.shuffle(waits)
        if len(waits) > len(slots): self.sync_submission(r, waits[len(slots):])
        waits = waits[:len(slots)]
        while len(waits) < len(slots):  # unused slots wait on something already produced
            waits.append((self.P[r], self.pcount[r]) if rng.random() < 0.5 else (rng.choice(self.waits_for(r, self.P + self.users)), 0))
        self.begin(r)
        cmds: list[tuple] = []
        wi = 0
        for c in body:
            if c is None:
                sid, v = waits[wi]
                env[f"ws{slots[wi]}"] = ("sig", sid)
                env[f"wv{slots[wi]}"] = ("tlv", sid, v) if self.prog.sigs[sid].kind == "tl" else v
                wi += 1
                c = ("wait", sid, v)
            elif c == "progress":
                c = ("signal", self.P[r], self.next_p(r))
                env["p"] = c[2]
            self.emit(r, cmds, c)
        for name, v in env.items():
            lo, hi = t.vars[name]
            if isinstance(v, int) and not lo <= v <= hi: raise GeneratorBug(f"seed {self.seed}: template {t.tid}: {name}={v} outside [{lo}, {hi}]")
        st.done += 1
        st.last_p = self.pcount[r]
        st.prev_env = dict(env)
        self.add_step(("submit", r, cmds, {"tmpl": t.tid, "env": env}), applied=True)

    def exec_instance(self, t: Template, tc: tuple, p: str, env: dict, prev: dict, keep: Callable[..., bool]) -> tuple:
        """Per-instance values of a symbolic exec: kernel values, grid dims, and regions that are either the
        output region itself or disjoint from it (so no two threads of the kernel race)."""
        rng = self.rng
        _, kname, regions, vals, gs, ls = tc
        for vn, vt in zip(KERNEL_SIGS[kname][1], vals):  # sometimes last instance's value: the patcher skips unchanged variables
            if vt[0] != "var": continue
            env[vt[1]] = prev[vt[1]] if keep(vt[1]) else \
                rng.getrandbits(32) if vn in ("v", "c") and rng.random() < 0.5 else rng.randint(*VAL_RANGES[vn])
        for g in (p + "gx", p + "gy", p + "g", p + "l"):
            if g in t.vars: env[g] = prev[g] if keep(g) else rng.randint(*t.vars[g])
        cv = tuple(ev(v, env) for v in vals)
        cgs, cls = tuple(ev(x, env) for x in gs), tuple(ev(x, env) for x in ls)
        words = cv[1] * cv[2] * cv[3] if kname == "fz_nd" else cv[-1]
        nbytes = 4 * words
        concrete: list[tuple[int, int, int]] = []
        for bi, rg in enumerate(regions):
            base, name = rg[1], p + f"r{bi}"
            if base[0] == "buf":
                bid = base[1]
                offs = list(range(0, DATA_WORDS - region_words(kname) + 1))
                if bi > 0 and bid == concrete[0][0]:
                    o = concrete[0][1] // 4
                    disjoint = [x for x in offs if x + words <= o or o + words <= x]
                    w = rng.choice(disjoint) if disjoint and rng.random() < 0.7 else o
                else:
                    w = rng.choice(offs)
                env[name] = w
                concrete.append((bid, 4 * w, nbytes))
            else:
                if bi > 0 and rng.random() < 0.3: bid, off = concrete[0][:2]
                else:
                    bid, off = self.region(4 * region_words(kname))
                    if bi > 0:
                        o = concrete[0]
                        for _ in range(20):
                            if bid != o[0] or off + nbytes <= o[1] or o[1] + nbytes <= off: break
                            bid, off = self.region(4 * region_words(kname))
                        else:
                            bid, off = o[:2]
                env[name] = ("buf", bid, off)
                concrete.append((bid, off, nbytes))
        return ("exec", kname, tuple(concrete), cv, cgs, cls)

    def handoff(self) -> None:
        """A producer (often held back by a gate) writes a region and then a flag or a user signal; a consumer on
        another ring polls the flag or waits on the signal, then reads the region. Nothing else orders the two,
        so a poll or wait that does not hold shows up as stale data."""
        rng = self.rng
        a, b = rng.sample(range(self.R), 2) if self.R > 1 else (0, 0)
        if a == b or self.shapes[self.prog.rings[a][0]].group != self.shapes[self.prog.rings[b][0]].group: return  # (one address space)
        self.at(self.prog.rings[a][0])
        n = 4 * rng.randint(1, 16)
        x = self.region(n)
        # producer
        self.begin(a)
        cmds: list[tuple] = []
        if (gates := self.waits_for(a, self.gates)) and rng.random() < 0.7:
            g = rng.choice(gates)
            self.emit(a, cmds, ("wait", g, rng.randint(1, self.prog.sigs[g].full)))
        if self.prog.rings[a][1] == "compute":
            cmd = ("exec", "fz_fill", (x + (n,),), (rng.getrandbits(32), n // 4), (n // 4,), (1,))
        else:
            cmd = ("copy", x[0], x[1]) + self.region(n) + (n,)
        self.need(a, cmds, *cmd_accesses(self.hb, self.prog, cmd))
        self.emit(a, cmds, cmd)
        mine = [s for s in self.users if self.prog.sigs[s].writer == a]
        if mine and rng.random() < 0.5:
            s = rng.choice(mine)
            self.ucur[s] += rng.choice([1, rng.randint(1, 1 << 34)])
            self.emit(a, cmds, ("signal", s, self.ucur[s]))
            sync: tuple | None = ("wait", s, rng.randint(self.hb.sw[s][-2][0] + 1 if len(self.hb.sw[s]) > 1 else 1, self.ucur[s]))
        else:
            fw = self.flag_write_cmd()
            if fw is not None: self.emit(a, cmds, fw)
            sync = None if fw is None else self.poll_cmd(fw[4] if rng.random() < 0.5 else not fw[4], key=fw[1:3])
        self.end_submission(a, cmds)
        if sync is None: return
        # consumer
        self.at(self.prog.rings[b][0])
        self.begin(b)
        cmds = []
        self.emit(b, cmds, sync)
        if self.prog.rings[b][1] == "compute":
            y = self.region(n)
            if y[0] == x[0] and abs(y[1] - x[1]) < n: y = x  # in place, or disjoint: no two threads race
            cmd = ("exec", "fz_scale", (y + (n,), x + (n,)), (rng.randint(2, 7), n // 4), (n // 4,), (1,))
        else:
            y = self.region(n, 1)
            cmd = ("copy", y[0], y[1], x[0], x[1], n)
        self.need(b, cmds, *cmd_accesses(self.hb, self.prog, cmd))
        self.emit(b, cmds, cmd)
        self.end_submission(b, cmds)

    def end_submission(self, r: int, cmds: list[tuple]) -> None:
        self.emit(r, cmds, ("signal", self.P[r], self.next_p(r)))
        self.add_step(("submit", r, cmds, {"asbuf": self.rng.random() < 0.5}), applied=True)

    def api_step(self) -> None:
        """Runtime paths that use the device timeline: a program call, copyin, copyout, transfer, synchronize."""
        rng = self.rng
        d = rng.randrange(self.prog.ndev)
        self.at(d)
        comp, copy0 = self.prog.rings.index((d, "compute", 0)), self.prog.rings.index((d, "copy", 0))
        tl = self.TL[d]
        tl_gates = lambda: set(self.hb.sw[tl][-1][4] or ()) if tl in self.hb.sw else set()  # noqa: E731
        x = rng.random()
        if x < 0.4:
            kname, regions, vals, gs, ls = self.kernel_launch()
            gs, ls = pad3(gs), pad3(ls)
            self.prefix(comp, *cmd_accesses(self.hb, self.prog, ("exec", kname, regions, vals, gs, ls)))
            self.tlk[d] += 1
            self.add_step(("prg", d, kname, regions, vals, gs, ls, self.tlk[d]))
        elif x < 0.6:
            n = rng.randint(1, 64)
            bid, off = rng.choice([b for b in self.data if self.prog.bufs[b].dev == d]), rng.randint(0, DATA_WORDS * 4 - n)
            data = rng.randbytes(n)
            self.prefix(copy0, [], self.hb.locs(bid, off, n))
            self.open_gates(self.ring_gates[copy0] | tl_gates())
            self.tlk[d] += 1
            self.add_step(("copyin", d, bid, off, data, self.tlk[d]))
        elif x < 0.8:
            n = rng.randint(1, 64)
            bid, off = self.region(n, 1)
            bid = self.data[d * DATA_BUFS + self.prog.bufs[bid].index]  # a host copy goes through its buffer's own device: d's of that index
            self.prefix(copy0, self.hb.locs(bid, off, n), [])
            self.open_gates(self.ring_gates[copy0] | tl_gates())
            self.tlk[d] += 1
            self.check_id += 1
            self.add_step(("copyout", self.check_id, d, bid, off, n, self.tlk[d]))
        elif x < 0.93 and (peers := [e for e in range(self.prog.ndev) if e != d and self.linked(d, e)]):
            dd = rng.choice(peers)
            n = rng.randint(1, 64)
            sb = rng.choice([b for b in self.data if self.prog.bufs[b].dev == d])
            db = rng.choice([b for b in self.data if self.prog.bufs[b].dev == dd])
            so, do = rng.randint(0, DATA_WORDS * 4 - n), rng.randint(0, DATA_WORDS * 4 - n)
            # where the copy runs: dd's copy engine (a pull); sd's into a landing buffer that dd's first copy queue
            # then moves into place (the reads happen on sd's, the writes on dd's); else sd's
            how = "pull" if d in self.shapes[dd].pulls else "land" if d in self.shapes[dd].lands else "push"
            if how == "land":
                self.prefix(copy0, self.hb.locs(sb, so, n), [])
                self.at(dd)
                self.prefix(self.prog.rings.index((dd, "copy", 0)), self.hb.locs(sb, so, n), self.hb.locs(db, do, n))
            else:
                if how == "pull": self.at(dd)
                self.prefix(self.prog.rings.index((dd, "copy", 0)) if how == "pull" else copy0, self.hb.locs(sb, so, n), self.hb.locs(db, do, n))
            ks = self.tlk[d] + 1
            kd_prev = self.tlk[dd]
            self.tlk[d] = ks
            self.tlk[dd] += 1
            self.add_step(("transfer", d, dd, db, do, sb, so, n, ks, kd_prev, self.tlk[dd], how))
        else:
            self.open_gates(tl_gates())
            self.add_step(("sync", d, self.tlk[d]))

    def host_step(self) -> None:
        rng = self.rng
        self.at(None)
        x = rng.random()
        if x < 0.35:
            n = 4 * rng.randint(1, 16)
            bid, off = self.region(n)
            self.host_cover(self.hb.locs(bid, off, n), [])
            self.check_id += 1
            self.add_step(("hcheck", self.check_id, bid, off, n))
        elif x < 0.6:
            n = 4 * rng.randint(1, 16)
            bid, off = self.region(n)
            self.host_cover([], self.hb.locs(bid, off, n))
            self.add_step(("hwrite", bid, off, struct.pack(f"<{n // 4}I", *(rng.randrange(1000) for _ in range(n // 4)))))
        elif x < 0.8 and self.gates:
            g = rng.choice(self.gates)
            full, cur = self.prog.sigs[g].full, self.gate_open[g]
            if cur >= full: return
            v = full if rng.random() < 0.5 or full - cur < 2 else rng.randint(cur + 1, full - 1)
            self.gate_open[g] = v
            self.add_step(("gate", g, v, self.rng.choice([0, 0, 200, 1000])))
        else:
            ws = [w for a in range(self.R) for w in self.waitable[a]]
            if not ws: return
            t, sid, v, prev = rng.choice(ws)
            self.host_wait(sid, v if self.prog.sigs[sid].kind != "u" else rng.randint(prev + 1, v))

    # ---------------------------------------------------------------- graphs and faults
    def tl_gates(self, d: int) -> set[int]:
        """Closed gates the newest value of device d's timeline sits behind."""
        tl = self.TL[d]
        return set(self.hb.sw[tl][-1][4] or ()) if tl in self.hb.sw else set()

    def quiesce(self) -> None:
        """Host waits until everything submitted so far ran (a device that fails must have nothing else queued,
        and nothing may wait on it: its later signals arrive poisoned)."""
        self.open_gates(set(self.gates))
        for r in range(self.R):
            if self.pcount[r]: self.host_wait(self.P[r], self.pcount[r])
        for d in range(self.prog.ndev):
            if self.tlk[d]: self.add_step(("sync", d, self.tlk[d]))

    def gregion(self, d: int, nbytes: int, align: int = 4) -> tuple[int, int]:
        rng = self.grng
        return rng.choice([b for b in self.data if self.prog.bufs[b].dev == d]), rng.randrange(0, DATA_WORDS * 4 - nbytes + 1, align)

    def g_kernel(self, d: int, kname: str, p: str, V: dict[str, tuple[int, int]] | None) -> tuple:
        """A kernel item on device d's data buffers: ("exec", d, kname, regions, vals, gs, ls); vals are Variables
        (added to V) or literals; with V None every value is a literal int (and fz_fault's `fault` is 0)."""
        rng = self.grng
        n = rng.randint(1, 32)
        l = rng.choice([1, 2, 4, 8])
        blocks = -(-n // l) + rng.choice([0, 0, 1])
        out = self.gregion(d, 4 * n) + (4 * n,)
        regions = [out]
        for _ in range(KERNEL_SIGS[kname][0] - 1 if kname != "fz_fault" else 1):
            reg = self.gregion(d, 4 * n) + (4 * n,)
            disjoint = reg[0] != out[0] or reg[1] + 4 * n <= out[1] or out[1] + 4 * n <= reg[1]
            regions.append(reg if disjoint and rng.random() < 0.75 else out)  # the same region or a disjoint one: no race

        def val(name: str, lo: int, hi: int, lit: int) -> Any:
            if V is None: return lit
            if rng.random() < 0.6:
                V[p + name] = (lo, hi)
                return ("var", p + name)
            return ("lit", lit)

        if kname == "fz_add": vals = (val("n", 0, n, n),)
        elif kname == "fz_scale": vals = (val("k", 0, 7, rng.randint(0, 7)), val("n", 0, n, n))
        elif kname in ("fz_fill", "fz_inc"): vals = (val("v", 0, M32, rng.getrandbits(32)), val("n", 0, n, n))
        else:
            if V is not None: V[p + "fault"] = (0, 2 * blocks)
            vals = (val("k", 0, 7, rng.randint(0, 7)), 0 if V is None else ("var", p + "fault"), val("n", 0, n, n))
        return ("exec", d, kname, tuple(regions), vals, (blocks, 1, 1), (l, 1, 1))

    def new_graph(self) -> int:
        """A graph of 1-5 items (kernels, copies, transfers) over 1-3 devices; at least one item is fz_fault."""
        rng = self.grng
        pool: list[int] = []
        for d in rng.sample(range(self.prog.ndev), rng.randint(1, min(3, self.prog.ndev))):
            if all(self.linked(d, e) for e in pool): pool.append(d)
        gid = len(self.prog.graphs)
        items: list[tuple] = []
        V: dict[str, tuple[int, int]] = {}
        nitems = rng.randint(1, 5)
        fpos = rng.randrange(nitems)
        for j in range(nitems):
            p, d = f"g{gid}i{j}_", rng.choice(pool)
            if j == fpos: items.append(self.g_kernel(d, "fz_fault", p, V))
            elif rng.random() < 0.6: items.append(self.g_kernel(d, rng.choice(["fz_add", "fz_scale", "fz_fill", "fz_inc", "fz_fault"]), p, V))
            else:
                nmax = rng.randint(1, 80)
                (sb, so), (db, do) = self.gregion(d, nmax, 1), self.gregion(rng.choice(pool), nmax, 1)
                n: tuple = ("lit", nmax)
                if rng.random() < 0.5:
                    V[p + "n"] = (0, nmax)
                    n = ("var", p + "n")
                items.append(("copy", db, do, sb, so, n, nmax))
        used: set[int] = set()  # the graph's devices: where its kernels run, and both ends of its copies
        for it in items: used |= {it[1]} if it[0] == "exec" else {self.prog.bufs[it[1]].dev, self.prog.bufs[it[3]].dev}
        faulty = [j for j, it in enumerate(items) if it[0] == "exec" and it[2] == "fz_fault"]
        self.prog.graphs[gid] = GraphSpec(gid, sorted(used), items, V, faulty)
        self.graph_faulted[gid] = False
        return gid

    def graph_run(self, gid: int, fault_run: bool) -> None:
        """Run graph gid (the host waits for it). A faulting run first lets everything submitted earlier finish."""
        rng = self.grng
        spec = self.prog.graphs[gid]
        env = {name: 0 if name.endswith("_fault") else rng.randint(lo, hi) for name, (lo, hi) in spec.vars.items()}
        fault = None
        if fault_run and all(self.shapes[d].faults for d in spec.devs):
            j = rng.choice(spec.faulty)
            block = rng.randrange(spec.items[j][5][0])
            env[f"g{gid}i{j}_fault"] = 2 * block + rng.choice([1, 2])
            fault = (j, block)
            self.quiesce()
            accs = [(rd, wr) for rd, wr, _ in whole_accesses(self.hb, self.prog, gid)]
        else:
            accs = [cmd_accesses(self.hb, self.prog, c) for c in graph_cmds(self.prog, gid, env)]
        self.host_cover([loc for rd, _ in accs for loc in rd], [loc for _, wr in accs for loc in wr])
        gates: set[int] = set()
        for r, (d, _, _) in enumerate(self.prog.rings):  # its queues run behind what its devices' rings hold
            if d in spec.devs: gates |= self.ring_gates[r]
        for d in spec.devs: gates |= self.tl_gates(d)
        self.open_gates(gates)
        ks = []
        for d in spec.devs:
            self.tlk[d] += 1
            ks.append((d, self.tlk[d]))
        self.graph_faulted[gid] = fault is not None
        self.add_step(("graph", gid, env, fault, tuple(ks)))

    def launch_fault(self) -> None:
        """A plain launch of fz_fault that faults (after everything earlier finished); the runner recovers the device."""
        rng = self.grng
        can = [d for d in range(self.prog.ndev) if self.shapes[d].faults]
        if not can: return
        self.quiesce()
        d = can[rng.randrange(len(can))]
        _, _, _, regions, vals, gs, ls = self.g_kernel(d, "fz_fault", "", None)
        vals = (vals[0], 2 * rng.randrange(gs[0]) + rng.choice([1, 2]), vals[2])
        self.tlk[d] += 1
        self.add_step(("pfault", d, regions, vals, gs, ls, self.tlk[d]))

    # ---------------------------------------------------------------- threads
    def t_kernel(self, region: Callable[[int], tuple[int, int]]) -> tuple:
        """A kernel launch over a thread's own buffers (regions keyed by the thread's buffer index)."""
        rng = self.trng
        kname = rng.choice(list(KERNEL_SIGS))
        if kname == "fz_nd": return nd_launch(rng, region)
        n, l = rng.randint(1, 32), rng.choice([1, 2, 4, 8, 16, 32])
        gs, ls = (max(1, -(-n // l) + rng.choice([-1, 0, 0, 1])), 1, 1), (l, 1, 1)
        out = region(4 * n) + (4 * n,)
        regions = [out]
        for _ in range(KERNEL_SIGS[kname][0] - 1):
            reg = region(4 * n) + (4 * n,)
            disjoint = reg[0] != out[0] or reg[1] + 4 * n <= out[1] or out[1] + 4 * n <= reg[1]
            regions.append(reg if disjoint and rng.random() < 0.75 else out)
        if kname == "fz_add": vals: tuple = (n,)
        elif kname == "fz_scale": vals = (rng.randint(0, 7), n)
        else: vals = (rng.getrandbits(32), n)
        return kname, tuple(regions), vals, gs, ls

    def thread_section(self) -> None:
        """2-4 threads, each with two private buffers and a chain signal, submit their own queues to shared rings
        (compute and copy rings of every device), make timeline calls under a lock (program calls, copyin,
        copyout), copy from scratch buffers they free right after submitting, and check what they read. The
        gates open first: the threads' submissions queue behind what the rings already hold."""
        rng, ndev = self.trng, self.prog.ndev
        self.open_gates(set(self.gates))
        tlc = [0] * ndev
        specs = []
        tw = THREAD_WORDS * 4
        for _ in range(rng.randint(2, 4)):
            first = rng.randrange(ndev)
            near = [d for d in range(ndev) if self.shapes[d].group == self.shapes[first].group]  # (what the thread's queues address)
            rings = [r for r, rg in enumerate(self.prog.rings) if rg[0] in near]
            bdevs = [first, near[rng.randrange(len(near))]]
            init = [rng.randbytes(tw) for _ in range(2)]
            mem = {j: bytearray(init[j]) for j in range(2)}

            def region(n: int, align: int = 4) -> tuple[int, int]:
                return rng.randrange(2), rng.randrange(0, tw - n + 1, align)

            ops: list[tuple] = []
            for _ in range(rng.randint(3, 8)):
                x = rng.random()
                if x < 0.45:
                    r = rings[rng.randrange(len(rings))]
                    body = []
                    for _ in range(rng.randint(1, 3)):
                        y = rng.random()
                        if self.prog.rings[r][1] == "compute" and y < 0.6:
                            kname, regions, vals, gs, ls = self.t_kernel(region)
                            run_kernel(mem, kname, regions, vals, gs, ls)
                            body.append(("exec", kname, regions, vals, gs, ls))
                        elif self.prog.rings[r][1] == "copy" and y < 0.7:
                            n = rng.randint(1, 96)
                            (db, do), (sb, so) = region(n, 1), region(n, 1)
                            mem[db][do:do + n] = mem[sb][so:so + n]
                            body.append(("copy", db, do, sb, so, n))
                        else:
                            b64 = rng.random() < 0.4
                            tb, off = region(8 if b64 else 4, 8 if b64 else 4)
                            v = rng.getrandbits(64 if b64 else 32)
                            mem[tb][off:off + (8 if b64 else 4)] = v.to_bytes(8 if b64 else 4, "little")
                            body.append(("write", tb, off, v, b64))
                    ops.append(("sub", r, tuple(body), rng.random() < 0.2))
                elif x < 0.6:
                    r = rng.choice([r for r in rings if self.prog.rings[r][1] == "copy"])
                    n = rng.randint(1, 128)
                    data = rng.randbytes(n)
                    tb, off = region(n, 1)
                    mem[tb][off:off + n] = data
                    ops.append(("scratch", r, data, tb, off, rng.random() < 0.5))  # freed through the LRU cache, or released
                elif x < 0.7:
                    d = near[rng.randrange(len(near))]
                    kname, regions, vals, gs, ls = self.t_kernel(region)
                    run_kernel(mem, kname, regions, vals, gs, ls)
                    tlc[d] += 1
                    ops.append(("prg", d, kname, regions, vals, gs, ls))
                elif x < 0.78:
                    n = rng.randint(1, 64)
                    data = rng.randbytes(n)
                    tb, off = region(n, 1)
                    mem[tb][off:off + n] = data
                    tlc[bdevs[tb]] += 1
                    ops.append(("copyin", tb, off, data))
                elif x < 0.86:
                    n = rng.randint(1, 64)
                    tb, off = region(n, 1)
                    tlc[bdevs[tb]] += 1
                    ops.append(("copyout", tb, off, n, bytes(mem[tb][off:off + n])))
                elif x < 0.94:
                    n = rng.randint(1, tw)
                    tb, off = region(n, 1)
                    ops.append(("check", tb, off, n, bytes(mem[tb][off:off + n])))
                else:
                    n = 4 * rng.randint(1, 16)
                    tb, off = region(n)
                    data = rng.randbytes(n)
                    mem[tb][off:off + n] = data
                    ops.append(("hwrite", tb, off, data))
            specs.append(ThreadSpec([(bdevs[j], init[j]) for j in range(2)], near[rng.randrange(len(near))], rng.random() < 0.5, ops,
                                    [bytes(mem[j]) for j in range(2)], drop=rng.random() < 0.5))
        sid = len(self.prog.sections)
        self.prog.sections[sid] = specs
        tls = []
        for d in range(ndev):
            if tlc[d]:
                tls.append((d, self.tlk[d], tlc[d]))
                self.tlk[d] += tlc[d]
        self.add_step(("threads", sid, tuple(tls)))

    def assign_interrupts(self) -> None:
        """Pick the runtime calls that get a SIGINT, and where: k = 0 before the call, 1 << 30 right after it,
        else at the k-th line event inside hcq code during the call (right after it when the call has fewer)."""
        rng = self.irng
        for i, st in enumerate(self.prog.steps):
            if st[0] in INTERRUPTIBLE and rng.random() < P_INTERRUPT:
                x = rng.random()
                if st[0] in ("copyin", "copyout") and rng.random() < 0.5:
                    # the copy is held back while the host waits for it: an interrupt there cancels it
                    self.prog.holds.add(i)
                    self.prog.interrupts[i] = -rng.randint(1000, 90_000) if x < 0.4 else rng.randint(1, 160)
                else:
                    self.prog.interrupts[i] = 0 if x < 0.05 else rng.randint(1, 40) if x < 0.4 else rng.randint(1, 400) if x < 0.85 else 1 << 30

    def generate(self) -> Program:
        rng, feats = self.rng, self.prog.features
        nsteps = rng.randint(5, 14)
        self.graph_faulted: dict[int, bool] = {}
        graph_at = self.grng.randrange(nsteps) if feats.graphs and self.grng.random() < P_GRAPH else None
        pfault_at = self.grng.randrange(nsteps) if feats.graphs and self.grng.random() < P_LAUNCH_FAULT else None
        threads_at = self.trng.randrange(nsteps) if feats.threads and self.trng.random() < P_THREADS else None
        for it in range(nsteps):
            x = rng.random()
            pending = [e for e in self.live_templates if e.done < e.t.instances]
            if x < 0.35: self.concrete_submission()
            elif x < 0.45: self.handoff()
            elif x < 0.57: self.new_template()
            elif x < 0.7 and pending: self.instance(rng.choice(pending))
            elif x < 0.85: self.api_step()
            else: self.host_step()
            if it == graph_at: self.graph_run(self.new_graph(), self.grng.random() < P_GRAPH_FAULT)
            elif self.graph_faulted and self.grng.random() < P_GRAPH_RERUN:
                self.graph_run(self.grng.choice(list(self.graph_faulted)), self.grng.random() < P_GRAPH_FAULT)
            if it == pfault_at: self.launch_fault()
            if it == threads_at: self.thread_section()
        for e in self.live_templates:
            while e.done < e.t.instances: self.instance(e)
        for gid, faulted in self.graph_faulted.items():  # after a faulting run the graph runs again, on the recovered devices
            if faulted: self.graph_run(gid, False)
        self.open_gates(set(self.gates))
        if feats.interrupts: self.assign_interrupts()
        return self.prog


def generate(seed: int, max_devices: int = 3, features: Features = DEFAULT_FEATURES, shapes: tuple[Shape, ...] | None = None) -> Program:
    """The program of `seed` over 1..max_devices devices of these shapes (default: CPU devices' shapes)."""
    return Gen(seed, max_devices, features, shapes).generate()


# ====================================================================== runner
def _hcq_dir() -> str:
    """The directory of the hcq package in use (found without importing it), where the tracer counts line events."""
    spec = importlib.util.find_spec("hcq")
    if spec is None or not spec.submodule_search_locations: raise ImportError("the hcq package is not importable")
    return os.path.abspath(list(spec.submodule_search_locations)[0]) + os.sep


_HCQ_DIR = _hcq_dir()
_FUZZ_FILE = os.path.abspath(__file__)  # never counted (matters only where this file sits inside the hcq package)


class _Tracer:
    """sys.settrace hook that delivers SIGINT where a real one could be handled, once execution reached the k-th line
    event inside hcq's own code (this module excepted). A signal handler only runs where the interpreter checks for
    pending work: on entering a Python function, on a backward jump, and after a call into C code (a native wait
    included). So the k-th line event only arms the tracer; it then follows opcodes and raises the signal at the
    next such point (raise_signal runs the handler at once: hcq's, which defers it inside a critical section).
    Raising it at the line event itself could put a KeyboardInterrupt where none can occur, e.g. between a with
    block's last statement and its __exit__ call, and report hangs no real Ctrl-C could cause."""
    __slots__ = ("k", "n", "armed", "fired", "after_call")

    def __init__(self, k: int):
        self.k, self.n, self.armed, self.fired, self.after_call = k, 0, False, False, None

    def trace(self, frame: Any, event: str, arg: Any) -> Any:  # 'call' events: a function starts (or resumes)
        if self.fired: return None
        if self.armed:  # the check on entering a function
            if not _in_destructor(frame): self.fire()
            return None
        code = frame.f_code
        if not code.co_filename.startswith(_HCQ_DIR) or code.co_filename == _FUZZ_FILE or code.co_name == "__del__": return None
        return self.line

    def line(self, frame: Any, event: str, arg: Any) -> Any:
        if self.fired: return None
        if not self.armed:
            if event == "line":
                self.n += 1
                if self.n >= self.k:
                    self.armed = True
                    frame.f_trace_opcodes = True
        elif event == "opcode":
            op = frame.f_code.co_code[frame.f_lasti]
            if (frame is self.after_call or op in _BACKWARD_JUMPS) and not _in_destructor(frame):  # after a call into C / a backward jump
                self.fire()
                return None
            if op in _CALLS: self.after_call = frame
        elif event == "return" and frame.f_back is not None and frame.f_back.f_trace is not None:
            frame.f_back.f_trace_opcodes = True  # follow the caller's opcodes from here
        return self.line

    def fire(self) -> None:
        self.fired, self.after_call = True, None
        signal.raise_signal(signal.SIGINT)


def _in_destructor(frame: Any) -> bool:
    """Whether a __del__ is running (Python drops an exception raised there: the interrupt would be lost, a property
    of Python rather than of hcq, so the tracer waits until it returned)."""
    while frame is not None:
        if frame.f_code.co_name == "__del__": return True
        frame = frame.f_back
    return False


# Opcodes after which (calls) or at which (backward jumps) the interpreter runs pending signal handlers; the names
# of 3.10 (JUMP_ABSOLUTE also jumps forward: a few more points) and of 3.11+.
_CALLS = {dis.opmap[n] for n in ("CALL", "CALL_KW", "CALL_FUNCTION", "CALL_FUNCTION_KW", "CALL_METHOD", "CALL_FUNCTION_EX") if n in dis.opmap}
_BACKWARD_JUMPS = {op for n, op in dis.opmap.items()
                   if n.startswith(("JUMP_BACKWARD", "POP_JUMP_BACKWARD")) and n != "JUMP_BACKWARD_NO_INTERRUPT" or n == "JUMP_ABSOLUTE"}


def when(k: int) -> str:
    """Where the SIGINT of interrupt point k came."""
    if k < 0: return f"from a timer thread {-k} us into the call"
    return "just before the call" if k == 0 else "right after the call" if k >= 1 << 30 else f"armed at hcq line event {k}"


def _flush() -> None:
    """A Python call: the interpreter runs pending signal handlers on entering it."""


# ====================================================================== device internals
# The runner judges more than hcq's public API shows. Each use of something private to hcq or to one backend is
# one helper here, so another backend is adapted in this section only; `_backend` is the one place that asks which
# backend a device belongs to.
def _backend(dev: Any) -> str:
    """Whose internals the helpers below may use for `dev`: "cpu" (the CPU backend), "remote" (a device of an `hcq
    serve`: its name starts with "CPU" too, but the CPU backend runs on the server, behind hcq's remote backend), or
    "" (another backend: what the public API shows only)."""
    from hcq.backends.cpu.device import CPUDevice
    if isinstance(dev, CPUDevice): return "cpu"
    return "remote" if type(dev).__module__ == "hcq.backends.remote.device" else ""


def _cpu_internals(dev: Any) -> bool:
    """Whether `dev` belongs to the CPU backend, whose host-side internals (its allocator's copy modes) the helpers know."""
    return _backend(dev) == "cpu"


def _supported_features(devs: list[Any], features: Features) -> Features:
    """`features` less what the runner cannot judge on `devs`: interrupts need every device to report its rings'
    positions (an interrupted submit is judged by its ring's write pointer). Graphs run everywhere; which of them
    fault is each device's Shape (`_fault_reports`)."""
    if all(dev.capabilities.queue_states for dev in devs): return features
    return Features(interrupts=False, graphs=features.graphs, threads=features.threads)


def _fault_reports(dev: Any) -> bool:
    """Whether fz_fault may fault on `dev` on purpose: the runner judges a fault by the words of the CPU backend's reports
    (the remote one's server runs the CPU backend's command processor) and then recovers the device."""
    return (_cpu_internals(dev) or _backend(dev) == "remote") and bool(dev.capabilities.recover)


def _shape(dev: Any, group: int) -> Shape:
    """What programs use of `dev` (see Shape), from its capabilities: up to two copy queues, leaving out the last one
    where the oracle needs it (`_Staged`: memory without a host view); RuntimeError for a device without the queues."""
    caps = dev.capabilities
    n = caps.queue_count("copy")
    usable = n if _host_visible(dev) else n - 1
    if usable < 1:
        raise RuntimeError(f"{dev.device} has {n} copy queue(s): the runtime's host copies need one (copy queue 0, which programs use "
                           "too)" + ("" if _host_visible(dev) else ", and without a host view of its memory the fuzzer reads and writes it "
                                     "through another one, which its programs never use (it needs two: an hcq serve's devices get three with "
                                     "HCQ_CPU_COPY_ENGINES=3, as --serve does)"))
    return Shape(copies=min(2, usable), faults=_fault_reports(dev), poll_mask=bool(caps.poll_mask), group=group)


def _host_mv(buf: Any) -> memoryview:
    """A buffer's host bytes for the oracle, without validation mode's stale-read warning: the fuzzer reads only
    regions its model proved finished, while other work may still write elsewhere in the same buffer."""
    return buf.view.mv


def _host_visible(dev: Any) -> bool:
    """Whether the host sees `dev`'s memory (else the oracle reads and writes it through `_Staged`)."""
    return bool(dev.capabilities.host_visible_memory)


SERVED_COPY_ENGINES = 3  # what --serve gives its devices: two copy queues for programs, the last for `_Staged`
SERVED_DEVICES = {"CPU": 3, "VK": 1, "NV": 1}  # how many devices of each kind --serve serves (lavapipe is one Vulkan device; a client opens one NV device of a server)
STAGE_BYTES = 1 << 20


class _Staged:
    """The oracle's host reads and writes of memory the host has no view of (a remote device's): a copy on the device's
    last copy queue, which programs never use (`_shape`), between the buffer and a staging buffer of runtime memory the host
    sees (an internal allocation: mirrored, so the server pushes what the copy stored before the signal after it),
    waited for on a signal of its own. The copy waits on nothing, so it runs while the programs' rings wait on gates
    the host opens later, where a synchronize (so allocator.copyout) would deadlock. The oracle reads only regions
    its model proved finished, and writes only regions no queued work touches before the host's next step. One per
    device and thread (made on the main thread: allocations are the caller's to serialise)."""

    def __init__(self, dev: Any, timeout_ms: int):
        from hcq import BufferSpec
        _shape(dev, 0)  # (refuses a device without a copy queue to spare)
        self.dev, self.timeout_ms, self.queue = dev, timeout_ms, dev.capabilities.queue_count("copy") - 1
        self.stage = dev.allocator.alloc(STAGE_BYTES, BufferSpec(cpu_access=True), internal=True)
        self.sig, self.value = dev.new_signal(value=0), 0

    def _copy(self, dest: int, src: int, n: int) -> None:
        self.value += 1
        self.dev.hw_copy_queue_t(self.queue).copy(dest, src, n).signal(self.sig, self.value).submit(self.dev)
        self.sig.wait(self.value, timeout=self.timeout_ms)

    def read(self, buf: Any, off: int, n: int) -> bytes:
        out = bytearray()
        for o in range(off, off + n, STAGE_BYTES):
            k = min(STAGE_BYTES, off + n - o)
            self._copy(self.stage.va_addr, buf.va_addr + o, k)
            out += _host_mv(self.stage)[:k]
        return bytes(out)

    def write(self, buf: Any, off: int, data: bytes) -> None:
        for o in range(0, len(data), STAGE_BYTES):
            chunk = data[o:o + STAGE_BYTES]
            _host_mv(self.stage)[:len(chunk)] = chunk
            self._copy(buf.va_addr + off + o, self.stage.va_addr, len(chunk))


def _interrupt_state() -> tuple[int, bool]:
    """hcq's SIGINT bookkeeping: (critical sections open on the main thread, whether an interrupt is deferred)."""
    from hcq import interrupts
    return interrupts._depth, interrupts._pending is not None


def _lent_host_ranges(dev: Any) -> list[tuple[int, int]]:
    """Host memory `dev`'s allocator counts as lent to in-flight direct copies (validation refuses it meanwhile)."""
    return list(dev.allocator._host_ranges)


def _direct_copy(dev: Any) -> bool:
    """Whether `dev`'s host copies are direct (the copy engine reads or writes the caller's memory: a cancelled one
    leaves it all-old, and nothing writes it after the call left) rather than staged. Only the CPU backend says."""
    return _cpu_internals(dev) and bool(dev.allocator.direct_copy)


def _set_direct_copy(dev: Any, on: bool) -> bool:
    """Make `dev`'s host copies direct or staged (as HCQ_CPU_DIRECT_COPY=0); returns the previous setting. Elsewhere
    a no-op: copies stay as the backend makes them."""
    if not _cpu_internals(dev): return False
    was = bool(dev.allocator.direct_copy)
    dev.allocator.direct_copy = on
    return was


def _ring_stats(dev: Any) -> dict[str, tuple[int, int]]:
    """Per ring of `dev` ("compute0", "copy0", "copy1"): (words the host wrote, words the device consumed); empty
    where the backend does not say."""
    if not dev.capabilities.queue_states: return {}
    return {st["queue"] if st["queue"] != "compute" else "compute0": (st["wptr"], st["rptr"]) for st in dev.queue_states()}


def _ring_wptr(dev: Any, kind: str, idx: int) -> int:
    """Words the host wrote to `dev`'s ring (an interrupted submit reached the ring when this moved)."""
    if not dev.capabilities.queue_states: raise NotImplementedError(f"{dev.device}: does not report ring positions")
    return _ring_stats(dev)[f"{kind}{idx}"][0]


def _rings_drained(dev: Any) -> bool:
    """Whether every ring of `dev` consumed all the host wrote (where the backend does not say: True, and the
    synchronize that follows waits instead)."""
    return all(w == r for w, r in _ring_stats(dev).values())


def _device_error(dev: Any) -> str | None:
    """The failure `dev`'s command processor reports, if any, without raising."""
    return dev._device_error()


def _check_device_error(dev: Any, during: str) -> None:
    """Raise hcq.DeviceError if `dev` failed."""
    dev.check_error(during)


def _recover(dev: Any, timeout_ms: int) -> None:
    """Clear `dev`'s sticky failure so it works again."""
    if not dev.capabilities.recover: raise NotImplementedError(f"{dev.device}: cannot recover from a failure")
    dev.recover(timeout=timeout_ms)


def _says_fault(msg: str, block: int) -> bool:
    """Whether a failed device's error names fz_fault and its faulting block (the CPU backend's words)."""
    return FAULT_RE.format(block=block) in msg


def _says_failed_peer(msg: str, peer: Any) -> bool:
    """Whether a device's error says a wait of it was released by the failed device `peer`, naming the kernel that
    faulted there (the CPU backend's words; a server's name its devices as their clients do)."""
    return f"released by {peer.device} after {peer.device} failed" in msg and "kernel 'fz_fault' faulted" in msg


def _compile_kernels(dev: Any) -> dict[str, Any]:
    """The fuzzer's kernels on `dev`, from the first set of KERNEL_SOURCES its compiler takes."""
    from hcq import CompileError
    why = []
    for lang, sources in KERNEL_SOURCES.items():
        try:
            return {name: dev.compile(sources[name], name) for name in ALL_KERNELS}
        except CompileError as e:
            why.append(f"{lang}: {(str(e).splitlines() or [''])[0]}")
    raise RuntimeError(f"{dev.device} compiles none of the fuzzer's kernel sources ({'; '.join(why)})")


class Runner:
    """Runs programs on the real devices (KIND:0..KIND:K-1, CPU by default, or a server's: see Target). Buffers and
    compiled kernels are kept between programs; signals are fresh per program. `events` counts what the optional
    features did (interrupts delivered and caught, cancelled copies, faults recovered, threaded sections...)."""

    def __init__(self, timeout_ms: int = DEFAULT_TIMEOUT_MS, target: Target | str = "CPU"):
        import hcq
        self.hcq = hcq
        self.timeout_ms = timeout_ms
        self.target = Target.of(target)
        self.devs: list[Any] = []
        self.dev_shapes: list[Shape] = []
        self.prgs: list[dict[str, Any]] = []
        self.bufs: dict[tuple[int, str, int], Any] = {}
        self.broken: str | None = None
        self.events: Counter[str] = Counter()
        self.can_interrupt = threading.current_thread() is threading.main_thread()  # KeyboardInterrupt reaches the main thread only
        self.keep: list[Any] = []
        self.extra_sigs: list[Any] = []
        self.staging: dict[tuple[int, int], _Staged] = {}  # (device, slot: 0 the main thread, t + 1 a section's thread t)

    def device(self, d: int) -> Any:
        while len(self.devs) <= d:
            i = len(self.devs)
            try:
                dev = self.hcq.Device(self.target.device(i))
            except self.hcq.HCQError as e:
                if i == 0: raise
                raise RuntimeError(f"{e} (programs use up to --devices devices, of the kinds --device lists: ask for fewer, or list "
                                   "kinds, e.g. --device VK,CPU)") from e
            group = next(j for j, e in enumerate(self.devs + [dev]) if e.peer_group == dev.peer_group)  # (the first of its peer group)
            shape = _shape(dev, group)  # (refuses a device without the queues programs need, at once)
            self.devs.append(dev)
            self.dev_shapes.append(shape)
            self.probe_replicas(i)
            dev.allocator.host_copy_max = 0  # the model follows host copies as copy-queue commands (tests/test_copies.py: the host's own)
            if not _host_visible(dev): self.staged(i, 0)
            self.prgs.append(_compile_kernels(dev))
            for j in range(DATA_BUFS): self.bufs[(i, "data", j)] = self.alloc(i, DATA_WORDS * 4)
            self.bufs[(i, "flag", 0)] = self.alloc(i, FLAG_SLOTS * 8)
            self.probe_pulls(i)
        return self.devs[d]

    def probe_pulls(self, i: int) -> None:
        """Record in the Shapes which transfers between device i (just opened) and each device opened before it of another
        peer group run on the destination's copy engine (a pull: `hcq.allocator.copy_engine`, on their data buffers), and
        which land in a buffer the destination's own copy queue moves into place (`hcq.allocator.landed_view`)."""
        from hcq.allocator import copy_engine, landed_view
        for j in range(i):
            for src, dst in ((i, j), (j, i)):
                if self.dev_shapes[src].group == self.dev_shapes[dst].group: continue
                try:
                    engine = copy_engine(self.devs[src], self.devs[dst], self.bufs[(dst, "data", 0)], self.bufs[(src, "data", 0)])
                except self.hcq.HCQError:
                    continue
                if engine is self.devs[dst]: self.dev_shapes[dst] = replace(self.dev_shapes[dst], pulls=self.dev_shapes[dst].pulls | {src})
                elif landed_view(self.bufs[(dst, "data", 0)], engine) is not None:
                    self.dev_shapes[dst] = replace(self.dev_shapes[dst], lands=self.dev_shapes[dst].lands | {src})

    def probe_replicas(self, i: int) -> None:
        """Record in the Shapes whether queues of device i (just opened) wait on signals of each device opened before it of
        another peer group, and the other way round: whether the runtime makes that replica (`dev.replica` of a new signal),
        with host copies staged as in a staged program (`_set_direct_copy`, on both), then direct. Staged first: a
        mapping made for a replica stays, and a later probe would find it. A probe's replica is dropped at once."""
        for staged in (True, False):
            for j in range(i):
                for w, o in ((i, j), (j, i)):
                    if self.dev_shapes[w].group == self.dev_shapes[o].group: continue
                    waiter, owner = self.devs[w], self.devs[o]
                    was = [_set_direct_copy(dev, not staged) for dev in (waiter, owner)]
                    sig = owner.new_signal(value=0)
                    try:
                        waiter.replica(sig)
                    except self.hcq.HCQError:
                        continue
                    finally:
                        waiter.drop_replicas(sig)
                        for dev, on in zip((waiter, owner), was): _set_direct_copy(dev, on)
                    sh, facts = self.dev_shapes[w], "staged_replicas" if staged else "replicas"
                    self.dev_shapes[w] = replace(sh, **{facts: getattr(sh, facts) | {o}})

    def shapes(self, n: int) -> tuple[Shape, ...]:
        """The shapes of devices 0..n-1 (opened now), which programs are generated for."""
        self.device(n - 1)
        return tuple(self.dev_shapes[:n])

    def devices(self, n: int) -> list[Any]:
        """Devices 0..n-1 (opened now)."""
        self.device(n - 1)
        return self.devs[:n]

    @staticmethod
    def spec(dev: Any, nolru: bool = False) -> Any:
        """How program data is allocated on `dev`: with a host view where it has one."""
        from hcq import BufferSpec
        return BufferSpec(cpu_access=_host_visible(dev), nolru=nolru)

    def alloc(self, d: int, size: int, nolru: bool = False) -> Any:
        dev = self.device(d)
        return dev.allocator.alloc(size, self.spec(dev, nolru))

    def buf(self, b: Buf) -> Any:
        key = (b.dev, b.kind, b.index)
        if key not in self.bufs: self.bufs[key] = self.alloc(b.dev, b.size)
        return self.bufs[key]

    # ---------------------------------------------------------------- the host's view of device memory
    def staged(self, d: int, slot: int) -> _Staged:
        """Device d's staging for host reads and writes by thread `slot`; made on first use (on the main thread)."""
        if (d, slot) not in self.staging: self.staging[(d, slot)] = _Staged(self.devs[d], self.timeout_ms)
        return self.staging[(d, slot)]

    def host_read(self, buf: Any, off: int, n: int, slot: int = 0) -> bytes:
        """Bytes [off, off + n) of program buffer `buf` as the host reads them (see `_Staged` where it has no view)."""
        if _host_visible(buf.owner): return bytes(_host_mv(buf)[off:off + n])
        return self.staged(self.devs.index(buf.owner), slot).read(buf, off, n)

    def host_write(self, buf: Any, off: int, data: bytes, slot: int = 0) -> None:
        """The host writes `data` at `off` into program buffer `buf` (done when this returns)."""
        if _host_visible(buf.owner): _host_mv(buf)[off:off + len(data)] = data
        else: self.staged(self.devs.index(buf.owner), slot).write(buf, off, data)

    def run(self, prog: Program, model: Model) -> Model:
        """Run `prog` and check it against `model`; returns the model it was finally checked against (a copy the
        runner saw cancelled by an interrupt makes it re-run the model with that copy's data left out)."""
        if self.broken: raise RuntimeError(f"the fuzz runner is unusable after an earlier failure: {self.broken}")
        devs = [self.device(d) for d in range(prog.ndev)]
        try:
            for dev in devs: dev.synchronize(timeout=self.timeout_ms)
        except self.hcq.HCQError as e:
            self.broken = f"devices were not idle at the start of a program: {e}"
            raise FuzzFailure(prog.seed, self.broken, repro_of(prog, self.target)) from e
        self.prog, self.model, self.skips = prog, model, set()
        self.base = [dev.timeline_value for dev in devs]
        self.TL = [sid for sid, s in enumerate(prog.sigs) if s.kind == "tl"]
        self.B = [self.buf(b) for b in prog.bufs]
        self.views: dict[tuple[int, int, int], Any] = {}
        for bid, data in prog.init.items(): self.host_write(self.B[bid], 0, data)
        self.S: list[Any] = []
        for s in prog.sigs:
            self.S.append(devs[s.dev].timeline_signal if s.kind == "tl" else devs[s.dev].new_signal(value=0))
        # Queues and signals must outlive the packets that use them: a bound queue frees its words when collected
        # and a collected signal's slot is handed out again, even while a ring still holds packets naming them.
        self.keep, self.extra_sigs = [], []
        self.tq: dict[int, Any] = {}
        self.graphs: dict[int, Any] = {}
        direct = [_set_direct_copy(dev, False) for dev in devs] if prog.staged else None
        try:
            for i, step in enumerate(prog.steps): self.step(i, step)
            self.drain()
            self.check()
        except BaseException as e:
            self.unblock()
            if isinstance(e, FuzzFailure): raise
            if isinstance(e, (self.hcq.HCQError, AssertionError, ValueError, TypeError)):
                what = ("watchdog: " if isinstance(e, self.hcq.HCQTimeoutError) else "") + f"{type(e).__name__}: {e}"
                raise FuzzFailure(prog.seed, what, repro_of(prog, self.target)) from e
            if isinstance(e, Exception):  # anything else is an internal error escaping hcq: reported like a mismatch
                where = "".join(traceback.format_exception(e)[-6:]).rstrip()
                raise FuzzFailure(prog.seed, f"internal error {type(e).__name__}: {e}\n{where}", repro_of(prog, self.target)) from e
            raise  # (a Ctrl-C of the person running the fuzzer)
        finally:
            self.keep.clear()
            self.tq.clear()
            self.graphs.clear()
            self.extra_sigs.clear()
            if direct is not None:
                for dev, was in zip(devs, direct): _set_direct_copy(dev, was)
        return self.model

    def fail(self, what: str) -> FuzzFailure:
        return FuzzFailure(self.prog.seed, what, repro_of(self.prog, self.target))

    def name(self, d: int | list[int]) -> str:
        """How messages name device d (or devices ds): CPU:1, [CPU:0, VK:0]."""
        return self.target.device(d) if isinstance(d, int) else "[" + ", ".join(self.target.device(x) for x in d) + "]"

    # ---------------------------------------------------------------- values
    def real(self, sid: int, v: int) -> int:
        s = self.prog.sigs[sid]
        return self.base[s.dev] - 1 + v if s.kind == "tl" else v

    def resolve(self, x: Any, dev: Any) -> int:
        """A template variable's value for a queue of `dev` (a signal another peer group owns: the address of its replica)."""
        if isinstance(x, int): return x
        if x[0] == "sig": return dev.replica(self.S[x[1]]).value_addr
        if x[0] == "buf": return self.B[x[1]].va_addr + x[2]
        if x[0] == "tlv": return self.real(x[1], x[2])
        raise ValueError(x)

    def queue(self, r: int) -> Any:
        d, kind, idx = self.prog.rings[r]
        dev = self.devs[d]
        return dev.hw_compute_queue_t() if kind == "compute" else dev.hw_copy_queue_t(idx)

    def wait(self, sig: Any, v: int, what: str) -> None:
        try:
            sig.wait(v, timeout=self.timeout_ms)
        except self.hcq.HCQTimeoutError as e:
            raise self.fail(f"watchdog: {what}: {e}") from e

    def wait_tl(self, d: int, k: int, what: str) -> None:
        self.wait(self.devs[d].timeline_signal, self.real(self.TL[d], k), what)

    def synchronize(self, d: int, what: str) -> None:
        try:
            self.devs[d].synchronize(timeout=self.timeout_ms)
        except self.hcq.HCQTimeoutError as e:
            raise self.fail(f"watchdog: {what} synchronize: {e}") from e

    # ---------------------------------------------------------------- interrupts
    def deliver(self, i: int, k: int | None, fn: Callable[[], Any]) -> bool:
        """Run `fn` (a step's runtime call). With k: SIGINT at the k-th line event inside hcq during it (k = 0:
        just before it; past its last line event: right after it), and the KeyboardInterrupt caught.
        Returns whether one was caught (then the caller judges what the call did)."""
        if k is None or not self.can_interrupt:
            fn()
            return False
        from hcq import interrupts
        self.events["interrupt delivered"] += 1
        self.events[f"interrupt delivered in {self.prog.steps[i][0]}"] += 1
        tracer = _Tracer(k)
        swapped = not callable(signal.getsignal(signal.SIGINT))  # SIGINT ignored (e.g. a background job): raise one anyway
        if swapped: previous = signal.signal(signal.SIGINT, signal.default_int_handler)
        interrupts.install()  # hcq stands in front of the handler (a handler installed since would replace it)
        unraisable: list[Any] = []
        hook, sys.unraisablehook = sys.unraisablehook, unraisable.append
        caught = False
        timer = threading.Timer(-k / 1e6, signal.pthread_kill, (threading.main_thread().ident, signal.SIGINT)) if k < 0 else None
        try:
            try:
                if timer is not None:  # asynchronous, like a real Ctrl-C: it may land anywhere, native waits included
                    timer.start()
                    try:
                        fn()
                    except Exception:
                        timer.cancel()  # a failure of the call itself is reported as such
                        raise
                    finally:
                        timer.join()
                else:
                    if k == 0: tracer.fire()
                    else: sys.settrace(tracer.trace)
                    try:
                        fn()
                    finally:
                        sys.settrace(None)
                    if not tracer.fired: tracer.fire()
                _flush()
            except KeyboardInterrupt:
                caught = True
        finally:
            sys.unraisablehook = hook
            if swapped: signal.signal(signal.SIGINT, previous)
        dropped = 0
        for u in unraisable:
            where = getattr(u.object, "__qualname__", repr(u.object))
            if issubclass(u.exc_type, KeyboardInterrupt):  # it landed in a destructor: Python drops it there
                self.events["interrupt dropped in a destructor"] += 1
                dropped += 1
            else:
                raise self.fail(f"step {i}: exception ignored in {where} after a SIGINT {when(k)}: {u.exc_type.__name__}: {u.exc_value}")
        depth, pending = _interrupt_state()
        if depth or pending:
            raise self.fail(f"step {i}: after a SIGINT {when(k)}, hcq's interrupt state is left depth={depth} pending={pending}")
        if caught: self.events["interrupt caught"] += 1
        elif not dropped:
            raise self.fail(f"step {i}: the KeyboardInterrupt of a SIGINT {when(k)} never came out of the call")
        return caught

    def timeline_call(self, i: int, k: int | None, ds: list[int], call: Callable[[], Any]) -> None:
        """A call that steps the timeline of each device in ds once (a launch, transfer or graph run). Interrupted,
        it must have done so whole or not at all; when it did nothing, it is made again."""
        if k is None:
            call()
            return
        tv = [self.devs[d].timeline_value for d in ds]
        if not self.deliver(i, k, call): return
        adv = [self.devs[d].timeline_value - t for d, t in zip(ds, tv)]
        if all(a == 1 for a in adv):
            self.events["interrupted call was whole"] += 1
            return
        if any(adv): raise self.fail(f"step {i}: a {self.prog.steps[i][0]} interrupted by a SIGINT {when(k)} stepped the timelines "
                                     f"of {self.name(ds)} by {adv}: it must happen whole or not at all")
        self.events["interrupted call did not start (made again)"] += 1
        call()

    def host_copy(self, i: int, k: int | None, d: int, kt: int, call: Callable[[], Any], look: Callable[[], bytes],
                  new: bytes, mask: bytes | None, old: bytes, old_mask: bytes | None, what: str) -> bool:
        """A copyin or copyout, under an interrupt: not started (made again), or started whole: its timeline value
        kt is signalled and the destination ends all-new (`new`, checked where `mask` is not set) or, a direct
        copy cancelled before the engine began it or a staged copyout whose host side never ran, all-old (`old`);
        never partly, and never written after the exception left. (A staged copyin whose timeline stepped is on its
        ring: it must land.) Returns False when the copy was cancelled."""
        dev = self.devs[d]
        if k is None:
            call()
            return True
        tv, leaks = dev.timeline_value, len(_lent_host_ranges(dev))
        hold = release = None
        if i in self.prog.holds:  # hold the copy ring back (a queue waiting on a signal released later), so the copy waits
            hold = dev.new_signal(value=0)
            self.extra_sigs.append(hold)
            self.keep.append(dev.hw_copy_queue_t(0).wait(hold, 1).submit(dev))
            release = threading.Timer(HOLD_MS / 1000, setattr, (hold, "value", 1))
            release.start()
        try:
            try:
                interrupted = self.deliver(i, k, call)
            finally:
                if release is not None:
                    release.cancel()
                    hold.value = 1
            if not interrupted: return True
            adv = dev.timeline_value - tv
            if adv == 0:
                self.events["interrupted call did not start (made again)"] += 1
                call()
                return True
            if adv != 1: raise self.fail(f"step {i}: a {what} interrupted by a SIGINT {when(k)} stepped {self.name(d)}'s timeline by {adv}")
            first = look() if _direct_copy(dev) else None  # as the exception left: a direct copy is done or will never run
            self.wait_tl(d, kt, f"step {i}: interrupted {what}")
            got = look()
            if masked_equal(got, new, mask):
                if first is not None and not masked_equal(first, new, mask) and not masked_equal(old, new, old_mask):
                    raise self.fail(f"step {i}: a {what} interrupted by a SIGINT {when(k)} wrote its destination after the "
                                    f"KeyboardInterrupt left: {first.hex()} then {got.hex()}")
                self.events["interrupted call was whole"] += 1
                return True
            if masked_equal(got, old, old_mask) and (_direct_copy(dev) or what == "copyout"):
                self.events[f"interrupted {what} cancelled"] += 1
                return False
            raise self.fail(f"step {i}: a {what} interrupted by a SIGINT {when(k)} left its destination " +
                            (f"partly written: {got.hex()}, neither all-old {old.hex()} nor all-new {new.hex()}"
                             if not masked_equal(got, old, old_mask) else f"all-old {got.hex()}, though the staged copy was submitted"))
        finally:
            if len(lent := _lent_host_ranges(dev)) > leaks:  # validation would take that host memory for lent to a copy from now on
                raise self.fail(f"step {i}: a {what} interrupted by a SIGINT {when(k)} left host memory lent to the copy engine: "
                                f"{lent[leaks:]}")

    # ---------------------------------------------------------------- steps
    def step(self, i: int, step: tuple) -> None:
        kind = step[0]
        prog = self.prog
        k = prog.interrupts.get(i)
        if kind == "submit":
            _, r, cmds, opts = step
            dev = self.devs[prog.rings[r][0]]
            vv: dict[str, int] | None = None
            if "tmpl" in opts:
                q = self.tq.get(opts["tmpl"])
                if q is None: q = self.tq[opts["tmpl"]] = self.build_template(prog.templates[opts["tmpl"]])
                vv = {name: self.resolve(v, dev) for name, v in opts["env"].items()}
            else:
                q = self.queue(r)
                for c in cmds: self.add(q, dev, c, opts)
                if opts.get("bind"): q.bind(dev)
                self.keep.append(q)
            if k is None:
                q.submit(dev, vv)
                return
            wptr = _ring_wptr(dev, *prog.rings[r][1:])
            if self.deliver(i, k, lambda: q.submit(dev, vv)):
                if _ring_wptr(dev, *prog.rings[r][1:]) != wptr: self.events["interrupted call was whole"] += 1
                else:  # nothing reached the ring: submit it again
                    self.events["interrupted call did not start (made again)"] += 1
                    q.submit(dev, vv)
        elif kind == "hwait":
            self.wait(self.S[step[1]], self.real(step[1], step[2]), f"step {i} host wait")
        elif kind == "gate":  # after an optional pause that lets the queues fall asleep on it
            if step[3]: time.sleep(step[3] / 1e6)
            self.S[step[1]].value = step[2]
        elif kind == "hcheck":
            _, cid, bid, off, n = step
            self.expect(cid, self.host_read(self.B[bid], off, n), f"step {i}: host read of buffer {bid} [{off}, {off + n})")
        elif kind == "hwrite":
            _, bid, off, data = step
            self.host_write(self.B[bid], off, data)
        elif kind == "prg":
            _, d, kname, regions, vals, gs, ls, kt = step
            self.expect_tl(d, kt)
            self.timeline_call(i, k, [d], lambda: self.prgs[d][kname](*(self.view(b, o, n) for b, o, n in regions), global_size=gs,
                                                                      local_size=ls, vals=vals))
        elif kind == "copyin":
            _, d, bid, off, data, kt = step
            self.expect_tl(d, kt)
            look = lambda: self.host_read(self.B[bid], off, len(data))  # noqa: E731
            old, old_mask = self.model.pre.get(i, (b"", None))
            if not self.host_copy(i, k, d, kt, lambda: self.devs[d].allocator.copyin(self.B[bid].offset(off, len(data)), memoryview(data)),
                                  look, data, None, old, old_mask, "copyin"):
                self.skips.add(i)  # the model leaves this copy's data out from here on
                self.model = Model(prog, frozenset(self.skips)).run()
        elif kind == "copyout":
            _, cid, d, bid, off, n, kt = step
            self.expect_tl(d, kt)
            out = bytearray(n)
            if self.host_copy(i, k, d, kt, lambda: self.devs[d].allocator.copyout(memoryview(out), self.B[bid].offset(off, n)),
                              lambda: bytes(out), self.model.checks[cid], self.model.check_masks.get(cid), bytes(n), None, "copyout"):
                self.expect(cid, bytes(out), f"step {i}: copyout of buffer {bid} [{off}, {off + n})")
        elif kind == "transfer":
            _, sd, dd, dbid, doff, sbid, soff, n, ks, kd_prev, kd, _ = step
            self.expect_tl(sd, ks)
            self.timeline_call(i, k, [sd, dd], lambda: self.devs[sd].allocator.transfer(
                self.B[dbid].offset(doff, n), self.B[sbid].offset(soff, n), n, src_dev=self.devs[sd], dest_dev=self.devs[dd]))
        elif kind == "sync":
            if self.deliver(i, k, lambda: self.synchronize(step[1], f"step {i}")):
                self.events["interrupted call did not start (made again)"] += 1
                self.synchronize(step[1], f"step {i}")
        elif kind == "graph":
            _, gid, env, fault, ks = step
            g = self.graph(gid)
            for d, kt in ks: self.expect_tl(d, kt)
            self.timeline_call(i, k, [d for d, _ in ks], lambda: g(var_vals=env))
            self.events["graph runs"] += 1
            if fault is None:
                for d, kt in ks: self.wait_tl(d, kt, f"step {i}: graph {gid} run")
            else:
                j, block = fault
                self.expect_fault(i, [d for d, _ in ks], prog.graphs[gid].items[j][1], block, f"graph {gid} run (item {j} faults)")
                self.events["graph fault recovered"] += 1
        elif kind == "pfault":
            _, d, regions, vals, gs, ls, kt = step
            self.expect_tl(d, kt)
            self.timeline_call(i, k, [d], lambda: self.prgs[d]["fz_fault"](*(self.view(b, o, n) for b, o, n in regions), global_size=gs,
                                                                           local_size=ls, vals=vals))
            self.expect_fault(i, [d], d, (vals[1] - 1) // 2, "launch of fz_fault")
            self.events["launch fault recovered"] += 1
        elif kind == "threads":
            self.run_section(i, step[1], step[2])
        else:
            raise ValueError(step)

    def view(self, bid: int, off: int, n: int) -> Any:
        """The same view object for the same region, so repeated identical launches take the fast path's
        kernargs reuse (retag) branch."""
        key = (bid, off, n)
        if key not in self.views: self.views[key] = self.B[bid].offset(off, n)
        return self.views[key]

    def expect_tl(self, d: int, k: int) -> None:
        want = self.base[d] - 1 + k
        if self.devs[d].timeline_value != want:
            raise self.fail(f"{self.name(d)} timeline_value is {self.devs[d].timeline_value}, the program expects {want}")

    def expect(self, cid: int, got: bytes, what: str) -> None:
        want, mask = self.model.checks[cid], self.model.check_masks.get(cid)
        if not masked_equal(got, want, mask):
            raise self.fail(f"{what}: got {got.hex()} want {want.hex()}" + (f" (unknown where {mask.hex()})" if mask else ""))

    # ---------------------------------------------------------------- faults
    def graph(self, gid: int) -> Any:
        """The HCQGraph of graph gid (built on its first run)."""
        if gid in self.graphs: return self.graphs[gid]
        from hcq import CopyItem, ExecItem, HCQGraph, Variable
        spec = self.prog.graphs[gid]
        V = {name: Variable(name, lo, hi) for name, (lo, hi) in spec.vars.items()}
        sym = lambda x: x[1] if x[0] == "lit" else V[x[1]]  # noqa: E731
        items: list[Any] = []
        for it in spec.items:
            if it[0] == "exec":
                _, d, kname, regions, vals, gs, ls = it
                items.append(ExecItem(self.prgs[d][kname], tuple(self.B[b].offset(o, n) for b, o, n in regions), tuple(sym(v) for v in vals), gs, ls))
            else:
                _, db, do, sb, so, n, nmax = it
                items.append(CopyItem(dest=self.B[db].offset(do, nmax), src=self.B[sb].offset(so, nmax), nbytes=sym(n)))
        g = self.graphs[gid] = HCQGraph(items)
        got = sorted(self.devs.index(dev) for dev in g.devices)
        if got != spec.devs: raise self.fail(f"graph {gid} runs on {self.name(got)}, the program expects {self.name(spec.devs)}")
        return g

    def expect_fault(self, i: int, ds: list[int], fd: int, block: int, what: str) -> None:
        """After work in which fz_fault faults on device fd: it fails naming the kernel and block, every other
        device in ds fails naming a failed peer, none hangs; recover() makes them all work again."""
        msgs = {}
        for d in ds:
            try:
                self.devs[d].synchronize(timeout=self.timeout_ms)
            except self.hcq.DeviceError as e:
                msgs[d] = str(e)
            except self.hcq.HCQTimeoutError as e:
                raise self.fail(f"watchdog: step {i}: {what}: {self.name(d)} hangs instead of failing: {e}") from e
            else:
                raise self.fail(f"step {i}: {what}: {self.name(d)} did not fail")
        if not _says_fault(msgs[fd], block):
            raise self.fail(f"step {i}: {what}: {self.name(fd)}'s error does not say {FAULT_RE.format(block=block)!r}: {msgs[fd]}")
        for d in ds:
            if d != fd:
                if not any(_says_failed_peer(msgs[d], self.devs[e]) for e in ds if e != d):
                    raise self.fail(f"step {i}: {what}: {self.name(d)}'s error does not name the failed peer it waited on: {msgs[d]}")
                self.events["peer failure"] += 1
        for d in ds: _recover(self.devs[d], self.timeout_ms)
        for d in ds: self.synchronize(d, f"step {i}: after recovering from {what}:")
        for d in range(self.prog.ndev):
            if d not in ds and (err := _device_error(self.devs[d])) is not None:
                raise self.fail(f"step {i}: {what}: {self.name(d)} failed too, though nothing of it waited on the failed devices: {err}")

    # ---------------------------------------------------------------- threads
    def thread_buf(self, d: int, slot: int) -> Any:
        key = (d, "thread", slot)
        if key not in self.bufs: self.bufs[key] = self.alloc(d, THREAD_WORDS * 4)
        return self.bufs[key]

    def run_section(self, i: int, sid: int, tls: tuple) -> None:
        """Run a threaded section: buffers (and some chain signals) made first, then the threads, joined under a
        watchdog; then every thread's chain and timeline calls must have finished and its buffers hold what the
        thread's sequence of operations gives."""
        prog = self.prog
        specs = prog.sections[sid]
        for d, kb, _ in tls: self.expect_tl(d, kb + 1)
        bufs = []
        for t, ts in enumerate(specs):
            bufs.append([self.thread_buf(d, 2 * t + j) for j, (d, _) in enumerate(ts.bufs)])
            for b, (_, init) in zip(bufs[-1], ts.bufs): self.host_write(b, 0, init)
            for d in range(prog.ndev):  # the thread's staging (for its reads, writes and scratch buffers), made here
                if not _host_visible(self.devs[d]): self.staged(d, t + 1)
        sigs = [self.devs[ts.sig_dev].new_signal(value=0) if ts.sig_early else None for ts in specs]
        lock = threading.Lock()
        start = threading.Barrier(len(specs))  # all start together
        results: list[Any] = [None] * len(specs)
        threads = [threading.Thread(target=self.thread_main, args=(i, t, ts, bufs[t], sigs[t], lock, start, results), daemon=True,
                                    name=f"fuzz seed {prog.seed} thread {t}") for t, ts in enumerate(specs)]
        for th in threads: th.start()
        deadline = time.monotonic() + 10 * self.timeout_ms / 1000 + 5
        for th in threads: th.join(max(0.0, deadline - time.monotonic()))
        if any(th.is_alive() for th in threads):
            self.broken = f"step {i}: threads of section {sid} still run after the watchdog"
            raise self.fail(f"watchdog: {self.broken}")
        for res in results:  # what they submitted stays alive until it ran (dropped on this thread)
            self.keep.append(res["keep"])
            if res["sig"] is not None: self.extra_sigs.append(res["sig"])
            self.events.update(res["counts"])
        for res in results:
            if res["err"]: raise self.fail(res["err"])
        spans = [res["span"] for res in results]
        if max(a for a, _ in spans) < min(b for _, b in spans): self.events["threaded section with all threads at work together"] += 1
        for t, res in enumerate(results): self.wait(res["sig"], res["n"], f"step {i}: thread {t}'s last submission")
        for d, kb, c in tls:
            self.expect_tl(d, kb + c + 1)
            self.synchronize(d, f"step {i}: after section {sid}:")
        for t, ts in enumerate(specs):
            for j, want in enumerate(ts.final):
                got = self.host_read(bufs[t][j], 0, len(want))
                if got != want:
                    bad = [w for w in range(0, len(want), 4) if got[w:w + 4] != want[w:w + 4]]
                    raise self.fail(f"step {i}: thread {t} buffer {j} ({self.name(ts.bufs[j][0])}) differs at {len(bad)} word(s), first at byte "
                                    f"{bad[0]}: got {got[bad[0]:bad[0] + 4].hex()} want {want[bad[0]:bad[0] + 4].hex()}")
        self.events["threaded section"] += 1
        self.events["threads"] += len(specs)

    def thread_main(self, i: int, t: int, ts: ThreadSpec, bufs: list[Any], sig: Any, lock: threading.Lock, start: threading.Barrier,
                    results: list[Any]) -> None:
        """One thread of a section. Its submissions form a chain on its own signal (each waits for the previous
        one, and for the thread's last timeline call); host reads, writes and timeline calls first wait for the
        chain. What the thread-safety contract leaves to the caller is done under `lock`: timeline calls
        (program calls, copyin, copyout), alloc/free, new_signal, fill_kernargs, bind (and submit too in
        validation mode, whose checks read every allocator)."""
        from hcq import validation
        prog, keep, cur, op, counts = self.prog, [], 0, None, Counter()
        pend: tuple[Any, int] | None = None  # (device, timeline value) of the thread's last timeline call
        sublock = lock if validation.enabled else contextlib.nullcontext()
        t0 = t1 = 0.0
        try:
            start.wait(timeout=self.timeout_ms / 1000)
            t0 = time.monotonic()
            if sig is None:
                with lock: sig = self.devs[ts.sig_dev].new_signal(value=0)

            def settle() -> None:
                sig.wait(cur, timeout=self.timeout_ms)
                if pend is not None: pend[0].timeline_signal.wait(pend[1], timeout=self.timeout_ms)

            for oi, op in enumerate(ts.ops):
                kind = op[0]
                if kind in ("sub", "scratch"):
                    d, rkind, idx = prog.rings[op[1]]
                    dev = self.devs[d]
                    q = dev.hw_compute_queue_t() if rkind == "compute" else dev.hw_copy_queue_t(idx)
                    q.wait(sig, cur)
                    if pend is not None: q.wait(pend[0].timeline_signal, pend[1])
                    scratch = None
                    if kind == "sub":
                        for c in op[2]:
                            if c[0] == "exec":
                                _, kname, regions, vals, gs, ls = c
                                prg = self.prgs[d][kname]
                                with lock: args = prg.fill_kernargs(tuple(bufs[b].offset(o, n) for b, o, n in regions), vals)
                                q.exec(prg, args, gs, ls)
                            elif c[0] == "copy":
                                _, db, do, sb, so, n = c
                                q.copy(bufs[db].va_addr + do, bufs[sb].va_addr + so, n)
                            else:
                                _, b, o, v, b64 = c
                                q.write(bufs[b].va_addr + o, v, b64)
                    else:
                        _, _, data, b, o, lru = op
                        with lock: scratch = self.alloc(d, len(data), nolru=not lru)
                        self.host_write(scratch, 0, data, t + 1)
                        q.copy(bufs[b].va_addr + o, scratch.va_addr, len(data))
                    q.signal(sig, cur + 1)
                    if kind == "sub" and op[3]:
                        with lock: q.bind(dev)
                    with sublock: q.submit(dev)
                    if not ts.drop: keep.append(q)  # else the ring holds what it needs until the submission ran
                    with lock: args = q = None  # dropping the last reference may free (kernargs, bound words): the allocator
                    if scratch is not None:  # freed before its copy ran: hcq must keep the memory until it did
                        with lock: dev.allocator.free(scratch, len(data), self.spec(dev, not lru))
                        scratch = None
                        counts["thread freed a scratch buffer its submitted copy reads" + (" (LRU cache)" if lru else "")] += 1
                    cur, pend = cur + 1, None
                elif kind == "prg":
                    _, d, kname, regions, vals, gs, ls = op
                    settle()
                    dev = self.devs[d]
                    with lock:
                        self.prgs[d][kname](*(bufs[b].offset(o, n) for b, o, n in regions), global_size=gs, local_size=ls, vals=vals)
                        pend = (dev, dev.timeline_value - 1)
                elif kind in ("copyin", "copyout"):
                    b, o = op[1], op[2]
                    settle()
                    dev = self.devs[ts.bufs[b][0]]
                    out = bytearray(op[3] if kind == "copyout" else 0)
                    with lock:
                        if kind == "copyin": dev.allocator.copyin(bufs[b].offset(o, len(op[3])), memoryview(op[3]))
                        else: dev.allocator.copyout(memoryview(out), bufs[b].offset(o, op[3]))
                        pend = (dev, dev.timeline_value - 1)
                    if kind == "copyout" and bytes(out) != op[4]:
                        raise AssertionError(f"copyout of its buffer {b} [{o}, {o + op[3]}): got {bytes(out).hex()} want {op[4].hex()}")
                elif kind == "check":
                    _, b, o, n, want = op
                    settle()
                    got = self.host_read(bufs[b], o, n, t + 1)
                    if got != want: raise AssertionError(f"host read of its buffer {b} [{o}, {o + n}): got {got.hex()} want {want.hex()}")
                else:
                    _, b, o, data = op
                    settle()
                    self.host_write(bufs[b], o, data, t + 1)
            results[t] = {"sig": sig, "n": cur, "keep": keep, "err": None, "span": (t0, time.monotonic()), "counts": counts}
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            what = ("watchdog: " if isinstance(e, self.hcq.HCQTimeoutError) else "") + f"{type(e).__name__}: {e}"
            results[t] = {"sig": sig, "n": cur, "keep": keep, "span": (t0, t1), "counts": counts,
                          "err": f"step {i}: thread {t}, op {ts.ops.index(op) if op else -1} ({op[0] if op else None}): {what}"}

    def add(self, q: Any, dev: Any, c: tuple, opts: dict) -> None:
        op = c[0]
        B, S = self.B, self.S
        if op == "wait": q.wait(dev.replica(S[c[1]]), self.real(c[1], c[2]))  # (another peer group's signal: through a replica)
        elif op == "signal":
            s = self.prog.sigs[c[1]]
            if s.kind == "tl":
                tv = self.devs[s.dev].next_timeline()
                if tv != self.real(c[1], c[2]): raise FuzzFailure(self.prog.seed, f"timeline desync: {tv} != {self.real(c[1], c[2])}", "")
            q.signal(S[c[1]], self.real(c[1], c[2]))
        elif op == "ts": q.timestamp(S[c[1]])
        elif op == "barrier": q.memory_barrier()
        elif op == "write":
            _, bid, off, value, b64 = c
            q.write(B[bid].offset(off, 8 if b64 else 4) if opts.get("asbuf") else B[bid].va_addr + off, value, b64)
        elif op == "poll":
            _, bid, off, value, mask, b64 = c
            q.poll_bit(B[bid].offset(off, 8) if opts.get("asbuf") else B[bid].va_addr + off, value, mask, b64)
        elif op == "copy":
            _, db, do, sb, so, n = c
            if opts.get("asbuf"): q.copy(B[db].offset(do, n), B[sb].offset(so, n), n)
            else: q.copy(B[db].va_addr + do, B[sb].va_addr + so, n)
        elif op == "exec":
            _, kname, regions, vals, gs, ls = c
            prg = self.prgs[self.devs.index(dev)][kname]
            args = prg.fill_kernargs(tuple(B[b].offset(o, n) for b, o, n in regions), vals)
            short = opts.get("short_dims") and kname != "fz_nd"
            q.exec(prg, args, tuple(gs[:1]) if short else pad3(gs), tuple(ls[:1]) if short else pad3(ls))
        else:
            raise ValueError(c)

    def build_template(self, t: Template) -> Any:
        from hcq import HCQBuffer, Variable
        d = self.prog.rings[t.ring][0]
        dev = self.devs[d]
        V = {name: Variable(name, lo, hi) for name, (lo, hi) in t.vars.items()}
        q = self.queue(t.ring)

        def sig(ref: tuple) -> Any:
            if ref[0] == "sig": return dev.replica(self.S[ref[1]])  # (itself where dev may write it: its own peer group's)
            return dev.signal_t(base_buf=HCQBuffer(V[ref[1]], 16), owner=dev)

        def addr(ref: tuple) -> Any:
            base = self.B[ref[1][1]].va_addr if ref[1][0] == "buf" else V[ref[1][1]]
            off = ev(ref[2], V)
            return base if isinstance(off, int) and off == 0 else base + off

        for c in t.cmds:
            op = c[0]
            if op == "wait": q.wait(sig(c[1]), ev(c[2], V))
            elif op == "signal": q.signal(sig(c[1]), ev(c[2], V))
            elif op == "ts": q.timestamp(sig(c[1]))
            elif op == "barrier": q.memory_barrier()
            elif op == "write": q.write(HCQBuffer(addr(c[1]), 8 if c[3] else 4) if t.asbuf else addr(c[1]), ev(c[2], V), c[3])
            elif op == "poll": q.poll_bit(addr(c[1]), ev(c[2], V), ev(c[3], V), c[4])
            elif op == "copy": q.copy(addr(c[1]), addr(c[2]), ev(c[3], V))
            elif op == "exec":
                _, kname, regions, vals, gs, ls = c
                prg = self.prgs[d][kname]
                bufs = tuple(HCQBuffer(addr(rg), 4 * region_words(kname)) for rg in regions)
                q.exec(prg, prg.fill_kernargs(bufs, tuple(ev(v, V) for v in vals)), tuple(ev(x, V) for x in gs), tuple(ev(x, V) for x in ls))
            else:
                raise ValueError(c)
        if t.bound: q.bind(dev)
        return q

    # ---------------------------------------------------------------- end of program
    def drain(self) -> None:
        prog, model = self.prog, self.model
        for sid, s in enumerate(prog.sigs):
            if s.kind in ("p", "tl") and model.sig[sid]:
                self.wait(self.S[sid], self.real(sid, model.sig[sid]), f"final wait for {s.kind} signal {sid} (ring {prog.rings[s.writer] if s.writer is not None else 'timeline'})")
        for dev in self.devs[:prog.ndev]: _check_device_error(dev, "fuzz program end")

    def check(self) -> None:
        prog, model = self.prog, self.model
        rep = repro_of(prog, self.target)
        for bid, b in enumerate(prog.bufs):
            got, want = self.host_read(self.B[bid], 0, b.size), bytes(model.mem[bid])
            mask = model.taint.get(bid) if model.taint is not None else None
            if not masked_equal(got, want, mask):
                diffs = [i for i in range(0, len(want), 4) if not masked_equal(got[i:i + 4], want[i:i + 4], mask[i:i + 4] if mask else None)]
                detail = ", ".join(f"byte {i}: got {got[i:i + 4].hex()} want {want[i:i + 4].hex()}" for i in diffs[:4])
                raise FuzzFailure(prog.seed, f"buffer {bid} ({b.kind} {b.index} of {self.name(b.dev)}) differs at {len(diffs)} word(s): {detail}", rep)
        for sid, s in enumerate(prog.sigs):
            got, want = self.S[sid].value, self.real(sid, model.sig[sid])
            if got != want: raise FuzzFailure(prog.seed, f"signal {sid} ({s.kind}) is {got}, the model says {want}", rep)
        for d in range(prog.ndev):
            want = self.base[d] + model.sig[self.TL[d]]
            if self.devs[d].timeline_value != want:
                raise FuzzFailure(prog.seed, f"{self.name(d)} timeline_value is {self.devs[d].timeline_value}, want {want}", rep)
        stamped = {e[0] for e in model.ts_events}
        ts = {sid: self.S[sid].load_timestamp() for sid, s in enumerate(prog.sigs) if s.kind == "t"}
        for sid, v in ts.items():
            if (sid in stamped) != (v != 0): raise FuzzFailure(prog.seed, f"timestamp signal {sid}: stamped={sid in stamped} but raw timestamp {v}", rep)
        group = [prog.shapes[d].group for d, _, _ in prog.rings]  # (devices of one peer group share a clock; others need not)
        for a in model.ts_events:
            for b in model.ts_events:
                if a is not b and group[a[1]] == group[b[1]] and b[3].get(a[1], 0) >= a[2] and ts[a[0]] > ts[b[0]]:
                    raise FuzzFailure(prog.seed, f"timestamp {a[0]} ({ts[a[0]]}) happens before {b[0]} but is later ({ts[b[0]]})", rep)

    def unblock(self) -> None:
        """After a failure: keep everything the program's queues could wait on satisfied until every ring drained
        (pending packets may lower a signal again, hence the loop), then repair the timelines."""
        devs = self.devs[:self.prog.ndev]
        polls = [c for st in self.prog.steps if st[0] == "submit" for c in st[2] if c[0] == "poll"]
        try:
            deadline = time.monotonic() + self.timeout_ms / 1000
            for dev in devs:
                if _device_error(dev) is not None: _recover(dev, self.timeout_ms)
            while True:
                for sid, s in enumerate(self.prog.sigs):
                    if s.kind in ("p", "u", "g"): self.S[sid].value = M64 >> 1
                for sig in self.extra_sigs: sig.value = M64 >> 1
                for _, bid, off, value, mask, b64 in polls:
                    self.host_write(self.B[bid], off, value.to_bytes(8 if b64 else 4, "little"))
                for dev in devs:
                    if dev.timeline_signal.value < dev.timeline_value - 1: dev.timeline_signal.value = dev.timeline_value - 1
                if all(_rings_drained(dev) for dev in devs): break
                if time.monotonic() > deadline: raise RuntimeError(f"rings did not drain: {[_ring_stats(d) for d in devs]}")
                time.sleep(0.001)
            for dev in devs:
                if _device_error(dev) is not None: _recover(dev, self.timeout_ms)
                dev.error_state = None
                if dev.timeline_signal.value < dev.timeline_value - 1: dev.timeline_signal.value = dev.timeline_value - 1
                dev.synchronize(timeout=self.timeout_ms)
        except Exception as e:  # noqa: BLE001 - recorded: later programs are refused
            self.broken = f"{type(e).__name__}: {e}"


# ====================================================================== driver
@dataclass
class Stats:
    programs: int = 0
    commands: int = 0
    steps: int = 0
    seconds: float = 0.0
    failures: list[FuzzFailure] = field(default_factory=list)
    events: Counter[str] = field(default_factory=Counter)  # what the optional features did (see Runner.events)


def run_one(seed: int, max_devices: int = 3, runner: Runner | None = None, timeout_ms: int = DEFAULT_TIMEOUT_MS,
            features: Features = DEFAULT_FEATURES, target: Target | str = "CPU") -> tuple[Program, Model]:
    """Generate, model and run the program of `seed` on the devices of `target` (the runner's when one is given);
    raises FuzzFailure (or GeneratorBug) on a mismatch. Returns the program and the model it was checked against.
    Features the devices' runner cannot judge are left out (see `_supported_features`)."""
    runner = runner or Runner(timeout_ms, target)
    prog = generate(seed, max_devices, _supported_features(runner.devices(max_devices), features), runner.shapes(max_devices))
    model = Model(prog).run()
    model = runner.run(prog, model)
    return prog, model


def run(seed: int, programs: int, max_devices: int = 3, timeout_ms: int = DEFAULT_TIMEOUT_MS, keep_going: bool = False,
        log: Callable[[str], None] | None = None, every: int = 0, features: Features = DEFAULT_FEATURES, target: Target | str = "CPU",
        runner: Runner | None = None) -> Stats:
    """Run programs seed, seed+1, ... on the devices of `target` (the runner's when one is given); stops at the first
    failure unless keep_going."""
    runner = runner or Runner(timeout_ms, target)
    st = Stats(events=runner.events)
    if log and (sup := _supported_features(runner.devices(max_devices), features)) != features:
        log(f"{runner.name(list(range(max_devices)))}: running with{sup.flags()} (the runner judges interrupts by the rings' positions)")
    t0 = time.perf_counter()
    for i in range(programs):
        s = seed + i
        try:
            prog, model = run_one(s, max_devices, runner, timeout_ms, features)
            st.commands += model.cmds_run
            st.steps += len(prog.steps)
        except FuzzFailure as e:
            st.failures.append(e)
            if log: log(str(e))
            if not keep_going or runner.broken:
                st.programs += 1
                break
        st.programs += 1
        if log and every and (i + 1) % every == 0:
            el = time.perf_counter() - t0
            log(f"  {i + 1} programs, {st.commands} commands, {el:.1f} s ({(i + 1) / el:.0f} programs/s)")
    st.seconds = time.perf_counter() - t0
    return st


def _short(x: Any) -> Any:
    if isinstance(x, bytes): return f"<{len(x)} bytes>"
    if isinstance(x, tuple): return tuple(_short(y) for y in x)
    return x


def dump(prog: Program, target: Target | str = "CPU") -> str:
    name = Target.of(target).device
    lines = [f"program seed={prog.seed}: {prog.ndev} device(s), {len(prog.steps)} steps" + (", staged host copies" if prog.staged else "")]
    lines.extend(f"  device {d} {name(d)}: {sh}" for d, sh in enumerate(prog.shapes) if sh != CPU_SHAPE)
    for i, s in enumerate(prog.sigs): lines.append(f"  sig {i}: {s.kind} {name(s.dev)}" + (f" writer {prog.rings[s.writer]}" if s.writer is not None else "")
                                                   + (f" opens at {s.full}" if s.kind == "g" else ""))
    for t in prog.templates.values(): lines.append(f"  template {t.tid} on {prog.rings[t.ring]}: bound={t.bound} drain={t.drain} {t.cmds}")
    for g in prog.graphs.values():
        lines.append(f"  graph {g.gid} on {[name(d) for d in g.devs]}, variables {g.vars}")
        lines.extend(f"        item {j}: {it}" for j, it in enumerate(g.items))
    for sid, specs in prog.sections.items():
        for t, ts in enumerate(specs):
            lines.append(f"  section {sid} thread {t}: buffers on {[name(d) for d, _ in ts.bufs]}, chain signal of {name(ts.sig_dev)} "
                         f"({'made before' if ts.sig_early else 'made by the thread'}), {'drops' if ts.drop else 'keeps'} its queues")
            lines.extend(f"        {_short(op)}" for op in ts.ops)
    for i, st in enumerate(prog.steps):
        k = prog.interrupts.get(i)
        intr = "" if k is None else f"  <- SIGINT {when(k)}" + (", copy ring held back" if i in prog.holds else "")
        if st[0] == "submit":
            lines.append(f"  [{i}] submit {prog.rings[st[1]]} {({k: v for k, v in st[3].items() if k != 'env'})}{intr}")
            lines.extend(f"        {c if c[0] not in ('hcopyin',) else c[:3]}" for c in st[2])
        else:
            lines.append(f"  [{i}] {_short(st)}{intr}")
    return "\n".join(lines)


class Served:
    """An `hcq serve` on loopback for a run (--serve), started as hcq.bench.remote starts one for `transport`: its
    environment there for the server, with SERVED_COPY_ENGINES copy queues (the last for `_Staged`); the client's set in this process
    while it runs (before any remote device opens: UCX reads it when a connection starts)."""

    def __init__(self, transport: str, kind: str = "CPU"):
        from hcq.bench.remote import _serve, CLIENTS, SERVE_ARGS, TRANSPORTS
        self.saved: dict[str, str | None] = {}  # this process's values of the client's variables, put back by close()
        queues = {"HCQ_CPU_COPY_ENGINES": str(SERVED_COPY_ENGINES), "HCQ_VK_COPY_QUEUES": str(SERVED_COPY_ENGINES)}
        self.proc, address, self.log = _serve({**os.environ, **TRANSPORTS[transport], **queues},
                                              ("--devices", ",".join(f"{kind}:{i}" for i in range(SERVED_DEVICES[kind])), *SERVE_ARGS.get(transport, ())))
        if address is None:
            self.close()
            raise RuntimeError(f"hcq serve did not start: {self.log_tail()}")
        self.address = address
        self.saved = {k: os.environ.get(k) for k in CLIENTS[transport]}
        os.environ.update(CLIENTS[transport])

    def log_tail(self, n: int = 3000) -> str:
        self.log.seek(0)
        return self.log.read()[-n:]

    def close(self) -> None:
        for k, v in self.saved.items():
            if v is None: os.environ.pop(k, None)
            else: os.environ[k] = v
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def main(argv: list[str] | None = None) -> int:
    from hcq.bench.remote import TRANSPORTS
    ap = argparse.ArgumentParser(prog="python -m tools.fuzz", description=__doc__.split("\n\n")[0])
    ap.add_argument("--programs", type=int, default=300, help="number of programs (seeds SEED .. SEED+N-1)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="CPU", metavar="KIND", help="the kind of device to open: KIND:0, KIND:1, ... (default CPU); or "
                    "kinds, comma-separated: device i is of the i-th kind listed, the last one repeating (VK,CPU: VK:0, CPU:0, CPU:1)")
    where = ap.add_mutually_exclusive_group()
    where.add_argument("--remote", metavar="HOST:PORT", help="open KIND:0@HOST:PORT, KIND:1@HOST:PORT, ... (an hcq serve there, "
                       f"served with HCQ_CPU_COPY_ENGINES={SERVED_COPY_ENGINES})")
    where.add_argument("--serve", choices=list(TRANSPORTS), help="start an hcq serve on loopback for the run (UCX transport as in "
                       "hcq.bench.remote) and open its devices")
    ap.add_argument("--serve-kind", choices=list(SERVED_DEVICES), default="CPU", help="the kind of device the server hosts (default CPU; "
                    "VK: its one VK:0, so --device VK --devices 1); --device kinds of another kind stay local")
    ap.add_argument("--devices", type=int, default=3, choices=(1, 2, 3), help="at most this many devices per program")
    ap.add_argument("--timeout", type=int, default=DEFAULT_TIMEOUT_MS, help="watchdog: ms a wait may go without progress")
    ap.add_argument("--keep-going", action="store_true", help="continue after a failure (when the devices could be drained)")
    ap.add_argument("--dump", action="store_true", help="print each program before running it")
    ap.add_argument("--validate", action="store_true", help="run with validation mode on (as HCQ_VALIDATE=1): valid programs must pass it")
    ap.add_argument("--no-interrupts", action="store_true", help="no SIGINT inside runtime calls")
    ap.add_argument("--no-graphs", action="store_true", help="no graphs with faulting items, no faulting launches")
    ap.add_argument("--no-threads", action="store_true", help="no sections run on several Python threads")
    args = ap.parse_args(argv)
    features = Features(interrupts=not args.no_interrupts, graphs=not args.no_graphs, threads=not args.no_threads)
    from hcq import HCQError
    from hcq.registry import available_backends
    kind = Target.of(args.device).kind
    if any(k not in available_backends() for k in kind.split(",")):
        ap.error(f"--device takes a kind of device (or kinds, comma-separated), each one of {', '.join(available_backends())} (got {args.device!r})")
    served, rc = None, 1
    try:
        served = Served(args.serve, args.serve_kind) if args.serve else None
        rc = _main(args, features, Target(kind, served.address, args.serve, args.serve_kind) if served else Target(kind, args.remote, None, args.serve_kind))
    except (RuntimeError, HCQError) as e:  # a server that did not start, devices that do not open or the runner cannot use
        print(f"python -m tools.fuzz: {e}", file=sys.stderr)
        rc = 2
    finally:
        if served is not None:
            served.close()
            if rc and (tail := served.log_tail().strip()): print(f"the log of hcq serve ({args.serve}) at {served.address}:\n{tail}")
    return rc


def _main(args: argparse.Namespace, features: Features, target: Target) -> int:
    """main, once the devices' server (if any) runs."""
    runner = Runner(args.timeout, target)
    if (sup := _supported_features(runner.devices(args.devices), features)) != features:
        print(f"{runner.name(list(range(args.devices)))}: running with{sup.flags()} (the runner judges interrupts by the rings' positions)")
        features = sup
    if args.validate:
        from hcq import validation
        validation.set_enabled(True)
    if args.dump:
        for i in range(args.programs): print(dump(generate(args.seed + i, args.devices, features, runner.shapes(args.devices)), target))
    st = run(args.seed, args.programs, args.devices, args.timeout, args.keep_going, log=print, every=max(100, args.programs // 10),
             features=features, target=target, runner=runner)
    rate = st.programs / st.seconds if st.seconds else 0.0
    print(f"tools.fuzz: {st.programs} programs ({st.steps} steps, {st.commands} device commands) in {st.seconds:.1f} s: "
          f"{rate:.0f} programs/s, {st.commands / st.seconds if st.seconds else 0:.0f} commands/s; {len(st.failures)} failure(s)")
    if st.events: print("  " + ", ".join(f"{k}: {v}" for k, v in sorted(st.events.items())))
    for f in st.failures: print(f"FAILED seed {f.seed}: {f.repro}")
    return 1 if st.failures else 0


if __name__ == "__main__":
    sys.exit(main())
