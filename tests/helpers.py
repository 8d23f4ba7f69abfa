"""Helpers shared by test modules (import as `from helpers import ...`; tests/ is on sys.path)."""

import contextlib
import os
import random
import signal
from pathlib import Path

import pytest
import torch

import attnlab
from attnlab.cache.layout import CacheLayout, Field, Read
from attnlab.config import DataConfig, ModelConfig, TrainConfig
from attnlab.data.files import SEAL
from attnlab.errors import InputError
from attnlab.train.loop import train

# The tiny model most tests want: vocab 97 (not a multiple of 64, so the padded embedding rows are exercised),
# 4 heads of 16, two layers (the second reads a non-trivial residual stream). At the default init_std=0.02
# attention barely moves the logits, so cache and masking bugs would hide under the tolerances: 0.1.
TINY = {"vocab_size": 97, "d_model": 64, "n_layers": 2, "n_heads": 4, "max_seq_len": 64, "init_std": 0.1}


# One tiny-model attention of each kind that reads through a cache (tests of cache kinds run over all of them).
CACHE_VARIANTS = {
    "mha": {"kind": "mha"},
    "mha-gqa": {"kind": "mha", "n_kv_heads": 2},
    "decoupled": {"kind": "decoupled", "d_sem": 16, "d_geo": 32},
    "mla": {"kind": "mla", "d_latent": 32},
    "diff": {"kind": "diff"},
    "coda": {"kind": "coda", "gate_bias": 0.0},
}

PROBE_MODEL = {
    "vocab_size": 40,
    "d_model": 32,
    "n_layers": 1,
    "n_heads": 2,
    "max_seq_len": 64,
}  # the probes' tiny model


def probe_manifest(tmp_path: Path, text: Path, train: str, targets: str = "  base: {}\n", model: str = "",
                   head: str = "") -> Path:  # fmt: skip
    """tmp_path/m.yml: a manifest of the probes' tiny model (or `model`, YAML flow text) trained on `text` with a
    char tokenizer and a validation split; `train` and `targets` as YAML text, `head` in place of `seeds: [0]`."""
    path = tmp_path / "m.yml"
    model = model or "{d_model: 32, n_layers: 1, n_heads: 2, max_seq_len: 64}"
    path.write_text(f"name: m\n{head or 'seeds: [0]'}\ndefaults:\n  model: {model}\n"
                    f"  data: {{source: {text}, tokenizer: char, val_fraction: 0.2}}\n  train: {train}\n"
                    f"targets:\n{targets}")  # fmt: skip
    return path


def tiny_config(attention=None, memory=None, **config) -> ModelConfig:
    """A validated ModelConfig: TINY with `config` (ModelConfig fields) over it. attention and memory are dicts,
    parsed as from a YAML file, or config dataclasses. attention may also be a whole ModelConfig, which then stands
    for TINY (memory, if given, a MemoryConfig)."""
    if isinstance(attention, ModelConfig):
        cfg = attention.replace(**config)
        return cfg if memory is None else cfg.replace(memory=memory)
    parts = {"attention": attention, "memory": memory}
    plain = {key: value for key, value in parts.items() if isinstance(value, dict)}
    typed = {key: value for key, value in parts.items() if value is not None and key not in plain}
    cfg = attnlab.model_config_from_dict({**TINY, **config, **plain})
    return cfg.replace(**typed) if typed else cfg


def tiny_model(
    attention=None, memory=None, *, seed: int = 0, perturb: bool = False, dtype=None, **config
) -> attnlab.Transformer:
    """The model of tiny_config(attention, memory, **config), built after torch.manual_seed(seed), in eval mode
    (cast to dtype if given). perturb moves every 1-D parameter (norm gains, gate logits and biases, DIFF lambdas)
    off its init-time constant, so that no path of the model hides behind a default."""
    cfg = tiny_config(attention, memory, **config)
    torch.manual_seed(seed)
    model = attnlab.build_model(cfg)
    if perturb:
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() == 1:
                    p.add_(torch.randn_like(p) * 0.3)
    return model.to(dtype=dtype).eval() if dtype else model.eval()


def hat_text(folder: Path) -> Path:
    """folder/text.txt: 60 short numbered paragraphs, a corpus for tiny char-tokenizer manifests."""
    path = folder / "text.txt"
    path.write_text("\n\n".join(f"the cat is on the mat and this is the hat number {i}" for i in range(60)))
    return path


