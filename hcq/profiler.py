"""Built-in profiling: device events from timestamp signals (kernels, copies, graph items with their
dependencies) and host spans (submits, waits, copies), brought onto one clock and exported as a
Chrome/Perfetto trace or a text summary.

`PROFILE=1` profiles the whole process and writes the trace at exit to `PROFILE_PATH` (default
./hcq-profile.json); `with hcq.profile() as p:` profiles a block and leaves the events in `p.events`.
Lower layers only look at `profiler.active` (None when off), so profiling costs nothing when off."""
from __future__ import annotations

import atexit
import functools
import json
import os
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, TypeVar

from hcq import lifecycle, recorder

F = TypeVar("F", bound=Callable[..., Any])

active: Profiler | None = None
CALIBRATION_ROUNDS = 21


@dataclass
class Event:
    """A span on the host clock (microseconds of time.perf_counter). kind: kernel, copy, graph or host."""
    kind: str
    name: str
    device: str
    queue: str
    start_us: float
    dur_us: float
    nbytes: int | None = None
    ident: int | None = None
    deps: tuple[int, ...] = ()
    args: dict[str, Any] = field(default_factory=dict)
    thread_id: int | None = None  # host spans: the thread (its track), as thread names need not be unique

    @property
    def end_us(self) -> float:
        """The end of the span (start + duration), in microseconds."""
        return self.start_us + self.dur_us


@dataclass
class _Pending:
    kind: str
    name: str
    dev: Any
    queue: tuple[str, int]
    st: Any  # a signal, or a raw device timestamp in device units
    en: Any
    nbytes: int | None
    ident: int | None
    deps: tuple[int, ...]
    args: dict[str, Any]


