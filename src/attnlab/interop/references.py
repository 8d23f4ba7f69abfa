"""Model references: one string names a model, wherever it comes from.

    cfg, model, tokenizer = load_model("models/SmolLM2-135M-Instruct.Q4_1.gguf")    # a GGUF file
    cfg, model, tokenizer = load_model("path/to/hf-folder")                          # a Hugging Face folder
    cfg, model, tokenizer = load_model("hf:HuggingFaceTB/SmolLM2-135M@main")         # the Hub (or a local copy)
    cfg, model, tokenizer = load_model("runs/tiny/seed0")                            # an attnlab run or checkpoint

`hf:ORG/NAME[@REVISION]` is looked for as a folder `<data dir>/models/ORG/NAME` (in each data directory:
--data-dir, $ATTNLAB_DATA, the user cache; only without @REVISION: a copy has no revision to check), then in the
Hugging Face cache, then downloaded with huggingface_hub (an optional dependency) unless downloads are off
($ATTNLAB_OFFLINE / $HF_HUB_OFFLINE). A relative path that is not found from the working directory is looked for in
the data directories (`models/X.gguf`).
"""

from __future__ import annotations

import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from attnlab.config import DataConfig, ModelConfig
from attnlab.config_io import model_config_from_dict
from attnlab.data import load_tokenizer, prepare
from attnlab.data.files import downloads_allowed
from attnlab.data.pretrained import check_token_ids, regular_file, tokenizer_from_folder
from attnlab.data.tokenizers import Tokenizer, tokenizer_problem
from attnlab.errors import DataError, InputError, given
from attnlab.interop.gguf import check_token_count, check_weights, config_from_gguf, load_gguf, open_gguf
from attnlab.interop.hf import check_hf_weights, config_from_hf, is_hf_folder, load_hf_folder, read_json
from attnlab.interop.tokenizer import tokenizer_from_gguf
from attnlab.model.transformer import Transformer
from attnlab.paths import check_data_dir, data_dirs, in_data_dirs, shown_value
from attnlab.train.checkpoint import (
    WEIGHTS,
    find_checkpoint,
    load_checkpoint,
    recorded_checksums,
    step_folders,
    verify_file,
)
from attnlab.train.resume import config_differences

HUB_PREFIX = "hf:"
HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")
# What a Hub download fetches: config, safetensors weights and the tokenizer files (never pickles).
HUB_FILES = [
    "config.json", "generation_config.json", "model.safetensors", "model-*.safetensors",
    "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
]  # fmt: skip
KINDS = "a .gguf file, a Hugging Face model folder, an attnlab run or checkpoint folder, or hf:ORG/NAME[@REVISION]"


@dataclass
class LoadedModel:
    """A model a reference names, ready to use: what load_model returns, plus what tables and records need."""

    cfg: ModelConfig
    model: Transformer  # eval mode
    tokenizer: Tokenizer | None
    config: dict  # an attnlab run's resolved config (model, data, train); else {"model": ..., "source": ref}
    label: str  # a name for tables: <target>/seed<S> for a run, the file or folder name, ORG/NAME for the Hub
    folder: Path | None = None  # an attnlab checkpoint's folder (None for pretrained models)


def load_model(
    ref: str | Path, dtype: torch.dtype = torch.float32, data_dir: str | Path | None = None, *, tag: str = "best",
    weights: str = "fp32",
) -> tuple[ModelConfig, Transformer, Tokenizer | None]:  # fmt: skip
    """(config, model in eval mode, tokenizer) of the model `ref` names (see the module docstring).

    dtype: the weights' dtype, torch.float32 (None too), float16, bfloat16 or float64 (quantized GGUF weights are
    dequantized to it; another value, or a name such as "float16", is an InputError). tag: which checkpoint of an
    attnlab run, "best" (else its last) or "last" (InputError for another: give one checkpoint's folder as `ref`
    instead). weights="native" keeps a GGUF file's F16/Q8_0/Q4_0/Q4_1 matrices as they are
    stored, multiplied as they are (attnlab.interop.gguf; other tensors are dequantized); for other references it
    is refused (InputError: their weights load in `dtype`; attnlab.quantize_weights quantizes a loaded model, also
    what weights="q8_0" and the other formats are refused pointing to).
    The tokenizer is None only for an attnlab checkpoint saved without one.
    """
    loaded = load_reference(ref, dtype, data_dir, tag=tag, weights=weights)
    return loaded.cfg, loaded.model, loaded.tokenizer


