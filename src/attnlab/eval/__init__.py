"""Evaluation: load any checkpoint with its tokenizer, score text, run benchmarks, write records.

Every benchmark writes records (JSONL rows with the config hash, device, dtype and versions next to the
figures); tables and plots are pure functions of those records.
"""

from attnlab.eval.loading import EvalModel, load_for_eval
from attnlab.eval.records import append_records, make_record, read_records
from attnlab.eval.scoring import continuation_logprobs, greedy_text, token_logprobs

__all__ = [
    "EvalModel", "append_records", "continuation_logprobs", "greedy_text", "load_for_eval", "make_record",
    "read_records", "token_logprobs",
]  # fmt: skip