def train_tiny_run(root: Path, model: dict, steps: int = 20, seq_len: int = 32, words: int = 30) -> Path:
    """A tiny run trained on a made-up corpus (char tokenizer) under root/runs/tiny/seed0, for tests that
    evaluate a real checkpoint folder: its path."""
    rng = random.Random(0)
    vocabulary = "a cat and a dog sat on the mat by the red door".split()
    corpus = root / "text.txt"
    corpus.write_text("\n\n".join(" ".join(rng.choice(vocabulary) for _ in range(words)) for _ in range(200)))
    data = DataConfig(source=str(corpus), tokenizer="char", val_fraction=0.2)
    run = root / "runs" / "tiny" / "seed0"
    train_cfg = TrainConfig(seq_len=seq_len, batch_size=4, steps=steps, eval_every=steps // 2, eval_tokens=256)
    train(attnlab.model_config_from_dict(model), data, train_cfg, run, progress=False)
    return run


def kv_layout(kv_heads: int, head_dim: int, interleaved: bool = False):
    """The cache layout of a per-head variant (mha): k (rotated by RoPE) and v, head_dim each per KV head."""
    fields = {"k": [Field("k", head_dim, rope=True)], "v": [Field("v", head_dim)]}
    return CacheLayout.of(fields, kv_heads=kv_heads, route="v", read=Read("k", "v"), rope_interleaved=interleaved)


def fails(capsys, argv, *fragments) -> str:
    """main(argv) exits 2 with one stderr line `attnlab <command>: error: ...` holding every fragment and no
    traceback; that line (truthy, so a test can `assert fails(...)`)."""
    from attnlab.cli import main

    assert main(argv) == 2
    verb = argv[0] == "memory" and len(argv) > 1 and argv[1] in ("ingest", "ls", "rm", "query")
    return error_line(capsys, " ".join(argv[:2]) if verb else argv[0], *fragments)  # `attnlab memory ingest`


def error_line(capsys, command: str, *fragments) -> str:
    """The one stderr line `attnlab <command>: error: ...` a refused command printed, holding every fragment and no
    traceback (for a command run some other way than fails())."""
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"attnlab {command}: error: "), lines
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def gguf_name(hf: str) -> str:
    """The GGUF tensor name of a Hugging Face Llama tensor name (model.layers.3.self_attn.q_proj.weight ->
    blk.3.attn_q.weight), by attnlab.interop.gguf's own tables."""
    from attnlab.interop.gguf import BLOCK_NAMES, TOP_LEVEL_NAMES

    top = {hf_name: name for name, hf_name in TOP_LEVEL_NAMES.items()}
    if hf in top:
        return top[hf]
    parts = {hf_name: name for name, hf_name in BLOCK_NAMES.items()}
    layer, rest = hf[len("model.layers.") :].split(".", 1)
    part, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{parts[part]}.{kind}"


