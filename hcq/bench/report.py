"""Rows of the comparison table from the raw results, the issue's targets, and the text / Markdown tables."""
from __future__ import annotations

from typing import Any

from hcq.bench.common import COLLAPSE_RATIO, GRAPH_KS, KB, MB, size_name

COLUMNS = ("hcq", "pocl", "tinygrad", "memcpy", "vk_raw", "wgpu")
HEADERS = {"hcq": "hcq", "pocl": "PoCL", "tinygrad": "tinygrad", "memcpy": "memcpy", "vk_raw": "raw Vulkan", "wgpu": "wgpu"}
VK_SECTION = "vk"  # the Vulkan section (hcq.bench.vulkan, which builds on this module)
# The figure each Vulkan row compares: (its path in hcq's results, its key in a peer's), by row.
VK_HEADLINES: dict[str, tuple[tuple[str, ...], str]] = {
    "rt": (("rt", "us"), "rt_us"), "pipe": (("pipe", "us_per_dispatch"), "pipelined_us"),
    "graph": (("graph", "wall_us_per_kernel"), "per_dispatch_us"), "copy": (("copy", "gbps"), "copy_gbps")}


def get_in(d: Any, *path: Any) -> Any:
    """d[path[0]][path[1]]..., or None where a step is missing."""
    for p in path:
        if d is None: return None
        d = d.get(p) if isinstance(d, dict) else None
    return d


