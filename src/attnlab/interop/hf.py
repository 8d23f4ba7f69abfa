"""Hugging Face Llama-family models in (Llama, Mistral, Qwen2): a loaded transformers model, or a model folder read
without transformers.

    cfg, model = from_hf_llama(LlamaForCausalLM.from_pretrained(...))    # a model already in memory
    cfg, model = load_hf_folder("path/to/folder")                          # config.json + *.safetensors

A folder holds config.json and the weights as model.safetensors, or as shards model-0000i-of-0000n.safetensors
listed in model.safetensors.index.json. Shards are read one at a time through safetensors' memory map and
each tensor is copied straight into the model, so two full copies of the weights are never held.

Every source (a transformers model, a folder, a GGUF file through interop.gguf) fills the model through one
table, `hf_targets`: Hugging Face parameter name -> the attnlab tensor it fills (q/k/v weights and biases are
slices of the fused qkv projection, gate/up slices of the fused SwiGLU input, the embeddings the first vocab_size
padded rows).
"""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from attnlab.attention.mha import MHAConfig
from attnlab.attention.sliding import SlidingConfig
from attnlab.config import ModelConfig, RopeScaling, head_counts
from attnlab.data.pretrained import regular_file
from attnlab.errors import AttnlabWarning, ConfigError, DataError, InputError, given
from attnlab.jsonio import DuplicateKey, loads_json
from attnlab.model.transformer import Transformer, build_model
from attnlab.ops.finite import all_finite

