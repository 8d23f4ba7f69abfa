"""The C decode-attention kernels (attnlab.kernels.cpu) against matmuls over attnlab.quant's dequantized rows."""

from __future__ import annotations

import pytest
import torch

from attnlab.cache.codecs import Codec
from attnlab.kernels import cpu
from attnlab.kernels.cpu import routing

pytestmark = pytest.mark.skipif(not cpu.available(), reason="no working C compiler for the CPU kernels")

FORMATS = ["fp32", "fp16", "bf16", "q8_0", "q4_0", "nf4"]
SHAPES = [(8, 1, 16), (2, 4, 32), (1, 8, 64), (4, 2, 8), (8, 1, 8), (8, 2, 4), (16, 1, 4), (2, 3, 48)]  # (H_kv, G, d)


def stored(fmt: str, rows: torch.Tensor) -> tuple[Codec, list[torch.Tensor]]:
    codec = Codec(fmt, rows.shape[-1], True, 32, "k")
    return codec, [t.contiguous() for t in codec.encode(rows)]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("kv_heads,group,d", SHAPES)
def test_scores_and_wsum_match_matmuls_over_dequantized_rows(fmt, kv_heads, group, d):
    g = torch.Generator().manual_seed(kv_heads * 100 + d)
    batch, n, heads = 2, 37, kv_heads * group  # 37: two whole tiles of 16 and a partial one
    codec, arrays = stored(fmt, torch.randn(batch, n, kv_heads * d, generator=g))
    keys = codec.decode(arrays, torch.float32).view(batch, n, kv_heads, d).transpose(1, 2)  # (B, H_kv, n, d)
    keys = keys.repeat_interleave(group, dim=1)  # query head h reads K/V head h // G
    q = torch.randn(batch, heads, d + 3, generator=g)[..., 1 : d + 1]  # a strided view
    out = torch.full((batch, heads, n + 5), 7.0)
    cpu.scores(fmt, arrays, n, kv_heads, q, out, accumulate=False)
    want = torch.einsum("bhd,bhtd->bht", q, keys)
    torch.testing.assert_close(out[..., :n], want, rtol=1e-5, atol=1e-5)
    assert (out[..., n:] == 7.0).all()  # nothing written past n
    cpu.scores(fmt, arrays, n, kv_heads, q, out, accumulate=True)
    torch.testing.assert_close(out[..., :n], 2 * want, rtol=1e-5, atol=1e-5)

    p = torch.rand(batch, heads, n + 2, generator=g)
    acc = torch.randn(batch, heads, d, generator=g)
    o = acc.clone()
    cpu.wsum(fmt, arrays, n, kv_heads, p, o)
    torch.testing.assert_close(o, acc + torch.einsum("bht,bhtd->bhd", p[..., :n], keys), rtol=1e-5, atol=1e-5)


def test_decoded_values_are_the_dequantized_values_exactly():
    """A one-hot query reads single values back: the kernel decodes exactly as quant.dequantize does."""
    g = torch.Generator().manual_seed(0)
    for fmt in FORMATS:
        codec, arrays = stored(fmt, torch.randn(1, 20, 64, generator=g) * 3)
        values = codec.decode(arrays, torch.float32)  # (1, 20, 64)
        for i in (0, 5, 31, 63):
            q = torch.zeros(1, 1, 64)
            q[0, 0, i] = 1.0
            out = torch.empty(1, 1, 20)
            cpu.scores(fmt, arrays, 20, 1, q, out, accumulate=False)
            assert torch.equal(out[0, 0], values[0, :, i]), (fmt, i)


def test_build_is_cached_and_the_switch_turns_the_kernels_off(tmp_path, monkeypatch):
    first = cpu.build(tmp_path)
    assert first.exists() and cpu.build(tmp_path) == first
    assert sorted(p.name for p in tmp_path.iterdir()) == [first.name, first.name + ".sha256"]  # no temporaries
    monkeypatch.setenv("ATTNLAB_CPU_KERNELS", "0")
    cpu.library.cache_clear()
    try:
        assert cpu.library() is None
    finally:
        monkeypatch.delenv("ATTNLAB_CPU_KERNELS")
        cpu.library.cache_clear()
    assert cpu.available()