def load_reference(
    ref: str | Path, dtype: torch.dtype = torch.float32, data_dir: str | Path | None = None, *, tag: str = "best",
    weights: str = "fp32",
) -> LoadedModel:  # fmt: skip
    """`load_model` with the reference's run config and label (attnlab.eval.load_for_eval builds on it)."""
    if not isinstance(ref, (str, os.PathLike)):
        raise InputError(f"the model reference must be a path or a name, got {given(ref)} (give {KINDS})")
    check_data_dir(data_dir, "data_dir")  # (a typo would look in the default folders without a word, as --data-dir)
    check_weights(weights)
    dtype = check_dtype(dtype)
    kind, where = resolve(ref, data_dir)
    check_tag(tag, where if kind == "run" else None)
    if weights == "native" and kind != "gguf":
        what = {"run": "an attnlab run or checkpoint", "hf": "a Hugging Face folder", "hub": "a Hub model"}[kind]
        raise InputError(f"weights='native' keeps a GGUF file's quantized matrices, but {ref} is {what}, whose "
                         "weights load in dtype (leave weights='fp32'; attnlab.quantize_weights(model, 'q8_0') "
                         "quantizes a loaded model)")  # fmt: skip
    if kind == "run":
        return _load_run(where, dtype, data_dir, tag)
    if kind == "gguf":
        cfg, model, tokenizer = load_gguf(where, dtype, weights=weights)
        label = where.stem
    else:
        name = str(ref) if kind == "hub" else None
        cfg, model = load_hf_folder(where, dtype, name=name)
        tokenizer = tokenizer_from_folder(where, name=name)
        check_token_ids(tokenizer, cfg.vocab_size, where / "tokenizer.json")
        label = str(ref)[len(HUB_PREFIX) :] if kind == "hub" else where.name
    return LoadedModel(cfg, model, tokenizer, {"model": cfg.to_dict(), "source": str(ref)}, label)


# The dtypes load_model takes, and names of them a dtype given as a string is told to give as the torch dtype.
FLOAT_DTYPES = {name: getattr(torch, name) for name in ("float32", "float16", "bfloat16", "float64")}
DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16",
                 "fp64": "float64", "double": "float64"}  # fmt: skip


def check_dtype(dtype) -> torch.dtype:
    """`dtype` (None: float32) when it is one of FLOAT_DTYPES; InputError otherwise (a name says which to give)."""
    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype) and dtype in FLOAT_DTYPES.values():
        return dtype
    takes = "torch.float32, torch.float16, torch.bfloat16 or torch.float64 (float32 is the default)"
    name = dtype.lower().removeprefix("torch.") if isinstance(dtype, str) else None
    name = DTYPE_ALIASES.get(name, name)
    if name in FLOAT_DTYPES:
        raise InputError(f"dtype={dtype!r} is not a torch dtype: give dtype=torch.{name} (load_model takes {takes})")
    raise InputError(f"dtype={dtype!r} is not a dtype load_model takes: give {takes}")


def check_tag(tag, run: Path | None = None) -> None:
    """InputError unless `tag` is best or last; for a run's folder `run`, naming a checkpoint folder to give instead."""
    if isinstance(tag, str) and tag in ("best", "last"):
        return
    steps = step_folders(run / "checkpoints") if run is not None else []
    one = f": to load one checkpoint, give its folder, e.g. {steps[-1]}" if steps else ""
    raise InputError(f"tag={tag!r} is not 'best' or 'last' (which checkpoint of an attnlab run to load){one}")


