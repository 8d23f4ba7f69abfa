"""8-bit activations (attnlab.set_activations(model, "q8"), llama.cpp's arithmetic): the codes are gguf's Q8_0 codes,
the kernel's integer sums are exact, its result is a float32 matmul of the quantized activations with the weights
(within float32 summation error), the paths (C kernel, C++ operator, GEMM, PyTorch) agree, and the option is
refused where it would change nothing."""

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import fails, tiny_model
from test_qlinear import adversarial_blocks, gguf_dequantize, use_portable_build

import attnlab
from attnlab.cli import main
from attnlab.errors import InputError
from attnlab.kernels import cpu
from attnlab.kernels.cpu import ops, qmatmul
from attnlab.model.qlinear import QuantizedLinear, quantize_activations

kernels = pytest.mark.skipif(not qmatmul.available(), reason="no working C compiler for the CPU kernels")
CODED = ("q8_0", "q4_0", "q4_1")  # the weight formats with codes (fp16 keeps float32 activations)
U = 2.0**-24


def awkward_x(m: int, k: int, seed: int) -> torch.Tensor:
    """Rows of x with the blocks that break quantizers: all zeros, exact halves of the step (ties), one huge value
    among tiny ones, negative maxima, subnormal floats."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.logspace(-3, 3, m)[:, None]
    x[0, :32] = 0.0
    if k >= 64:
        x[0, 32:64] = torch.arange(32) - 15.5  # d = 16.5 / 127: codes fall on ties of round(x / d)?
        x[0, 32] = -127.0  # |max| = 127: d = 1, so every other value is a half: ties broken away from zero
        x[0, 33:64] = torch.linspace(-30.5, 30.5, 31)
    if m > 1:
        x[1, :32] = torch.full((32,), 1e-38)
        x[1, 5] = -3e4
    return x


def reference(x: torch.Tensor, blocks: torch.Tensor, fmt: str, bias=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(x's 8-bit values times W^T + bias in float64, the size the float32 error is measured against): W by gguf's
    own dequantize, x by quantize_activations; for q4_1 the size counts |d q| + |m| (the kernel sums d q x and m x
    apart, so their cancellation in w = d q + m does not shrink its rounding)."""
    n, k = blocks.shape[0], x.shape[-1]
    xq = quantize_activations(x).double()
    w = gguf_dequantize(blocks, fmt)
    exact = xq @ w.T
    if fmt == "q4_1":
        raw = blocks.view(n, k // 32, 20)
        d = raw[..., 0:2].contiguous().view(torch.float16).double().abs()
        m = raw[..., 2:4].contiguous().view(torch.float16).double().abs()
        nibbles = raw[..., 4:].long()
        codes = torch.cat([nibbles & 15, nibbles >> 4], dim=-1).double()  # (n, nb, 32): elements 0..15, 16..31
        w = (d * codes + m).reshape(n, k)
    size = xq.abs() @ w.abs().T
    if bias is not None:
        exact, size = exact + bias.double(), size + bias.double().abs()
    return exact, size


def assert_q8_close(y, x, blocks, fmt, bias=None):
    exact, size = reference(x.reshape(-1, x.shape[-1]), blocks, fmt, bias)
    bound = (x.shape[-1] + 8) * U * size + 1e-30
    error = (y.reshape(exact.shape).double() - exact).abs()
    assert (error <= bound).all(), f"{fmt}: error {error.max().item():.3g} over bound"


@kernels
def test_codes_are_ggufs_q8_0_codes_and_the_torch_path_gives_the_same_values():
    x = awkward_x(6, 128, seed=1)
    codes, scales, sums = qmatmul.quantize_q8(x)
    ggml = gguf.quants.quantize(x.numpy(), gguf.GGMLQuantizationType.Q8_0).reshape(6, 4, 34)
    assert np.array_equal(ggml[..., 2:].view(np.int8).reshape(6, 128), codes.numpy())  # an independent quantizer
    assert torch.equal(sums, codes.view(6, 4, 32).sum(-1, dtype=torch.int32))
    assert torch.equal(scales, x.view(6, 4, 32).abs().amax(-1) / 127)  # float32, not rounded to fp16 as ggml stores it
    assert torch.equal(qmatmul.quantized(x), quantize_activations(x))  # C and PyTorch: the same values
    assert codes[0, 33:64].abs().max() <= 127 and codes[0, 32] == -127
    tiny = torch.full((1, 32), 1e-39)  # 1 / d overflows: all-zero codes (as attnlab.quant), not inf cast to int
    assert not qmatmul.quantize_q8(tiny)[0].any() and not qmatmul.quantize_q8(tiny)[2].any()
    assert torch.equal(qmatmul.quantized(tiny), quantize_activations(tiny))


@kernels
@pytest.mark.parametrize("fmt", CODED)
@pytest.mark.parametrize("n,k", [(1, 32), (5, 64), (37, 576), (70, 1536)])
def test_the_kernel_is_a_float32_matmul_of_the_quantized_activations(fmt, n, k):
    blocks = adversarial_blocks(fmt, n, k, seed=n + k)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(3))
    previous = torch.get_num_threads()
    try:
        for m in (1, 2, 3, 5, 33):  # each count of x rows per pass, two passes, and the GEMM path
            x = awkward_x(m, k, seed=m)
            outputs = []
            for threads in (1, 2):
                torch.set_num_threads(threads)
                outputs.append(qmatmul.matmul(fmt, blocks, x, bias, activations="q8"))
                assert_q8_close(outputs[-1], x, blocks, fmt, bias)
            if m < qmatmul.GEMM_MIN_ROWS:
                assert torch.equal(outputs[0], outputs[1])  # one thread's sum per output, in one order
    finally:
        torch.set_num_threads(previous)


