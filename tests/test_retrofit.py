"""Recovery fine-tuning from a pretrained model (issue 15 item 2): a manifest target with `init_from: <model
reference>` is converted once, reads its data with the model's own tokenizer and trains from the conversion."""

import json
import random

import pytest
import torch
from helpers import fails
from test_pretrained import random_model, save

import attnlab
from attnlab.cli import main
from attnlab.config import DataConfig
from attnlab.data import prepare
from attnlab.errors import ConfigError
from attnlab.manifest import load_manifest
from attnlab.runner import run_manifest
from attnlab.train.checkpoint import load_model_from_checkpoint

MANIFEST = """
name: retro
defaults:
  data: {{source: {corpus}, val_fraction: 0.2}}
  train: {{steps: 3, seq_len: 16, batch_size: 2, eval_every: 3, eval_tokens: 32, lr: 0.001, warmup_steps: 1}}
targets:
  mqa:
    init_from: {source}
    model: {{attention: {{kind: mha, n_kv_heads: 1}}}}
    train: {{trainable: ["blocks.*.attn.*"]}}
"""


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """A tiny Llama folder (2 KV heads, a byte-level BPE tokenizer) and a text corpus to fine-tune on."""
    folder = tmp_path_factory.mktemp("retro")
    source = save(random_model("llama", n_kv_heads=2), folder / "llama")
    rng = random.Random(0)
    words = "the cat is on the mat and this is the hat".split()
    corpus = folder / "text.txt"
    corpus.write_text("\n\n".join(" ".join(rng.choice(words) for _ in range(30)) for _ in range(60)))
    return source, corpus


def write(tmp_path, pretrained, text=MANIFEST, replace=()):
    source, corpus = pretrained
    text = text.format(corpus=corpus, source=source)
    for old, new in replace:
        assert old in text
        text = text.replace(old, new)
    path = tmp_path / "m.yml"
    path.write_text(text)
    return path


def quiet(*args, **kwargs):
    pass


