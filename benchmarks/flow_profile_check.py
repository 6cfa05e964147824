"""Why the warm-up profile's one-thread encoder rate (alloc.profile) fell below what the runs
reached: on the quiet run 3 (flow-vlm-quiet.json, encoder-heavy) the profile gave the encoder
53 samples/s at 1 thread (and 184 at 2 threads, 3.5x), while the flow producer computed at about
106 samples/s (flow's 96.9 samples/s over its 0.91 compute share).

    python benchmarks/flow_profile_check.py                       # 5 repetitions
    python benchmarks/flow_profile_check.py --smoke --out flowprof_smoke.json  # a quick check

The encoder-heavy workload of benchmarks/flow.py. Variants, interleaved in each repetition,
one thread unless said:
  profile_fresh    (i, the reference) alloc.profile(cfg, 2, alloc.profile_steps) as the first
                   compute of a fresh process, after benchmarks/flow.py's preamble: how run 3
                   took it. Its 2-thread per-replica rate is a row too.
  passes_fresh     (ii) profile's calls on profile's models in a fresh process, as profile's
                   timing loop but --passes passes: the rate of each pass (profile keeps pass 2)
  profile_warm     (i) alloc.profile in this process, which profiled once before the repetitions
  runtime_calls    (iii) the producer's calls in the runs' window (steps run.warmup_steps..),
                   encoder set up as the runtime's (requires_grad off), in this process, warm
  runtime_process  (iii, iv) the producer's steps in a fresh process set up like a runtime
                   worker (torch.set_num_threads(run.threads) first), its window's compute
                   spans; alone, where the runs' consumer computed beside it on the other core
Every variant records the time Python's garbage collector spent inside its timed calls (in the
profile rows: anywhere in profile(), an upper bound), and passes_fresh its pass's wall time
beside the summed call times (the timing's own overhead).

Rates are samples/s (what the simulator uses) and GFLOP/s (estimated from a ViT FLOP count:
independent of the calls' image sizes, so the runtime's heavier image mix compares fairly).
Prints a table (median over repetitions, min-max, ratio of medians to profile_fresh and the
per-repetition ratios' min-max) and writes the JSON (every repetition, measured).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import statistics
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from multiprocessing import get_context

import provenance
import torch
from flow import WORKLOADS, with_sets

from frugaltrain.flow.alloc import encoder_pass, profile
from frugaltrain.flow.config import FlowConfig, load_flow_config
from frugaltrain.flow.data import build_dataset
from frugaltrain.flow.models import build_consumer, build_encoder
from frugaltrain.flow.packing import plan_batch
from frugaltrain.flow.runtime import make_plans, min_slots
from frugaltrain.flow.samples import CaptionSet
from frugaltrain.flow.trace import calibrate_matmul_flops

WORKLOAD = "encoder_heavy"
REFERENCE = "profile_fresh"
# Tiny compute (a small tower, one profile batch, two runtime steps): the smoke run's time is
# its four processes' imports.
SMOKE = [
    "model.enc_dim=32",
    "model.enc_layers=1",
    "model.enc_heads=2",
    "alloc.profile_steps=1",
    "run.steps=2",
    "run.warmup_steps=1",
]


# ------------------------------------------------------------------- measuring


@contextmanager
def gc_clock() -> Iterator[dict]:
    """Seconds in the garbage collector and its full (generation 2) collections while open and
    while the yielded dict's "on" is true (a caller clears it between timed spans)."""
    got = {"gc_s": 0.0, "gc_full": 0, "on": True}
    t0 = [0.0]

    def cb(phase: str, info: dict) -> None:
        if phase == "start":
            t0[0] = time.perf_counter()
        elif got["on"]:
            got["gc_s"] += time.perf_counter() - t0[0]
            got["gc_full"] += info["generation"] == 2

    gc.callbacks.append(cb)
    try:
        yield got
    finally:
        gc.callbacks.remove(cb)
        del got["on"]


def flop(cfg: FlowConfig, calls: list[list[int]]) -> float:
    """Forward FLOPs (estimated) of encoder calls given as visual token counts per sample: per
    layer 24 N d^2 (projections, MLP 4d) + 4 N^2 d (attention), plus the patch embedding."""
    d, layers, p = cfg.model.enc_dim, cfg.model.enc_layers, cfg.data.patch
    per = [
        layers * (24 * n * d * d + 4 * n * n * d) + 2 * 3 * p * p * d * n for c in calls for n in c
    ]
    return float(sum(per)) * (3 if cfg.run.train_encoder else 1)


def measurement(cfg: FlowConfig, calls: list[list[int]], seconds: float, gcs: dict) -> dict:
    n = sum(len(c) for c in calls)
    return {"samples": n, "seconds": seconds, "flop": flop(cfg, calls), **gcs}