# config.json "architectures" entries attnlab maps, and those it knows but refuses (with the reason).
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
REFUSED_ARCHITECTURES: dict[str, str] = {}
MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
# transformers' class defaults for keys a config.json may leave out.
DEFAULTS = {
    "LlamaForCausalLM": {"max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "rope_theta": 10000.0},
    "MistralForCausalLM": {"max_position_embeddings": 4096 * 32, "rms_norm_eps": 1e-6, "rope_theta": 10000.0},
    "Qwen2ForCausalLM": {"max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
                         "max_window_layers": 28},
}  # fmt: skip
# RoPE scaling types (rope_type) attnlab applies; transformers' others (dynamic, yarn, longrope, ...) are refused.
ROPE_TYPES = ("default", "linear", "llama3")
LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
REQUIRED_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
EMBEDDING = "model.embed_tokens.weight"
# Buffers some checkpoints carry that attnlab recomputes.
RECOMPUTED_SUFFIXES = ("rotary_emb.inv_freq",)


def architecture_of(hf: dict, source: str) -> str:
    """The one supported architecture config.json names; ConfigError (one line) for any other."""
    given = hf.get("architectures")
    if given is not None and not (isinstance(given, list) and all(isinstance(name, str) for name in given)):
        example = json.dumps([given] if isinstance(given, str) else ["LlamaForCausalLM"])
        raise ConfigError(f"architectures={json.dumps(given)[:80]} must be a list of names: write \"architectures\": "
                          f"{example[:80]}", source=source)  # fmt: skip
    names = given or [MODEL_TYPES.get(hf.get("model_type"), str(hf.get("model_type")))]
    name = names[0] if len(names) == 1 else ", ".join(map(str, names))
    supported = ", ".join(SUPPORTED_ARCHITECTURES)
    if name in REFUSED_ARCHITECTURES:
        raise ConfigError(f"architecture {name} is not supported yet: {REFUSED_ARCHITECTURES[name]}", source=source)
    if name not in SUPPORTED_ARCHITECTURES:
        raise ConfigError(f"architecture {name} is not supported (supported: {supported})", source=source)
    model_type = hf.get("model_type")
    own = next(kind for kind, arch in MODEL_TYPES.items() if arch == name)
    if model_type is not None and model_type != own:  # transformers builds the model model_type names
        raise ConfigError(f"model_type={json.dumps(model_type)[:40]} and architectures={json.dumps(names)[:80]} "
                          f"disagree (transformers would build a {json.dumps(model_type)[:40]} model, attnlab a "
                          f"{name}): make model_type {own!r}, or use the model's own config.json",
                          source=source)  # fmt: skip
    return name


def rope_settings(hf: dict, default: float) -> tuple[float, RopeScaling | None, list[str]]:
    """(rope theta, scaling or None, problems). transformers 5 writes rope_parameters (rope_type, rope_theta and
    the scaling options together), older configs rope_theta + rope_scaling (rope_type, or type, and options)."""
    params, older = hf.get("rope_parameters") or {}, hf.get("rope_scaling") or {}
    if not isinstance(params, dict) or not isinstance(older, dict):
        return 10000.0, None, ["rope_parameters and rope_scaling must be JSON objects (or null)"]
    scaling = {**older, **params}  # the options, whichever spelling holds them
    rope_type = scaling.get("rope_type") or scaling.get("type") or "default"
    problems = []
    if params and older:  # both spellings: they must agree, or one would silently override the other
        kinds = [d.get("rope_type") or d.get("type") or "default" for d in (params, older)]
        clashes = [f"rope_type {kinds[0]!r} vs {kinds[1]!r}"] if kinds[0] != kinds[1] else []
        clashes += [
            f"{key} {params[key]!r} vs {older[key]!r}"
            for key in sorted(set(params) & set(older) - {"rope_type", "type"})
            if params[key] != older[key]
        ]
        if clashes:
            problems.append(
                f"rope_parameters and rope_scaling disagree ({'; '.join(clashes)}): keep one of them, or make "
                "them say the same"
            )
            return 10000.0, None, problems
    theta, top = params.get("rope_theta"), hf.get("rope_theta")  # (export.py writes both, for transformers 4 and 5)
    if theta is not None and (isinstance(theta, bool) or not isinstance(theta, int | float)):
        return 10000.0, None, [f"rope_parameters.rope_theta={json.dumps(theta)} must be a number"]
    # A NaN is no base (and equals nothing, not even another NaN): said as such, not as a disagreement
    bases = [f"{key}={json.dumps(value)} must be a finite number > 0 (the RoPE base, e.g. 10000.0)"
             for key, value in (("rope_theta", top), ("rope_parameters.rope_theta", theta))
             if isinstance(value, int | float) and not (math.isfinite(value) and value > 0)]  # fmt: skip
    if bases:
        return 10000.0, None, problems + bases
    if theta is not None:  # with rope_theta given too, the two must agree
        if top is not None and float(top) != float(theta):
            problems.append(
                f"rope_theta={top!r} and rope_parameters.rope_theta={theta!r} disagree (transformers silently "
                "takes rope_parameters'): keep one of them, or make them say the same"
            )
            return 10000.0, None, problems
    if rope_type not in ROPE_TYPES:
        problems.append(
            f"rope_type={rope_type!r} is not supported (attnlab applies plain RoPE and the linear and llama3 "
            "scalings, not dynamic, yarn, longrope or others)"
        )
    if params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) != 1.0:
        problems.append("partial_rotary_factor != 1 is not supported (attnlab rotates every channel of a head)")
    base = float(theta if theta is not None else top if top is not None else default)
    options = {"linear": ("factor",), "llama3": LLAMA3_KEYS}.get(rope_type, ()) if rope_type in ROPE_TYPES else ()
    missing = [key for key in options if scaling.get(key) is None]
    if missing:
        problems.append(f"rope_type={rope_type!r} needs {', '.join(missing)} (missing from the config)")
    if problems or not options or (rope_type == "linear" and scaling["factor"] == 1.0):
        return base, None, problems
    try:
        return base, RopeScaling(type=rope_type, **{key: scaling[key] for key in options}), problems
    except ConfigError as e:
        return base, None, problems + e.problems


