"""Programs and their argument blocks: `HCQProgram` (a compiled kernel on one device) and
`HCQArgsState` / `CLikeArgsState` (a kernargs block filled with buffer addresses and values)."""
from __future__ import annotations

import functools
import struct
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, Sequence, TypeVar, Union

from hcq import hotpath, profiler, recorder, validation
from hcq.helpers import as_integer, as_real
from hcq.interfaces import COMPUTE
from hcq.memory import FMT_RANGE, PLACEHOLDER, REAL_FORMATS, RUNTIME_SPEC, HCQBuffer, MMIOInterface
from hcq.symbolic import Expr, sint

ProgramType = TypeVar("ProgramType", bound="HCQProgram")
Dims = Union[int, Expr, Sequence[sint]]  # launch dims as callers give them: n is (n, 1, 1), (x, y) is (x, y, 1)
FALLBACK = object()  # what a device's fast launcher returns for a call it leaves to the checked path


@dataclass(frozen=True)
class ArgSlot:
    """One kernel parameter: its name, whether it is a pointer (gets a buffer) and where it sits in the
    kernargs block (byte offset, struct format); `read_only`: a pointer to const data (the kernel only reads the
    buffer, which validation's stale-read check relies on)."""
    name: str
    ctype: str
    is_pointer: bool
    offset: int
    fmt: str
    read_only: bool = False


@dataclass(frozen=True)
class BufferBindings:
    """Buffers a kernel binds with their sizes (Vulkan's storage buffers: `.length()` counts the buffer the launch
    passed): the byte sizes of its first `count` buffer parameters go, as 64-bit words, at `sizes_offset` of its
    arguments (after `args_offset`); each such buffer must hold at least one byte and at most `max_bytes` (0: no limit)
    and start at a multiple of `alignment`. A program that has them (`HCQProgram.bindings`) writes the sizes on every
    path, so its plain launches run their plan in Python (the native run writes no sizes)."""
    count: int
    sizes_offset: int
    alignment: int = 1
    max_bytes: int = 0

    def problem(self, buf: object) -> str | None:
        """Why `buf` cannot be bound, or None (and None for a symbolic address, which the command processor checks, and
        for what check_args refuses anyway)."""
        va, size = getattr(buf, "va_addr", None), getattr(buf, "size", None)
        if not isinstance(size, int) or not isinstance(va, int): return None
        if size == 0: return "is empty: a storage-buffer binding needs at least one byte"
        if self.max_bytes and size > self.max_bytes:
            return f"is {size} bytes, more than the device's maxStorageBufferRange ({self.max_bytes}) for a storage-buffer binding"
        if va % self.alignment:
            return (f"starts at 0x{va:x}, not a multiple of the device's minStorageBufferOffsetAlignment ({self.alignment}): a "
                    "storage-buffer binding must start there (pass the buffer, or a view at such an offset)")
        return None

    def to_wire(self) -> list[int]:
        return [self.count, self.sizes_offset, self.alignment, self.max_bytes]

    @classmethod
    def from_wire(cls, value: Any) -> BufferBindings | None:
        """The record `to_wire` made (None: none), or ValueError."""
        if value is None: return None
        if not isinstance(value, list) or len(value) != 4 or any(type(n) is not int or n < 0 for n in value) or not value[0] or not value[2]:
            raise ValueError(f"buffer bindings must be [count > 0, sizes offset, alignment > 0, max bytes], not {value!r}")
        return cls(*value)


