"""Fuzzing the inputs a user writes: whatever they hold, the loaders either accept them or raise one of attnlab's
typed errors (AttnlabError, which the CLI prints as one line with exit code 2). Any other exception is a bug.

Covered: model configs as data (every ModelConfig key, nested attention and memory sections, values of every
type: huge and negative integers, NaN and infinities, strings, lists, dicts), manifests with `--set` overrides,
KV policy strings, and raw bytes as a config or manifest file. A config that is accepted must also work: its hash,
`attnlab info`'s report and a round trip through its own dict. Hypothesis is a test extra; the examples are
derandomised (fixed) and few, so the suite stays fast.
"""

from __future__ import annotations

import dataclasses
import math
import tempfile
from pathlib import Path

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from attnlab.accounting import info  # noqa: E402
from attnlab.cache.codecs import KVPolicy  # noqa: E402
from attnlab.config import MemoryConfig, ModelConfig  # noqa: E402
from attnlab.config_io import load_config, model_config_from_dict  # noqa: E402
from attnlab.errors import AttnlabError  # noqa: E402
from attnlab.manifest import load_manifest  # noqa: E402

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
FUZZ = settings(max_examples=200, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow])

MODEL_KEYS = [f.name for f in dataclasses.fields(ModelConfig) if f.name not in ("attention", "memory")]
MEMORY_KEYS = [f.name for f in dataclasses.fields(MemoryConfig)]
ATTENTION_KEYS = ["kind", "n_kv_heads", "d_attn", "null_attn", "d_sem", "d_geo", "d_latent", "d_rope", "window",
                  "gate_bias", "head_norm", "head_dim", "tie_qk", "lambda_init"]  # fmt: skip
KINDS = ["mha", "bottleneck", "decoupled", "mla", "sliding", "diff", "coda", "none", "window", "streaming", "h2o",
         "bounded", "absolute", "cache", "gated"]  # fmt: skip

# Values a YAML file or a --set override can hold, the plausible and the odd.
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-4, max_value=300),
    st.sampled_from([0, 1, 2, 4, 8, 16, 32, 64, 128, -1, 10**12, 10**40, -(10**40)]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, 0.5, 1.0, 1e-5, 1e-300, 1e300, float("nan"), float("inf"), -float("inf")]),
    st.sampled_from(KINDS),
    st.text(max_size=12),
)
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8),
                      inner, max_size=3), max_leaves=6)  # fmt: skip


def section(keys: list[str]):
    """A dict over known keys (and now and then an unknown one) with values of any type."""
    return st.dictionaries(st.sampled_from(keys) | st.text(max_size=10), values, max_size=6)


model_dicts = st.fixed_dictionaries(
    {},
    optional={
        **{key: values for key in MODEL_KEYS},
        "attention": section(ATTENTION_KEYS) | values,
        "memory": section(MEMORY_KEYS) | values,
    },
)


def plausible_base() -> dict:
    return {"vocab_size": 97, "d_model": 64, "n_layers": 2, "n_heads": 4, "max_seq_len": 64}


def check_accepted(cfg: ModelConfig) -> None:
    """What an accepted config must hold (no NaN or infinity anywhere) and support without a traceback."""

    def floats(x):
        if isinstance(x, dict):
            return [f for v in x.values() for f in floats(v)]
        if isinstance(x, (list, tuple)):
            return [f for v in x for f in floats(v)]
        return [x] if isinstance(x, float) else []

    assert all(math.isfinite(f) for f in floats(cfg.to_dict())), cfg.to_dict()
    cfg.config_hash()
    report = info(cfg, dtype="fp32")
    assert all(isinstance(n, int) and n >= 0 for n in report["params"].values())
    assert report["kv_bytes"] >= 0 and math.isfinite(report["kv_bytes"])
    again = model_config_from_dict(cfg.to_dict())
    assert again.config_hash() == cfg.config_hash()


@FUZZ
@given(model_dicts)
def test_any_model_config_data_is_accepted_or_refused_with_a_typed_error(data):
    try:
        cfg = model_config_from_dict(data)
    except AttnlabError:
        return
    check_accepted(cfg)