def test_a_pretrained_target_trains_from_its_conversion_with_the_models_tokenizer(tmp_path, pretrained, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    source, corpus = pretrained
    manifest = load_manifest(write(tmp_path, pretrained))
    (spec,) = manifest.runs
    assert spec.source["model"] == str(source) and spec.data.tokenizer == str(source)  # the model's own tokenizer
    run_manifest(manifest, tmp_path / "runs", progress=False, log=quiet)
    converted = tmp_path / "runs/retro/mqa/converted"
    recipe = json.loads((converted / "config.json").read_text())["recipe"]
    assert recipe["attention"] == {"kind": "mha", "n_kv_heads": 1} and recipe["init_from"]["model"] == str(source)
    _, original, tokenizer = attnlab.load_model(source)
    _, cold = load_model_from_checkpoint(converted)
    cfg, tuned = load_model_from_checkpoint(tmp_path / "runs/retro/mqa/seed0", tag="last")
    assert cfg.attention.n_kv_heads == 1
    start, end, first = dict(cold.named_parameters()), dict(tuned.named_parameters()), dict(original.named_parameters())
    for name, p in end.items():
        if ".attn." in name:
            assert not torch.equal(p, start[name]), name  # trained, from the conversion
        else:
            assert torch.equal(p, start[name]) and torch.equal(p, first[name]), name  # frozen: the pretrained weights
    # the data and the run read the model's own tokenizer; the fine-tuned run loads with it
    text = "the cat is on the hat"
    prepared = prepare(DataConfig(source=str(corpus), tokenizer=str(source), val_fraction=0.2), tokenizer=tokenizer)
    assert prepared.tokenizer.encode(text) == tokenizer.encode(text) and prepared.vocab_size == tokenizer.vocab_size
    assert prepared.eot_id == tokenizer.eot_id
    _, _, run_tokenizer = attnlab.load_model(tmp_path / "runs/retro/mqa/seed0")
    assert run_tokenizer.encode(text) == tokenizer.encode(text) and run_tokenizer.add_bos == tokenizer.add_bos
    # its held-out split is scored as any run's (the prepared data found again by the tokenizer's fingerprint)
    assert main(["bench", str(tmp_path / "runs/retro/mqa/seed0"), "--benchmarks", "perplexity",
                 "--set", "perplexity.split=val", "--out", str(tmp_path / "bench")]) == 0  # fmt: skip
    # a second run: done already, and the conversion is reused (not made again)
    stamp = (converted / "model.safetensors").stat().st_mtime_ns
    summaries = run_manifest(manifest, tmp_path / "runs", progress=False, log=quiet)
    assert summaries[0]["steps"] == 3 and (converted / "model.safetensors").stat().st_mtime_ns == stamp


def test_phases_of_a_pretrained_target_continue_and_a_later_phase_adds_a_memory(tmp_path, pretrained, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    text = MANIFEST.replace(
        '    train: {{trainable: ["blocks.*.attn.*"]}}',
        "    phases:\n      - {{name: full}}\n"
        "      - {{name: bounded, model: {{memory: {{kind: bounded, recent_window: 8, exact_slots: 4, "
        "summary_slots: 4}}}}, train: {{steps: 2}}}}",
    )
    manifest = load_manifest(write(tmp_path, pretrained, text))
    run_manifest(manifest, tmp_path / "runs", progress=False, log=quiet)
    _, full = load_model_from_checkpoint(tmp_path / "runs/retro/mqa/seed0/full", tag="last")
    cfg, bounded = load_model_from_checkpoint(tmp_path / "runs/retro/mqa/seed0/bounded", tag="last")
    assert cfg.memory.kind == "bounded" and cfg.attention.n_kv_heads == 1
    before = dict(full.named_parameters())
    assert {n for n, _ in bounded.named_parameters()} - set(before) == {
        f"blocks.{i}.memory.{p}" for i in range(2) for p in ("write", "eta_logit")
    }
    assert any(not torch.equal(p, before[n]) for n, p in bounded.named_parameters() if n in before)


def test_a_changed_recipe_is_refused_rather_than_reusing_the_conversion(tmp_path, pretrained, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    run_manifest(load_manifest(write(tmp_path, pretrained)), tmp_path / "runs", progress=False, log=quiet)
    changed = load_manifest(write(tmp_path, pretrained, replace=[("n_kv_heads: 1", "n_kv_heads: 2")]))
    with pytest.raises(ConfigError, match="holds a conversion made with another recipe \\(attention: saved"):
        run_manifest(changed, tmp_path / "runs", progress=False, log=quiet)


@pytest.mark.parametrize(
    "old, new, message",
    [
        ("n_kv_heads: 1", "n_kv_heads: 3", "convert: attention.n_kv_heads=3 must divide n_heads=4"),
        ("blocks.*.attn.*", "blocks.*.attn.gate.*", "'blocks.*.attn.gate.*' matches no parameter"),
        ("val_fraction: 0.2", "val_fraction: 0.2, tokenizer: gpt2", "data.tokenizer='gpt2' is not the tokenizer of"),
        ("{kind: mha, n_kv_heads: 1}}", "{kind: mha}, d_model: 32}", "model.d_model: a pretrained model's d_model"),
        (
            "seq_len: 16, batch_size: 2, eval_every: 3, eval_tokens: 32",
            "seq_len: 128, batch_size: 2, eval_tokens: 256",
            "train.seq_len=128 exceeds the model's max_seq_len=64",
        ),
    ],
)
def test_what_a_pretrained_target_cannot_do_is_refused_by_validate_and_dry_run(tmp_path, pretrained, old, new,
                                                                              message, capsys):  # fmt: skip
    path = write(tmp_path, pretrained, replace=[(old, new)])
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    fails(capsys, ["run", str(path), "--dry-run", "--out", str(tmp_path / "runs")], message)
    assert not (tmp_path / "runs").exists()


def test_a_conversion_of_since_changed_source_files_is_refused_and_convert_only_needs_a_pretrained_target(
    tmp_path, pretrained, monkeypatch, capsys
):
    import shutil

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    source = shutil.copytree(pretrained[0], tmp_path / "source")
    path = write(tmp_path, (source, pretrained[1]))
    assert main(["run", str(path), "--out", str(tmp_path / "runs"), "--convert-only"]) == 0
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-6}))
    fails(capsys, ["run", str(path), "--out", str(tmp_path / "runs"), "--no-progress"],
          "conversion made with another recipe (the source's config.json changed since the conversion)")  # fmt: skip
    plain = tmp_path / "plain.yml"
    plain.write_text(f"name: p\ndefaults: {{model: {{d_model: 32, n_layers: 1, n_heads: 2}}, data: {{source: "
                     f"{pretrained[1]}, tokenizer: char}}}}\ntargets: {{a: {{}}}}\n")  # fmt: skip
    fails(capsys, ["run", str(plain), "--convert-only", "--out", str(tmp_path / "runs")],
          "--convert-only: no selected target starts from a pretrained model")  # fmt: skip