def attention_window(hf: dict, arch: str) -> tuple[int | None, list[str]]:
    """(sliding window or None, problems). Mistral's sliding_window W (each token sees itself and the W - 1
    before it) holds for every layer. Qwen2 slides only when use_sliding_window, and then only layers from
    max_window_layers on (transformers' layer_types, which transformers 5 also writes out): all of them or none."""
    n_layers, first, types = hf.get("num_hidden_layers", 0), hf.get("max_window_layers"), hf.get("layer_types")
    window = hf.get("sliding_window")
    sliding_layers = isinstance(types, list) and "sliding_attention" in types
    used = arch == "MistralForCausalLM" or hf.get("use_sliding_window") or sliding_layers
    if used and window is not None and window < 1:  # 0 means zero, never "unset" (that is null)
        return None, [f"sliding_window={window} must be >= 1 or null (null: no window, full attention)"]
    if arch == "Qwen2ForCausalLM" and not types and hf.get("use_sliding_window") and hf.get("sliding_window"):
        if not isinstance(n_layers, int) or not isinstance(first, int):
            return None, [f"max_window_layers={first!r} and num_hidden_layers={n_layers!r} must be integers"]
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(n_layers)]
    if not isinstance(types or [], list):
        return None, [f"layer_types must be a list, got {type(types).__name__}"]
    kinds = set(map(str, types or ["full_attention"]))
    if kinds - {"full_attention", "sliding_attention"} or len(kinds) > 1:
        where = f" (max_window_layers={hf.get('max_window_layers')})" if arch == "Qwen2ForCausalLM" else ""
        return None, [f"layer_types {sorted(kinds)}{where} are not supported (every layer must attend alike)"]
    if arch == "MistralForCausalLM":
        return hf.get("sliding_window"), []
    if kinds == {"sliding_attention"}:
        if not hf.get("sliding_window"):
            return None, ["layer_types are sliding_attention but sliding_window is not set"]
        return hf["sliding_window"], []
    return None, []


# The config.json fields attnlab reads, by JSON type: a string "false" is not a boolean, "1e-5" not a number.
INTEGER_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "head_dim", "max_position_embeddings", "intermediate_size", "sliding_window",
                "max_window_layers")  # fmt: skip
NUMBER_KEYS = ("rms_norm_eps", "rope_theta")
BOOLEAN_KEYS = ("tie_word_embeddings", "attention_bias", "mlp_bias", "use_sliding_window")


def field_type_problems(hf: dict) -> list[str]:
    """One problem per config.json field attnlab reads whose JSON type is wrong (a null is an absent field)."""
    problems = []
    kinds = [(INTEGER_KEYS, "an integer", lambda v: isinstance(v, int) and not isinstance(v, bool)),
             (NUMBER_KEYS, "a number", lambda v: isinstance(v, int | float) and not isinstance(v, bool)),
             (BOOLEAN_KEYS, "true or false", lambda v: isinstance(v, bool))]  # fmt: skip
    for keys, what, fits in kinds:
        for key in keys:
            if hf.get(key) is not None and not fits(hf[key]):
                quoted = " (a JSON string: write the value without quotes)" if isinstance(hf[key], str) else ""
                problems.append(f"{key}={json.dumps(hf[key])} must be {what}{quoted}")
    if hf.get("hidden_act") is not None and not isinstance(hf["hidden_act"], str):
        problems.append(f"hidden_act={json.dumps(hf['hidden_act'])} must be a string")
    return problems


def quantization_problems(hf: dict) -> list[str]:
    """A quantization_config (GPTQ, AWQ, bitsandbytes, fp8, ...) is refused: attnlab implements none of them, and
    read as plain weights its tensors would be taken for a float model's (transformers would dequantize them, or
    quantize float weights on loading). An empty one says nothing (transformers ignores it too)."""
    quantization = hf.get("quantization_config")
    if quantization is None or quantization == {}:
        return []
    method = quantization.get("quant_method") if isinstance(quantization, dict) else None
    named = f"quant_method {json.dumps(method)[:40]}" if method is not None else json.dumps(quantization)[:60]
    return [
        f"quantization_config ({named}) is not supported: attnlab reads a model's float weights only (float32, "
        "float16 or bfloat16, as stored) and quantizes none on loading; use the model's unquantized weights"
    ]


