"""Parity with an independent implementation: transformers' LlamaForCausalLM imported with from_hf_llama."""

import pytest
import torch

import attnlab

transformers = pytest.importorskip("transformers")


def random_llama(n_kv_heads: int, vocab: int = 1000, tie: bool = False, seed: int = 0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=n_kv_heads,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tie,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # make the norms non-trivial, so their import is tested too
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


@pytest.mark.parametrize("n_kv_heads, tie", [(8, False), (2, False), (1, True)])
def test_logits_match_transformers(n_kv_heads, tie):
    hf = random_llama(n_kv_heads, tie=tie)
    cfg, model = attnlab.from_hf_llama(hf)
    assert cfg.attention.n_kv_heads == n_kv_heads and cfg.vocab_size == 1000 and cfg.padded_vocab_size == 1024
    tokens = torch.randint(0, 1000, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(tokens).logits
        ours, _ = model(tokens, use_cache=False)
    assert ours.shape == expected.shape
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=0)
    # The cached path agrees too: prefill 25 tokens, then decode the rest one at a time.
    cache = model.new_cache(2, 40)
    pieces = [model(tokens[:, :25], cache=cache)[0]] + [
        model(tokens[:, t : t + 1], cache=cache)[0] for t in range(25, 40)
    ]
    torch.testing.assert_close(torch.cat(pieces, dim=1), expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("n_kv_heads", [8, 2])
def test_greedy_generation_matches_transformers(n_kv_heads):
    hf = random_llama(n_kv_heads, seed=3)
    _, model = attnlab.from_hf_llama(hf)
    prompt = torch.randint(3, 1000, (1, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = hf.generate(prompt, max_new_tokens=30, min_new_tokens=30, do_sample=False)[0, 12:]
    ours = attnlab.generate(model, prompt[0], max_new_tokens=30, temperature=0.0)
    assert ours.tolist() == expected.tolist()


def test_unsupported_llama_variants_are_refused():
    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        attention_bias=True,
    )  # fmt: skip
    with pytest.raises(attnlab.ConfigError, match="attention_bias"):
        attnlab.from_hf_llama(transformers.LlamaForCausalLM(cfg))