def resolve(ref: str | Path, data_dir: str | Path | None = None) -> tuple[str, Path]:
    """What `ref` is and where: ("gguf", file), ("hf", folder), ("hub", its local folder) or ("run", folder).
    DataError (one line) when it names nothing loadable."""
    if isinstance(ref, str) and ref.startswith(HUB_PREFIX):
        return "hub", hub_folder(ref, data_dir)
    if isinstance(ref, str) and not ref:  # ('' from an unset shell variable: Path('') would be the working directory)
        raise InputError(f"the model reference is an empty path: give {KINDS}")
    path = in_data_dirs(ref, data_dir)
    if path.is_file():
        with open(path, "rb") as f:
            magic = f.read(4)
        if path.suffix.lower() != ".gguf" and magic != b"GGUF":
            raise DataError(f"{path}: not a GGUF file (a model reference is {KINDS})")
        return "gguf", path
    if not path.is_dir():
        if path.exists():  # a FIFO, socket or device: say what it is, not that nothing is there
            regular_file(path, fix=f"a model reference is {KINDS}")
        where = ", ".join(str(d) for d in data_dirs(data_dir)) if not path.is_absolute() else ""
        raise DataError(f"{shown_value(str(ref))}: no such file or folder" + (f" (nor in {where})" if where else "")
                        + f" (a model reference is {KINDS})")  # fmt: skip
    if (path / "checkpoints").is_dir() or _is_attnlab_checkpoint(path):
        return "run", path
    if is_hf_folder(path):
        return "hf", path
    if os.path.lexists(path / "config.json"):
        read_json(path / "config.json")  # broken JSON, not an object, a FIFO: says so (naming the file)
    steps = step_folders(path) if path.name == "checkpoints" else []
    if steps:  # a run's checkpoints/: the run itself is the reference (or one checkpoint in it)
        raise DataError(f"{path}: a run's checkpoints folder, not a model: give the run's folder {path.parent} (its "
                        f"best checkpoint) or one checkpoint in it, e.g. {steps[-1]}")  # fmt: skip
    inside = _references_inside(path)
    if inside:  # a manifest target's folder of seed runs, a folder of models
        names = [str(p) for p in inside[:3]]
        shown = " or ".join([", ".join(names[:-1]), names[-1]]) if len(names) > 1 else names[0]
        more = f" (and {len(inside) - 3} more)" if len(inside) > 3 else ""
        raise DataError(f"{path}: no config.json naming a model here, but the folder holds model references: give "
                        f"one of them, e.g. {shown}{more}")  # fmt: skip
    raise DataError(f"{path}: no config.json naming a model here (a model reference is {KINDS})")


def _references_inside(folder: Path, limit: int = 1000) -> list[Path]:
    """The model references right inside `folder` (runs, checkpoint and Hugging Face folders, .gguf files), by name;
    a folder of more than `limit` entries is not searched (nothing is listed)."""
    try:
        entries = sorted(folder.iterdir(), key=lambda p: _natural(p.name)) if folder.is_dir() else []
    except OSError:  # unreadable: the plain refusal says enough
        return []
    if len(entries) > limit:
        return []
    found = []
    for entry in entries:
        try:
            if entry.is_dir() and ((entry / "checkpoints").is_dir() or _is_attnlab_checkpoint(entry)
                                   or is_hf_folder(entry)):  # fmt: skip
                found.append(entry)
            elif entry.suffix.lower() == ".gguf" and entry.is_file():
                found.append(entry)
        except OSError:  # a folder that cannot be entered is no reference to point at
            continue
    return found


def _natural(name: str) -> list:
    """A sort key putting seed2 before seed10."""
    return [(0, int(part), "") if part.isdigit() else (1, 0, part) for part in re.split(r"(\d+)", name)]


def model_config_of(ref: str | Path, data_dir: str | Path | None = None) -> ModelConfig:
    """The ModelConfig of the model `ref` names, from its config alone (its weights are not read)."""
    return _config_at(ref, *resolve(ref, data_dir))


