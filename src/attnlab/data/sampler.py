"""Batches from a split's token array: random training windows (`BatchSampler`) and evaluation windows.

Windows are read from the (memory-mapped) array and cast to int64 one batch at a time; the split itself is
never copied whole.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from attnlab.errors import DataError, InputError


def _check_layout(seq_len: int, batch_size: int, rank: int, world_size: int) -> None:
    if seq_len < 1 or batch_size < 1 or world_size < 1 or not 0 <= rank < world_size:
        raise InputError(
            f"seq_len={seq_len} and batch_size={batch_size} must be >= 1, "
            f"and rank={rank} in [0, world_size={world_size})"
        )


def _windows(tokens: np.ndarray, offsets: np.ndarray, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, y), both (B, T) int64: x = tokens[o : o+T], y = tokens[o+1 : o+T+1] for each offset o."""
    rows = np.stack([tokens[o : o + seq_len + 1] for o in offsets.tolist()])  # (B, T+1), the array's dtype
    window = torch.from_numpy(rows.astype(np.int64))  # (B, T+1)
    return window[:, :-1].contiguous(), window[:, 1:].contiguous()


class BatchSampler:
    """Random windows of `seq_len + 1` tokens from `tokens` (shape (N,)), reproducible, resumable, shardable.

    Counter-based: the offsets of step s's *global* batch (batch_size * world_size windows) are drawn from a
    generator seeded with (seed, s), and rank r takes windows [r * batch_size, (r + 1) * batch_size). So the
    union over ranks equals the batch one process with batch_size * world_size draws, the state is just the
    step counter, and a resumed run (even on another number of ranks with the same global batch) continues the
    exact same sequence of batches.
    """

    def __init__(
        self, tokens: np.ndarray, seq_len: int, batch_size: int, seed: int = 0, rank: int = 0, world_size: int = 1
    ):
        _check_layout(seq_len, batch_size, rank, world_size)
        if len(tokens) < seq_len + 1:
            raise DataError(f"the split has {len(tokens):,} tokens, fewer than seq_len + 1 = {seq_len + 1}")
        if seed < 0:
            raise InputError(f"seed={seed} must be >= 0")
        self.tokens = tokens
        self.seq_len, self.batch_size, self.seed = seq_len, batch_size, seed
        self.rank, self.world_size = rank, world_size
        self.step = 0

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.world_size

    def global_offsets(self, step: int) -> np.ndarray:
        """Start offsets (global_batch,) of step `step`'s windows, uniform over [0, N - seq_len - 1]."""
        rng = np.random.default_rng([self.seed, step])
        return rng.integers(0, len(self.tokens) - self.seq_len, size=self.global_batch)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y) int64 tensors of shape (batch_size, seq_len); y is x shifted left by one token."""
        start = self.rank * self.batch_size
        offsets = self.global_offsets(self.step)[start : start + self.batch_size]  # (B,) this rank's share
        self.step += 1
        return _windows(self.tokens, offsets, self.seq_len)

    def state_dict(self) -> dict:
        """Plain ints (safe for json and torch.load(weights_only=True))."""
        return sampler_state(self.seed, self.seq_len, self.global_batch, len(self.tokens), self.step)

    def load_state_dict(self, state: dict) -> None:
        """Continues from `state`; the seed, seq_len, global batch and split size must match."""
        problem = state_problem(state, self.state_dict())
        if problem:
            raise InputError(problem)
        self.step = int(state["step"])


def sampler_state(seed: int, seq_len: int, global_batch: int, n_tokens: int | None, step: int = 0) -> dict:
    """What a BatchSampler saves (its state_dict()), from its settings alone: what a run's sampler would be before it
    is built (n_tokens None: the split is not prepared yet)."""
    return {"step": step, "seed": seed, "seq_len": seq_len, "global_batch": global_batch, "n_tokens": n_tokens}


def state_problem(state: dict, mine: dict) -> str | None:
    """Why a saved sampler state cannot be continued by the sampler whose state is `mine` (sampler_state: its
    n_tokens None when not known yet, then not compared), or None: another seed, seq_len, global batch or split size
    (the training data changed). The step is not compared (it is where the sampler continues)."""
    then, now = state.get("n_tokens"), mine["n_tokens"]
    if isinstance(then, int) and now is not None and then != now:
        return f"the training data changed: its split has {now:,} tokens, {then:,} when the sampler state was saved"
    differ = [
        f"{k}={state.get(k)!r} (this sampler: {mine[k]!r})"
        for k in mine
        if k != "step" and state.get(k) != mine[k] and not (k == "n_tokens" and mine[k] is None)
    ]
    return f"sampler state does not match this sampler: {', '.join(differ)}" if differ else None


def eval_windows(n_tokens: int, seq_len: int, max_tokens: int | None = None) -> int:
    """How many evaluation windows eval_batches makes of a split of n_tokens."""
    n_windows = (n_tokens - 1) // seq_len
    return n_windows if max_tokens is None else min(n_windows, max_tokens // seq_len)


def eval_window_problem(n_tokens: int, seq_len: int, max_tokens: int | None = None) -> str | None:
    """The line eval_batches refuses a split of n_tokens with (no window fits), or None."""
    if eval_windows(n_tokens, seq_len, max_tokens) >= 1:
        return None
    return f"no evaluation window of seq_len={seq_len} fits (split of {n_tokens:,} tokens, budget {max_tokens})"


def eval_batches(
    tokens: np.ndarray,
    seq_len: int,
    batch_size: int,
    max_tokens: int | None = None,
    rank: int = 0,
    world_size: int = 1,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Non-overlapping windows from the start of `tokens`, in batches of (x, y), each (<= batch_size, seq_len).

    Window i is x = tokens[i*T : (i+1)*T], y = tokens[i*T+1 : (i+1)*T+1], so every token is predicted once.
    There are min((N - 1) // T, max_tokens // T) windows (max_tokens bounds the predicted tokens); with
    world_size > 1 rank r takes windows r, r + world_size, ... (the union over ranks is the same set).
    """
    _check_layout(seq_len, batch_size, rank, world_size)
    problem = eval_window_problem(len(tokens), seq_len, max_tokens)
    if problem:
        raise DataError(problem)
    n_windows = eval_windows(len(tokens), seq_len, max_tokens)
    mine = np.arange(rank, n_windows, world_size)  # window indices of this rank
    for start in range(0, len(mine), batch_size):
        yield _windows(tokens, mine[start : start + batch_size] * seq_len, seq_len)
