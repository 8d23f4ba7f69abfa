"""A checkpoint ready for evaluation: config, model (eval mode) and the tokenizer it was trained with."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from attnlab.config import DataConfig, ModelConfig
from attnlab.data import load_tokenizer, prepare
from attnlab.errors import DataError
from attnlab.train.checkpoint import load_checkpoint


@dataclass
class EvalModel:
    name: str  # a label for tables: <target>/seed<S> for runs, else the folder name
    path: Path
    cfg: ModelConfig
    model: object  # attnlab Transformer, eval mode
    tokenizer: object | None  # attnlab.data Tokenizer (None for token-level benchmarks on models without one)
    config: dict  # the full resolved run config (model, data, train) when known

    @property
    def device(self):
        return next(self.model.parameters()).device


def _label(path: Path) -> str:
    parts = path.resolve().parts
    seed = next((i for i in range(len(parts) - 1, -1, -1) if parts[i].startswith("seed")), None)
    return f"{parts[seed - 1]}/{parts[seed]}" if seed else path.name


def load_for_eval(path: str | Path, data_dir: str | None = None, tag: str = "best", device=None) -> EvalModel:
    """Loads a run directory (its best checkpoint, else last) or a checkpoint folder.

    The tokenizer comes from the run's `tokenizer/` folder, else from the prepared data of its data config.
    """
    path = Path(path)
    loaded = load_checkpoint(path, tag=tag)
    model = loaded.model if device is None else loaded.model.to(device)
    run_dir, config = loaded.run_dir, loaded.config
    tokenizer = None
    data = config.get("data")
    if data:
        try:
            tokenizer = load_tokenizer(data["tokenizer"], run_dir / "tokenizer", data_dir=data_dir)
        except DataError as saved_error:
            try:
                tokenizer = prepare(DataConfig(**data), data_dir=data_dir).tokenizer
            except DataError:
                if (run_dir / "tokenizer").is_dir():  # the run's own tokenizer is damaged: say so, not the data's
                    raise saved_error from None
                raise
    return EvalModel(_label(run_dir), path, loaded.cfg, model, tokenizer, config)
