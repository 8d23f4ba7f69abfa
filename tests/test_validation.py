"""Every bad input is one typed error naming the key (or file) and nothing is silently wrong: types before any
lookup, finite and in-range numbers, strict YAML, checks `run` would make made by `validate` too, safe names."""

import math
from pathlib import Path

import pytest

from attnlab.attention.mha import MHAConfig
from attnlab.cli import main
from attnlab.config import DataConfig, MemoryConfig, ModelConfig, TrainConfig, section_from_dict
from attnlab.config_io import load_config, model_config_from_dict, read_yaml
from attnlab.errors import ConfigError, DataError, InputError
from attnlab.manifest import Manifest, RunSpec, file_kind, load_manifest, parse_set
from attnlab.memory.store import check_name as check_memory_name
from attnlab.paths import check_name, name_problem
from attnlab.runner import run_manifest

BASE = {"vocab_size": 100, "d_model": 64, "n_layers": 2, "n_heads": 8}
CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def refused(error, *fragments: str) -> str:
    """The error's message, asserted to be one line holding every fragment."""
    message = str(error.value)
    assert "\n" not in message, message
    for fragment in fragments:
        assert fragment in message, (fragment, message)
    return message


# ----------------------------------------------------------------------------- types


@pytest.mark.parametrize(
    "config, fragment",
    [
        ({"attention": {"kind": ["mha"]}}, "attention.kind=['mha'] must be str, got list"),
        ({"attention": {"kind": None}}, "attention.kind=None must be str"),
        ({"memory": {"kind": ["window"]}}, "memory.kind=['window'] must be str, got list"),
        ({"memory": {"kind": {"a": 1}}}, "memory.kind={'a': 1} must be str"),
        ({"d_model": True}, "d_model=True must be int, got bool"),
        ({"n_layers": 2.0}, "n_layers=2.0 must be int"),
        ({"tie_embeddings": 1}, "tie_embeddings=1 must be bool, got int"),
        ({"rope_base": True}, "rope_base=True must be float, got bool"),
        ({"norm_eps": [1e-5]}, "norm_eps=[1e-05] must be float"),
        ({"name": ["x"]}, "name=['x'] must be str, got list"),
        ({"mlp": {"kind": "gelu"}}, "mlp={'kind': 'gelu'} must be str"),
        ({"d_ff": "wide"}, "d_ff='wide' must be int or null"),
        ({"attention": {"kind": "mha", "n_kv_heads": "2"}}, "attention.n_kv_heads='2' must be int or null"),
        ({"attention": {"kind": "mla", "d_latent": 8.5}}, "attention.d_latent=8.5 must be int"),
        ({"attention": {"kind": "decoupled", "d_sem": 16, "d_geo": 32, "gate": 1}}, "attention.gate=1 must be bool"),
        ({"attention": {"kind": "coda", "head_norm": "no"}}, "attention.head_norm='no' must be bool"),
        ({"attention": {"kind": "coda", "gate_bias": False}}, "attention.gate_bias=False must be float"),
        ({"memory": {"kind": "bounded", "detach_evicted": 0}}, "memory.detach_evicted=0 must be bool"),
        ({"memory": {"kind": "window", "block": True}}, "memory.block=True must be int or null"),
        ({"attention": {"kind": "mha", 1: 2}}, "attention: key 1 must be a name"),
        ({"attention": ["mha"]}, "attention must be a mapping"),
        ({"memory": "bounded"}, "memory must be a mapping"),
    ],
)
def test_a_wrong_type_is_refused_naming_key_value_and_type(config, fragment):
    with pytest.raises(ConfigError) as error:
        model_config_from_dict({**BASE, **config})
    refused(error, fragment)