@dataclass(frozen=True)
class KernargsLayout:
    """Where a plain launch (`prg(*bufs, vals=...)`) writes a program's arguments in a kernargs block of `size` bytes:
    each buffer's 64-bit address at `pointers`, each value at its (offset, struct format) in `scalars`, both in
    parameter order. Launch plans carry it; the Python run (`pack_into`) and the native one (hcq/_hotpath.c) write
    these bytes from it, and both take only what `accepts` states."""
    size: int
    pointers: tuple[int, ...]
    scalars: tuple[tuple[int, str], ...]

    def accepts(self, dev: Any, bufs: tuple, vals: tuple) -> int:
        """The arguments a plain launch on `dev` takes (the checked path takes the rest, and says what is wrong): as many
        as the parameters; buffers that are live, not read-only allocations of `dev` itself (a peer's is mapped by the
        checked path, read-only memory is checked against the parameter there); values that are exact ints, or exact
        floats for floating parameters (`real_values`; bools, numpy numbers and symbols are converted or refused there). Whether a value fits its parameter is the
        packing's to find (`values_packer`: struct's ranges, on both runs). Returns 0 (not taken), 1
        (taken, every value an int) or 2 (taken, with a float: 0.0 == -0.0 and 1 == 1.0, so such values are not compared
        to reuse a block)."""
        if len(bufs) != len(self.pointers) or len(vals) != len(self.scalars): return 0
        try:
            for b in bufs:
                root = b._root
                if root._freed or root.owner is not dev or root._readonly: return 0
        except AttributeError:  # not a buffer
            return 0
        taken = 1
        for v, real in zip(vals, self.real_values):
            if type(v) is not int:
                if type(v) is not float or not real: return 0
                taken = 2
        return taken

    @functools.cached_property
    def real_values(self) -> tuple[bool, ...]:
        """Which values are of floating parameters (any real number); the others take integers only."""
        return tuple(fmt in REAL_FORMATS for _, fmt in self.scalars)

    @functools.cached_property
    def _packer(self) -> tuple[struct.Struct, tuple[int, ...] | None]:
        """A struct packing (buffer addresses..., values...) at their offsets, and the permutation from that order to
        the struct's (None: the same)."""
        return _struct_at([(off, "Q") for off in self.pointers] + list(self.scalars))

    @functools.cached_property
    def values_packer(self) -> tuple[struct.Struct, tuple[int, ...] | None]:
        """The same for the values alone (what the native run packs; it writes the addresses itself): a struct whose
        bytes, from offset 0 of the block, hold each value at its offset, and the permutation from parameter order to
        the struct's (None: the same)."""
        return _struct_at(list(self.scalars))

    def pack_into(self, raw: Any, offset: int, bufs: tuple, vals: tuple) -> bool:
        """Write the arguments of a call `accepts` took into `raw` at `offset`; False (nothing meaningful written) when a
        value does not fit its parameter."""
        packer, order = self._packer
        try:
            if order is None: packer.pack_into(raw, offset, *[b.va_addr for b in bufs], *vals)
            else:
                args = [b.va_addr for b in bufs] + list(vals)
                packer.pack_into(raw, offset, *[args[i] for i in order])
        except (struct.error, TypeError, OverflowError):
            return False
        return True


def _struct_at(fields: list[tuple[int, str]]) -> tuple[struct.Struct, tuple[int, ...] | None]:
    """How values are packed, for every run: a struct ("=": standard sizes, no alignment) that writes each (offset,
    format) field at its offset from 0, zero bytes between, and the order its arguments take (None: as given)."""
    order = sorted(range(len(fields)), key=lambda i: fields[i][0])
    fmt, pos = "=", 0
    for i in order:
        off, f = fields[i]
        fmt += "x" * (off - pos) + f
        pos = off + struct.calcsize("=" + f)
    return struct.Struct(fmt), None if order == list(range(len(fields))) else tuple(order)


def as_dims(dims: Dims) -> tuple[sint, ...]:
    """Launch dims as a tuple: an int (or expression) n is (n,); tuples and lists pass as they are (padding to three
    and range checks are the device's, `HCQCompiled.check_launch_dims`)."""
    if isinstance(dims, Expr): return (dims,)
    if (n := as_integer(dims)) is not None: return (n,)
    return tuple(dims) if isinstance(dims, (tuple, list)) else dims  # type: ignore[return-value]  # anything else: refused later