@kernels
def test_the_integer_sums_of_a_block_are_exact():
    """attnlab_block_dot_q8 (the portable C sum, which the vector kernel is tested against through its results):
    against the integer dot product of the codes, -8 offset for q4_0."""
    lib = qmatmul.library()
    x = awkward_x(2, 64, seed=9)
    codes, _, sums = qmatmul.quantize_q8(x)
    for fmt in CODED:
        blocks = adversarial_blocks(fmt, 6, 64, seed=4)
        width = blocks.shape[1] // 2
        for row in range(6):
            block = blocks[row, :width].contiguous()
            raw = block.numpy()
            if fmt == "q8_0":
                w = torch.from_numpy(raw[2:].view(np.int8).astype(np.int64))
            else:
                nib = torch.from_numpy(raw[2 if fmt == "q4_0" else 4 :].astype(np.int64))
                w = torch.cat([nib & 15, nib >> 4]) - (8 if fmt == "q4_0" else 0)
            for i in range(2):
                xc = codes[i, :32].contiguous()
                want = int((w * xc.long()).sum())
                got = lib.attnlab_block_dot_q8(
                    qmatmul.FORMAT_CODES[fmt], block.data_ptr(), xc.data_ptr(), int(sums[i, 0])
                )
                assert got == want, (fmt, row, i)


@kernels
def test_the_portable_c_build_gives_the_same_results(tmp_path, monkeypatch):
    use_portable_build(tmp_path, monkeypatch)
    for fmt in CODED:
        blocks = adversarial_blocks(fmt, 37, 576, seed=2)
        for m in (1, 5):
            x = awkward_x(m, 576, seed=m)
            assert_q8_close(qmatmul.matmul(fmt, blocks, x, activations="q8"), x, blocks, fmt)


