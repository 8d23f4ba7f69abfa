"""Matmuls with weights in a GGUF format (attnlab.kernels.cpu.qmatmul, attnlab.model.qlinear): the C kernels and the
PyTorch path against a float64 matmul over gguf's own dequantized weights, on adversarial blocks; q4_1 byte parity
with gguf; QuantizedLinear / QuantizedEmbedding / quantize_weights on a tiny model, state dicts, the compiled step."""

import importlib
import warnings

import numpy as np
import pytest
import safetensors.torch
import torch
import torch.nn.functional as F
from helpers import tiny_model
from torch.utils._python_dispatch import TorchDispatchMode

import attnlab
from attnlab import quant
from attnlab.errors import AttnlabWarning, InputError
from attnlab.kernels import cpu
from attnlab.kernels.cpu import qmatmul
from attnlab.model.qlinear import FORMATS, QuantizedEmbedding, QuantizedLinear, dequantize_blocks, row_bytes

gguf = pytest.importorskip("gguf")
kernels = pytest.mark.skipif(not qmatmul.available(), reason="no working C compiler for the CPU kernels")

GGML_TYPES = {"fp16": "F16", "q8_0": "Q8_0", "q4_0": "Q4_0", "q4_1": "Q4_1"}
U = 2.0**-24  # float32 unit roundoff
# Scales where formats break: zero, negative zero, fp16 subnormals (smallest, largest), the largest fp16 (both signs),
# and ordinary ones.
SPECIAL_SCALES = [0.0, -0.0, 2.0**-24, 2.0**-14 - 2.0**-24, 65504.0, -65504.0, 1.0, -0.0123, 3.5]


def gguf_dequantize(blocks: torch.Tensor, fmt: str) -> torch.Tensor:
    """W in float64 by gguf's dequantize (an implementation independent of attnlab's)."""
    kind = gguf.GGMLQuantizationType[GGML_TYPES[fmt]]
    if fmt == "fp16":
        return blocks.contiguous().view(torch.float16).double()
    return torch.from_numpy(np.asarray(gguf.quants.dequantize(blocks.numpy(), kind), dtype=np.float64))


