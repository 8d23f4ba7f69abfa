"""Scoring text with a model: log-probabilities of continuations and greedy generation of text."""

from __future__ import annotations

import torch

from attnlab.generate import generate, refuse_nan_logits


@torch.no_grad()
def token_logprobs(model, ids: list[int]) -> torch.Tensor:
    """(len(ids) - 1,) log p(ids[t] | ids[:t]) for t >= 1, in fp32. A sequence longer than max_seq_len + 1
    keeps its last max_seq_len + 1 tokens (the model reads max_seq_len of them, as lm-eval's window does)."""
    ids = ids[-(model.cfg.max_seq_len + 1) :]
    tokens = torch.tensor([ids], device=next(model.parameters()).device)  # (1, T + 1)
    logits, _ = model(tokens[:, :-1], use_cache=False)  # (1, T, V)
    refuse_nan_logits(model, logits, f"on a text of {tokens.shape[1] - 1} tokens")
    logprobs = logits[0].float().log_softmax(dim=-1)
    return logprobs.gather(-1, tokens[0, 1:, None])[:, 0]


@torch.no_grad()
def continuation_logprobs(model, context: list[int], continuation: list[int]) -> torch.Tensor:
    """(len(continuation),) log p of each continuation token after the context (the context is cut on the
    left to fit max_seq_len). This is what multiple-choice and likelihood probes sum or average."""
    if not continuation:
        raise ValueError("continuation is empty")
    return token_logprobs(model, context + continuation)[-len(continuation) :]


def greedy_text(model, tokenizer, prompt: str, max_new_tokens: int = 32, stop_at_eot: bool = True) -> str:
    """The model's greedy continuation of `prompt`, decoded (end-of-text stops it and is not included)."""
    ids = tokenizer.encode(prompt)[-(model.cfg.max_seq_len - max_new_tokens) :] or [tokenizer.eot_id]
    stops = [tokenizer.eot_id] if stop_at_eot else []
    # compile=False: a few tokens per call; compiling the decode step (seconds per model and cache size)
    # would cost more than it saves.
    out = generate(
        model, ids, max_new_tokens=max_new_tokens, temperature=0.0, stop_tokens=stops, compile=False
    ).tolist()
    if stop_at_eot and out and out[-1] == tokenizer.eot_id:
        out = out[:-1]
    return tokenizer.decode(out)