@kernels
@pytest.mark.parametrize("fmt", CODED)
def test_every_path_of_a_layer_agrees(fmt):
    """The C++ operator (decoding), the Python operator, the GEMM path (many rows) and PyTorch without the kernels."""
    g = torch.Generator().manual_seed(5)
    layer = QuantizedLinear.from_weight(torch.randn(70, 96, generator=g), fmt)
    attnlab.set_activations(layer, "q8")
    assert "activations=q8" in repr(layer)
    with torch.no_grad():
        for x in (
            torch.randn(1, 96, generator=g),
            torch.randn(3, 1, 96, generator=g),
            torch.randn(40, 96, generator=g),
        ):
            y = layer(x)
            assert_q8_close(y, x, layer.blocks, fmt)
            assert_q8_close(torch.ops.attnlab.qlinear(x, layer.blocks, None, fmt + ":q8"), x, layer.blocks, fmt)
            if ops.load() and x.numel() < qmatmul.GEMM_MIN_ROWS * 96:  # the C++ operator takes decoding's rows
                cpp = torch.ops.attnlab_cpp.qlinear(x, layer.blocks, None, fmt + ":q8")
                assert torch.equal(cpp, torch.ops.attnlab.qlinear(x, layer.blocks, None, fmt + ":q8"))
            with cpu.disabled():  # PyTorch: quantize_activations, then F.linear
                assert_q8_close(layer(x), x, layer.blocks, fmt)
            plain = F.linear(x, layer.dequantize())
            assert not torch.equal(y, plain)  # the option changes the result (not exact)
            assert (y - plain).norm() < 0.05 * plain.norm()


@kernels
def test_a_model_decodes_with_q8_activations_and_fp16_layers_keep_float32():
    model = attnlab.quantize_weights(tiny_model({"kind": "mha", "n_kv_heads": 2}, seed=0, init_std=0.3), "q8_0")
    prompt = torch.randint(0, 97, (9,), generator=torch.Generator().manual_seed(4)).tolist()
    exact = attnlab.generate(model, prompt, max_new_tokens=16, compile=False).tolist()
    attnlab.set_activations(model, "q8")
    assert all(layer.activations == "q8" for layer in model.modules() if isinstance(layer, QuantizedLinear))
    q8 = attnlab.generate(model, prompt, max_new_tokens=16, compile=False).tolist()
    assert q8[:4] == exact[:4]  # near: the same first tokens (greedy, well-separated logits of a tiny model)
    cached = attnlab.generate(model, prompt, max_new_tokens=16, prefill_chunk=4, compile=False).tolist()
    assert cached == q8
    half = attnlab.quantize_weights(tiny_model({"kind": "mha", "n_kv_heads": 2}, seed=0, init_std=0.3), "fp16")
    with pytest.raises(InputError, match="activations=q8 quantizes the inputs of layers whose weights are q8_0"):
        attnlab.set_activations(half, "q8")
    with pytest.raises(InputError, match="activations='q4' is not known"):
        attnlab.set_activations(model, "q4")


def test_the_cli_refuses_q8_activations_on_float_weights(tiny_run, capsys):
    assert fails(capsys, ["generate", str(tiny_run), "hello", "--activations", "q8"],
                 "--activations q8: activations=q8 quantizes the inputs", "(given --weights fp32)")  # fmt: skip
    assert main(["generate", str(tiny_run), "hello", "--weights", "q8_0", "--activations", "q8", "--max-new-tokens",
                 "4"]) == 0  # fmt: skip


