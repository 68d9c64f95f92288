"""Validation mode (`HCQ_VALIDATE=1`), in the spirit of Vulkan's validation layers: while on, queues note
every command's memory ranges and launch parameters as they are built, and each submit checks them with
every symbol resolved: ranges inside live (not freed) allocations of the peer group, grid and block dims
positive and within the device's limits, kernargs matching the program's signature. A violation raises
ValidationError naming the queue, the command's index, the command and the offending value. Off by
default: queues then keep no notes and submit checks nothing."""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Mapping

from hcq.errors import HCQError
from hcq.helpers import env_flag
from hcq.interfaces import DeviceLike
from hcq.symbolic import Expr, UnboundVariableError, sint

enabled: bool = env_flag("HCQ_VALIDATE", False)


class ValidationError(HCQError, ValueError):
    """A command failed validation at submit."""


class UnboundInValidation(ValidationError, UnboundVariableError):
    """Validation found a symbol without a value (catchable as either error)."""

    def __str__(self) -> str:
        return str(self.args[0])


@dataclass
class Note:
    """One command as validation sees it."""
    index: int
    command: str
    ranges: list[tuple[str, sint, sint]] = field(default_factory=list)  # (what, address, size)
    launch: tuple[Any, Any, tuple[sint, ...], tuple[sint, ...]] | None = None  # (prg, args_state, global, local)
    writes: list[tuple[sint, sint]] = field(default_factory=list)  # (address, size) the command may write
    sets: tuple[Any, sint] | None = None  # a signal command: (signal, value); once it holds, the writes before it are done


class StaleReadWarning(UserWarning):
    """The host looked at memory that submitted, unfinished work writes (validation mode)."""


# What a write of submitted work is done by: a signal value that is stored after it. Memory that submitted work writes,
# until the work is done: ([(signal, value), ...], start, end, what).
Mark = tuple[Any, int]
Write = tuple[int, int, str, list[Mark]]  # (address, size, command, signals stored after it in its queue)
_pending_writes: list[tuple[list[Mark], int, int, str]] = []


def _done(marks: list[Mark]) -> bool:
    return any(sig.load() >= v for sig, v in marks)


def note_writes(fence: Any, value: int, writes: list[Write]) -> None:
    """Remember what the submission ending with `fence` >= `value` writes, until it (or a signal stored after a write,
    e.g. the device timeline the host synchronizes on) says the write is done."""
    _pending_writes[:] = [w for w in _pending_writes if not _done(w[0])]
    _pending_writes.extend(([*marks, (fence, value)], a, a + n, what) for a, n, what, marks in writes if n > 0)


def check_host_read(addr: int, size: int, what: str) -> None:
    """Warn (StaleReadWarning) when [addr, addr + size) overlaps memory that submitted work writes and that work has not
    finished: the host would read stale data."""
    for marks, a, b, cmd in _pending_writes:
        if a < addr + size and addr < b and not _done(marks):
            warnings.warn(f"{what} is read by the host while submitted work that writes it ({cmd}) has not finished: "
                          "synchronize (or wait for that work's signal) first", StaleReadWarning, stacklevel=3)
            return


def set_enabled(on: bool) -> None:
    """Turn validation on or off for queues created from now on."""
    global enabled
    enabled = on


def _resolve(x: sint, var_vals: Mapping[str, int], where: str) -> int:
    if not isinstance(x, Expr): return x
    try:
        return x.resolve(var_vals)
    except UnboundVariableError as e:
        raise UnboundInValidation(f"{where}: {e}") from None


def check(queue_name: str, notes: list[Note], dev: DeviceLike, var_vals: Mapping[str, int]) -> list[Write]:
    """Check every noted command of a queue about to be submitted to `dev`; returns the ranges its commands write,
    resolved, each with the signal values stored after it in the queue."""
    peers = dev.peers()
    writes: list[Write] = []
    for note in notes:
        where = f"{queue_name} on {dev.device}, command {note.index} ({note.command})"
        for what, addr, size in note.ranges:
            a, n = _resolve(addr, var_vals, where), _resolve(size, var_vals, where)
            _check_range(where, what, a, n, peers)
        if note.launch is not None: _check_launch(where, note.launch, var_vals, dev)
        written: list[Write] = [(_resolve(a, var_vals, where), _resolve(n, var_vals, where), f"{note.command} of {queue_name}", [])
                                for a, n in note.writes]
        for a, n, _, _ in written: _check_writable(where, a, n, peers)
        writes += written
        if note.sets is not None and writes and (sig := _host_signal(note.sets[0], var_vals, where, peers)) is not None:
            for w in writes: w[3].append((sig, _resolve(note.sets[1], var_vals, where)))
    return writes


def _host_signal(sig: Any, var_vals: Mapping[str, int], where: str, peers: list[Any]) -> Any:
    """The signal the host can read that a signal command stores: itself, or for a virtual one (a graph's) the
    device timeline at its resolved address; None if neither."""
    if not sig.virtual: return sig
    addr = _resolve(sig.value_addr, var_vals, where)
    return next((d.timeline_signal for d in peers if d.timeline_signal.value_addr == addr), None)


def _check_range(where: str, what: str, addr: int, size: int, peers: list[DeviceLike]) -> None:
    if size < 0: raise ValidationError(f"{where}: {what} has negative size {size}")
    if size == 0: return
    for d in peers:
        buf = d.allocator.owns(addr, size)
        if buf is not None:
            if buf._freed: raise ValidationError(f"{where}: {what} 0x{addr:x} (+{size} bytes) uses freed buffer {buf!r}")
            return
        if d.allocator.owns_host_range(addr, size): return
    raise ValidationError(f"{where}: {what} 0x{addr:x} (+{size} bytes) is outside every live allocation of peer group "
                          f"{peers[0].peer_group!r}")


def _check_writable(where: str, addr: int, size: int, peers: list[DeviceLike]) -> None:
    """A command may not write read-only memory (`HCQBuffer.check_writable`, raised as a ValidationError)."""
    if size <= 0: return
    for d in peers:
        if (buf := d.allocator.owns(addr, size)) is not None:
            buf.check_writable(f"{where}: it writes 0x{addr:x} (+{size} bytes)", error=ValidationError)
            return


def _check_launch(where: str, launch: tuple[Any, Any, tuple[sint, ...], tuple[sint, ...]], var_vals: Mapping[str, int],
                  dev: DeviceLike) -> None:
    prg, args_state, gs, ls = launch
    gdims = [_resolve(x, var_vals, where) for x in gs]
    ldims = [_resolve(x, var_vals, where) for x in ls]
    for kind, dims, limits in (("global_size", gdims, dev.max_grid), ("local_size", ldims, dev.max_block)):
        for i, (d, lim) in enumerate(zip(dims, limits)):
            if not 0 < d <= lim: raise ValidationError(f"{where}: {kind}[{i}] = {d} is outside [1, {lim}]")
    threads = ldims[0] * ldims[1] * ldims[2]
    if threads > dev.max_block_threads:
        raise ValidationError(f"{where}: a block of {threads} threads exceeds the device's {dev.max_block_threads}")
    if args_state.prg is not prg: raise ValidationError(f"{where}: kernargs were filled for {args_state.prg.name}, not {prg.name}")
    try:
        prg.check_args(args_state.bufs, args_state.vals)
    except (TypeError, ValueError) as e:
        raise ValidationError(f"{where}: {e}") from None
