"""FGD against DiLoCo on BPE text with a transformers model: `fgd_real_text.py` with the default
job's Llama and token shards (2048-token BPE of the standard library's sources), one H, real
processes, 3 seeds. Later flags override these defaults.

    python benchmarks/hf_loss_gap.py [--seeds 0,1,2] [--steps 300] [--H 30]
"""

import sys

from fgd_real_text import main

DEFAULTS = ["--model", "llama", "--data", "runs/data/stdlib-bpe2k", "--H", "30", "--steps", "300"]

if __name__ == "__main__":
    main([*DEFAULTS, "--evals", "2", "--out", "benchmarks/results/hf_loss_gap.json", *sys.argv[1:]])
