"""Probe AD's command-line findings (/work/probe_ad/REPORT.md): bench's kv_quant.policies items that are not
strings (AD1), report over memory records of length 0 (AD2) or that contradict themselves (AD7); and the UNCLEAR
items: "quantizes nothing" blaming resid (U2), a policy list split by YAML (U3), false follow-ons of a refused
init_from (U4), bench kv_quant keys refused without the way to write them (U5), a relative $XDG_CACHE_HOME (U6),
$ATTNLAB_MEMORY naming a file (U7), lm-eval --kv-policy checked after the slow loading (U9)."""

from __future__ import annotations

import json
import shutil

import pytest
from helpers import fails, hat_text, unsealed

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
    assert fails(capsys, ["bench", str(manifest), "--out", str(tmp_path / "o")], *said)
    assert main(["validate", str(kv_manifest(tmp_path, tiny_run, KVQ % "['k=q8_0,resid=4', none]"))]) == 0


@pytest.mark.parametrize("policy", ["resid=4", "flush=2", "resid=0"])
def test_u3_kv_eval_refuses_a_policy_that_names_no_format(tiny_run, capsys, policy):
    """Was: kv-eval --policies resid=4: rc 0, a row of the full-precision cache, no line."""
    argv = ["kv-eval", str(tiny_run), "--split", "val", "--tokens", "64", "--seq-len", "16", "--policies", "k=q8_0"]
    said = f"--policies: {policy!r} names no format"
    assert fails(capsys, [*argv, policy], said, "'none' for the full-precision row")


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


# ----------------------------------------------------------------------------- AD2, AD7: report on damaged records


@pytest.fixture(scope="module")
def bench_folder(tmp_path_factory, tiny_run, own_cache, one_thread):
    """A bench folder of tiny_run's memory (lengths 16, 32) and kv_quant records."""
    root = tmp_path_factory.mktemp("bench")
    manifest = root / "bm.yml"
    kv_quant = KVQ % "['k=q8_0,v=q8_0']"
    manifest.write_text(f"name: bm\ncheckpoints: [{tiny_run}]\nbenchmarks:\n  memory: {{lengths: [16, 32]}}\n"
                        f"  kv_quant: {kv_quant}\n")  # fmt: skip
    assert main(["bench", str(manifest), "--out", str(root / "b")]) == 0
    return root / "b"


