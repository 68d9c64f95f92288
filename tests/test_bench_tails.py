"""The bench's tails (issue 46, point 2): percentiles, the collapse count, and that a tiny real run of the round-trip
row in fresh processes reports them. Behaviour only: no assertion on how fast anything is."""
import json
import subprocess
import sys

import pytest

from hcq.bench.common import (COLLAPSE_RATIO, chunk_sizes, chunk_times, is_collapsed, merge_tails, quantile, runs_summary, tail,
                              time_each)
from hcq.bench.report import tail_rows, tail_table


def test_quantile_is_the_nearest_rank_of_the_sorted_samples():
    xs = list(range(100, 0, -1))  # 1..100, unsorted
    assert quantile(xs, 0.5) == 51  # index round(0.5 * 99) = 50 (round half to even: 49.5 -> 50)
    assert quantile(xs, 0.9) == 90 and quantile(xs, 0.99) == 99 and quantile(xs, 0.0) == 1 and quantile(xs, 1.0) == 100
    assert quantile([7.0], 0.99) == 7.0


def test_tail_gives_p50_p90_p99_scaled_and_the_collapse_flag():
    t = tail([1000] * 80 + [2000] * 15 + [50_000] * 5, 1e-3)  # ns -> us
    assert (t["p50"], t["p90"], t["p99"]) == (1.0, 2.0, 50.0)
    assert t["runs"] == 1 and t["collapsed"] == 0 and t["collapsed_share"] == 0 and t["worst_p90_over_p50"] == 2.0
    assert t["per_run"] == [{"p50": 1.0, "p90": 2.0, "p99": 50.0, "samples": 100}] and t["collapse_ratio"] == COLLAPSE_RATIO
    bad = tail([1.0] * 85 + [10.0] * 15)  # p90 = 10 > 6 x 1
    assert bad["collapsed"] == 1 and bad["collapsed_share"] == 1.0 and bad["worst_p90_over_p50"] == 10.0


def test_collapsed_means_p90_strictly_above_six_times_the_median():
    assert COLLAPSE_RATIO == 6.0
    assert not is_collapsed(1.0, 6.0) and is_collapsed(1.0, 6.0001) and not is_collapsed(2.0, 11.9)


def test_runs_summary_counts_collapsed_runs_and_the_worst_ratio():
    runs = [{"p50": 1.0, "p90": r, "p99": 2 * r, "samples": 10} for r in (1.5, 7.0, 2.0, 12.0, 3.0)]
    s = runs_summary(runs)
    assert s["runs"] == 5 and s["collapsed"] == 2 and s["collapsed_share"] == pytest.approx(0.4)
    assert s["worst_p90_over_p50"] == 12.0 and s["p50"] == 1.0 and s["p90"] == 3.0 and s["p99"] == 6.0  # medians over runs
    merged = merge_tails([runs_summary(runs[:2]), runs_summary(runs[2:])])  # rounds merged: the runs pooled, not medians of counts
    assert {k: merged[k] for k in ("runs", "collapsed", "worst_p90_over_p50", "p90")} == {"runs": 5, "collapsed": 2,
                                                                                          "worst_p90_over_p50": 12.0, "p90": 3.0}
    assert runs_summary([{"p50": 0.0, "p90": 1.0, "p99": 1.0, "samples": 3}])["collapsed"] == 1  # a zero median: any tail collapses


def test_chunks_and_time_each_fill_a_preallocated_array():
    assert chunk_times([0, 100, 300], 10) == [10.0, 20.0]
    assert chunk_sizes(250, 100) == [100, 100, 50] and chunk_sizes(200, 100) == [100, 100]
    calls = []
    ns = time_each(lambda: calls.append(1), 17, warmup=3)
    assert len(ns) == 17 and len(calls) == 20 and ns.typecode == "q" and all(x >= 0 for x in ns)


def test_tail_rows_name_hcq_and_peers_and_check_the_round_trip_target():
    ok, bad = tail([1.0] * 100), tail([1.0] * 80 + [9.0] * 20)
    res = {"hcq": {"rt": {"us": 1.0, "tail": ok}, "rt_processes": {"us": 1.0, "tail": merge_tails([ok, bad])}, "pipe": {"tail": ok},
                   "signal": {"cross_queue": {"tail": ok}, "cross_device": {"tail": ok}}},
           "peers": {"pocl": {"rt": {"us": 10.0, "tail": bad}, "pipe": {"tail": ok}, "signal": {"cross_queue": {"tail": ok}, "cross_device": None}}}}
    rows = tail_rows(res)
    got = {(r["metric"].split(" (")[0].split(": ")[0], r["who"]): r for r in rows}
    assert set(got) == {("round trip", "hcq"), ("round trip", "PoCL"), ("round trip, one run per fresh process", "hcq"),
                        ("pipelined", "hcq"), ("pipelined", "PoCL"), ("signal round trip, queue <-> queue", "hcq"),
                        ("signal round trip, queue <-> queue", "PoCL"), ("signal round trip, CPU:0 <-> CPU:1", "hcq")}
    procs = got[("round trip, one run per fresh process", "hcq")]
    assert procs["collapsed"] == 1 and procs["runs"] == 2 and procs["met"] == "NO (10.00x PoCL)"  # one of 2 collapsed
    assert got[("round trip", "hcq")]["met"] == "yes" and got[("round trip", "PoCL")]["met"] == ""  # targets are hcq's
    assert got[("round trip", "PoCL")]["collapsed"] == 1 and got[("round trip", "PoCL")]["p90"] == 9.0
    assert "1/2" in tail_table(rows) and "| 1/2 |" in tail_table(rows, markdown=True)


@pytest.mark.full
def test_a_tiny_round_trip_run_in_two_fresh_processes_reports_the_tails(tmp_path):
    out = tmp_path / "b.json"
    r = subprocess.run([sys.executable, "-m", "hcq.bench", "--only", "rt", "--peers", "", "--rt-samples", "100", "--processes", "2",
                        "--quiet-wait", "0", "--retries", "0", "--json", str(out)], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads(out.read_text())
    rt, procs = res["hcq"]["rt"], res["hcq"]["rt_processes"]
    assert rt["tail"]["runs"] == 5 and all(run["samples"] == 50 for run in rt["tail"]["per_run"])  # 5 rounds, >= 50 samples each
    assert procs["processes"] == 2 and len(procs["per_process_us"]) == 2
    t = procs["tail"]
    assert t["runs"] == 2 and all(run["samples"] == 100 for run in t["per_run"]) and 0 <= t["collapsed"] <= 2
    assert 0 < t["p50"] <= t["p90"] <= t["p99"] and t["worst_p90_over_p50"] >= 1
    rows = {r["metric"]: r for r in res["tails"]}
    assert rows["round trip, one run per fresh process"]["runs"] == 2 and rows["round trip, one run per fresh process"]["who"] == "hcq"
    assert "Tails" in r.stdout and "runs collapsed" in r.stdout and "/2" in r.stdout, r.stdout
    assert res["rows"][0]["section"] == "rt" and res["rows"][0]["target"] == "<= 3 us and >= 6x PoCL"  # the old row is still there