def config_from_hf(hf: dict, source: str = "config.json", name: str | None = None) -> ModelConfig:
    """ModelConfig of a Hugging Face config.json (as a dict) for LlamaForCausalLM, MistralForCausalLM or
    Qwen2ForCausalLM.

    A sliding window for every layer (attention_window) becomes attention.kind `sliding` (`mha` when it covers
    max_position_embeddings: it hides nothing); Qwen2's biases on
    q/k/v become attention.qkv_bias; RoPE scaling linear or llama3 becomes rope_scaling. Everything attnlab
    cannot express (a bias on o_proj or the MLP, another activation, another RoPE scaling, per-layer attention,
    ...) is refused in one ConfigError listing every problem."""
    arch = architecture_of(hf, source)
    given = {k: v for k, v in hf.items() if v is not None}  # rope_settings tells a given rope_theta from a default
    hf = {**DEFAULTS[arch], **given}
    problems = [f"{key} is missing" for key in REQUIRED_KEYS if key not in hf]
    problems += field_type_problems(hf) + quantization_problems(hf)
    if problems:  # the checks below read these fields
        raise ConfigError(problems, source=source)
    if hf.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={hf['hidden_act']!r} is not supported (only SwiGLU with silu)")
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        problems.append(
            "attention_bias/mlp_bias=True is not supported (attnlab has biases on q/k/v only, as Qwen2; "
            "Llama's attention_bias puts one on o_proj too)"
        )
    base, scaling, rope_problems = rope_settings(given, DEFAULTS[arch]["rope_theta"])
    window, window_problems = attention_window(hf, arch)
    problems += rope_problems + window_problems
    n_heads, width = hf["num_attention_heads"], hf["hidden_size"]
    if hf.get("head_dim") is None and n_heads > 0 and width > 0 and width % n_heads:  # (transformers floors it)
        problems.append(f"num_attention_heads={n_heads} does not divide hidden_size={width} (without head_dim a head "
                        "is hidden_size / num_attention_heads wide; head counts that fit: "
                        f"{head_counts(width)}): fix num_attention_heads, or give head_dim")  # fmt: skip
    if problems:
        raise ConfigError(problems, source=source)
    head_dim = hf["hidden_size"] // n_heads if hf.get("head_dim") is None else hf["head_dim"]
    kv_heads = hf.get("num_key_value_heads")  # 0 is zero heads (refused by the attention's check), not "unset"
    heads = {"n_kv_heads": n_heads if kv_heads is None else kv_heads, "head_dim": head_dim,
             "qkv_bias": arch == "Qwen2ForCausalLM"}  # fmt: skip
    # A window covering the whole context hides nothing (tiny Mistral test models have 4096 over 512 positions):
    # transformers attends as full attention there, and so does attnlab's mha (a sliding one is refused as a no-op).
    sliding = window and window < hf["max_position_embeddings"]
    attention = SlidingConfig(window=window, **heads) if sliding else MHAConfig(**heads)
    try:
        return ModelConfig(
            vocab_size=hf["vocab_size"],
            d_model=hf["hidden_size"],
            n_layers=hf["num_hidden_layers"],
            n_heads=n_heads,
            max_seq_len=hf["max_position_embeddings"],
            attention=attention,
            mlp="swiglu",
            d_ff=hf["intermediate_size"],
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            rope_base=base,
            rope_scaling=scaling,
            norm_eps=float(hf["rms_norm_eps"]),
            name=name or hf.get("_name_or_path") or arch,
        )
    except ConfigError as e:
        raise e.with_source(source) from None


