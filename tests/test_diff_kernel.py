"""The fused differential attention kernel (attnlab.kernels.diff_attention) against the PyTorch path.

Runs on a GPU when there is one, else under Triton's interpreter (TRITON_INTERPRET=1, CPU tensors); skipped
only when triton is not importable. Random inputs: decode (1 query) and prefill shapes, chunks against a
cache, GQA ratios 1, 2 and 4, diff's shapes (q/k of D/2, v of D, one lambda) and CoDA's (k1 = k2, a lambda
per token and head), with and without the head norm, and positions with empty (-1) and unordered slots.
"""

from __future__ import annotations

import importlib
import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    # Triton decorates its own language functions when it is first imported, so the interpreter must be
    # chosen before anything imports triton: here, at collection (nothing else in the suite uses triton).
    os.environ.setdefault("TRITON_INTERPRET", "1")

import attnlab.attention.coda as coda_module  # noqa: E402
import attnlab.attention.differential as differential_module  # noqa: E402
from attnlab.attention.coda import CoDAConfig  # noqa: E402
from attnlab.attention.differential import DiffConfig, Differential  # noqa: E402
from attnlab.config import ModelConfig  # noqa: E402
from attnlab.kernels import fused_usable  # noqa: E402
from attnlab.model.transformer import build_model  # noqa: E402
from attnlab.ops.attend import attend  # noqa: E402
from attnlab.ops.masks import causal_mask  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def kernel():
    """The kernel function: compiled on a GPU, else run by Triton's interpreter on CPU tensors."""
    triton = pytest.importorskip("triton")
    if DEVICE == "cpu" and not triton.knobs.runtime.interpret:
        pytest.fail("triton was imported before TRITON_INTERPRET=1 was set: run with TRITON_INTERPRET=1")
    return importlib.import_module("attnlab.kernels.diff_attention").diff_attention


def torch_path(q1, q2, k1, k2, v, lam, scale, q_pos, k_pos, weight=None, eps=1e-5) -> torch.Tensor:
    """What the layers compute without the kernel: two `attend` calls, the subtraction, the head norm."""
    mask = causal_mask(q_pos, k_pos)  # (T, S)
    lam = lam[..., None] if lam.dim() == 3 else lam  # (B, H, T, 1) per row, or a scalar
    y = attend(q1, k1, v, mask, scale) - lam * attend(q2, k2, v, mask, scale)  # (B, H, T, Dv)
    if weight is not None:
        gain = weight[:, None, :] if weight.dim() == 2 else weight
        y = y / torch.sqrt(y.pow(2).mean(-1, keepdim=True) + eps) * gain
    return y


