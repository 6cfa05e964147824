"""Measure what a netlab link really delivers to gloo (comm/probe.py: a ring all-reduce and a pair
exchange of S bytes, both orders of the exchange). Started in every namespace like a netlab worker
(RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set):

    python -m frugaltrain.netlab.probe BYTES REPEATS OUT_JSON      (worker 0 writes OUT_JSON)
"""

from __future__ import annotations

import json
import sys
from datetime import timedelta

import torch.distributed as dist

from frugaltrain.comm.probe import measure


def main(nbytes: int, repeats: int, out: str) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=600))
    got = measure(nbytes, repeats)
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(got, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