def config_from_hf_llama(hf_cfg) -> ModelConfig:
    """ModelConfig of a transformers LlamaConfig (or MistralConfig, Qwen2Config) object."""
    return config_from_hf(hf_cfg.to_dict(), source="from_hf_llama")


# ----------------------------------------------------------------------------- weights


def hf_targets(model: Transformer) -> dict[str, torch.Tensor]:
    """Hugging Face Llama parameter name -> the attnlab tensor (a view of a parameter) that holds it.

    q, k, v are row slices of the fused `qkv` projection (in that order; its bias too with attention.qkv_bias),
    gate and up of the SwiGLU's fused `gate_up`; the embedding and an untied LM head fill their first vocab_size
    (unpadded) rows."""
    cfg, vocab = model.cfg, model.cfg.vocab_size
    out = {EMBEDDING: model.embed.weight[:vocab], "model.norm.weight": model.norm.weight}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = model.lm_head.weight[:vocab]
    for i, block in enumerate(model.blocks):
        attn, mlp, p = block.attn, block.mlp, f"model.layers.{i}."
        q_rows, kv_rows = attn.n_heads * attn.head_dim, attn.n_kv_heads * attn.head_dim
        q, k, v = attn.qkv.weight.split((q_rows, kv_rows, kv_rows))  # (rows, d_model) each
        gate, up = mlp.gate_up.weight.split(mlp.hidden_dim)  # (hidden_dim, d_model) each
        out.update({
            p + "input_layernorm.weight": block.attn_norm.weight,
            p + "self_attn.q_proj.weight": q,
            p + "self_attn.k_proj.weight": k,
            p + "self_attn.v_proj.weight": v,
            p + "self_attn.o_proj.weight": attn.out.weight,
            p + "post_attention_layernorm.weight": block.mlp_norm.weight,
            p + "mlp.gate_proj.weight": gate,
            p + "mlp.up_proj.weight": up,
            p + "mlp.down_proj.weight": mlp.down.weight,
        })  # fmt: skip
        if attn.qkv.bias is not None:
            q, k, v = attn.qkv.bias.split((q_rows, kv_rows, kv_rows))
            out.update({p + "self_attn.q_proj.bias": q, p + "self_attn.k_proj.bias": k, p + "self_attn.v_proj.bias": v})
    return out


