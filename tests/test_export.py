"""Hugging Face folders out (attnlab.interop.export): tiny attnlab models written as Llama/Mistral folders must give
transformers' AutoModelForCausalLM the same logits, and read back through load_model to the same model; attnlab's
tokenizers written as tokenizer.json must encode text to the same ids through transformers' AutoTokenizer."""

import dataclasses
import json
import lzma
import re

import pytest
import torch
from helpers import TINY, smollm_file, tiny_model, train_tiny_run
from safetensors import safe_open

import attnlab
from attnlab.config import MemoryConfig, ModelConfig
from attnlab.data.tokenizers import EOT, load_tokenizer, train_tokenizer
from attnlab.errors import ConfigError, DataError, InputError
from attnlab.interop import load_hf_folder, tokenizer_from_folder
from attnlab.interop.export import export, export_hf, write_tokenizer

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("one_thread")

LLAMA3 = {"type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}  # fmt: skip
# TINY: vocab 97 (padding rows to drop), d_model 64, 4 heads of 16, 2 layers. perturb: norms away from 1.
CASES = {
    "mha-untied": dict(tie_embeddings=False),
    "gqa-tied": dict(attention={"kind": "mha", "n_kv_heads": 2}),
    "mqa": dict(attention={"kind": "mha", "n_kv_heads": 1}),
    "mha-interleaved": dict(rope_interleaved=True),
    "gqa-interleaved-untied": dict(
        attention={"kind": "mha", "n_kv_heads": 2}, rope_interleaved=True, tie_embeddings=False
    ),
    "sliding-gqa": dict(attention={"kind": "sliding", "window": 6, "n_kv_heads": 2}),
    "sliding-mqa-interleaved": dict(attention={"kind": "sliding", "window": 5, "n_kv_heads": 1}, rope_interleaved=True),
    "bottleneck-gqa": dict(attention={"kind": "bottleneck", "d_attn": 32, "n_kv_heads": 2}),
    "qkv-bias-gqa": dict(attention={"kind": "mha", "n_kv_heads": 2, "qkv_bias": True}),
    "qkv-bias-sliding-interleaved-untied": dict(
        attention={"kind": "sliding", "window": 6, "qkv_bias": True}, rope_interleaved=True, tie_embeddings=False
    ),
    "rope-linear": dict(rope_scaling={"type": "linear", "factor": 2.0}),
    "rope-llama3-gqa": dict(rope_scaling=LLAMA3, attention={"kind": "mha", "n_kv_heads": 2}),
}
SAMPLE = (
    "The game began development in 2010 , carrying over a large portion .\n\n"
    "  two  spaces\tand a tab\r\nnaïve café 🙂 猫 x\u00a0y\u3000z\x1cw 12345 don't\n \n"
)


def model_of(case: str, **overrides):
    return tiny_model(perturb=True, **{**CASES[case], **overrides})  # perturb: norms and biases away from init


def tokens_for(vocab: int, length: int = 24):
    return torch.randint(0, vocab, (2, length), generator=torch.Generator().manual_seed(1))  # past the window


def transformers_model(folder):
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(tmp_path, case):
    model = model_of(case)
    exported = export_hf(model, tmp_path / case)
    config = json.loads((tmp_path / case / "config.json").read_text())
    window = CASES[case].get("attention", {}).get("window")
    assert config["architectures"] == [exported.architecture]
    assert exported.architecture == (
        "Qwen2ForCausalLM" if case.startswith("qkv-bias") else "MistralForCausalLM" if window else "LlamaForCausalLM"
    )
    assert (config["vocab_size"], config.get("sliding_window"), config["tie_word_embeddings"]) == (
        TINY["vocab_size"],
        window,
        model.cfg.tie_embeddings,
    )
    with safe_open(str(tmp_path / case / "model.safetensors"), framework="pt") as f:
        assert f.get_slice("model.embed_tokens.weight").get_shape() == [97, 64]  # padding rows dropped
        assert ("lm_head.weight" in f.keys()) == (not model.cfg.tie_embeddings)
    hf = transformers_model(tmp_path / case)
    tokens = tokens_for(TINY["vocab_size"])
    with torch.no_grad():
        ours, _ = model(tokens, use_cache=False)
        theirs = hf(tokens).logits
    torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=0)