@pytest.mark.parametrize(
    "section, key, value, fragment",
    [
        (TrainConfig, "steps", True, "train.steps=True must be int, got bool"),
        (TrainConfig, "seq_len", "long", "train.seq_len='long' must be int"),
        (TrainConfig, "compile", 1, "train.compile=1 must be bool"),
        (TrainConfig, "lr", [0.1], "train.lr=[0.1] must be float"),
        (TrainConfig, "optimizer", ["adamw"], "train.optimizer=['adamw'] must be str"),
        (TrainConfig, "grad_clip", "off", "train.grad_clip='off' must be float or null"),
        (DataConfig, "source", ["wikitext2"], "data.source=['wikitext2'] must be str"),
        (DataConfig, "tokenizer", 2, "data.tokenizer=2 must be str"),
        (DataConfig, "max_tokens", 1.5, "data.max_tokens=1.5 must be int or null"),
    ],
)
def test_a_wrong_type_in_data_or_train_is_refused(section, key, value, fragment):
    where = "train." if section is TrainConfig else "data."
    with pytest.raises(ConfigError) as error:
        section_from_dict(section, {key: value}, where)
    refused(error, fragment)


@pytest.mark.parametrize(
    "build, fragment",
    [
        (lambda: ModelConfig(vocab_size="10", d_model=64, n_layers=1, n_heads=8), "vocab_size='10' must be int"),
        (lambda: ModelConfig(vocab_size=10, d_model=64, n_layers=1, n_heads=8, attention="mha"), "attention='mha'"),
        (lambda: MHAConfig(head_dim="8"), "attention.head_dim='8' must be int or null"),
        (lambda: MemoryConfig(recent_window=True), "memory.recent_window=True must be int"),
        (lambda: DataConfig(source=1), "data.source=1 must be str"),
        (lambda: TrainConfig(seed=-1), "train.seed=-1 must be >= 0"),
        (lambda: TrainConfig(lr=math.nan), "train.lr=nan must be a finite number"),
    ],
)
def test_direct_construction_checks_types_first(build, fragment):
    with pytest.raises(ConfigError) as error:
        build()
    refused(error, fragment)


# ----------------------------------------------------------------------------- numbers


@pytest.mark.parametrize(
    "config, fragment",
    [
        ({"norm_eps": math.nan}, "norm_eps=nan must be a finite number"),
        ({"norm_eps": 0.0}, "norm_eps=0.0 must be > 0"),
        ({"norm_eps": 2.0}, "norm_eps=2.0 must be > 0 and < 1"),
        ({"rope_base": math.inf}, "rope_base=inf must be a finite number"),
        ({"rope_base": -math.inf}, "rope_base=-inf must be a finite number"),
        ({"rope_base": 10**400}, "rope_base=1000"),  # an int too large for a float
        ({"rope_base": 1.0}, "rope_base=1.0 must be > 1"),
        ({"init_std": -1}, "init_std=-1.0 must be > 0"),
        ({"init_std": 0}, "init_std=0.0 must be > 0"),
        ({"d_model": 10**40}, "d_model=1000"),
        ({"n_layers": 10**40}, "is too large (at most 4,096)"),
        ({"vocab_size": -(10**40)}, "vocab_size=-1000"),
        ({"max_seq_len": 2**40}, "max_seq_len=1099511627776 is too large (at most 2,147,483,647)"),
        ({"d_ff": 0}, "d_ff=0 must be >= 1"),
        ({"attention": {"kind": "mha", "head_dim": 0}}, "attention.head_dim=0 must be >= 1 (or leave it out"),
        ({"attention": {"kind": "coda", "head_dim": 0}}, "attention.head_dim=0 must be >= 1"),
        ({"attention": {"kind": "diff", "head_dim": -4}}, "attention.head_dim=-4 must be >= 1"),
        ({"attention": {"kind": "sliding", "head_dim": 0}}, "attention.head_dim=0 must be >= 1"),
        ({"attention": {"kind": "mla", "d_latent": 8, "head_dim": 0}}, "attention.head_dim=0 must be >= 1"),
        ({"attention": {"kind": "mla", "d_latent": 8, "v_head_dim": 0}}, "attention.v_head_dim=0 must be >= 1"),
        ({"attention": {"kind": "mha", "n_kv_heads": 0}}, "attention.n_kv_heads=0 must divide n_heads=8"),
        ({"attention": {"kind": "decoupled", "d_sem": 16, "d_geo": 32, "d_v": 0}}, "attention.d_v=0 must be a"),
        ({"attention": {"kind": "sliding", "window": 10**40}}, "attention.window=1000"),
        ({"attention": {"kind": "coda", "gate_bias": math.inf}}, "attention.gate_bias=inf must be a finite number"),
        ({"memory": {"kind": "bounded", "tau_gate": math.nan}}, "memory.tau_gate=nan must be a finite number"),
        ({"memory": {"kind": "bounded", "tau_match": 1.5}}, "memory.tau_match=1.5 must be in [0, 1]"),
        ({"memory": {"kind": "window", "recent_window": 10**40}}, "memory.recent_window=1000"),
        ({"memory": {"kind": "window", "block": 0}}, "memory.block=0 must be >= 1"),
    ],
)
def test_nan_inf_zero_and_huge_values_are_refused(config, fragment):
    with pytest.raises(ConfigError) as error:
        model_config_from_dict({**BASE, **config})
    refused(error, fragment)


