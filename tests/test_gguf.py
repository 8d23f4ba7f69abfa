"""GGUF files in (attnlab.interop.gguf, .tokenizer): parity with transformers' own GGUF loader.

Tiny files are written here with gguf-py's GGUFWriter from a random transformers Llama, q and k rows permuted
as llama.cpp's convert_hf_to_gguf.py does; the real SmolLM2-135M file (data directory) is checked end to end.
"""

import lzma

import numpy as np
import pytest
import torch
from helpers import smollm_file

import attnlab
from attnlab.interop import open_gguf, tokenizer_from_gguf

gguf = pytest.importorskip("gguf")
from gguf_files import add_hf_hparams, add_tensors, finish  # noqa: E402  (needs gguf)

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("one_thread", "gguf_parsed_once")


@pytest.fixture(scope="module")
def gguf_parsed_once():
    """transformers reads a GGUF file through gguf-py once for its config, once for its weights and once for its
    tokenizer, and builds gguf-py's tensor-name map once per module of the model: for SmolLM2-135M about three
    quarters of its load time (cProfile). Here each file (by path, size and time) is parsed once, and each name map
    built once; what transformers does with them is unchanged."""
    import functools
    import os

    readers, reader = {}, gguf.GGUFReader

    def parsed(path, mode="r"):
        stat = os.stat(path)
        key = (os.path.realpath(path), stat.st_size, stat.st_mtime_ns, mode)
        if key not in readers:
            readers[key] = reader(path, mode)
        return readers[key]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "GGUFReader", parsed)
        patch.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
        yield


Q = gguf.GGMLQuantizationType


# A SentencePiece-style vocabulary (tokenizer.ggml.model llama): unk, bos, eos, the 256 byte tokens, pieces.
PIECES = ["\u2581", "\u2581t", "h", "e", "\u2581th", "\u2581the", "\u2581c", "a", "t", "\u2581cat", "s", "\u2581a",
          "\u2581is", "i", "n", "\u2581in", "\u2581hat", "\u2581h", "at", "d", "o", "g", "\u2581dog", "."]  # fmt: skip
SP_TOKENS = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + PIECES
SP_TYPES = [2, 3, 3] + [6] * 256 + [1] * len(PIECES)
SP_SCORES = [0.0, 0.0, 0.0] + [0.0] * 256 + [-float(i) for i in range(len(PIECES))]


def transformers_gguf_model(folder, name: str):
    """transformers' GGUF loader, fp32: from_pretrained(folder, gguf_file=name) when accelerate (which it requires)
    is installed, else the function it calls, load_gguf_checkpoint, into a model of the file's config."""
    try:
        import accelerate  # noqa: F401
    except ImportError:
        from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

        config = transformers.AutoConfig.from_pretrained(folder, gguf_file=name)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        tensors = load_gguf_checkpoint(str(folder / name), return_tensors=True, model_to_load=model)["tensors"]
        missing, unexpected = model.load_state_dict(tensors, strict=False)
        assert not unexpected and set(missing) <= {"lm_head.weight"} and (not missing or config.tie_word_embeddings)
        model.tie_weights()
        return model.eval()
    return transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()


def random_llama(vocab: int, n_kv_heads: int, tie: bool, seed: int = 0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=n_kv_heads, max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=5000.0,
        tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def write_gguf(path, hf, arch: str = "llama", tokenizer: str = "llama", quant=Q.Q8_0):
    """hf's weights as a GGUF file: norms F32, embeddings F16, attention `quant`, FFN Q4_0 (Q8_0 when quant is
    F32), with a SentencePiece tokenizer (or byte-level BPE when tokenizer='gpt2')."""
    cfg = hf.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("tiny-llama")
    add_hf_hparams(writer, cfg)
    writer.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    if tokenizer == "llama":
        writer.add_tokenizer_model("llama")
        writer.add_token_list(SP_TOKENS)
        writer.add_token_scores(SP_SCORES)
        writer.add_token_types(SP_TYPES)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_unk_token_id(0)
    else:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("smollm")
        writer.add_token_list(["<|endoftext|>"] + [chr(c) for c in range(33, 127)])
        writer.add_token_types([3] + [1] * 94)
        writer.add_token_merges([])
        writer.add_bos_token_id(0)
        writer.add_eos_token_id(0)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}  # fmt: skip
    parts = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}  # fmt: skip
    state = hf.state_dict()
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight")
    tensors = {}
    for name, tensor in state.items():
        if name.startswith("model.layers."):
            layer, rest = name[len("model.layers.") :].split(".", 1)
            tensors[f"blk.{layer}.{parts[rest.removesuffix('.weight')]}.weight"] = tensor.float().numpy()
        else:
            tensors[names[name]] = tensor.float().numpy()

    def kind_of(name, values):
        if values.ndim == 1:
            return Q.F32
        if "token_embd" in name or name == "output.weight":
            return Q.F16
        return quant if "attn" in name else (Q.Q4_0 if quant != Q.F32 else Q.Q8_0)

    add_tensors(writer, tensors, kind_of, heads=(cfg.num_attention_heads, cfg.num_key_value_heads))
    return finish(writer, path)


