"""Measurement records: one dict per measured window, loaded from CSV or JSON Lines.

Canonical keys (units in the name where it has one):
    energy_j, energy_label    energy of the window (J, None if unavailable) and its provenance
    seconds                   wall time of the window (s)
    n_layer, n_embd, n_head, seq_len, batch_size, vocab_size, ffn_mult, grad_accum
    steps                     optimizer steps in the window (1 when a row is one unit of work)
    n_devices, strategy       layout: strategy in baseline | ddp | fsdp | tp | pp
    hardware, arch            device name and model family (gpt, bert, ...)
    group                     cross-validation group (default arch|n_layer|n_embd: a configuration
                              family is never in both train and test)
    eta                       speedup-based parallel efficiency T1 / (N T_N), if known
    comm_every                steps between synchronisations (1 for DDP, H for DiLoCo)

The public single-GPU set (data/energy/transformer_energy_single_gpu.csv, columns duration,
energy_joules, d_model, ...) is recognised and mapped; its energy is CodeCarbon GPU+CPU+RAM.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

from frugaltrain.energy.proxies import Layout, TransformerShape, step_proxies

_INT_KEYS = (
    "n_layer",
    "n_embd",
    "n_head",
    "seq_len",
    "batch_size",
    "vocab_size",
    "ffn_mult",
    "grad_accum",
    "n_devices",
)
_DEFAULTS = {
    "vocab_size": 0,
    "ffn_mult": 4,
    "grad_accum": 1,
    "steps": 1,
    "n_devices": 1,
    "strategy": "baseline",
    "hardware": "unknown",
    "arch": "gpt",
    "energy_label": "measured (unspecified)",
    "comm_every": 1,
}
STRATEGIES = ("baseline", "ddp", "fsdp", "tp", "pp")


def _from_public_csv(row: dict) -> dict:
    """Map a row of the MIT single-GPU set (MansMayaki/MLEnergyConsumption) to canonical keys."""
    return {
        "energy_j": float(row["energy_joules"]),
        "energy_label": "measured (CodeCarbon GPU+CPU+RAM)",
        "seconds": float(row["duration"]),
        "n_layer": row["num_layers"],
        "n_embd": row["d_model"],
        "n_head": row["num_attention_heads"],
        "seq_len": row["seq_length"],
        "batch_size": row["batch_size"],
        "hardware": {"a100": "a100", "grid": "grid"}.get(row["source"], row["source"]),
        "arch": row["model"],
        "params_reported": float(row["params"]),
        "flops_reported": float(row["flops_counts"]) * 1e12,
    }


def normalize(rec: dict) -> dict:
    """Fill defaults, coerce types and check a record; raises ValueError naming the key."""
    out = {**_DEFAULTS, **{k: v for k, v in rec.items() if v not in ("", None)}}
    if "energy_j" not in rec:
        out["energy_j"] = None
    for key in _INT_KEYS:
        if key not in out:
            raise ValueError(f"record is missing {key!r} (have {sorted(rec)})")
        out[key] = int(float(out[key]))
    out["seconds"] = float(out["seconds"])
    out["steps"] = float(out["steps"])
    out["comm_every"] = float(out["comm_every"])
    if out["energy_j"] is not None:
        out["energy_j"] = float(out["energy_j"])
    if out["strategy"] not in STRATEGIES:
        raise ValueError(f"strategy = {out['strategy']!r}: use one of {STRATEGIES}")
    out.setdefault("group", f"{out['arch']}|{out['n_layer']}|{out['n_embd']}")
    return out


def load_records(path: str | Path) -> list[dict]:
    """Read records from a .csv or .jsonl file (one record per row / line; JSONL lines with a
    `kind` other than 'record' are skipped)."""
    path = Path(path)
    if path.suffix == ".jsonl":
        with path.open() as fh:
            raw = [json.loads(line) for line in fh if line.strip()]
        # Logs may interleave other entries (preflight, idle, ...): keep the records.
        raw = [r for r in raw if r.get("kind", "record") == "record"]
    elif path.suffix == ".csv":
        with path.open(newline="") as fh:
            raw = list(csv.DictReader(fh))
        if raw and "energy_joules" in raw[0] and "d_model" in raw[0]:
            raw = [_from_public_csv(r) for r in raw]
    else:
        raise ValueError(f"{path}: records must be a .csv or .jsonl file")
    return [normalize(r) for r in raw]


def save_records(records: list[dict], path: str | Path) -> None:
    with Path(path).open("w") as fh:
        for r in records:
            fh.write(json.dumps(r) + "\n")


def shape_of(rec: dict) -> TransformerShape:
    return TransformerShape(
        n_layer=rec["n_layer"],
        n_embd=rec["n_embd"],
        n_head=rec["n_head"],
        seq_len=rec["seq_len"],
        vocab_size=rec["vocab_size"],
        batch_size=rec["batch_size"],
        grad_accum=rec["grad_accum"],
        ffn_mult=rec["ffn_mult"],
        head_tokens="all" if rec["vocab_size"] else "none",
    )


def layout_of(rec: dict) -> Layout:
    n, strategy = rec["n_devices"], rec["strategy"]
    if strategy == "tp":
        return Layout(tp=n, flash=False)
    if strategy == "pp":
        return Layout(pp=n, flash=False)
    return Layout(dp=n, fsdp=strategy == "fsdp", flash=False)


def derive(rec: dict) -> dict:
    """Analytic proxies for a record's whole window (per device, x steps), plus paper proxies.

    Keys: F, F_mm, F_att (FLOPs), Q, Q_act, Q_score, Q_w (bytes: total, activation,
    attention-score, weight/optimizer), X (collective bytes), layer_steps (layer passes: a
    proxy for kernel launches), params, tokens, C, M.
    Score traffic is computed as without fused attention: a proxy for the s^2 memory term.
    """
    px = step_proxies(shape_of(rec), layout_of(rec))
    k = rec["steps"]
    tokens = px.tokens * k
    return {
        "F": px.flops * k,
        "F_mm": px.flops_matmul * k,
        "F_att": px.flops_attention * k,
        "Q": px.hbm_bytes * k,
        "Q_act": px.act_bytes * k,
        "Q_score": px.score_bytes * k,
        "Q_w": (px.hbm_bytes - px.act_bytes - px.score_bytes) * k,
        "X": px.comm_bytes * k / rec.get("comm_every", 1),
        "layer_steps": rec["n_layer"] * rec["grad_accum"] * k,
        "params": px.params,
        "tokens": tokens,
        "C": 20 * rec["n_layer"] * rec["n_embd"] ** 2 * tokens,
        "M": rec["batch_size"] * rec["seq_len"] * rec["n_embd"] * rec["n_layer"],
    }


def is_measured(rec: dict) -> bool:
    return rec["energy_j"] is not None and str(rec["energy_label"]).startswith("measured")
