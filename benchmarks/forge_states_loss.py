"""FORGE's optimizer-state formats against torch.optim.AdamW: 200-step loss curves.

The run of tests/forge/test_forge_bf16_states.py (which asserts every 20-step window's mean loss
within 1% of torch AdamW in fp32), with the figures printed and more arms: a 2-layer GPT (width
32, vocabulary 64, 2 x 16 tokens per step) on a noisy learnable stream (next token = 3x + 1 mod
64 with probability 0.7, uniform otherwise, so the loss stays well above zero), AdamW lr 3e-3,
betas (0.9, 0.95), weight decay 0.1 on matrices. Arms, all from the same initial weights and
batches:
    torch-fp32         torch.optim.AdamW(foreach=False), fp32 parameters: the reference
    torch-bf16         torch.optim.AdamW on bf16 parameters (bf16 states, round to nearest)
    forge-fp32         FORGE, fp32 parameters and states
    forge-int8         FORGE, fp32 parameters, 8-bit states
    forge-bf16w        FORGE, bf16 parameters (stochastic rounding), fp32 states
    forge-bf16w-bf16s  FORGE, bf16 parameters and bf16 states (stochastic rounding on every store)
Reported per arm, measured: first and last window means, the final step's loss, and the largest
relative difference of a window mean from the reference's.

    python benchmarks/forge_states_loss.py [--steps 200] [--threads 1] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import provenance
import torch

from frugaltrain.forge import ForgeOptimizer
from frugaltrain.models.gpt import GPT, GPTConfig

VOCAB, T, B, WINDOW = 64, 16, 2, 20
HYPER = {"lr": 3e-3, "betas": (0.9, 0.95)}
ARMS = {  # name -> (parameter dtype, FORGE states or None for torch.optim.AdamW)
    "torch-fp32": (torch.float32, None),
    "torch-bf16": (torch.bfloat16, None),
    "forge-fp32": (torch.float32, "fp32"),
    "forge-int8": (torch.float32, "int8"),
    "forge-bf16w": (torch.bfloat16, "fp32"),
    "forge-bf16w-bf16s": (torch.bfloat16, "bf16"),
}


def settings(arm: str) -> list[str]:
    """What curve() trains `arm` with, as `key=value` strings (the arm's overrides)."""
    dtype, states = ARMS[arm]
    kw = [f"{k}={v}" for k, v in HYPER.items()] + ["weight_decay=0.1 (2-D), 0.0 (the rest)"]
    if states is None:
        opt = ["optimizer=torch.optim.AdamW", "foreach=False"]
    else:
        opt = ["optimizer=ForgeOptimizer", f"states={states}"]
    return [*opt, f"param_dtype={str(dtype).removeprefix('torch.')}", *kw]


def make_gpt(dtype: torch.dtype) -> GPT:
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=VOCAB, block_size=T)
    return GPT(cfg).to(dtype)


def groups(model: torch.nn.Module) -> list[dict]:
    ps = list(model.parameters())
    return [
        {"params": [p for p in ps if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in ps if p.dim() < 2], "weight_decay": 0.0},
    ]


def noisy_batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    xs = [torch.randint(0, VOCAB, (B, T), generator=g) for _ in range(n)]
    g = torch.Generator().manual_seed(1)
    out = []
    for x in xs:
        y = (3 * x + 1) % VOCAB
        noise = torch.rand(x.shape, generator=g) < 0.3
        out.append((x, torch.where(noise, torch.randint(0, VOCAB, x.shape, generator=g), y)))
    return out


def curve(dtype: torch.dtype, states: str | None, data) -> torch.Tensor:
    model = make_gpt(dtype)
    if states is None:
        opt = torch.optim.AdamW(groups(model), foreach=False, **HYPER)
    else:
        opt = ForgeOptimizer(model, groups(model), states=states, **HYPER)
    losses = []
    for x, y in data:
        loss = model(x, y)[1]
        losses.append(loss.item())
        if states is None:
            loss.backward()
        else:
            opt.backward(loss)  # FORGE updates only in its own backward
        opt.step()
        opt.zero_grad()
    return torch.tensor(losses, dtype=torch.float64)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="benchmarks/results/forge_states_loss.json")
    args = ap.parse_args()
    record = provenance.start("measured", variants={arm: settings(arm) for arm in ARMS})
    torch.set_num_threads(args.threads)
    data = noisy_batches(args.steps)
    curves = {name: curve(dtype, states, data) for name, (dtype, states) in ARMS.items()}
    ref = curves["torch-fp32"].unfold(0, WINDOW, WINDOW).mean(1)
    rows = []
    for name, c in curves.items():
        w = c.unfold(0, WINDOW, WINDOW).mean(1)
        row = {
            "arm": name,
            "first_window": round(w[0].item(), 4),
            "last_window": round(w[-1].item(), 4),
            "final_step": round(c[-1].item(), 4),
            "max_window_rel_diff": round(((w - ref).abs() / ref).max().item(), 5),
            "windows": [round(v, 4) for v in w.tolist()],
        }
        rows.append(row)
        print(
            f"{name:<18} first window {row['first_window']:.4f}  last window "
            f"{row['last_window']:.4f}  final step {row['final_step']:.4f}  max window diff "
            f"{100 * row['max_window_rel_diff']:.3f}%",
            flush=True,
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "device": f"cpu ({platform.processor() or platform.machine()}), {args.threads} threads",
        "torch": torch.__version__,
        "steps": args.steps,
        "method": f"mean loss per {WINDOW}-step window against torch-fp32's; measured",
    }
    provenance.finish(record)
    out.write_text(json.dumps(record | {"meta": meta, "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
