"""HCQGraph: a recorded sequence of kernel launches and copies over devices (of one or several peer groups), encoded
once into static queues (a compute queue per device, copy queues as needed), bound into device memory, and
replayed by patching only the symbols that changed (input addresses, variables, timeline values, kickoff).

Build: inputs become symbolic addresses; kernargs for all items are allocated once per device and filled;
dependencies come from buffer reads/writes (an item writes its `outs`, by default its first buffer, and
reads the rest), waits already implied by earlier waits on the same queue are dropped (vector clocks), and
no queue waits on itself. Every queue first waits for the graph's kickoff signal and for the timelines of
all devices of the graph (so a run follows earlier work); at the end each device's compute queue waits for
every graph queue and signals its device's timeline. Across peer groups, waits go to replicas of the signals
(`HCQCompiled.replica`), copies write mappings the backends provide, each group has its own kickoff, and queue
signal values grow from run to run (docs/design.md, "Across peer groups")."""
from __future__ import annotations

import time
from array import array
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence, cast

from hcq import hotpath, interrupts, profiler, recorder, validation
from hcq.allocator import copy_engine, landed_view
from hcq.device import HCQCompiled
from hcq.device_state import OPEN, TIMELINE_ADDRESS, TIMELINE_VALUE
from hcq.graph_state import KICKOFF, last_run_at, words as state_words
from hcq.errors import HCQError
from hcq.helpers import env_flag, getenv, round_up
from hcq.lifetimes import FREES
from hcq.memory import RUNTIME_SPEC, HCQBuffer, MMIOInterface
from hcq.packets import SIGNAL_TIMESTAMP_OFFSET, WORD_BYTES
from hcq.program import Dims, HCQProgram, as_dims
from hcq.interfaces import COMPUTE, COPY
from hcq.queue import HWQueue
from hcq.signal import HCQSignal, SignalReplica
from hcq.symbolic import UnboundVariableError, Variable, resolve, sint

ADDR_MAX = (1 << 64) - 1


@dataclass
class ExecItem:
    """A kernel launch. `outs`: indices of `bufs` the kernel writes (default: the first)."""
    prg: HCQProgram
    bufs: tuple[HCQBuffer, ...]
    vals: tuple[sint, ...] = ()
    global_size: Dims = (1, 1, 1)
    local_size: Dims = (1, 1, 1)
    outs: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        self.global_size, self.local_size = as_dims(self.global_size), as_dims(self.local_size)  # an int n is (n,)

    @property
    def device(self) -> HCQCompiled:
        """The device the kernel runs on (its program's)."""
        return self.prg.dev

    @property
    def name(self) -> str:
        """The kernel's name."""
        return self.prg.name

    def accesses(self) -> tuple[list[HCQBuffer], list[HCQBuffer]]:
        """(reads, writes) as buffers."""
        outs = (0,) if self.outs is None else self.outs
        return [b for i, b in enumerate(self.bufs) if i not in outs], [self.bufs[i] for i in outs if i < len(self.bufs)]


@dataclass
class CopyItem:
    """A copy of `nbytes` from `src` to `dest`: on the device's copy queue, or a transfer (on the source
    device's copy engine) when they sit on different devices of the peer group."""
    dest: HCQBuffer
    src: HCQBuffer
    nbytes: sint

    @property
    def device(self) -> HCQCompiled:
        """The device whose copy engine runs the copy: the source buffer's owner, or across peer groups the destination's
        when only it reaches the other's memory (hcq.allocator.copy_engine)."""
        if self.src.owner is None: raise HCQError(f"CopyItem source {self.src!r} has no owning device")
        src_dev, dest_dev = self.src.owner, self.dest.owner
        if dest_dev is None or dest_dev.peer_group == src_dev.peer_group: return cast(HCQCompiled, src_dev)
        return cast(HCQCompiled, copy_engine(src_dev, dest_dev, self.dest, self.src))  # (owners are devices)

    @property
    def name(self) -> str:
        """A name for traces: size and devices."""
        dest = self.dest.owner.device if self.dest.owner else "?"
        size = self.nbytes.expr if hasattr(self.nbytes, "expr") else self.nbytes
        return f"copy {size}B {self.device.device}->{dest}"

    def accesses(self) -> tuple[list[HCQBuffer], list[HCQBuffer]]:
        """(reads, writes) as buffers: the copy reads `src` and writes `dest`."""
        return [self.src], [self.dest]


class _LandedCopy(CopyItem):
    """The second half of a graph's copy into memory whose device's host does not write it: the device's own queue moves
    the bytes from the landing buffer into place (as `HCQAllocator.transfer` does), on a copy queue if it has one."""

    @property
    def name(self) -> str:
        return super().name + " (landed)"


Item = ExecItem | CopyItem
QueueKey = tuple[HCQCompiled, str, int]  # (device, "compute" | "copy", index)


@dataclass
class GraphEntry:
    """One item as the profiler sees it: its device and queue, timestamp signals and the items it depends on."""
    index: int
    name: str
    dev: HCQCompiled
    queue: tuple[str, int]
    st: HCQSignal
    en: HCQSignal
    deps: list[int] = field(default_factory=list)
    nbytes: sint | None = None  # copies only (may be symbolic: resolved with the run's variables)

    @property
    def device(self) -> str:
        """The name of the item's device."""
        return self.dev.device


@dataclass
class _Planned:
    item: Item
    queue: QueueKey
    value: int
    waits: list[tuple[QueueKey, int]]
    dep_items: list[int]


@dataclass
class RunPlan:
    """What a graph run that changes only the per-run values (the kickoff, each device's timeline wait and signal) may
    assume, noted when a run went in through Python: the later runs it holds for patch only those words
    (`HCQGraph._fast_patch` in Python; hcq/_hotpath.c's GraphRun, which takes it through `use`, checks the same)."""
    inputs: tuple[HCQBuffer, ...]
    user_vals: dict[str, int]  # (never changed once noted)
    timelines: tuple[int, ...]  # each device's timeline address state word at that run (hcq.device_state)
    frees: int  # lifetimes.FREES[0] when the inputs were last seen live: they are looked at again only after a free

    def holds(self, devices: Sequence[HCQCompiled], inputs: tuple[HCQBuffer, ...], user_vals: dict[str, int]) -> bool:
        """Whether a run with `inputs` and `user_vals` changes only the per-run values: the same input objects, none freed,
        the same variables, every device open on the same timeline signal, validation off."""
        if validation.enabled or user_vals != self.user_vals or len(inputs) != len(self.inputs): return False
        for new, old in zip(inputs, self.inputs):
            if new is not old: return False
        if self.frees != FREES[0]:
            if any(b._root._freed for b in inputs): return False
            self.frees = FREES[0]
        for dev, addr in zip(devices, self.timelines):
            state = dev._state  # (hcq.device_state: open, and the timeline signal's address)
            if not state[OPEN] or state[TIMELINE_ADDRESS] != addr: return False
        return True