@FUZZ
@given(st.dictionaries(st.sampled_from(MODEL_KEYS), scalars, min_size=1, max_size=2),
       st.just({}) | st.dictionaries(st.sampled_from(ATTENTION_KEYS), scalars, max_size=2),
       st.just({}) | st.dictionaries(st.sampled_from(MEMORY_KEYS), scalars, max_size=2))  # fmt: skip
def test_near_valid_model_configs_are_accepted_or_refused_with_a_typed_error(changes, attention, memory):
    """A valid base with a few keys changed: reaches the deeper checks (shapes, kinds, memory options)."""
    data = {**plausible_base(), **changes, "attention": attention, "memory": memory}
    try:
        cfg = model_config_from_dict(data)
    except AttnlabError:
        return
    check_accepted(cfg)


OVERRIDE_KEYS = ["seeds", "name", "defaults.model.d_model", "defaults.model.n_heads", "defaults.model.max_seq_len",
                 "defaults.model.attention.kind", "defaults.model.memory.kind", "defaults.train.steps",
                 "defaults.train.lr", "defaults.train.seq_len", "defaults.train.batch_size", "defaults.data.source",
                 "defaults.data.tokenizer", "targets.baseline.model.attention.kind", "targets.gqa.init_from",
                 "targets", "defaults", "targets.baseline", "targets.x.y.z"]  # fmt: skip
override_values = st.one_of(
    st.sampled_from(
        [
            "0",
            "-1",
            "1e400",
            ".nan",
            ".inf",
            "[1, 2]",
            "{a: 1}",
            "'",
            '"',
            "[",
            "{",
            "null",
            "mha",
            "../x",
            "a/b",
            "",
            "10000000000000000000000000",
            "yes",
            "!!python/object:os.system x",
        ]
    ),  # fmt: skip
    st.text(max_size=12),
)
overrides = st.lists(st.builds(lambda k, v: f"{k}={v}", st.sampled_from(OVERRIDE_KEYS) | st.text(max_size=8),
                               override_values) | st.text(max_size=12), max_size=3)  # fmt: skip


@FUZZ
@given(overrides)
def test_manifest_overrides_are_applied_or_refused_with_a_typed_error(sets):
    try:
        manifest = load_manifest(CONFIGS / "quickstart.yml", sets)
    except AttnlabError:
        return
    assert manifest.targets


policy_text = st.lists(st.sampled_from(["k", "v", "kgeo", "k_sem", "latent", "=", ",", "q8_0", "q4_0", "nf4", "fp16",
                                        "bf16", "fp32", "kivi2", "kivi4", "resid", "group", "flush", "32", "0", "-1",
                                        "1e9", "10000000000000000000000", "x", " ", ":", "nan"]),
                       max_size=12).map("".join) | st.text(max_size=24)  # fmt: skip


@FUZZ
@given(policy_text)
def test_any_kv_policy_string_is_parsed_or_refused_with_a_typed_error(text):
    try:
        policy = KVPolicy.parse(text)
    except AttnlabError:
        return
    assert KVPolicy.parse(str(policy)) == policy  # what it prints, it reads back


ODD_FILES = [
    b"\xff\xfe\x00",
    b"name: \xe9t\xe9\n",
    b"a: 1\na: 2\n",
    b"\x00\x00",
    b"d_model: !!binary AAAA\n",
    b"[[[[",
    b"{",
]


@settings(max_examples=80, derandomize=True, deadline=None)
@given(st.binary(max_size=200) | st.sampled_from(ODD_FILES))
def test_raw_bytes_as_a_config_or_manifest_file_are_refused_with_a_typed_error(raw):
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "fuzz.yml"
        path.write_bytes(raw)
        for load in (load_config, load_manifest):
            try:
                loaded = load(path)
            except AttnlabError as error:
                assert str(error)  # a typed error says what is wrong
            else:
                assert loaded is not None  # bytes that happen to be a valid config load as one