def test_an_init_from_model_that_is_not_there_is_one_line(tmp_path, pretrained, capsys):
    path = write(tmp_path, pretrained, replace=[(str(pretrained[0]), str(tmp_path / "nowhere/model.gguf"))])
    line = fails(capsys, ["run", str(path), "--out", str(tmp_path / "runs")], "targets.mqa.init_from:")
    assert "nowhere/model.gguf: no such file or folder" in line and not (tmp_path / "runs").exists()


def test_a_dry_run_checks_the_init_from_models_weights_as_the_run_does(tmp_path, pretrained, capsys):
    """Probe W: a truncated model.safetensors in the init_from folder was 'would train' in the dry run; the run
    refused it. Both now refuse with one line naming the file, before anything is written."""
    import shutil

    copy = tmp_path / "llama"
    shutil.copytree(pretrained[0], copy)
    weights = copy / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    path = write(tmp_path, pretrained, replace=[(str(pretrained[0]), str(copy))])
    for dry in (["--dry-run"], []):
        line = fails(capsys, ["run", str(path), *dry, "--out", str(tmp_path / "runs")], "targets.mqa.init_from:")
        assert f"{weights}: unreadable safetensors file" in line and not (tmp_path / "runs").exists()


def test_a_models_tokenizer_keys_prepared_data_by_its_contents(tmp_path, pretrained, monkeypatch):
    """Two names for one tokenizer share the prepared files; without the tokenizer object prepare says what it needs."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    source, corpus = pretrained
    tokenizer = attnlab.load_model(source)[2]
    one = prepare(DataConfig(source=str(corpus), tokenizer=str(source)), tokenizer=tokenizer)
    other = prepare(DataConfig(source=str(corpus), tokenizer=str(source) + "/"), tokenizer=tokenizer)
    assert one.path == other.path and one.path.name.startswith("text-llama-")
    with pytest.raises(ConfigError, match="names a model: its tokenizer is read from the model"):
        prepare(DataConfig(source=str(corpus), tokenizer=str(source)))


def test_a_model_trained_from_scratch_can_read_a_pretrained_models_tokenizer(tmp_path, pretrained, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    source, corpus = pretrained
    path = tmp_path / "m.yml"
    path.write_text(f"""
name: scratch
defaults:
  model: {{d_model: 32, n_layers: 1, n_heads: 2, max_seq_len: 32}}
  data: {{source: {corpus}, tokenizer: {source}, val_fraction: 0.2}}
  train: {{steps: 2, seq_len: 16, batch_size: 2, eval_every: 2, eval_tokens: 32, warmup_steps: 1}}
targets:
  small: {{}}