@pytest.mark.parametrize(
    "section, key, value, fragment",
    [
        (TrainConfig, "lr", math.nan, "train.lr=nan must be a finite number"),
        (TrainConfig, "lr", "nan", "train.lr=nan must be a finite number"),  # read from a string, as 3e-4 is
        (TrainConfig, "lr", 0, "train.lr=0.0 must be > 0"),
        (TrainConfig, "eps", 0, "train.eps=0.0 must be > 0"),
        (TrainConfig, "beta2", 1.0, "train.beta2=1.0 must be in [0, 1)"),
        (TrainConfig, "beta1", -0.1, "train.beta1=-0.1 must be in [0, 1)"),
        (TrainConfig, "weight_decay", -0.1, "train.weight_decay=-0.1 must be >= 0"),
        (TrainConfig, "min_lr_ratio", 1.5, "train.min_lr_ratio=1.5 must be in [0, 1]"),
        (TrainConfig, "grad_clip", math.inf, "train.grad_clip=inf must be a finite number"),
        (TrainConfig, "grad_clip", 0, "train.grad_clip=0.0 must be > 0"),
        (TrainConfig, "steps", 10**40, "train.steps=1000"),
        (TrainConfig, "steps", 0, "train.steps=0 must be >= 1"),
        (TrainConfig, "warmup_steps", -1, "train.warmup_steps=-1 must be >= 0"),
        (TrainConfig, "eval_tokens", 0, "train.eval_tokens=0 must be >= 1"),
        (TrainConfig, "seed", -1, "train.seed=-1 must be >= 0"),
        (TrainConfig, "seed", 2**32, "train.seed=4294967296 is too large (at most 4,294,967,295)"),
        (TrainConfig, "device", "cuda:x", "train.device='cuda:x' is not known"),
        (DataConfig, "val_fraction", math.nan, "data.val_fraction=nan must be a finite number"),
        (DataConfig, "test_fraction", 1.0, "data.test_fraction=1.0 must be in [0, 1)"),
        (DataConfig, "max_tokens", 0, "data.max_tokens=0 must be >= 1"),
        (DataConfig, "max_tokens", 10**40, "data.max_tokens=1000"),
        (DataConfig, "tokenizer", "bpe:10", "data.tokenizer='bpe:10': a byte-level BPE needs 257"),
        (DataConfig, "tokenizer", "bpe:\u0663\u0660\u0660", "is not known"),  # not ASCII digits
        (DataConfig, "source", "wikitext3", "data.source='wikitext3' is not a known dataset"),
        (DataConfig, "source", "notes.docx", "data.source='notes.docx' is not a known dataset"),
    ],
)
def test_out_of_range_train_and_data_values_are_refused(section, key, value, fragment):
    where = "train." if section is TrainConfig else "data."
    with pytest.raises(ConfigError) as error:
        section_from_dict(section, {key: value}, where)
    refused(error, fragment)


