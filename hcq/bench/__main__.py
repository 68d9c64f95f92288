"""python -m hcq.bench: hcq vs its peers, side by side in one run (issue 5). See hcq/bench/__init__.py."""
from __future__ import annotations

import argparse
import functools
import json
import math
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from hcq.bench import vulkan
from hcq.bench.common import (COLLAPSE_RATIO, SECTIONS, Config, LoadSampler, machine_info, median, merge_tails, other_processes_busy,
                              wait_for_quiet)
from hcq.bench.peers import PEER_SECTIONS, PEERS, TITLES, PeerProcess, install_peers, missing_reason
from hcq.bench.report import build_rows, markdown_table, missed, row_groups, tail_rows, tail_table, text_table

if TYPE_CHECKING: from hcq.bench.ours import Ours

ALL_SECTIONS = (*SECTIONS, vulkan.SECTION)
ALL_PEERS = (*PEERS, *vulkan.PEER_NAMES)
SECTION_TITLES = {"rt": "round trip", "pipe": "pipelined", "graph": "graph replay", "copy": "copies", "compute": "compute scaling",
                  "signal": "signal latency", vulkan.SECTION: "Vulkan", "rt_processes": "round trip in fresh processes"}
TAILS_TITLE = f"Tails (a run collapsed: its p90 > {COLLAPSE_RATIO:g}x its own median; p50/p90/p99 are medians over the runs)"


