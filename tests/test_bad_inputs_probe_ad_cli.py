"""Probe AD's command-line findings (/work/probe_ad/REPORT.md): bench's kv_quant.policies items that are not
strings (AD1), report over memory records of length 0 (AD2) or that contradict themselves (AD7); and the UNCLEAR
items: "quantizes nothing" blaming resid (U2), a policy list split by YAML (U3), false follow-ons of a refused
init_from (U4), bench kv_quant keys refused without the way to write them (U5), a relative $XDG_CACHE_HOME (U6),
$ATTNLAB_MEMORY naming a file (U7), lm-eval --kv-policy checked after the slow loading (U9)."""

from __future__ import annotations

import pytest
from helpers import fails

from attnlab.cli import main

pytestmark = pytest.mark.usefixtures("one_thread", "own_cache")

KVQ = "{seq_len: 16, max_tokens: 64, split: val, policies: %s}"


def kv_manifest(tmp_path, run, params: str):
    path = tmp_path / "bm.yml"
    path.write_text(f"name: bm\ncheckpoints: [{run}]\nbenchmarks:\n  kv_quant: {params}\n")
    return path


def validate_refuses(capsys, argv, *fragments) -> str:
    """`attnlab validate ...` exits 2 with one line (validate names the file first), holding every fragment."""
    assert main(["validate", *argv]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert all(fragment in err for fragment in fragments), err
    return err.strip()


# ----------------------------------------------------------------------------- AD1: policies that are not strings


NOT_STRINGS = [("[8]", "8"), ("[k=q8_0, 1.5]", "1.5"), ("[[k=q8_0]]", "['k=q8_0']"), ("[{k: q8_0}]", "{'k': 'q8_0'}")]


@pytest.mark.parametrize(("policies", "shown"), NOT_STRINGS)
def test_ad1_a_policy_that_is_not_a_string_is_refused_by_validate_and_bench(tmp_path, tiny_run, capsys, policies,
                                                                            shown):  # fmt: skip
    """Was: validate said ok; bench ended in AttributeError: 'int' object has no attribute 'strip'."""
    manifest = kv_manifest(tmp_path, tiny_run, KVQ % policies)
    said = ("benchmarks.kv_quant.policies=", f"holds {shown} at [", "which is not a policy string",
            "such as 'k=q8_0,v=q4_0' (quote it in YAML)")  # fmt: skip
    line = validate_refuses(capsys, [str(manifest)], *said)
    assert fails(capsys, ["bench", str(manifest), "--out", str(tmp_path / "o")], *said)
    assert "Traceback" not in line and not (tmp_path / "o").exists()


# ----------------------------------------------------------------------------- U3: a policy that names no format


def test_u3_an_unquoted_policy_list_split_by_yaml_is_refused_saying_how_to_quote(tmp_path, tiny_run, capsys):
    """Was: [k=q8_0,resid=64] measured as 'k=q8_0' and 'resid=64' (vs_full 1, dNLL 0), rc 0, no line."""
    manifest = kv_manifest(tmp_path, tiny_run, KVQ % "[k=q8_0,resid=64]")
    said = ("holds 'resid=64', which names no format, so it quantizes nothing", "e.g. 'k=q8_0,resid=64'",
            "YAML splits an unquoted [k=q8_0,resid=64] at its comma", "policies: ['k=q8_0,resid=64']")  # fmt: skip
    validate_refuses(capsys, [str(manifest)], *said)
    fails(capsys, ["bench", str(manifest), "--out", str(tmp_path / "o")], *said)
    assert main(["validate", str(kv_manifest(tmp_path, tiny_run, KVQ % "['k=q8_0,resid=4', none]"))]) == 0


@pytest.mark.parametrize("policy", ["resid=4", "flush=2", "resid=0"])
def test_u3_kv_eval_refuses_a_policy_that_names_no_format(tiny_run, capsys, policy):
    """Was: kv-eval --policies resid=4: rc 0, a row of the full-precision cache, no line."""
    argv = ["kv-eval", str(tiny_run), "--split", "val", "--tokens", "64", "--seq-len", "16", "--policies", "k=q8_0"]
    fails(capsys, [*argv, policy], f"--policies: {policy!r} names no format", "'none' for the full-precision row")


# ----------------------------------------------------------------------------- U5: kv_quant keys a kv-eval user tries


def test_u5_kv_quant_dtype_is_refused_saying_what_kv_eval_dtype_does(tmp_path, tiny_run, capsys):
    """Was: "unknown key benchmarks.kv_quant.'dtype' (did you mean 'dataset'?)"."""
    manifest = kv_manifest(tmp_path, tiny_run, "{seq_len: 16, max_tokens: 64, split: val, dtype: fp16}")
    line = validate_refuses(capsys, [str(manifest)], "benchmarks.kv_quant has no dtype key",
                 "kv-eval's --dtype only changes those byte counts", "leave dtype out")  # fmt: skip
    assert "did you mean" not in line


def test_u5_set_policies_to_one_policy_says_how_to_write_the_list(tmp_path, tiny_run, capsys):
    """Was: "... must be a non-empty list", without how to give a list to --set."""
    manifest = kv_manifest(tmp_path, tiny_run, KVQ % "['k=q8_0']")
    validate_refuses(capsys, [str(manifest), "--set", "kv_quant.policies=k=q4_0"],
          "benchmarks.kv_quant.policies='k=q4_0' must be a non-empty list",
          """--set 'kv_quant.policies=["k=q4_0"]'""")  # fmt: skip
    assert main(["validate", str(manifest), "--set", 'kv_quant.policies=["k=q4_0"]']) == 0