@pytest.mark.parametrize(
    "n_kv_heads, tie, quant",
    [(2, False, Q.Q8_0), (4, True, Q.F32), (1, False, Q.Q4_1)],
    ids=["gqa-untied-q8_0", "mha-tied-f32", "mqa-untied-q4_1"],
)
def test_tiny_gguf_logits_match_transformers(tmp_path, n_kv_heads, tie, quant):
    hf = random_llama(vocab=len(SP_TOKENS), n_kv_heads=n_kv_heads, tie=tie)
    write_gguf(tmp_path / "tiny.gguf", hf, quant=quant)
    expected_model = transformers_gguf_model(tmp_path, "tiny.gguf")
    cfg, model, tokenizer = attnlab.load_model(tmp_path / "tiny.gguf")
    assert (cfg.attention.n_kv_heads, cfg.tie_embeddings, cfg.rope_base) == (n_kv_heads, tie, 5000.0)
    assert cfg.vocab_size == len(SP_TOKENS) and not cfg.rope_interleaved
    tokens = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = expected_model(tokens).logits
        ours, _ = model(tokens, use_cache=False)
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=0)
    # The weights are the file's dequantized values, not the original fp32 ones: a lossy quant differs from hf.
    if quant != Q.F32:
        assert not torch.allclose(model.blocks[0].attn.out.weight, hf.model.layers[0].self_attn.o_proj.weight)


@pytest.mark.parametrize("quant", [Q.F32, Q.Q4_1])
def test_the_table_reader_gives_gguf_readers_values(tmp_path, quant):
    """attnlab reads a GGUF file's metadata and tensor table itself (gguf-py's reader takes seconds on a real
    vocabulary): every metadata value, and every tensor's type, shape, sizes, offset and data, as GGUFReader has
    them."""
    from attnlab.interop.gguf_table import read_gguf_table

    write_gguf(tmp_path / "tiny.gguf", random_llama(vocab=len(SP_TOKENS), n_kv_heads=2, tie=True), quant=quant)
    reader, table = gguf.GGUFReader(tmp_path / "tiny.gguf"), read_gguf_table(tmp_path / "tiny.gguf")
    assert table.metadata == {name: field.contents() for name, field in reader.fields.items()}
    assert any(isinstance(v, list) and v and isinstance(v[0], str) for v in table.metadata.values())  # strings
    assert (table.data_offset, table.alignment) == (reader.data_offset, reader.alignment)
    assert [t.name for t in table.tensors] == [t.name for t in reader.tensors]
    for ours, theirs in zip(table.tensors, reader.tensors, strict=True):
        fields = ("tensor_type", "n_elements", "n_bytes", "data_offset")
        assert [getattr(ours, f) for f in fields] == [getattr(theirs, f) for f in fields], ours.name
        assert ours.shape.tolist() == theirs.shape.tolist() and ours.data.dtype == theirs.data.dtype
        assert ours.data.shape == theirs.data.shape and np.array_equal(ours.data, theirs.data), ours.name


TEXTS = ["the cat is in the hat.", " the dog", "cathat", "the  cat\nis", "th\u00e9 \u732b", ""]