class Profiler:
    """Collects device and host events; `finish()` resolves them (waiting for the devices involved)."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self._pending: list[_Pending] = []
        self._graphs: list[Any] = []
        self._queues: list[Any] = []  # hand-built queues whose last run is not reported yet
        self._next_ident = 0
        self._lock = threading.Lock()
        self.offsets_ns: dict[str, float] = {}  # per device: its clock -> the host's perf_counter (one clock for all its queues)
        self._domain_offsets: dict[str, float] = {}  # per clock domain (`dev.clock_domain`): calibrated once
        self.finished = False

    # ---- recording (called by the runtime while active)
    def device_event(self, kind: str, name: str, dev: Any, queue: tuple[str, int], st: Any, en: Any, nbytes: int | None = None,
                     ident: int | None = None, deps: Iterable[int] = (), **args: Any) -> None:
        """A command on `dev`'s `queue` bracketed by timestamp signals (or raw timestamps) st and en."""
        with self._lock: self._pending.append(_Pending(kind, name, dev, queue, st, en, nbytes, ident, tuple(deps), args))

    def host_event(self, name: str, start_ns: int, **args: Any) -> None:
        """A host span from `start_ns` (time.perf_counter_ns) to now on the calling thread."""
        end = time.perf_counter_ns()
        t = threading.current_thread()  # tracks are per thread: names need not be unique
        ev = Event("host", name, "host", t.name, start_ns / 1000, (end - start_ns) / 1000, args=args, thread_id=t.native_id)
        with self._lock: self.events.append(ev)

    def span_event(self, kind: str, name: str, device: str, lane: str, start_ns: int, nbytes: int | None = None) -> None:
        """Work done for `device` outside its queues (bytes a network engine moved, say), timed on the host clock from
        `start_ns` (time.perf_counter_ns) to now, on the device's `lane` track."""
        ev = Event(kind, name, device, lane, start_ns / 1000, (time.perf_counter_ns() - start_ns) / 1000, nbytes)
        with self._lock: self.events.append(ev)

    def new_idents(self, n: int) -> int:
        """Reserve `n` consecutive event idents (for dependency arrows); returns the first."""
        with self._lock:
            first, self._next_ident = self._next_ident, self._next_ident + n
        return first

    def track_graph(self, graph: Any) -> None:
        """A graph whose item times are collected before its next run overwrites them (the last run's at `finish`)."""
        if graph not in self._graphs: self._graphs.append(graph)

    def track_queue(self, q: Any) -> None:
        """A queue that reports its exec/copy times after each run (the last one at `finish`)."""
        with self._lock:
            if not any(x is q for x in self._queues): self._queues.append(q)

    # ---- resolution
    def finish(self) -> Profiler:
        """Wait for the profiled work, calibrate device clocks per queue and turn records into events."""
        global active
        if self.finished: return self
        prev, active = active, None  # calibration and synchronisation are not themselves profiled
        try:
            for g in self._graphs: g._collect_profile(self)
            for q in self._queues: q._collect_profile()
            self._queues.clear()
            devices = {id(p.dev): p.dev for p in self._pending}
            for dev in devices.values(): dev.synchronize()
            for p in self._pending:
                if p.dev.device not in self.offsets_ns:  # devices that stamp one clock share its calibration
                    domain = getattr(p.dev, "clock_domain", p.dev.device)
                    if domain not in self._domain_offsets: self._domain_offsets[domain] = calibrate(p.dev)
                    self.offsets_ns[p.dev.device] = self._domain_offsets[domain]
                st, en = (_raw_us(p.st), _raw_us(p.en))
                off = self.offsets_ns[p.dev.device] / 1000
                self.events.append(Event(p.kind, p.name, p.dev.device, _queue_name(p.queue), st + off, max(0.0, en - st), p.nbytes,
                                         p.ident, p.deps, p.args))
            self._pending.clear()
            _mark_clock_error(self.events)
            self.events.sort(key=lambda e: (e.start_us, -e.dur_us))
        finally:
            active = prev
        self.finished = True
        return self

    # ---- output
    def to_chrome(self) -> dict[str, Any]:
        """The events as a Chrome/Perfetto trace (`{"traceEvents": [...]}`)."""
        return chrome_trace(self.events)

    def write(self, path: str) -> str:
        """Write the events as a Chrome/Perfetto trace to `path`; returns the path."""
        with open(path, "w") as f: json.dump(self.to_chrome(), f)
        return path

    def summary(self, top: int = 10) -> str:
        """A text summary: per-kernel counts and times, copies with bandwidth, host spans (`top` kernels listed)."""
        return summarize(self.to_chrome(), top)

    def __enter__(self) -> Profiler:
        start(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            self.finish()
        finally:
            stop(self)


def traced(name: str) -> Callable[[F], F]:
    """Decorator: while profiling, record a host span named `name` around the call."""
    def deco(fn: F) -> F:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if active is None or recorder.capturing: return fn(*args, **kwargs)
            t0 = time.perf_counter_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                if active is not None: active.host_event(name, t0)
        return wrapper  # type: ignore[return-value]
    return deco


def _raw_us(x: Any) -> float:
    return float(x.timestamp) if hasattr(x, "timestamp") else float(x)


def _queue_name(queue: tuple[str, int]) -> str:
    return queue[0] if queue[0] == "compute" else f"{queue[0]}{queue[1]}"


def _mark_clock_error(events: list[Event]) -> None:
    """Events of one device share its clock, so one that depends on another never starts before it ends; across
    devices the two calibrations can disagree by a little. Where a dependent event appears to start before what it
    waited for ended, `args["clock_error_us"]` says by how much (the trace is not shifted)."""
    by_ident = {e.ident: e for e in events if e.ident is not None}
    for e in events:
        ends = [by_ident[d].end_us for d in e.deps if d in by_ident]
        if ends and (err := max(ends) - e.start_us) > 0: e.args["clock_error_us"] = round(err, 3)


def calibrate(dev: Any, rounds: int = CALIBRATION_ROUNDS) -> float:
    """Offset (ns) from `dev`'s clock to the host's perf_counter: the median over `rounds` synchronisations of (host
    time halfway between submit and completion) - (device timestamp), on its compute queue (every queue of a device
    stamps the same clock)."""
    sig = dev.new_signal(value=0)
    offsets = []
    for i in range(1, rounds + 1):
        q = dev.hw_compute_queue_t(profile=False)
        t0 = time.perf_counter_ns()
        q.timestamp(sig).signal(sig, i).submit(dev)
        sig.wait(i)
        t1 = time.perf_counter_ns()
        offsets.append((t0 + t1) / 2 - float(sig.timestamp) * 1000)
    return statistics.median(offsets)


def chrome_trace(events: list[Event]) -> dict[str, Any]:
    """Chrome trace JSON: one process per device (plus the host), one track per queue (or host thread),
    'X' slices in microseconds, 'M' names, and flow arrows ('s'/'f') for graph dependencies."""
    pids: dict[str, int] = {"host": 0}
    tids: dict[tuple[int, str, int | None], int] = {}
    out: list[dict[str, Any]] = []
    for ev in events:
        pid = pids.setdefault(ev.device, len(pids))
        tid = tids.setdefault((pid, ev.queue, ev.thread_id), len([k for k in tids if k[0] == pid]) + 1)
        args = dict(ev.args)
        if ev.nbytes is not None:
            args["bytes"] = ev.nbytes
            if ev.dur_us > 0: args["GB/s"] = round(ev.nbytes / (ev.dur_us * 1e3), 3)
        if ev.ident is not None: args["id"] = ev.ident
        if ev.deps: args["deps"] = list(ev.deps)
        out.append({"ph": "X", "name": ev.name, "cat": ev.kind, "ts": ev.start_us, "dur": ev.dur_us, "pid": pid, "tid": tid, "args": args})
    meta = [{"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": name}} for name, pid in pids.items()]
    shared = {(pid, q) for (pid, q, _) in tids if sum(1 for k in tids if k[:2] == (pid, q)) > 1}
    meta += [{"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": f"{q} ({th})" if (pid, q) in shared else q}}
             for (pid, q, th), tid in tids.items()]
    by_ident = {item["args"]["id"]: item for item in out if "id" in item["args"]}
    flows: list[dict[str, Any]] = []
    for item in out:
        for dep in item["args"].get("deps", ()):
            src = by_ident.get(dep)
            if src is None: continue
            fid = len(flows) // 2 + 1
            flows.append({"ph": "s", "id": fid, "cat": "dep", "name": "dep", "ts": src["ts"] + src["dur"] / 2, "pid": src["pid"], "tid": src["tid"]})
            flows.append({"ph": "f", "bp": "e", "id": fid, "cat": "dep", "name": "dep", "ts": item["ts"], "pid": item["pid"], "tid": item["tid"]})
    return {"traceEvents": meta + out + flows, "displayTimeUnit": "ns"}