def _jsonable(x: Any) -> Any:
    """Results as JSON will store them (string keys; inf/nan as None)."""
    if isinstance(x, dict): return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)): return [_jsonable(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x): return None
    return x


def markdown_report(results: dict[str, Any]) -> str:
    """The machine line, the table and the noise notes, in Markdown (for BENCHMARKS.md)."""
    m = results["machine"]
    lines = [f"Machine: {m['nproc']} CPUs, {m['cpu_model']}, Linux {m['kernel']}; Python {m['python']}, numpy {m['numpy']}; "
             f"C compiler {m['cc']}; hcq {m['hcq_commit']} ({m['hcq_tree']}); {m['date']}; whole run {results.get('wall_s')} s.", ""]
    for name, info in results.get("peer_info", {}).items():
        lines.append(f"- {TITLES[name]}: " + ", ".join(f"{k} {v}" for k, v in info.items()))
    for name, why in results.get("skipped_peers", {}).items(): lines.append(f"- {TITLES[name]}: skipped ({why})")
    lines += _vk_notes(results.get(vulkan.SECTION), "- ")
    for title, rows in row_groups(results["rows"]): lines += ["", f"{title}:", "", markdown_table(rows)]
    if results.get("tails"): lines += ["", f"{TAILS_TITLE}:", "", tail_table(results["tails"], markdown=True)]
    lines.append("")
    noisy = {s: v for s, v in results.get("other_load", {}).items() if v >= 0.05}
    lines.append("Other processes' share of the CPU per section: " +
                 ", ".join(f"{SECTION_TITLES[s]} {v * 100:.0f}%" for s, v in results.get("other_load", {}).items()) +
                 (" (noisy sections marked by the bench)" if noisy else ""))
    for key, err in results.get("errors", {}).items(): lines.append(f"- error in {key}: {err}")
    return "\n".join(lines)


def _vk_notes(vk: dict[str, Any] | None, bullet: str = "") -> list[str]:
    """Lines on the Vulkan section: skipped and why, or the devices, the rounds, the CPUs it ran on, skipped peers."""
    if vk is None: return []
    if vk.get("skipped"): return [f"{bullet}Vulkan section skipped: {vk['skipped']}"]
    pin, info = vk.get("pinning") or {}, vk.get("hcq_info") or {}
    lines = [f"{bullet}Vulkan: hcq {info.get('device')} ({info.get('vulkan_device')}); {vk.get('rounds')} rounds alternating hcq and the "
             f"peers (medians over the rounds); CPUs {pin.get('cpus')} of {pin.get('online_cpus')} "
             f"({'pinned' if pin.get('pinned') else 'not pinned'}), LP_NUM_THREADS {pin.get('LP_NUM_THREADS') or 'unset'}"]
    for name, res in (vk.get("peers") or {}).items():
        lines.append(f"{bullet}{vulkan.TITLES[name]}: {res.get('device')}; wait: {res.get('wait')}" +
                     (f"; wgpu {res['wgpu']}" if res.get("wgpu") else "") + (f"; copy memory {res['copy_memory']}" if res.get("copy_memory") else ""))
    lines += [f"{bullet}{vulkan.TITLES[name]}: skipped ({why})" for name, why in (vk.get("skipped_peers") or {}).items()]
    return lines


ROUNDS = {"rt": 5, "pipe": 5}  # sections run in alternating rounds (hcq, peers, hcq, peers...): drift hits all alike


def _round_cfg(section: str, cfg: Config, rounds: int) -> Config:
    c = Config.from_json(cfg.to_json())
    if section == "rt": c.rt_samples = max(50, cfg.rt_samples // rounds)
    if section == "pipe": c.pipe_batches = max(1, -(-cfg.pipe_batches // rounds))
    return c


def _merge_rounds(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Median over rounds of each numeric figure (vulkan.merge_medians); the per-round values of the headline figure
    are kept under 'rounds'."""
    out: dict[str, Any] = vulkan.merge_medians(parts)
    key = "us" if "us" in out else "us_per_kernel" if "us_per_kernel" in out else None
    if key: out["rounds"] = [round(p[key], 3) for p in parts]
    if any(p.get("tail") for p in parts): out["tail"] = merge_tails([p["tail"] for p in parts if p.get("tail")])  # each round a run
    return out


def _rt_processes(n: int, cfg: Config, peers: list[str]) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    """The round trip (cfg.rt_samples samples) in `n` fresh processes of hcq (`python -m hcq.bench.ours rt`) and of each
    peer in `peers` (a new peer server each), alternating: ({who: {us: median of the processes' medians, per_process_us,
    tail: each process a run}}, errors)."""
    got: dict[str, list[dict[str, Any]]] = {}
    errors: dict[str, str] = {}
    for _ in range(n):
        try:
            r = subprocess.run([sys.executable, "-m", "hcq.bench.ours", "rt", json.dumps(cfg.to_json())], capture_output=True, text=True,
                               timeout=300)
            if r.returncode != 0: raise RuntimeError(f"exit code {r.returncode}: {r.stderr.strip()[-500:]}")
            got.setdefault("hcq", []).append(json.loads(r.stdout.strip().splitlines()[-1]))
        except Exception as e:  # noqa: BLE001 - reported, the peers still run
            errors["hcq.rt_processes"] = f"{type(e).__name__}: {e}"
        for name in peers:
            proc = PeerProcess(name)
            ans = proc.request("rt", cfg)
            proc.close()
            if ans.get("ok") and ans.get("result"): got.setdefault(name, []).append(ans["result"])
            else: errors[f"{name}.rt_processes"] = str(ans.get("error"))
    return {who: {"us": median([r["us"] for r in rs]), "per_process_us": [round(r["us"], 3) for r in rs], "processes": len(rs),
                  "tail": merge_tails([r["tail"] for r in rs])} for who, rs in got.items()}, errors


def _run_section(section: str, ours: Any, running: dict[str, PeerProcess], cfg: Config
                 ) -> tuple[dict[str, Any] | None, dict[str, Any], dict[str, str]]:
    """hcq's side of a section, then each running peer's (right after, under the same conditions); sections
    in ROUNDS alternate in several rounds and report the median of the rounds."""
    from hcq.bench.ours import SECTION_FUNCS
    rounds = ROUNDS.get(section, 1)
    rcfg = _round_cfg(section, cfg, rounds) if rounds > 1 else cfg
    errors: dict[str, str] = {}
    ours_parts: list[dict[str, Any]] = []
    peer_parts: dict[str, list[dict[str, Any]]] = {}
    for _ in range(rounds):
        try:
            if f"hcq.{section}" not in errors: ours_parts.append(getattr(ours, SECTION_FUNCS[section])(rcfg))
        except Exception as e:  # noqa: BLE001 - one broken section must not lose the others
            traceback.print_exc()
            errors[f"hcq.{section}"] = f"{type(e).__name__}: {e}"
        for name, proc in running.items():
            if section not in PEER_SECTIONS[name] or f"{name}.{section}" in errors: continue
            ans = proc.request(section, rcfg)
            if ans.get("ok") and ans.get("result") is not None: peer_parts.setdefault(name, []).append(ans["result"])
            elif not ans.get("ok"): errors[f"{name}.{section}"] = str(ans.get("error"))
    def merged(parts: list[dict[str, Any]]) -> dict[str, Any] | None:
        if not parts: return None
        return parts[0] if len(parts) == 1 else _merge_rounds(parts)
    peer_res = {name: m for name, parts in peer_parts.items() if (m := merged(parts)) is not None}
    return merged(ours_parts), peer_res, errors


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hcq.bench", description="hcq vs PoCL, tinygrad and memcpy, and hcq's Vulkan device vs "
                                 "raw Vulkan and wgpu, side by side in one run.")
    ap.add_argument("--install-peers", action="store_true",
                    help="first install missing peers: apt-get update + install pocl-opencl-icd clang, pip install pyopencl tinygrad "
                         "(into this interpreter's environment; never a project dependency)")
    ap.add_argument("--peers", default=",".join(ALL_PEERS),
                    help=f"comma list of peers to run (default {','.join(ALL_PEERS)}; {', '.join(vulkan.PEER_NAMES)}: the {vulkan.SECTION} "
                         "section's; '' for none)")
    ap.add_argument("--only", default=",".join(ALL_SECTIONS),
                    help=f"comma list of sections (default all: {','.join(ALL_SECTIONS)}; {vulkan.SECTION}: hcq's Vulkan device against raw "
                         "Vulkan in C and wgpu, skipped with the reason where Vulkan is missing)")
    ap.add_argument("--quick", action="store_true", help="fewer repetitions and sizes (a smoke run, numbers are rougher)")
    ap.add_argument("--quiet-wait", type=float, default=10.0,
                    help="before each section wait up to this many seconds for other processes to use < 10%% of the CPU "
                         "(default 10; at most 60 s of waiting in the whole run)")
    ap.add_argument("--retries", type=int, default=1,
                    help="re-run a section (up to this many times) when other processes took >= 10%% of the CPU during it; "
                         "the quietest attempt is kept (default 1)")
    ap.add_argument("--rt-samples", type=int, default=None,
                    help="round trips timed for the round-trip row (default 3000, --quick 300; split over its rounds; each "
                         "--processes process times them all)")
    ap.add_argument("--processes", type=int, default=0,
                    help="also run the round-trip row in this many fresh processes (hcq's and each peer's, alternating) and report "
                         f"the worst p90/median and how many processes collapsed (p90 > {COLLAPSE_RATIO:g}x their median); "
                         "issue 46's target: none of 30 (with --only rt: the round trip alone)")
    ap.add_argument("--json", default="hcq-bench.json", help="where to write the results (default ./hcq-bench.json)")
    ap.add_argument("--markdown", default=None, help="also write the table as Markdown (with the machine line) to this file")
    args = ap.parse_args(argv)
    # Processes this run starts (the fresh-process round trips, the peers) import numpy, whose OpenBLAS starts a worker
    # thread that spins on a CPU for about 0.1 s after the import: on a 2-CPU machine a fresh process's round trip (some
    # milliseconds, right after it starts) then ran 3.4-5.4 us in 14 of 20 processes, against 1.5 us without it. No
    # section here calls BLAS, so the children get one BLAS thread, hcq's and the peers' alike (unless already set).
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

    sections = [s.strip() for s in args.only.split(",") if s.strip()]
    peers = [p.strip() for p in args.peers.split(",") if p.strip()]
    for s in sections:
        if s not in ALL_SECTIONS: ap.error(f"unknown section {s!r}; choose from {', '.join(ALL_SECTIONS)}")
    for p in peers:
        if p not in ALL_PEERS: ap.error(f"unknown peer {p!r}; choose from {', '.join(ALL_PEERS)}")
    vk_peers = tuple(p for p in peers if p in vulkan.PEER_NAMES)
    peers = [p for p in peers if p in PEERS]
    cfg = Config.quick() if args.quick else Config()
    if args.rt_samples is not None: cfg.rt_samples = max(1, args.rt_samples)
    t_start = time.perf_counter()

    def say(msg: str) -> None:
        print(msg, flush=True)

    if args.install_peers: install_peers(peers, say)
    machine = machine_info()
    say(f"machine: {machine['nproc']} CPUs ({machine['cpu_model']}), Python {machine['python']}, numpy {machine['numpy']}, "
        f"{machine['date']}; hcq {machine['hcq_commit']} ({machine['hcq_tree']})")
    busy = other_processes_busy()
    if busy: say(f"note: other processes are busy right now (numbers will be noisier): {'; '.join(busy[:6])}")

    # Peers, each in its own process; a missing one is skipped with a line saying why.
    sampler = LoadSampler()
    running: dict[str, PeerProcess] = {}
    skipped: dict[str, str] = {}
    wanted = [p for p in peers if any(s in PEER_SECTIONS[p] for s in sections)]
    for name in wanted:
        if (why := missing_reason(name)) is not None:
            skipped[name] = why
            continue
        proc = PeerProcess(name)
        if proc.ready:
            running[name] = proc
            sampler.children.append(proc.pid)
            say(f"peer {TITLES[name]}: {', '.join(f'{k} {v}' for k, v in proc.info.items())}")
        else:
            skipped[name] = proc.reason or "did not start"
    for name, why in skipped.items(): say(f"peer {TITLES[name]}: SKIPPED - {why}")

    ours: Ours | None = None
    if any(s != vulkan.SECTION for s in sections):  # hcq's CPU devices, opened only for their sections
        from hcq.bench.ours import Ours
        ours = Ours()
    results: dict[str, Any] = {"machine": machine, "config": cfg.to_json(), "hcq_info": ours.info() if ours else None, "hcq": {},
                               "errors": {}, "peers": {name: {} for name in running}, "peer_info": {n: p.info for n, p in running.items()},
                               "skipped_peers": skipped, "other_load": {}, "busy_at_start": busy}
    wait_left = 60.0  # the whole run's budget for waiting on other processes

    def quietest(section: str, measure: Callable[[], Any]) -> tuple[float, Any]:
        """(share of the CPU other processes took, result) of the quietest attempt at `measure` (see --retries)."""
        nonlocal wait_left
        best: tuple[float, Any] | None = None
        for attempt in range(1 + max(0, args.retries)):
            t_wait = time.perf_counter()
            limit = min(args.quiet_wait, wait_left)
            before = wait_for_quiet(sampler, limit, threshold=0.10) if limit > 0 else 0.0
            wait_left -= time.perf_counter() - t_wait
            if before >= 0.10: say(f"  (other processes still use {before * 100:.0f}% of the CPU; measuring anyway)")
            sampler.start()
            res = measure()
            share = sampler.stop(section) or 0.0
            if best is None or share < best[0]: best = (share, res)
            if share < 0.10: break
            if attempt < args.retries: say(f"  {SECTION_TITLES[section]}: other processes took {share * 100:.0f}% of the CPU; measuring again")
        assert best is not None
        return best

    for section in sections:
        t = time.perf_counter()
        if section == vulkan.SECTION:
            share, vk = quietest(section, functools.partial(vulkan.run, cfg, args.quick, say, vk_peers))
            results[section] = vk
            results["errors"].update(vk.get("errors", {}))
            if vk.get("skipped"): say(f"Vulkan section skipped: {vk['skipped']}")
        else:
            share, (ours_res, peer_res, errs) = quietest(section, functools.partial(_run_section, section, ours, running, cfg))
            if ours_res is not None: results["hcq"][section] = ours_res
            for name, r in peer_res.items(): results["peers"][name][section] = r
            results["errors"].update(errs)
        sampler.sections[section] = round(share, 3)
        note = f"; other processes took {share * 100:.0f}% of the CPU" if share >= 0.05 else ""
        say(f"{SECTION_TITLES[section]}: {time.perf_counter() - t:.1f} s{note}")
    if args.processes > 0 and "rt" in sections:
        t = time.perf_counter()
        rt_peers = [name for name in running if "rt" in PEER_SECTIONS[name]]
        share, (per_who, errs) = quietest("rt_processes", functools.partial(_rt_processes, args.processes, cfg, rt_peers))
        for who, r in per_who.items(): (results["hcq"] if who == "hcq" else results["peers"][who])["rt_processes"] = r
        results["errors"].update(errs)
        sampler.sections["rt_processes"] = round(share, 3)
        say(f"{SECTION_TITLES['rt_processes']} ({args.processes} each): {time.perf_counter() - t:.1f} s" +
            (f"; other processes took {share * 100:.0f}% of the CPU" if share >= 0.05 else ""))
    results["other_load"] = sampler.sections
    for proc in running.values(): proc.close()

    results = _jsonable(results)
    rows = build_rows(results)
    results["rows"] = rows
    results["tails"] = tails = tail_rows(results)
    results["wall_s"] = round(time.perf_counter() - t_start, 1)
    Path(args.json).write_text(json.dumps(results, indent=1) + "\n")

    if args.markdown: Path(args.markdown).write_text(markdown_report(results) + "\n")
    for title, group in row_groups(rows):
        say("")
        say(f"{title}:")
        say(text_table(group))
    if tails:
        say("")
        say(f"{TAILS_TITLE}:")
        say(tail_table(tails))
    say("")
    for line in _vk_notes(results.get(vulkan.SECTION)): say(line)
    for key, err in results["errors"].items(): say(f"error in {key}: {err}")
    for name, why in skipped.items(): say(f"{TITLES[name]} skipped: {why}")
    noisy = {s: v for s, v in results["other_load"].items() if v >= 0.05}
    if noisy: say("noise: other processes used " + ", ".join(f"{v * 100:.0f}% of the CPU during {SECTION_TITLES[s]}" for s, v in noisy.items()))
    miss = missed(rows) + missed(tails)
    say(f"targets missed: {len(miss)}" + (": " + "; ".join(r["metric"] for r in miss) if miss else ""))
    say(f"wrote {args.json} ({results['wall_s']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
