"""Pretrained architectures beyond plain Llama: Qwen2 (biases on q/k/v: attention.qkv_bias) and scaled RoPE
(rope_scaling: Llama 3.1's llama3, linear, and llama.cpp's per-pair freq_factors), from Hugging Face folders and
GGUF files.

Tiny random transformers models are the reference: folders written by save_pretrained, GGUF files written here with
gguf-py (qwen2 unpermuted, llama with llama.cpp's q/k permutation) and read by transformers' own GGUF loader where it
reads them. The scaled frequencies must equal transformers' inv_freq to the bit, and the caches (dense, ring, and a
memory that re-rotates its keys to their cache positions) must agree with the full forward pass under them.
"""

import json
import math

import numpy as np
import pytest
import torch
from helpers import tiny_model
from test_gguf import SP_SCORES, SP_TOKENS, SP_TYPES, transformers_gguf_model
from test_pretrained import one_line, write_config, write_tokenizer

import attnlab
from attnlab.config import MemoryConfig, RopeScaling
from attnlab.config_io import model_config_from_dict
from attnlab.interop import config_from_hf, from_hf_llama, load_hf_folder, open_gguf
from attnlab.ops.rope import inverse_frequencies

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
from gguf_files import Q, add_hf_hparams, add_tensors, finish  # noqa: E402  (needs gguf)
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 300
# Llama 3.1's scaling with a short original context, so that the 8 frequency pairs of a 16-wide head fall in all
# three bands: pair 0 kept (wavelength 6.3 < 32 / 4), pair 1 interpolated, pairs 2.. slowed down by the factor.
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32}  # fmt: skip
LLAMA3_SCALING = RopeScaling(type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                             original_max_position_embeddings=32)  # fmt: skip


def common(vocab: int, n_kv_heads: int, tie: bool) -> dict:
    return dict(
        vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=n_kv_heads, max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=tie,
        bos_token_id=1, eos_token_id=2,
    )  # fmt: skip


