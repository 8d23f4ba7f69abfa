"""Import weights from Hugging Face transformers' Llama (no download: pass a loaded model)."""

from __future__ import annotations

import torch

from attnlab.attention.mha import MHAConfig
from attnlab.config import ModelConfig
from attnlab.errors import ConfigError
from attnlab.model.transformer import Transformer, build_model


def _rope_theta(hf_cfg) -> float:
    params = getattr(hf_cfg, "rope_parameters", None) or {}
    scaling = getattr(hf_cfg, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", scaling.get("rope_type", "default"))
    if rope_type not in ("default", None):
        raise ConfigError(f"rope_type={rope_type!r} is not supported by from_hf_llama (only default RoPE)")
    return float(params.get("rope_theta", getattr(hf_cfg, "rope_theta", 10000.0)))


def config_from_hf_llama(hf_cfg) -> ModelConfig:
    problems = []
    if getattr(hf_cfg, "hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={hf_cfg.hidden_act!r} (only SwiGLU with silu is supported)")
    if getattr(hf_cfg, "attention_bias", False) or getattr(hf_cfg, "mlp_bias", False):
        problems.append("attention_bias/mlp_bias=True (attnlab's projections have no bias)")
    if problems:
        raise ConfigError(problems, source="from_hf_llama")
    n_heads = hf_cfg.num_attention_heads
    head_dim = getattr(hf_cfg, "head_dim", None) or hf_cfg.hidden_size // n_heads
    return ModelConfig(
        vocab_size=hf_cfg.vocab_size,
        d_model=hf_cfg.hidden_size,
        n_layers=hf_cfg.num_hidden_layers,
        n_heads=n_heads,
        max_seq_len=hf_cfg.max_position_embeddings,
        attention=MHAConfig(n_kv_heads=hf_cfg.num_key_value_heads or n_heads, head_dim=head_dim),
        mlp="swiglu",
        d_ff=hf_cfg.intermediate_size,
        tie_embeddings=bool(getattr(hf_cfg, "tie_word_embeddings", False)),
        rope_base=_rope_theta(hf_cfg),
        norm_eps=hf_cfg.rms_norm_eps,
        name=getattr(hf_cfg, "name_or_path", "") or "hf-llama",
    )


@torch.no_grad()
def from_hf_llama(hf_model) -> tuple[ModelConfig, Transformer]:
    """(config, model) with the weights of a transformers `LlamaForCausalLM`, in fp32."""
    cfg = config_from_hf_llama(hf_model.config)
    model = build_model(cfg)
    src = {k: v.float() for k, v in hf_model.state_dict().items()}
    vocab = cfg.vocab_size
    model.embed.weight.zero_()
    model.embed.weight[:vocab] = src["model.embed_tokens.weight"]
    for i, block in enumerate(model.blocks):
        p = f"model.layers.{i}."
        block.attn_norm.weight.copy_(src[p + "input_layernorm.weight"])
        block.mlp_norm.weight.copy_(src[p + "post_attention_layernorm.weight"])
        qkv = [src[p + f"self_attn.{n}_proj.weight"] for n in "qkv"]
        block.attn.qkv.weight.copy_(torch.cat(qkv))
        block.attn.out.weight.copy_(src[p + "self_attn.o_proj.weight"])
        block.mlp.gate_up.weight.copy_(torch.cat((src[p + "mlp.gate_proj.weight"], src[p + "mlp.up_proj.weight"])))
        block.mlp.down.weight.copy_(src[p + "mlp.down_proj.weight"])
    model.norm.weight.copy_(src["model.norm.weight"])
    if not cfg.tie_embeddings:
        model.lm_head.weight.zero_()
        model.lm_head.weight[:vocab] = src["lm_head.weight"]
    return cfg, model.eval()
