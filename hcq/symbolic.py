"""Symbolic integers: a `Variable` and expressions over it, usable anywhere a queue takes a value,
an address, a size or a grid dimension. A queue records where each expression went and patches only
those words at submit time (see `HWQueue._apply_var_vals`)."""
from __future__ import annotations

from typing import Callable, Mapping, Union


class Expr:
    """An integer expression over named variables. Immutable; combine with + - * // %."""
    __slots__ = ("expr", "vmin", "vmax", "_fn", "_vars")

    def __init__(self, expr: str, vmin: int, vmax: int, fn: Callable[[Mapping[str, int]], int], variables: frozenset[str]):
        self.expr, self.vmin, self.vmax, self._fn, self._vars = expr, vmin, vmax, fn, variables

    @property
    def variables(self) -> frozenset[str]:
        """Names of the variables this expression depends on."""
        return self._vars

    def resolve(self, var_vals: Mapping[str, int]) -> int:
        """The value for the given variable values. Raises KeyError-like error naming a missing variable."""
        try:
            return self._fn(var_vals)
        except KeyError as e:
            raise UnboundVariableError(f"no value for variable {e.args[0]!r} (needed by {self.expr})") from None

    def _bin(self, other: sint, op: str, fn2: Callable[[int, int], int], rev: bool = False) -> Expr:
        if not isinstance(other, (int, Expr)) or isinstance(other, bool):
            return NotImplemented
        a, b = (other, self) if rev else (self, other)
        fa, fb = _as_fn(a), _as_fn(b)
        lo_a, hi_a, lo_b, hi_b = _bounds(a) + _bounds(b)
        if op in "+-*":
            corners = [fn2(x, y) for x in (lo_a, hi_a) for y in (lo_b, hi_b)]
            lo, hi = min(corners), max(corners)
        else:  # // and %: conservative bounds
            if lo_b <= 0: raise ValueError(f"{op} by a value that may be <= 0 in {_str(a)} {op} {_str(b)}")
            if op == "//":  # monotonic in each argument for a positive divisor: the corners bound it
                corners = [fn2(x, y) for x in (lo_a, hi_a) for y in (lo_b, hi_b)]
                lo, hi = min(corners), max(corners)
            else:
                lo, hi = 0, hi_b - 1
        return Expr(f"({_str(a)}{op}{_str(b)})", lo, hi, lambda vv: fn2(fa(vv), fb(vv)), _vars(a) | _vars(b))

    def __add__(self, o: sint) -> Expr: return self._bin(o, "+", int.__add__)
    def __radd__(self, o: sint) -> Expr: return self._bin(o, "+", int.__add__, True)
    def __sub__(self, o: sint) -> Expr: return self._bin(o, "-", int.__sub__)
    def __rsub__(self, o: sint) -> Expr: return self._bin(o, "-", int.__sub__, True)
    def __mul__(self, o: sint) -> Expr: return self._bin(o, "*", int.__mul__)
    def __rmul__(self, o: sint) -> Expr: return self._bin(o, "*", int.__mul__, True)
    def __floordiv__(self, o: sint) -> Expr: return self._bin(o, "//", int.__floordiv__)
    def __mod__(self, o: sint) -> Expr: return self._bin(o, "%", int.__mod__)
    def __neg__(self) -> Expr: return self._bin(-1, "*", int.__mul__)

    def __index__(self) -> int:
        raise TypeError(f"symbolic value {self.expr} has no concrete value; pass it through var_vals at submit")

    def __bool__(self) -> bool:
        raise TypeError(f"symbolic value {self.expr} has no truth value")

    def __repr__(self) -> str:
        return f"<Expr {self.expr} in [{self.vmin}, {self.vmax}]>"


sint = Union[int, Expr]
"""A plain or symbolic integer: what a queue takes as a value, an address, a size or a grid dimension."""


class UnboundVariableError(KeyError):
    """A symbolic value was resolved without a value for one of its variables."""

    def __str__(self) -> str:
        return str(self.args[0])


class Variable(Expr):
    """A named integer in [vmin, vmax]; its value is given per submit (`q.submit(dev, {"n": 4})`)."""
    __slots__ = ("name",)

    def __init__(self, name: str, vmin: int, vmax: int):
        if not name.isidentifier(): raise ValueError(f"variable name must be an identifier, got {name!r}")
        if vmin > vmax: raise ValueError(f"variable {name}: min {vmin} > max {vmax}")
        self.name = name
        super().__init__(name, vmin, vmax, self._lookup, frozenset((name,)))

    def _lookup(self, var_vals: Mapping[str, int]) -> int:
        v = var_vals[self.name]
        if not self.vmin <= v <= self.vmax:
            raise ValueError(f"variable {self.name}={v} is outside its range [{self.vmin}, {self.vmax}]")
        return v

    def __repr__(self) -> str:
        return f"Variable({self.name!r}, {self.vmin}, {self.vmax})"


def _as_fn(x: sint) -> Callable[[Mapping[str, int]], int]:
    if isinstance(x, Expr): return x._fn

    def const(vv: Mapping[str, int], c: int = x) -> int:
        return c
    return const


def _bounds(x: sint) -> tuple[int, int]:
    return (x.vmin, x.vmax) if isinstance(x, Expr) else (x, x)


def _vars(x: sint) -> frozenset[str]:
    return x._vars if isinstance(x, Expr) else frozenset()


def _str(x: sint) -> str:
    return x.expr if isinstance(x, Expr) else str(x)


def resolve(x: sint, var_vals: Mapping[str, int] | None = None) -> int:
    """Concrete value of an int or expression."""
    if isinstance(x, Expr): return x.resolve(var_vals or {})
    return x
