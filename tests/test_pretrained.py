"""Hugging Face model folders and model references (attnlab.interop.hf, .tokenizer, .references).

Tiny random models are written by transformers itself (save_pretrained, also sharded) and read back by
attnlab without transformers; the logits must equal transformers' in fp32.
"""

import json

import pytest
import torch
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors

import attnlab
from attnlab.interop import PretrainedTokenizer, config_from_hf, from_hf_llama, load_hf_folder, tokenizer_from_folder

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 300
TEMPLATE = "{% for m in messages %}<s>{{ m['content'] }}</s>{% endfor %}"


def random_model(arch: str = "llama", n_kv_heads: int = 2, tie: bool = False, sliding_window=None, seed: int = 0):
    torch.manual_seed(seed)
    common = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=n_kv_heads, max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=tie,
        bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    if arch == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common, rope_theta=20000.0))
    else:
        model = transformers.MistralForCausalLM(transformers.MistralConfig(**common, sliding_window=sliding_window))
    with torch.no_grad():  # non-trivial norms, so their import is tested too
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model.eval()


def write_tokenizer(folder, add_bos: bool | None = True) -> None:
    """A byte-level BPE tokenizer.json (<unk>, <s>, </s>, the 256 bytes, a few merges) whose post-processor puts
    <s> first, and a tokenizer_config.json naming the special tokens (add_bos_token left out when None)."""
    alphabet = list(pre_tokenizers.ByteLevel.alphabet())
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{c: 3 + i for i, c in enumerate(sorted(alphabet))}}
    merges = [("\u0120", "t"), ("h", "e"), ("\u0120t", "he"), ("i", "s")]
    for left, right in merges:
        vocab[left + right] = len(vocab)
    tokenizer = HFTokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<unk>", "<s>", "</s>"])
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
              "unk_token": "<unk>", "chat_template": TEMPLATE}  # fmt: skip
    if add_bos is not None:
        config["add_bos_token"] = add_bos
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


def save(model, folder, shard: str | None = None):
    model.save_pretrained(folder, **({"max_shard_size": shard} if shard else {}))
    write_tokenizer(folder)
    return folder


CASES = {
    "llama-mha-untied": dict(arch="llama", n_kv_heads=4, tie=False),
    "llama-gqa-tied": dict(arch="llama", n_kv_heads=2, tie=True),
    "llama-mqa-sharded": dict(arch="llama", n_kv_heads=1, tie=False, shard="40KB"),
    "mistral-sliding": dict(arch="mistral", n_kv_heads=2, sliding_window=6),
    "mistral-plain-sharded": dict(arch="mistral", n_kv_heads=2, sliding_window=None, shard="40KB"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_hf_folder_logits_match_transformers(tmp_path, case):
    options = dict(CASES[case])
    shard = options.pop("shard", None)
    hf = random_model(**options)
    folder = save(hf, tmp_path / case, shard)
    assert (folder / "model.safetensors.index.json").exists() == bool(shard)
    cfg, model, tokenizer = attnlab.load_model(folder)
    window = options.get("sliding_window")
    assert cfg.attention.kind == ("sliding" if window else "mha") and getattr(cfg.attention, "window", None) == window
    assert (cfg.attention.n_kv_heads, cfg.tie_embeddings, cfg.vocab_size) == (
        options["n_kv_heads"],
        hf.config.tie_word_embeddings,
        VOCAB,
    )
    tokens = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))  # longer than the window
    with torch.no_grad():
        expected = hf(tokens).logits
        ours, _ = model(tokens, use_cache=False)
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=0)
    # One name table for every source: the in-memory import fills the same model.
    _, imported = from_hf_llama(hf)
    with torch.no_grad():
        torch.testing.assert_close(imported(tokens, use_cache=False)[0], ours, atol=0, rtol=0)
    assert isinstance(tokenizer, PretrainedTokenizer)