def adversarial_blocks(fmt: str, n: int, k: int, seed: int) -> torch.Tensor:
    """Rows (n, row bytes) of W in `fmt`: random codes under the SPECIAL_SCALES (and q4_1 mins), all-zero blocks,
    codes at their extremes, and rows quantized by ggml's rounding from values with one huge outlier per block."""
    g = torch.Generator().manual_seed(seed)
    if fmt == "fp16":
        values = torch.randn(n, k, generator=g) * torch.logspace(-6, 4, n)[:, None]
        specials = torch.tensor(SPECIAL_SCALES + [2.0**-20, -(2.0**-24)])
        mask = torch.rand(n, k, generator=g) < 0.2
        values[mask] = specials[torch.randint(0, len(specials), (int(mask.sum()),), generator=g)]
        return values.half().view(torch.uint8)
    nb, size = k // quant.BLOCK, quant.block_bytes(fmt)
    blocks = torch.randint(0, 256, (n, nb, size), generator=g, dtype=torch.uint8)
    scales = torch.tensor(SPECIAL_SCALES, dtype=torch.float16).view(torch.uint8).view(-1, 2)  # (S, 2)
    pick = torch.randint(0, len(SPECIAL_SCALES), (n, nb), generator=g)
    blocks[..., :2] = scales[pick]
    if fmt == "q4_1":
        blocks[..., 2:4] = scales[torch.randint(0, len(SPECIAL_SCALES), (n, nb), generator=g)]
    flat = blocks.view(-1, size)
    flat[::7] = 0  # all-zero blocks
    flat[3::11, 4 if fmt == "q4_1" else 2 :] = 255  # the largest codes (q8_0: -1)
    flat[5::13, 4 if fmt == "q4_1" else 2 :] = 0x88 if fmt == "q4_1" else 0x80  # q4_0: 8 = 0; q8_0: -128
    outliers = torch.randn(max(1, n // 3), k, generator=g) * 0.01
    outliers[:, torch.randint(0, quant.BLOCK, (1,), generator=g).item() :: quant.BLOCK] = 3e3  # one per block
    blocks[: outliers.shape[0]] = quant.quantize(outliers, fmt).view(-1, nb, size)
    return blocks.view(n, nb * size)


def assert_matmul_close(y: torch.Tensor, x: torch.Tensor, blocks: torch.Tensor, fmt: str, bias=None) -> None:
    """y equals x W^T + bias up to float32 summation error: |y - exact| <= (k + 4) u (|x| |W|^T + |bias|)."""
    w = gguf_dequantize(blocks, fmt)  # (n, k) float64
    x64 = x.double().reshape(-1, x.shape[-1])
    exact, size = x64 @ w.T, x64.abs() @ w.abs().T
    if bias is not None:
        exact, size = exact + bias.double(), size + bias.double().abs()
    bound = (x.shape[-1] + 4) * U * size + 1e-30
    error = (y.double().reshape(exact.shape) - exact).abs()
    worst = int((error / bound).argmax())
    assert (error <= bound).all(), f"{fmt}: error {error.flatten()[worst]:.3g} > bound {bound.flatten()[worst]:.3g}"


# --- q4_1 is byte for byte ggml's ------------------------------------------------------------------------------


def test_q4_1_codec_matches_gguf():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 128, generator=g) * torch.logspace(-30, 4, 64)[:, None]
    x[3], x[4], x[5] = 0.0, -0.0, 7.0  # zero blocks (both signs), a constant block (d = 0)
    x[6, 40] = 1e3  # an outlier
    x[7] = torch.arange(128.0).remainder(16) * 0.5 - 3  # codes on their .5 ties
    x[8, ::2] = -(x[8, ::2].abs())
    ours = quant.quantize(x, "q4_1")
    theirs = torch.from_numpy(gguf.quants.quantize(x.numpy(), gguf.GGMLQuantizationType.Q4_1))
    assert torch.equal(ours, theirs)
    assert torch.equal(quant.dequantize(ours, "q4_1"), gguf_dequantize(ours, "q4_1").float())
    assert quant.bytes_per_value("q4_1") == 0.625


def test_q4_1_refuses_what_its_fp16_fields_cannot_hold():
    for bad, match in ((float("nan"), "non-finite"), (7e4, "beyond")):  # |min| > 65504: m overflows fp16
        x = torch.randn(2, 32)
        x[1, 3] = -bad if bad == 7e4 else bad
        with pytest.raises(InputError, match=match):
            quant.quantize(x, "q4_1")


# --- the kernels -------------------------------------------------------------------------------------------------

SHAPES = [(1, 32), (5, 32), (37, 576), (70, 1536), (9, 96)]  # (n, k): n not a multiple of the 4-row tile, 1 row
ROWS = [1, 2, 3, 5, 17]  # rows of x: each count of x rows per pass (1-4), two passes, and the GEMM path (>= 16)


def check_kernel(fmt: str, n: int, k: int) -> int:
    """qmatmul.matmul on adversarial blocks of W (n, k) against a float64 matmul over gguf's dequantized values, for
    every row count of x, at 1 and 2 threads, with and without a bias: how many outputs were compared."""
    blocks = adversarial_blocks(fmt, n, k, seed=n * k)
    g = torch.Generator().manual_seed(k)
    assert torch.equal(qmatmul.dequantize(fmt, blocks, k), gguf_dequantize(blocks, fmt).float())  # ggml's values
    bias = torch.randn(n, generator=g)
    previous, compared = torch.get_num_threads(), 0
    try:
        for m in ROWS:
            x = torch.randn(m, k, generator=g)
            x[0, :3] = torch.tensor([0.0, -0.0, 1e-30])
            outputs = []
            for threads in (1, 2):
                torch.set_num_threads(threads)
                outputs.append(qmatmul.matmul(fmt, blocks, x, bias))
                assert_matmul_close(outputs[-1], x, blocks, fmt, bias)
            if m < qmatmul.GEMM_MIN_ROWS:  # each output is one thread's sum, in one order: threads change nothing
                assert torch.equal(outputs[0], outputs[1])
            assert_matmul_close(qmatmul.matmul(fmt, blocks, x), x, blocks, fmt)  # no bias
            compared += 3
    finally:
        torch.set_num_threads(previous)
    return compared


@kernels
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("n,k", SHAPES)
def test_kernel_matches_a_float64_matmul_over_ggufs_dequantized_weights(fmt, n, k):
    assert check_kernel(fmt, n, k) == 3 * len(ROWS)


@kernels
@pytest.mark.parametrize("fmt", FORMATS)
def test_gemm_path_over_several_tiles_and_leading_shapes(fmt, monkeypatch):
    """Many rows of x: tiles of W dequantized into one buffer (here 3 rows of W at a time, 7 tiles), x (2, 9, k)."""
    monkeypatch.setattr(qmatmul, "GEMM_TILE_VALUES", 3 * 64)
    blocks = adversarial_blocks(fmt, 19, 64, seed=5)
    x = torch.randn(2, 9, 64, generator=torch.Generator().manual_seed(1))
    bias = torch.randn(19)
    y = qmatmul.matmul(fmt, blocks, x, bias)
    assert y.shape == (2, 9, 19)
    assert_matmul_close(y, x, blocks, fmt, bias)


@kernels
def test_strided_input_and_the_pytorch_path_agree():
    blocks = adversarial_blocks("q4_1", 40, 64, seed=2)
    wide = torch.randn(3, 128)
    x = wide[:, 32:96]  # rows with a stride of 128
    assert_matmul_close(qmatmul.matmul("q4_1", blocks, x), x, blocks, "q4_1")
    assert_matmul_close(F.linear(x, dequantize_blocks(blocks, "q4_1", 64)), x, blocks, "q4_1")


def use_portable_build(folder, monkeypatch):
    """qmatmul.c built into `folder` without AVX-512, AVX2 and F16C (the plain C loops, software fp16), and every entry
    of attnlab.kernels.cpu.qmatmul pointed at it for the test: the library."""
    flags = ("-mno-avx512f", "-mno-avx2", "-mno-f16c") if "avx2" in cpu._cpu_flags() else ()
    portable = qmatmul.load(cpu.build(folder, flags, source=qmatmul.SOURCE))
    monkeypatch.setattr(qmatmul, "library", lambda: portable)
    monkeypatch.setattr(qmatmul, "_qmatmul", lambda: portable.attnlab_qmatmul)
    monkeypatch.setattr(qmatmul, "_qmatmul_q8", lambda: portable.attnlab_qmatmul_q8)
    return portable


@kernels
def test_the_portable_c_build_is_exact_too(tmp_path, monkeypatch):
    """qmatmul.c built without AVX-512, AVX2 and F16C (the plain C loops, software fp16): the same checks."""
    portable = use_portable_build(tmp_path, monkeypatch)
    assert qmatmul.library() is portable
    for fmt in FORMATS:
        for n, k in SHAPES[:4]:
            assert check_kernel(fmt, n, k) == 3 * len(ROWS)


def test_a_failing_compiler_names_the_source(tmp_path, monkeypatch):
    monkeypatch.setenv("CC", "false")
    with pytest.raises(RuntimeError, match="false failed on qmatmul.c"):
        cpu.build(tmp_path, source=qmatmul.SOURCE)


# --- QuantizedLinear ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantized_linear_is_a_linear_over_its_dequantized_weight(fmt):
    g = torch.Generator().manual_seed(3)
    linear = torch.nn.Linear(96, 40, bias=True)
    layer = QuantizedLinear.from_linear(linear, fmt)
    assert layer.blocks.shape == (40, row_bytes(fmt, 96)) and layer.blocks.dtype == torch.uint8
    assert layer.nbytes == 40 * row_bytes(fmt, 96) + 40 * 4
    w = layer.dequantize()
    assert torch.equal(w, gguf_dequantize(layer.blocks, fmt).float()) and torch.equal(layer.weight, w)
    if fmt == "fp16":
        assert torch.equal(w, linear.weight.half().float())
    x = torch.randn(2, 3, 96, generator=g)
    with torch.no_grad():
        y = layer(x)
        assert y.shape == (2, 3, 40)
        assert_matmul_close(y, x, layer.blocks, fmt, layer.bias)
        with cpu.disabled():  # the op's PyTorch path (no compiler)
            torch.testing.assert_close(layer(x), y, rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(layer(x.double()), F.linear(x.double(), w.double(), layer.bias.double()))
    x.requires_grad_(True)  # a gradient through x: F.linear over the dequantized weight
    layer(x).sum().backward()
    torch.testing.assert_close(x.grad, w.sum(0).expand_as(x))


def test_bad_formats_and_widths_are_refused():
    with pytest.raises(InputError, match="unknown weight format 'q5_0'"):
        QuantizedLinear(64, 8, "q5_0")
    with pytest.raises(InputError, match="in_features=48, not a multiple of 32"):
        QuantizedLinear(48, 8, "q4_0")
    assert QuantizedLinear(48, 8, "fp16").blocks.shape == (8, 96)  # fp16 takes any width


@pytest.mark.parametrize("rows", [1, 7])  # one row: decoding's path (the C++ op), several: prefill's
def test_fp16_weights_of_any_width_multiply_on_every_path(rows):
    """Probe K's k12: a model of width 40 with fp16 weights crashed on its first decoded token, in the C++ op
    that takes only widths in blocks of 32."""
    linear = torch.nn.Linear(40, 24, bias=False)
    layer = QuantizedLinear.from_linear(linear, "fp16")
    x = torch.randn(rows, 40)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), F.linear(x, linear.weight.half().float()), rtol=1e-5, atol=1e-5)
    with pytest.raises(InputError, match="take 18 bytes"):
        QuantizedLinear.from_blocks(torch.zeros(4, 20, dtype=torch.uint8), "q4_0", 32)


