"""Manifests: merging, variables, phases, seeds, --set overrides, and strict errors."""

from pathlib import Path

import pytest

from attnlab.errors import ConfigError
from attnlab.manifest import deep_merge, load_manifest, parse_set

CONFIGS = Path(__file__).resolve().parents[1] / "configs"

MANIFEST = """
name: demo
vars: {lr: 0.002, width: 64}
seeds: [3, 4]
defaults:
  model: {d_model: "${width}", n_layers: 2, n_heads: 4, max_seq_len: 64, attention: {kind: mha, n_kv_heads: 2}}
  data: {source: tinyshakespeare, tokenizer: char}
  train: {lr: "${lr}", steps: 10, seq_len: 32}
targets:
  base: {}
  dba:
    model: {attention: {kind: decoupled, d_sem: 8, d_geo: 16}}
    train: {lr: 0.001}
  two_phase:
    phases:
      - {name: short, train: {steps: 5}}
      - {name: long, train: {steps: 3, seq_len: 64}}
"""


def write(tmp_path, text, name="m.yml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_targets_seeds_and_phases_resolve(tmp_path):
    manifest = load_manifest(write(tmp_path, MANIFEST))
    assert manifest.name == "demo" and manifest.targets == ["base", "dba", "two_phase"]
    assert len(manifest.runs) == (1 + 1 + 2) * 2
    base = manifest.runs[0]
    assert (base.target, base.seed, base.phase) == ("base", 3, None)
    assert base.model["d_model"] == 64  # a whole-value ${var} keeps the variable's type
    assert base.train.lr == 0.002 and base.train.seed == 3  # each run's seed comes from `seeds`
    dba = next(r for r in manifest.runs if r.target == "dba")
    assert dba.train.lr == 0.001
    assert dba.model["attention"] == {"kind": "decoupled", "d_sem": 8, "d_geo": 16}  # another kind replaces
    phases = [(r.seed, r.phase, r.train.steps, r.train.seq_len) for r in manifest.runs if r.target == "two_phase"]
    assert phases == [(3, "short", 5, 32), (3, "long", 3, 64), (4, "short", 5, 32), (4, "long", 3, 64)]
    assert phases and manifest.runs[-1].run_dir(Path("runs")) == Path("runs/two_phase/seed4/long")
    assert base.model_config(vocab_size=65).vocab_size == 65  # the tokenizer's vocabulary fills in


def test_set_overrides_everything(tmp_path):
    manifest = load_manifest(write(tmp_path, MANIFEST), sets=["train.lr=3e-4", "model.attention.n_kv_heads=1"])
    assert {r.train.lr for r in manifest.runs} == {3e-4}
    assert manifest.runs[0].model["attention"]["n_kv_heads"] == 1
    assert parse_set(["train.grad_clip=null", "data.tokenizer=bpe:512"]) == {
        "train": {"grad_clip": None},
        "data": {"tokenizer": "bpe:512"},
    }


def test_every_problem_is_reported_with_nearest_names(tmp_path):
    text = MANIFEST.replace("seeds:", "seedz:").replace('lr: "${lr}"', 'lr: "${lrr}"')
    text = text.replace("train: {lr: 0.001}", "trian: {lr: 0.001}")
    text += "  broken:\n    model: {n_layer: 3}\n"
    with pytest.raises(ConfigError) as info:
        load_manifest(write(tmp_path, text))
    message = str(info.value)
    assert "m.yml" in message
    assert "unknown key 'seedz' (did you mean 'seeds'?)" in message
    assert "undefined variable ${lrr} (did you mean ${lr}?)" in message
    assert "unknown key targets.dba.'trian' (did you mean 'train'?)" in message
    assert "targets.broken.model: unknown key 'n_layer' (did you mean 'n_layers'?)" in message


def test_bad_set_values_are_errors(tmp_path):
    path = write(tmp_path, MANIFEST)
    with pytest.raises(ConfigError, match=r"train\.steps='many' must be int"):
        load_manifest(path, sets=["train.steps=many"])
    with pytest.raises(ConfigError, match="must look like model.KEY=VALUE"):
        load_manifest(path, sets=["lr=3"])
    with pytest.raises(ConfigError, match=r"n_kv_heads=3 must divide n_heads=4"):
        load_manifest(path, sets=["model.attention.n_kv_heads=3"])


def test_phases_need_unique_names(tmp_path):
    text = MANIFEST.replace("{name: long,", "{name: short,")
    with pytest.raises(ConfigError, match="names must be unique"):
        load_manifest(write(tmp_path, text))


def test_deep_merge_keeps_same_kind_options():
    base = {"attention": {"kind": "mha", "n_kv_heads": 2}, "d_model": 64}
    assert deep_merge(base, {"attention": {"n_kv_heads": 1}}) == {
        "attention": {"kind": "mha", "n_kv_heads": 1},
        "d_model": 64,
    }
    assert base["attention"]["n_kv_heads"] == 2  # inputs are not modified


@pytest.mark.parametrize("name", ["quickstart.yml", "wikitext2_suite.yml", "fineweb_edu.yml"])
def test_shipped_manifests_are_valid(name):
    manifest = load_manifest(CONFIGS / name)
    lrs = {(r.train.lr, r.train.schedule, r.train.warmup_steps, r.train.grad_clip) for r in manifest.runs}
    assert len(lrs) == 1  # the same learning rate, schedule and clipping for every target


def test_coda_factorial_gives_every_arm_the_same_budget():
    manifest = load_manifest(CONFIGS / "coda_factorial.yml")
    phase2 = [r for r in manifest.runs if r.init_from]
    assert {r.init_from for r in phase2} == {"gqa", "coda"} and len(phase2) == 6
    assert len({(r.train.steps, r.train.lr, r.train.seq_len, r.train.batch_size) for r in phase2}) == 1
    memories = {r.target: r.model_config(8192).memory for r in phase2}
    assert {m.slots for m in memories.values() if m.kind != "none"} == {96}  # one memory budget for all


@pytest.mark.parametrize("path", sorted((CONFIGS / "bench").glob("*.yml")), ids=lambda p: p.name)
def test_shipped_bench_manifests_name_real_benchmarks(path):
    import yaml

    from attnlab.eval.harness import check_benchmarks

    assert check_benchmarks(yaml.safe_load(path.read_text())["benchmarks"]) == []


@pytest.mark.parametrize("path", sorted((CONFIGS / "retrofit").glob("*.yml")), ids=lambda p: p.name)
def test_shipped_retrofit_manifests_start_every_target_from_smollm2_with_one_budget(path):
    """The SmolLM2 experiments: every target converted from (or continuing) the GGUF, with the model's own
    tokenizer, and the same training budget within each phase."""
    manifest = load_manifest(path)
    assert all(
        r.source is not None and r.source["model"].endswith("SmolLM2-135M-Instruct.Q4_1.gguf") for r in manifest.runs
    )
    assert {r.data.tokenizer for r in manifest.runs} == {manifest.runs[0].source["model"]}
    first, later = [r for r in manifest.runs if not r.init_from], [r for r in manifest.runs if r.init_from]
    for group in (first, later):
        assert len({(r.train.steps, r.train.lr, r.train.seq_len, r.train.batch_size) for r in group}) <= 1


@pytest.mark.slow
@pytest.mark.parametrize("path", sorted((CONFIGS / "retrofit").glob("*.yml")), ids=lambda p: p.name)
def test_shipped_retrofit_manifests_pass_every_check_run_makes_up_front(path, data_dir):
    """Conversions SmolLM2's weights can initialise, its tokenizer, trainable patterns that match, contexts that
    fit (what `run` checks before it starts, from the GGUF's metadata)."""
    from attnlab.retrofit import check_pretrained

    manifest = load_manifest(path)
    assert check_pretrained(list(manifest.runs), list(manifest.runs), data_dir) == []