def checked_model_config(ref: str | Path, data_dir: str | Path | None = None) -> ModelConfig:
    """model_config_of, after the checks loading the model makes that read no tensor data (`attnlab info`, which
    should not print figures the weights contradict): for a Hugging Face folder, its safetensors headers against the
    config (check_hf_weights: files, shards, names, dtypes, shapes) and its tokenizer files (as load_reference reads
    them); for an attnlab checkpoint, its weights' size and sha256 against its checksums.json. A GGUF file's
    tensors are checked by open_gguf and config_from_gguf already."""
    kind, where = resolve(ref, data_dir)
    cfg = _config_at(ref, kind, where)
    if kind in ("hf", "hub"):
        check_hf_weights(where, cfg)
        tokenizer = tokenizer_from_folder(where, name=str(ref) if kind == "hub" else None)
        check_token_ids(tokenizer, cfg.vocab_size, where / "tokenizer.json")
    elif kind == "run":
        folder = _checkpoint_folder(where)
        verify_file(folder, WEIGHTS, recorded_checksums(folder))
    return cfg


def _checkpoint_folder(where: Path) -> Path:
    """The checkpoint folder of a run (its best, else last) or the checkpoint folder `where` itself."""
    checkpoint = (
        find_checkpoint(where, "best") or find_checkpoint(where, "last") if (where / "checkpoints").is_dir() else None
    )
    return checkpoint.path if checkpoint else where


def data_config_of(ref: str | Path, data_dir: str | Path | None = None) -> dict | None:
    """The data config an attnlab run or checkpoint `ref` was trained on (its saved config's `data`), or None (a
    GGUF or Hugging Face model, a conversion: none saved)."""
    kind, where = resolve(ref, data_dir)
    if kind != "run":
        return None
    data = _saved_config(where)[1].get("data")
    return data if isinstance(data, dict) else None


def _saved_config(where: Path) -> tuple[Path, dict]:
    """(the config.json, its config) of an attnlab run (its best checkpoint's, else its last's) or checkpoint."""
    checkpoint = (
        find_checkpoint(where, "best") or find_checkpoint(where, "last") if (where / "checkpoints").is_dir() else None
    )
    config_path = (checkpoint.path if checkpoint else where) / "config.json"
    return config_path, checkpoint.config if checkpoint else read_json(config_path)


def _config_at(ref: str | Path, kind: str, where: Path) -> ModelConfig:
    """model_config_of of a resolved reference (kind, where: resolve's)."""
    if kind == "gguf":
        return config_from_gguf(open_gguf(where))
    if kind == "run":
        config_path, config = _saved_config(where)
        check_run_checkpoint(config_path.parent, config)
        return model_config_from_dict(config.get("model"), source=str(config_path), saved=True)
    config_path = where / "config.json"
    return config_from_hf(
        read_json(config_path), source=str(config_path), name=str(ref) if kind == "hub" else where.name
    )


def tokenizer_of(ref: str | Path, data_dir: str | Path | None = None) -> Tokenizer | None:
    """The tokenizer of the model `ref` names, without loading its weights (but an attnlab checkpoint's, which come
    with them; None for one saved without a tokenizer)."""
    kind, where = resolve(ref, data_dir)
    if kind == "gguf":
        file = open_gguf(where)
        check_token_count(file)  # as loading the model checks it
        return tokenizer_from_gguf(file.metadata, source=str(where))
    if kind == "run":
        return _load_run(where, torch.float32, data_dir, "best").tokenizer
    tokenizer = tokenizer_from_folder(where, name=str(ref) if kind == "hub" else None)
    vocab_size = read_json(where / "config.json").get("vocab_size")  # (any architecture: its tokenizer may be used)
    if isinstance(vocab_size, int) and not isinstance(vocab_size, bool):
        check_token_ids(tokenizer, vocab_size, where / "tokenizer.json")
    return tokenizer


