"""Symbolic values: Variable / Expr arithmetic, bounds, resolution and its errors."""
import itertools

import pytest

import hcq
from hcq import Expr, UnboundVariableError, Variable


def test_variable_expr_name_and_bounds():
    v = Variable("n", 0, 2**32 - 1)
    assert v.expr == "n"
    assert (v.vmin, v.vmax) == (0, 2**32 - 1)
    assert v.variables == frozenset({"n"})
    assert isinstance(v, Expr)
    assert v.resolve({"n": 1234}) == 1234


def test_arithmetic_resolves():
    v = Variable("n", 0, 2**32 - 1)
    vals = {"n": 1024}
    assert (v - 1).resolve(vals) == 1023
    assert (v + 8).resolve(vals) == 1032
    assert (8 + v).resolve(vals) == 1032
    assert (2 * v).resolve(vals) == 2048
    assert (v * 3).resolve(vals) == 3072
    assert (v // 3).resolve(vals) == 341
    assert (v % 7).resolve(vals) == 1024 % 7
    assert (100 - v).resolve(vals) == -924
    assert (-v).resolve(vals) == -1024
    # compositions and expressions over two variables
    w = Variable("w", 1, 64)
    e = (v + 8) * 2 // w - v % w
    assert e.variables == frozenset({"n", "w"})
    for n, ww in [(0, 1), (1024, 3), (2**32 - 1, 64), (77, 5)]:
        assert e.resolve({"n": n, "w": ww}) == (n + 8) * 2 // ww - n % ww


def test_arithmetic_bounds():
    v = Variable("n", 0, 2**32 - 1)
    assert ((v - 1).vmin, (v - 1).vmax) == (-1, 2**32 - 2)
    assert ((v + 8).vmin, (v + 8).vmax) == (8, 2**32 + 7)
    assert ((2 * v).vmin, (2 * v).vmax) == (0, 2**33 - 2)
    assert ((v // 4).vmin, (v // 4).vmax) == (0, (2**32 - 1) // 4)
    assert ((v % 7).vmin, (v % 7).vmax) == (0, 6)
    m = Variable("m", 3, 10)
    assert ((-m).vmin, (-m).vmax) == (-10, -3)
    assert ((5 - m).vmin, (5 - m).vmax) == (-5, 2)


@pytest.mark.parametrize("build", [
    lambda a, b: a - 10,
    lambda a, b: (a - 10) * b,
    lambda a, b: a // b,
    lambda a, b: (a - 10) // b,
    lambda a, b: (a - 10) // 3,
    lambda a, b: (a - 10) % b,
    lambda a, b: a % b + b * 2 - a,
    lambda a, b: (a * b) // (b + 1),
], ids=["sub", "mul", "floordiv", "neg_floordiv_sym", "neg_floordiv_const", "neg_mod", "mix", "div_expr"])
def test_bounds_contain_every_value(build):
    """vmin/vmax are bounds: every value the expression takes over its variables' ranges lies inside them."""
    a, b = Variable("a", 0, 20), Variable("b", 1, 5)
    e = build(a, b)
    seen = [e.resolve({"a": x, "b": y}) for x, y in itertools.product(range(0, 21), range(1, 6))]
    assert e.vmin <= min(seen) and max(seen) <= e.vmax, f"{e!r} takes values in [{min(seen)}, {max(seen)}]"


def test_range_violation_at_resolve_names_variable():
    v = Variable("n", 0, 2**32 - 1)
    with pytest.raises(ValueError, match=r"\bn\b.*4294967296"):
        v.resolve({"n": 2**32})
    with pytest.raises(ValueError, match=r"\bn\b.*-1"):
        (v + 8).resolve({"n": -1})
    k = Variable("kval", 5, 10)
    with pytest.raises(ValueError, match="kval"):
        (2 * k - 1).resolve({"kval": 4})
    assert (2 * k - 1).resolve({"kval": 10}) == 19


def test_missing_variable_raises_unbound_naming_it():
    n, m = Variable("n", 0, 100), Variable("other_var", 0, 100)
    with pytest.raises(UnboundVariableError, match="other_var"):
        (n + m).resolve({"n": 3})
    with pytest.raises(hcq.UnboundVariableError, match=r"'n'"):
        (n * 2).resolve({})
    assert issubclass(UnboundVariableError, KeyError)


def test_no_truth_value_or_int():
    v = Variable("n", 0, 10)
    for e in (v, v + 1, 2 * v):
        with pytest.raises(TypeError, match="symbolic"):
            bool(e)
        with pytest.raises(TypeError, match="symbolic"):
            int(e)
        with pytest.raises(TypeError):
            if e: pass  # noqa: E701
        with pytest.raises(TypeError):
            [0, 1, 2][e]


def test_bad_variables_and_operands():
    with pytest.raises(ValueError, match="min"):
        Variable("n", 5, 4)
    with pytest.raises(ValueError, match="identifier"):
        Variable("not a name", 0, 1)
    v = Variable("n", 0, 10)
    with pytest.raises(ValueError, match="<= 0"):
        v // Variable("z", 0, 3)
    with pytest.raises(ValueError, match="<= 0"):
        v % 0
    with pytest.raises(TypeError):
        v + 1.5
    with pytest.raises(TypeError):
        v + True