class WeightFiller:
    """Copies named Hugging Face tensors into a model, one at a time, checking names and shapes.

    `fill(name, tensor)` for each tensor in any order, then `finish()`, which raises DataError if a tensor
    the model needs never came. The padded rows of the embedding and LM head are zeroed."""

    def __init__(self, model: Transformer, source: str):
        self.model, self.source = model, source
        self.targets = hf_targets(model)
        self.missing = set(self.targets)
        self.tied_head: tuple[torch.Tensor, str] | None = None  # a tied model's stored LM head, until compared
        with torch.no_grad():
            model.embed.weight.zero_()
            model.lm_head.weight.zero_()

    def check(self, name: str, shape: tuple, dtype: str, floating: bool, where: str | None = None) -> bool:
        """DataError when tensor `name` (of this shape and dtype, as a safetensors header gives them) cannot fill
        the model: a name the model has no place for, integer weights, another shape. False for a tensor that is
        skipped (recomputed buffers; a tied checkpoint's stored LM head), True for one the model takes."""
        where = where or self.source
        target = self.targets.get(name)
        if target is None:
            if name.endswith(RECOMPUTED_SUFFIXES) or (name == "lm_head.weight" and self.model.cfg.tie_embeddings):
                return False  # recomputed buffers; a tied checkpoint that also stores its LM head
            raise DataError(f"{where}: unexpected tensor {name!r} (the weights do not match the model's config)")
        if not floating:  # copy_ would cast int8 codes to floats without their scales
            raise DataError(
                f"{where}: tensor {name!r} is {dtype}, not floating point: a "
                "quantized checkpoint's integer weights (GPTQ, AWQ, bitsandbytes...) are not supported; use the "
                "model's float32, float16 or bfloat16 weights"
            )
        if tuple(shape) != tuple(target.shape):
            raise DataError(f"{where}: tensor {name!r} has shape {tuple(shape)}, the config implies "
                            f"{tuple(target.shape)}")  # fmt: skip
        return True

    @torch.no_grad()
    def fill(self, name: str, tensor: torch.Tensor, where: str | None = None) -> None:
        where = where or self.source
        dtype = str(tensor.dtype).removeprefix("torch.")
        if not self.check(name, tuple(tensor.shape), dtype, tensor.is_floating_point(), where):
            if name == "lm_head.weight":  # (tie_embeddings): compared with the embedding, once that is filled
                self.tied_head = (tensor, where)
                self._compare_tied_head()
            return
        target = self.targets[name]
        target.copy_(tensor)
        # A NaN or inf weight makes every output NaN without a word: a damaged file or a diverged model is refused
        # here.
        if not all_finite(target):
            raise DataError(nonfinite_line(where, name, tensor, target.dtype))
        self.missing.discard(name)
        if name == EMBEDDING:
            self._compare_tied_head()

    def _compare_tied_head(self) -> None:
        """A model whose config ties the LM head to the embedding (tie_word_embeddings) reads no lm_head.weight: one
        the files also hold is only compared with the embedding, and an AttnlabWarning says when it differs (it is
        then ignored, where a reader might expect it used)."""
        if self.tied_head is None or EMBEDDING in self.missing:
            return
        (head, where), self.tied_head = self.tied_head, None
        embedding = self.targets[EMBEDDING]
        if head.shape != embedding.shape or not torch.equal(head.to(embedding.dtype), embedding):
            warnings.warn(f"{where}: lm_head.weight differs from the embedding ({EMBEDDING}) and is ignored: "
                          "config.json's tie_word_embeddings is true, so the embedding is the output layer too "
                          "(transformers 5 unties them when the two differ, and uses lm_head.weight); set "
                          "tie_word_embeddings to false to use lm_head.weight, or remove it", AttnlabWarning,
                          stacklevel=3)  # fmt: skip

    def placed(self, name: str) -> None:
        """Counts tensor `name` as filled: the caller placed it in the model itself (a quantized layer's blocks)."""
        self.missing.discard(name)

    def finish(self) -> Transformer:
        if self.missing:
            names = sorted(self.missing)
            more = f" and {len(names) - 3} more" if len(names) > 3 else ""
            raise DataError(f"{self.source}: missing tensor(s) {', '.join(names[:3])}{more}")
        return self.model.eval()


def nonfinite_line(where: str, name: str, tensor: torch.Tensor, dtype: torch.dtype) -> str:
    """Why tensor `name` holds NaN or infinite values once loaded in `dtype`: stored so, or too large for dtype."""
    stored = tensor.float()
    bad = int((~torch.isfinite(stored)).sum())
    if not bad:
        kind = str(dtype).removeprefix("torch.")
        return f"{where}: tensor {name!r} has values too large for {kind} (load the model in float32)"
    return (f"{where}: tensor {name!r} holds {bad:,} NaN or infinite values (of {stored.numel():,}): the weights are "
            "damaged (a corrupt file, or a model whose training diverged) and cannot be used")  # fmt: skip


def fillable_model(cfg: ModelConfig, dtype=None) -> Transformer:
    """A model of `cfg` for a WeightFiller to fill: built without its random init (build_model init=False) when its
    Hugging Face names cover every parameter, as they do a pretrained model's; else initialised as usual, so that a
    parameter no file fills never holds whatever memory held."""
    model = build_model(cfg, dtype=dtype, init=False)
    covered = {t.untyped_storage().data_ptr() for t in hf_targets(model).values()}
    if all(p.untyped_storage().data_ptr() in covered for p in model.parameters()):
        return model
    return build_model(cfg, dtype=dtype)


