"""Model references: one string names a model, wherever it comes from.

    cfg, model, tokenizer = load_model("models/SmolLM2-135M-Instruct.Q4_1.gguf")    # a GGUF file
    cfg, model, tokenizer = load_model("path/to/hf-folder")                          # a Hugging Face folder
    cfg, model, tokenizer = load_model("hf:HuggingFaceTB/SmolLM2-135M@main")         # the Hub (or a local copy)
    cfg, model, tokenizer = load_model("runs/tiny/seed0")                            # an attnlab run or checkpoint

`hf:ORG/NAME[@REVISION]` is looked for as a folder `<data dir>/models/ORG/NAME` (in each data directory:
--data-dir, $ATTNLAB_DATA, the user cache), then in the Hugging Face cache, then downloaded with
huggingface_hub (an optional dependency) unless downloads are off ($ATTNLAB_OFFLINE / $HF_HUB_OFFLINE).
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from attnlab.config import DataConfig, ModelConfig
from attnlab.data import load_tokenizer, prepare
from attnlab.data.files import downloads_allowed
from attnlab.data.tokenizers import Tokenizer
from attnlab.errors import DataError, InputError
from attnlab.interop.gguf import load_gguf
from attnlab.interop.hf import is_hf_folder, load_hf_folder, read_json
from attnlab.interop.tokenizer import tokenizer_from_folder
from attnlab.model.transformer import Transformer
from attnlab.paths import data_dirs
from attnlab.train.checkpoint import load_checkpoint

HUB_PREFIX = "hf:"
HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")
# What a Hub download fetches: config, safetensors weights and the tokenizer files (never pickles).
HUB_FILES = [
    "config.json", "generation_config.json", "model.safetensors", "model-*.safetensors",
    "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
]  # fmt: skip
KINDS = "a .gguf file, a Hugging Face model folder, an attnlab run or checkpoint folder, or hf:ORG/NAME[@REVISION]"


def load_model(
    ref: str | Path, dtype: torch.dtype = torch.float32, data_dir: str | Path | None = None, *, tag: str = "best"
) -> tuple[ModelConfig, Transformer, Tokenizer | None]:
    """(config, model in eval mode, tokenizer) of the model `ref` names (see the module docstring).

    dtype: the weights' dtype (quantized GGUF weights are dequantized to it). tag: which checkpoint of an
    attnlab run (best, else last). The tokenizer is None only for an attnlab checkpoint saved without one.
    """
    if isinstance(ref, str) and ref.startswith(HUB_PREFIX):
        folder = hub_folder(ref, data_dir)
        cfg, model = load_hf_folder(folder, dtype, name=ref)
        return cfg, model, tokenizer_from_folder(folder, name=ref)
    path = Path(ref)
    if path.is_file():
        with open(path, "rb") as f:
            magic = f.read(4)
        if path.suffix.lower() != ".gguf" and magic != b"GGUF":
            raise DataError(f"{path}: not a GGUF file (a model reference is {KINDS})")
        return load_gguf(path, dtype)
    if not path.is_dir():
        raise DataError(f"{ref}: no such file or folder (a model reference is {KINDS})")
    if (path / "checkpoints").is_dir() or _is_attnlab_checkpoint(path):
        return _load_run(path, dtype, data_dir, tag)
    if is_hf_folder(path):
        cfg, model = load_hf_folder(path, dtype)
        return cfg, model, tokenizer_from_folder(path)
    raise DataError(f"{path}: no config.json naming a model here (a model reference is {KINDS})")


def _is_attnlab_checkpoint(folder: Path) -> bool:
    """A checkpoint folder written by attnlab: config.json holds the resolved run config under "model"."""
    if not (folder / "config.json").is_file():
        return False
    try:
        return isinstance(read_json(folder / "config.json").get("model"), dict)
    except DataError:
        return False


def _load_run(path: Path, dtype, data_dir, tag: str) -> tuple[ModelConfig, Transformer, Tokenizer | None]:
    """An attnlab run or checkpoint: its model, and the tokenizer it was trained with (as eval.loading finds it:
    the run's tokenizer/ folder, else the prepared data of its data config)."""
    loaded = load_checkpoint(path, tag=tag)
    model = loaded.model if dtype == torch.float32 else loaded.model.to(dtype)
    data = loaded.config.get("data")
    tokenizer = None
    if data:
        try:
            tokenizer = load_tokenizer(data["tokenizer"], loaded.run_dir / "tokenizer", data_dir=data_dir)
        except DataError as saved_error:
            try:
                tokenizer = prepare(DataConfig(**data), data_dir=data_dir).tokenizer
            except DataError:
                if (loaded.run_dir / "tokenizer").is_dir():  # the run's own tokenizer is damaged: say so
                    raise saved_error from None
                raise
    return loaded.cfg, model, tokenizer


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
    looked = []
    if revision is None:  # a folder in a data directory has no revision to check
        for directory in data_dirs(data_dir):
            folder = directory / "models" / repo_id
            looked.append(str(folder))
            if (folder / "config.json").is_file():
                return folder
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        where = ", ".join(looked) or "nowhere local (a revision was asked for)"
        raise DataError(
            f"{ref}: not found (looked in {where}) and huggingface_hub is not installed to fetch it "
            "(pip install huggingface_hub, or put the model folder there)"
        ) from None
    looked.append("the Hugging Face cache")
    online = downloads_allowed()
    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=HUB_FILES, local_files_only=True))
    except Exception:  # huggingface_hub's LocalEntryNotFoundError and friends: not in the cache
        if not online:
            raise DataError(
                f"{ref}: not found (looked in {', '.join(looked)}) and downloads are off ($ATTNLAB_OFFLINE or "
                f"$HF_HUB_OFFLINE); put the model folder in <data dir>/models/{repo_id}"
            ) from None
    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=HUB_FILES))
    except Exception as e:  # network, authentication, unknown repository or revision
        reason = " ".join(str(e).split())[:300]
        raise DataError(
            f"{ref}: not found (looked in {', '.join(looked)}) and the download failed ({reason})"
        ) from None