def as_read_back(cfg: ModelConfig, loaded: ModelConfig) -> ModelConfig:
    """What config.json says of cfg, read back: derived widths explicit, half-split RoPE (the q/k rows permuted);
    the name is the folder's, and init_std (which no weight depends on) whatever the reader takes it to be."""
    attention = dataclasses.replace(
        cfg.attention, n_kv_heads=cfg.attention.kv_heads(cfg), head_dim=cfg.attention.dim(cfg)
    )
    return cfg.replace(attention=attention, d_ff=cfg.hidden_dim, rope_interleaved=False, name=loaded.name,
                       init_std=loaded.init_std)  # fmt: skip


@pytest.mark.parametrize(
    "case", ["mha-untied", "gqa-tied", "mha-interleaved", "sliding-gqa", "qkv-bias-sliding-interleaved-untied",
             "rope-llama3-gqa"]
)  # fmt: skip
def test_round_trip_through_load_model(tmp_path, case):
    """vocab 257 (the byte tokenizer's, padded to 320): load_model reads the folder back, tokenizer included."""
    model = model_of(case, vocab_size=257)
    tokenizer = load_tokenizer("byte")
    export_hf(model, tmp_path / "m", tokenizer=tokenizer)
    cfg, loaded, loaded_tokenizer = attnlab.load_model(tmp_path / "m")
    assert cfg.config_hash() == as_read_back(model.cfg, cfg).config_hash()
    tokens = tokens_for(257)
    with torch.no_grad():
        torch.testing.assert_close(loaded(tokens, use_cache=False)[0], model(tokens, use_cache=False)[0],
                                   atol=1e-5, rtol=0)  # fmt: skip
    assert loaded_tokenizer.encode(SAMPLE) == tokenizer.encode(SAMPLE)
    assert (loaded_tokenizer.eot_id, loaded_tokenizer.stop_ids, loaded_tokenizer.bos_id) == (256, (256,), None)


def test_sharded_and_bf16(tmp_path):
    model = model_of("gqa-interleaved-untied")
    exported = export_hf(model, tmp_path / "sharded", max_shard_bytes=40_000)
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert set(shards) < set(exported.files) and not (tmp_path / "sharded" / "model.safetensors").exists()
    tokens = tokens_for(97)
    with torch.no_grad():
        expected = model(tokens, use_cache=False)[0]
        torch.testing.assert_close(transformers_model(tmp_path / "sharded")(tokens).logits, expected, atol=1e-5, rtol=0)
    _, read = load_hf_folder(tmp_path / "sharded")
    with torch.no_grad():
        torch.testing.assert_close(read(tokens, use_cache=False)[0], expected, atol=1e-5, rtol=0)

    exported = export_hf(model, tmp_path / "bf16", dtype="bf16")
    assert exported.dtype == "bfloat16"
    config = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert config["torch_dtype"] == config["dtype"] == "bfloat16"
    with safe_open(str(tmp_path / "bf16" / "model.safetensors"), framework="pt") as f:
        assert {f.get_tensor(name).dtype for name in f.keys()} == {torch.bfloat16}
        torch.testing.assert_close(f.get_tensor("model.norm.weight"), model.norm.weight.detach().bfloat16())


def test_sharded_sizes_add_up(tmp_path):
    model = model_of("mha-untied")
    export_hf(model, tmp_path / "m", max_shard_bytes=1)  # every tensor alone
    index = json.loads((tmp_path / "m" / "model.safetensors.index.json").read_text())
    counted = 0
    for name, file in index["weight_map"].items():
        with safe_open(str(tmp_path / "m" / file), framework="pt") as f:
            assert list(f.keys()) == [name]
            counted += f.get_tensor(name).numel()
    assert index["metadata"]["total_size"] == 4 * counted
    # embed + head (97 rows each, not 128), 2 x (9 per block), the final norm
    assert len(index["weight_map"]) == 2 + 2 * 9 + 1


# ----------------------------------------------------------------------------- tokenizers

CORPUS = [SAMPLE.replace("🙂", ""), " = Valkyria Chronicles III = \n \n Senjō no Valkyria 3 : <unk> Chronicles \n"] * 20


def attnlab_tokenizer(name: str, request):
    if name == "gpt2":
        data_dir = request.getfixturevalue("data_dir")
        try:
            return load_tokenizer("gpt2", data_dir=data_dir, download=False)
        except DataError as e:
            pytest.skip(str(e))
    if name == "byte":
        return load_tokenizer("byte")
    return train_tokenizer({"bpe": "bpe:300"}.get(name, name), CORPUS)