def profile_calls(cfg: FlowConfig, ds: CaptionSet) -> list[list[int]]:
    """The sample ids of alloc.profile's encoder calls (its construction, repeated here; checked
    against profile's own `enc_calls` in main)."""
    k_ids = {k: ds.batch_ids(10_000 + k) for k in range(cfg.alloc.profile_steps)}
    samples = {i: ds.sample(i) for ids in k_ids.values() for i in ids}
    s = cfg.sched
    return [
        sids
        for k, ids in k_ids.items()
        for sids, _ in plan_batch(
            k,
            {i: samples[i].length for i in ids},
            L=s.capacity,
            ranks=1,
            policy=s.policy,
            how=s.dispatch,
            visual={i: x.n_visual for i, x in samples.items()},
        ).encoder_batches()
    ]


def runtime_calls(cfg: FlowConfig, ds: CaptionSet) -> list[tuple[int, list[int]]]:
    """(step, sample ids) of producer 0's calls over every step, as runtime._producer runs them."""
    P = cfg.run.producers
    return [
        (k, sids)
        for k, plan in enumerate(make_plans(cfg, ds))
        for b, (sids, _) in enumerate(plan.encoder_batches())
        if b % P == 0
    ]


def visual(ds: CaptionSet, calls: list[list[int]]) -> list[list[int]]:
    return [[ds.sample(i).n_visual for i in c] for c in calls]


def runtime_encoder(cfg: FlowConfig) -> torch.nn.Module:
    enc = build_encoder(cfg)
    enc.requires_grad_(cfg.run.train_encoder)  # as runtime._producer
    return enc


# ------------------------------------------------------------------- fresh processes


def _preamble(cfg: FlowConfig) -> None:
    """What benchmarks/flow.py's process computes before its first profile."""
    provenance.machine_info()
    calibrate_matmul_flops()
    min_slots(make_plans(cfg, build_dataset(cfg)), cfg.run.producers, "flow")


def child_profile(cfg: FlowConfig) -> dict:
    """profile() as run 3 took it: the process's first compute after the preamble."""
    _preamble(cfg)
    with gc_clock() as gcs:
        prof = profile(cfg, 2, cfg.alloc.profile_steps)
    t1 = measurement(cfg, prof["enc_calls"], sum(prof["enc_call_seconds"]), gcs)
    n = t1["samples"]
    t2 = {"samples": n, "seconds": n / prof["rho"]["encoder"][2], "flop": t1["flop"]}
    return {"t1": t1, "t2": t2}


def child_passes(cfg: FlowConfig, passes: int) -> list[dict]:
    """profile's models, inputs and timing loop in a fresh process, for `passes` passes."""
    _preamble(cfg)
    ds = build_dataset(cfg)
    enc, _ = build_encoder(cfg), build_consumer(cfg, ds)  # both built, as in profile
    calls = profile_calls(cfg, ds)
    inputs = [ds.encoder_input(c, getattr(torch, cfg.run.dtype)) for c in calls]
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    out = []
    try:
        for _ in range(passes):
            with gc_clock() as gcs:
                t0 = time.perf_counter()
                seconds = encoder_pass(cfg, enc, inputs)
                wall = time.perf_counter() - t0
            m = measurement(cfg, visual(ds, calls), sum(seconds), gcs)
            out.append(m | {"wall_s": wall})
    finally:
        torch.set_num_threads(saved)
    return out


def child_runtime(cfg: FlowConfig) -> dict:
    """runtime._producer's encoder work in a process set up like runtime._worker: the compute
    spans of the steps from run.warmup_steps on (the window the runs are measured over)."""
    torch.set_num_threads(cfg.run.threads)
    ds, dtype = build_dataset(cfg), getattr(torch, cfg.run.dtype)
    enc, train = runtime_encoder(cfg), cfg.run.train_encoder and cfg.run.staleness == 0
    calls, seconds = [], 0.0
    with gc_clock() as gcs:
        for k, sids in runtime_calls(cfg, ds):
            gcs["on"] = False  # image processing between spans, as in the runtime: not counted
            x = ds.encoder_input(sids, dtype)
            gcs["on"] = k >= cfg.run.warmup_steps
            t0 = time.perf_counter()
            with torch.set_grad_enabled(train):
                enc(x)
            if gcs["on"]:
                seconds += time.perf_counter() - t0
                calls.append(sids)
    return measurement(cfg, visual(ds, calls), seconds, gcs)


def fresh(fn, *args):
    """fn(*args) in a new spawned process (as the runtime starts its workers)."""
    with ProcessPoolExecutor(1, mp_context=get_context("spawn")) as ex:
        return ex.submit(fn, *args).result()


# ------------------------------------------------------------------- in this process