def test_sentencepiece_tokenizer_matches_transformers(tmp_path):
    write_gguf(tmp_path / "tiny.gguf", random_llama(vocab=len(SP_TOKENS), n_kv_heads=2, tie=True))
    expected = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="tiny.gguf")
    ours = tokenizer_from_gguf(open_gguf(tmp_path / "tiny.gguf").metadata)
    assert (ours.bos_id, ours.eos_id, ours.eot_id, ours.add_bos, ours.vocab_size) == (1, 2, 2, True, len(SP_TOKENS))
    for text in TEXTS:
        ids = ours.encode(text, prompt=True)
        assert ids == expected(text).input_ids, text
        assert ids[0] == 1 and ours.encode(text) == ids[1:]
        assert ours.decode(ids[1:]) == expected.decode(ids[1:])
        assert ours.decode(ids[1:]) == (text[1:] if text.startswith(" ") else text)  # no "▁" is prepended before one
    # Control tokens written in a prompt are recognised; in ordinary text they are plain text.
    assert ours.encode("</s>the", prompt=True) == expected("</s>the").input_ids
    assert ours.encode("</s>the", prompt=True)[:2] == [1, 2] and 2 not in ours.encode("</s>the")


# A byte-level vocabulary (256 byte tokens, some merges) to tell the pre-tokenizers apart.
def byte_level_metadata(pre: str) -> dict:
    alphabet = [chr(c) for c in range(33, 127)] + [chr(c) for c in range(161, 173)] + [chr(c) for c in range(174, 256)]
    alphabet += [chr(256 + i) for i in range(256 - len(alphabet))]
    merges = ["\u0120 t", "h e", "\u0120t he", "1 2", "12 3", "123 4", "' s", "\u0120 1", "\u0120 \u0120"]
    tokens = ["<|endoftext|>", "<|im_start|>"] + alphabet + [m.replace(" ", "") for m in merges]
    return {
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3, 3] + [1] * (len(tokens) - 2), "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 0,
    }  # fmt: skip


@pytest.mark.parametrize(
    "pre, digits",
    [("default", ["\u0120", "1234"]), ("smollm", ["\u0120", "1", "2", "3", "4"]), ("llama-bpe", ["\u0120", "123", "4"]),
     ("qwen2", ["\u0120", "1", "2", "3", "4"])],
)  # fmt: skip
def test_byte_level_pre_tokenizers(pre, digits):
    ours = tokenizer_from_gguf(byte_level_metadata(pre))
    assert ours.eot_id == 0 and ours.stop_ids == (0,) and not ours.add_bos
    text = "the 1234 it's  \u00e9t\u00e9 \n\n <|im_start|>"
    pieces = [ours.tokenizer.id_to_token(i) for i in ours.encode(" 1234")]
    assert pieces == digits
    assert ours.decode(ours.encode(text)) == text
    assert ours.encode("<|im_start|>", prompt=True) == [1] and 1 not in ours.encode("<|im_start|>")


def test_unsupported_tokenizers_are_refused():
    with pytest.raises(attnlab.ConfigError, match="tokenizer.ggml.pre='chatglm-bpe'"):
        tokenizer_from_gguf(byte_level_metadata("chatglm-bpe"))
    with pytest.raises(attnlab.ConfigError, match="tokenizer.ggml.model='t5'"):
        tokenizer_from_gguf({"tokenizer.ggml.model": "t5", "tokenizer.ggml.tokens": ["a"]})


def one_line(error) -> str:
    message = str(error.value)
    assert "\n" not in message and message
    return message