def test_dtype_argument(tmp_path):
    folder = save(random_model(), tmp_path / "m")
    cfg, model = load_hf_folder(folder, dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    _, fp32 = load_hf_folder(folder)
    torch.testing.assert_close(model.embed.weight.float(), fp32.embed.weight, atol=1e-2, rtol=1e-2)


def test_folder_tokenizer_matches_transformers(tmp_path):
    folder = save(random_model(), tmp_path / "m")
    ours = tokenizer_from_folder(folder)
    expected = transformers.AutoTokenizer.from_pretrained(folder)
    assert (ours.bos_id, ours.eos_id, ours.eot_id, ours.add_bos, ours.chat_template) == (1, 2, 2, True, TEMPLATE)
    for text in ["the cat is here", " the", "</s>the", "caf\u00e9 \u732b\n\n x", ""]:
        assert ours.encode(text, prompt=True) == expected(text).input_ids, text
        assert ours.decode(ours.encode(text)) == text
    assert 2 not in ours.encode("</s>") and ours.encode("</s>", prompt=True) == [1, 2]
    # Without add_bos_token, whether tokenizer.json's post-processor puts BOS first decides.
    write_tokenizer(folder, add_bos=None)
    assert tokenizer_from_folder(folder).add_bos
    write_tokenizer(folder, add_bos=False)
    plain = tokenizer_from_folder(folder)
    assert not plain.add_bos and plain.encode("x", prompt=True) == [plain.tokenizer.token_to_id("x")]
    # save() writes a folder tokenizer_from_folder reads back the same.
    ours.save(tmp_path / "saved")
    again = tokenizer_from_folder(tmp_path / "saved")
    assert (again.bos_id, again.eos_id, again.add_bos, again.chat_template) == (1, 2, True, TEMPLATE)
    assert again.encode("the </s> cat", prompt=True) == ours.encode("the </s> cat", prompt=True)


def one_line(error) -> str:
    message = str(error.value)
    assert "\n" not in message and message
    return message


def write_config(folder, **changes):
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))


def test_unsupported_architectures_are_refused(tmp_path):
    folder = save(random_model(), tmp_path / "m")
    write_config(folder, architectures=["Qwen2ForCausalLM"], model_type="qwen2")  # a Llama relabelled: no biases
    with pytest.raises(attnlab.DataError, match="missing tensor.*q_proj.bias") as error:
        attnlab.load_model(folder)
    one_line(error)
    write_config(folder, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    with pytest.raises(attnlab.ConfigError, match=r"GPT2LMHeadModel is not supported \(supported: LlamaForCausalLM"):
        attnlab.load_model(folder)
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "rope_theta": 10000.0}
    write_config(folder, architectures=["LlamaForCausalLM"], model_type="llama", rope_parameters=yarn)
    with pytest.raises(attnlab.ConfigError, match="rope_type='yarn' is not supported") as error:
        attnlab.load_model(folder)
    one_line(error)
    hf = {**json.loads((folder / "config.json").read_text()), "rope_parameters": None, "attention_bias": True}
    with pytest.raises(attnlab.ConfigError, match="attention_bias"):
        config_from_hf(hf)


