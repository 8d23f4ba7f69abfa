"""A checkpoint ready for evaluation: config, model (eval mode) and the tokenizer it was trained with."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from attnlab.config import ModelConfig
from attnlab.errors import DataError


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
    from attnlab.train.checkpoint import load_model_from_checkpoint

    path = Path(path)
    cfg, model = load_model_from_checkpoint(path, tag=tag)
    if device is not None:
        model = model.to(device)
    run_dir = path if (path / "checkpoints").exists() else path.parent.parent
    config_path = run_dir / "config.json"
    config = json.loads(config_path.read_text()) if config_path.exists() else {"model": cfg.to_dict()}
    tokenizer = None
    data = config.get("data")
    if data:
        from attnlab.data import load_tokenizer

        try:
            tokenizer = load_tokenizer(data["tokenizer"], run_dir / "tokenizer", data_dir=data_dir)
        except DataError:
            from attnlab.config import DataConfig
            from attnlab.data import prepare

            tokenizer = prepare(DataConfig(**data), data_dir=data_dir).tokenizer
    return EvalModel(_label(run_dir), path, cfg, model, tokenizer, config)
