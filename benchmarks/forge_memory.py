"""FORGE memory: whole-step peak and backward+step transient, FORGE vs torch AdamW variants.

For each GPT size and token count, every variant trains one warm-up step (so optimizer states
exist) and then one measured step under `AllocationTracker`, a TorchDispatchMode that sees every
tensor storage an op creates and when it is freed (tracemalloc cannot see torch's CPU
allocations). Reported, all measured:
    resident_MiB   weights + optimizer states (+ FORGE accumulation buffers) before the step
    peak_MiB       resident + the peak of bytes allocated during forward, backward and step
    transient_MiB  peak - resident: activations, gradients and optimizer temporaries
and each variant's ratio to torch.optim.AdamW (foreach=False, the CPU default). The counts are
allocator-independent (cached-but-free memory is not counted) and deterministic, so variants run
one after another. Blind spot: scratch memory an op allocates and frees internally.

A case is size:tokens[:dtype]. Sizes are the built-in GPT's and `llama125M`, a transformers Llama
built by frugaltrain.models.build_model (12 layers, width 768, 12 heads, MLP 2048, vocabulary
32000, untied head: 134M parameters). dtype bf16 converts the model (model.to(torch.bfloat16));
the baseline is then torch.optim.AdamW on the bf16 parameters, which keeps bf16 states.

    python benchmarks/forge_memory.py [--cases 10M:512,85M:4096,llama125M:512:bf16]
        [--variants adamw,forge,forge-int8,forge-bf16] [--out FILE]
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import time
from pathlib import Path

import provenance
import torch

from frugaltrain.config import Config
from frugaltrain.config.base import build_config
from frugaltrain.forge import AllocationTracker, ForgeOptimizer
from frugaltrain.forge.memtrack import resident_bytes
from frugaltrain.models import build_model
from frugaltrain.models.gpt import GPT, GPTConfig

SIZES = {  # byte vocabulary, untied head; parameter counts from GPT.num_params()
    "10M": {"n_layer": 6, "n_embd": 384, "n_head": 6},
    "85M": {"n_layer": 12, "n_embd": 768, "n_head": 12},
    "300M": {"n_layer": 24, "n_embd": 1024, "n_head": 16},
    # a wide stack (the layer shape of a ~1B model, 4 blocks): weight gradients outweigh the
    # activations of 512 tokens here, which is FORGE's operating regime
    "wide200M": {"n_layer": 4, "n_embd": 2048, "n_head": 16},
}
LLAMAS = {  # frugaltrain config overrides (model.family = llama)
    "llama125M": {
        "n_layer": 12, "n_embd": 768, "n_head": 12, "intermediate_size": 2048, "vocab_size": 32000,
    },
}  # fmt: skip
VARIANTS = ("adamw", "adamw-foreach", "adamw-fused", "hooks", "forge", "forge-int8")
STATES = {"forge": "fp32", "forge-int8": "int8", "forge-bf16": "bf16"}  # FORGE's state formats
SEQ = 512
LR, BETAS, WD = 3e-4, (0.9, 0.95), 0.1
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def make_model(size: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    if size in LLAMAS:
        sets = [f"model.{k}={v}" for k, v in LLAMAS[size].items()]
        cfg = build_config(Config, {}, ["model.family='llama'", f"data.seq_len={SEQ}", *sets])
        return build_model(cfg).to(dtype)
    return GPT(GPTConfig(**SIZES[size], vocab_size=256, block_size=SEQ)).to(dtype)


def vocab(size: str) -> int:
    return LLAMAS[size]["vocab_size"] if size in LLAMAS else 256


class _HookAdamW:
    """Optimizer-in-backward as in the PyTorch tutorial: one AdamW per parameter, stepped from
    its post-accumulate-grad hook, gradient freed at once (one parameter gradient alive)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.opts = {}
        for p in model.parameters():
            self.opts[p] = torch.optim.AdamW(
                [p], lr=LR, betas=BETAS, weight_decay=WD, foreach=False
            )
            p.register_post_accumulate_grad_hook(self._hook)

    def _hook(self, p) -> None:
        self.opts[p].step()
        p.grad = None

    def step(self) -> None:
        pass

    def zero_grad(self) -> None:
        pass

    def state_tensors(self):
        return [t for o in self.opts.values() for s in o.state.values() for t in s.values()]


def build(variant: str, model: torch.nn.Module):
    """The optimizer for one variant, and a function returning its resident state tensors."""
    kw = {"lr": LR, "betas": BETAS, "weight_decay": WD}
    if variant == "hooks":
        opt = _HookAdamW(model)
        return opt, opt.state_tensors
    if variant in STATES:
        opt = ForgeOptimizer(model, states=STATES[variant], **kw)
    else:
        opt = torch.optim.AdamW(
            model.parameters(),
            foreach=variant == "adamw-foreach",
            fused=True if variant == "adamw-fused" else None,
            **kw,
        )
    return opt, lambda: [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t)]


