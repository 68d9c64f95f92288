"""The matmul teaching example (hcq/bench/matmul.py, docs/kernels.md): its kernels give numpy's answer at
sizes that are and are not multiples of the tiles. Correctness only; no timing assertions."""
import numpy as np
import pytest

from hcq.bench import matmul as mm


@pytest.fixture
def kernels(dev):
    return mm.compile_kernels(dev)


def _inputs(n, seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, n), dtype=np.float32), rng.standard_normal((n, n), dtype=np.float32)


@pytest.mark.parametrize("n", [1, 5, 16, 64, 100, 97, 255, 300])
def test_fast_matches_numpy(dev, kernels, n):
    a, b = _inputs(n, seed=n)
    c = mm.matmul(dev, kernels["fast"], a, b, "fast")
    assert mm.check(c, a.astype(np.float64) @ b.astype(np.float64)), f"n={n}: max error {np.abs(c - a @ b).max()}"


@pytest.mark.parametrize("n", [1, 64, 100])
def test_naive_matches_numpy(dev, kernels, n):
    a, b = _inputs(n, seed=n + 1)
    c = mm.matmul(dev, kernels["naive"], a, b, "naive")
    assert mm.check(c, a.astype(np.float64) @ b.astype(np.float64))


@pytest.mark.parametrize("n", [64, 100])
def test_portable_path_matches_numpy(dev, n):
    """The fast kernel without its AVX2 + FMA path (what runs on a CPU without them, or off x86-64)."""
    prg = mm.compile_kernels(dev, portable=True)["fast"]
    a, b = _inputs(n, seed=n + 2)
    c = mm.matmul(dev, prg, a, b, "fast")
    assert mm.check(c, a.astype(np.float64) @ b.astype(np.float64))


def test_fast_overwrites_c_and_tiles_cover_it(dev, kernels):
    """C's old contents do not leak into the result (the first k slice stores, later ones add), and the
    grid covers every element for a size just past a tile boundary."""
    n = mm.TILE_N + 1
    a, b = _inputs(n, seed=7)
    ab, bb = mm.arrays.upload(dev, a), mm.arrays.upload(dev, b)
    cb = mm.arrays.upload(dev, np.full((n, n), np.nan, np.float32))
    try:
        gs, ls = mm.fast_dims(n)
        assert gs == (2, (n + mm.TILE_M - 1) // mm.TILE_M, 1) and ls == (1, 1, 1)
        kernels["fast"](cb, ab, bb, vals=(n,), global_size=gs, local_size=ls, wait=True)
        c = mm.arrays.download(cb, np.float32, (n, n))
        assert mm.check(c, a.astype(np.float64) @ b.astype(np.float64))
    finally:
        for buf in (ab, bb, cb): dev.allocator.free(buf, buf.size)


@pytest.mark.full
def test_bench_main_runs_small(capsys, dev):
    # (main opens "CPU", which is CPU:0: `dev`, closed after the test)
    assert mm.main(["--n", "48", "--reps", "1", "--rounds", "1", "--naive-reps", "1", "--quiet-wait", "0"]) == 0
    out = capsys.readouterr().out
    assert "fast" in out and "numpy" in out and "ok=False" not in out