def test_bad_gguf_files_are_refused(tmp_path):
    hf = random_llama(vocab=95, n_kv_heads=2, tie=False)
    with pytest.raises(attnlab.ConfigError, match="general.architecture='gpt2' is not supported") as error:
        attnlab.load_model(write_gguf(tmp_path / "gpt2.gguf", hf, arch="gpt2", tokenizer="gpt2"))
    assert "gpt2.gguf" in one_line(error)
    good = write_gguf(tmp_path / "good.gguf", hf, tokenizer="gpt2")
    data = good.read_bytes()
    for keep in (20, 3000, len(data) // 2, len(data) - 10):
        (tmp_path / f"cut{keep}.gguf").write_bytes(data[:keep])
        with pytest.raises(attnlab.DataError, match=f"cut{keep}.gguf") as error:
            attnlab.load_model(tmp_path / f"cut{keep}.gguf")
        one_line(error)
    (tmp_path / "magic.gguf").write_bytes(b"GGUX" + data[4:])
    with pytest.raises(attnlab.DataError, match="magic.gguf: not a readable GGUF file"):
        attnlab.load_model(tmp_path / "magic.gguf")
    with pytest.raises(attnlab.DataError, match="no such file"):
        attnlab.load_model(tmp_path / "absent.gguf")
    # Metadata that disagrees with the tensors: the shape error names the file and the tensor.
    hf_wide = random_llama(vocab=95, n_kv_heads=4, tie=False)
    path = write_gguf(tmp_path / "kv.gguf", hf_wide, tokenizer="gpt2")
    file = open_gguf(path)
    file.metadata["llama.attention.head_count_kv"] = 2
    from attnlab.interop.gguf import config_from_gguf, model_from_gguf

    with pytest.raises(attnlab.DataError, match=r"kv\.gguf \(blk\.0\.attn_k\.weight\): .* has shape") as error:
        model_from_gguf(file, config_from_gguf(file))
    one_line(error)


# ----------------------------------------------------------------------------- the real SmolLM2-135M file


@pytest.fixture
def smollm():
    return smollm_file()


@pytest.mark.slow
def test_smollm_tokenizer_matches_transformers_on_wikitext(smollm, data_dir):
    """The whole WikiText-2 raw test file (1.29M characters, 303k tokens) encodes to transformers' ids and
    decodes back.

    transformers (5.x) rebuilds a GGUF tokenizer with tokenizer.ggml.pre 'smollm' as plain GPT-2 byte-level BPE;
    SmolLM2's own tokenizer.json (and llama.cpp) first split every numeric character alone (Digits, individual).
    attnlab follows the model's own: with that one pre-tokenizer given to transformers' rebuild, the ids are equal
    everywhere; without it they differ only on non-ASCII numerics (the file's one " 4 ½ months": 2 tokens)."""
    from tokenizers import pre_tokenizers

    with lzma.open(data_dir / "wikitext-2" / "wiki.test.raw.xz", "rt", encoding="utf-8") as f:
        text = f.read()
    expected = transformers.AutoTokenizer.from_pretrained(smollm.parent, gguf_file=smollm.name)
    ours = tokenizer_from_gguf(open_gguf(smollm).metadata, source=str(smollm))
    ids = ours.encode(text)
    assert len(ids) > 300_000
    plain = expected(text).input_ids
    expected.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    assert ids == expected(text).input_ids
    assert ours.decode(ids) == text
    differ = [i for i, (a, b) in enumerate(zip(ids, plain, strict=True)) if a != b]
    assert 0 < len(differ) <= 4
    for i in differ:
        assert any(c.isnumeric() and not c.isascii() for c in ours.decode(ids[i - 1 : i + 2]))
    assert (ours.vocab_size, ours.bos_id, ours.eos_id, ours.eot_id, ours.add_bos) == (49152, 1, 2, 0, False)
    assert ours.stop_ids == (2, 0)
    assert "<|im_start|>" in ours.chat_template
    prompt = "<|im_start|>user\nWhat is 12+30?<|im_end|>\n<|im_start|>assistant\n"
    assert ours.encode(prompt, prompt=True) == expected(prompt).input_ids
    assert ours.encode(prompt, prompt=True)[0] == 1 and 1 not in ours.encode(prompt)


PROMPTS = [
    "The capital of France is Paris. The capital of Germany is",
    "def fibonacci(n):",
    "<|im_start|>user\nName a colour.<|im_end|>\n<|im_start|>assistant\n",
]


@pytest.mark.slow
def test_smollm_matches_transformers(smollm):
    """load_model on the real file against transformers' GGUF loader: config, logits on a few prompts (fp32,
    within 1e-4), and 16 greedy tokens."""
    cfg, model, tokenizer = attnlab.load_model(smollm)
    assert (cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.attention.n_kv_heads, cfg.hidden_dim) == (30, 576, 9, 3, 1536)
    assert (cfg.vocab_size, cfg.max_seq_len, cfg.rope_base, cfg.tie_embeddings) == (49152, 8192, 100000.0, True)
    assert model.embed.weight.dtype == torch.float32 and not model.training
    expected = transformers_gguf_model(smollm.parent, smollm.name)
    for prompt in PROMPTS:
        ids = torch.tensor([tokenizer.encode(prompt, prompt=True)])
        with torch.no_grad():
            ours, _ = model(ids, use_cache=False)
            theirs = expected(ids).logits
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
    ids = torch.tensor(tokenizer.encode(PROMPTS[0]))
    with torch.no_grad():
        theirs = expected.generate(ids[None], max_new_tokens=16, min_new_tokens=16, do_sample=False)[0, len(ids) :]
    ours = attnlab.generate(model, ids, max_new_tokens=16, temperature=0.0)
    assert ours.tolist() == theirs.tolist()
    assert tokenizer.decode(ours.tolist()).startswith(" Berlin")