def test_bad_folders_are_refused(tmp_path):
    sharded = save(random_model(), tmp_path / "sharded", shard="40KB")
    shards = sorted(sharded.glob("model-*.safetensors"))
    shards[1].unlink()
    with pytest.raises(attnlab.DataError, match=f"{shards[1].name}: not found") as error:
        attnlab.load_model(sharded)
    one_line(error)

    single = save(random_model(), tmp_path / "single")
    data = (single / "model.safetensors").read_bytes()
    (single / "model.safetensors").write_bytes(data[: len(data) - 1000])
    with pytest.raises(attnlab.DataError, match="single/model.safetensors: unreadable safetensors") as error:
        attnlab.load_model(single)
    one_line(error)
    (single / "model.safetensors").write_bytes(data[:5])
    with pytest.raises(attnlab.DataError, match="model.safetensors"):
        attnlab.load_model(single)

    from safetensors.torch import load_file, save_file

    missing = save(random_model(), tmp_path / "missing")
    tensors = load_file(missing / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, missing / "model.safetensors")
    with pytest.raises(attnlab.DataError, match="missing tensor.*layers.1.mlp.up_proj"):
        attnlab.load_model(missing)
    tensors["model.layers.1.mlp.up_proj.weight"] = torch.zeros(96, 64)
    tensors["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(64)
    save_file(tensors, missing / "model.safetensors")
    with pytest.raises(attnlab.DataError, match="unexpected tensor 'model.layers.0.self_attn.q_proj.bias'"):
        attnlab.load_model(missing)
    del tensors["model.layers.0.self_attn.q_proj.bias"]
    tensors["model.norm.weight"] = torch.ones(32)
    save_file(tensors, missing / "model.safetensors")
    with pytest.raises(attnlab.DataError, match=r"model.norm.weight' has shape \(32,\), the config implies \(64,\)"):
        attnlab.load_model(missing)

    no_tokenizer = save(random_model(), tmp_path / "no_tokenizer")
    (no_tokenizer / "tokenizer.json").unlink()
    with pytest.raises(attnlab.DataError, match="no_tokenizer/tokenizer.json: not found") as error:
        attnlab.load_model(no_tokenizer)
    one_line(error)

    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_bytes((single / "config.json").read_bytes())
    (pickled / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(attnlab.DataError, match="pytorch_model.bin are pickle files, never loaded"):
        attnlab.load_model(pickled)
    with pytest.raises(attnlab.DataError, match="no such file or folder"):
        attnlab.load_model(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(attnlab.DataError, match="no config.json naming a model"):
        attnlab.load_model(tmp_path / "empty")
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(attnlab.DataError, match="not a GGUF file"):
        attnlab.load_model(tmp_path / "notes.txt")


def test_hub_references(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNLAB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))  # an empty Hugging Face cache
    monkeypatch.delenv("ATTNLAB_DATA", raising=False)
    hf = random_model()
    save(hf, tmp_path / "data" / "models" / "someone" / "tiny-llama")
    cfg, model, tokenizer = attnlab.load_model("hf:someone/tiny-llama", data_dir=tmp_path / "data")
    assert cfg.name == "hf:someone/tiny-llama" and tokenizer.name == "hf:someone/tiny-llama"
    tokens = torch.tensor([[5, 6, 7]])
    with torch.no_grad():
        torch.testing.assert_close(model(tokens, use_cache=False)[0], hf(tokens).logits, atol=1e-4, rtol=0)
    with pytest.raises(attnlab.DataError, match="hf:someone/absent: not found \\(looked in .*someone/absent") as error:
        attnlab.load_model("hf:someone/absent", data_dir=tmp_path / "data")
    one_line(error)
    for bad in ("hf:", "hf:name-only", "hf:a/b/c", "hf:a/b@", "hf:../etc"):
        with pytest.raises(attnlab.InputError, match="not a Hub reference"):
            attnlab.load_model(bad)


def test_attnlab_checkpoints_load_through_the_same_call(tmp_path):
    from helpers import tiny_model

    from attnlab.train.checkpoint import save_checkpoint

    model = tiny_model(perturb=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    save_checkpoint(tmp_path / "run", model, optimizer, {"step": 3}, {"model": model.cfg.to_dict()})
    cfg, loaded, tokenizer = attnlab.load_model(tmp_path / "run")
    assert cfg == model.cfg and tokenizer is None
    tokens = torch.randint(0, cfg.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(loaded(tokens, use_cache=False)[0], model(tokens, use_cache=False)[0])
    _, half, _ = attnlab.load_model(tmp_path / "run" / "checkpoints" / "step-000003", dtype=torch.bfloat16)
    assert half.embed.weight.dtype == torch.bfloat16
    # A run's data config names its tokenizer (byte: fixed, so no prepared folder is needed).
    config = {"model": model.cfg.to_dict(), "data": {"source": "tinyshakespeare", "tokenizer": "byte"}}
    save_checkpoint(tmp_path / "run2", model, optimizer, {"step": 1}, config)
    assert attnlab.load_model(tmp_path / "run2")[2].name == "byte"


# ----------------------------------------------------------------------------- commands take references


def test_info_reads_a_reference_without_its_weights(tmp_path, capsys):
    """`attnlab info FOLDER` gives the parameters and KV bytes of the pretrained shape, as the loaded model counts
    them, with a KV policy and with a memory."""
    from attnlab.accounting import kv_report, param_counts
    from attnlab.cli import main

    folder = save(random_model("llama", n_kv_heads=2), tmp_path / "m")
    cfg, model, _ = attnlab.load_model(folder)
    assert main(["info", str(folder), "--json", "--kv-policy", "k=q8_0,v=q8_0", "--dtype", "fp32"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["params"] == param_counts(model)
    assert report["kv_bytes"] == kv_report(cfg, "fp32", policy="k=q8_0,v=q8_0")["kv_bytes"]
    assert main(["info", str(folder), "--json", "--memory", "kind=window,recent_window=16"]) == 0
    assert json.loads(capsys.readouterr().out)["memory"]["slots"] == 16
    assert main(["info", str(folder), "--memory", "kind=window,recent_wndow=16"]) == 2
    assert "recent_wndow" in capsys.readouterr().err


def test_generate_continues_a_prompt_as_transformers_does(tmp_path, capsys):
    """`attnlab generate FOLDER PROMPT` (greedy) prints the prompt and the tokens transformers' greedy generate
    gives, the prompt read as the model reads one (BOS first); --chat renders the model's chat template."""
    from attnlab.cli import main

    hf = random_model("llama", n_kv_heads=2)
    folder = save(hf, tmp_path / "m")
    tokenizer = tokenizer_from_folder(folder)
    prompt = "the cat is here"
    ids = tokenizer.encode_prompt(prompt)
    assert ids[0] == 1  # <s>
    with torch.no_grad():
        want = hf.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False, eos_token_id=None)[0, len(ids) :]
    assert main(["generate", str(folder), prompt, "--max-new-tokens", "6"]) == 0
    expected = want.tolist()
    stop = next((i for i, t in enumerate(expected) if t in tokenizer.stop_ids), None)
    expected = expected if stop is None else expected[:stop]
    assert capsys.readouterr().out == prompt + tokenizer.decode(expected) + "\n"
    assert tokenizer.encode_chat("hi") == tokenizer.encode("<s>hi</s>", prompt=True)[1:]  # TEMPLATE, no extra BOS


def test_a_pretrained_model_is_scored_on_a_named_dataset_with_its_own_tokenizer(tmp_path, data_dir):
    """perplexity.dataset: the test split of WikiText-2 raw, read through the model's tokenizer (a pretrained model
    has no prepared data), every window scored as the plain forward pass scores it."""
    import lzma

    import torch.nn.functional as F

    from attnlab.eval import load_for_eval
    from attnlab.eval.perplexity import dataset_split, run_perplexity

    model = load_for_eval(save(random_model("llama", n_kv_heads=2), tmp_path / "m"))
    tokens = dataset_split(model, "wikitext2-raw", "test", data_dir)
    with lzma.open(data_dir / "wikitext-2" / "wiki.test.raw.xz", "rt", encoding="utf-8") as f:
        start = f.read(2000)
    assert model.tokenizer.decode(tokens[:200].tolist()) in start  # the split's own text, from its start
    record = run_perplexity(model, dataset="wikitext2-raw", seq_len=32, max_tokens=128, data_dir=data_dir)
    with torch.no_grad():
        windows = torch.as_tensor(tokens[:129]).unfold(0, 33, 32)  # 4 windows of 32 scored tokens
        losses = [F.cross_entropy(model.model(w[None, :-1], use_cache=False)[0][0], w[1:]) for w in windows]
    assert record["dataset"] == "wikitext2-raw" and record["tokens"] == 128
    assert abs(record["ppl"] - float(torch.stack(losses).mean().exp())) < 1e-3 * record["ppl"]


def test_every_held_out_benchmark_reads_a_named_dataset_for_a_pretrained_model(tmp_path, data_dir):
    """kv_quant, needle (heldout filler), context_sweep and rope_extrapolation take `dataset` as perplexity does:
    the same tokens dataset_split gives, and the record names the dataset."""
    from attnlab.eval import load_for_eval
    from attnlab.eval.harness import BENCHMARKS, check_benchmarks
    from attnlab.eval.kvquant import held_out_windows, run_kv_eval
    from attnlab.eval.longctx import heldout_tokens, run_needle
    from attnlab.eval.perplexity import dataset_split

    model = load_for_eval(save(random_model("llama", n_kv_heads=2), tmp_path / "m"))
    tokens = dataset_split(model, "wikitext2-raw", "test", data_dir)
    windows = held_out_windows(model, "test", 33, 100, data_dir, dataset="wikitext2-raw")
    assert windows.tolist() == torch.as_tensor(tokens[:99]).view(3, 33).tolist()
    got, origin = heldout_tokens(model, data_dir=data_dir, dataset="wikitext2-raw")
    assert origin == "wikitext2-raw:test" and got.tolist() == tokens.tolist()
    rows = run_kv_eval(model, ["k=q8_0,v=q8_0"], seq_len=32, max_tokens=66, data_dir=data_dir, dataset="wikitext2-raw")
    assert rows[0]["dataset"] == "wikitext2-raw" and rows[0]["tokens"] == 64
    for name in ("kv_quant", "needle", "context_sweep", "rope_extrapolation", "perplexity"):
        filler = {"filler": "heldout"} if name == "needle" else {}  # the sentences filler reads no dataset
        assert check_benchmarks({name: {"dataset": "wikitext2-raw", **filler}}) == []
    needle = BENCHMARKS["needle"](model, tmp_path, data_dir, lengths=[60], depths=[0.5], trials=1, filler="heldout",
                                  dataset="wikitext2-raw")  # fmt: skip
    assert needle[0]["filler"] == "wikitext2-raw:test"
    cell = run_needle(model, lengths=[60], depths=[0.5], trials=1, filler="heldout", data_dir=data_dir,
                      dataset="wikitext2-raw", intro="", needle="{key}", question="")[0]  # fmt: skip
    assert cell["status"] == "ok" and cell["filler"] == "wikitext2-raw:test" and cell["trials"] == 1


def test_the_demo_says_where_it_looked_for_the_pretrained_model(tmp_path, monkeypatch, capsys):
    from attnlab.demo import pretrained

    monkeypatch.setenv("ATTNLAB_DATA", str(tmp_path))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    pretrained(str(tmp_path))
    out = capsys.readouterr().out
    assert "skipped:" in out and "SmolLM2-135M-Instruct.Q4_1.gguf" in out