def damaged(tmp_path, folder, benchmark: str, **fields) -> tuple:
    """A copy of `folder` whose first `benchmark` record (numbered as report numbers them) holds `fields`, unsealed
    (an older attnlab's record, checked by its figures: a sealed one changed is refused for its seal first)."""
    copy = tmp_path / "r"
    shutil.copytree(folder, copy)
    records = [json.loads(line) for line in (copy / "records.jsonl").read_text().splitlines()]
    number = next(i for i, r in enumerate(records, 1) if r["benchmark"] == benchmark)
    records[number - 1] = unsealed({**records[number - 1], **fields})
    (copy / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return copy, f"record {number} ({benchmark}, "


@pytest.mark.parametrize("which", [0, 1])
def test_ad2_ad7_a_memory_record_of_length_0_is_refused_naming_record_and_field(tmp_path, bench_folder, capsys, which):
    """Was: ZeroDivisionError when it is the model's largest length (AD2); shown as "0 tokens, 2,048 bytes" when not
    (AD7)."""
    copy = tmp_path / "r"
    shutil.copytree(bench_folder, copy)
    records = [json.loads(line) for line in (copy / "records.jsonl").read_text().splitlines()]
    numbers = [i for i, r in enumerate(records, 1) if r["benchmark"] == "memory"]
    number = sorted(numbers, key=lambda i: records[i - 1]["length"])[which]  # the smallest, then the largest
    records[number - 1] = unsealed({**records[number - 1], "length": 0})  # an older attnlab's: checked by figures
    (copy / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert fails(capsys, ["report", str(copy), "--unsealed"], f"record {number} (memory, ", "field 'length' is 0, which is impossible",  # noqa: E501
          "(a cache of 0 tokens is not measured) (the file was changed): take that line out")  # fmt: skip
    assert not (copy / "report.md").exists()


@pytest.mark.parametrize(("benchmark", "fields", "said"), [
    ("memory", {"kv_bytes": 0}, "field 'kv_matches_analytic' is true, which is impossible beside 'kv_bytes' 0 and"),
    ("memory", {"kv_matches_analytic": False}, "field 'kv_matches_analytic' is false, which is impossible beside"),
    ("kv_quant", {"kl": -0.5}, "field 'kl' is -0.5, which is impossible (a KL divergence is >= 0)"),
    ("kv_quant", {"bytes_per_token": 0, "vs_full": 0}, "field 'bytes_per_token' is 0, which is impossible"),
    ("kv_quant", {"vs_full": 0}, "field 'vs_full' is 0, which is impossible (a policy stores every token in some"),
])  # fmt: skip
def test_ad7_self_contradicting_memory_and_kv_quant_records_are_refused(tmp_path, bench_folder, capsys, benchmark,
                                                                         fields, said):  # fmt: skip
    """Was: drawn (rc 0): "| 64 | ok | 0 | 2,048 | yes |", a KL of -0.500000, a 0-byte policy."""
    copy, which = damaged(tmp_path, bench_folder, benchmark, **fields)
    assert fails(capsys, ["report", str(copy), "--unsealed"], which, said, "(the file was changed)")


def test_ad7_the_undamaged_records_still_report(tmp_path, bench_folder):
    shutil.copytree(bench_folder, tmp_path / "r")
    assert main(["report", str(tmp_path / "r")]) == 0


# ----------------------------------------------------------------------------- U7: $ATTNLAB_MEMORY naming a file


def test_u7_attnlab_memory_naming_a_file_is_named_as_the_variable(tmp_path, capsys, monkeypatch):
    """Was: "…/tiny.yml: a file, not a memory store folder (give --store a folder)", no --store given."""
    (tmp_path / "tiny.yml").write_text("name: x\n")
    monkeypatch.setenv("ATTNLAB_MEMORY", str(tmp_path / "tiny.yml"))
    line = fails(capsys, ["memory", "ls"], f"$ATTNLAB_MEMORY={tmp_path / 'tiny.yml'}: a file, not a memory store",
                 "(point it at a folder)")  # fmt: skip
    assert "--store" not in line


# ----------------------------------------------------------------------------- U6: a relative $XDG_CACHE_HOME


def test_u6_a_relative_xdg_cache_home_is_ignored_as_the_spec_says_in_one_warning_line(tmp_path, capsys, monkeypatch):
    """Was: taken from the working directory (a cache of each folder's own, every kernel built again), no line."""
    from attnlab.paths import cache_dir

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CACHE_HOME", "relcache_u6")
    monkeypatch.delenv("ATTNLAB_MEMORY", raising=False)
    assert main(["memory", "ls"]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("attnlab memory ls: warning: $XDG_CACHE_HOME=relcache_u6 is a"), err
    assert f"ignored, the cache is {tmp_path / 'home' / '.cache' / 'attnlab'}" in err[0]
    assert cache_dir() == tmp_path / "home" / ".cache" / "attnlab" and not (tmp_path / "relcache_u6").exists()
    assert main(["memory", "ls"]) == 0 and "relcache_u6" not in capsys.readouterr().err  # (said once a process)


# ----------------------------------------------------------------------------- U2: what keeps a policy idle


def test_u2_a_kivi_group_not_filled_is_named_as_the_cause(tiny_run, capsys):
    """Was: "... its residual window keeps all 8 tokens ... (give a smaller resid or flush ...)", a policy with no
    resid or flush."""
    assert main(["generate", str(tiny_run), "the", "--max-new-tokens", "6", "--kv-policy", "k=kivi2,v=q8_0"]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "warning: kv_policy k=kivi2,v=q8_0 quantizes nothing in this generation: KIVI stores " \
        "keys in groups of 32 tokens (group=32), and its 8 tokens are too few for one" in err[0], err  # fmt: skip
    assert "(give a smaller group, or leave the policy out)" in err[0] and "resid" not in err[0]


def test_u2_info_names_flush_when_resid_is_already_0(tmp_path, capsys):
    """Was: "... window (resid=0, flush=100000) keeps every token in fp16 ...: give a longer --seq-len, or a smaller
    resid"."""
    config = tmp_path / "m.yaml"
    config.write_text("vocab_size: 97\nd_model: 64\nn_layers: 2\nn_heads: 2\nmax_seq_len: 1024\n")
    assert main(["info", str(config), "--kv-policy", "k=q4_0,v=q4_0,flush=100000", "--seq-len", "512"]) == 0
    out = capsys.readouterr().out
    assert "nothing is quantized at seq_len 512: flush=100000 quantizes tokens 100000 at a time, and its 512 tokens " \
        "are too few for one" in out and "give a longer --seq-len, or a smaller flush" in out  # fmt: skip


# ----------------------------------------------------------------------------- U4: init_from a later target, a cycle


def later_manifest(root, a: str, b: str):
    path = root / "rfl.yml"
    path.write_text(f"name: rfl\nseeds: [0]\ndefaults:\n  data: {{source: {hat_text(root)}, tokenizer: char}}\n"
                    f"  train: {{seq_len: 16, batch_size: 2, steps: 4}}\ntargets:\n  a: {a}\n  b: {b}\n")  # fmt: skip
    return path


@pytest.mark.parametrize(("b", "said"), [
    ("{init_from: g.gguf}", "targets.a.init_from='b' names a target defined after a: list b before a"),
    ("{init_from: a}", "targets.a.init_from='b' makes a cycle (a -> b -> a): let one of them start from a model or"),
    ("{init_from: {model: g.gguf}}", "targets.a.init_from='b' names a target defined after a: list b before a"),
])  # fmt: skip
def test_u4_init_from_a_later_target_or_a_cycle_says_so_without_false_follow_ons(tmp_path, capsys, monkeypatch, b,
                                                                                 said):  # fmt: skip
    """Was: "... must name an earlier target (none) ...; targets.a.model: missing key 'd_model'; ... 'n_layers';
    ...; targets.b: model must be a mapping"."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "g.gguf").write_bytes(b"GGUF")
    manifest = later_manifest(tmp_path, "{init_from: b, model: {attention: {kind: sliding, window: 8}}}", b)
    line = fails(capsys, ["run", str(manifest), "--out", str(tmp_path / "o"), "--dry-run"], said)
    assert "missing key" not in line and "must be a mapping" not in line and "(none)" not in line
    assert line.count("; ") == 0, line


# ----------------------------------------------------------------------------- U9: lm-eval --kv-policy, before tasks


@pytest.mark.parametrize(("policy", "said"), [
    ("k=kivi2,group=5", "kv policy group=5: a group of kivi2 codes must fill whole bytes"),
    ("ksem=q8_0", "kv policy names 'ksem', which this model does not cache (use k, v)"),
])  # fmt: skip
def test_u9_lm_eval_checks_its_kv_policy_against_the_model_before_reading_the_tasks(tiny_run, capsys, monkeypatch,
                                                                                    policy, said):  # fmt: skip
    """Was: checked only once the tasks were read and the model loaded (86 s, and then the Hub dataset's error)."""
    pytest.importorskip("lm_eval")
    import attnlab.eval.lmeval as lmeval

    def too_late(*args, **kwargs):
        raise AssertionError("the tasks were read before the policy was checked")

    monkeypatch.setattr(lmeval, "task_manager", too_late)
    assert fails(capsys, ["lm-eval", str(tiny_run), "--tasks", "arc_easy", "--kv-policy", policy, "--limit", "2"], said)