def fill_model(cfg: ModelConfig, tensors: Iterable[tuple[str, torch.Tensor]], source: str, dtype=None) -> Transformer:
    """A model of `cfg` (in dtype, default fp32) holding the named Hugging Face tensors."""
    filler = WeightFiller(fillable_model(cfg, dtype=dtype), source)
    for name, tensor in tensors:
        filler.fill(name, tensor)
    return filler.finish()


@torch.no_grad()
def from_hf_llama(hf_model, dtype=torch.float32) -> tuple[ModelConfig, Transformer]:
    """(config, model) with the weights of a transformers `LlamaForCausalLM` (or Mistral, Qwen2), in `dtype`."""
    if not callable(getattr(getattr(hf_model, "config", None), "to_dict", None)) or not callable(
            getattr(hf_model, "state_dict", None)):  # fmt: skip
        raise InputError(f"from_hf_llama takes a transformers model (e.g. LlamaForCausalLM.from_pretrained(...)), got "
                         f"{given(hf_model)} (a folder or Hub name: attnlab.load_model(ref) reads it)")  # fmt: skip
    cfg = config_from_hf(hf_model.config.to_dict(), source="from_hf_llama")
    return cfg, fill_model(cfg, hf_model.state_dict().items(), "from_hf_llama", dtype)


# ----------------------------------------------------------------------------- folders


def read_json(path: Path) -> dict:
    """A JSON object from `path`; DataError (one line naming the file) when it is missing or malformed, gives a key
    twice (naming the key and both values), or is not a regular file (a FIFO would block the read forever)."""
    if not regular_file(path):
        raise DataError(f"{path}: not found")
    try:
        data = loads_json(path.read_text(encoding="utf-8"), unique_keys=True)
    except DuplicateKey as e:  # (json.loads, and transformers, would keep the last value silently)
        raise DataError(f"{path}: {e}") from None
    except FileNotFoundError:
        raise DataError(f"{path}: not found") from None
    except PermissionError:  # not a damaged file: the OS's error names it
        raise
    except json.JSONDecodeError as e:
        raise DataError(f"{path}: not valid JSON ({e}); is it damaged or cut short?") from None
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: unreadable JSON ({e})") from None
    if not isinstance(data, dict):
        raise DataError(f"{path}: not a JSON object (got a JSON {type(data).__name__}); it must hold an object {{...}}")
    return data


def is_hf_folder(folder: Path) -> bool:
    """Whether `folder` looks like a Hugging Face model folder (its config.json names an architecture)."""
    try:
        config = read_json(Path(folder) / "config.json")
    except DataError:
        return False
    return "architectures" in config or "model_type" in config


def safetensors_files(folder: Path) -> list[Path]:
    """The weight files of a folder: model.safetensors, else the shards model.safetensors.index.json lists (each
    checked to exist). With both, model.safetensors is read, as transformers' from_pretrained does (it looks for
    model.safetensors first), and an AttnlabWarning says that the shards are not."""
    index, single = folder / "model.safetensors.index.json", folder / "model.safetensors"
    if regular_file(single):
        try:  # transformers never reads the index then: nor is a damaged one refused here
            only_single = not regular_file(index) or _index_shards(index, folder) == [single]
        except DataError:
            only_single = False
        if not only_single:
            warnings.warn(f"{folder}: holds model.safetensors and also the shards {index.name} lists: "
                          "model.safetensors is read (as transformers does) and the shards are not; remove the "
                          "ones that are not this model's", AttnlabWarning, stacklevel=3)  # fmt: skip
        return [single]
    if regular_file(index):
        return _index_shards(index, folder)
    pickled = [p.name for p in folder.glob("*.bin")] + [p.name for p in folder.glob("*.pt")]
    hint = f" ({', '.join(pickled)} are pickle files, never loaded: convert them to safetensors)" if pickled else ""
    raise DataError(f"{folder}: no model.safetensors or model.safetensors.index.json{hint}")


