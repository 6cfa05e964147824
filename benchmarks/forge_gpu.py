"""FORGE on a CUDA GPU: peak memory and step time of a whole GPT training step, and the Triton
kernel alone, against torch.optim.AdamW (single-tensor, foreach, fused). All figures measured.

Variants (one param group, lr 3e-4, betas (0.9, 0.95), weight decay 0.1):
    adamw            torch.optim.AdamW(foreach=False)     ("vanilla")
    adamw-foreach    torch.optim.AdamW(foreach=True)      (torch's CUDA default)
    adamw-fused      torch.optim.AdamW(fused=True)        (the GPU target's baseline)
    forge            ForgeOptimizer, torch path (default tiles: 64Ki elements, CPU-sized)
    forge-r512       the torch path with 512-row tiles (1-4 Mi elements: fewer kernel launches)
    forge-triton     ForgeOptimizer, Triton kernel
    forge-triton-int8  the Triton kernel with 8-bit states
Parameters are fp32 or bf16 ("pure" bf16: torch's AdamW keeps bf16 states, FORGE keeps fp32
states, or 8-bit ones). fp32 matmuls run without TF32 (torch's default), like the kernel.

Memory, one variant at a time: a fresh model, one warm-up step (states exist), empty_cache,
reset_peak_memory_stats, one measured step. resident = memory_allocated() before the step
(weights, states, the batch, cuBLAS workspace); peak = max_memory_allocated() through forward,
backward and step; transient = peak - resident. Never nvidia-smi (it shows the cache).

Speed: every variant resident at once (those that fit; see `_speed_arms`), each warmed up, then
`--reps` rounds of one step per variant in turn (A B C ..., A B C ...). Each step runs between
two synchronizations and is timed with CUDA events (so it includes launch overhead); median.

Kernel: per layer shape of the 1B stack, the Triton kernel (dW tile + AdamW, in place) against
cuBLAS dW (torch.mm) + torch._fused_adamw_ on that one tensor, CUDA events over `--kernel-reps`
calls; with a few tile shapes (BV, BH, BK, warps, stages) for the kernel.

    python benchmarks/forge_gpu.py [--cases 1B:512:bf16,...] [--reps 10] [--out FILE]
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import subprocess
import time
from pathlib import Path

import provenance
import torch

from frugaltrain.forge import ForgeOptimizer
from frugaltrain.models.gpt import GPT, GPTConfig

SIZES = {  # byte vocabulary, untied head (forge_memory.py's sizes, plus a 1B-class stack)
    "tiny": {"n_layer": 2, "n_embd": 64, "n_head": 4},
    "10M": {"n_layer": 6, "n_embd": 384, "n_head": 6},
    "85M": {"n_layer": 12, "n_embd": 768, "n_head": 12},
    "300M": {"n_layer": 24, "n_embd": 1024, "n_head": 16},
    "wide200M": {"n_layer": 4, "n_embd": 2048, "n_head": 16},
    "1B": {"n_layer": 20, "n_embd": 2048, "n_head": 16},  # 1.01B; the layer shape of wide200M
}
VARIANTS = (
    "adamw",
    "adamw-foreach",
    "adamw-fused",
    "forge",
    "forge-r512",
    "forge-triton",
    "forge-triton-int8",
)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
CASES = (  # the target's cases first
    "1B:512:bf16,1B:512:fp32,wide200M:512:fp32,wide200M:512:bf16,1B:4096:bf16,300M:512:fp32,"
    "300M:512:bf16,85M:512:fp32,85M:512:bf16,10M:512:fp32,10M:512:bf16,85M:4096:fp32"
)
SEQ = 512
LR, BETAS, WD, EPS = 3e-4, (0.9, 0.95), 0.1, 1e-8
BASE = "adamw-fused"
# The torch path is launch-bound on a GPU (one small GEMM and ~10 element-wise kernels per
# 64Ki-element tile; about 4 s per step at 1B in bf16): it gets one warm-up step and 3 timed ones.
SLOW, SLOW_REPS = {"forge"}, 3
# Bytes per parameter a variant keeps resident (weights + states), for choosing the speed arms.
RESIDENT_B = {
    torch.float32: {"forge-triton-int8": 6.2, "other": 12.0},
    torch.bfloat16: {
        "forge-triton-int8": 4.2,
        "adamw": 6,
        "adamw-foreach": 6,
        "adamw-fused": 6,
        "other": 10,
    },
}
KERNEL_BLOCKS = {  # (BV, BH, BK, num_warps, num_stages); triton_kernel.default_block picks
    "fp32": [(64, 64, 32, 4, 3), (128, 64, 32, 8, 3), (64, 64, 16, 4, 4), (32, 64, 32, 4, 3)],
    "bf16": [(64, 64, 32, 4, 3), (128, 64, 64, 8, 3), (128, 128, 64, 8, 3), (64, 128, 64, 4, 3)],
}


def make_model(size: str, dtype: torch.dtype, device: str) -> GPT:
    torch.manual_seed(0)
    with torch.device(device):
        model = GPT(GPTConfig(**SIZES[size], vocab_size=256, block_size=SEQ))
    return model.to(dtype)


def _options(variant: str) -> dict:
    """The keyword arguments `variant`'s optimizer is built with."""
    kw = {"lr": LR, "betas": BETAS, "weight_decay": WD, "eps": EPS}
    if variant.startswith("forge"):
        backend = "triton" if "triton" in variant else "torch"
        states = "int8" if variant.endswith("int8") else "fp32"
        tile_rows = 512 if variant == "forge-r512" else None
        return {"backend": backend, "states": states, "tile_rows": tile_rows, **kw}
    return {
        "foreach": variant == "adamw-foreach",
        "fused": True if variant == "adamw-fused" else None,
        **kw,
    }