def test_valid_edges_are_accepted_and_keep_their_hash():
    cfg = model_config_from_dict({**BASE, "rope_base": 10000, "init_std": 1})  # ints where floats go
    assert cfg.rope_base == 10000.0 and isinstance(cfg.rope_base, float)
    assert (
        cfg.config_hash() == model_config_from_dict({**BASE, "rope_base": 10000.0}).replace(init_std=1.0).config_hash()
    )
    assert TrainConfig(seed=2**32 - 1, warmup_steps=0).seed == 2**32 - 1
    assert DataConfig(source="corpus/notes.jsonl.gz", max_tokens=10**10).max_tokens == 10**10
    assert DataConfig(source="/abs/path/book.txt", tokenizer="bpe:257").tokenizer == "bpe:257"
    assert TrainConfig(device="cuda:1").device == "cuda:1"
    mla = model_config_from_dict({**BASE, "attention": {"kind": "mla", "d_latent": 8, "head_dim": 4, "v_head_dim": 6}})
    assert mla.attention.dims(mla) == (4, 2, 6)


# ----------------------------------------------------------------------------- options of another kind


@pytest.mark.parametrize(
    "config, fragment",
    [
        ({"attention": {"kind": "mha", "window": 8}}, "attention.window belongs to attention kind sliding, not mha"),
        ({"attention": {"kind": "mha", "d_sem": 8}}, "attention.d_sem belongs to attention kind decoupled, not mha"),
        ({"attention": {"kind": "sliding", "gate_bias": -2.0}}, "attention.gate_bias belongs to attention kind coda"),
        ({"memory": {"kind": "window", "exact_slots": 8}}, "memory.exact_slots belongs to memory.kind bounded, not"),
        ({"memory": {"kind": "none", "recent_window": 8}}, "memory.recent_window belongs to memory.kind window"),
        ({"memory": {"kind": "h2o", "sink_tokens": 2}}, "memory.sink_tokens belongs to memory.kind streaming or quest"),
    ],
)
def test_an_option_of_another_kind_says_whose_it_is(config, fragment):
    with pytest.raises(ConfigError) as error:
        model_config_from_dict({**BASE, **config})
    refused(error, fragment)


# ----------------------------------------------------------------------------- YAML files and --set


@pytest.mark.parametrize(
    "text, fragments",
    [
        ("vocab_size: 100\nd_model: 64\nd_model: 128\n", ["key 'd_model' is given twice", "line 3", "first at line 2"]),
        ("attention:\n  kind: mha\n  kind: sliding\n", ["key 'kind' is given twice", "line 3, column 3"]),
        ("vocab_size: [1,\n", ["not valid YAML at line 2"]),
        ("a: 'open\n", ["not valid YAML at line"]),
        ("a: b: c\n", ["not valid YAML at line 1"]),
        ('a: "x\x01"\n', ["not valid YAML at line 1", "0x01"]),
        ("? [1]\n: 2\n", ["not valid YAML at line 1", "unhashable key"]),
    ],
)
def test_bad_yaml_is_one_line_naming_file_and_line(tmp_path, text, fragments):
    path = tmp_path / "bad.yaml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(ConfigError) as error:
        read_yaml(path)
    refused(error, "bad.yaml: ", *fragments)


def test_a_merge_may_override_what_it_brings(tmp_path):
    path = tmp_path / "merge.yaml"
    path.write_text("base: &b {x: 1, y: 2}\nd: {<<: *b, x: 3}\n")
    assert read_yaml(path) == {"base": {"x": 1, "y": 2}, "d": {"x": 3, "y": 2}}


def test_a_file_that_is_not_utf8_or_not_a_file_is_a_config_error(tmp_path):
    latin = tmp_path / "latin.yaml"
    latin.write_bytes("name: caf\u00e9\n".encode("latin-1"))
    with pytest.raises(ConfigError) as error:
        load_config(latin)
    refused(error, "latin.yaml: not UTF-8 text (byte 0xe9 at offset 9)")
    assert file_kind(latin) == "model"  # not read as a manifest: load_config names the file
    with pytest.raises(ConfigError) as error:
        read_yaml(tmp_path)  # a folder
    refused(error, f"{tmp_path}: cannot read the file")


