"""Config validation: strict keys with suggestions, impossible shapes, every problem reported at once."""

import pytest

import attnlab
from attnlab.attention.decoupled import DecoupledConfig
from attnlab.attention.mha import MHAConfig
from attnlab.attention.mla import MLAConfig
from attnlab.config_io import model_config_from_dict
from attnlab.errors import ConfigError

BASE = {"vocab_size": 100, "d_model": 64, "n_layers": 2, "n_heads": 8}


def make(**attention):
    return model_config_from_dict({**BASE, "attention": attention})


def test_valid_config_round_trips_through_to_dict():
    cfg = make(kind="decoupled", d_sem=16, d_geo=32, gate=True)
    again = model_config_from_dict(cfg.to_dict())
    assert again == cfg
    assert again.config_hash() == cfg.config_hash()
    assert cfg.padded_vocab_size == 128 and cfg.vocab_size == 100


def test_unknown_key_names_it_and_suggests_nearest():
    with pytest.raises(ConfigError, match=r"unknown key 'n_layer' \(did you mean 'n_layers'\?\)"):
        model_config_from_dict({**BASE, "n_layer": 3})
    with pytest.raises(ConfigError, match=r"attention\.'n_kv_head' \(did you mean 'n_kv_heads'\?\)"):
        make(kind="mha", n_kv_head=2)


def test_unknown_attention_kind_suggests_nearest():
    with pytest.raises(ConfigError, match=r"attention.kind='decouple' \(did you mean 'decoupled'\?\)"):
        make(kind="decouple")


def test_n_kv_heads_must_divide_n_heads_and_lists_options():
    with pytest.raises(ConfigError, match=r"n_kv_heads=3 must divide n_heads=8 \(use 1, 2, 4, 8\)"):
        make(kind="mha", n_kv_heads=3)


def test_decoupled_widths_must_split_over_heads():
    with pytest.raises(ConfigError, match=r"d_sem=12 must be a positive multiple of n_heads=8"):
        make(kind="decoupled", d_sem=12, d_geo=32)


def test_odd_rope_dims_are_rejected():
    with pytest.raises(ConfigError, match=r"d_geo / n_heads = 3 must be even"):
        make(kind="decoupled", d_sem=16, d_geo=24)
    with pytest.raises(ConfigError, match=r"head_dim=9 must be even"):
        model_config_from_dict({**BASE, "d_model": 72})
    with pytest.raises(ConfigError, match=r"d_rope=3 must be even"):
        make(kind="mla", d_latent=16, d_rope=3)
    # Without RoPE on the geometric path, an odd per-head width is fine.
    assert make(kind="decoupled", d_sem=16, d_geo=24, rope=False).attention.d_geo == 24


def test_d_model_must_divide_by_heads():
    with pytest.raises(ConfigError, match=r"d_model=60 must be divisible by n_heads=8"):
        model_config_from_dict({**BASE, "d_model": 60})


def test_every_problem_is_reported_at_once():
    with pytest.raises(ConfigError) as info:
        model_config_from_dict({"vocab_size": "big", "d_model": 64, "n_heads": 8, "n_layerz": 2, "mlp": "relu"})
    text = str(info.value)
    assert "vocab_size='big' must be int" in text
    assert "unknown key 'n_layerz'" in text
    assert "missing key 'n_layers'" in text
    assert len(info.value.problems) == 3


def test_wrong_types_are_rejected():
    with pytest.raises(ConfigError, match=r"tie_embeddings='yes' must be bool"):
        model_config_from_dict({**BASE, "tie_embeddings": "yes"})
    with pytest.raises(ConfigError, match=r"n_heads=8.0 must be int"):
        model_config_from_dict({**BASE, "n_heads": 8.0})


def test_direct_construction_is_validated_too():
    with pytest.raises(ConfigError, match="n_kv_heads"):
        attnlab.ModelConfig(vocab_size=10, d_model=64, n_layers=1, n_heads=8, attention=MHAConfig(n_kv_heads=5))
    with pytest.raises(ConfigError, match="tie_qk"):
        attnlab.ModelConfig(
            vocab_size=10, d_model=64, n_layers=1, n_heads=8,
            attention=DecoupledConfig(d_sem=16, d_geo=32, tie_qk=True, n_kv_heads=2),
        )  # fmt: skip
    assert attnlab.ModelConfig(vocab_size=10, d_model=64, n_layers=1, n_heads=8, attention=MLAConfig(d_latent=8))


def test_load_config_names_the_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("vocab_size: 100\nd_model: 64\nn_layers: 2\nn_heads: 8\nattention: {kind: mha, windw: 3}\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml: unknown key attention\.'windw'"):
        attnlab.load_config(path)
    broken = tmp_path / "broken.yaml"
    broken.write_text("vocab_size: [1,\n")
    with pytest.raises(ConfigError, match=r"broken\.yaml: not valid YAML at line"):
        attnlab.load_config(broken)
    with pytest.raises(ConfigError, match="file not found"):
        attnlab.load_config(tmp_path / "missing.yaml")


def test_model_key_wrapper_is_accepted():
    assert model_config_from_dict({"model": BASE}).d_model == 64
