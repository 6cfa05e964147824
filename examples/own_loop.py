"""Your own training loop, made communication-light with frugaltrain.wrap (docs/library.md).

    python examples/own_loop.py                                        # one process
    torchrun --nproc-per-node 2 examples/own_loop.py --strategy fgd    # two workers, gloo

A next-byte model over the bytes of argparse.py from the Python standard library. Only the
`wrap` line is frugaltrain: the loop is plain backward, step, zero_grad.
"""

import argparse
import os
import sysconfig
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

import frugaltrain

parser = argparse.ArgumentParser()
parser.add_argument("--strategy", default="diloco", choices=["ddp", "diloco", "fgd", "noloco"])
parser.add_argument("--steps", type=int, default=200)
parser.add_argument("-H", type=int, default=20, help="inner steps per outer round")
args = parser.parse_args()

if "RANK" in os.environ:  # started by torchrun: join its group
    dist.init_process_group("gloo")
rank = dist.get_rank() if dist.is_initialized() else 0

text = Path(sysconfig.get_paths()["stdlib"], "argparse.py").read_bytes()
data = torch.tensor(list(text))
CONTEXT = 8  # the model sees the previous 8 bytes

torch.manual_seed(0)  # the same initial parameters on every worker (wrap's contract)
model = torch.nn.Sequential(
    torch.nn.Embedding(256, 32), torch.nn.Flatten(), torch.nn.Linear(CONTEXT * 32, 256)
)
opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
batches = torch.Generator().manual_seed(1 + rank)  # but each worker its own batches

with frugaltrain.wrap(model, opt, strategy=args.strategy, H=args.H) as outer:
    round_loss = 0.0
    while outer.step < args.steps:
        starts = torch.randint(len(data) - CONTEXT, (64,), generator=batches)
        window = torch.stack([data[s : s + CONTEXT + 1] for s in starts.tolist()])
        loss = F.cross_entropy(model(window[:, :-1]), window[:, -1])
        loss.backward()
        opt.step()  # the outer round runs in here every H steps
        opt.zero_grad()
        round_loss += loss.item() / args.H
        if outer.step % args.H == 0:
            sent_mb = outer.comm.stats.bytes_sent / 1e6
            if rank == 0:
                print(f"round {outer.round:3d}  loss {round_loss:.3f}  sent {sent_mb:.2f} MB")
            round_loss = 0.0

if dist.is_initialized():
    dist.barrier()  # gloo can abort a rank that leaves while its peer still sends
    dist.destroy_process_group()
