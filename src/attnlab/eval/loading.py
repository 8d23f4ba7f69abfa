"""A model ready for evaluation: config, model (eval mode), its tokenizer and a label, from any model reference
(attnlab.interop.load_model: an attnlab run or checkpoint, a .gguf file, a Hugging Face folder, hf:ORG/NAME)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from attnlab.config import ModelConfig
from attnlab.interop.references import load_reference


@dataclass
class EvalModel:
    name: str  # a label for tables: <target>/seed<S> for runs, else the file or folder name (ORG/NAME for hf:)
    path: Path  # the reference as given (hf:ORG/NAME stays a string in `str(path)`)
    cfg: ModelConfig
    model: object  # attnlab Transformer, eval mode
    tokenizer: object | None  # attnlab.data Tokenizer (None for token-level benchmarks on models without one)
    config: dict  # an attnlab run's resolved config (model, data, train); a pretrained model's {"model", "source"}

    @property
    def device(self):
        return next(self.model.parameters()).device


def load_for_eval(path: str | Path, data_dir: str | None = None, tag: str = "best", device=None) -> EvalModel:
    """Loads a model reference: a run directory (its best checkpoint, else last), a checkpoint folder, a .gguf file,
    a Hugging Face folder or hf:ORG/NAME. A run's tokenizer comes from its `tokenizer/` folder, else from the
    prepared data of its data config; a pretrained model's from its own files."""
    loaded = load_reference(path, data_dir=data_dir, tag=tag)
    model = loaded.model if device is None else loaded.model.to(device)
    return EvalModel(loaded.label, Path(path), loaded.cfg, model, loaded.tokenizer, loaded.config)
