"""transformers modules for FlowTrain: a ViT or SigLIP vision tower (producer) and a Llama
causal LM behind a projector (consumer).

Each is built from a small config made of the model.* size keys (random init from the run
seed) or loaded from a local directory (model.encoder_pretrained, model.backbone_pretrained);
nothing is downloaded. The tower takes images of any side that is a multiple of its patch size
(`interpolate_pos_encoding`), so visual token counts vary per image.

The consumer packs a micro-batch's samples into one row and gives the language model position
ids that restart at 0 for each sample and no attention mask: transformers reads that as packed
sequences and builds the block-diagonal causal mask itself (as padding-free training does), so a
packed micro-batch computes what its samples would compute one by one.

Legend: B images of one encoder call, N visual tokens, T packed tokens, Dv tower width, D
backbone width, V vocabulary.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from frugaltrain.config import ConfigError
from frugaltrain.data.sources import require_hf
from frugaltrain.flow.consumer_input import pack_samples, projector


def require(module: str) -> ModuleType:
    """Import a module of the flow extra (transformers, datasets, PIL), or say how to get it."""
    return require_hf(module, user="FlowTrain's transformers modules and image data", extra="flow")


class VisionTower(nn.Module):
    """Producer: pixel_values [B, 3, H, W] -> the tower's last hidden states [B, N, Dv]."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, pixels_B3HW: torch.Tensor) -> torch.Tensor:
        out = self.model(pixel_values=pixels_B3HW, interpolate_pos_encoding=True)
        return out.last_hidden_state


class LlamaConsumer(nn.Module):
    """Projector + transformers causal LM: packed [visual | text] samples -> summed caption loss."""

    def __init__(self, project: nn.Module, lm: nn.Module) -> None:
        super().__init__()
        self.projector, self.lm = project, lm

    def loss_sum(self, embs: list[torch.Tensor], texts: list[torch.Tensor]) -> torch.Tensor:
        """Sum of caption cross-entropies of the samples packed, in order, into one sequence."""
        x_TD, pos_T, _, tgt_T = pack_samples(
            embs, texts, self.projector, self.lm.get_input_embeddings()
        )
        # No attention mask: with restarting position ids transformers masks per sample.
        out = self.lm(inputs_embeds=x_TD[None], position_ids=pos_T[None], use_cache=False)
        return F.cross_entropy(out.logits[0], tgt_T, reduction="sum")


def vision_tower(cfg) -> VisionTower:
    """ViTModel or SiglipVisionModel (model.encoder) without pooling head, from the size keys
    or model.encoder_pretrained; its patch size must be data.patch."""
    tf = require("transformers")
    m = cfg.model
    vit = m.encoder == "vit"
    if m.encoder_pretrained:
        pretrained_config(m.encoder_pretrained, "model.encoder_pretrained")
        cls = tf.ViTModel if vit else tf.SiglipVisionModel
        kw = {"add_pooling_layer": False} if vit else {}
        model = cls.from_pretrained(m.encoder_pretrained, local_files_only=True, **kw)
    else:
        size = dict(
            hidden_size=m.enc_dim,
            num_hidden_layers=m.enc_layers,
            num_attention_heads=m.enc_heads,
            intermediate_size=4 * m.enc_dim,
            image_size=max(cfg.data.image_sides),
            patch_size=cfg.data.patch,
            num_channels=3,
        )
        if vit:
            model = tf.ViTModel(tf.ViTConfig(**size), add_pooling_layer=False)
        else:
            model = tf.SiglipVisionModel(tf.SiglipVisionConfig(**size, vision_use_head=False))
    if model.config.patch_size != cfg.data.patch:
        raise ConfigError(
            f"data.patch = {cfg.data.patch}: the vision tower's patch_size is "
            f"{model.config.patch_size}; set data.patch to it"
        )
    return VisionTower(model)


def llama_consumer(cfg, ds, enc_dim: int) -> LlamaConsumer:
    """A projector and a LlamaForCausalLM, from the size keys or model.backbone_pretrained; its
    vocabulary must cover the dataset's token ids."""
    tf = require("transformers")
    m = cfg.model
    if m.backbone_pretrained:
        pretrained_config(m.backbone_pretrained, "model.backbone_pretrained")
        lm = tf.LlamaForCausalLM.from_pretrained(m.backbone_pretrained, local_files_only=True)
    else:
        config = tf.LlamaConfig(
            hidden_size=m.lm_dim,
            num_hidden_layers=m.lm_layers,
            num_attention_heads=m.lm_heads,
            num_key_value_heads=m.lm_kv_heads or m.lm_heads,
            intermediate_size=4 * m.lm_dim,
            vocab_size=ds.vocab_size,
            max_position_embeddings=cfg.slot_tokens + ds.max_text_tokens,
            tie_word_embeddings=False,
        )
        lm = tf.LlamaForCausalLM(config)
    if lm.config.vocab_size < ds.vocab_size:
        raise ConfigError(
            f"model.backbone_pretrained = {m.backbone_pretrained!r}: its vocabulary has "
            f"{lm.config.vocab_size} ids, the tokenizer needs {ds.vocab_size}; use a matching "
            "data.tokenizer"
        )
    return LlamaConsumer(projector(enc_dim, lm.config.hidden_size), lm)


def pretrained_config(path: str, key: str) -> dict:
    """The config.json of a local model directory; a ConfigError naming `key` if missing."""
    file = Path(path).expanduser() / "config.json"
    if not file.is_file():
        raise ConfigError(
            f"{key} = {path!r}: {file} not found; give a local transformers model directory "
            "(config.json and *.safetensors)"
        )
    return json.loads(file.read_text())
