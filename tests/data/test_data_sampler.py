"""Training batches (determinism, resume, rank shards) and evaluation windows."""

import json

import numpy as np
import pytest
import torch

from attnlab.data import BatchSampler, eval_batches
from attnlab.errors import DataError, InputError

N = 10_000


@pytest.fixture
def tokens(tmp_path):
    """A memory-mapped uint16 split whose token at position i is i: a window's content gives its offset."""
    path = tmp_path / "train.bin"
    np.arange(N, dtype=np.uint16).tofile(path)
    return np.memmap(path, dtype=np.uint16, mode="r", shape=(N,))


def batches(sampler, n):
    return [sampler.next_batch() for _ in range(n)]


def same(a, b):
    return all(torch.equal(xa, xb) and torch.equal(ya, yb) for (xa, ya), (xb, yb) in zip(a, b, strict=True))


def test_windows_are_shifted_pairs_from_the_split(tokens):
    x, y = BatchSampler(tokens, seq_len=16, batch_size=4, seed=0).next_batch()
    assert x.shape == y.shape == (4, 16) and x.dtype == y.dtype == torch.int64
    offsets = x[:, :1]
    assert torch.equal(x, offsets + torch.arange(16)) and torch.equal(y, x + 1)
    assert int(offsets.max()) + 16 < N


def test_offsets_cover_the_whole_split_and_never_run_past_it():
    small = np.arange(8, dtype=np.uint16)  # seq_len 5: windows of 6 tokens start at 0, 1 or 2
    sampler = BatchSampler(small, seq_len=5, batch_size=8, seed=3)
    starts = {int(x[b, 0]) for x, _ in batches(sampler, 20) for b in range(8)}
    assert starts == {0, 1, 2}


def test_same_seed_same_batches_other_seed_other_batches(tokens):
    first = batches(BatchSampler(tokens, 32, 8, seed=7), 5)
    assert same(first, batches(BatchSampler(tokens, 32, 8, seed=7), 5))
    assert not same(first, batches(BatchSampler(tokens, 32, 8, seed=8), 5))
    assert len({int(x[0, 0]) for x, _ in first}) == 5  # steps differ from each other


def test_resume_from_state_dict_continues_the_same_batches(tokens):
    reference = BatchSampler(tokens, 32, 8, seed=1)
    batches(reference, 3)
    state = json.loads(json.dumps(reference.state_dict()))  # plain data: survives json and torch.save
    expected = batches(reference, 4)
    resumed = BatchSampler(tokens, 32, 8, seed=1)
    resumed.load_state_dict(state)
    assert same(batches(resumed, 4), expected)
    with pytest.raises(InputError, match="seq_len=32 .*this sampler: 64"):
        BatchSampler(tokens, 64, 8, seed=1).load_state_dict(state)
    with pytest.raises(InputError, match="seed=1 .*this sampler: 2"):
        BatchSampler(tokens, 32, 8, seed=2).load_state_dict(state)


@pytest.mark.parametrize("world_size", [2, 4])
def test_rank_shards_union_is_the_single_process_batch(tokens, world_size):
    single = batches(BatchSampler(tokens, 16, 4 * world_size, seed=5), 3)
    ranks = [batches(BatchSampler(tokens, 16, 4, seed=5, rank=r, world_size=world_size), 3) for r in range(world_size)]
    for step, (x, y) in enumerate(single):
        assert torch.equal(torch.cat([ranks[r][step][0] for r in range(world_size)]), x)
        assert torch.equal(torch.cat([ranks[r][step][1] for r in range(world_size)]), y)


def test_resume_on_another_number_of_ranks_with_the_same_global_batch(tokens):
    two = [BatchSampler(tokens, 16, 4, seed=9, rank=r, world_size=2) for r in range(2)]
    for sampler in two:
        batches(sampler, 2)
    single = BatchSampler(tokens, 16, 8, seed=9)
    single.load_state_dict(two[0].state_dict())
    x, _ = single.next_batch()
    assert torch.equal(x, torch.cat([two[0].next_batch()[0], two[1].next_batch()[0]]))


def test_sampler_errors(tokens):
    with pytest.raises(DataError, match="fewer than seq_len"):
        BatchSampler(tokens[:10], seq_len=10, batch_size=1)
    with pytest.raises(InputError, match="rank=2"):
        BatchSampler(tokens, 8, 1, rank=2, world_size=2)


def test_eval_windows_are_consecutive_non_overlapping_and_within_budget(tokens):
    seq_len, budget = 100, 4_150
    got = list(eval_batches(tokens, seq_len, batch_size=16, max_tokens=budget))
    assert [x.shape[0] for x, _ in got] == [16, 16, 9]  # 41 windows = 4150 // 100
    x = torch.cat([x for x, _ in got])
    y = torch.cat([y for _, y in got])
    assert torch.equal(x.flatten(), torch.arange(41 * seq_len))  # from the start, no gap, no overlap
    assert torch.equal(y, x + 1) and x.numel() <= budget
    assert got[0][0].dtype == torch.int64


def test_eval_windows_without_budget_cover_the_split_and_shard_over_ranks(tokens):
    windows = torch.cat([x for x, _ in eval_batches(tokens, 128, batch_size=7)])
    assert windows.shape == ((N - 1) // 128, 128)  # the last window's target is the split's last token
    shards = [torch.cat([x for x, _ in eval_batches(tokens, 128, 7, rank=r, world_size=3)]) for r in range(3)]
    starts = sorted(int(s) for shard in shards for s in shard[:, 0])
    assert starts == windows[:, 0].tolist()


def test_eval_budget_below_one_window_is_an_error(tokens):
    with pytest.raises(DataError, match="no evaluation window"):
        list(eval_batches(tokens, seq_len=256, batch_size=4, max_tokens=100))