def settings(variant: str) -> list[str]:
    """What build() makes of `variant`, as `key=value` strings (the variant's overrides)."""
    kw = [f"lr={LR}", f"betas={BETAS}", f"weight_decay={WD}"]
    if variant == "hooks":
        return ["optimizer=torch.optim.AdamW per parameter, in its grad hook", *kw, "foreach=False"]
    if variant in STATES:
        return ["optimizer=ForgeOptimizer", f"states={STATES[variant]}", *kw]
    fused = True if variant == "adamw-fused" else None
    flags = [f"foreach={variant == 'adamw-foreach'}", f"fused={fused}"]
    return ["optimizer=torch.optim.AdamW", *kw, *flags]


def batch(tokens: int, step: int, size: str = "") -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    idx = torch.randint(0, vocab(size), (tokens // SEQ, SEQ + 1), generator=g)
    return idx[:, :-1], idx[:, 1:]


def backward(opt, loss) -> None:
    if isinstance(opt, ForgeOptimizer):
        opt.backward(loss)  # FORGE updates only in its own backward
    else:
        loss.backward()


def train_step(model, opt, x, y) -> None:
    _, loss = model(x, y)
    backward(opt, loss)
    opt.step()
    opt.zero_grad()


def measure(size: str, tokens: int, variant: str, dtype: str = "fp32") -> dict:
    model = make_model(size, DTYPES[dtype])
    opt, states = build(variant, model)
    train_step(model, opt, *batch(tokens, 0, size))  # warm-up: states allocated
    gc.collect()
    resident = resident_bytes(list(model.parameters()) + states())
    x, y = batch(tokens, 1, size)
    t0 = time.perf_counter()
    with AllocationTracker() as tracker:
        tracker.mark("forward")
        _, loss = model(x, y)
        tracker.mark("backward+step")
        backward(opt, loss)
        opt.step()
        opt.zero_grad()
    seconds = time.perf_counter() - t0
    mib = 2**20
    return {
        "size": size,
        "params_M": round(sum(p.numel() for p in model.parameters()) / 1e6, 1),
        "tokens": tokens,
        "dtype": dtype,
        "variant": variant,
        "resident_MiB": round(resident / mib, 1),
        "peak_MiB": round((resident + tracker.peak_bytes) / mib, 1),
        "transient_MiB": round(tracker.peak_bytes / mib, 1),
        "backward_step_transient_MiB": round(tracker.phase_peak["backward+step"] / mib, 1),
        "largest_alloc_MiB": round(tracker.largest_bytes / mib, 2),
        "tracked_step_s": round(seconds, 2),  # under the tracker: not a speed figure
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--cases",
        default="10M:512,10M:4096,85M:512,85M:4096,wide200M:512,300M:512",
        help="size:tokens,...",
    )
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results/forge_memory.json")
    args = ap.parse_args()
    variants = {v: settings(v) for v in args.variants.split(",")}
    record = provenance.start("measured", variants=variants)
    torch.set_num_threads(args.threads)
    rows = []
    for case in args.cases.split(","):
        size, tokens, *dtype = case.split(":")
        base = None
        for variant in args.variants.split(","):
            r = measure(size, int(tokens), variant, *dtype)
            base = base or r
            r["peak_ratio"] = round(r["peak_MiB"] / base["peak_MiB"], 3)
            r["transient_ratio"] = round(r["transient_MiB"] / base["transient_MiB"], 3)
            rows.append(r)
            print(
                f"{size:>9} {r['params_M']:>6}M {tokens:>5} tok {r['dtype']} {variant:<13}"
                f" resident {r['resident_MiB']:>7.1f}  peak {r['peak_MiB']:>7.1f}"
                f" ({r['peak_ratio']:.3f}x)  transient {r['transient_MiB']:>7.1f}"
                f" ({r['transient_ratio']:.3f}x)  largest {r['largest_alloc_MiB']:>6.2f} MiB",
                flush=True,
            )
            gc.collect()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "device": f"cpu ({platform.processor() or platform.machine()}), {args.threads} threads",
        "torch": torch.__version__,
        "method": "AllocationTracker (TorchDispatchMode storage tracker); all figures measured",
        "baseline": "torch.optim.AdamW(foreach=False), the CPU default, on the case's dtype",
    }
    provenance.finish(record)
    out.write_text(json.dumps(record | {"meta": meta, "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
