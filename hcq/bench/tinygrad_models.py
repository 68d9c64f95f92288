"""Two small models under tinygrad, DEV=HCQ against DEV=CPU (tinygrad's own CPU device), in one run.

    python -m hcq.bench.tinygrad_models [--rounds 3] [--calls 20] [--models gpt,cnn] [--json FILE]

- `gpt`: the forward pass of a GPT-style decoder (2 blocks, width 128, 4 heads, 64 tokens, batch 8, vocabulary 512:
  token and position embeddings, causal attention, a 4x MLP, layer norms), logits out, under TinyJit.
- `cnn`: a training step of a small CNN on 28x28 images (two 3x3 convolutions with ReLU and 2x2 max pooling, a linear
  layer, cross-entropy, Adam; batch 32) under TinyJit.

Each measurement is a fresh process per device, the devices alternating which goes first round after round; a process
builds the model from a fixed seed, warms the JIT up (capture and three replays), then times `calls` calls ending with a
synchronize, best of five. Throughput is calls per second; the ratio is HCQ over CPU (above 1: hcq faster). The
processes also return the model's output after the warm-up, so the run says whether both devices computed the same
numbers (the largest difference, and whether they are bit for bit equal)."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any, Callable

DEVICES = ("HCQ", "CPU")
MODELS = ("gpt", "cnn")


def gpt_forward(tg: Any, dev: str) -> tuple[Callable[[], Any], Callable[[], list[float]]]:
    """(a JIT'd forward call, what its logits are) of a small GPT-style decoder on `dev`."""
    Tensor, nn = tg.Tensor, tg.nn
    vocab, width, heads, ctx, batch, blocks = 512, 128, 4, 64, 8, 2
    with tg.Context(DEV=dev):
        Tensor.manual_seed(0)
        tok, pos = nn.Embedding(vocab, width), nn.Embedding(ctx, width)
        layers = [(nn.LayerNorm(width), nn.Linear(width, 3 * width), nn.Linear(width, width), nn.LayerNorm(width),
                   nn.Linear(width, 4 * width), nn.Linear(4 * width, width)) for _ in range(blocks)]
        head_norm, head = nn.LayerNorm(width), nn.Linear(width, vocab, bias=False)
        idx = Tensor.randint(batch, ctx, high=vocab).realize()
        positions = Tensor.arange(ctx).reshape(1, ctx).realize()

    def forward(idx: Any) -> Any:
        x = tok(idx) + pos(positions)
        for ln1, qkv, proj, ln2, up, down in layers:
            q, k, v = qkv(ln1(x)).reshape(batch, ctx, 3, heads, width // heads).permute(2, 0, 3, 1, 4)
            attn = q.scaled_dot_product_attention(k, v, is_causal=True).transpose(1, 2).reshape(batch, ctx, width)
            x = x + proj(attn)
            x = x + down(up(ln2(x)).gelu())
        return head(head_norm(x)).realize()
    step = tg.TinyJit(forward)
    for _ in range(4): out = step(idx)
    return (lambda: step(idx)), (lambda: out.flatten()[:4096].tolist())


def cnn_train_step(tg: Any, dev: str) -> tuple[Callable[[], Any], Callable[[], list[float]]]:
    """(a JIT'd training step, its loss and first weights after the warm-up) of a small CNN on `dev`."""
    Tensor, nn = tg.Tensor, tg.nn
    with tg.Context(DEV=dev):
        Tensor.manual_seed(0)
        c1, c2, fc = nn.Conv2d(1, 8, 3), nn.Conv2d(8, 16, 3), nn.Linear(16 * 5 * 5, 10)
        opt = nn.optim.Adam(nn.state.get_parameters([c1, c2, fc]), lr=1e-3)
        x, y = Tensor.randn(32, 1, 28, 28).realize(), Tensor.randint(32, high=10).realize()

    @tg.TinyJit
    def step(x: Any, y: Any) -> Any:
        with tg.Context(TRAINING=1):
            opt.zero_grad()
            h = c1(x).relu().max_pool2d(2)
            h = c2(h).relu().max_pool2d(2)
            loss = fc(h.flatten(1)).sparse_categorical_crossentropy(y).backward()
            opt.step()
            return loss.realize()
    losses = [step(x, y).item() for _ in range(4)]
    return (lambda: step(x, y)), (lambda: losses + c1.weight.flatten().tolist() + fc.weight.flatten()[:256].tolist())


BUILDERS = {"gpt": gpt_forward, "cnn": cnn_train_step}


def child(model: str, dev: str, calls: int) -> dict[str, Any]:
    """One device's measurement of one model (what a fresh process prints)."""
    import hcq.tinygrad  # noqa: F401  (registers HCQ)
    import tinygrad as tg
    call, result = BUILDERS[model](tg, dev)
    values = result()
    sync = tg.Device[dev].synchronize
    best = float("inf")
    for _ in range(5):
        sync()
        t0 = time.perf_counter()
        for _ in range(calls): call()
        sync()
        best = min(best, (time.perf_counter() - t0) / calls)
    return {"model": model, "dev": dev, "s_per_call": best, "values": values}


def measure(model: str, dev: str, calls: int) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, "-m", "hcq.bench.tinygrad_models", "--child", model, dev, "--calls", str(calls)],
                          capture_output=True, text=True, timeout=900, env={**os.environ, "DEV": dev})
    if proc.returncode != 0: raise RuntimeError(f"{model} on DEV={dev} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run(models: list[str], rounds: int, calls: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for model in models:
        times: dict[str, list[float]] = {d: [] for d in DEVICES}
        values: dict[str, list[float]] = {}
        for r in range(rounds):
            for dev in (DEVICES if r % 2 == 0 else DEVICES[::-1]):
                res = measure(model, dev, calls)
                times[dev].append(res["s_per_call"])
                values[dev] = res["values"]
        a, b = values["HCQ"], values["CPU"]
        out[model] = {"s_per_call": times, "ratios": [c / h for h, c in zip(times["HCQ"], times["CPU"])],
                      "identical": a == b, "max_abs_diff": max((abs(x - y) for x, y in zip(a, b)), default=0.0) if len(a) == len(b) else None}
    return out


def report(res: dict[str, Any]) -> str:
    lines = ["| model | DEV=HCQ calls/s (median) | DEV=CPU calls/s (median) | HCQ/CPU per round | same numbers |", "|---|---|---|---|---|"]
    for model, r in res.items():
        hcq_s, cpu_s = statistics.median(r["s_per_call"]["HCQ"]), statistics.median(r["s_per_call"]["CPU"])
        same = "bit for bit" if r["identical"] else f"no: max diff {r['max_abs_diff']:.3g}"
        lines.append(f"| {model} | {1 / hcq_s:.1f} | {1 / cpu_s:.1f} | {', '.join(f'{x:.2f}x' for x in r['ratios'])} | {same} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hcq.bench.tinygrad_models", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3, help="fresh processes per device and model (alternating which device goes first)")
    ap.add_argument("--calls", type=int, default=20, help="calls per timed batch (best of five batches)")
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--child", nargs=2, metavar=("MODEL", "DEV"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child[0], args.child[1], args.calls)))
        return 0
    models = [m for m in args.models.split(",") if m]
    if bad := [m for m in models if m not in BUILDERS]: ap.error(f"unknown model(s) {bad}; choose from {', '.join(MODELS)}")
    if args.rounds < 1 or args.calls < 1: ap.error("--rounds and --calls must be at least 1")
    res = run(models, args.rounds, args.calls)
    print(report(res))
    if args.json:
        with open(args.json, "w") as f: json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