def perturbed(model):
    """Non-trivial norms and biases (transformers starts biases at 0), so their import is tested too."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.5)
    return model.eval()


def random_qwen2(vocab=VOCAB, n_kv_heads=2, tie=False, seed=0, **options):
    torch.manual_seed(seed)
    config = transformers.Qwen2Config(**common(vocab, n_kv_heads, tie), rope_theta=20000.0, **options)
    return perturbed(transformers.Qwen2ForCausalLM(config))


def random_llama(vocab=VOCAB, n_kv_heads=2, tie=False, seed=0, rope=None):
    torch.manual_seed(seed)
    rope = {"rope_type": "default"} if rope is None else rope
    config = transformers.LlamaConfig(**common(vocab, n_kv_heads, tie), rope_parameters={**rope, "rope_theta": 5000.0})
    return perturbed(transformers.LlamaForCausalLM(config))


CASES = {
    "qwen2-gqa-untied": lambda: random_qwen2(n_kv_heads=2, tie=False),
    "qwen2-mha-tied": lambda: random_qwen2(n_kv_heads=4, tie=True),
    "qwen2-sliding": lambda: random_qwen2(n_kv_heads=1, use_sliding_window=True, sliding_window=6, max_window_layers=0),
    "llama3-gqa-tied": lambda: random_llama(n_kv_heads=2, tie=True, rope=LLAMA3),
    "llama3-mqa-untied": lambda: random_llama(n_kv_heads=1, tie=False, rope=LLAMA3),
    "llama-linear": lambda: random_llama(n_kv_heads=2, rope={"rope_type": "linear", "factor": 4.0}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_hf_folder_logits_and_greedy_tokens_match_transformers(tmp_path, case):
    hf = CASES[case]()
    hf.save_pretrained(tmp_path)
    write_tokenizer(tmp_path)
    cfg, model, _ = attnlab.load_model(tmp_path)
    qwen = case.startswith("qwen2")
    assert cfg.attention.qkv_bias == qwen and cfg.tie_embeddings == hf.config.tie_word_embeddings
    assert cfg.attention.kind == ("sliding" if case == "qwen2-sliding" else "mha")
    assert getattr(cfg.attention, "window", None) == (6 if case == "qwen2-sliding" else None)
    scaling = {"llama3-gqa-tied": LLAMA3_SCALING, "llama3-mqa-untied": LLAMA3_SCALING,
               "llama-linear": RopeScaling(type="linear", factor=4.0)}.get(case)  # fmt: skip
    assert cfg.rope_scaling == scaling
    tokens = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))  # longer than the window
    with torch.no_grad():
        expected = hf(tokens).logits
        ours, _ = model(tokens, use_cache=False)
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=0)
    _, imported = from_hf_llama(hf)  # the in-memory import fills the same model
    with torch.no_grad():
        torch.testing.assert_close(imported(tokens, use_cache=False)[0], ours, atol=0, rtol=0)
    # Greedy decoding through attnlab's cache (ring buffer for the sliding case) gives transformers' tokens.
    prompt = tokens[0, :5]
    with torch.no_grad():
        theirs = hf.generate(prompt[None], max_new_tokens=8, min_new_tokens=8, do_sample=False)[0, 5:]
    assert attnlab.generate(model, prompt, max_new_tokens=8, temperature=0.0, compile=False).tolist() == theirs.tolist()


@pytest.mark.parametrize(
    "dim, base, options",
    [(16, 5000.0, LLAMA3), (128, 500000.0, {**LLAMA3, "original_max_position_embeddings": 8192}),
     (64, 10000.0, {**LLAMA3, "factor": 32.0, "low_freq_factor": 1.5, "high_freq_factor": 3.0,
                    "original_max_position_embeddings": 100}),
     (16, 5000.0, {"rope_type": "linear", "factor": 4.0}), (128, 500000.0, {"rope_type": "linear", "factor": 2.5})],
)  # fmt: skip
def test_scaled_frequencies_equal_transformers_to_the_bit(dim, base, options):
    """Realistic Llama 3.1 (head_dim 128, base 500000, 8 / 1 / 4 / 8192) among them."""
    config = transformers.LlamaConfig(hidden_size=dim * 2, num_attention_heads=2, max_position_embeddings=200000,
                                      rope_parameters={**options, "rope_theta": base})  # fmt: skip
    expected, _ = ROPE_INIT_FUNCTIONS[options["rope_type"]](config, "cpu")
    scaling = config_from_hf({**config.to_dict(), "architectures": ["LlamaForCausalLM"]}).rope_scaling
    ours = inverse_frequencies(dim, base, scaling)
    assert torch.equal(ours, expected)
    assert not torch.equal(ours, inverse_frequencies(dim, base))


def test_both_spellings_of_rope_scaling_and_qwen2_windows(tmp_path):
    """transformers 4 wrote rope_theta + rope_scaling (rope_type or type), transformers 5 rope_parameters: the same
    config. Qwen2 slides only with use_sliding_window, and only layers from max_window_layers on: all or none."""
    hf = random_llama(rope=LLAMA3).config.to_dict()
    v4 = {k: v for k, v in hf.items() if k != "rope_parameters"}
    options = {k: v for k, v in LLAMA3.items() if k != "rope_type"}
    v4 = {
        **v4,
        "architectures": ["LlamaForCausalLM"],
        "rope_theta": 5000.0,
        "rope_scaling": {"type": "llama3", **options},
    }
    v5 = {**hf, "architectures": ["LlamaForCausalLM"]}
    assert config_from_hf(v4) == config_from_hf(v5) and config_from_hf(v5).rope_scaling == LLAMA3_SCALING
    assert config_from_hf({**v4, "rope_scaling": {"rope_type": "linear", "factor": 1.0}}).rope_scaling is None

    qwen = {**common(VOCAB, 2, False), "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"}
    # A transformers 4 config.json as Qwen2.5 ships it: a sliding_window that is not used.
    plain = config_from_hf({**qwen, "use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 28})
    assert plain.attention.kind == "mha" and plain.attention.qkv_bias
    assert config_from_hf({**qwen, "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 2}) == plain
    sliding = config_from_hf({**qwen, "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 0})
    assert sliding.attention.kind == "sliding" and sliding.attention.window == 8 and sliding.attention.qkv_bias
    with pytest.raises(attnlab.ConfigError, match=r"layer_types .* \(max_window_layers=1\) are not supported") as error:
        config_from_hf({**qwen, "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1})
    one_line(error)


def test_what_stays_refused(tmp_path):
    random_llama().save_pretrained(tmp_path)
    for rope_type in ("yarn", "dynamic", "longrope"):
        write_config(tmp_path, rope_parameters={"rope_type": rope_type, "factor": 4.0, "rope_theta": 10000.0,
                                                "original_max_position_embeddings": 32})  # fmt: skip
        with pytest.raises(attnlab.ConfigError, match=f"rope_type='{rope_type}' is not supported") as error:
            load_hf_folder(tmp_path)
        assert "config.json" in one_line(error)
    write_config(tmp_path, rope_parameters={"rope_type": "llama3", "factor": 8.0, "rope_theta": 10000.0})
    with pytest.raises(attnlab.ConfigError, match="needs low_freq_factor, high_freq_factor, original_max_position"):
        load_hf_folder(tmp_path)
    write_config(tmp_path, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, attention_bias=True)
    with pytest.raises(attnlab.ConfigError, match="attention_bias/mlp_bias=True is not supported .*o_proj") as error:
        load_hf_folder(tmp_path)
    one_line(error)
    # Configs: scaled RoPE only where the variant rotates with it, q/k/v biases only where the variant applies them.
    base = {"vocab_size": 97, "d_model": 64, "n_layers": 2, "n_heads": 4}
    llama3 = LLAMA3_SCALING.to_dict()
    for attention in ({"kind": "coda"}, {"kind": "diff"}):
        with pytest.raises(
            attnlab.ConfigError, match=f"rope_scaling is not applied by attention.kind='{attention['kind']}'"
        ):
            model_config_from_dict({**base, "attention": attention, "rope_scaling": llama3})
    decoupled = model_config_from_dict({**base, "attention": {"kind": "decoupled", "d_sem": 16, "d_geo": 32},
                                        "rope_scaling": llama3})  # fmt: skip
    assert decoupled.attention.cache_layout(decoupled).rope_scaling == decoupled.rope_scaling  # its k_geo turns so
    mla = model_config_from_dict({**base, "attention": {"kind": "mla", "d_latent": 32}, "rope_scaling": llama3})
    assert mla.attention.cache_layout(mla).rope_scaling == mla.rope_scaling  # its k_rope turns so
    with pytest.raises(attnlab.ConfigError, match="attention.qkv_bias is not supported by attention.kind coda"):
        model_config_from_dict({**base, "attention": {"kind": "coda", "qkv_bias": True}})
    with pytest.raises(attnlab.ConfigError, match="freq_factors has 3 factors, the rotated width 16 has 8"):
        model_config_from_dict({**base, "rope_scaling": {"type": "freq_factors", "freq_factors": [1, 2, 3]}})
    with pytest.raises(attnlab.ConfigError, match="rope_scaling.factor belongs to rope_scaling.type linear or llama3"):
        model_config_from_dict({**base, "rope_scaling": {"type": "freq_factors", "freq_factors": [1] * 8, "factor": 2}})
    with pytest.raises(attnlab.ConfigError, match="high_freq_factor=1.0 must be > low_freq_factor=1.0"):
        model_config_from_dict({**base, "rope_scaling": {**llama3, "high_freq_factor": 1}})


def test_new_options_keep_old_hashes_and_round_trip():
    """Without the new options a config's dict (and hash) is what it was; with them it reads back the same."""
    plain = model_config_from_dict({"vocab_size": 97, "d_model": 64, "n_layers": 2, "n_heads": 4})
    assert "rope_scaling" not in plain.to_dict() and "qkv_bias" not in plain.to_dict()["attention"]
    assert plain.config_hash() == "db2699ac9931"  # the hash this config had before the options existed
    for scaling in (LLAMA3_SCALING, RopeScaling(type="linear", factor=2.0),
                    RopeScaling(type="freq_factors", freq_factors=tuple(range(1, 9)))):  # fmt: skip
        data = {**plain.to_dict(), "rope_scaling": scaling.to_dict(), "attention": {"kind": "sliding", "window": 4,
                                                                                   "qkv_bias": True}}  # fmt: skip
        cfg = model_config_from_dict(json.loads(json.dumps(data)))
        assert cfg.rope_scaling == scaling and cfg.attention.qkv_bias
        assert model_config_from_dict(cfg.to_dict()) == cfg and cfg.config_hash() != plain.config_hash()