@dataclasses.dataclass
class Warm:
    """This process's state for the in-process variants, warmed before the repetitions."""

    cfg: FlowConfig
    enc: torch.nn.Module
    calls: list[list[int]]
    inputs: list[torch.Tensor]

    @classmethod
    def build(cls, cfg: FlowConfig) -> Warm:
        ds = build_dataset(cfg)
        prof = profile(cfg, 1, cfg.alloc.profile_steps)  # warms this process; not recorded
        assert prof["enc_calls"] == visual(ds, profile_calls(cfg, ds)), "profile's calls changed"
        calls = [s for k, s in runtime_calls(cfg, ds) if k >= cfg.run.warmup_steps]
        inputs = [ds.encoder_input(c, getattr(torch, cfg.run.dtype)) for c in calls]
        warm = cls(cfg, runtime_encoder(cfg), visual(ds, calls), inputs)
        warm.runtime_calls()  # one untimed pass
        return warm

    def profile(self) -> dict:
        with gc_clock() as gcs:
            prof = profile(self.cfg, 1, self.cfg.alloc.profile_steps)
        return measurement(self.cfg, prof["enc_calls"], sum(prof["enc_call_seconds"]), gcs)

    def runtime_calls(self) -> dict:
        saved = torch.get_num_threads()
        torch.set_num_threads(self.cfg.run.threads)
        try:
            with gc_clock() as gcs:
                seconds = sum(encoder_pass(self.cfg, self.enc, self.inputs))
        finally:
            torch.set_num_threads(saved)
        return measurement(self.cfg, self.calls, seconds, gcs)


# ------------------------------------------------------------------- the run


def repetition(cfg: FlowConfig, warm: Warm, passes: int) -> dict[str, dict]:
    """One measurement of every row, in the interleaved order."""
    prof = fresh(child_profile, cfg)
    rows = {REFERENCE: prof["t1"], f"{REFERENCE}, 2 threads (per replica)": prof["t2"]}
    for i, m in enumerate(fresh(child_passes, cfg, passes), 1):
        rows[f"passes_fresh, pass {i}"] = m
    rows["runtime_process"] = fresh(child_runtime, cfg)
    rows["profile_warm"] = warm.profile()
    rows["runtime_calls"] = warm.runtime_calls()
    return rows


def rate(m: dict, unit: str) -> float:
    return (m["samples"] if unit == "samples" else m["flop"] / 1e9) / m["seconds"]


def summary(reps: list[dict[str, dict]]) -> dict[str, dict]:
    """Per row: median and range of samples/s and GFLOP/s, ratios to the reference, GC time."""
    out = {}
    for row in reps[0]:
        sps = [rate(r[row], "samples") for r in reps]
        per_rep = [rate(r[row], "samples") / rate(r[REFERENCE], "samples") for r in reps]
        ref = statistics.median(rate(r[REFERENCE], "samples") for r in reps)
        out[row] = {
            "samples_per_s": [statistics.median(sps), min(sps), max(sps)],
            "gflop_per_s": statistics.median(rate(r[row], "gflop") for r in reps),
            "over_reference": [statistics.median(sps) / ref, min(per_rep), max(per_rep)],
            "gc_s": statistics.median(r[row].get("gc_s", 0.0) for r in reps),
        }
        if "wall_s" in reps[0][row]:  # the timing's own overhead in a pass
            walls = [r[row]["wall_s"] - r[row]["seconds"] for r in reps]
            out[row]["wall_minus_calls_s"] = statistics.median(walls)
    return out


def table(summ: dict[str, dict]) -> str:
    lines = [
        f"| variant | samples/s, median (min-max) | / {REFERENCE} (per-rep min-max) "
        "| GFLOP/s (estimated) | GC s in timed calls | pass wall - calls, ms |",
        "|---|---|---|---|---|---|",
    ]
    for row, s in summ.items():
        (m, lo, hi), (r, rlo, rhi) = s["samples_per_s"], s["over_reference"]
        wall = s.get("wall_minus_calls_s")
        lines.append(
            f"| {row} | {m:.1f} ({lo:.1f}-{hi:.1f}) | {r:.2f} ({rlo:.2f}-{rhi:.2f}) "
            f"| {s['gflop_per_s']:.1f} | {s['gc_s']:.3f} "
            f"| {'-' if wall is None else f'{1e3 * wall:.2f}'} |"
        )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="examples/flow_vlm.toml")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--passes", type=int, default=6, help="passes of passes_fresh")
    ap.add_argument("--smoke", action="store_true", help="tiny model and sizes, 1 repetition")
    ap.add_argument("--out", default="benchmarks/results/flow_profile_check.json")
    args = ap.parse_args(argv)
    sets = WORKLOADS[WORKLOAD] + (SMOKE if args.smoke else [])
    reps, passes = (1, 3) if args.smoke else (args.reps, args.passes)
    cfg = with_sets(load_flow_config(args.config), sets)
    record = provenance.start("measured", variants={WORKLOAD: sets})
    record |= {"config": dataclasses.asdict(cfg), "reps": reps, "passes": passes}
    warm, runs = Warm.build(cfg), []
    for rep in range(reps):
        runs.append(repetition(cfg, warm, passes))
        record["measured.repetitions"] = runs
        record["measured.summary"] = summary(runs)
        provenance.save(record, args.out)  # a cut run keeps its finished repetitions
        print(f"rep {rep}: {REFERENCE} {rate(runs[-1][REFERENCE], 'samples'):.1f} samples/s")
    provenance.save(provenance.finish(record), args.out)
    print(table(record["measured.summary"]))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