@pytest.mark.parametrize("name", ["gpt2", "bpe", "byte", "char", "word"])
def test_tokenizer_encodes_as_attnlab_does(tmp_path, name, request):
    tokenizer = attnlab_tokenizer(name, request)
    write_tokenizer(tokenizer, tmp_path)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert len(set(tokenizer.encode(SAMPLE))) > 20  # the sample is mostly known tokens, not <unk>
    for text in [SAMPLE, "", " ", "\n", "a", "Chronicles\nIII  \t ="]:
        assert theirs(text).input_ids == tokenizer.encode(text), (name, text)
    assert theirs.eos_token_id == tokenizer.eot_id and theirs.bos_token_id is None
    # transformers matches special tokens written in text (as for its own GPT-2); attnlab's ordinary encoding not.
    assert theirs(f"a{EOT}").input_ids[-1] == tokenizer.eot_id
    assert tokenizer.eot_id not in tokenizer.encode(f"a{EOT}")
    back = tokenizer_from_folder(tmp_path)  # attnlab reads the folder back: the same ids, plain text plain
    assert back.encode(SAMPLE) == tokenizer.encode(SAMPLE) and back.eot_id == tokenizer.eot_id
    if name == "word":
        assert (
            tokenizer.decode(tokenizer.encode(SAMPLE)).split()
            == theirs.decode(tokenizer.encode(SAMPLE)).replace("<eos>", "\n").split()
        )
    else:
        assert theirs.decode(tokenizer.encode(SAMPLE)) == tokenizer.decode(tokenizer.encode(SAMPLE))


def test_gpt2_tokenizer_on_wikitext(tmp_path, data_dir):
    """100k characters of WikiText-2 raw: transformers' ids from the exported tokenizer.json equal tiktoken's."""
    path = data_dir / "wikitext-2" / "wiki.test.raw.xz"
    if not path.exists():
        pytest.skip(f"{path} not found")
    try:
        tokenizer = load_tokenizer("gpt2", data_dir=data_dir, download=False)
    except DataError as e:
        pytest.skip(str(e))
    with lzma.open(path, "rt", encoding="utf-8") as f:
        text = f.read(100_000)
    write_tokenizer(tokenizer, tmp_path)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert theirs(text).input_ids == tokenizer.encode(text)


# ----------------------------------------------------------------------------- refusals and folders