class HCQArgsState(Generic[ProgramType]):
    """The arguments of one launch, living in `buf` (device memory the host can write). Symbolic values are
    recorded in `bind_data` so a queue that executes with this state patches them at submit.
    Lifetime: queues keep the states they execute alive until their submissions finished; a state made by
    `fill_kernargs` without a buffer owns its block, which stays valid for as many submits as the queues
    holding it make, and is released (once unused) when the state is collected."""
    _owned: HCQBuffer | None = None

    def __init__(self, buf: HCQBuffer, prg: ProgramType, bufs: tuple[HCQBuffer, ...], vals: tuple[sint, ...] = ()):
        self.buf, self.prg, self.bufs, self.vals = buf, prg, bufs, vals
        self.bind_data: list[tuple[tuple[sint, ...], MMIOInterface, str]] = []

    def __del__(self) -> None:
        block, self._owned = self._owned, None
        if block is None or block.freed: return
        try:
            block.owner.allocator.free_from_finalizer(block, RUNTIME_SPEC)  # type: ignore[union-attr]
        except Exception:  # noqa: BLE001 - a destructor must not raise (e.g. at interpreter exit)
            pass

    def bind_sints_to_buf(self, *vals: sint, buf: HCQBuffer, fmt: str, offset: int = 0) -> None:
        """Write `vals` into `buf` at `offset` with struct format `fmt`; symbolic ones are recorded for patching."""
        mv = buf.cpu_view().view(offset, len(vals) * struct.calcsize(fmt), fmt)
        self.bind_data.append((vals, mv, fmt))
        for i, v in enumerate(vals):
            mv[i] = _placeholder_for(fmt) if isinstance(v, Expr) else v



def _show(v: object) -> str:
    """`repr(v)`, shortened for messages (a 2**1030 has 311 digits)."""
    r = repr(v)
    return r if len(r) <= 48 else f"{r[:24]}...{r[-12:]} ({len(r)} characters)"


def _placeholder_for(fmt: str) -> int | float:
    if fmt in REAL_FORMATS: return 0.0
    bits = 8 * struct.calcsize(fmt)
    return PLACEHOLDER & ((1 << (bits - 1)) - 1) if fmt.islower() else PLACEHOLDER & ((1 << bits) - 1)


class CLikeArgsState(HCQArgsState[ProgramType]):
    """Arguments laid out like a C struct of the kernel's parameters (`prg.arg_slots`): buffers fill the
    pointer parameters and `vals` the scalar ones, each in declared order. An optional `prefix` of 32-bit
    words precedes them when the program reserves room for it."""

    def __init__(self, buf: HCQBuffer, prg: ProgramType, bufs: tuple[HCQBuffer, ...], vals: tuple[sint, ...] = (),
                 prefix: Sequence[int] | None = None):
        super().__init__(buf, prg, bufs, vals)
        if prefix is not None: self.bind_sints_to_buf(*prefix, buf=buf, fmt="I")
        slots: list[ArgSlot] = prg.arg_slots
        base = prg.args_offset
        ptrs = [s for s in slots if s.is_pointer]
        scalars = [s for s in slots if not s.is_pointer]
        for s, b in zip(ptrs, bufs): self.bind_sints_to_buf(b.va_addr, buf=buf, fmt=s.fmt, offset=base + s.offset)
        for s, v in zip(scalars, vals): self.bind_sints_to_buf(v, buf=buf, fmt=s.fmt, offset=base + s.offset)
        if (bound := prg.bindings) is not None and len(bufs) >= bound.count:
            self.bind_sints_to_buf(*(b.size for b in bufs[:bound.count]), buf=buf, fmt="Q", offset=base + bound.sizes_offset)


if TYPE_CHECKING:
    class _Launch:
        def __call__(self, *bufs: HCQBuffer, global_size: Dims = (1, 1, 1), local_size: Dims = (1, 1, 1),
                     vals: tuple[sint, ...] = (), wait: bool = False, timeout: int | None = None) -> float | None: ...
else:
    _Launch = hotpath.LaunchBase  # prg(...): the native fast path (hcq/_hotpath.c) where it can, else prg.launch(...)
# What turns the native fast path off: capturing, profiling, validating (those launches go through `launch`).
hotpath.set_gates(((vars(recorder), "capturing"), (vars(profiler), "active"), (vars(validation), "enabled")))