def random_case(batch, n_heads, n_kv, seq_q, seq_k, dim_qk, dim_v, shared_k=False, per_row=False, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(DEVICE)

    q1, q2 = rand(batch, n_heads, seq_q, dim_qk), rand(batch, n_heads, seq_q, dim_qk)
    k1 = rand(batch, n_kv, seq_k, dim_qk)
    k2 = k1 if shared_k else rand(batch, n_kv, seq_k, dim_qk)
    v = rand(batch, n_kv, seq_k, dim_v)
    lam = torch.rand(batch, n_heads, seq_q, generator=gen).to(DEVICE) if per_row else torch.tensor(0.63, device=DEVICE)
    return q1, q2, k1, k2, v, lam


SHAPES = {  # batch, n_heads, n_kv_heads, seq_q, seq_k
    "decode": (2, 4, 4, 1, 37),
    "decode-gqa2": (2, 4, 2, 1, 70),
    "decode-gqa4": (1, 8, 2, 1, 130),
    "prefill": (2, 4, 4, 29, 29),
    "prefill-gqa2": (1, 4, 2, 40, 40),
    "prefill-gqa4": (1, 4, 1, 70, 70),
    "prefill-long": (1, 2, 2, 130, 130),  # rows 0..63 skip the key tile 64..127 (all in their future)
    "chunk-after-cache": (2, 4, 2, 5, 21),
}


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
@pytest.mark.parametrize("norm", ["shared", "none"])
def test_diff_shapes_match_torch_path(kernel, shape, norm):
    """diff: q/k of D/2 = 8, v of D = 16, one lambda; queries are the last T positions of 0..S-1."""
    batch, n_heads, n_kv, seq_q, seq_k = shape
    q1, q2, k1, k2, v, lam = random_case(batch, n_heads, n_kv, seq_q, seq_k, 8, 16)
    k_pos = torch.arange(seq_k, device=DEVICE)
    q_pos = k_pos[seq_k - seq_q :]
    gain = 1 + 0.3 * torch.randn(16, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    weight = gain if norm == "shared" else None
    scale = 1 / math.sqrt(8)
    got = kernel(q1, q2, k1, k2, v, lam, scale, q_pos, k_pos, weight)
    expected = torch_path(q1, q2, k1, k2, v, lam, scale, q_pos, k_pos, weight)
    assert got.shape == (batch, n_heads, seq_q, 16)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("shape", [SHAPES["decode-gqa2"], SHAPES["prefill-gqa4"]], ids=["decode", "prefill"])
def test_coda_shapes_match_torch_path(kernel, shape):
    """CoDA's form: the same keys for both streams (k1 = k2), a lambda per token and head, a gain per head."""
    batch, n_heads, n_kv, seq_q, seq_k = shape
    q1, q2, k1, k2, v, lam = random_case(batch, n_heads, n_kv, seq_q, seq_k, 16, 16, shared_k=True, per_row=True)
    k_pos = torch.arange(seq_k, device=DEVICE)
    q_pos = k_pos[seq_k - seq_q :]
    weight = 1 + 0.3 * torch.randn(n_heads, 16, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    got = kernel(q1, q2, k1, k2, v, lam, 0.25, q_pos, k_pos, weight)
    expected = torch_path(q1, q2, k1, k2, v, lam, 0.25, q_pos, k_pos, weight)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-5)


def test_empty_and_unordered_slots(kernel):
    """Masks come from positions: empty slots (-1) and slots in any order (a wrapped ring) are handled, and a
    tile holding only future keys is skipped without changing the result."""
    q1, q2, k1, k2, v, lam = random_case(2, 4, 2, 3, 80, 8, 16, seed=3)
    k_pos = torch.randperm(80, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    k_pos[k_pos > 70] = -1  # empty slots
    q_pos = torch.tensor([40, 55, 70], device=DEVICE)
    got = kernel(q1, q2, k1, k2, v, lam, 0.3, q_pos, k_pos)
    torch.testing.assert_close(got, torch_path(q1, q2, k1, k2, v, lam, 0.3, q_pos, k_pos), atol=2e-5, rtol=1e-5)


LAYERS = {  # attention config, the module whose fused_usable decides
    "diff": (DiffConfig(), differential_module),
    "diff-gqa": (DiffConfig(n_kv_heads=2), differential_module),
    "coda-gqa": (CoDAConfig(n_kv_heads=2, gate_bias=0.0), coda_module),
    "coda-mqa-no-head-norm": (CoDAConfig(n_kv_heads=1, gate_bias=0.0, head_norm=False), coda_module),
}


@pytest.mark.parametrize("attention, module", LAYERS.values(), ids=LAYERS.keys())
def test_layer_uses_the_kernel_and_matches_its_torch_path(kernel, monkeypatch, attention, module):
    """A layer with the kernel (forced here; on its own only on CUDA without autograd) equals its PyTorch path:
    full forward and token-by-token decode through the cache."""
    cfg = ModelConfig(vocab_size=50, d_model=32, n_layers=4, n_heads=4, max_seq_len=32, attention=attention)
    torch.manual_seed(0)
    layer = build_model(cfg).blocks[3].attn.to(DEVICE).eval()  # layer index 3: diff's lambda_init 0.556
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name.startswith("head_norm"):
                p.add_(0.3 * torch.randn(p.shape, device=DEVICE))
    x = torch.randn(2, 9, 32, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    positions = torch.arange(9, device=DEVICE)

    def decode():
        cache = layer.new_cache(2, 16, torch.float32, DEVICE)
        return torch.cat([layer(x[:, i : i + 1], positions[i : i + 1], cache)[0] for i in range(9)], dim=1)

    with torch.no_grad():
        monkeypatch.setattr(module, "fused_usable", lambda x, module: False)
        plain, plain_decode = layer(x, positions)[0], decode()
        calls = []

        def fused(*args, **kwargs):
            calls.append(args[0].shape)
            return kernel(*args, **kwargs)

        monkeypatch.setattr(module, "fused_usable", lambda x, module: True)
        monkeypatch.setattr("attnlab.kernels.diff_attention.diff_attention", fused)
        torch.testing.assert_close(layer(x, positions)[0], plain, atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(decode(), plain_decode, atol=2e-5, rtol=1e-5)
    assert len(calls) == 1 + 9


def test_kernel_is_used_only_on_cuda_without_autograd():
    layer = Differential(ModelConfig(vocab_size=50, d_model=32, n_layers=1, n_heads=4, attention=DiffConfig()))
    x = torch.randn(1, 3, 32)
    assert not fused_usable(x, layer)  # CPU
    if torch.cuda.is_available():
        layer, x = layer.cuda(), x.cuda()
        assert not fused_usable(x, layer)  # parameters need gradients
        with torch.no_grad():
            assert fused_usable(x, layer) is (importlib.util.find_spec("triton") is not None)
