"""Helpers shared by test modules (import as `from helpers import ...`; tests/ is on sys.path)."""

from pathlib import Path


def train_tiny_run(root: Path, model: dict, steps: int = 20, seq_len: int = 32, words: int = 30) -> Path:
    """A tiny run trained on a made-up corpus (char tokenizer) under root/runs/tiny/seed0, for tests that
    evaluate a real checkpoint folder: its path."""
    import random

    import attnlab
    from attnlab.config import DataConfig, TrainConfig
    from attnlab.train.loop import train

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
    from attnlab.cache.layout import CacheLayout, Field, Read

    fields = {"k": [Field("k", head_dim, rope=True)], "v": [Field("v", head_dim)]}
    return CacheLayout.of(fields, kv_heads=kv_heads, route="v", read=Read("k", "v"), rope_interleaved=interleaved)