# ----------------------------------------------------------------------------- caches under scaled RoPE

SCALED = {
    "mha-llama3-bias": ({"kind": "mha", "n_kv_heads": 2, "qkv_bias": True}, LLAMA3_SCALING),
    "sliding-factors-bias": ({"kind": "sliding", "window": 5, "qkv_bias": True},
                             RopeScaling(type="freq_factors", freq_factors=(1.0, 1.5, 2.0, 3.0, 5.0, 8.0, 8.0, 8.0))),
    "bottleneck-linear": ({"kind": "bottleneck", "d_attn": 32}, RopeScaling(type="linear", factor=3.0)),
}  # fmt: skip


@pytest.mark.parametrize("name", list(SCALED))
def test_cached_decode_equals_the_full_forward_with_scaled_rope(name):
    attention, scaling = SCALED[name]
    model = tiny_model(attention, perturb=True, rope_scaling=scaling.to_dict())
    assert model.blocks[0].attn.rotary.scaling == scaling and model.blocks[0].attn.layout.rope_scaling == scaling
    tokens = torch.randint(0, 97, (2, 20), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full, _ = model(tokens, use_cache=False)
        cache = model.new_cache(2)
        steps = [model(tokens[:, :8], cache=cache)[0]]  # prefill, then one token at a time
        steps += [model(tokens[:, t : t + 1], cache=cache)[0] for t in range(8, 20)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=0)


def test_cache_positions_with_scaled_rope_read_the_held_tokens_as_one_sequence():
    """tests/test_streams.py's identity under Llama 3.1's scaling: the streaming memory re-rotates its held keys to
    their ranks with the scaled frequencies, so each step's logits are the plain model's on the held tokens."""
    sinks, window, length = 3, 6, 20
    memory = MemoryConfig(kind="streaming", recent_window=window, sink_tokens=sinks, positions="cache")
    attention, options = {"kind": "mha", "n_kv_heads": 2, "qkv_bias": True}, {"n_layers": 1, "max_seq_len": 32}
    rope = {"rope_scaling": LLAMA3_SCALING.to_dict()}
    model = tiny_model(attention, memory, perturb=True, **options, **rope)
    plain = tiny_model(attention, perturb=True, **options, **rope)
    plain.load_state_dict(model.state_dict())
    tokens = torch.randint(0, 97, (2, length), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        cache = model.new_cache(2)
        got = torch.cat([model(tokens[:, t : t + 1], cache=cache)[0] for t in range(length)], dim=1)
        for t in range(length):
            held = list(range(min(sinks, t + 1))) + list(range(max(sinks, t - window + 1), t + 1))
            want, _ = plain(tokens[:, held], use_cache=False)
            torch.testing.assert_close(got[:, t], want[:, -1], atol=1e-5, rtol=0)


# ----------------------------------------------------------------------------- GGUF files

NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
         "lm_head.weight": "output.weight"}  # fmt: skip
PARTS = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
         "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
         "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}  # fmt: skip


def write_gguf(path, hf, arch: str, quant=gguf.GGMLQuantizationType.F32, rope_freqs=None, linear=None):
    """hf's weights (biases too) as a GGUF file of architecture `arch`, with a SentencePiece tokenizer: q and k
    permuted as llama.cpp's converter does for llama only; matrices in `quant`, the rest F32; rope_freqs (one factor
    per pair) as llama.cpp writes Llama 3.1's scaling, linear as rope.scaling.type linear with that factor."""
    cfg = hf.config
    writer = gguf.GGUFWriter(str(path), arch)
    add_hf_hparams(writer, cfg)
    if linear is not None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(linear)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(SP_TOKENS)
    writer.add_token_scores(SP_SCORES)
    writer.add_token_types(SP_TYPES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", np.asarray(rope_freqs, dtype=np.float32))
    state = hf.state_dict()
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight")
    tensors = {}
    for name, tensor in state.items():
        if name.startswith("model.layers."):
            layer, rest = name[len("model.layers.") :].split(".", 1)
            part, kind = rest.rsplit(".", 1)
            tensors[f"blk.{layer}.{PARTS[part]}.{kind}"] = tensor.float().numpy()
        else:
            tensors[NAMES[name]] = tensor.float().numpy()
    heads = (cfg.num_attention_heads, cfg.num_key_value_heads) if arch == "llama" else None  # llama's converter only
    add_tensors(writer, tensors, lambda name, values: Q.F32 if values.ndim == 1 else quant, heads=heads)
    return finish(writer, path)


def llama_cpp_rope_factors(dim: int, base: float, options: dict) -> list[float]:
    """convert_hf_to_gguf.py's LlamaModel.generate_extra_tensors: Llama 3.1's scaling as per-pair divisors."""
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    old_context = options["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_context / options["low_freq_factor"], old_context / options["high_freq_factor"]
    factors = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(options["factor"])
        else:
            smooth = (old_context / wavelen - options["low_freq_factor"]) / (
                options["high_freq_factor"] - options["low_freq_factor"]
            )
            factors.append(1 / ((1 - smooth) / options["factor"] + smooth))
    return factors


def logits(model, tokens, transformers_model=False):
    with torch.no_grad():
        return model(tokens).logits if transformers_model else model(tokens, use_cache=False)[0]


TOKENS = torch.randint(0, len(SP_TOKENS), (2, 24), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_qwen2_gguf_matches_transformers_gguf_loader(tmp_path, tie):
    """qwen2 is stored unpermuted, q/k/v biases as blk.N.attn_q.bias etc. (Q8_0 matrices: both loaders read the
    same dequantized values)."""
    hf = random_qwen2(vocab=len(SP_TOKENS), n_kv_heads=2, tie=tie)
    write_gguf(tmp_path / "qwen.gguf", hf, "qwen2", quant=gguf.GGMLQuantizationType.Q8_0)
    cfg, model, _ = attnlab.load_model(tmp_path / "qwen.gguf")
    assert cfg.attention.qkv_bias and cfg.tie_embeddings == tie and cfg.rope_base == 20000.0
    expected = transformers_gguf_model(tmp_path, "qwen.gguf")
    assert isinstance(expected, transformers.Qwen2ForCausalLM)
    torch.testing.assert_close(logits(model, TOKENS), logits(expected, TOKENS, True), atol=1e-4, rtol=0)
    torch.testing.assert_close(logits(model, TOKENS), logits(hf, TOKENS, True), atol=0.05, rtol=0)  # Q8_0 vs fp32


def test_llama_gguf_with_biases_and_scaled_rope_matches_transformers(tmp_path):
    """A llama file: q/k weights and biases permuted by llama.cpp (Qwen2's weights, which are Llama's plus q/k/v
    biases), Llama 3.1's scaling as rope_freqs.weight; and linear scaling as rope.scaling.type. F32, so attnlab
    matches the transformers models they come from."""
    qwen = random_qwen2(vocab=len(SP_TOKENS), n_kv_heads=2)
    write_gguf(tmp_path / "biased.gguf", qwen, "llama")
    cfg, model, _ = attnlab.load_model(tmp_path / "biased.gguf")
    assert cfg.attention.qkv_bias and cfg.rope_scaling is None
    torch.testing.assert_close(logits(model, TOKENS), logits(qwen, TOKENS, True), atol=1e-4, rtol=0)

    llama3 = random_llama(vocab=len(SP_TOKENS), n_kv_heads=1, rope=LLAMA3)
    factors = llama_cpp_rope_factors(16, 5000.0, LLAMA3)
    assert factors[0] == 1.0 and 1.0 < factors[1] < 8.0 and set(factors[2:]) == {8.0}  # kept, between, slowed
    write_gguf(tmp_path / "llama3.gguf", llama3, "llama", rope_freqs=factors)
    cfg, model, _ = attnlab.load_model(tmp_path / "llama3.gguf")
    assert cfg.rope_scaling == RopeScaling(type="freq_factors", freq_factors=tuple(np.float32(factors).tolist()))
    torch.testing.assert_close(
        inverse_frequencies(16, 5000.0, cfg.rope_scaling), inverse_frequencies(16, 5000.0, LLAMA3_SCALING)
    )
    torch.testing.assert_close(logits(model, TOKENS), logits(llama3, TOKENS, True), atol=1e-4, rtol=0)
    prompt = TOKENS[0, :5]
    with torch.no_grad():
        theirs = llama3.generate(prompt[None], max_new_tokens=8, min_new_tokens=8, do_sample=False)[0, 5:]
    assert attnlab.generate(model, prompt, max_new_tokens=8, temperature=0.0, compile=False).tolist() == theirs.tolist()

    linear = random_llama(vocab=len(SP_TOKENS), n_kv_heads=2, tie=True, rope={"rope_type": "linear", "factor": 4.0})
    write_gguf(tmp_path / "linear.gguf", linear, "llama", linear=4.0)
    cfg, model, _ = attnlab.load_model(tmp_path / "linear.gguf")
    assert cfg.rope_scaling == RopeScaling(type="linear", factor=4.0)
    torch.testing.assert_close(logits(model, TOKENS), logits(linear, TOKENS, True), atol=1e-4, rtol=0)


def test_gguf_scalings_attnlab_cannot_express_are_refused(tmp_path):
    hf = random_llama(vocab=len(SP_TOKENS), n_kv_heads=2)
    path = write_gguf(tmp_path / "yarn.gguf", hf, "llama")
    file = open_gguf(path)
    from attnlab.interop.gguf import config_from_gguf

    file.metadata["llama.rope.scaling.type"] = "yarn"
    with pytest.raises(attnlab.ConfigError, match="llama.rope.scaling.type='yarn' is not supported") as error:
        config_from_gguf(file)
    one_line(error)
    write_gguf(tmp_path / "both.gguf", hf, "llama", rope_freqs=[1.0] * 8, linear=2.0)
    with pytest.raises(attnlab.ConfigError, match="together with rope_freqs.weight is not supported"):
        attnlab.load_model(tmp_path / "both.gguf")
    write_gguf(tmp_path / "short.gguf", hf, "llama", rope_freqs=[1.0] * 4)
    with pytest.raises(attnlab.ConfigError, match="freq_factors has 4 factors, the rotated width 16 has 8") as error:
        attnlab.load_model(tmp_path / "short.gguf")
    assert "short.gguf" in one_line(error)