@pytest.mark.parametrize("damage", ["truncated", "emptied", "no checksum"])
def test_a_library_damaged_in_the_cache_is_built_again(tmp_path, damage):
    """Probe N's n4: a truncated library in the cache killed every later process in dlopen (SIGBUS, no output)."""
    built = cpu.build(tmp_path, source=routing.SOURCE)
    good = built.read_bytes()
    if damage == "no checksum":
        built.with_name(built.name + ".sha256").unlink()
    else:
        built.write_bytes(good[:1000] if damage == "truncated" else b"")
    assert cpu.build(tmp_path, source=routing.SOURCE) == built and built.read_bytes() == good
    assert routing.load(built).attnlab_exact_routing is not None


def test_a_failing_compiler_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("CC", "false")
    with pytest.raises(RuntimeError, match="false failed on qattn.c"):
        cpu.build(tmp_path)


@pytest.mark.parametrize("fmt", ["fp32", "q8_0", "q4_0"])
def test_long_segments_split_over_threads_give_the_same_sums(fmt):
    """Above qattn.c's PARALLEL_MIN the rows are shared among torch's threads (batch 3: jobs span sequences)."""
    g = torch.Generator().manual_seed(1)
    batch, n, kv_heads, group, d = 3, 1100, 4, 2, 32  # 1100 * 128 values per sequence
    codec, arrays = stored(fmt, torch.randn(batch, n, kv_heads * d, generator=g))
    keys = codec.decode(arrays, torch.float32).view(batch, n, kv_heads, d).transpose(1, 2)
    keys = keys.repeat_interleave(group, dim=1)
    q = torch.randn(batch, kv_heads * group, d, generator=g)
    p = torch.rand(batch, kv_heads * group, n, generator=g)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        out, o = torch.empty(batch, kv_heads * group, n), torch.zeros(batch, kv_heads * group, d)
        cpu.scores(fmt, arrays, n, kv_heads, q, out, accumulate=False)
        cpu.wsum(fmt, arrays, n, kv_heads, p, o)
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(out, torch.einsum("bhd,bhtd->bht", q, keys), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(o, torch.einsum("bht,bhtd->bhd", p, keys), rtol=1e-4, atol=1e-4)


def adversarial_rows(fmt: str) -> torch.Tensor:
    """Rows of 4 blocks: random at many scales, ties, zeros (signed), outliers, negative maxima, tiny values."""
    g = torch.Generator().manual_seed(7)
    limit = {"q8_0": 8e6, "q4_0": 5e5, "nf4": 6e4}[fmt]
    rows = [torch.randn(128, generator=g) * s for s in (1e-30, 1e-6, 1e-2, 1, 30, limit / 10)]
    grid = torch.randint(-16, 17, (128,), generator=g) / 2.0  # halves: ties of x / d at .5 for d = 1 and 0.5
    rows += [grid, grid * 127 / 8, torch.zeros(128), -torch.zeros(128)]
    signed_zero = torch.zeros(128)
    signed_zero[::3] = -0.0
    outlier = torch.randn(128, generator=g) * 0.01
    outlier[[3, 40, 77, 100]] = torch.tensor([50.0, -50.0, 1e3, -1e3])
    negative = torch.rand(128, generator=g)
    negative[[0, 33, 70, 127]] = -2.0  # the signed maximum is negative (q4_0's d > 0)
    both = torch.rand(128, generator=g)
    both[[1, 2]], both[[60, 61]] = torch.tensor([-3.0, 3.0]), torch.tensor([3.0, -3.0])  # +-max ties: first wins
    tiny = torch.full((128,), 1e-40) * torch.randn(128, generator=g).sign()  # float32 subnormals
    # Ties: blocks whose scale is exactly 1 (q8_0: absmax 127; q4_0: signed max -8), so x / d = x is a .5 tie.
    near = [0.5 - 2**-25, -(0.5 - 2**-25), 1.5 - 2**-23, -2.5, 2.5]
    q8_ties = [127.0] + [k + 0.5 for k in range(-13, 13)] + near
    q4_ties = [-8.0] + [k + 0.5 for k in range(-8, 8)] + near + [7.49, -7.51, 0.0, -0.0, 3.5, -3.5, 6.5, -6.5]
    q4_ties += [1e-9, -1e-9]
    rows += [signed_zero, outlier, negative, both, tiny, torch.full((128,), limit * 0.999)]
    rows.append(torch.tensor(q8_ties + q4_ties + q8_ties[::-1] + q4_ties[::-1]))
    return torch.stack(rows)


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "nf4"])
def test_quantize_writes_the_bytes_of_quant_quantize(fmt):
    from attnlab import quant

    x = adversarial_rows(fmt)
    want = quant.quantize(x, fmt).view(x.shape[0], 4, -1)  # ggml's blocks: fp16 scale, then the codes
    quants, scales = cpu.quantize(fmt, x)
    assert torch.equal(scales, want[..., :2]) and torch.equal(quants, want[..., 2:])
    strided = torch.cat((x, x), dim=-1)[:, 128:]  # rows with a stride of 256
    assert all(torch.equal(a, b) for a, b in zip(cpu.quantize(fmt, strided), (quants, scales), strict=True))


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "nf4"])
def test_quantize_leaves_bad_values_to_quant_quantize(fmt):
    for bad in (float("nan"), float("inf"), 1e9):  # 1e9: beyond every format's fp16 scale
        x = torch.randn(2, 64)
        x[1, 40] = bad
        assert cpu.quantize(fmt, x) is None


