"""transformers causal LMs behind the built-in GPT's interface: `model(idx, targets)` returns
(logits, mean next-token loss), so every strategy, FORGE, the simulator and the metrics use them
unchanged.

    family = llama | qwen2 | gpt2   built with AutoModelForCausalLM.from_config from the size keys
    family = hf                     from model.config_json (random init) or model.pretrained (a
                                    local directory with config.json and safetensors weights)

Nothing is downloaded: configs are built here or read from local files, and a pretrained model
is loaded with local_files_only. Parameter names keep the transformers module tree under `hf.`
(hf.model.embed_tokens, hf.model.layers.N, hf.lm_head; hf.transformer.wte/h.N/ln_f for gpt2), which
models/parts.py maps onto embed, blocks and head.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from frugaltrain.config import Config, ConfigError, ModelSection

_MISSING = "the transformers models need the hf extra: pip install 'frugaltrain[hf]'"


def _transformers():
    try:
        import transformers
    except ImportError as e:
        raise ImportError(_MISSING) from e
    return transformers


class HFCausalLM(nn.Module):
    """A transformers causal LM with the built-in GPT's forward signature."""

    def __init__(self, hf: nn.Module) -> None:
        super().__init__()
        self.hf = hf

    def forward(
        self, idx_BT: torch.Tensor, targets_BT: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        logits_BTV = self.hf(input_ids=idx_BT, use_cache=False).logits
        loss = None
        if targets_BT is not None:
            loss = F.cross_entropy(logits_BTV.flatten(0, 1).float(), targets_BT.flatten())
        return logits_BTV, loss

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


def intermediate_size(m: ModelSection) -> int:
    """The MLP width: model.intermediate_size, or the family's default."""
    if m.intermediate_size:
        return m.intermediate_size
    if m.family == "gpt2":
        return 4 * m.n_embd
    return -(-8 * m.n_embd // 3 // 32) * 32  # Llama's 8/3 d, rounded up to a multiple of 32


def hf_config(cfg: Config):
    """The transformers config of `cfg`: from the size keys, or read from a local file."""
    m, seq_len = cfg.model, cfg.data.seq_len
    tf = _transformers()
    if m.family == "hf":
        return tf.AutoConfig.from_pretrained(_config_file(m), local_files_only=True)
    common = {"vocab_size": m.vocab_size, "tie_word_embeddings": m.tie_embeddings}
    if m.family == "gpt2":
        drop = {"resid_pdrop": m.dropout, "embd_pdrop": m.dropout, "attn_pdrop": m.dropout}
        return tf.GPT2Config(
            n_embd=m.n_embd,
            n_layer=m.n_layer,
            n_head=m.n_head,
            n_inner=intermediate_size(m),
            n_positions=seq_len,
            bos_token_id=None,  # GPT-2's 50256 is outside a small vocabulary
            eos_token_id=None,
            **drop,
            **common,
        )
    cls = {"llama": tf.LlamaConfig, "qwen2": tf.Qwen2Config}[m.family]
    extra = {"attention_bias": m.bias, "mlp_bias": m.bias} if m.family == "llama" else {}
    return cls(
        hidden_size=m.n_embd,
        num_hidden_layers=m.n_layer,
        num_attention_heads=m.n_head,
        num_key_value_heads=m.n_kv_head or m.n_head,
        intermediate_size=intermediate_size(m),
        max_position_embeddings=seq_len,
        attention_dropout=m.dropout,
        **extra,
        **common,
    )


def build_hf(cfg: Config) -> HFCausalLM:
    """The transformers model of `cfg` (random init from run.seed, or pretrained weights)."""
    tf = _transformers()
    m = cfg.model
    if m.pretrained:
        _config_file(m)  # a clear error for a missing directory, before transformers looks
        hf = tf.AutoModelForCausalLM.from_pretrained(
            m.pretrained, local_files_only=True, dtype=torch.float32
        )
    else:
        config = hf_config(cfg)
        try:
            hf = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        except ValueError as e:  # an architecture with no causal LM head
            raise ConfigError(
                f"model.config_json = {m.config_json!r}: transformers has no causal LM for "
                f"model_type {config.model_type!r} ({str(e).splitlines()[0][:80]}); use a "
                "decoder-only architecture such as llama, qwen2 or gpt2"
            ) from None
    return HFCausalLM(hf)


def hf_dims(cfg: Config) -> dict[str, int]:
    """vocab_size and the longest sequence of the model of `cfg`, without building it."""
    m = cfg.model
    if m.family != "hf":
        return {"vocab_size": m.vocab_size, "positions": cfg.data.seq_len}
    config = json.loads(_config_file(m).read_text())
    positions = config.get("max_position_embeddings") or config.get("n_positions") or 0
    return {"vocab_size": int(config.get("vocab_size", 0)), "positions": int(positions)}


def _config_file(m: ModelSection) -> Path:
    """The config.json of model.pretrained or model.config_json; a ConfigError if missing."""
    if m.pretrained:
        root = Path(m.pretrained).expanduser()
        key, path = "model.pretrained", root / "config.json"
        fix = "give a local transformers model directory (config.json and *.safetensors)"
    else:
        key, path = "model.config_json", Path(m.config_json).expanduser()
        fix = "give the path of a transformers config.json"
    if not path.is_file():
        value = m.pretrained or m.config_json
        raise ConfigError(f"{key} = {value!r}: {path} not found; {fix}")
    return path