def test_duplicate_keys_in_a_manifest_are_refused(tmp_path):
    path = tmp_path / "m.yml"
    path.write_text(MANIFEST.replace("targets:\n", "targets:\n  base: {train: {steps: 3}}\n", 1))
    with pytest.raises(ConfigError) as error:
        load_manifest(path)
    refused(error, "m.yml: ", "key 'base' is given twice")


@pytest.mark.parametrize(
    "item, fragment",
    [
        ("train.lr='3e-4", '--set "train.lr=\'3e-4": the value "\'3e-4" is not valid YAML at line 1'),
        ('data.source="wiki', "--set 'data.source=\"wiki'"),
        ("model.attention={kind: mha", "model.attention={kind: mha"),
        ("model.d_model=[64", "model.d_model=[64"),
        ("train.lr={a: 1, a: 2}", "key 'a' is given twice"),
        ("lr=3", "must look like model.KEY=VALUE"),
        ("train..lr=3", "must look like model.KEY=VALUE"),
    ],
)
def test_a_bad_set_override_is_one_line_naming_it(item, fragment):
    with pytest.raises(ConfigError) as error:
        parse_set([item])
    refused(error, fragment)


def test_set_into_a_value_is_refused():
    with pytest.raises(ConfigError) as error:
        parse_set(["model.attention=mha", "model.attention.kind=mha"])
    refused(error, "model.attention is set to a value by an earlier --set")


# ----------------------------------------------------------------------------- names


@pytest.mark.parametrize("name", ["base", "dba_null", "v1.2", "run-7", "gqa 2", "x" * 100, "caf\u00e9"])
def test_plain_names_are_names(name):
    assert name_problem(name, "name") is None and check_name(name, "name") == name


@pytest.mark.parametrize(
    "name, fragment",
    [
        ("", "must not be empty"),
        ("../up", "must not contain a path separator"),
        ("a/b", "must not contain a path separator"),
        ("a\\b", "must not contain a path separator"),
        ("..", "must not contain '..'"),
        ("a..b", "must not contain '..'"),
        (".hidden", "must not start with '.'"),
        ("tab\there", "must not contain control characters"),
        ("new\nline", "must not contain control characters"),
        ("nul\x00", "must not contain control characters"),
        ("rtl\u202eexe", "must not contain control characters"),
        (" padded", "must not start or end with white space"),
        ("x" * 101, "is 101 characters long (at most 100)"),
        (["x"], "must be a string (a name), got list"),
        (7, "must be a string (a name), got int"),
        (None, "must be a string (a name), got NoneType"),
    ],
)
def test_unsafe_names_are_refused(name, fragment):
    assert fragment in name_problem(name, "target name")
    with pytest.raises(ConfigError) as error:
        check_name(name, "target name")
    refused(error, "target name", fragment)
    with pytest.raises(InputError, match="memory name"):
        check_memory_name(name)


# ----------------------------------------------------------------------------- manifests

MANIFEST = """\
name: demo
seeds: [0, 1]
defaults:
  model: {d_model: 64, n_layers: 2, n_heads: 4, max_seq_len: 64}
  data: {source: tinyshakespeare, tokenizer: char}
  train: {steps: 10, seq_len: 32}
targets:
  base: {}
  two:
    phases:
      - {name: short, train: {steps: 5}}
      - {name: long, train: {steps: 3}}
"""


def edit(text: str, old: str, new: str) -> str:
    assert old in text, old
    return text.replace(old, new, 1)


