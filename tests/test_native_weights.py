"""load_model(..., weights="native"): a GGUF file's F16/Q8_0/Q4_0/Q4_1 matrices kept as stored (QuantizedLinear),
other formats dequantized; the model equals the one whose weights were all dequantized, on tiny files written here
and on the real SmolLM2-135M file (slow)."""

import pytest
import torch
from helpers import gguf_name, smollm_file, tiny_model

import attnlab
from attnlab.errors import InputError
from attnlab.interop.gguf import load_gguf, native_layers, open_gguf
from attnlab.interop.hf import hf_targets
from attnlab.model.qlinear import QuantizedEmbedding, QuantizedLinear

gguf = pytest.importorskip("gguf")
from gguf_files import add_tensors, finish  # noqa: E402  (needs gguf)

Q = gguf.GGMLQuantizationType
pytestmark = pytest.mark.usefixtures("one_thread")

TOKENS = ["<|endoftext|>"] + [chr(c) for c in range(33, 127)] + ["ab", "cd"]  # 97: the tiny model's vocabulary


def write_gguf(path, model, types: dict[str, Q]):
    """An attnlab Llama-shaped model as a llama GGUF file: each matrix in types[its GGUF part] (default Q8_0; norms
    F32), q and k rows permuted as llama.cpp's converter does."""
    cfg = model.cfg
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(cfg.n_layers)
    writer.add_context_length(cfg.max_seq_len)
    writer.add_embedding_length(cfg.d_model)
    writer.add_feed_forward_length(cfg.hidden_dim)
    writer.add_head_count(cfg.n_heads)
    writer.add_head_count_kv(cfg.attention.n_kv_heads or cfg.n_heads)
    writer.add_rope_freq_base(cfg.rope_base)
    writer.add_layer_norm_rms_eps(cfg.norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(TOKENS)
    writer.add_token_types([3] + [1] * (len(TOKENS) - 1))
    writer.add_token_merges(["a b", "c d"])  # (its tokens "ab" and "cd")
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(0)
    tensors = {gguf_name(hf): tensor.detach().float().numpy() for hf, tensor in hf_targets(model).items()}
    kind_of = lambda name, values: Q.F32 if values.ndim == 1 else types.get(name.split(".")[-2], Q.Q8_0)  # noqa: E731
    add_tensors(writer, tensors, kind_of, heads=(cfg.n_heads, cfg.attention.n_kv_heads or cfg.n_heads))
    return finish(writer, path)


def assert_same_model(native, dequantized, tokens):
    with torch.no_grad():
        a, b = native(tokens)[0], dequantized(tokens)[0]
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


MIXED = {"attn_q": Q.Q4_1, "attn_k": Q.Q4_1, "attn_v": Q.Q4_1, "attn_output": Q.Q8_0, "ffn_gate": Q.Q4_0,
         "ffn_up": Q.Q4_0, "ffn_down": Q.Q5_0, "token_embd": Q.F16, "output": Q.Q8_0}  # fmt: skip


def test_native_layers_hold_the_files_blocks_and_compute_the_same_model(tmp_path):
    """Untied, GQA, a padded vocabulary (97 -> 128 rows): q/k/v Q4_1 (unpermuted on their blocks), the output
    projection Q8_0, gate/up Q4_0, down Q5_0 (dequantized: not a native format), embedding F16, LM head Q8_0."""
    model = tiny_model({"kind": "mha", "n_kv_heads": 2}, seed=0, init_std=0.3, perturb=True, tie_embeddings=False)
    path = write_gguf(tmp_path / "tiny.gguf", model, MIXED)
    cfg, native, _ = load_gguf(path, tokenizer=False, weights="native")
    _, dequantized, _ = load_gguf(path, tokenizer=False)
    attn, mlp = native.blocks[1].attn, native.blocks[1].mlp
    assert (attn.qkv.fmt, attn.out.fmt, mlp.gate_up.fmt) == ("q4_1", "q8_0", "q4_0")
    assert type(mlp.down) is torch.nn.Linear  # Q5_0: dequantized, as with weights="fp32"
    assert isinstance(native.embed, QuantizedEmbedding) and native.embed.fmt == "fp16"
    assert native.lm_head.fmt == "q8_0" and native.lm_head.blocks.shape[0] == cfg.padded_vocab_size == 128
    assert not native.lm_head.blocks[97:].any()  # the padded rows: zeros
    file = open_gguf(path)
    assert torch.equal(attn.out.blocks, torch.from_numpy(file.tensors["blk.1.attn_output.weight"].data.copy()))
    for name, module in native.named_modules():  # the dequantized blocks are the fp32 model's weights, exactly
        if isinstance(module, QuantizedLinear):
            assert torch.equal(module.dequantize(), dequantized.get_submodule(name).weight), name
    assert torch.equal(native.embed(torch.arange(97)), dequantized.embed.weight[:97])
    tokens = torch.randint(0, 97, (2, 15), generator=torch.Generator().manual_seed(0))
    assert_same_model(native, dequantized, tokens)
    prompt = tokens[0, :6].tolist()
    out = attnlab.generate(native, prompt, max_new_tokens=10, compile=False).tolist()
    assert out == attnlab.generate(dequantized, prompt, max_new_tokens=10, compile=False).tolist()


def test_tied_table_and_layers_whose_parts_differ(tmp_path):
    """Tied embeddings in Q4_0: one QuantizedLinear LM head, the embedding reading its blocks; q in Q8_0 but k/v
    in Q4_0: the fused qkv stays fp32 (one layer, one format)."""
    model = tiny_model(seed=1, init_std=0.3, perturb=True, tie_embeddings=True)
    types = {"attn_q": Q.Q8_0, "attn_k": Q.Q4_0, "attn_v": Q.Q4_0, "token_embd": Q.Q4_0, "ffn_down": Q.F16}
    path = write_gguf(tmp_path / "tied.gguf", model, types)
    cfg, native, tokenizer = attnlab.load_model(path, weights="native")
    _, dequantized, _ = attnlab.load_model(path)
    assert tokenizer is not None and "lm_head" in native_layers(open_gguf(path), cfg)
    assert native.embed.blocks is native.lm_head.blocks and native.lm_head.fmt == "q4_0"
    assert type(native.blocks[0].attn.qkv) is torch.nn.Linear
    assert native.blocks[0].mlp.down.fmt == "fp16" and native.blocks[0].attn.out.fmt == "q8_0"
    assert_same_model(native, dequantized, torch.randint(0, 97, (1, 20), generator=torch.Generator().manual_seed(1)))


def test_weights_other_than_fp32_and_native_and_native_for_other_references(tmp_path):
    path = write_gguf(tmp_path / "tiny.gguf", tiny_model(seed=0), {})
    with pytest.raises(InputError, match=r"weights='int4' is not a choice \('fp32': .*'native': "):
        attnlab.load_model(path, weights="int4")
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "llama", "architectures": ["LlamaForCausalLM"]}')
    with pytest.raises(InputError, match="weights='native' keeps a GGUF file's quantized matrices, but .* is a "
                       "Hugging Face folder"):  # fmt: skip
        attnlab.load_model(folder, weights="native")