def test_embedding_dequantizes_the_rows_it_looks_up():
    weight = torch.randn(50, 64)
    embedding = QuantizedEmbedding.from_weight(weight, "q8_0")
    tokens = torch.tensor([[3, 0, 49], [7, 7, 1]])
    table = quant.dequantize(quant.quantize(weight, "q8_0"), "q8_0")
    assert torch.equal(embedding(tokens), table[tokens])
    with cpu.disabled():
        assert torch.equal(embedding(tokens), table[tokens])
    with pytest.raises(IndexError):
        embedding(torch.tensor([50]))


# --- quantize_weights on a model ---------------------------------------------------------------------------------


def dequantized_copy(config: dict, quantized):
    """tiny_model(**config) with each weight replaced by what `quantized` holds (its dequantized values)."""
    reference = tiny_model(**config)
    with torch.no_grad():
        for name, module in quantized.named_modules():
            if isinstance(module, QuantizedLinear):
                reference.get_submodule(name).weight.copy_(module.dequantize())
    return reference


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantize_weights_replaces_every_linear_and_the_tied_table(fmt):
    config = {"seed": 0, "init_std": 0.3, "tie_embeddings": True}
    model = tiny_model(**config)
    n_linear = sum(type(m) is torch.nn.Linear for m in model.modules())
    quantized = attnlab.quantize_weights(model, fmt)
    assert quantized is model and not any(type(m) is torch.nn.Linear for m in model.modules())
    assert sum(isinstance(m, QuantizedLinear) for m in model.modules()) == n_linear
    assert isinstance(model.embed, QuantizedEmbedding) and model.embed.blocks is model.lm_head.blocks
    assert all(p.dim() == 1 for p in model.parameters())  # norms only
    reference = dequantized_copy(config, model)
    tokens = torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens)[0], reference(tokens)[0], rtol=1e-4, atol=1e-4)
    prompt = tokens[0, :5].tolist()
    eager = attnlab.generate(model, prompt, max_new_tokens=12, compile=False).tolist()
    assert eager == attnlab.generate(reference, prompt, max_new_tokens=12, compile=False).tolist()
    assert len(set(eager)) > 3, "degenerate test model: every step picks the same few tokens"


