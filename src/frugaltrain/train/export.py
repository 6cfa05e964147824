"""`frugaltrain export RUN_DIR --out DIR`: the run's final model in the transformers format.

The exported model is the average of the workers' parameters at the run's last complete
checkpoint (what DiLoCo-family methods converge to; for DiLoCo and DDP every worker already holds
it). A transformers model is saved with `save_pretrained` (safetensors); the built-in GPT is
converted to a GPT-2 model with the same arithmetic (`to_gpt2`). The tokenizer goes with it: the
token shards' own, a pretrained directory's own, or the byte tokenizer for byte-level corpora.
Afterwards anyone can run `AutoModelForCausalLM.from_pretrained(DIR)` and `generate`.
"""

from __future__ import annotations

from pathlib import Path

import torch

from frugaltrain.config import Config, ConfigError, load_config
from frugaltrain.models import build_model
from frugaltrain.models.gpt import GPT
from frugaltrain.train import checkpoint


def export(run_dir: str | Path, out_dir: str | Path) -> Path:
    """Write the averaged final model of `run_dir` and its tokenizer to `out_dir`."""
    run_dir, out = Path(run_dir), Path(out_dir)
    cfg = _run_config(run_dir)
    ckpt = checkpoint.latest_complete(run_dir)
    if ckpt is None:
        raise ConfigError(f"export {run_dir}: no complete checkpoint under {run_dir}/checkpoints")
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"--out {out}: not empty; give a new directory")
    model = build_model(cfg)
    model.load_state_dict(averaged_state(ckpt, cfg))
    hf = model.hf if cfg.model.family != "gpt" else to_gpt2(model)
    tokenizer = _tokenizer(cfg)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        hf.config.eos_token_id = hf.generation_config.eos_token_id = tokenizer.eos_token_id
    hf.save_pretrained(out, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    return out


def averaged_state(ckpt_dir: Path, cfg: Config) -> dict[str, torch.Tensor]:
    """The mean over workers of every model tensor (accumulated in fp64, in rank order)."""
    states = [checkpoint.load_worker(ckpt_dir, r, cfg)["model"] for r in range(cfg.run.workers)]
    return {
        k: (sum(s[k].double() for s in states) / len(states)).to(states[0][k].dtype)
        for k in states[0]
    }


@torch.no_grad()
def to_gpt2(model: GPT):
    """The built-in GPT as a transformers GPT2LMHeadModel with the same arithmetic: fused qkv
    and the MLP in the same order, exact GELU, LayerNorm eps 1e-5, biases zero when the GPT has
    none; Conv1D weights are the transposed Linear weights."""
    from frugaltrain.models.hf import _transformers

    tf = _transformers()
    c = model.cfg
    config = tf.GPT2Config(
        vocab_size=c.vocab_size,
        n_positions=c.block_size,
        n_embd=c.n_embd,
        n_layer=c.n_layer,
        n_head=c.n_head,
        n_inner=4 * c.n_embd,
        activation_function="gelu",
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        layer_norm_epsilon=model.ln_f.eps,
        tie_word_embeddings=c.tie_embeddings,
        bos_token_id=None,
        eos_token_id=None,
    )
    gpt2 = tf.GPT2LMHeadModel(config).float().eval()
    sd = gpt2.state_dict()
    for name, tensor in _gpt2_names(model).items():
        sd[name].copy_(tensor)
    gpt2.load_state_dict(sd)
    return gpt2


def _gpt2_names(model: GPT) -> dict[str, torch.Tensor]:
    """GPT2LMHeadModel state-dict names -> the GPT's tensors (zeros for absent biases)."""

    def bias_of(module, size):
        return module.bias if module.bias is not None else torch.zeros(size)

    d = model.cfg.n_embd
    out = {
        "transformer.wte.weight": model.wte.weight,
        "transformer.wpe.weight": model.wpe.weight,
        "transformer.ln_f.weight": model.ln_f.weight,
        "transformer.ln_f.bias": bias_of(model.ln_f, d),
        "lm_head.weight": model.head.weight,
    }
    pairs = {"ln_1": "ln1", "ln_2": "ln2"}
    linears = {"attn.c_attn": "attn.qkv", "attn.c_proj": "attn.proj"}
    linears |= {"mlp.c_fc": "mlp.fc", "mlp.c_proj": "mlp.proj"}
    for i, block in enumerate(model.blocks):
        for theirs, ours in pairs.items():
            norm = getattr(block, ours)
            out[f"transformer.h.{i}.{theirs}.weight"] = norm.weight
            out[f"transformer.h.{i}.{theirs}.bias"] = bias_of(norm, d)
        for theirs, ours in linears.items():
            linear = block.get_submodule(ours)
            out[f"transformer.h.{i}.{theirs}.weight"] = linear.weight.t()
            out[f"transformer.h.{i}.{theirs}.bias"] = bias_of(linear, linear.out_features)
    return out


def _tokenizer(cfg: Config):
    """The run's tokenizer: the token shards' own, the pretrained directory's own, or the byte
    tokenizer (id b is byte b) for byte-level corpora."""
    from frugaltrain.data.corpus import load_corpus
    from frugaltrain.data.tokenizer import byte_tokenizer, load_tokenizer

    d = cfg.data
    corpus = load_corpus(d.path, d.max_bytes, d.val_fraction, verify=False)
    if getattr(corpus, "tokenizer_dir", None):
        return load_tokenizer(corpus.tokenizer_dir)
    if cfg.model.pretrained and (Path(cfg.model.pretrained) / "tokenizer.json").is_file():
        return load_tokenizer(cfg.model.pretrained)
    return byte_tokenizer()


def _run_config(run_dir: Path) -> Config:
    saved = run_dir / "config.toml"
    if not saved.is_file():
        raise ConfigError(f"export {run_dir}: no config.toml there; pass a run directory")
    return load_config(saved)
