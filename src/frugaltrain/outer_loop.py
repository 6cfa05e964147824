"""`frugaltrain.wrap` (and the `OuterLoop` it returns): an outer strategy for a training loop you
keep.

Like torchft's LocalSGD and DiLoCo, `wrap` hooks your torch.optim optimizer and leaves your loop
alone: `loss.backward(); opt.step(); opt.zero_grad()`. The strategy is the same object
`frugaltrain train` builds (outer.build_strategy), its keywords are the [outer] config keys,
checked by the config's own rules (config.OuterSection), and it talks through the same Comm. See
docs/library.md.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from frugaltrain.comm import Comm, LocalComm
from frugaltrain.comm.torchdist import TorchDistComm
from frugaltrain.config import (
    OUTER_KEYS,
    ConfigError,
    OuterSection,
    build_config,
    nest_outer_keys,
    unused_outer_keys,
)
from frugaltrain.forge import ForgeOptimizer
from frugaltrain.outer import DDP, Strategy, build_strategy


@dataclass(kw_only=True)
class _OuterOnly:
    """A config of the [outer] section alone: wrap's keywords go through the config's checks
    (unknown keys, types, values) and its one error format, `outer.key = value: rule`."""

    outer: OuterSection = field(default_factory=OuterSection)


def wrap(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    strategy: str = "diloco",
    H: int = 50,
    comm: Comm | None = None,
    seed: int = 0,
    **outer_keys,
) -> OuterLoop:
    """Run an outer strategy (DiLoCo, Factored Gossip DiLoCo, NoLoCo, Streaming DiLoCo or DDP)
    around your own training loop by hooking `optimizer.step()`.

    Behaviour. Around every `optimizer.step()` (torch's step pre- and post-hooks):
        before: strategy.before_step(step), then strategy.sync_grads()
            ddp all-reduces the gradients here; fgd posts its non-blocking Mix1 of the outer
            parameters x at a round's first step. `frugaltrain train` posts Mix1 before that
            step's forward instead: x does not move inside a round, so it is the same message
            and the same arithmetic, only a shorter overlap (the round's other H - 1 steps
            instead of all H).
        after: step += 1, then strategy.after_step(step)
            every H steps the outer round: the pseudo-gradient Delta = x - theta is exchanged,
            the outer optimizer (SGD, learning rate gamma = `lr`, Nesterov momentum mu =
            `momentum`) steps x, and the model's parameters theta are overwritten with x.
    So after the step that completes a round the model holds the new outer parameters; its own
    AdamW (or other) state stays local, as in the papers. A step the optimizer does not take
    (e.g. GradScaler skipping an overflow) runs no hook and is not counted.

    Failure. The strategies block only inside their collectives; a dead or stalled peer makes
    one raise after the process group's timeout (`init_process_group(timeout=...)`), out of
    `optimizer.step()`, before the optimizer updates anything. wrap does not recover: restart
    every worker from your last checkpoint (model, optimizer and `OuterLoop.state_dict()`). The
    fault-tolerant runtime (comm/ft/: membership epochs, deadlines, rejoin) is available
    only through `frugaltrain train --set fault_tolerance.enabled=true`.

    Papers: DiLoCo arXiv 2311.08105; Factored Gossip DiLoCo (fgd, Mix1 with W1 and Mix2 with
    W2) arXiv 2606.22768; NoLoCo arXiv 2506.10911; Streaming DiLoCo arXiv 2501.18512.
    docs/outer.md has the updates.

    Calling contract:
        - call `wrap` on every rank, with the same strategy, keys and seed;
        - the parameters must be identical on every rank when `wrap` is called (it copies them
          as the first outer parameters x): build the model under the same `torch.manual_seed`
          everywhere, or broadcast rank 0's parameters first
          (`for p in model.parameters(): dist.broadcast(p.data, src=0)`);
        - call `optimizer.step()` the same number of times on every rank (rounds are counted in
          steps), e.g. `while outer.step < total_steps`, and end on a multiple of H so every
          worker ends on synchronized parameters;
        - take `state_dict()` at a round end (`outer.step % H == 0`): fgd and streaming refuse
          while a message is in flight.

    Args:
        model: the module your optimizer trains; every parameter with requires_grad is synced.
        optimizer: a torch.optim optimizer over `model`'s parameters. FORGE optimizers
            (frugaltrain.forge) update inside backward and are refused.
        strategy: outer.strategy: ddp, diloco, fgd, noloco or streaming.
        H: outer.H, inner steps per outer round (ddp: steps per counted round).
        comm: where to communicate. Default: the default torch.distributed group
            (TorchDistComm) when it is initialized, else one worker (LocalComm), where every
            strategy reduces to single-worker DiLoCo (ddp to plain training).
        seed: run.seed of a config: seeds what a strategy draws (gossip pairs, NoLoCo groups).
        **outer_keys: the other [outer] keys the strategy reads (config.OUTER_KEYS), flat:
            the shared ones, e.g. lr (gamma), momentum (mu), nesterov, codec, feedback_decay
            (not ddp), param_codec (fgd, noloco), and the keys of its own sub-section, which
            wrap places there: fgd (outer.fgd): preset, mix1, mix2, mix2_params,
            momentum_policy, mix1_weight, mix2_momentum; noloco (outer.noloco): group_size,
            consensus_pull; streaming (outer.streaming): fragments (P), overlap (tau),
            merge_alpha.

    Raises (before any hook is installed): ConfigError (a ValueError), one line in the config's
    format, for an unknown key, a bad value, a key set away from its default that the strategy
    does not read (a config file only warns), or a FORGE optimizer; TypeError for an
    optimizer that is not a torch.optim.Optimizer.
    """
    _check_optimizer(optimizer)
    o = _outer_section(strategy, H, outer_keys)
    if comm is None:
        comm = TorchDistComm() if dist.is_available() and dist.is_initialized() else LocalComm()
    return OuterLoop(o.strategy, build_strategy(o, model, comm, seed=seed), optimizer, comm, o.H)


class OuterLoop:
    """The outer strategy hooked on your optimizer; `wrap` builds it.

    Attributes:
        step: inner steps (optimizer steps) done.
        round: outer rounds done (ddp: H-step rounds counted).
        H: inner steps per round.
        comm: the Comm in use; `comm.stats` holds bytes_sent, bytes_received (the algorithm's
            traffic model, comm/base.py) and blocking_s (seconds blocked in communication).
        strategy: the strategy object (outer.STRATEGIES); strategy_name: its name.
    """

    def __init__(
        self, name: str, strategy: Strategy, optimizer: torch.optim.Optimizer, comm: Comm, H: int
    ):
        self.strategy_name = name
        self.strategy = strategy
        self.comm = comm
        self.H = H
        self.step = 0
        self.round = 0
        self._begun = False  # before_step and sync_grads done for the coming step
        self._hooks = [
            optimizer.register_step_pre_hook(self._pre_step),
            optimizer.register_step_post_hook(self._post_step),
        ]

    def sync_grads(self) -> None:
        """Run the strategy's gradient sync now instead of inside `optimizer.step()`: call it
        after backward and before clipping (and before a GradScaler's step), on every rank, so
        you clip the averaged gradient as `frugaltrain train` does. Only ddp syncs gradients;
        for the others it is free."""
        if not self._begun:
            self.strategy.before_step(self.step)
            self.strategy.sync_grads()
            self._begun = True

    def _pre_step(self, optimizer, args, kwargs) -> None:
        self.sync_grads()

    def _post_step(self, optimizer, args, kwargs) -> None:
        self._begun = False
        self.step += 1
        if self.strategy.after_step(self.step):
            self.round += 1

    def state_dict(self) -> dict:
        """The strategy's outer state (x, outer optimizer, round) and the counters. Save it with
        your model's and optimizer's state dicts, at a round end."""
        return {
            "strategy": self.strategy_name,
            "outer": self.strategy.state_dict(),
            "step": self.step,
            "round": self.round,
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from `state_dict()`; load the model and optimizer states too."""
        if state["strategy"] != self.strategy_name:
            raise ValueError(
                f"state is from strategy {state['strategy']!r}, this loop runs "
                f"{self.strategy_name!r}; wrap with the strategy that saved it"
            )
        self.strategy.load_state_dict(state["outer"])
        self.step, self.round = state["step"], state["round"]

    def close(self) -> None:
        """Remove the hooks: `optimizer.step()` is a plain step again."""
        if self._hooks and self.step % self.H and not isinstance(self.strategy, DDP):
            warnings.warn(
                f"closed at step {self.step}, inside round {self.round + 1} (H = {self.H}): its "
                f"last {self.step % self.H} inner steps were never synchronized; stop on a "
                "multiple of H",
                stacklevel=2,
            )
        self._remove_hooks()

    def _remove_hooks(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def __enter__(self) -> OuterLoop:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:  # the error is the news; no warning about the round it interrupted
            self._remove_hooks()


def _check_optimizer(optimizer) -> None:
    if isinstance(optimizer, ForgeOptimizer):
        raise ConfigError(
            "optimizer is a FORGE optimizer: it updates the weights inside backward, so there is "
            "no optimizer step for wrap to hook; use `frugaltrain train --set "
            "optim.name=forge-adamw` for FORGE, or a torch.optim optimizer with wrap"
        )
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer is a {type(optimizer).__name__}; wrap hooks a torch.optim.Optimizer"
        )


def _outer_section(strategy: str, H: int, keys: dict) -> OuterSection:
    """The [outer] section of these keywords (a strategy's own keys go to its sub-section),
    refused exactly as a config would refuse it; a key the strategy does not read is an error
    here, since it was passed on purpose."""
    table = nest_outer_keys({"strategy": strategy, "H": H, **keys})
    o = build_config(_OuterOnly, {"outer": table}).outer
    unused = unused_outer_keys(o)
    if unused:
        (key, value), reads = unused[0], [k for k in OUTER_KEYS[o.strategy] if k != "strategy"]
        raise ConfigError(
            f"{key} = {value!r}: no effect with outer.strategy = {o.strategy!r}, which reads "
            f"{', '.join(reads)}; drop it"
        )
    return o