@contextlib.contextmanager
def at_most(seconds: int):
    """TimeoutError when the block takes longer (a read that never ends, blocked on a FIFO or a device), instead of
    hanging the suite."""

    def expire(*_):
        raise TimeoutError(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def index_lm_eval_defaults_once() -> None:
    """From now on in this process, lm-eval's TaskIndex.build reads lm-eval's own task folder once and reuses
    that index (a copy each time); every other folder it is given is indexed as before, later folders overriding
    earlier ones. For tests only: the index of ~15,000 files takes about 14 s and never changes in a session."""
    from lm_eval.tasks import _index

    if getattr(_index.TaskIndex.build, "attnlab_cached", False):
        return
    build, defaults, known = _index.TaskIndex.build, Path(_index.__file__).parent, {}

    def cached(paths, *, resolve_includes=True):
        index = {}
        for path in paths:
            if Path(path) == defaults:
                if resolve_includes not in known:
                    known[resolve_includes] = build([path], resolve_includes=resolve_includes)
                index.update(known[resolve_includes])
            else:
                index.update(build([path], resolve_includes=resolve_includes))
        return index

    cached.attnlab_cached = True
    _index.TaskIndex.build = staticmethod(cached)


def lm_task_folders(tmp_path: Path, monkeypatch, task_yaml: str, items: list[dict]) -> tuple[Path, Path]:
    """(tasks folder, data folder) for lm-eval: tasks/mytask.yaml holding `task_yaml`, over data/x/data.jsonl holding
    `items`; skips without lm-eval and datasets; the datasets cache inside tmp_path."""
    import json

    import pytest

    datasets = pytest.importorskip("datasets")
    pytest.importorskip("lm_eval")
    index_lm_eval_defaults_once()
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-datasets"))
    tasks, data = tmp_path / "t", tmp_path / "data"
    (data / "x").mkdir(parents=True)
    tasks.mkdir()
    (tasks / "mytask.yaml").write_text(task_yaml)
    (data / "x" / "data.jsonl").write_text("".join(json.dumps(item) + "\n" for item in items))
    return tasks, data


LM_TASK = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    validation: {data}
output_type: multiple_choice
validation_split: validation
doc_to_text: "{{{{q}}}}"
doc_to_target: "{{{{gold}}}}"
doc_to_choice: "{{{{choices}}}}"
metric_list:
  - metric: acc
"""


def lm_task_yaml(name: str = "mytask", data: str = "x/data.jsonl") -> str:
    """An lm-eval multiple-choice task file over a local JSON-lines file (fields q, gold, choices)."""
    return LM_TASK.format(name=name, data=data)


def snapshot(folder: Path) -> dict:
    """Every file under `folder` by its relative path: its bytes (to assert a refused command wrote nothing)."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def edit_one_word(path: Path) -> None:
    """'cat' -> 'act' in one paragraph of a text file: the same characters, so the same vocabulary."""
    docs = path.read_text().split("\n\n")
    docs[7] = docs[7].replace("cat", "act")
    path.write_text("\n\n".join(docs))


def run_limited(limit, size, argv):
    """main(argv) with files limited to `size` bytes (limit: the file_size_limit fixture); its exit code."""
    from attnlab.cli import main

    limit(size)
    try:
        return main(argv)
    finally:
        limit(None)  # pytest's own files are written past it


def dry_run(capsys, argv) -> str:
    """main(argv), a `run ... --dry-run`: what it printed. Its exit code is 2 when it says a run would be refused
    (then with one stderr line saying how many), else 0."""
    from attnlab.cli import main

    code = main(argv)
    captured = capsys.readouterr()
    refused = "would be refused" in captured.out
    assert code == (2 if refused else 0), (code, captured.out, captured.err)
    if refused:
        lines = captured.err.strip().splitlines()
        assert len(lines) == 1 and "runs would be refused" in lines[0] and "Traceback" not in captured.err, lines
    return captured.out


class Stop(Exception):
    """Raised after a checkpoint is saved: a run interrupted right there (stop_after_first_checkpoint)."""


def stop_after_first_checkpoint(monkeypatch, argv) -> None:
    """main(argv), an `attnlab run`, stopped by Stop right after it saves its first checkpoint."""
    from attnlab.cli import main
    from attnlab.train import loop

    save = loop.save_checkpoint

    def save_then_stop(*args, **kwargs):
        save(*args, **kwargs)
        raise Stop

    with monkeypatch.context() as patch:
        patch.setattr(loop, "save_checkpoint", save_then_stop)
        with pytest.raises(Stop):
            main(argv)


def edit_trainer(folder: Path, edit) -> None:
    """trainer.json changed by edit(dict), and checksums.json made to agree (as a careful hand would)."""
    import hashlib
    import json

    trainer = json.loads((folder / "trainer.json").read_text())
    edit(trainer)
    (folder / "trainer.json").write_text(json.dumps(trainer, indent=1))
    checksums = json.loads((folder / "checksums.json").read_text())
    data = (folder / "trainer.json").read_bytes()
    checksums["files"]["trainer.json"] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (folder / "checksums.json").write_text(json.dumps(checksums, indent=1))


SMOLLM = "models/SmolLM2-135M-Instruct.Q4_1.gguf"  # the real pretrained model in the data directory


def smollm_file() -> Path:
    """The SmolLM2-135M GGUF in the data directory (ATTNLAB_DATA, else shared/data beside the checkout, as
    conftest.SIBLING_DATA); skips the test when it is not there. (Here, not in conftest: tests/data has a conftest
    of its own, and `from conftest import` may get that one.)"""
    path = Path(os.environ.get("ATTNLAB_DATA", Path(__file__).resolve().parents[2] / "shared" / "data")) / SMOLLM
    if not path.is_file():
        pytest.skip(f"{path} not found (set ATTNLAB_DATA)")
    return path


def refused(call, *fragments) -> str:
    """call() raises InputError (no other exception) whose one-line message holds every fragment; the message."""
    with pytest.raises(InputError) as caught:
        call()
    message = str(caught.value)
    assert "\n" not in message, message
    for fragment in fragments:
        assert fragment in message, message
    return message


def unsealed(row: dict) -> dict:
    """row without its SEAL: as an older attnlab (before records and summaries were sealed) wrote it, which attnlab
    still reads, checking only that its figures do not contradict each other (a test of those checks edits one)."""
    return {k: v for k, v in row.items() if k != SEAL}
