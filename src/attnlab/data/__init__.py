"""Data pipeline: text sources -> tokenizer -> prepared token files -> batches.

    prepared = prepare(DataConfig(source="wikitext2", tokenizer="gpt2"), data_dir="shared/data")
    sampler = BatchSampler(prepared.split("train"), seq_len=256, batch_size=16, seed=0)
    x, y = sampler.next_batch()                       # (B, T) int64 each, y = x shifted by one
    for x, y in eval_batches(prepared.split("val"), seq_len=256, batch_size=16, max_tokens=65536): ...

Modules: `tokenizers` (gpt2, bpe:<N>, word, byte, char), `sources` (datasets and local files as documents
with their split), `prepared` (the cached token files and meta.json), `sampler` (training and eval windows).
"""

from attnlab.data.prepared import Prepared, default_cache_dir, open_prepared, prepare, token_dtype
from attnlab.data.sampler import BatchSampler, eval_batches
from attnlab.data.sources import Source, open_source, split_of
from attnlab.data.tokenizers import Tokenizer, load_tokenizer, train_tokenizer

__all__ = [
    "BatchSampler",
    "Prepared",
    "Source",
    "Tokenizer",
    "default_cache_dir",
    "eval_batches",
    "load_tokenizer",
    "open_prepared",
    "open_source",
    "prepare",
    "split_of",
    "token_dtype",
    "train_tokenizer",
]
