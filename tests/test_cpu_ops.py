"""The C++ operators (attnlab.kernels.cpu.ops, ops.cpp) against the Python operators they stand in for: the same
bits, the same routing, one warning where they cannot be built. (quantized_attend's steps, compiled and eager,
are also checked against the eager kernel path in test_kv_quant_cache.py, with either operator.)"""

import warnings

import pytest
import torch
from helpers import tiny_model
from torch.profiler import profile

from attnlab import quant
from attnlab.errors import AttnlabWarning
from attnlab.kernels import cpu
from attnlab.kernels.cpu import ops
from attnlab.model.qlinear import FORMATS, QuantizedLinear, encode

built = pytest.mark.skipif(not ops.load(), reason="the C++ operators do not build here (no C++ compiler)")


def calls(fn) -> dict[str, int]:
    """How often each operator ran during fn()."""
    with profile() as prof:
        fn()
    return {e.key: e.count for e in prof.key_averages()}


@built
@pytest.mark.parametrize("fmt", FORMATS)
def test_qlinear_gives_the_python_operators_bits(fmt):
    g = torch.Generator().manual_seed(7)
    blocks = encode(torch.randn(70, 96, generator=g), fmt)  # 70 rows: not a multiple of the kernel's tiles
    wide = torch.randn(5, 2, 200, generator=g)
    inputs = [
        torch.randn(1, 96, generator=g),
        torch.randn(3, 1, 96, generator=g),
        torch.randn(31, 96, generator=g),
        wide[..., 50:146],
    ]  # fmt: skip  (the last one strided)
    for bias in (None, torch.randn(70, generator=g), torch.randn(70, generator=g).half()):
        for x in inputs:
            got = torch.ops.attnlab_cpp.qlinear(x, blocks, bias, fmt)
            want = torch.ops.attnlab.qlinear(x, blocks, bias, fmt)
            assert got.shape == x.shape[:-1] + (70,) and torch.equal(got, want)


@built
def test_decoding_rows_take_the_cpp_operator_prefill_the_python_one():
    layer = QuantizedLinear.from_weight(torch.randn(64, 96), "q8_0")
    with torch.no_grad():
        decode = calls(lambda: layer(torch.randn(2, 1, 96)))
        prefill = calls(lambda: layer(torch.randn(1, 40, 96)))  # 40 rows: torch's GEMM over dequantized tiles
        with cpu.disabled():
            off = calls(lambda: layer(torch.randn(2, 1, 96)))
    assert decode.get("attnlab_cpp::qlinear") == 1 and "attnlab::qlinear" not in decode
    assert prefill.get("attnlab::qlinear") == 1 and "attnlab_cpp::qlinear" not in prefill
    assert off.get("attnlab::qlinear") == 1 and "attnlab_cpp::qlinear" not in off  # disabled(): PyTorch path


@built
def test_qlinear_refuses_what_it_cannot_read():
    blocks = encode(torch.randn(8, 64), "q4_0")
    with pytest.raises(RuntimeError, match="unknown weight format 'q5_0'"):
        torch.ops.attnlab_cpp.qlinear(torch.randn(1, 64), blocks, None, "q5_0")
    with pytest.raises(RuntimeError, match=r"blocks must be contiguous uint8 \(n, 40\) for q4_1"):
        torch.ops.attnlab_cpp.qlinear(torch.randn(1, 64), blocks, None, "q4_1")
    with pytest.raises(RuntimeError, match="must be float32"):
        torch.ops.attnlab_cpp.qlinear(torch.randn(1, 64).double(), blocks, None, "q4_0")


@built
def test_quantized_attend_refuses_a_value_it_cannot_quantize():
    model = tiny_model({"kind": "mha", "n_kv_heads": 2}, n_layers=1, max_seq_len=64)
    cache = model.new_cache(1, 32, policy="k=q8_0,v=q8_0")  # no residual window: each token is quantized
    with torch.no_grad():
        model(torch.randint(0, 97, (1, 6)), cache=cache)
    cache.set_static(True)
    layer = cache.layers[0]
    rows = [torch.full((1, 1, p.codec.width), float("nan")) for p in layer.parts]
    store = [a for p in layer.parts for a in layer.store[p.name]]
    recent = [layer.recent[p.name] for p in layer.parts]
    args = (torch.randn(1, 4, 1, 16), rows, store, recent, layer.counters, layer.plan_spec, 0.25)
    with pytest.raises(RuntimeError, match="KV cache part k: a value that is not finite"):
        torch.ops.attnlab_cpp.quantized_attend(*args, quant._NF4_BELOW, quant._NF4_INSIDE)
    with pytest.raises(Exception, match="not finite"):  # the Python operator says the same (KVValueError: InputError)
        torch.ops.attnlab.quantized_attend(*args)


def test_without_a_cpp_compiler_the_python_operators_run_after_one_warning(tmp_path, monkeypatch):
    monkeypatch.setattr(ops, "_LOADED", [None])  # as in a new process
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # nothing built yet
    monkeypatch.setenv("CXX", "false")
    with pytest.warns(AttnlabWarning, match="false failed building ops.cpp"):
        assert ops.load() is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ops.load() is False and not ops.usable()  # once
    layer = QuantizedLinear.from_weight(torch.randn(8, 64), "q4_0")
    with torch.no_grad():
        x = torch.randn(1, 64)
        assert "attnlab_cpp::qlinear" not in calls(lambda: layer(x))
        torch.testing.assert_close(layer(x), x @ layer.dequantize().T, rtol=1e-5, atol=1e-5)


def test_switched_off_nothing_is_built(tmp_path, monkeypatch):
    monkeypatch.setattr(ops, "_LOADED", [None])
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("ATTNLAB_CPU_KERNELS", "0")
    assert ops.load() is False
    assert not (tmp_path / "attnlab").exists()