# ----------------------------------------------------------------------------- the real SmolLM2-135M file


@pytest.fixture(scope="module")
def smollm_pair():
    """(native model, dequantized model, tokenizer) of the SmolLM2 file, loaded once for this module's tests."""
    path = smollm_file()
    _, native, tokenizer = attnlab.load_model(path, weights="native")
    _, dequantized, _ = attnlab.load_model(path)
    return native, dequantized, tokenizer


@pytest.mark.slow
def test_smollm_native_weights_are_the_files_and_give_the_dequantized_models_logits(smollm_pair):
    native, dequantized, tokenizer = smollm_pair
    assert native.blocks[0].attn.qkv.fmt == "q4_1" and native.lm_head.fmt == "q8_0"
    assert native.embed.blocks is native.lm_head.blocks
    layers = [m for m in native.modules() if isinstance(m, QuantizedLinear | QuantizedEmbedding)]
    held = {m.blocks.data_ptr(): m.blocks.nbytes for m in layers}  # the tied table once
    weights = sum(m.in_features * m.out_features for m in native.modules() if isinstance(m, QuantizedLinear))
    assert 4.5 < 8 * sum(held.values()) / weights < 6.0  # Q4_1 blocks (5 bits) and the Q8_0 table (8.5 bits)
    tokens = torch.tensor([tokenizer.encode("The capital of France is Paris, and the capital of Italy is")])
    with torch.no_grad():
        a, b = native(tokens)[0], dequantized(tokens)[0]
    assert (a - b).abs().max() < 1e-3 * b.abs().max()  # float32 sums in another order, over 30 layers


@pytest.mark.slow
def test_smollm_greedy_tokens_equal_the_dequantized_models(smollm_pair):
    """128 greedy tokens through generate equal the fp32 model's: the logits differ by float rounding only, far
    below the gap between the two best tokens at every step. Eager steps: the compiled step with native weights
    gives the eager step's tokens in test_qlinear (two cold compiles of this model would cost more than the 256
    steps)."""
    native, dequantized, tokenizer = smollm_pair
    prompt = tokenizer.encode("Write a short story about a robot who learns to paint.")
    ours = attnlab.generate(native, prompt, max_new_tokens=128, compile=False).tolist()
    theirs = attnlab.generate(dequantized, prompt, max_new_tokens=128, compile=False).tolist()
    first = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b), None)
    assert first is None, f"first divergence at step {first}: {ours[first]} vs {theirs[first]}"
