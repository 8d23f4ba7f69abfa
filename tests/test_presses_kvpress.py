"""attnlab's presses against NVIDIA's kvpress on the same tiny random Llama: the prompt pressed at prefill, then the
continuation's logits. kvpress 0.5.5 pins transformers below 5.3, so it lives in an environment of its own
(`pip install -e '.[presses]'` in a fresh venv, BENCHMARKS.md "KV presses"); here the test skips without it."""

from __future__ import annotations

import pytest
import torch

try:  # kvpress 0.5.5 fails to import beside transformers >= 5.3 (it patches attention functions at import)
    import kvpress
    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM
except (ImportError, AttributeError, TypeError) as error:
    pytest.skip(f"kvpress is not usable here ({type(error).__name__}: {error})", allow_module_level=True)

import attnlab
from attnlab.config import MemoryConfig
from attnlab.interop.hf import from_hf_llama

CONTEXT, CONTINUATION = 48, 16


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         rope_theta=10000.0, tie_word_embeddings=False, attn_implementation="eager")  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # larger weights than the init's, so attention is far from uniform and scores differ
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(4.0)
    return model


PRESSES = {
    "knorm": (lambda: kvpress.KnormPress(compression_ratio=0.5), {"kind": "knorm", "compression_ratio": 0.5}),
    "tova": (lambda: kvpress.TOVAPress(compression_ratio=0.5), {"kind": "tova", "compression_ratio": 0.5}),
    "snapkv": (lambda: kvpress.SnapKVPress(compression_ratio=0.5, window_size=8, kernel_size=5),
               {"kind": "snapkv", "compression_ratio": 0.5, "window_size": 8, "kernel_size": 5}),
}  # fmt: skip


@pytest.mark.parametrize("name", list(PRESSES))
def test_continuation_logits_equal_kvpress(name):
    make_press, memory = PRESSES[name]
    reference = tiny_llama()
    tokens = torch.randint(0, 97, (1, CONTEXT + CONTINUATION), generator=torch.Generator().manual_seed(1))
    context, continuation = tokens[:, :CONTEXT], tokens[:, CONTEXT:]
    with torch.no_grad():
        cache = DynamicCache()
        with make_press()(reference):
            reference(context, past_key_values=cache)
        positions = torch.arange(CONTEXT, CONTEXT + CONTINUATION)[None]
        expected = reference(continuation, past_key_values=cache, position_ids=positions).logits
        unpressed = reference(tokens).logits[:, CONTEXT:]
    cfg, model = from_hf_llama(reference)
    pressed = attnlab.build_model(cfg.replace(memory=MemoryConfig(**memory))).eval()
    pressed.load_state_dict(model.state_dict())
    with torch.no_grad():
        ours = pressed.new_cache(1)
        pressed(context, ours)
        got = pressed(continuation, ours)[0]
    assert all(layer.positions().shape[-1] == CONTEXT // 2 + CONTINUATION for layer in ours.layers)
    assert (expected - unpressed).abs().max() > 1e-2  # the press changed something
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