@pytest.mark.parametrize(
    "old, new, fragment",
    [
        # types where a name goes
        ("name: demo", "name: [demo]", "name=['demo'] must be a string (a name), got list"),
        ("name: demo", "name: 7", "name=7 must be a string"),
        (
            "  base: {}",
            "  base: {init_from: [two]}",
            "targets.base.init_from=['two'] must be a target name or a model reference, got list",
        ),
        ("  base: {}", "  1: {}", "targets: target name=1 must be a string"),
        ("{name: short,", "{name: [short],", "targets.two.phases[0]: phase name=['short'] must be a string"),
        ("{name: short,", "{name: {a: 1},", "phase name={'a': 1} must be a string"),
        ("{name: short,", "{name: 3,", "phase name=3 must be a string"),
        # unsafe names
        ("name: demo", "name: ../../escape", "name '../../escape' must not contain a path separator"),
        ("  base: {}", "  ../evil: {}", "targets: target name '../evil' must not contain a path separator"),
        ("  base: {}", "  .hidden: {}", "target name '.hidden' must not start with '.'"),
        ("  base: {}", '  "": {}', "target name must not be empty"),
        ("{name: short,", "{name: ../short,", "targets.two.phases[0]: phase name '../short' must not contain"),
        ("{name: short,", "{name: short,", None),  # (a control: valid)
        # seeds
        ("seeds: [0, 1]", "seeds: [-1]", "seeds[0]=-1 must be in 0 .. 4294967295"),
        ("seeds: [0, 1]", "seeds: [0, 4294967296]", "seeds[1]=4294967296 must be in 0 .. 4294967295"),
        ("seeds: [0, 1]", "seeds: [true]", "seeds[0]=True must be an integer, got bool"),
        ("seeds: [0, 1]", "seeds: [1, 1]", "seeds[1]=1 is given twice"),
        ("seeds: [0, 1]", "seeds: []", "seeds=[] must be a non-empty list of integers"),
        ("seeds: [0, 1]", "seeds: 3", "seeds=3 must be a non-empty list"),
        # shapes of sections
        ("    phases:\n", "    phases: []\n    x:\n", "targets.two.phases must be a non-empty list"),
        ("  base: {}", "  base: {phases: {name: a}}", "targets.base.phases must be a non-empty list"),
        ("  base: {}", "  base: {phases: [[1], {name: b}]}", "targets.base.phases[0] must be a mapping, got [1]"),
        ("  base: {}", "  base: {model: [1]}", "targets.base.model must be a mapping, got list"),
        ("  base: {}", "  base: {description: [1]}", "targets.base.description must be text"),
        ("name: demo", "name: demo\nvars: [1]", "vars must be a mapping of names to values, got list"),
        ("name: demo", "name: demo\nvars: {1: 2}", "vars: 1 is not a variable name"),
        ("name: demo", "name: demo\ndefaults: []", "key 'defaults' is given twice"),
        ("defaults:\n", "description: 3\ndefaults:\n", "description must be text, got int"),
        # what run would refuse once started
        ("seq_len: 32}", "seq_len: 128}", "targets.base: train.seq_len=128 exceeds model.max_seq_len=64"),
        ("source: tinyshakespeare", "source: tinyshakspeare", "data.source='tinyshakspeare' is not a known dataset"),
        ("tokenizer: char", "tokenizer: gpt2", None),
        ("max_seq_len: 64}", "max_seq_len: 64, vocab_size: 50}", None),  # char: the trainer checks its vocabulary
        ("train: {steps: 10,", "train: {seed: -3, steps: 10,", "train.seed=-3 must be >= 0"),
        ("train: {steps: 10,", "train: {seed: 5, steps: 10,", "targets.base: train.seed=5 would be ignored"),
        ("train: {steps: 10,", "train: {lr: .nan, steps: 10,", "train.lr=nan must be a finite number"),
        ("train: {steps: 10,", "train: {device: gpu, steps: 10,", "train.device='gpu' is not known"),
    ],
)
def test_manifest_problems_are_reported_naming_the_key(tmp_path, old, new, fragment):
    path = tmp_path / "m.yml"
    path.write_text(edit(MANIFEST, old, new))
    if fragment is None:  # a control: valid
        assert load_manifest(path).runs
        return
    with pytest.raises(ConfigError) as error:
        load_manifest(path)
    refused(error, "m.yml: ", fragment)