def _index_shards(index: Path, folder: Path) -> list[Path]:
    """The shard files an index's weight_map names, each checked to be a file in the folder."""
    weight_map = read_json(index).get("weight_map")
    if weight_map is None:
        raise DataError(f"{index}: no weight_map in it")
    if not isinstance(weight_map, dict):
        raise DataError(f"{index}: weight_map={json.dumps(weight_map)[:80]} must be a JSON object of tensor name -> "
                        "shard file (such as {\"model.norm.weight\": \"model-00001-of-00002.safetensors\"}); the "
                        "index is damaged")  # fmt: skip
    if not weight_map:
        raise DataError(f"{index}: weight_map={{}} names no tensor (the index is damaged)")
    for name, file in weight_map.items():
        if not isinstance(file, str) or not file or Path(file).name != file:
            raise DataError(f"{index}: weight_map[{name!r}]={json.dumps(file)} must be the name of a shard file in "
                            "the folder (a string such as \"model-00001-of-00002.safetensors\"); the index is "
                            "damaged")  # fmt: skip
    shards = [folder / name for name in sorted(set(weight_map.values()))]
    for shard in shards:
        if not regular_file(shard):
            raise DataError(f"{shard}: not found (named in {index.name})")
    return shards


def safetensors_tensors(files: list[Path]) -> Iterable[tuple[str, torch.Tensor, str]]:
    """(name, tensor, file) for every tensor, one file open at a time (memory-mapped by safetensors)."""
    for path in files:
        open(path, "rb").close()  # an unreadable file: the PermissionError naming it (safetensors says "not found")
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name), str(path)
        except (SafetensorError, OSError) as e:
            raise DataError(f"{path}: unreadable safetensors file ({e}); is it truncated?") from None


def check_hf_weights(folder: str | Path, cfg: ModelConfig) -> None:
    """The checks load_hf_folder makes of a folder's weights, from the safetensors headers alone (no tensor data is
    read): the weight files there (model.safetensors, else every shard the index names), each file whole (its
    header's sizes add up to the file's), and every tensor's name, dtype and shape against the model `cfg` builds,
    none missing. DataError naming the file and tensor, as loading says it. (NaN weights are found by loading.)"""
    folder = Path(folder)
    with torch.device("meta"):  # shapes alone: no memory for the weights
        filler = WeightFiller(build_model(cfg, init=False), str(folder))
    for path in safetensors_files(folder):
        open(path, "rb").close()  # an unreadable file: the PermissionError naming it (safetensors says "not found")
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    piece = f.get_slice(name)
                    dtype = piece.get_dtype()
                    if filler.check(name, tuple(piece.get_shape()), dtype, dtype.startswith(("F", "BF")), str(path)):
                        filler.placed(name)
        except (SafetensorError, OSError) as e:
            raise DataError(f"{path}: unreadable safetensors file ({e}); is it truncated?") from None
    filler.finish()


@torch.no_grad()
def load_hf_folder(folder: str | Path, dtype=torch.float32, name: str | None = None) -> tuple[ModelConfig, Transformer]:
    """(config, model) from a Hugging Face model folder, read without transformers, in `dtype`."""
    folder = Path(folder)
    config_path = folder / "config.json"
    cfg = config_from_hf(read_json(config_path), source=str(config_path), name=name or folder.name)
    files = safetensors_files(folder)
    filler = WeightFiller(fillable_model(cfg, dtype=dtype), str(folder))
    for tensor_name, tensor, path in safetensors_tensors(files):
        filler.fill(tensor_name, tensor, where=path)
    return cfg, filler.finish()