def _div(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b not in (None, 0) else None


def _met(ok: bool | None, partial: str = "") -> str:
    if ok is None: return "n/a" + (f" ({partial})" if partial else "")
    return ("yes" if ok else "NO") + (f" ({partial})" if partial else "")


def row(section: str, metric: str, unit: str, hcq: float | None = None, pocl: float | None = None, tinygrad: float | None = None,
        memcpy: float | None = None, ratio: float | None = None, ratio_vs: str = "", target: str = "", met: str = "",
        vk_raw: float | None = None, wgpu: float | None = None, also: list[tuple[float | None, str]] | None = None) -> dict[str, Any]:
    """A table row. `ratio` (vs `ratio_vs`) is the main one; `also` lists more (ratio, vs) pairs shown after it."""
    return {"section": section, "metric": metric, "unit": unit, "hcq": hcq, "pocl": pocl, "tinygrad": tinygrad, "memcpy": memcpy,
            "vk_raw": vk_raw, "wgpu": wgpu, "ratio": ratio, "ratio_vs": ratio_vs,
            "also_ratios": [{"ratio": r, "vs": vs} for r, vs in also or []], "target": target, "met": met}


def _better(hcq: float | None, peer: float | None, rate: bool) -> float | None:
    """How many times better hcq is than the peer: peer time / hcq time, or hcq rate / peer rate."""
    return _div(hcq, peer) if rate else _div(peer, hcq)


def _met_vs(hcq: float | None, checks: list[tuple[str, bool | None]]) -> str:
    """'met' of a row whose target holds against several peers: (peer, whether it holds) each; a missing peer (None)
    is named and left out of the verdict."""
    if hcq is None: return _met(None)
    have = [(name, ok) for name, ok in checks if ok is not None]
    gone = ", ".join(name for name, ok in checks if ok is None)
    if not have: return _met(None, f"{gone} missing")
    missed = [name for name, ok in have if not ok]
    notes = ([f"missed vs {', '.join(missed)}"] if missed and len(have) > 1 else []) + ([f"{gone} missing"] if gone else [])
    return _met(not missed, "; ".join(notes))


def _vk_rows(vk: dict[str, Any]) -> list[dict[str, Any]]:
    """The Vulkan section's rows (hcq.bench.vulkan): hcq's VK device, the raw Vulkan loop in C and wgpu. The ratio vs
    raw Vulkan comes first (with its target where the row has one), then vs wgpu (target: ahead of it, ratio > 1)."""
    ours, peers = vk.get("hcq") or {}, vk.get("peers") or {}
    raw, wg = peers.get("raw") or {}, peers.get("wgpu") or {}
    # (row, metric, unit, a rate (higher is better), the least ratio vs raw allowed, that target)
    spec: list[tuple[str, str, str, bool, float | None, str]] = [
        ("rt", "round trip: 1 empty dispatch, submit + wait", "us", False, 1 / 1.5, "within 1.5x of raw"),
        ("pipe", "pipelined: empty dispatches back to back, per dispatch", "us", False, None, ""),
        ("graph", "graph replay: per extra kernel (slope over K of replay + wait)", "us", False, 1 / 1.5, "within 1.5x of raw"),
        ("copy", "copy 64 MB device to device, submit + wait", "GB/s", True, 0.8, ">= 0.8x raw"),
    ]
    rows: list[dict[str, Any]] = []
    for name, metric, unit, rate, least, target in spec:
        if name == "graph":  # the replays behind the slope (hcq only)
            rows += [row(VK_SECTION, f"VK graph replay K={k}: replay + wait", "us", get_in(ours, "graph", "K", str(k), "wall_us"))
                     for k in GRAPH_KS]
        path, key = VK_HEADLINES[name]
        h, r, w = get_in(ours, *path), raw.get(key), wg.get(key)
        rr, rw = _better(h, r, rate), _better(h, w, rate)
        checks = ([("raw", None if rr is None else rr >= least)] if least is not None else []) + [("wgpu", None if rw is None else rw > 1)]
        rows.append(row(VK_SECTION, f"VK {metric}", unit, h, vk_raw=r, wgpu=w, ratio=rr, ratio_vs="raw", also=[(rw, "wgpu")],
                        target="; ".join(filter(None, [target, "ahead of wgpu"])), met=_met_vs(h, checks)))
    return rows


def build_rows(res: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per metric, from results as JSON has them (string keys). `ratio` is how many times better hcq is than the peer named in `ratio_vs`
    (peer time / hcq time, or hcq rate / peer rate); for copies it is hcq / memcpy."""
    ours, peers = res.get("hcq", {}), res.get("peers", {})
    pocl, tg = peers.get("pocl", {}), peers.get("tinygrad", {})
    rows: list[dict[str, Any]] = []

    # 1. round trip
    if "rt" in ours or "rt" in pocl:
        h, p = get_in(ours, "rt", "us"), get_in(pocl, "rt", "us")
        r = _div(p, h)
        ok = None if h is None else (h <= 3 and (r is None or r >= 6))
        rows.append(row("rt", "round trip: 1 empty kernel, submit + wait", "us", h, p, ratio=r, ratio_vs="PoCL",
                        target="<= 3 us and >= 6x PoCL", met=_met(ok, "PoCL missing: only <= 3 us checked" if ok is not None and r is None else "")))
    # 2. pipelined
    if "pipe" in ours or "pipe" in pocl:
        h, p = get_in(ours, "pipe", "us_per_kernel"), get_in(pocl, "pipe", "us_per_kernel")
        r = _div(p, h)
        ok = None if h is None else (h <= 0.8 and (r is None or r >= 2))
        rows.append(row("pipe", "pipelined: empty kernels back to back, per kernel", "us", h, p, ratio=r, ratio_vs="PoCL",
                        target="<= 0.8 us and >= 2x PoCL", met=_met(ok, "PoCL missing: only <= 0.8 us checked" if ok is not None and r is None else "")))
        h4 = get_in(ours, "pipe", "us_per_kernel_4x4")
        if h4 is not None:
            rows.append(row("pipe", "pipelined: 4 buffers + 4 values per launch, per kernel", "us", h4, target="<= 1.2 us", met=_met(h4 <= 1.2)))
        rs = get_in(ours, "pipe", "resubmit_us")
        if rs is not None:
            rows.append(row("pipe", "re-submit of a built 10-command queue, 1 variable changed (host)", "us", rs, target="<= 1 us", met=_met(rs <= 1)))
    # 3. graph replay
    if "graph" in ours or "graph" in tg:
        for K in GRAPH_KS:
            h, t = get_in(ours, "graph", "K", str(K)), get_in(tg, "graph", "K", str(K))
            hh, th = get_in(h, "host_us"), get_in(t, "host_us")
            rows.append(row("graph", f"graph replay K={K}: host time per replay", "us", hh, tinygrad=th, ratio=_div(th, hh), ratio_vs="tinygrad",
                            target="<= 15 us", met=_met(None if hh is None else hh <= 15)))
        for K in GRAPH_KS:
            h, t = get_in(ours, "graph", "K", str(K)), get_in(tg, "graph", "K", str(K))
            hw, tw = get_in(h, "wall_us"), get_in(t, "wall_us")
            rows.append(row("graph", f"graph replay K={K}: replay + wait", "us", hw, tinygrad=tw, ratio=_div(tw, hw), ratio_vs="tinygrad"))
        for K in GRAPH_KS:
            d = get_in(ours, "graph", "K", str(K), "device_us_per_kernel")
            rows.append(row("graph", f"graph replay K={K}: device time per kernel", "us", d,
                            target="<= 0.1 us" if K == GRAPH_KS[-1] else "", met=_met(None if d is None else d <= 0.1) if K == GRAPH_KS[-1] else ""))
        wf = get_in(ours, "graph", "wall_fixed_us")
        if wf is not None:
            rows.append(row("graph", "graph replay: fixed cost (replay + wait, intercept of K=1..1000)", "us", wf, target="<= 10 us", met=_met(wf <= 10)))
        pw = get_in(ours, "graph", "paused", "wall_us")
        if pw is not None:
            rows.append(row("graph", "graph replay K=1 right after the host paused 200 us: replay + wait", "us", pw, target="<= 10 us",
                            met=_met(pw <= 10)))
        hs, ts = get_in(ours, "graph", "device_us_per_kernel_slope"), get_in(tg, "graph", "wall_us_per_kernel")
        r = _div(ts, hs)
        why = "tinygrad missing" if not tg.get("graph") else "noise made a slope negative"
        rows.append(row("graph", "graph replay: per-kernel cost, slope K=100 -> 1000 (hcq: device time; tinygrad: replay + wait)",
                        "us", hs, tinygrad=ts, ratio=r, ratio_vs="tinygrad", target=">= 100x tinygrad",
                        met=_met(None if r is None else r >= 100, "" if r is not None else why)))
    # 4. copies
    if "copy" in ours or "copy" in pocl:
        sizes = sorted({int(s) for s in list((ours.get("copy") or {}).keys()) + list((pocl.get("copy") or {}).keys())})
        for what, label in (("copyin", "copyin host -> CPU:0"), ("copyout", "copyout CPU:0 -> host"), ("d2d", "device to device CPU:0 -> CPU:1")):
            for size in sizes:
                h, p, m = get_in(ours, "copy", str(size), what), get_in(pocl, "copy", str(size), what), get_in(ours, "copy", str(size), "memcpy")
                r = _div(h, m)
                want = 1.0 if size >= 16 * MB else 0.5 if size == 256 * KB and what != "d2d" else None
                rows.append(row("copy", f"{label}, {size_name(size)}", "GB/s", h, p, memcpy=m, ratio=r, ratio_vs="memcpy",
                                target="" if want is None else f">= {want}x memcpy", met="" if want is None else _met(None if r is None else r >= want)))
            for size in (s for s in sizes if s <= 256 * KB):  # small copies: the time of one, next to the GB/s above
                us, m_us = get_in(ours, "copy", str(size), f"{what}_us"), get_in(ours, "copy", str(size), "memcpy_us")
                capped = size == KB and what != "d2d"
                rows.append(row("copy", f"{label}, {size_name(size)}: per copy", "us", us, memcpy=m_us,
                                target="<= 3 us" if capped else "", met=_met(None if us is None else us <= 3) if capped else ""))
    # 5. compute
    if "compute" in ours or "compute" in pocl:
        c, p = ours.get("compute") or {}, pocl.get("compute") or {}
        n = c.get("workers", "all")
        rows.append(row("compute", "compute-bound kernel, 1 worker", "ms", c.get("ms_1")))
        rows.append(row("compute", f"compute-bound kernel, {n} workers (PoCL: all cores)", "ms", c.get("ms_all"), p.get("ms_all"),
                        ratio=_div(p.get("ms_all"), c.get("ms_all")), ratio_vs="PoCL"))
        s = c.get("speedup")
        rows.append(row("compute", f"compute speed-up, {n} workers vs 1", "x", s, ratio=s, ratio_vs="1 worker",
                        target=">= 1.8x on 2 workers", met=_met(None if s is None or n == 1 else s >= 1.8, "1 core" if n == 1 else "")))
    # 6. signal latency
    if "signal" in ours or "signal" in pocl:
        for kind, label in (("cross_queue", "signal round trips, queue <-> queue of one device"),
                            ("cross_device", "signal round trips, CPU:0 <-> CPU:1")):
            h, p = get_in(ours, "signal", kind, "per_s"), get_in(pocl, "signal", kind, "per_s")
            rows.append(row("signal", label, "1/s", h, p, ratio=_div(h, p), ratio_vs="PoCL"))
    # 7. Vulkan
    if res.get(VK_SECTION) and not res[VK_SECTION].get("skipped"): rows += _vk_rows(res[VK_SECTION])
    return rows


def fmt(v: float | None, unit: str = "") -> str:
    if v is None: return "—"
    if unit == "1/s":
        return f"{v / 1e6:.2f}M" if v >= 1e6 else f"{v / 1e3:.1f}k" if v >= 1e3 else f"{v:.0f}"
    a = abs(v)
    if a >= 1000: return f"{v:,.0f}"
    if a >= 100: return f"{v:.0f}"
    if a >= 10: return f"{v:.1f}"
    if a >= 1: return f"{v:.2f}"
    if a >= 0.01: return f"{v:.3f}"
    return f"{v:.2g}"


def _ratio_text(ratio: float, vs: str) -> str:
    return (f"{ratio:.2f}x" if ratio < 10 else f"{ratio:.0f}x") + (f" vs {vs}" if vs else "")


def _cells(r: dict[str, Any], cols: tuple[str, ...]) -> list[str]:
    pairs = [(r["ratio"], r["ratio_vs"])] + [(a["ratio"], a["vs"]) for a in r.get("also_ratios", [])]
    ratio = "; ".join(_ratio_text(x, vs) for x, vs in pairs if x is not None) or "—"
    return [f"{r['metric']} ({r['unit']})"] + [fmt(r.get(c), r["unit"]) for c in cols] + [ratio, r["target"] or "", r["met"] or ""]


def present_columns(rows: list[dict[str, Any]]) -> tuple[str, ...]:
    return tuple(c for c in COLUMNS if c == "hcq" or any(r.get(c) is not None for r in rows))


def row_groups(rows: list[dict[str, Any]]) -> list[tuple[str, list[dict[str, Any]]]]:
    """The rows as separately printed tables, each with its own columns: hcq's CPU device vs its peers, and the
    Vulkan section (empty groups left out)."""
    groups = [("CPU device", [r for r in rows if r["section"] != VK_SECTION]),
              ("Vulkan (hcq's VK device vs raw Vulkan in C and wgpu)", [r for r in rows if r["section"] == VK_SECTION])]
    return [(title, rs) for title, rs in groups if rs]


def text_table(rows: list[dict[str, Any]], cols: tuple[str, ...] | None = None) -> str:
    cols = cols or present_columns(rows)
    head = ["metric"] + [HEADERS[c] for c in cols] + ["ratio", "target", "met"]
    body = [_cells(r, cols) for r in rows]
    widths = [max(len(x[i]) for x in [head] + body) for i in range(len(head))]
    def line(cells: list[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 or i >= len(cols) + 2 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))).rstrip()
    out, prev = [line(head), line(["-" * w for w in widths])], None
    for r, cells in zip(rows, body):
        if prev is not None and r["section"] != prev: out.append("")
        out.append(line(cells))
        prev = r["section"]
    return "\n".join(out)


def markdown_table(rows: list[dict[str, Any]], cols: tuple[str, ...] | None = None) -> str:
    cols = cols or present_columns(rows)
    head = ["metric"] + [HEADERS[c] for c in cols] + ["ratio", "target", "met"]
    out = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] + ["---:"] * len(cols) + ["---:", "---", "---"]) + "|"]
    for r in rows:
        cells = _cells(r, cols)
        if r["met"].startswith("NO"): cells[-1] = f"**{cells[-1]}**"
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


# ---------------------------------------------------------------- tails (issue 46)
TAIL_HEAD = ["metric", "who", "p50", "p90", "p99", "worst p90/p50", "runs collapsed", "target", "met"]
TAIL_TARGET = f"no run's p90 > {COLLAPSE_RATIO:g}x its median"


def _tail_row(metric: str, unit: str, who: str, t: dict[str, Any], target: str = "", met: str = "") -> dict[str, Any]:
    return {"metric": metric, "unit": unit, "who": who, "p50": t.get("p50"), "p90": t.get("p90"), "p99": t.get("p99"),
            "worst_p90_over_p50": t.get("worst_p90_over_p50"), "runs": t.get("runs"), "collapsed": t.get("collapsed"),
            "collapsed_share": t.get("collapsed_share"), "target": target, "met": met}


def tail_rows(res: dict[str, Any]) -> list[dict[str, Any]]:
    """The tails of the round-trip, pipelined and signal rows, for hcq and each peer measured in the run: p50 / p90 / p99
    (medians over the runs), the worst run's p90 / p50, and how many runs collapsed (common.is_collapsed). A run is a
    round (rt, pipe), a repeat (signal) or a fresh process (`--processes`, row 'rt_processes'). hcq's round-trip rows carry
    the issue 46 target: no run collapsed (and, over fresh processes, the median >= 6x PoCL's)."""
    who = {"hcq": res.get("hcq", {}), **{k: v for k, v in res.get("peers", {}).items() if isinstance(v, dict)}}
    spec = [(("rt", "tail"), "round trip: 1 empty kernel, submit + wait", "us"),
            (("rt_processes", "tail"), "round trip, one run per fresh process", "us"),
            (("pipe", "tail"), "pipelined: per kernel in chunks of launches (host)", "us"),
            (("signal", "cross_queue", "tail"), "signal round trip, queue <-> queue (chunks, device time)", "ns"),
            (("signal", "cross_device", "tail"), "signal round trip, CPU:0 <-> CPU:1 (chunks, device time)", "ns")]
    out = []
    for path, metric, unit in spec:
        for name, r in who.items():
            t = get_in(r, *path)
            if not t: continue
            target, met = "", ""
            if name == "hcq" and path[0] in ("rt", "rt_processes"):
                target, ok, note = TAIL_TARGET, t["collapsed"] == 0, ""
                if path[0] == "rt_processes":
                    ratio = _div(get_in(who, "pocl", "rt_processes", "us") or get_in(who, "pocl", "rt", "us"), get_in(r, "rt_processes", "us"))
                    target += "; median >= 6x PoCL"
                    ok, note = (ok, "PoCL missing") if ratio is None else (ok and ratio >= 6, f"{ratio:.2f}x PoCL")
                met = _met(ok, note)
            out.append(_tail_row(metric, unit, HEADERS.get(name, name), t, target, met))
    return out


def _tail_cells(r: dict[str, Any]) -> list[str]:
    w = r["worst_p90_over_p50"]
    return [f"{r['metric']} ({r['unit']})", r["who"], fmt(r["p50"]), fmt(r["p90"]), fmt(r["p99"]), "—" if w is None else f"{w:.2f}x",
            f"{r['collapsed']}/{r['runs']}", r["target"], r["met"]]


def tail_table(trows: list[dict[str, Any]], markdown: bool = False) -> str:
    """The tail rows as a text table (or Markdown)."""
    body = [_tail_cells(r) for r in trows]
    if markdown:
        return "\n".join(["| " + " | ".join(TAIL_HEAD) + " |", "|---|---|---:|---:|---:|---:|---:|---|---|"] +
                         ["| " + " | ".join(c) + " |" for c in body])
    widths = [max(len(x[i]) for x in [TAIL_HEAD] + body) for i in range(len(TAIL_HEAD))]
    return "\n".join("  ".join(c.ljust(w) if i < 2 or i > 6 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))).rstrip()
                     for cells in [TAIL_HEAD, ["-" * w for w in widths]] + body)


def missed(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in rows if r["met"].startswith("NO")]