REFUSED = {
    "decoupled": (dict(attention={"kind": "decoupled", "d_sem": 16, "d_geo": 32}), "attention.kind='decoupled'"),
    "mla": (dict(attention={"kind": "mla", "d_latent": 32}), "attention.kind='mla'"),
    "diff": (dict(attention={"kind": "diff"}), "attention.kind='diff'"),
    "coda": (dict(attention={"kind": "coda"}), "attention.kind='coda'"),
    "bottleneck-null": (dict(attention={"kind": "bottleneck", "d_attn": 32, "null_attn": True}), "null_attn"),
    "memory-window": (dict(memory=MemoryConfig(kind="window", recent_window=8)), "memory.kind='window'"),
    "memory-streaming": (dict(memory=MemoryConfig(kind="streaming", recent_window=8)), "memory.kind='streaming'"),
    "memory-h2o": (dict(memory=MemoryConfig(kind="h2o", recent_window=8)), "memory.kind='h2o'"),
    "memory-bounded": (dict(memory=MemoryConfig(kind="bounded", recent_window=8)), "memory.kind='bounded'"),
    "gelu": (dict(mlp="gelu"), "mlp='gelu'"),
    "rope-freq-factors": (dict(rope_scaling={"type": "freq_factors", "freq_factors": [1.5] * 8}), "freq_factors"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_what_a_llama_config_cannot_describe_is_refused(tmp_path, case):
    options, what = REFUSED[case]
    model = tiny_model(**options)
    with pytest.raises(ConfigError, match=re.escape(what)) as caught:
        export_hf(model, tmp_path / "out")
    assert "\n" not in str(caught.value) and ("cannot" in str(caught.value) or "not exported" in str(caught.value))
    assert list(tmp_path.iterdir()) == []  # nothing written, no temporary left


def test_out_dir_is_replaced_only_when_asked(tmp_path):
    model = model_of("gqa-tied")
    out = tmp_path / "out"
    out.mkdir()
    export_hf(model, out)  # an empty folder is fine
    (out / "stale.txt").write_text("old")
    with pytest.raises(InputError, match="not empty.*overwrite"):
        export_hf(model, out)
    assert (out / "stale.txt").exists()
    with pytest.raises(InputError, match="stale.txt, which an export does not write"):  # never deleted
        export_hf(model, out, overwrite=True)
    assert (out / "stale.txt").read_text() == "old"
    (out / "stale.txt").unlink()
    (out / "model-00001-of-00002.safetensors").write_text("old")  # an earlier (sharded) export's: replaced
    export_hf(model, out, overwrite=True)
    assert not (out / "model-00001-of-00002.safetensors").exists() and (out / "config.json").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temporaries beside it
    (tmp_path / "file").write_text("x")
    with pytest.raises(InputError, match="is a file"):
        export_hf(model, tmp_path / "file", overwrite=True)
    with pytest.raises(InputError, match="dtype"):
        export_hf(model, tmp_path / "new", dtype="int8")
    with pytest.raises(ConfigError, match="more than the model's vocab_size=97"):
        export_hf(model, tmp_path / "new", tokenizer=load_tokenizer("byte"))
    assert not (tmp_path / "new").exists()


def test_export_a_reference_and_refuse_its_own_folder(tmp_path):
    """export(ref): the folder of a Hugging Face reference exported again is the same model; the reference's own
    folder is never the target."""
    model = model_of("sliding-gqa", vocab_size=257)
    export_hf(model, tmp_path / "first", tokenizer=load_tokenizer("byte"))
    exported = export(str(tmp_path / "first"), tmp_path / "second", dtype="fp32")
    assert exported.architecture == "MistralForCausalLM" and "tokenizer.json" in exported.files
    for name in ("tokenizer.json", "model.safetensors", "generation_config.json"):
        assert (tmp_path / "first" / name).read_bytes() == (tmp_path / "second" / name).read_bytes(), name
    first, second = (json.loads((tmp_path / d / "config.json").read_text()) for d in ("first", "second"))
    assert first.pop("initializer_range") == 0.1  # init_std, which no weight depends on, is not read back
    second.pop("initializer_range")
    assert first == second
    with pytest.raises(InputError, match="holds the model"):
        export(str(tmp_path / "first"), tmp_path / "first", overwrite=True)


def test_export_a_trained_run(tmp_path):
    """An attnlab run (char tokenizer, fitted to its corpus): transformers reads the folder, its logits and its
    tokenizer's ids are attnlab's; a text with characters the run never saw goes to <unk> alike."""
    run = train_tiny_run(tmp_path, {"vocab_size": 64, "d_model": 32, "n_layers": 1, "n_heads": 2, "max_seq_len": 32,
                                    "attention": {"kind": "mha", "n_kv_heads": 1}}, steps=4)  # fmt: skip
    exported = export(run, tmp_path / "hf", dtype="fp32")
    assert exported.tokenizer == "char as tokenizer.json"
    cfg, model, tokenizer = attnlab.load_model(run)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    text = "the cat sat, 猫 Z\nby a red door"  # 30 characters: within max_seq_len
    ids = tokenizer.encode(text)
    assert theirs(text).input_ids == ids and ids.count(tokenizer.unk_id) == 3  # , 猫 Z
    with torch.no_grad():
        expected = model(torch.tensor([ids]), use_cache=False)[0]
        torch.testing.assert_close(transformers_model(tmp_path / "hf")(torch.tensor([ids])).logits, expected,
                                   atol=1e-5, rtol=0)  # fmt: skip


# ----------------------------------------------------------------------------- a real model


@pytest.mark.slow
def test_smollm_gguf_exports_to_transformers(tmp_path, data_dir):
    """SmolLM2-135M (GGUF, dequantized to fp32) -> a sharded Llama folder: transformers' logits equal attnlab's
    within 1e-4, its AutoTokenizer encodes prompts and chat turns to attnlab's ids."""
    gguf = smollm_file()
    exported = export_hf(gguf, tmp_path / "smollm", max_shard_bytes=300 * 2**20)
    assert exported.architecture == "LlamaForCausalLM"
    assert len([f for f in exported.files if f.startswith("model-")]) == 2
    cfg, model, tokenizer = attnlab.load_model(gguf)
    hf = transformers_model(tmp_path / "smollm")
    theirs_tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "smollm")
    prompt = "The capital of France is Paris. The capital of Germany is"
    ids = tokenizer.encode(prompt, prompt=True)
    assert theirs_tokenizer(prompt).input_ids == ids
    chat = theirs_tokenizer.apply_chat_template(
        [{"role": "user", "content": "Name a colour."}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert chat == tokenizer.encode_chat("Name a colour.")
    with torch.no_grad():
        torch.testing.assert_close(hf(torch.tensor([ids])).logits, model(torch.tensor([ids]), use_cache=False)[0],
                                   atol=1e-4, rtol=0)  # fmt: skip
    generation = json.loads((tmp_path / "smollm" / "generation_config.json").read_text())
    assert generation["eos_token_id"] == list(tokenizer.stop_ids)