def build(variant: str, model: torch.nn.Module):
    if variant.startswith("forge"):
        return ForgeOptimizer(model, **_options(variant))
    return torch.optim.AdamW(model.parameters(), **_options(variant))


def settings(variant: str) -> list[str]:
    """What build() makes of `variant`, as `key=value` strings (the variant's overrides)."""
    name = "ForgeOptimizer" if variant.startswith("forge") else "torch.optim.AdamW"
    return [f"optimizer={name}", *(f"{k}={v}" for k, v in _options(variant).items())]


def batch(tokens: int, step: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    idx = torch.randint(0, 256, (tokens // SEQ, SEQ + 1), generator=g).to(device)
    return idx[:, :-1], idx[:, 1:]


def train_step(model, opt, x, y) -> None:
    _, loss = model(x, y)
    if isinstance(opt, ForgeOptimizer):
        opt.backward(loss)  # FORGE updates only in its own backward
    else:
        loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _free(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def measure_memory(size, tokens, dtype, variant, device) -> dict:
    model = make_model(size, dtype, device)
    opt = build(variant, model)
    train_step(model, opt, *batch(tokens, 0, device))  # warm-up: states exist
    x, y = batch(tokens, 2, device)
    _sync(device)
    _free(device)
    row = {"params_M": round(sum(p.numel() for p in model.parameters()) / 1e6, 1)}
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        resident = torch.cuda.memory_allocated()
        train_step(model, opt, x, y)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        mib = 2**20
        row.update(
            resident_MiB=round(resident / mib, 1),
            peak_MiB=round(peak / mib, 1),
            transient_MiB=round((peak - resident) / mib, 1),
        )
    del model, opt
    _free(device)
    return row


def _speed_arms(size: str, dtype, variants: list[str], device: str) -> tuple[list, list]:
    """The variants that fit resident together (75% of the device), and those dropped."""
    if device != "cuda":
        return variants, []
    cfg = SIZES[size]
    params = 12 * cfg["n_layer"] * cfg["n_embd"] ** 2
    budget = 0.75 * torch.cuda.get_device_properties(0).total_memory
    table = RESIDENT_B[dtype]
    arms = list(variants)
    dropped = []
    for v in ("forge-triton-int8", "adamw", "forge"):
        if sum(table.get(a, table["other"]) * params for a in arms) <= budget:
            break
        if v in arms:
            arms.remove(v)
            dropped.append(v)
    return arms, dropped


def measure_speed(size, tokens, dtype, variants, reps, device) -> tuple[dict, list]:
    arms, dropped = _speed_arms(size, dtype, variants, device)
    built = {}
    for v in arms:
        model = make_model(size, dtype, device)
        built[v] = (model, build(v, model))
    for s in range(2):  # warm-up: states, allocator, kernels compiled
        x, y = batch(tokens, s, device)
        for v in arms:
            if not (v in SLOW and s):
                train_step(*built[v], x, y)
    times = {v: [] for v in arms}
    for rep in range(reps):
        x, y = batch(tokens, 10 + rep, device)
        for v in arms:
            if v in SLOW and rep >= SLOW_REPS:
                continue
            _sync(device)
            if device == "cuda":
                t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                t0.record()
                train_step(*built[v], x, y)
                t1.record()
                torch.cuda.synchronize()
                times[v].append(t0.elapsed_time(t1) / 1e3)
            else:
                c0 = time.perf_counter()
                train_step(*built[v], x, y)
                times[v].append(time.perf_counter() - c0)
    del built
    _free(device)
    out = {
        v: {"median_ms": statistics.median(t) * 1e3, "min_ms": min(t) * 1e3, "reps": len(t)}
        for v, t in times.items()
    }
    return out, dropped


def run_case(size, tokens, dtype_name, variants, reps, device) -> list[dict]:
    dtype = DTYPES[dtype_name]
    rows = {}
    for v in variants:
        try:
            rows[v] = measure_memory(size, tokens, dtype, v, device)
        except Exception as e:  # noqa: BLE001 - an OOM or a kernel failure is a result too
            rows[v] = {"error": f"memory: {type(e).__name__}: {str(e)[:300]}"}
            _free(device)
    try:
        speed, dropped = measure_speed(size, tokens, dtype, variants, reps, device)
    except Exception as e:  # noqa: BLE001
        speed, dropped = {}, []
        for v in variants:
            rows[v].setdefault("error", f"speed: {type(e).__name__}: {str(e)[:300]}")
        _free(device)
    out = []
    base = rows.get(BASE, {})
    base_t = speed.get(BASE, {}).get("median_ms")
    for v in variants:
        r = {"size": size, "tokens": tokens, "dtype": dtype_name, "variant": v, **rows[v]}
        if v in speed:
            r["median_ms"] = round(speed[v]["median_ms"], 2)
            r["min_ms"] = round(speed[v]["min_ms"], 2)
            r["reps"] = speed[v]["reps"]
            if base_t:
                r["time_ratio"] = round(speed[v]["median_ms"] / base_t, 3)
        elif v in dropped:
            r["speed"] = "not timed: all arms resident together would not fit"
        if "peak_MiB" in r and "peak_MiB" in base:
            r["peak_ratio"] = round(r["peak_MiB"] / base["peak_MiB"], 3)
            r["transient_ratio"] = round(r["transient_MiB"] / base["transient_MiB"], 3)
        out.append(r)
        print(_fmt(r), flush=True)
    return out


def _fmt(r: dict) -> str:
    def f(key, spec):
        return format(r[key], spec) if key in r else "-".rjust(len(format(0.0, spec)))

    return (
        f"{r['size']:>8} {r['tokens']:>5} {r['dtype']} {r['variant']:<18}"
        f" resident {f('resident_MiB', '9.1f')} peak {f('peak_MiB', '9.1f')}"
        f" ({f('peak_ratio', '5.3f')}x) transient {f('transient_MiB', '8.1f')}"
        f" ({f('transient_ratio', '5.3f')}x)  step {f('median_ms', '9.2f')} ms"
        f" ({f('time_ratio', '5.3f')}x) {r.get('error', '')}"
    )


def _time_cuda(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0.record()
    for _ in range(reps):
        fn()
    t1.record()
    torch.cuda.synchronize()
    return t0.elapsed_time(t1) / reps


def kernel_bench(tokens: int, reps: int) -> list[dict]:
    """The Triton kernel alone vs cuBLAS dW + fused AdamW, per layer shape of the 1B stack."""
    from frugaltrain.forge import RULES, triton_kernel

    rule = RULES["adamw"]
    scalars = rule.scalars({"lr": LR, "betas": BETAS, "eps": EPS, "weight_decay": WD}, 10)
    c = SIZES["1B"]["n_embd"]
    rows = []
    for dname, dtype in DTYPES.items():
        for V, H in ((3 * c, c), (c, c), (4 * c, c), (c, 4 * c)):
            g = torch.Generator(device="cuda").manual_seed(0)
            x = torch.randn(tokens, H, device="cuda", generator=g).to(dtype)
            dy = torch.randn(tokens, V, device="cuda", generator=g).to(dtype) * 1e-3
            w = torch.randn(V, H, device="cuda", generator=g).to(dtype) * 0.02
            w0 = w.clone()
            st = {n: torch.zeros(V, H, device="cuda") for n in rule.state_names}
            st["exp_avg_sq"] += 1e-6
            flops = 2 * tokens * V * H
            r = {"dtype": dname, "tokens": tokens, "V": V, "H": H}
            # reference: cuBLAS dW in the parameter dtype, then torch's fused AdamW on that tensor
            m_ref = torch.zeros(V, H, device="cuda", dtype=dtype)
            v_ref = torch.full((V, H), 1e-6, device="cuda", dtype=dtype)
            step_t = torch.tensor(10.0, device="cuda")

            def ref(w=w0, x=x, dy=dy, m=m_ref, v=v_ref, s=step_t):
                gW = torch.mm(dy.t(), x)
                torch._fused_adamw_(
                    [w], [gW], [m], [v], [], [s], lr=LR, beta1=BETAS[0], beta2=BETAS[1],
                    weight_decay=WD, eps=EPS, amsgrad=False, maximize=False,
                )  # fmt: skip

            gemm_ms = _time_cuda(lambda dy=dy, x=x: torch.mm(dy.t(), x), reps)
            ref_ms = _time_cuda(ref, reps)
            r.update(gemm_ms=round(gemm_ms, 4), cublas_plus_fused_adamw_ms=round(ref_ms, 4))
            r["gemm_TFLOPs"] = round(flops / gemm_ms / 1e9, 1)
            for block in KERNEL_BLOCKS[dname]:
                key = "x".join(map(str, block))
                seed = 1 if dtype == torch.bfloat16 else None
                try:

                    def kern(block=block, dy=dy, x=x, w=w, st=st, seed=seed):
                        triton_kernel.fused_linear_update(
                            dy, x, w, st, rule, scalars, 1.0, seed, block
                        )

                    ms = _time_cuda(kern, reps)
                    r[f"triton_{key}_ms"] = round(ms, 4)
                except Exception as e:  # noqa: BLE001
                    r[f"triton_{key}_ms"] = f"{type(e).__name__}: {str(e)[:200]}"
            timed = {k: v for k, v in r.items() if k.startswith("triton_") and isinstance(v, float)}
            if timed:
                best = min(timed, key=timed.get)
                r["best_block"] = best[len("triton_") : -len("_ms")]
                r["best_speedup"] = round(ref_ms / timed[best], 3)
                block0 = triton_kernel.default_block(dtype, False, tokens)
                default = f"triton_{'x'.join(map(str, block0))}_ms"
                if default in timed:
                    r["default_speedup"] = round(ref_ms / timed[default], 3)
            rows.append(r)
            print("kernel", json.dumps(r), flush=True)
            del x, dy, w, w0, st, m_ref, v_ref
            torch.cuda.empty_cache()
    return rows


def _meta(device: str, args) -> dict:
    meta = {"torch": torch.__version__, "python": platform.python_version(), "args": vars(args)}
    if device == "cuda":
        p = torch.cuda.get_device_properties(0)
        meta["device"] = (
            f"{p.name}, {p.total_memory / 2**30:.1f} GiB, {p.multi_processor_count} SMs"
        )
        meta["cuda"] = torch.version.cuda
        try:
            import triton

            meta["triton"] = triton.__version__
        except ImportError:
            pass
        try:
            q = "--query-gpu=driver_version,clocks.max.sm,power.limit"
            meta["nvidia_smi"] = subprocess.run(
                ["nvidia-smi", q, "--format=csv,noheader"], capture_output=True, text=True
            ).stdout.strip()
        except OSError:
            pass
        meta["tf32_matmul"] = torch.backends.cuda.matmul.allow_tf32
    else:
        meta["device"] = f"cpu ({platform.machine()})"
    meta["method"] = (
        "memory: torch.cuda.max_memory_allocated after reset_peak_memory_stats, one variant at a "
        "time; speed: CUDA events per whole step between synchronizations, variants alternating, "
        "median; all measured"
    )
    meta["baseline"] = "torch.optim.AdamW(fused=True); ratios are variant / baseline"
    return meta


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=CASES, help="size:tokens:dtype,...")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--kernel-tokens", default="512,4096", help="'' skips the kernel benchmark")
    ap.add_argument("--kernel-reps", type=int, default=20)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default="benchmarks/results/forge_gpu_h100.json")
    args = ap.parse_args()
    t_start = time.time()
    variants = {v: settings(v) for v in args.variants.split(",")}
    result = provenance.start("measured", variants=variants)
    result |= {"meta": _meta(args.device, args), "kernel": [], "rows": []}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.device == "cuda" and args.kernel_tokens:
        for tokens in args.kernel_tokens.split(","):
            result["kernel"] += kernel_bench(int(tokens), args.kernel_reps)
        out.write_text(json.dumps(result, indent=1))
    for case in args.cases.split(","):
        size, tokens, dname = case.split(":")
        result["rows"] += run_case(
            size, int(tokens), dname, args.variants.split(","), args.reps, args.device
        )
        result["meta"]["elapsed_s"] = round(time.time() - t_start, 1)
        out.write_text(json.dumps(result, indent=1))  # partial results survive a time limit
    provenance.finish(result)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out} in {time.time() - t_start:.0f} s")


if __name__ == "__main__":
    main()