def pack_reference(blocks: torch.Tensor, fmt: str) -> torch.Tensor:
    """qmatmul.pack_q8's layout written out plainly (see qmatmul.c): per group of 16 rows and block, the 16 rows'
    scales (and q4_1's mins) side by side, then their codes 4 bytes of each row at a time (q8_0's plus 128)."""
    n, width = blocks.shape
    bb = {"q4_0": 18, "q4_1": 20, "q8_0": 34}[fmt]
    scales = 2 if fmt == "q4_1" else 1
    raw = blocks.view(n // 16, 16, width // bb, bb).transpose(1, 2)  # (group, block, row, bytes)
    heads = raw[..., : 2 * scales].reshape(*raw.shape[:3], scales, 2).transpose(2, 3)  # (group, block, scale, row, 2)
    codes = raw[..., 2 * scales :]
    if fmt == "q8_0":
        codes = codes ^ 0x80
    chunks = codes.reshape(*raw.shape[:3], -1, 4).transpose(2, 3)  # (group, block, chunk, row, 4 bytes)
    return torch.cat([heads.flatten(2), chunks.flatten(2)], dim=-1).reshape(n, width)


@kernels
@pytest.mark.parametrize("fmt", CODED)
def test_packed_rows_are_the_layout_and_give_the_kernels_results(fmt):
    """pack_q8 against its layout written plainly; the packed kernel (AVX-512 VNNI or AVX2 where the CPU has it) against
    float64 over gguf's dequantized weights, within the same bound as the unpacked kernel, one result per output
    whatever the threads."""
    previous = torch.get_num_threads()
    try:
        for n, k in [(16, 32), (48, 64), (64, 576), (32, 1536)]:
            blocks = adversarial_blocks(fmt, n, k, seed=n + k)
            packed = qmatmul.pack_q8(fmt, blocks, k)
            assert packed.shape == blocks.shape and torch.equal(packed, pack_reference(blocks, fmt))
            bias = torch.randn(n, generator=torch.Generator().manual_seed(k))
            for m in (1, 2, 5):
                x = awkward_x(m, k, seed=m)
                outputs = []
                for threads in (1, 2):
                    torch.set_num_threads(threads)
                    outputs.append(qmatmul.matmul(fmt, packed, x, bias, activations="q8", packed=True))
                assert_q8_close(outputs[0], x, blocks, fmt, bias)
                assert torch.equal(outputs[0], outputs[1])
                unpacked = qmatmul.matmul(fmt, blocks, x, bias, gemm=False, activations="q8")
                assert torch.allclose(outputs[0], unpacked, rtol=1e-5, atol=1e-4 * unpacked.abs().max().item())
    finally:
        torch.set_num_threads(previous)
    with pytest.raises(ValueError, match="rows a multiple of 16"):
        qmatmul.pack_q8(fmt, adversarial_blocks(fmt, 20, 64, seed=1), 64)


@kernels
def test_the_portable_c_build_multiplies_packed_rows_too(tmp_path, monkeypatch):
    portable = use_portable_build(tmp_path, monkeypatch)
    assert not portable.attnlab_packed_q8_fast()  # and so attnlab keeps no packed rows on such a machine
    for fmt in CODED:
        blocks = adversarial_blocks(fmt, 48, 576, seed=3)
        packed = qmatmul.pack_q8(fmt, blocks, 576)
        for m in (1, 3):
            x = awkward_x(m, 576, seed=m)
            assert_q8_close(qmatmul.matmul(fmt, packed, x, activations="q8", packed=True), x, blocks, fmt)


@kernels
@pytest.mark.skipif(not qmatmul.packed_fast(), reason="neither AVX-512 VNNI nor AVX2 here: weights are not packed")
def test_a_layer_packs_for_q8_decoding_and_never_keeps_stale_packed_rows():
    g = torch.Generator().manual_seed(6)
    layer = QuantizedLinear.from_weight(torch.randn(48, 96, generator=g), "q4_1")
    odd = QuantizedLinear.from_weight(torch.randn(40, 96, generator=g), "q4_1")  # 40 rows: not a multiple of 16
    attnlab.set_activations(layer, "q8")
    attnlab.set_activations(odd, "q8")
    assert layer.packed is not None and odd.packed is None
    assert layer.nbytes == layer.blocks.nbytes + layer.packed.nbytes and odd.nbytes == odd.blocks.nbytes  # held
    assert "packed" not in layer.state_dict()  # a checkpoint holds the rows as they are, once
    x = torch.randn(2, 96, generator=g)
    with torch.no_grad():
        y = layer(x)
        assert torch.equal(y, torch.ops.attnlab.qlinear(x, layer.packed, None, "q4_1:q8p"))
        assert_q8_close(y, x, layer.blocks, "q4_1")
        assert_q8_close(odd(x), x, odd.blocks, "q4_1")
        other = QuantizedLinear.from_weight(torch.randn(48, 96, generator=g), "q4_1")
        layer.load_state_dict(other.state_dict())  # new weights: packed again
        assert torch.equal(layer.packed, qmatmul.pack_q8("q4_1", other.blocks, 96))
        assert_q8_close(layer(x), x, other.blocks, "q4_1")
    attnlab.set_activations(layer, "fp32")
    assert layer.packed is None and layer.nbytes == layer.blocks.nbytes