def check_run_checkpoint(folder: Path, trained: dict) -> None:
    """DataError when `folder` is a run's checkpoint (<run>/checkpoints/step-N) trained with another config than the
    run's config.json says (`trained`: the checkpoint's own config.json, checksummed with its weights): a step folder
    copied in from another run, or the run's config.json changed since; either way the run's files (its config, its
    tokenizer/) would be taken for another model's. A run's config.json that is missing or unreadable is not compared
    (the weights are loaded by the checkpoint's own)."""
    if folder.parent.name != "checkpoints":
        return
    run_config = folder.parent.parent / "config.json"
    try:
        saved = read_json(run_config)
    except DataError:
        return
    differences = config_differences(trained, saved, saved_as="trained with")
    if differences:
        more = f" (and {len(differences) - 1} more)" if len(differences) > 1 else ""
        raise DataError(f"{folder}: this checkpoint was trained with another config than the run's {run_config} says "
                        f"({differences[0]}{more}): it was copied in from another run, or the run's config.json was "
                        "changed after training; put the run's own checkpoint back (or its config.json as it was), or "
                        "train the run again into another --out")  # fmt: skip


def _is_attnlab_checkpoint(folder: Path) -> bool:
    """A checkpoint folder written by attnlab: config.json holds the resolved run config under "model"."""
    if not (folder / "config.json").is_file():
        return False
    try:
        return isinstance(read_json(folder / "config.json").get("model"), dict)
    except DataError:
        return False


def reference_label(path: Path) -> str:
    """<target>/seed<S> for a run's folder (or a checkpoint inside it), <target>/converted for a manifest target's
    conversion (its cold model), else the folder's name."""
    parts = path.resolve().parts
    seed = next((i for i in range(len(parts) - 1, -1, -1) if parts[i].startswith("seed")), None)
    if seed:
        return f"{parts[seed - 1]}/{parts[seed]}"
    return f"{parts[-2]}/{parts[-1]}" if parts[-1] == "converted" and len(parts) > 1 else path.name


def _load_run(path: Path, dtype, data_dir, tag: str) -> LoadedModel:
    """An attnlab run or checkpoint: its model, and the tokenizer it was trained with (the run's tokenizer/
    folder, else the prepared data of its data config), or, for a converted pretrained model, its source's
    (tokenizer/tokenizer.json in the checkpoint folder)."""
    loaded = load_checkpoint(path, tag=tag)
    check_run_checkpoint(loaded.folder, loaded.config)  # another run's weights are not taken for this run's
    model = loaded.model if dtype == torch.float32 else loaded.model.to(dtype)
    data = loaded.config.get("data")
    record = (loaded.trainer or {}).get("tokenizer")  # what training saved in tokenizer/ (runs since it was recorded)
    tokenizer, refitted = None, False
    if data and (loaded.run_dir / "tokenizer").is_dir():  # damaged, it is refused: never another in its place
        tokenizer = load_tokenizer(data["tokenizer"], loaded.run_dir / "tokenizer", data_dir=data_dir)
    elif data:  # a fixed tokenizer (byte, gpt2) needs no folder; a fitted one of a run from before runs saved theirs
        try:
            tokenizer = load_tokenizer(data["tokenizer"], data_dir=data_dir)
        except DataError:
            tokenizer, refitted = prepare(DataConfig(**data), data_dir=data_dir).tokenizer, True
        problem = refitted_problem(record, tokenizer) if refitted and isinstance(record, dict) else None
        if problem is not None:  # fitted again on text that has changed since: other ids, silently
            raise DataError(f"{loaded.run_dir}: its tokenizer/ folder is gone, and the {data['tokenizer']} tokenizer "
                            f"fitted again on {data['source']} is not the one the run was trained with ({problem}): "
                            "the text has changed since; restore tokenizer/ from a copy of the run (or the text as "
                            "it was)")  # fmt: skip
    elif (loaded.folder / "tokenizer" / "tokenizer.json").is_file():  # a converted pretrained model's (attnlab convert)
        tokenizer = tokenizer_from_folder(loaded.folder / "tokenizer", name=loaded.config.get("tokenizer"))
    folder = loaded.run_dir / "tokenizer"
    if data and folder.is_dir():  # another run's tokenizer copied in: other ids (or ids past the embedding)
        problem = tokenizer_problem(record, tokenizer, folder) if isinstance(record, dict) else None
        if tokenizer.vocab_size > loaded.cfg.vocab_size:  # (the one check a run from before the record gets)
            size = loaded.cfg.vocab_size
            problem = f"the tokenizer has {tokenizer.vocab_size} tokens but the model's vocab_size is {size}"
        if problem is not None:
            raise DataError(f"{folder}: {problem}: it is not the tokenizer this model was trained with (copy the run's "
                            "own tokenizer/ folder back, or delete it to use the prepared data's)")  # fmt: skip
    return LoadedModel(loaded.cfg, model, tokenizer, loaded.config, reference_label(loaded.run_dir), loaded.folder)