def test_a_vocab_size_below_a_fixed_tokenizers_is_refused(tmp_path):
    path = tmp_path / "m.yml"
    text = edit(MANIFEST, "max_seq_len: 64}", "max_seq_len: 64, vocab_size: 300}")
    path.write_text(edit(text, "tokenizer: char", "tokenizer: gpt2"))
    with pytest.raises(ConfigError) as error:
        load_manifest(path)
    refused(error, "targets.base: model.vocab_size=300 is smaller than tokenizer gpt2's 50257")
    path.write_text(text)  # char: its vocabulary depends on the data (the trainer checks it)
    assert load_manifest(path).runs[0].model["vocab_size"] == 300


def test_a_memory_model_also_trains_within_max_seq_len(tmp_path):
    path = tmp_path / "m.yml"
    memory = "max_seq_len: 64, memory: {kind: window, recent_window: 16}}"
    path.write_text(edit(edit(MANIFEST, "max_seq_len: 64}", memory), "seq_len: 32}", "seq_len: 128}"))
    with pytest.raises(ConfigError) as error:
        load_manifest(path)
    refused(error, "train.seq_len=128 exceeds model.max_seq_len=64 (a memory model too trains on at most")


def test_a_file_name_that_is_not_a_name_needs_a_name_key(tmp_path):
    path = tmp_path / ".hidden.yml"
    path.write_text(MANIFEST.replace("name: demo\n", ""))
    with pytest.raises(ConfigError) as error:
        load_manifest(path)
    refused(error, "'.hidden' must not start with '.'", "(set `name:`)")
    path.write_text(MANIFEST)
    assert load_manifest(path).name == "demo"


def test_a_null_section_changes_nothing(tmp_path):
    path = tmp_path / "m.yml"
    path.write_text(edit(MANIFEST, "  base: {}", "  base: {data: null, model: null}"))
    base = load_manifest(path).runs[0]
    assert base.data.source == "tinyshakespeare" and base.model["d_model"] == 64


def test_set_values_are_checked_like_file_values(tmp_path):
    path = tmp_path / "m.yml"
    path.write_text(MANIFEST)
    cases = {
        "train.steps=1e40": "train.steps='1e40' must be a whole number: 1e40 is read as text",
        "train.steps=10000000000000000000000000000000000000000": "train.steps=1000",
        "model.head_dim=0": "unknown key 'head_dim'",
        "model.attention.head_dim=0": "attention.head_dim=0 must be >= 1",
        "model.norm_eps=.nan": "norm_eps=nan must be a finite number",
        "data.source=[a]": "data.source=['a'] must be str",
        "train.seed=-1": "train.seed=-1 must be >= 0",
    }
    for item, fragment in cases.items():
        with pytest.raises(ConfigError) as error:
            load_manifest(path, sets=[item])
        refused(error, fragment)