def summarize(trace: dict[str, Any], top: int = 10) -> str:
    """Top kernels by total device time (count, total, mean) and copies with bandwidth, from a trace."""
    kernels: dict[str, list[float]] = {}
    copies: dict[str, list[tuple[float, int]]] = {}
    for ev in trace.get("traceEvents", []):
        if ev.get("ph") != "X": continue
        cat, op = ev.get("cat"), ev.get("args", {}).get("op")
        if cat == "kernel" or (cat == "graph" and op != "copy"): kernels.setdefault(ev["name"], []).append(ev["dur"])
        elif cat == "copy" or (cat == "graph" and op == "copy"): copies.setdefault(ev["name"], []).append((ev["dur"], ev["args"].get("bytes", 0)))
    lines = []
    total = sum(sum(v) for v in kernels.values())
    lines.append(f"kernels: {sum(len(v) for v in kernels.values())} launches, {total / 1000:.3f} ms device time")
    lines.append(f"  {'name':<32} {'count':>7} {'total ms':>10} {'mean us':>10} {'share':>6}")
    for name, durs in sorted(kernels.items(), key=lambda kv: -sum(kv[1]))[:top]:
        lines.append(f"  {name[:32]:<32} {len(durs):>7} {sum(durs) / 1000:>10.3f} {sum(durs) / len(durs):>10.2f} "
                     f"{100 * sum(durs) / total if total else 0:>5.1f}%")
    if copies:
        lines.append("copies:")
        lines.append(f"  {'name':<32} {'count':>7} {'MB':>10} {'total ms':>10} {'GB/s':>8}")
        for name, xs in sorted(copies.items(), key=lambda kv: -sum(d for d, _ in kv[1])):
            dur, nbytes = sum(d for d, _ in xs), sum(b for _, b in xs)
            lines.append(f"  {name[:32]:<32} {len(xs):>7} {nbytes / 1e6:>10.2f} {dur / 1000:>10.3f} {nbytes / (dur * 1e3) if dur else 0:>8.2f}")
    return "\n".join(lines)


_stack: list[Profiler] = []  # an inner `with hcq.profile()` collects alone, then the outer one resumes


def start(p: Profiler | None = None) -> Profiler:
    """Start collecting into `p` (a new Profiler by default)."""
    global active
    p = p if p is not None else Profiler()
    if active is not None: _stack.append(active)
    active = p
    return p


def stop(p: Profiler) -> None:
    global active
    if active is p: active = _stack.pop() if _stack else None


def profile() -> Profiler:
    """`with hcq.profile() as p: ...` collects events for the block; afterwards `p.events`, `p.summary()`,
    `p.write(path)`."""
    return Profiler()


def start_from_env() -> None:
    """With PROFILE=1, profile the whole process and write the trace at exit."""
    if os.environ.get("PROFILE", "0") in ("", "0"): return
    prof = start()

    def write_at_exit() -> None:
        path = os.environ.get("PROFILE_PATH") or "hcq-profile.json"
        prof.finish()
        prof.write(path)
        print(f"hcq: profile with {len(prof.events)} events written to {os.path.abspath(path)}", file=sys.stderr)

    lifecycle.exit_hooks.append(write_at_exit)
    atexit.register(lifecycle.run_exit_hooks)  # if no device was ever opened (with one, hooks run before devices stop)
