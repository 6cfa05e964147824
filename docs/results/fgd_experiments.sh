#!/usr/bin/env bash
# Reproduce docs/results/fgd.md (E1-E4, E7): simulated runs on the synthetic Markov source.
# Every run is resumable: compare skips runs whose summary.json exists. OUT defaults to runs/fgd.
set -euo pipefail
OUT=${OUT:-runs/fgd}
CFG=examples/sim_markov.toml
SEEDS=${SEEDS:-0,1,2}
ft() { python -m frugaltrain "$@"; }

case "${1:-all}" in
e2|all)  # E2 + E4 (+ E3 at r = 0.887): per-token quality, Mix2 subset sweep
  ft compare $CFG --seeds $SEEDS --out $OUT/e2 --set sim.ratio=0.887 \
    --methods ddp,diloco,GlobalM1,GlobalM1LocalM2,M2:embed+head,M2:embed+head+blocks:1,M2:all,M2pairs:embed+head,fgd-ring,noloco,streaming
  ;;&
e1|all)  # E1: utilization vs r (fixed compute: utilization is deterministic, one seed)
  for r in 0.25 0.5 0.887 1.774 4; do
    ft compare $CFG --seeds 0 --out $OUT/e1/r$r --set sim.ratio=$r --set run.steps=80 \
      --set run.eval_every=0 \
      --methods ddp,diloco,GlobalM1,GlobalM1LocalM2,M2:embed+head,M2:all,noloco,streaming
  done
  ;;&
e7|all)  # E7: drops, stragglers, a crash (r = 0.887)
  M="diloco,GlobalM1,fgd-ring"
  ft compare $CFG --seeds $SEEDS --out $OUT/e7/drop0.05-retry --methods $M \
    --set sim.ratio=0.887 --set sim.drop_prob=0.05 --set sim.allreduce_policy=retry
  ft compare $CFG --seeds $SEEDS --out $OUT/e7/straggle --methods $M --set sim.ratio=0.887 \
    --set sim.straggler_prob=0.1 --set sim.straggler_slowdown=4
  ft compare $CFG --seeds $SEEDS --out $OUT/e7/crash --methods $M --set sim.ratio=0.887 \
    --set sim.crash_worker=3 --set sim.crash_round=5 --set sim.crash_rounds=5
  ft compare $CFG --seeds $SEEDS --out $OUT/e7/drop0.05-rollback --methods diloco,GlobalM1 \
    --set sim.ratio=0.887 --set sim.drop_prob=0.05 --set sim.allreduce_policy=rollback
  ;;&
e3|all)  # E3 at r = 1.774 (100 Mbps regime); same trajectories as E2, longer links
  ft compare $CFG --seeds $SEEDS --out $OUT/e3 --set sim.ratio=1.774 \
    --methods diloco,GlobalM1,GlobalM1LocalM2,M2:embed+head
  ;;
esac