# ----------------------------------------------------------------------------- the command line


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize(
    "old, new, fragment",
    [
        ("  base: {}", "  ../evil: {}", "target name '../evil' must not contain a path separator"),
        ("seq_len: 32}", "seq_len: 128}", "train.seq_len=128 exceeds model.max_seq_len=64"),
        ("source: tinyshakespeare", "source: wikitext3", "data.source='wikitext3' is not a known dataset"),
        ("seeds: [0, 1]", "seeds: [-1]", "seeds[0]=-1 must be in 0 .. 4294967295"),
        ("  base: {}", "  base: {init_from: [two]}", "init_from=['two'] must be a target name"),
        ("seq_len: 32}", "seq_len: 32, eval_tokens: 31}", "train.eval_tokens=31 is less than train.seq_len=32"),
        ("tokenizer: char}", "tokenizer: char, max_tokens: 32}", "data.max_tokens=32 leaves no training window"),
        ("seq_len: 32}", "seq_len: 32, trainable: [blocks.*.atn.*]}", "'blocks.*.atn.*' matches no parameter"),
    ],
)
def test_validate_and_dry_run_refuse_what_run_would(tmp_path, capsys, monkeypatch, old, new, fragment):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "m.yml"
    path.write_text(edit(MANIFEST, old, new))
    assert main(["validate", str(path)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()  # one line per problem
    assert all(line.startswith(f"{path}: ") for line in lines) and any(fragment in line for line in lines)
    assert main(["run", "--dry-run", str(path), "--out", str(tmp_path / "runs")]) == 2
    line = one_error_line(capsys)
    assert line.startswith("attnlab run: error: ") and fragment in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.yml"]  # nothing written, inside --out or out of it


@pytest.mark.parametrize(
    "content, fragment",
    [
        (b"name: caf\xe9\n", "not UTF-8 text"),
        (b"targets: {a: {}}\ntargets: {b: {}}\n", "key 'targets' is given twice"),
        (b"vocab_size: [1,\n", "not valid YAML at line 2"),
    ],
)
def test_validate_reports_unreadable_files_in_one_line(tmp_path, capsys, content, fragment):
    path = tmp_path / "bad.yml"
    path.write_bytes(content)
    assert main(["validate", str(path)]) == 2
    line = one_error_line(capsys)
    assert line.startswith(f"{path}: ") and fragment in line


def test_validate_with_a_bad_set_names_the_override(tmp_path, capsys):
    path = tmp_path / "m.yml"
    path.write_text(MANIFEST)
    assert main(["validate", str(path), "--set", "train.lr='3e-4"]) == 2
    assert '--set "train.lr=\'3e-4"' in one_error_line(capsys)


# ----------------------------------------------------------------------------- the runner


def spec(target: str, phase: str | None = None, source: str = "tinyshakespeare") -> RunSpec:
    data = DataConfig(source=source, tokenizer="char")
    return RunSpec(target, 0, phase, {**BASE, "max_seq_len": 64}, data, TrainConfig(steps=1, seq_len=32))


@pytest.mark.parametrize(
    "name, target, phase",
    [("demo", "../../outside", None), ("../outside", "base", None), ("demo", "base", "../../../../x")],
)
def test_the_runner_writes_only_inside_out(tmp_path, name, target, phase):
    """Names come checked from load_manifest; a Manifest made otherwise still cannot write outside --out."""
    manifest = Manifest(name, tmp_path / "m.yml", (0,), (spec(target, phase),))
    with pytest.raises(ConfigError) as error:
        run_manifest(manifest, tmp_path / "out" / "runs", dry_run=True, log=lambda *a: None)
    refused(error, "run folder", "outside", str((tmp_path / "out" / "runs").resolve()))
    assert not (tmp_path / "out").exists()


def test_dry_run_checks_that_local_data_files_exist(tmp_path):
    manifest = Manifest("demo", tmp_path / "m.yml", (0,), (spec("base", source=str(tmp_path / "missing.txt")),))
    with pytest.raises(DataError, match="missing.txt"):
        run_manifest(manifest, tmp_path / "runs", dry_run=True, log=lambda *a: None)
    (tmp_path / "missing.txt").write_text("some text\n")  # one document: the run would find a split empty
    logged = []
    with pytest.raises(ConfigError, match="1 of 1 runs would be refused"):
        run_manifest(manifest, tmp_path / "runs", dry_run=True, log=logged.append)
    assert "would be refused: " in logged[0] and "no document fell in the" in logged[0]
    (tmp_path / "missing.txt").write_text("\n\n".join(f"some text {i}" for i in range(40)))
    logged = []
    assert run_manifest(manifest, tmp_path / "runs", dry_run=True, log=logged.append) == [None]
    assert "would train 1 steps" in logged[0]


# ----------------------------------------------------------------------------- shipped configs


def test_shipped_configs_still_load_with_their_hashes():
    """The hashes of the shipped model configs (what records and checkpoints carry) are what they were."""
    hashes = {p.stem: load_config(p).config_hash() for p in sorted((CONFIGS / "models").glob("*.yaml"))}
    assert hashes["tiny-mha"] == "5556f10f9fc2" and hashes["dba-12l-decoupled"] == "63db52fa8512"
    assert hashes["mistral7b-bounded"] == "a466eda2f077" and hashes["tiny-mla"] == "ac2db2e77592"
    for name in ("quickstart", "wikitext2_suite", "fineweb_edu", "coda_factorial"):
        manifest = load_manifest(CONFIGS / f"{name}.yml")
        assert manifest.runs and all(r.train.seed in manifest.seeds for r in manifest.runs)