class HCQProgram(_Launch):
    """A kernel loaded on one device. `fill_kernargs` prepares a launch's arguments; calling the program,
    `prg(*bufs, global_size=, local_size=, vals=, wait=, timeout=)`, is `prg.launch(...)`: it enqueues the kernel
    after all earlier work on the device (and returns its run time with wait=True). Plain launches take a native
    fast path when hcq's CPython extension is built."""
    arg_slots: list[ArgSlot]
    args_offset: int = 0
    entry: int = 0  # the word that names the kernel in an EXEC packet (packet backends)
    fixed_local_size: tuple[int, int, int] | None = None  # a block size the kernel fixed when compiled: launches must use it
    native_launch = True  # whether the native fast path may run this program's launch plan (False: the backend writes more per launch)
    bindings: BufferBindings | None = None  # buffers bound with their sizes (set before __init__; they turn native_launch off)

    def __init__(self, args_state_t: type[HCQArgsState], dev: Any, name: str, kernargs_alloc_size: int,
                 lib: bytes | None = None, base: int | None = None):
        self.args_state_t, self.dev, self.name, self.kernargs_alloc_size, self.lib, self.base = \
            args_state_t, dev, name, kernargs_alloc_size, lib, base
        self._timing_signals: tuple | None = None
        self._launch_runs: dict[bool, Any] = {}  # the fast launcher's plan runs (untimed, timed), made at first use
        if self.entry: dev.kernel_names[self.entry] = name  # hang reports name the kernel an EXEC runs
        self._layout: Any = False  # the KernargsLayout or None (False: not made yet)
        self._last_kernargs: tuple | None = None  # (bufs, vals, offset, ring lap, device address) of the last fast launch
        if self.bindings is not None: self.native_launch = False  # (the native run of a launch plan does not write the sizes)

    def timing_signals(self) -> tuple[Any, Any]:
        """The (start, end) timestamp signals of this program's timed launches (`wait=True`), made once."""
        if self._timing_signals is None: self._timing_signals = (self.dev.new_signal(), self.dev.new_signal())
        return self._timing_signals

    def kernargs_layout(self) -> KernargsLayout | None:
        """Where a plain launch writes this program's arguments (made once from `arg_slots`), or None when its launches
        always take the checked path (no `arg_slots`, or a pointer parameter that is not a 64-bit address)."""
        if self._layout is False:
            slots: list[ArgSlot] | None = getattr(self, "arg_slots", None)
            if slots is None or any(s.is_pointer and s.fmt != "Q" for s in slots): self._layout = None
            else: self._layout = KernargsLayout(self.kernargs_alloc_size, tuple(self.args_offset + s.offset for s in slots if s.is_pointer),
                                                tuple((self.args_offset + s.offset, s.fmt) for s in slots if not s.is_pointer))
        return self._layout

    def _fast_kernargs(self, bufs: tuple[HCQBuffer, ...], vals: tuple, tag: int) -> int | None:
        """Fill kernargs for concrete buffers and values without building an args state (the Python run of a launch plan,
        see KernargsLayout.accepts). Returns their device address, or None when the call needs the checked path. A
        launch with the same buffers and values as the previous one re-reads the previous block."""
        dev, layout = self.dev, self._layout if self._layout is not False else self.kernargs_layout()
        if layout is None or not (taken := layout.accepts(dev, bufs, vals)): return None
        if (bound := self.bindings) is not None and any(bound.problem(b) is not None for b in bufs[:bound.count]): return None  # (the checked path says why)
        ring, last = dev.kernargs_allocator, self._last_kernargs
        if taken == 1 and last is not None and last[0] == bufs and last[1] == vals and ring.retag(last[2], layout.size, last[3], tag):
            return last[4]  # (a block reused for the same buffers has their sizes already)
        off = ring.alloc(layout.size, tag)
        if not layout.pack_into(dev.kernargs_raw, off, bufs, vals): return None
        if bound is not None: struct.pack_into(f"<{bound.count}Q", dev.kernargs_raw, off + self.args_offset + bound.sizes_offset, *(b.size for b in bufs[:bound.count]))
        addr = dev.kernargs_buf.va_addr + off
        self._last_kernargs = (bufs, vals, off, ring.lap, addr) if taken == 1 else None
        return addr

    def check_args(self, bufs: Sequence[object], vals: Sequence[object]) -> tuple[sint, ...]:
        """Raise ValueError/TypeError when buffers or values do not match the kernel's parameters; returns the values as
        Python numbers (an integer parameter takes ints, numpy integers and Variables, a floating one any real number;
        never a bool)."""
        slots = getattr(self, "arg_slots", None)
        if slots is None: return tuple(vals)  # type: ignore[arg-type]
        ptrs = [s for s in slots if s.is_pointer]
        scalars = [s for s in slots if not s.is_pointer]
        sig = f"{self.name}({', '.join(f'{s.ctype} {s.name}' for s in slots)})"
        if len(bufs) != len(ptrs) or len(vals) != len(scalars):
            raise ValueError(f"kernel {sig} takes {len(ptrs)} buffer(s) and {len(scalars)} value(s), "
                             f"got {len(bufs)} buffer(s) and {len(vals)} value(s)")
        for s, b in zip(ptrs, bufs):
            if not isinstance(b, HCQBuffer):
                raise TypeError(f"kernel {sig}: parameter {s.name!r} needs an HCQBuffer, got {type(b).__name__}")
            if b.freed: raise ValueError(f"kernel {sig}: parameter {s.name!r} got a freed buffer {b!r}")
            if not s.read_only: b.check_writable(f"kernel {sig}: parameter {s.name!r} may write", " (declare it const to read it, or pass a copy)")
            self._reach(sig, s, b)
        if (bound := self.bindings) is not None:
            for s, b in zip(ptrs, bufs[:bound.count]):
                if (why := bound.problem(b)) is not None: raise ValueError(f"kernel {self.name}: parameter {s.name!r} ({s.ctype}) got {b!r}, which {why}")
        out: list[Any] = []  # (ints, floats and Variables)
        for s, v in zip(scalars, vals):
            if s.fmt in REAL_FORMATS:
                if (x := as_real(v)) is None: raise TypeError(f"kernel {sig}: parameter {s.name!r} ({s.ctype}) needs a number, got {v!r}")
                try:
                    struct.pack("=" + s.fmt, x)  # (what the native path's conversion refuses too: no silent inf)
                except (OverflowError, struct.error):
                    raise ValueError(f"kernel {sig}: parameter {s.name!r} ({s.ctype}) = {_show(v)} is too large for a {s.ctype}") from None
                out.append(x)  # (an int stays an int: struct converts it exactly)
            elif isinstance(v, Expr):
                out.append(v)
            elif (n := as_integer(v)) is None:
                raise TypeError(f"kernel {sig}: parameter {s.name!r} ({s.ctype}) needs an int or Variable, got {v!r}")
            elif s.fmt in FMT_RANGE and not FMT_RANGE[s.fmt][0] <= n <= FMT_RANGE[s.fmt][1]:
                lo, hi = FMT_RANGE[s.fmt]
                raise ValueError(f"kernel {sig}: parameter {s.name!r} ({s.ctype}) = {_show(n)} is outside [{lo}, {hi}]")
            else:
                out.append(n)
        return tuple(out)

    def _reach(self, sig: str, slot: ArgSlot, buf: HCQBuffer) -> None:
        """A kernel reads its buffers at their addresses on this device: a buffer of a peer is mapped here (once), one of a
        device this device cannot address is refused. (A buffer without an owner, such as a placeholder with a symbolic
        address, is taken as given; validation mode checks its range.)"""
        dev, owner = self.dev, buf.owner
        if owner is None or owner is dev: return
        if getattr(owner, "peer_group", None) != dev.peer_group:
            raise ValueError(f"kernel {sig}: parameter {slot.name!r} got {buf!r}, memory of {owner.device} that {dev.device} cannot "
                             f"address (another peer group); copy it to a buffer of {dev.device} first (allocator.transfer)")
        if dev not in buf.base.mappings: dev.allocator.map(buf)

    def fill_kernargs(self, bufs: tuple[HCQBuffer, ...], vals: tuple[sint, ...] = (), kernargs: HCQBuffer | None = None) -> HCQArgsState:
        """Write `bufs` and `vals` into a kernargs block: `kernargs` if given, else a block the returned state
        owns (valid for as long as the state lives, however often queues holding it are re-submitted)."""
        vals = self.check_args(bufs, vals)
        if kernargs is not None:
            if kernargs.size < self.kernargs_alloc_size:
                raise ValueError(f"kernargs buffer of {kernargs.size} bytes is smaller than {self.name}'s {self.kernargs_alloc_size}")
            return self.args_state_t(kernargs, self, tuple(bufs), vals=tuple(vals))
        block = self.dev.allocator.alloc(self.kernargs_alloc_size, RUNTIME_SPEC, internal=True)
        try:
            state = self.args_state_t(block, self, tuple(bufs), vals=tuple(vals))
        except BaseException:
            self.dev.allocator.free(block, block.size, RUNTIME_SPEC)
            raise
        state._owned = block
        return state

    def _native_plan(self) -> tuple | None:
        """(launcher, LaunchPlan) the native fast path runs for this program (read once, at its first call), or None."""
        launcher = self.dev.fast_launch
        return launcher.native_plan(self) if launcher is not None else None

    def launch(self, *bufs: HCQBuffer, global_size: Dims = (1, 1, 1), local_size: Dims = (1, 1, 1),
               vals: tuple[sint, ...] = (), wait: bool = False, timeout: int | None = None) -> float | None:
        """Enqueue the program after all earlier work on the device. With wait=True, wait for it and
        return its run time in seconds (from device timestamps); with a `timeout` (ms) too, give up waiting
        after that long with HCQTimeoutError: the kernel runs on and the device stays usable (a deadline,
        as tinygrad's BEAM search sets on candidates, not a hang)."""
        dev, prof = self.dev, profiler.active
        deadline = timeout is not None and wait
        if deadline and (not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or timeout < 0):
            raise ValueError(f"timeout must be a number of ms >= 0, got {timeout!r}")
        if not deadline and not recorder.capturing and prof is None and not validation.enabled and (launch := dev.fast_launch) is not None:
            if (res := launch(self, bufs, global_size, local_size, vals, wait)) is not FALLBACK: return res
        if (rec := recorder.active()) is not None:
            rec.on_exec(self, bufs, self.check_args(bufs, vals), as_dims(global_size), as_dims(local_size))
            return None
        t0 = time.perf_counter_ns() if prof is not None else 0
        args = self.fill_kernargs(bufs, vals)
        q = dev.hw_compute_queue_t(profile=False).wait(dev.timeline_signal, dev.timeline_value - 1).memory_barrier()  # timed below
        if wait or prof is not None:
            if prof is not None: st, en = dev.new_signal(), dev.new_signal()  # every profiled launch keeps its own pair
            else: st, en = self.timing_signals()
            q.timestamp(st)
        q.exec(self, args, global_size, local_size)
        if wait or prof is not None: q.timestamp(en)
        dev.submit_timeline(q.signal(dev.timeline_signal, dev.timeline_value))  # a refused one leaves the timeline as it was
        if prof is not None:
            prof.device_event("kernel", self.name, dev, (COMPUTE, 0), st, en, global_size=str(as_dims(global_size)),
                              local_size=str(as_dims(local_size)))
        if deadline:  # unlike synchronize's timeout (a hang), a missed deadline leaves the device usable
            dev.timeline_signal.wait(dev.timeline_value - 1, timeout=timeout)
            dev.check_error(f"running {self.name}")
        elif wait: dev.synchronize()
        if prof is not None: prof.host_event(f"launch {self.name}", t0)
        return float(en.timestamp - st.timestamp) / 1e6 if wait else None

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name} on {self.dev.device}>"