""")
    run_manifest(load_manifest(path), tmp_path / "runs", progress=False, log=quiet)
    tokenizer = attnlab.load_model(source)[2]
    cfg, _, run_tokenizer = attnlab.load_model(tmp_path / "runs/scratch/small/seed0")
    assert cfg.vocab_size >= tokenizer.vocab_size and run_tokenizer.encode("the hat") == tokenizer.encode("the hat")
    path.write_text(path.read_text().replace(str(source), str(tmp_path / "missing") + "/"))
    with pytest.raises(ConfigError, match="data.tokenizer: .*missing/: no such file or folder"):
        run_manifest(load_manifest(path), tmp_path / "runs2", dry_run=True, log=quiet)


FACTORIAL = """
name: fact
vars:
  bounded: {{kind: bounded, recent_window: 8, exact_slots: 4, summary_slots: 4}}
defaults:
  data: {{source: {corpus}, val_fraction: 0.2}}
  train: {{steps: 2, seq_len: 16, batch_size: 2, eval_every: 2, eval_tokens: 32, lr: 0.001, warmup_steps: 1,
          trainable: ["blocks.*.attn.*"]}}
targets:
  gqa: {{init_from: {source}}}
  coda: {{init_from: {source}, model: {{attention: {{kind: coda, gate_bias: -6.0}}}}}}
  gqa_bounded:
    init_from: gqa
    model: {{memory: "${{bounded}}"}}
    train: {{trainable: ["blocks.*.attn.*", "blocks.*.memory.*"]}}
  coda_bounded:
    init_from: coda
    model: {{memory: "${{bounded}}"}}
"""


def test_the_factorial_converts_each_attention_once_and_its_phase_two_arms_continue_them(
    tmp_path, pretrained, monkeypatch, capsys
):
    """{gqa, coda} x {full, bounded}: `--convert-only` makes the two cold models (nothing trained); the run trains
    gqa and coda from them, and gqa_bounded / coda_bounded from those runs' weights with a fresh memory (the
    attention their origin converted to, the memory their own)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path = write(tmp_path, pretrained, FACTORIAL)
    manifest = load_manifest(path)
    assert {s.target: s.source["target"] for s in manifest.runs} == {
        "gqa": "gqa", "coda": "coda", "gqa_bounded": "gqa", "coda_bounded": "coda"
    }  # fmt: skip
    assert manifest.runs[3].model["attention"] == {"kind": "coda", "gate_bias": -6.0}  # left out: coda's, inherited
    assert main(["run", str(path), "--out", str(tmp_path / "runs"), "--convert-only", "--no-progress"]) == 0
    root = tmp_path / "runs/fact"
    assert sorted(p.name for p in root.iterdir()) == ["coda", "gqa"]  # the two conversions, no run
    from attnlab.eval import load_for_eval

    assert load_for_eval(root / "coda/converted").name == "coda/converted"  # a table's label for the cold model
    assert sorted(p.name for p in (root / "coda").iterdir()) == ["converted"]
    run_manifest(manifest, tmp_path / "runs", progress=False, log=quiet)
    _, coda = load_model_from_checkpoint(root / "coda/seed0", tag="last")
    cfg, bounded = load_model_from_checkpoint(root / "coda_bounded/seed0", tag="last")
    assert (cfg.attention.kind, cfg.memory.kind) == ("coda", "bounded")
    before = dict(coda.named_parameters())
    assert {n for n, _ in bounded.named_parameters()} - set(before) == {
        f"blocks.{i}.memory.{p}" for i in range(2) for p in ("write", "eta_logit")
    }
    # frozen outside the attention: still the pretrained weights, two runs later
    _, original, _ = attnlab.load_model(pretrained[0])
    first = dict(original.named_parameters())
    assert all(torch.equal(p, first[n]) for n, p in bounded.named_parameters() if ".attn." not in n and n in first)
    assert not (root / "coda_bounded/converted").exists() and not (root / "gqa_bounded/converted").exists()
    changed = path.read_text().replace(
        'model: {memory: "${bounded}"}', "model: {attention: {kind: mha, n_kv_heads: 1}}"
    )
    path.write_text(changed)
    fails(capsys, ["run", str(path), "--dry-run", "--out", str(tmp_path / "r")],
          "targets.gqa_bounded.model.attention: gqa's conversion fixes the attention")  # fmt: skip