@pytest.mark.parametrize("n", [1, 15, 16, 37, 4097])
def test_softmax_matches_torch(n):
    g = torch.Generator().manual_seed(n)
    scores = torch.randn(2, 5, n + 3, generator=g) * 30  # spreads of hundreds: tails below exp's range
    scores[0, 1, :n] = 0.0  # a constant row
    want = torch.softmax(scores[..., :n] * 0.125, dim=-1)
    got = cpu.softmax_(scores[..., :n].clone().contiguous(), 0.125)
    torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-7)
    strided = scores.clone()
    cpu.softmax_(strided[..., :n], 0.125)  # rows with a stride of n + 3: the last 3 values untouched
    torch.testing.assert_close(strided[..., :n], want, rtol=2e-6, atol=1e-7)
    assert torch.equal(strided[..., n:], scores[..., n:])


def test_wide_rows_and_long_softmax_rows():
    """Rows of 4,160 values (no width limit) and a softmax over 2^20 columns (sums in double: no drift)."""
    g = torch.Generator().manual_seed(5)
    codec, arrays = stored("q8_0", torch.randn(1, 20, 4160, generator=g))
    keys = codec.decode(arrays, torch.float32).view(1, 20, 1, 4160).transpose(1, 2)
    q, out = torch.randn(1, 2, 4160, generator=g), torch.empty(1, 2, 20)
    cpu.scores("q8_0", arrays, 20, 1, q, out, accumulate=False)
    torch.testing.assert_close(out, torch.einsum("bhd,bhtd->bht", q, keys), rtol=1e-5, atol=1e-4)
    long = torch.randn(1, 1, 1 << 20, generator=g)
    want = torch.softmax(long.double() * 0.5, dim=-1).float()
    torch.testing.assert_close(cpu.softmax_(long.clone(), 0.5), want, rtol=1e-5, atol=1e-12)


def test_quantize_into_writes_cache_slots():
    from attnlab import quant

    x = torch.randn(2, 5, 64)
    quants, scales = torch.zeros(2, 9, 2, 16, dtype=torch.uint8), torch.zeros(2, 9, 2, 2, dtype=torch.uint8)
    assert cpu.quantize_into("q4_0", x, [quants, scales], 3)
    want = quant.quantize(x, "q4_0").view(2, 5, 2, 18)
    assert torch.equal(quants[:, 3:8], want[..., 2:]) and torch.equal(scales[:, 3:8], want[..., :2])
    assert not quants[:, :3].any() and not quants[:, 8:].any()


