"""Cache details: storage dtype narrower than compute, ring buffers sized to short sequences, positions."""

import pytest
import torch
from helpers import tiny_model

from attnlab.accounting import kv_report
from attnlab.errors import InputError

KINDS = [
    {"kind": "mha", "n_kv_heads": 2},
    {"kind": "decoupled", "d_sem": 16, "d_geo": 32},
    {"kind": "sliding", "window": 6},
    {"kind": "mla", "d_latent": 16},
]


@pytest.mark.parametrize("attention", KINDS, ids=lambda a: a["kind"])
def test_fp16_cache_with_fp32_model_halves_bytes_and_stays_close(attention):
    model = tiny_model(attention)
    tokens = torch.randint(0, 97, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full, _ = model(tokens, use_cache=False)
        cache16 = model.new_cache(2, 32, dtype=torch.float16)
        cache32 = model.new_cache(2, 32)
        steps = [model(tokens[:, :7], cache=cache16)[0]] + [
            model(tokens[:, t : t + 1], cache=cache16)[0] for t in range(7, 20)
        ]
    assert cache16.nbytes() * 2 == cache32.nbytes()
    assert torch.cat(steps, dim=1).dtype == torch.float32
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=5e-3, rtol=0)


def test_ring_cache_for_a_short_sequence_holds_only_that_many_slots():
    model = tiny_model({"kind": "sliding", "window": 6})
    cache = model.new_cache(1, 4)
    assert cache.layers[0].capacity == 4
    assert cache.nbytes() == kv_report(model.cfg, "fp32", 4)["kv_bytes"]
    tokens = torch.randint(0, 97, (1, 5))
    with torch.no_grad():
        model(tokens[:, :4], cache=cache)
        with pytest.raises(InputError, match="ring cache made for max_len=4"):
            model(tokens[:, 4:], cache=cache)


def test_ring_positions_after_wrapping():
    model = tiny_model({"kind": "sliding", "window": 6})
    cache = model.new_cache(1, 64)
    with torch.no_grad():
        model(torch.randint(0, 97, (1, 9)), cache=cache)  # a chunk longer than the window
        model(torch.randint(0, 97, (1, 1)), cache=cache)
    held = sorted(cache.layers[0].positions().tolist())
    assert held == [4, 5, 6, 7, 8, 9]
    assert cache.seen == 10