def refitted_problem(record: dict, tokenizer: Tokenizer) -> str | None:
    """Why `tokenizer`, fitted again from a run's data because its tokenizer/ folder is gone, is not the one the run
    recorded (tokenizer_record), or None: its files, saved as training saved them, are compared with the record."""
    with tempfile.TemporaryDirectory(prefix="attnlab-tokenizer-") as folder:
        tokenizer.save(folder)
        return tokenizer_problem(record, tokenizer, folder)


def parse_hub_ref(ref: str) -> tuple[str, str | None]:
    """("ORG/NAME", revision or None) of `hf:ORG/NAME[@REVISION]`; InputError for anything else."""
    name, _, revision = ref[len(HUB_PREFIX) :].partition("@")
    if not HUB_NAME.fullmatch(name) or ".." in name or (_ and not revision):
        raise InputError(f"{ref!r} is not a Hub reference (expected hf:ORG/NAME or hf:ORG/NAME@REVISION)")
    return name, revision or None


def hub_folder(ref: str, data_dir: str | Path | None = None) -> Path:
    """The local folder of `hf:ORG/NAME[@REVISION]`: a copy in a data directory, the Hugging Face cache, or a
    download. DataError (one line, saying where it looked) when none is available."""
    repo_id, revision = parse_hub_ref(ref)
    looked, copy, misfit = [], None, ""
    for directory in data_dirs(data_dir):
        folder = directory / "models" / repo_id
        found = (folder / "config.json").is_file()
        if not found and os.path.lexists(folder) and not misfit:  # said if the model is found nowhere else
            what = "holds no config.json" if folder.is_dir() else "is a file" if folder.is_file() else "is no folder"
            misfit = f"; {folder} {what}, not a model folder (config.json and the weights)"
        if revision is None:  # a folder in a data directory has no revision to check
            looked.append(str(folder))
            if found:
                return folder
        elif found and copy is None:
            copy = folder
    # With a revision, a copy in a data directory is not used (nothing tells its revision): the way to it is to drop it.
    use_copy = (f"; {copy} holds a copy, but a folder in a data directory has no revision to check: drop @{revision} "
                f"to use it (hf:{repo_id})") if copy else ""  # fmt: skip
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        where = ", ".join(looked) or "nowhere local (a revision was asked for)"
        raise DataError(
            f"{ref}: not found (looked in {where}) and huggingface_hub is not installed to fetch it "
            f"(pip install huggingface_hub{', or put the model folder there' if not copy else ''}){use_copy}{misfit}"
        ) from None
    looked.append("the Hugging Face cache")
    online = downloads_allowed()
    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=HUB_FILES, local_files_only=True))
    except Exception:  # huggingface_hub's LocalEntryNotFoundError and friends: not in the cache
        if not online:
            fix = use_copy or f"{misfit}; put the model folder in <data dir>/models/{repo_id}"
            raise DataError(
                f"{ref}: not found (looked in {', '.join(looked)}) and downloads are off ($ATTNLAB_OFFLINE or "
                f"$HF_HUB_OFFLINE){fix}"
            ) from None
    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=HUB_FILES))
    except Exception as e:  # network, authentication, unknown repository or revision
        reason = " ".join(str(e).split())[:300]
        raise DataError(
            f"{ref}: not found (looked in {', '.join(looked)}) and the download failed ({reason}){use_copy}{misfit}"
        ) from None