def test_attend_over_runs_of_rows_is_softmax_attention():
    """Keys in two parts (q4_0 and fp16 columns of each head), each as stored rows, a window and a new row."""
    g = torch.Generator().manual_seed(3)
    batch, kv_heads, group, d1, d2, dv = 2, 2, 3, 32, 16, 32
    heads, n_store, n_window = kv_heads * group, 45, 7
    n = n_store + n_window + 1

    def rows(fmt, d, count):
        codec, arrays = stored(fmt, torch.randn(batch, count, kv_heads * d, generator=g))
        return arrays, codec.decode(arrays, torch.float32).view(batch, count, kv_heads, d)

    k1, k2, v = rows("q4_0", d1, n_store), rows("fp16", d2, n_store), rows("q8_0", dv, n_store)
    window = [torch.randn(batch, n_window + 2, kv_heads * w, generator=g) for w in (d1, d2, dv)]  # a ring
    new = [torch.randn(batch, 1, kv_heads * w, generator=g) for w in (d1, d2, dv)]
    q = torch.randn(batch, heads, d1 + d2, generator=g)
    keys = [("q4_0", k1[0], 0, n_store, 0, 0, d1), ("fp32", [window[0]], 2, n_window, n_store, 0, d1),
            ("fp32", [new[0]], 0, 1, n - 1, 0, d1), ("fp16", k2[0], 0, n_store, 0, d1, d2),
            ("fp32", [window[1]], 2, n_window, n_store, d1, d2), ("fp32", [new[1]], 0, 1, n - 1, d1, d2)]  # fmt: skip
    values = [("q8_0", v[0], 0, n_store, 0, 0, dv), ("fp32", [window[2]], 2, n_window, n_store, 0, dv),
              ("fp32", [new[2]], 0, 1, n - 1, 0, dv)]  # fmt: skip
    out = torch.zeros(batch, heads, dv)
    cpu.attend(keys, values, kv_heads, q, 0.3, n, out)

    def full(stored_part, index, width):
        tail = torch.cat((window[index][:, 2 : 2 + n_window], new[index]), dim=1).view(batch, -1, kv_heads, width)
        return torch.cat((stored_part, tail), dim=1).transpose(1, 2).repeat_interleave(group, dim=1)  # (B, H, n, w)

    key = torch.cat((full(k1[1], 0, d1), full(k2[1], 1, d2)), dim=-1)
    probs = torch.softmax(torch.einsum("bhd,bhtd->bht", q, key) * 0.3, dim=-1)
    torch.testing.assert_close(out, torch.einsum("bht,bhtd->bhd", probs, full(v[1], 2, dv)), rtol=1e-5, atol=1e-6)


def test_the_portable_c_path_matches_too(tmp_path, monkeypatch):
    """The same checks on a build without AVX-512 and F16C (the plain C loops, the software fp16 conversions)."""
    flags = ("-mno-avx512f", "-mno-f16c") if "avx512f" in cpu._cpu_flags() else ()
    native, portable = cpu.library(), cpu.load(cpu.build(tmp_path, flags))
    codec, arrays = stored("q4_0", torch.randn(2, 40, 64))
    q, scores = torch.randn(2, 8, 16), []
    for lib in (native, portable):
        monkeypatch.setattr(cpu, "library", lambda lib=lib: lib)
        scores.append(torch.empty(2, 8, 40))
        cpu.scores("q4_0", arrays, 40, 4, q, scores[-1], accumulate=False)
    torch.testing.assert_close(scores[1], scores[0], rtol=1e-5, atol=1e-5)  # both builds, the same scores
    for fmt in FORMATS:
        for kv_heads, group, d in SHAPES:
            test_scores_and_wsum_match_matmuls_over_dequantized_rows(fmt, kv_heads, group, d)
    test_decoded_values_are_the_dequantized_values_exactly()
    for fmt in ("q8_0", "q4_0", "nf4"):
        test_quantize_writes_the_bytes_of_quant_quantize(fmt)
        test_quantize_leaves_bad_values_to_quant_quantize(fmt)
    test_quantize_into_writes_cache_slots()
    for n in (1, 37, 4097):
        test_softmax_matches_torch(n)
    test_wide_rows_and_long_softmax_rows()
    test_attend_over_runs_of_rows_is_softmax_attention()
