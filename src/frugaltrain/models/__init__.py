"""Models the strategies train: the built-in GPT (models/gpt.py), transformers causal LMs
(models/hf.py), and named model parts (models/parts.py: embed, blocks, head), which Mix2
subsets, Streaming fragments and the consensus metrics address. Every model has the same
forward: `model(idx, targets) -> (logits, mean loss)`."""

from __future__ import annotations

import contextlib

import torch

from frugaltrain.config import Config
from frugaltrain.models.gpt import GPT, GPTConfig
from frugaltrain.models.parts import block_index


def build_model(cfg: Config) -> torch.nn.Module:
    """The model of `cfg`, initialized from run.seed (the same on every worker: DiLoCo needs
    one shared starting point)."""
    m = cfg.model
    torch.manual_seed(cfg.run.seed)
    if m.family != "gpt":
        from frugaltrain.models.hf import build_hf

        return build_hf(cfg)
    return GPT(
        GPTConfig(
            n_layer=m.n_layer,
            n_head=m.n_head,
            n_embd=m.n_embd,
            vocab_size=m.vocab_size,
            block_size=cfg.data.seq_len,
            dropout=m.dropout,
            bias=m.bias,
            tie_embeddings=m.tie_embeddings,
        )
    )


def model_dims(cfg: Config) -> dict[str, int]:
    """vocab_size and the longest sequence of the model of `cfg`, without building it (a
    transformers config file is read; a missing one is a ConfigError naming the path)."""
    if cfg.model.family == "gpt":
        return {"vocab_size": cfg.model.vocab_size, "positions": cfg.data.seq_len}
    from frugaltrain.models.hf import hf_dims

    return hf_dims(cfg)


def memory_estimate(cfg: Config) -> dict[str, int]:
    """Bytes one process needs, estimated before anything is built (the model is built on the
    meta device, which allocates nothing).

    state_bytes: the parameters held in fp32 seven times (weights, gradients, two AdamW moments,
        outer parameters, outer momentum, pseudo-gradient), each sharded over the run.shards
        processes of a replica (FSDP2 shards the first four, the outer strategy works on shards).
    gathered_bytes: with shards, what FSDP2 holds unsharded at once: the root's parameters
        (embeddings, head, final norm) from forward to the end of backward and two blocks (one
        computing, one prefetched), each with its unsharded gradient before reduce-scatter.
    activation_bytes: one step's activations of the process's batch_size / shards sequences: per
        token, 68 d + 10 heads T bytes per block kept for backward (Korthikanti et al., 2022, in
        fp32), or with activation checkpointing 4 d per block plus one block recomputed, and the
        logits three times (values, softmax, gradient).
    process_bytes: the process itself, with torch (and transformers) imported, its data and
        runtime (measured 500-530 MiB for a tiny model on CPU)."""
    with torch.device("meta"):
        model = build_model(cfg)
    params = sum(p.numel() for p in model.parameters())
    m, d, shards = cfg.model, cfg.data, cfg.run.shards
    layers, width, heads = m.n_layer, m.n_embd, m.n_head
    if m.family == "hf":
        hf = model.hf.config
        layers, width = hf.num_hidden_layers, hf.hidden_size
        heads = hf.num_attention_heads
    vocab = model_dims(cfg)["vocab_size"]
    tokens = d.batch_size // shards * d.seq_len
    block = 68 * width + 10 * heads * d.seq_len
    kept = layers * 4 * width + block if cfg.run.activation_checkpointing else layers * block
    gathered = 0
    if shards > 1:
        named = model.named_parameters()
        in_blocks = sum(p.numel() for n, p in named if block_index(n) is not None)
        root = params - in_blocks
        gathered = 2 * 4 * (root + 2 * in_blocks // max(1, layers))
    return {
        "params": params,
        "state_bytes": -(-28 * params // shards),
        "gathered_bytes": gathered,
        "activation_bytes": tokens * (kept + 12 * vocab),
        "process_bytes": 500 << 20,
    }


def model_bytes(est: dict[str, int]) -> int:
    """Of a memory_estimate, what the model's run holds (states, FSDP2's gathered blocks and
    activations: on the GPU when there is one); the process's own bytes come on top."""
    return est["state_bytes"] + est["gathered_bytes"] + est["activation_bytes"]


def train_flops_per_token(model: torch.nn.Module, cfg: Config) -> float:
    """Analytic forward + backward FLOPs of one training token, matmuls only: 2 per weight of
    every linear layer (the LM head included) plus the attention scores QK^T and A.V (full s x s,
    4 s d per layer), times 3 (backward = input + weight gradients). Equals
    energy.transformer_train_flops for the built-in GPT; transformers models count their own
    layers (grouped-query attention and gated MLPs included)."""
    if cfg.model.family == "gpt":
        layers, width = cfg.model.n_layer, cfg.model.n_embd
    else:
        layers, width = model.hf.config.num_hidden_layers, model.hf.config.hidden_size
    # gpt2's Conv1D is a linear layer with its weight transposed.
    linear = sum(
        m.weight.numel()
        for m in model.modules()
        if isinstance(m, torch.nn.Linear) or type(m).__name__ == "Conv1D"
    )
    return 3.0 * (2 * linear + 4 * layers * cfg.data.seq_len * width)


def autocast(cfg: Config, device: torch.device) -> contextlib.AbstractContextManager:
    """Forward passes in run.dtype: bf16 autocast (CPU or GPU; the weights stay fp32), or as is."""
    if cfg.run.dtype == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Mean loss of `model` over `batches`, in eval mode (dropout off); restores the mode."""
    was_training = model.training
    model.eval()
    total = sum(model(x, y)[1].item() for x, y in batches) / len(batches)
    model.train(was_training)
    return total


__all__ = [
    "GPT",
    "GPTConfig",
    "autocast",
    "build_model",
    "evaluate",
    "memory_estimate",
    "model_dims",
    "train_flops_per_token",
]