class HCQGraph:
    """Static queues for `items`, replayed with `g(inputs=..., var_vals=..., wait=...)`.

    Buffers listed in `inputs` (and views of them) are placeholders: each run passes buffers of at least the
    same size to use instead. `vals`, `global_size`, `local_size` and copy sizes may hold Variables, resolved
    from `var_vals` on each run."""

    def __init__(self, items: Sequence[Item], inputs: Sequence[HCQBuffer] = (), profile: bool | None = None):
        if not items: raise ValueError("HCQGraph needs at least one item")
        self.items: list[Item] = list(items)
        self.inputs = tuple(inputs)
        self.profile = (profiler.active is not None) if profile is None else profile
        self._check_items()
        self.devices: list[HCQCompiled] = list(dict.fromkeys(it.device for it in self.items))
        for it in self.items:  # (both ends of a copy take part, whichever engine runs it: their earlier work is ordered before it)
            if isinstance(it, CopyItem):
                for end in (it.dest.owner, it.src.owner):
                    if end is not None and end not in self.devices: self.devices.append(cast(HCQCompiled, end))
        _drop_dead_replicas()
        # Devices of several peer groups: each group has its own kickoff, a queue waits on replicas of the signals of
        # other groups (made by the backends), and queue signals only ever grow (values offset by a per-run epoch), so
        # a replica never needs a reset that could race with a late push of an older value.
        self.groups = list(dict.fromkeys(d.peer_group for d in self.devices))
        self.multi_group = len(self.groups) > 1
        # What the queues run: the items, each copy that lands followed by the copy that moves it into place
        # (`_item_of[step]` is the item a step belongs to, for messages and traces)
        self._steps: list[Item] = []
        self._item_of: list[int] = []
        for i, it in enumerate(self.items):
            self._steps.append(it)
            self._item_of.append(i)
            if isinstance(it, CopyItem):
                dest_dev = it.dest.owner
                across = dest_dev is not None and dest_dev.peer_group != it.device.peer_group
                pulled = cast(HCQCompiled, it.src.owner).peer_group != it.device.peer_group
                if (across and id(it.dest.base) in {id(b.base) for b in self.inputs}) or (pulled and id(it.src.base) in {id(b.base) for b in self.inputs}):
                    raise HCQError(f"item {i}: a graph input cannot be the {'source' if pulled else 'destination'} of a copy across peer "
                                   f"groups ({cast(HCQCompiled, it.src.owner).device} -> {cast(HCQCompiled, dest_dev).device}): the mapping is "
                                   "made for one buffer")
                it.device.allocator.map(it.dest)
                if dest_dev is not None and not across: dest_dev.allocator.map(it.src)
                if (landing := landed_view(it.dest, it.device)) is not None:
                    # the bytes land in memory of dest's device that its host writes (a landing buffer made for this one buffer,
                    # as the mapping is: across peer groups dest is no input); a copy on that device's own queue moves them into
                    # place, as allocator.transfer does: it writes dest after the copy, so it runs after it, and later users of
                    # dest wait for it
                    self._steps.append(_LandedCopy(it.dest, landing, it.nbytes))
                    self._item_of.append(i)

        self.input_vars = [Variable(f"__hcq_graph_input{i}", 0, ADDR_MAX) for i in range(len(self.inputs))]
        self._input_index: dict[int, list[int]] = {}
        for i, b in enumerate(self.inputs): self._input_index.setdefault(id(b.base), []).append(i)
        self._written_inputs = self._input_writers()
        # The buffers it bakes in (those not inside an input), by the first item that uses each: see _check_baked
        baked = {id(b.base): (self._item_of[s], b.base) for s, it in reversed(list(enumerate(self._steps))) for b in sum(it.accesses(), [])
                 if self._input_holding(b) is None}
        self._baked, self._baked_seen = list(baked.values()), -1
        self.kickoff_var = Variable("__hcq_graph_kickoff", 0, ADDR_MAX)
        self.tl_addr_vars = [Variable(f"__hcq_graph_tl_addr{i}", 0, ADDR_MAX) for i in range(len(self.devices))]
        self.tl_wait_vars = [Variable(f"__hcq_graph_tl_wait{i}", 0, ADDR_MAX) for i in range(len(self.devices))]
        self.tl_signal_vars = [Variable(f"__hcq_graph_tl_signal{i}", 0, ADDR_MAX) for i in range(len(self.devices))]
        self.virt_timelines = [d.signal_t(base_buf=HCQBuffer(v, 16), owner=d) for d, v in zip(self.devices, self.tl_addr_vars)]
        self.kickoff = self.devices[0].new_signal(value=0)
        self.kickoffs = {self.devices[0].peer_group: self.kickoff}
        for d in self.devices:
            if d.peer_group not in self.kickoffs: self.kickoffs[d.peer_group] = d.new_signal(value=0)
        # the run state words (hcq.graph_state: the kickoff value, each device's last-run mark), which the native run advances in place
        self._marks = array("Q", bytes(8 * state_words(len(self.devices))))
        self._last_run_values = [last_run_at(i) + 1 for i in range(len(self.devices))]  # the words of each device's last-run value
        self._last_signals: tuple[HCQSignal, ...] = ()  # the timeline signals the last run signals (its values are in _marks)
        self._synced_kickoff = 0  # the kickoff value the Python bookkeeping of the per-run values is at (see _catch_up)
        self._epoch_var = Variable("__hcq_graph_epoch", 0, ADDR_MAX)  # (several peer groups only) added to queue signal values
        self._tl_replica_vars: dict[tuple[int, str], Variable] = {}  # (device index, group waiting) -> address of the replica
        self._virt_replicas: dict[tuple[int, str], HCQSignal] = {}
        self._replica_sources: list[HCQSignal] = []  # queue signals other groups wait on through replicas

        self._alloc_kernargs()
        self.plan = self._resolve_deps()
        self._stride = max((p.value for p in self.plan), default=0) + 1  # epoch step: a run's queue signal values stay below the next's
        self.queues: dict[QueueKey, HWQueue] = {}
        self.queue_signals: dict[QueueKey, HCQSignal] = {}
        self.final_values: dict[QueueKey, int] = {}
        self.text: dict[QueueKey, list[str]] = {}
        self.prof_entries: list[GraphEntry] = []
        self._encode()
        for key, q in self.queues.items(): q.bind(key[0])
        # What every run touches, looked up once.
        self._queue_list = list(self.queues.items())
        self._queue_sigs = list(self.queue_signals.values())
        self._kickoff_name, self._input_names = self.kickoff_var.name, [v.name for v in self.input_vars]
        self._timeline_names = [(a.name, w.name, s.name) for a, w, s in zip(self.tl_addr_vars, self.tl_wait_vars, self.tl_signal_vars)]
        self._epoch_name = self._epoch_var.name
        self._replica_names = [(di, group, v.name) for (di, group), v in self._tl_replica_vars.items()]
        internal = {self._kickoff_name, self._epoch_name, *self._input_names, *(n for names in self._timeline_names for n in names),
                    *(name for _, _, name in self._replica_names)}
        used = {n for q in self.queues.values() for _, e in q.q_sints for n in e.variables} | \
               {n for q in self.queues.values() for _, _, e in q.mv_sints for n in e.variables}
        self.variables: frozenset[str] = frozenset(used - internal)  # the names a run's var_vals give values to
        self._prof_target: profiler.Profiler | None = None  # the profiler owed this graph's last run
        self._run_var_vals: dict[str, int] = {}
        self._run_plan: RunPlan | None = None  # what a run that changes only the per-run values assumes (None: no such run yet)
        self._per_run = self._plan_per_run()
        self._native: Any = None  # the native run (see _native_run): made after the first run, remade after a timeline wrap
        self._native_timeline: HCQSignal | None = None
        self._run_lock = hotpath.ring_lock()  # (a RingLock where the extension is: the native run takes it too)

    # ------------------------------------------------------------------ build
    def _check_items(self) -> None:
        for i, it in enumerate(self.items):
            if isinstance(it, ExecItem):
                it.prg.check_args(it.bufs, it.vals)
            elif isinstance(it, CopyItem):
                for what, b in (("dest", it.dest), ("src", it.src)):
                    if not isinstance(b, HCQBuffer): raise TypeError(f"item {i}: CopyItem {what} must be an HCQBuffer, got {b!r}")
                    if isinstance(it.nbytes, int) and it.nbytes > b.size: raise ValueError(f"item {i}: copy of {it.nbytes} bytes overruns {what} {b!r}")
                if it.dest.readonly: raise ValueError(f"item {i}: CopyItem dest {it.dest!r} is read-only memory")
                if not it.device.capabilities.queue_count(COPY): raise HCQError(f"item {i}: {it.device.device} has no copy queue")
            else:
                raise TypeError(f"graph items must be ExecItem or CopyItem, got {type(it).__name__}")

    def _input_writers(self) -> dict[int, str]:
        """Input index -> the first item that writes into that input (a kernel parameter not declared const, or, for
        a program without argument reflection, one of its `outs`; a copy's destination): a run may not put read-only
        memory there."""
        found: dict[int, str] = {}
        for i, it in enumerate(self.items):
            if isinstance(it, ExecItem) and (slots := getattr(it.prg, "arg_slots", None)) is not None:
                written = [(b, f"kernel {it.name}, parameter {s.name!r}") for s, b in zip([s for s in slots if s.is_pointer], it.bufs) if not s.read_only]
            else:
                what = "copy destination" if isinstance(it, CopyItem) else f"kernel {it.name}, one of its outs"
                written = [(b, what) for b in it.accesses()[1]]
            for b, what in written:
                if (idx := self._input_holding(b)) is not None: found.setdefault(idx, f"item {i} ({what})")
        return found

    def _input_holding(self, b: HCQBuffer) -> int | None:
        """The index of the input `b` lies inside (an input may be a view: only buffers inside it follow the run's
        buffer), or None."""
        for idx in self._input_index.get(id(b.base), ()):
            inp = self.inputs[idx]
            if inp.va_addr <= b.va_addr and b.va_addr + b.size <= inp.va_addr + inp.size: return idx  # type: ignore[operator]
        return None

    def _sym(self, b: HCQBuffer) -> HCQBuffer:
        """The buffer as the static queues see it: inputs (and views of them) get a symbolic address."""
        if (idx := self._input_holding(b)) is None: return b
        return HCQBuffer(self.input_vars[idx] + (b.va_addr - self.inputs[idx].va_addr), b.size, _base=None, owner=b.owner)

    def _alloc_kernargs(self) -> None:
        self.kernargs_bufs: dict[HCQCompiled, HCQBuffer] = {}
        sizes: dict[HCQCompiled, int] = {}
        for it in self._steps:
            if isinstance(it, ExecItem): sizes[it.device] = sizes.get(it.device, 0) + round_up(it.prg.kernargs_alloc_size, 16)
        for dev, size in sizes.items():
            self.kernargs_bufs[dev] = dev.allocator.alloc(size, RUNTIME_SPEC, internal=True)
        offsets = dict.fromkeys(sizes, 0)
        self.args: dict[int, Any] = {}  # (by step)
        for i, it in enumerate(self._steps):
            if not isinstance(it, ExecItem): continue
            size = it.prg.kernargs_alloc_size
            kbuf = self.kernargs_bufs[it.device].offset(offsets[it.device], size)
            offsets[it.device] += round_up(size, 16)
            self.args[i] = it.prg.fill_kernargs(tuple(self._sym(b) for b in it.bufs), it.vals, kernargs=kbuf)

    def _queue_for(self, i: int, it: Item, copy_rr: dict[HCQCompiled, int]) -> QueueKey:
        dev = it.device
        if isinstance(it, ExecItem) or (isinstance(it, _LandedCopy) and not dev.capabilities.queue_count(COPY)): return (dev, "compute", 0)
        n = max(1, min(getenv("HCQ_NUM_SDMA", min(len(self.devices), 8) if env_flag("ALL2ALL", False) else 1, lo=1), dev.capabilities.queue_count(COPY)))
        idx = copy_rr.get(dev, 0)
        copy_rr[dev] = (idx + 1) % n
        return (dev, "copy", idx)

    def _resolve_deps(self) -> list[_Planned]:
        """Assign queues and per-queue values; compute each item's waits, minus those already implied."""
        last_write: dict[int, tuple[QueueKey, int, int]] = {}  # buffer base id -> (queue, value, item)
        readers: dict[int, dict[QueueKey, tuple[int, int]]] = {}
        known: dict[QueueKey, dict[QueueKey, int]] = {}  # what each queue has observed of every queue
        clocks: dict[tuple[QueueKey, int], dict[QueueKey, int]] = {}
        counts: dict[QueueKey, int] = {}
        copy_rr: dict[HCQCompiled, int] = {}
        plan = []
        for i, it in enumerate(self._steps):
            q = self._queue_for(i, it, copy_rr)
            reads, writes = it.accesses()
            deps: dict[QueueKey, tuple[int, int]] = {}

            def need(dep: tuple[QueueKey, int, int]) -> None:
                dq, dv, di = dep
                if dv > deps.get(dq, (0, -1))[0]: deps[dq] = (dv, di)

            for b in reads:
                if (w := last_write.get(id(b.base))) is not None: need(w)
            for b in writes:
                if (w := last_write.get(id(b.base))) is not None: need(w)
                for rq, (rv, ri) in readers.get(id(b.base), {}).items(): need((rq, rv, ri))
            mine = known.setdefault(q, {})
            waits, dep_items = [], sorted({di for _, di in deps.values()})
            for dq, (dv, _) in sorted(deps.items(), key=lambda kv: -kv[1][0]):
                if dq == q or mine.get(dq, 0) >= dv: continue  # own order, or implied by an earlier wait
                waits.append((dq, dv))
                for k, v in clocks[(dq, dv)].items():
                    if v > mine.get(k, 0): mine[k] = v
            counts[q] = counts.get(q, 0) + 1
            mine[q] = counts[q]
            clocks[(q, counts[q])] = dict(mine)
            for b in writes:
                last_write[id(b.base)] = (q, counts[q], i)
                readers[id(b.base)] = {}
            for b in reads: readers.setdefault(id(b.base), {})[q] = (counts[q], i)
            plan.append(_Planned(it, q, counts[q], waits, dep_items))
        self._known, self._clocks = known, clocks
        return plan

    def _get_queue(self, key: QueueKey) -> HWQueue:
        if key in self.queues: return self.queues[key]
        dev, kind, idx = key
        # the graph reports its items itself (with their dependencies), so its queues do not
        q = dev.hw_compute_queue_t(profile=False) if kind == COMPUTE else dev.hw_copy_queue_t(idx, profile=False)  # type: ignore[misc]
        self.queues[key], self.queue_signals[key], self.text[key] = q, dev.new_signal(value=0), []
        q.wait(self.kickoffs[dev.peer_group], self.kickoff_var)
        self.text[key].append("wait kickoff")
        for di, (d, sig, v) in enumerate(zip(self.devices, self.virt_timelines, self.tl_wait_vars)):  # after earlier work on every device
            q.wait(sig if d.peer_group == dev.peer_group else self._timeline_replica(di, dev), v)
            self.text[key].append(f"wait {d.device} timeline")
        if kind == "compute":
            self.start_ts[dev] = dev.new_signal()
            q.memory_barrier().timestamp(self.start_ts[dev])
        return q

    def _timeline_replica(self, di: int, waiter: HCQCompiled) -> HCQSignal:
        """A virtual signal at the address (patched each run) of the replica, in `waiter`'s peer group, of device
        `di`'s timeline signal (which changes when the timeline wraps)."""
        key = (di, waiter.peer_group)
        if key not in self._virt_replicas:
            var = self._tl_replica_vars[key] = Variable(f"__hcq_graph_tl_replica{di}_{self.groups.index(waiter.peer_group)}", 0, ADDR_MAX)
            self._virt_replicas[key] = SignalReplica(self.devices[di].timeline_signal, var, waiter)  # (validation skips replicas)
        return self._virt_replicas[key]

    def _holder(self, group: str) -> HCQCompiled:
        """The graph's device that holds the replicas its peer group waits on."""
        return next(d for d in self.devices if d.peer_group == group)

    def _reach(self, waiter: HCQCompiled, sig: HCQSignal) -> HCQSignal:
        """`sig` as `waiter`'s queues wait on it (a replica across peer groups)."""
        if sig.owner is None or cast(HCQCompiled, sig.owner).peer_group == waiter.peer_group: return sig
        if sig not in self._replica_sources: self._replica_sources.append(sig)
        return self._holder(waiter.peer_group).replica(sig)

    def _val(self, value: int) -> sint:
        """A queue signal value as queues store and wait on it: offset by the run's epoch when several peer groups take part."""
        return self._epoch_var + value if self.multi_group else value

    def _encode(self) -> None:
        self.start_ts: dict[HCQCompiled, HCQSignal] = {}
        self.end_ts: dict[HCQCompiled, HCQSignal] = {}
        for dev in self.devices: self._get_queue((dev, "compute", 0))  # every device starts (and times) at kickoff
        needed = {(w[0], w[1]) for p in self.plan for w in p.waits}
        last_on_queue: dict[QueueKey, int] = {}
        for p in self.plan: last_on_queue[p.queue] = p.value
        prev_end: dict[QueueKey, HCQSignal] = {}
        for i, p in enumerate(self.plan):
            q, txt = self._get_queue(p.queue), self.text.setdefault(p.queue, [])
            for dq, dv in p.waits:
                q.wait(self._reach(p.queue[0], self.queue_signals[dq]), self._val(dv))
                txt.append(f"wait {_qname(dq)} >= {dv}")
            if self.profile:
                st = prev_end[p.queue] if (p.queue in prev_end and not p.waits) else p.queue[0].new_signal()
                if st is not prev_end.get(p.queue): q.timestamp(st)
            if isinstance(p.item, ExecItem):
                q.exec(p.item.prg, self.args[i], p.item.global_size, p.item.local_size)
                txt.append(f"exec {p.item.name} {_dims(p.item.global_size)}x{_dims(p.item.local_size)}")
            else:
                q.copy(p.queue[0].allocator.address_for(self._sym(p.item.dest)), p.queue[0].allocator.address_for(self._sym(p.item.src)), p.item.nbytes)
                txt.append(f"copy {p.item.nbytes} bytes")
            if self.profile:
                en = p.queue[0].new_signal()
                q.timestamp(en)
                prev_end[p.queue] = en
                nbytes = p.item.nbytes if isinstance(p.item, CopyItem) else None
                self.prof_entries.append(GraphEntry(i, p.item.name, p.queue[0], (p.queue[1], p.queue[2]), st, en, p.dep_items, nbytes))
            if (p.queue, p.value) in needed or last_on_queue[p.queue] == p.value:
                q.signal(self.queue_signals[p.queue], self._val(p.value))
                txt.append(f"signal {_qname(p.queue)} = {p.value}")
        self.final_values = dict(last_on_queue)
        # End: each device's compute queue waits for every graph queue, then signals its device's timeline.
        for di, dev in enumerate(self.devices):
            key = (dev, "compute", 0)
            q = self._get_queue(key)
            seen = dict(self._known.get(key, {}))
            # Queues whose final clock implies the most go first, so their waits cover the others' ends.
            for other, val in sorted(self.final_values.items(), key=lambda kv: -sum(self._clocks[kv].values())):
                if other != key and seen.get(other, 0) < val:  # skip what earlier waits already imply
                    q.wait(self._reach(dev, self.queue_signals[other]), self._val(val))
                    self.text[key].append(f"wait {_qname(other)} >= {val}")
                    for k, v in self._clocks[(other, val)].items():
                        if v > seen.get(k, 0): seen[k] = v
            self.end_ts[dev] = dev.new_signal()
            q.timestamp(self.end_ts[dev]).signal(self.virt_timelines[di], self.tl_signal_vars[di])
            self.text[key].append(f"signal {dev.device} timeline")

    # ------------------------------------------------------------------ run
    def __call__(self, inputs: Sequence[HCQBuffer] = (), var_vals: Mapping[str, int] | None = None, wait: bool = False) -> float | None:
        """Run the graph with `inputs` in place of the build-time input buffers. With wait=True, wait and
        return the device time in seconds from the first queue's start to the last queue's end."""
        if self._baked_seen != FREES[0]: self._check_baked()
        # one C call when only the kickoff and timeline values change (one-queue graphs; see _native_run)
        if not ((run := self._native) and run(inputs, var_vals)): self._run(tuple(inputs), var_vals)
        if not wait: return None
        self.synchronize()
        return self.device_time()

    def _check_baked(self) -> None:
        """Refuse a run once a buffer the graph bakes in (one not given as an input) was freed: its memory may be another
        allocation's by now. Looked at again only when something was freed since the last look."""
        seen = FREES[0]
        for i, b in self._baked:
            if b._freed: raise ValueError(f"item {i} uses {b!r}, which was freed after the graph was built; a replay would write whatever "
                                          "memory took its place (build the graph again, or make the buffer one of its inputs)")
        self._baked_seen = seen

    def _run(self, inputs: tuple[HCQBuffer, ...], var_vals: Mapping[str, int] | None) -> None:
        """A run through Python: checks, the patch (fast or general), every queue submitted whole."""
        if len(inputs) != len(self.inputs):
            raise ValueError(f"graph takes {len(self.inputs)} input buffer(s), got {len(inputs)}")
        for i, (new, old) in enumerate(zip(inputs, self.inputs)):
            if new is old and not old._root._freed: continue
            if not isinstance(new, HCQBuffer): raise TypeError(f"input {i} must be an HCQBuffer, got {type(new).__name__}")
            if new.size < old.size: raise ValueError(f"input {i}: {new!r} is smaller than the {old.size} bytes the graph was built with")
            if new.freed: raise ValueError(f"input {i}: {new!r} was freed")
            if not isinstance(new.va_addr, int): raise ValueError(f"input {i}: {new!r} has a symbolic address")
            if new.readonly and i in self._written_inputs:
                raise ValueError(f"input {i}: {new!r} is read-only memory, and {self._written_inputs[i]} writes it")
            if new.owner is not old.owner and new.owner is not None: self._reach_input(i, new, old)
        prof = profiler.active
        t0 = time.perf_counter_ns() if prof is not None else 0
        if var_vals and (unknown := set(var_vals) - self.variables):
            missing = self.variables - set(var_vals)
            why = (f"var_vals names {', '.join(sorted(map(repr, unknown)))}, which this graph does not use; it takes "
                   f"{', '.join(sorted(map(repr, self.variables))) or 'no variables'}")
            if missing: raise UnboundVariableError(f"no value for variable {', '.join(sorted(map(repr, missing)))}: {why}")
            raise ValueError(why)
        with self._run_lock:
            self._wait_last_run()  # the previous run finished: its queues may be patched
            if self._prof_target is not None: self._collect_profile(self._prof_target)
            self._patch_and_submit(inputs, dict(var_vals) if var_vals else {}, prof, t0)

    def _reach_input(self, i: int, new: HCQBuffer, old: HCQBuffer) -> None:
        """An input of another device than the one the graph was built with: it must be memory the graph's devices of
        that peer group address (it is mapped into them, once); memory of another peer group is refused."""
        group = old.owner.peer_group if old.owner is not None else None
        if group is not None and new.owner.peer_group != group:  # type: ignore[union-attr]
            raise ValueError(f"input {i}: {new!r} is memory of {new.owner.device}, which the devices that use this input cannot "  # type: ignore[union-attr]
                             f"address (the graph was built with memory of {old.owner.device}); copy it there first")  # type: ignore[union-attr]
        for dev in self.devices:
            if dev.peer_group == new.owner.peer_group: dev.allocator.map(new)  # type: ignore[union-attr]

    def _patch_and_submit(self, inputs: tuple[HCQBuffer, ...], user_vals: dict[str, int], prof: profiler.Profiler | None, t0: int) -> None:
        """A run through Python: the fast patch or the general one, then every queue submitted whole."""
        if self._marks[KICKOFF] != self._synced_kickoff: self._catch_up()
        if (vv := self._fast_patch(inputs, user_vals) if prof is None else None) is None:
            vv = dict(user_vals)
            vv[self._kickoff_name] = self.kickoff_value + 1
            for name, buf in zip(self._input_names, inputs): vv[name] = buf.va_addr  # type: ignore[assignment]
            for dev, (addr_name, wait_name, signal_name) in zip(self.devices, self._timeline_names):
                vv[addr_name] = dev.timeline_signal.value_addr
                vv[wait_name] = (tv := dev.timeline_value) - 1
                vv[signal_name] = tv
            if self.multi_group: vv[self._epoch_name] = (self.kickoff_value + 1) * self._stride
            for di, group, name in self._replica_names:
                vv[name] = self._holder(group).replica(self.devices[di].timeline_signal).value_addr  # type: ignore[assignment]
            # Patch every queue before anything reaches a device: a missing or out-of-range variable then
            # leaves the devices, their timelines and this graph as they were. Then make sure every ring has
            # room, so the submissions below cannot stall half way.
            self._use_plan(None)  # (until this run is in: a patch that fails or is interrupted half way leaves no fast path)
            for (dev, _, _), q in self._queue_list: q._prepare(dev, vv, previous_run_done=True)
        if len(self._queue_list) > 1:  # (one submission is whole by itself)
            for (dev, _, _), q in self._queue_list: q._wait_for_room(dev)
        entered = interrupts.enter()  # a run is submitted whole: queues waiting for a kickoff that never comes would wedge
        try:
            self._submit_run(vv, prof)
        finally:
            interrupts.leave(entered)
        if prof is not None:
            if self.profile:
                self._prof_target = prof
                prof.track_graph(self)
            prof.host_event(f"graph run ({len(self.items)} items)", t0)
        if self._native is None or self._native_timeline is not self.devices[0].timeline_signal: self._native = self._native_run()
        # A general patch dropped the plan (a fast patch keeps the one it followed). A run owed to a profiler gets none: the
        # next run, through Python, collects it first.
        if self._run_plan is None and self._per_run is not None and self._prof_target is None:
            self._use_plan(RunPlan(inputs, user_vals, tuple(d._state[TIMELINE_ADDRESS] for d in self.devices), FREES[0]))

    def _use_plan(self, plan: RunPlan | None) -> None:
        """The plan the fast runs (`_fast_patch`, and the native one) follow from now on (None: none, every run patches
        everything)."""
        entered = interrupts.enter()  # (both runs see the same plan: a Ctrl-C between the two would split them)
        try:
            if self._native: self._native.use(plan, FREES)
            self._run_plan = plan
        finally:
            interrupts.leave(entered)

    @property
    def kickoff_value(self) -> int:
        """The kickoff value of the last run that went in (each run opens the graph's queues with the next one)."""
        return self._marks[KICKOFF]

    @property
    def _last_run(self) -> list[tuple[HCQSignal, int]]:
        """(timeline signal, value) per device: the last run is done once each signal reached its value."""
        marks = self._marks
        return [(sig, marks[at]) for sig, at in zip(self._last_signals, self._last_run_values)]

    def _wait_last_run(self) -> None:
        marks = self._marks
        for sig, at in zip(self._last_signals, self._last_run_values): sig.wait(marks[at])

    def _note_last_run(self, marks: list[tuple[HCQSignal, int]]) -> None:
        self._last_signals = tuple(sig for sig, _ in marks)
        for (sig, value), at in zip(marks, self._last_run_values):
            self._marks[at - 1], self._marks[at] = addr if isinstance(addr := sig.value_addr, int) else 0, value

    def _submit_run(self, vv: dict[str, int], prof: profiler.Profiler | None) -> None:
        if not self.multi_group:
            for sig in self._queue_sigs: sig.store(0, wake=False)  # nothing waits on them now: no wake-up needed
        self._marks[KICKOFF] = self._synced_kickoff = kickoff = self._marks[KICKOFF] + 1
        self._note_last_run([(dev.timeline_signal, dev.next_timeline()) for dev in self.devices])
        single = len(self._queue_list) == 1  # one submission is whole by itself: its gate opens first (nobody to wake)
        if single: self.kickoff.store(kickoff, wake=False)
        submitted = 0
        try:
            for (dev, _, _), q in self._queue_list:
                ts = time.perf_counter_ns() if prof is not None else 0
                q._submit_to_ring(dev)
                submitted += 1
                if prof is not None: prof.host_event(f"submit {type(q).__name__}", ts, device=dev.device, words=len(q))
        except BaseException:
            self._abandon_run(submitted, vv)
            raise
        self._run_var_vals = vv
        if not single:
            for kickoff in self.kickoffs.values(): kickoff.value = self.kickoff_value

    def _abandon_run(self, submitted: int, vv: dict[str, int]) -> None:
        """A run a ring refused part way (the first `submitted` queues went in) leaves nothing waiting forever: the queues
        not submitted are marked done (their signals stored at their final values) and the kickoff opens, so the submitted
        ones run to their end (an incomplete run: the caller raises), and the timeline value of each device whose compute
        queue (which signals it) did not go in is reached all the same (HCQCompiled._forfeit_timeline), or, with nothing
        submitted, given back (the run took it just now: as if it had not been called)."""
        if submitted:
            for key, _ in self._queue_list[submitted:]:
                if key in self.final_values: self.queue_signals[key].value = resolve(self._val(self.final_values[key]), vv)
            for kickoff in self.kickoffs.values(): kickoff.value = self.kickoff_value
        signalled = {key[0] for key, _ in self._queue_list[:submitted] if key[1] == COMPUTE}
        for i, (dev, (sig, value)) in enumerate(zip(self.devices, self._last_run)):
            if dev in signalled: continue
            dev._forfeit_timeline(value, give_back=not submitted)
            if dev.timeline_value <= value: self._marks[self._last_run_values[i]] = value - 1  # given back: nothing of this run signals it

    def _plan_per_run(self) -> list[tuple[HWQueue, list[tuple[int, int, str]], list[str]]] | None:
        """Where each queue holds the values every run changes (the kickoff, each device's timeline wait and signal
        value): (queue, [(symbol index, word index, variable name)], those names). None when one of them sits inside a
        larger expression or in memory other than the queue's words (then every run takes the general patch)."""
        per_run = {self._kickoff_name, self._epoch_name, *(n for _, w, s in self._timeline_names for n in (w, s))}
        plan = []
        for q in self.queues.values():
            if not q._words_in_memory or any(per_run & e.variables for _, _, e in q.mv_sints): return None
            slots = []
            for i, (idx, e) in enumerate(q.q_sints):
                if not per_run & e.variables: continue
                if not isinstance(e, Variable): return None
                slots.append((i, idx, e.name))
            plan.append((q, slots, sorted({name for _, _, name in slots})))
        return plan

    def _native_run(self) -> Any:
        """hcq/_hotpath.c's GraphRun for a one-queue graph whose words, signals, kickoff and timeline the host can
        write, on a device with a native submit; False otherwise. It runs the replays the graph's RunPlan holds for (given
        through `use`; it checks that itself, and that the last run finished), with the run lock taken without blocking,
        in one C call."""
        self._native_timeline = self.devices[0].timeline_signal
        if len(self._queue_list) != 1 or self._per_run is None or not hotpath.available(): return False
        (dev, _, _), q = self._queue_list[0]
        words, view = getattr(q, "_indirect", None), q._q
        address = dev.executor.native_submit_address() if dev.executor is not None else None
        host = [_host_words(sig) for sig in (*self._queue_sigs, self.kickoff)]
        if not address or words is None or not isinstance(view, MMIOInterface) or None in host: return False
        _, wait_name, signal_name = self._timeline_names[0]
        which = {self._kickoff_name: 0, wait_name: 1, signal_name: 2}
        slots = tuple((view.addr + WORD_BYTES * idx, which[name]) for _, idx, name in self._per_run[0][1])
        timeline = _host_words(self._native_timeline)
        if timeline is None or type(self._run_lock).__name__ != "RingLock": return False
        run = hotpath.graph_run(dev.native_state(), q, dev.ring(q.kind, q.index), address, tuple(words), slots, tuple(host[:-1]), host[-1],
                                 self._marks, self._run_lock, timeline[0])
        if run is None: return False
        run.use(self._run_plan, FREES)
        return run

    def _fast_patch(self, inputs: tuple[HCQBuffer, ...], user_vals: dict[str, int]) -> dict[str, int] | None:
        """A run that changes only what every run changes: its values written straight into the bound queues' words
        (their bookkeeping kept as the general patch would leave it). None, with nothing written, when anything
        else may have changed (inputs, variables, a timeline signal, validation) or there was no run yet."""
        last, plan = self._run_var_vals, self._per_run
        if plan is None or (run := self._run_plan) is None or not run.holds(self.devices, inputs, user_vals): return None
        vv = last  # updated in place: the last run's values are only read before this (profile collection)
        vv[self._kickoff_name] = self._marks[KICKOFF] + 1
        for dev, (_, wait_name, signal_name) in zip(self.devices, self._timeline_names):
            vv[wait_name] = (tv := dev._state[TIMELINE_VALUE]) - 1
            vv[signal_name] = tv
        self._note_per_run(plan, vv, write_words=True)  # (whole here: a general patch that failed half way left no plan)
        return vv

    @staticmethod
    def _note_per_run(plan: list[tuple[HWQueue, list[tuple[int, int, str]], list[str]]], vv: dict[str, int], write_words: bool) -> None:
        """The per-run values of `vv` in each planned queue's bookkeeping (its last patched values, as a general patch would
        leave them) and, with `write_words`, in its words."""
        for q, slots, names in plan:
            words, prev, seen = q._q.mv, q._prev_q, q._last_var_vals  # type: ignore[union-attr]
            for i, idx, name in slots:
                if write_words: words[idx] = vv[name]
                prev[i] = vv[name]
            if seen is not None:
                for name in names: seen[name] = vv[name]

    def _catch_up(self) -> None:
        """Bring the Python bookkeeping of the per-run values (the last run's values, each queue's patched words) up to
        the native runs since the last Python run: hcq/_hotpath.c's GraphRun writes only the queue's words and the run
        state words (a one-device graph's kickoff value and timeline mark). Idempotent: a Ctrl-C half way is redone."""
        kickoff = self._marks[KICKOFF]
        if kickoff == self._synced_kickoff or self._per_run is None: return
        signalled = self._marks[self._last_run_values[0]]
        _, wait_name, signal_name = self._timeline_names[0]
        vv = self._run_var_vals
        vv[self._kickoff_name], vv[wait_name], vv[signal_name] = kickoff, signalled - 1, signalled
        self._note_per_run(self._per_run, vv, write_words=False)
        self._synced_kickoff = kickoff

    def device_time(self) -> float:
        """Seconds from the earliest queue start to the latest queue end of the last finished run."""
        return float(max(s.timestamp for s in self.end_ts.values()) - min(s.timestamp for s in self.start_ts.values())) / 1e6

    def synchronize(self) -> None:
        """Wait for the last run."""
        self._wait_last_run()

    def _collect_profile(self, prof: profiler.Profiler) -> None:
        """Hand the finished run's item timestamps to the profiler (before the next run overwrites them)."""
        if self._prof_target is None: return
        self.synchronize()
        self._catch_up()
        base = prof.new_idents(len(self._steps))
        for e in self.prof_entries:
            nbytes = resolve(e.nbytes, self._run_var_vals) if e.nbytes is not None else None
            prof.device_event("graph", e.name, e.dev, e.queue, float(e.st.timestamp), float(e.en.timestamp), nbytes=nbytes,
                              ident=base + e.index, deps=[base + d for d in e.deps], item=self._item_of[e.index], op="copy" if nbytes is not None else "exec")
        self._prof_target = None

    # ------------------------------------------------------------------ debugging
    def dot(self) -> str:
        """The static queues and their waits as Graphviz DOT text (one cluster per queue)."""
        lines = ["digraph hcqgraph {", "  rankdir=LR; node [shape=box, fontname=monospace];"]
        for n, (key, cmds) in enumerate(self.text.items()):
            lines.append(f'  subgraph cluster_{n} {{ label="{_qname(key)}";')
            lines.extend(f'    "{_qname(key)}#{j}" [label="{c}"];' for j, c in enumerate(cmds))
            lines.extend(f'    "{_qname(key)}#{j}" -> "{_qname(key)}#{j + 1}" [style=dotted];' for j in range(len(cmds) - 1))
            lines.append("  }")
        for i, p in enumerate(self.plan):
            for d in p.dep_items: lines.append(f'  "item{d}" -> "item{i}";')
            lines.append(f'  "item{i}" [label="{self._item_of[i]}: {p.item.name}\\n{_qname(p.queue)}", shape=ellipse];')
        lines.append("}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return "\n".join(f"{_qname(k)}:\n" + "\n".join(f"  {c}" for c in cmds) for k, cmds in self.text.items())

    def __del__(self) -> None:
        # No waiting here (a run may still be in flight, or the devices stopped at exit): the allocator
        # releases the kernargs only once submitted work is past them, and the queues hold their signals.
        # Replicas go at the next graph build (releasing one may talk to a server: not from a finalizer).
        try:
            _dead_replicas.extend(self._replica_sources)
            for dev, buf in self.kernargs_bufs.items(): dev.allocator.free_from_finalizer(buf, RUNTIME_SPEC)
        except Exception:  # noqa: BLE001 - a destructor must not raise (e.g. at interpreter exit)
            pass


_dead_replicas: deque[HCQSignal] = deque()  # queue signals of collected graphs whose replicas are still up


def _drop_dead_replicas() -> None:
    while _dead_replicas: HCQCompiled.drop_replicas(_dead_replicas.popleft())


def _host_words(sig: HCQSignal) -> tuple[int, int] | None:
    """Host addresses of a signal's value and timestamp words, or None when the host cannot write them directly."""
    view = sig.base_buf.view
    if view is None or sig._value_mv is None or not sig.stores_in_host_memory: return None
    return view.addr, view.addr + SIGNAL_TIMESTAMP_OFFSET


def _dims(dims: Dims) -> str:
    dims = as_dims(dims)
    return "(" + ",".join(d.expr if hasattr(d, "expr") else str(d) for d in dims) + ")"


def _qname(key: QueueKey) -> str:
    dev, kind, idx = key
    return f"{dev.device} {kind}" + (f"{idx}" if kind == "copy" else "")


class Capture:
    """Records program calls and device transfers issued inside `with hcq.capture() as g:`; on exit they
    become an HCQGraph that `g(...)` replays. Nothing runs while capturing."""

    def __init__(self, inputs: Sequence[HCQBuffer] = ()):
        self.inputs = tuple(inputs)
        self.items: list[Item] = []
        self.graph: HCQGraph | None = None

    def __enter__(self) -> Capture:
        if recorder.active() is not None: raise HCQError("captures do not nest")
        recorder.set_active(self)
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        recorder.set_active(None)
        if exc_type is None:
            if not self.items: raise HCQError("nothing was captured: no program calls or transfers inside the capture block")
            self.graph = HCQGraph(self.items, inputs=self.inputs)

    def on_exec(self, prg: HCQProgram, bufs: tuple[HCQBuffer, ...], vals: tuple[sint, ...], global_size: tuple[sint, ...],
                local_size: tuple[sint, ...]) -> None:
        """Record a program call made inside the capture (it does not run)."""
        self.items.append(ExecItem(prg, tuple(bufs), tuple(vals), as_dims(global_size), as_dims(local_size)))

    def on_copy(self, dest: HCQBuffer, src: HCQBuffer, nbytes: sint) -> None:
        """Record a transfer made inside the capture (it does not run)."""
        self.items.append(CopyItem(dest, src, nbytes))

    def __call__(self, inputs: Sequence[HCQBuffer] | None = None, var_vals: Mapping[str, int] | None = None, wait: bool = False) -> float | None:
        """Replay the captured graph (with the capture's inputs unless others are given); see `HCQGraph.__call__`."""
        if self.graph is None: raise HCQError("the capture block has not finished (or raised); there is no graph to run")
        return self.graph(self.inputs if inputs is None else inputs, var_vals=var_vals, wait=wait)


def capture(inputs: Sequence[HCQBuffer] = ()) -> Capture:
    """`with hcq.capture(inputs=(x,)) as g: ...` records instead of running; then `g(inputs=(y,))` replays."""
    return Capture(inputs)


def jit(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Decorator in the spirit of TinyJit: the first call runs normally (or, when given `var_vals`, is
    captured at once), the next is captured into an HCQGraph and run, later calls replay it. The function's
    HCQBuffer arguments are the graph's inputs; every other argument is baked into the graph, so a later call
    with a different one raises (pass values that change as Variables, through `var_vals=`). The function's
    return value is only produced by the first call."""
    state: dict[str, Any] = {"calls": 0, "graph": None, "nbufs": None, "fixed": None}

    def wrapper(*args: Any, var_vals: Mapping[str, int] | None = None, wait: bool = False) -> Any:
        bufs = tuple(a for a in args if isinstance(a, HCQBuffer))
        fixed = [(i, a) for i, a in enumerate(args) if not isinstance(a, HCQBuffer)]
        state["calls"] += 1
        if state["calls"] == 1 and var_vals is None: return fn(*args)  # with variables, launches need var_vals: capture at once
        if state["graph"] is None:
            with capture(inputs=bufs) as cap:
                fn(*args)
            state["graph"], state["nbufs"], state["fixed"] = cap.graph, len(bufs), fixed
        if len(bufs) != state["nbufs"]: raise ValueError(f"jitted function was captured with {state['nbufs']} buffers, got {len(bufs)}")
        _check_fixed_args(fn, state["fixed"], fixed)
        return state["graph"](bufs, var_vals=var_vals, wait=wait)

    wrapper.__wrapped__ = fn  # type: ignore[attr-defined]
    return wrapper


def _check_fixed_args(fn: Callable[..., Any], captured: list[tuple[int, Any]], now: list[tuple[int, Any]]) -> None:
    """Arguments that are not buffers were baked into the graph when it was captured: refuse a call that
    changes one rather than replay the old value."""
    name = getattr(fn, "__name__", "function")
    if [i for i, _ in captured] != [i for i, _ in now]:
        raise ValueError(f"@hcq.jit {name}: the buffer arguments are not in the positions they had when the graph was captured")
    for (i, old), (_, new) in zip(captured, now):
        if not _same_value(old, new):
            raise ValueError(f"@hcq.jit {name}: argument {i} is {new!r}, but the graph was captured with {old!r} and would replay that; "
                             "pass a value that changes between calls as a Variable and give it through var_vals=")


def _same_value(a: Any, b: Any) -> bool:
    if a is b: return True
    if type(a) is not type(b): return False
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - values without a usable == (e.g. arrays) must be the same object
        return False
