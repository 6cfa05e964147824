"""One netlab worker: `python -m frugaltrain.netlab.worker CONFIG RUN_DIR`, started inside its
namespace with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set (the torchrun path of
train.launch.run)."""

import sys
from pathlib import Path

from frugaltrain.config import Config, build_config, read_toml
from frugaltrain.train import launch

if __name__ == "__main__":
    cfg = build_config(Config, read_toml(Path(sys.argv[1])))
    import torch

    torch.set_num_threads(launch.worker_threads(cfg))
    launch.run(cfg, Path(sys.argv[2]))
