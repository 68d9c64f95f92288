"""Validation mode (`HCQ_VALIDATE=1`), in the spirit of Vulkan's validation layers: while on, queues note
every command's memory ranges and launch parameters as they are built, and each submit checks them with
every symbol resolved: ranges inside live (not freed) allocations of the peer group, grid and block dims
positive and within the device's limits, kernargs matching the program's signature. A violation raises
ValidationError naming the queue, the command's index, the command and the offending value. Off by
default: queues then keep no notes and submit checks nothing."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from hcq.errors import HCQError
from hcq.helpers import getenv
from hcq.interfaces import DeviceLike
from hcq.symbolic import Expr, UnboundVariableError, sint

enabled: bool = getenv("HCQ_VALIDATE", 0) != 0


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


def check(queue_name: str, notes: list[Note], dev: DeviceLike, var_vals: Mapping[str, int]) -> None:
    """Check every noted command of a queue about to be submitted to `dev`."""
    peers = dev.peers()
    for note in notes:
        where = f"{queue_name} on {dev.device}, command {note.index} ({note.command})"
        for what, addr, size in note.ranges:
            a, n = _resolve(addr, var_vals, where), _resolve(size, var_vals, where)
            _check_range(where, what, a, n, peers)
        if note.launch is not None: _check_launch(where, note.launch, var_vals, dev)


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