def test_untied_embedding_and_layers_that_do_not_split_into_blocks():
    model = tiny_model(seed=0, d_model=48, n_heads=4, tie_embeddings=False)  # d_model 48: no q4_0 blocks
    with pytest.warns(AttnlabWarning, match=r"kept in float, in_features not a multiple of 32: embed .*qkv") as seen:
        attnlab.quantize_weights(model, "q4_0")
    line = str(seen[0].message)  # one entry per kind of layer, its count: not one per block (SmolLM2's MLA: 60)
    layers = model.cfg.n_layers
    assert f"blocks.*.attn.qkv (in_features=48) x {layers}" in line and "blocks.0." not in line, line
    assert type(model.blocks[0].attn.qkv) is torch.nn.Linear and type(model.embed) is torch.nn.Embedding
    assert isinstance(model.blocks[0].mlp.down, QuantizedLinear)  # hidden_dim 128 splits
    model = tiny_model(seed=0, tie_embeddings=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        attnlab.quantize_weights(model, "q8_0")
    assert isinstance(model.embed, QuantizedEmbedding) and model.embed.blocks is not model.lm_head.blocks
    with pytest.raises(InputError, match="unknown weight format 'int8'"):
        attnlab.quantize_weights(tiny_model(), "int8")


def test_state_dict_round_trip_through_safetensors(tmp_path):
    model = attnlab.quantize_weights(tiny_model(seed=0, perturb=True), "q4_1")
    path = tmp_path / "model.safetensors"
    safetensors.torch.save_model(model, str(path))  # plain uint8 and float tensors, the shared table once
    fresh = attnlab.quantize_weights(tiny_model(seed=1), "q4_1")
    missing, unexpected = safetensors.torch.load_model(fresh, str(path))
    assert not missing and not unexpected
    assert fresh.embed.blocks is fresh.lm_head.blocks  # still one table
    for (name, a), (_, b) in zip(model.state_dict().items(), fresh.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    other = attnlab.quantize_weights(tiny_model(seed=1), "q4_0")  # 18 bytes per block, not 20
    with pytest.raises(RuntimeError, match="size mismatch for blocks.0.attn.qkv.blocks"):
        other.load_state_dict(model.state_dict())


@pytest.mark.slow
@kernels
def test_compiled_decode_step_runs_the_op_and_matches_eager():
    generate_module = importlib.import_module("attnlab.generate")  # the module (attnlab.generate is the function)
    model = attnlab.quantize_weights(tiny_model({"kind": "mha", "n_kv_heads": 2}, seed=0, init_std=0.3), "q4_0")
    prompt = torch.randint(0, 97, (9,), generator=torch.Generator().manual_seed(4)).tolist()
    compiled = attnlab.generate(model, prompt, max_new_tokens=16, prefill_chunk=4, compile=True).tolist()
    assert model in generate_module._COMPILED  # fullgraph: the op is one node of the compiled step
    assert compiled == attnlab.generate(model, prompt, max_new_tokens=16, compile=False).tolist()
    assert len(set(compiled)) > 3, "degenerate test model: every step picks the same few tokens"


class WeightCalls(TorchDispatchMode):
    """Counts the weight-matmul ops (attnlab::qlinear, attnlab_cpp::qlinear) dispatched inside a `with` block."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += str(func.overloadpacket) in ("attnlab.qlinear", "attnlab_cpp.qlinear")
        return func(*args, **(kwargs or {}))


@kernels
@pytest.mark.parametrize("activations", ["fp32", "q8"])
@pytest.mark.parametrize("attention", [{"kind": "mha", "n_kv_heads": 2}, {"kind": "mha", "qkv_bias": True},
                                       {"kind": "sliding", "window": 8}, {"kind": "diff"}])  # fmt: skip
def test_a_decode_step_makes_one_weight_call_per_projection_group(attention, activations):
    """q, k and v are one QuantizedLinear (qkv), gate and up one (gate_up): a decoding step of a SwiGLU block makes 4
    weight matmuls (qkv, out, gate_up, down), the LM head one more. The GGUF loader stacks a file's q/k/v and
    gate/up tensors into these layers (interop.gguf.NATIVE_BLOCK_LAYERS), so a native model decodes the same way."""
    model = attnlab.quantize_weights(tiny_model(attention, seed=0), "q8_0")
    attnlab.set_activations(model, activations)
    cache = model.new_cache(1, 16)
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3]]), cache)
        with WeightCalls() as counted:
            model(torch.tensor([[4]]), cache)
    assert counted.calls == 4 * model.cfg.n_layers + 1


def test_mla_reads_its_dequantized_up_projections():
    """MLA's absorbed decode reads k_up.weight and v_up.weight directly: the dequantized matrices."""
    attention = {"kind": "mla", "d_latent": 32}
    model = attnlab.quantize_weights(tiny_model(attention, seed=0, init_std=0.3), "q8_0")
    assert isinstance(model.blocks[0].attn.k_up, QuantizedLinear)
    reference = tiny_model(attention, seed=0, init_std=0.3)
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, QuantizedLinear):
                reference.get_submodule(name).weight.copy_(module.weight)
    prompt = [5, 17, 3, 60, 2, 9]
    out = attnlab.generate(model, prompt, max_new_tokens=10, compile=False).tolist()
    assert out == attnlab.generate(reference, prompt, max_new_tokens=10, compile=False).tolist()
    assert len(set(out)) > 3, "degenerate test model: every step picks the same few tokens"


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_1", "fp16"])
def test_the_gguf_loader_decodes_blocks_as_gguf_does_bit_for_bit(fmt, tmp_path):
    """interop.gguf.dequantized decodes the native block formats itself (not through the gguf package, 10x slower):
    the same float32 values as gguf's dequantize, on adversarial blocks."""
    from attnlab.interop.gguf import dequantized, open_gguf

    kind = gguf.GGMLQuantizationType[GGML_TYPES[fmt]]
    blocks = adversarial_blocks(fmt, 24, 96, seed=5)
    writer = gguf.GGUFWriter(str(tmp_path / "w.gguf"), "llama")
    writer.add_tensor("w.weight", blocks.numpy(), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    file = open_gguf(tmp_path / "w.gguf")
    ours = dequantized(file, "w.weight")
    theirs = torch.from_numpy(np.asarray(gguf.quants.dequantize(file.tensors["w.weight"].data, kind), np.float32))
    assert ours.shape == (24, 96) and ours.dtype == torch.float32
    assert torch.equal(ours.view(torch.int32), theirs.reshape(24, 96).view(torch.int32))  # the same bits
