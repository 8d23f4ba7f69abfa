"""attnlab.quant: byte parity with gguf (ggml's reference quantizers), round-trip bounds derived from each format,
the KIVI layout, shapes and error messages."""

import math
import re

import pytest
import torch

from attnlab import quant
from attnlab.errors import InputError

# Unit roundoff of float32. The codecs do a few float32 operations per value (inverse scale, product, sum, the
# dequantizing product), each with relative error <= U; SLACK(m) = 4 U m bounds their sum for magnitudes <= m.
U = 2.0**-24
FP16_SUBNORMAL = 2.0**-24  # spacing of fp16 numbers below 2^-14; round-to-nearest errs by at most half of it


def slack(magnitude: torch.Tensor) -> torch.Tensor:
    return 4 * U * magnitude


def fp16_rounding_error(value: torch.Tensor) -> torch.Tensor:
    """Largest |value - fp16(value)| under round-to-nearest: half an ulp, 2^-11 relative (normal) or 2^-25."""
    return torch.maximum(value.abs() * 2.0**-11, torch.full_like(value, FP16_SUBNORMAL / 2))


# --- parity with gguf ------------------------------------------------------------------------------------------


@pytest.fixture
def gguf_codec():
    gguf = pytest.importorskip("gguf")
    types = {"q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_0": gguf.GGMLQuantizationType.Q4_0}

    def encode(x: torch.Tensor, fmt: str) -> torch.Tensor:
        return torch.from_numpy(gguf.quants.quantize(x.numpy(), types[fmt]))

    def decode(q: torch.Tensor, fmt: str) -> torch.Tensor:
        return torch.from_numpy(gguf.quants.dequantize(q.numpy(), types[fmt]))

    return encode, decode


def assert_same_as_gguf(x: torch.Tensor, fmt: str, gguf_codec) -> None:
    encode, decode = gguf_codec
    ours, theirs = quant.quantize(x, fmt), encode(x, fmt)
    assert ours.dtype == theirs.dtype == torch.uint8
    assert ours.shape == theirs.shape
    if not torch.equal(ours, theirs):
        block = quant.block_bytes(fmt)
        diff = (ours.reshape(-1, block) != theirs.reshape(-1, block)).any(-1).nonzero().flatten()
        pytest.fail(f"{fmt}: {len(diff)} blocks differ from gguf, first {int(diff[0])}: x={x.reshape(-1, 32)[diff[0]]}")
    assert torch.equal(quant.dequantize(ours, fmt), decode(theirs, fmt))


def half_steps(fmt: str, anchor: float) -> torch.Tensor:
    """Blocks of values on x / d = k + 0.5 and two float32 neighbours either side, where rounding rules and the
    order of float32 operations show: q8_0 rounds half away from zero; q4_0 truncates x * (1 / d) + 8.5 in
    float32. `anchor` (first value of every block) sets d: absmax / 127 (q8_0) or max / -8 (q4_0); a power of
    two makes the halves exact, any other value puts them within an ulp of the tie."""
    a = torch.tensor(anchor, dtype=torch.float32)
    if fmt == "q8_0":
        d, halves = a.abs() / 127, torch.arange(-127, 127, dtype=torch.float32) + 0.5  # (254,): -126.5 ... 126.5
    else:
        d, halves = a / -8, torch.arange(-8, 8, dtype=torch.float32) + 0.5  # (16,): -7.5 ... 7.5
    ties = halves * d
    up, down = torch.full_like(ties, math.inf), torch.full_like(ties, -math.inf)
    up1, down1 = torch.nextafter(ties, up), torch.nextafter(ties, down)
    near = [ties, up1, down1, torch.nextafter(up1, up), torch.nextafter(down1, down)]
    # the 0.5 - 2^-25 trap of floor(|p| + 0.5), and products just below .5 that + 8.5 rounds up in float32
    near.append(torch.tensor([0.5 - 2.0**-25, 1.5 - 2.0**-23, -(2.5 - 2.0**-22), 0.25, 2.0**-30]) * d)
    near = torch.cat(near)
    per_block = 31
    near = torch.cat([near, torch.zeros((-len(near)) % per_block)]).reshape(-1, per_block)  # (blocks, 31)
    return torch.cat([torch.full((near.shape[0], 1), anchor), near], dim=1)  # (blocks, 32)


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0"])
@pytest.mark.parametrize("shape", [(32,), (3, 64), (2, 5, 256)])
@pytest.mark.parametrize("scale", [1e-3, 1.0, 37.5, 1e4])
def test_random_normal_matches_gguf(fmt, shape, scale, gguf_codec):
    gen = torch.Generator().manual_seed(math.prod(shape))
    x = torch.randn(shape, generator=gen) * scale + 0.1 * scale
    assert_same_as_gguf(x, fmt, gguf_codec)


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0"])
@pytest.mark.parametrize("anchor", [127 / 16, -1.0, 1.0, 1.1, -3.7, 1234.5, 0.013])
def test_half_steps_match_gguf(fmt, anchor, gguf_codec):
    x = half_steps(fmt, anchor)
    assert_same_as_gguf(x, fmt, gguf_codec)


def test_half_ties_round_as_the_format_says():
    # q8_0 (d = 1/16): 16 x = k + 0.5 rounds away from zero.
    x = half_steps("q8_0", 127 / 16)[:1]  # first block: anchor, then -126.5 ... -96.5 steps
    codes = quant.quantize(x, "q8_0")[0, 2:].view(torch.int8)
    assert codes[0] == 127 and codes[1] == -127 and codes[2] == -126  # -126.5 -> -127, -125.5 -> -126
    # q4_0 (d = 1/8): trunc(x / d + 8.5) rounds x / d = k + 0.5 up, to k + 1, for either sign.
    x = torch.tensor([[-1.0, -2.5 / 8, 2.5 / 8] + [0.0] * 29])
    decoded = quant.dequantize(quant.quantize(x, "q4_0"), "q4_0")
    assert decoded[0, :3].tolist() == [-1.0, -2 / 8, 3 / 8]


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0"])
def test_special_blocks_match_gguf(fmt, gguf_codec):
    gen = torch.Generator().manual_seed(1)
    small = torch.randn(32, generator=gen)
    outlier = small.clone()
    outlier[7] = 1e4  # one large outlier
    negative_max = small.clone()
    negative_max[3] = -9.0  # the most negative value has the largest magnitude
    tie_neg_first = torch.zeros(32)
    tie_neg_first[2], tie_neg_first[9] = -3.0, 3.0  # equal magnitudes: ggml keeps the first
    tie_pos_first = -tie_neg_first
    blocks = [
        torch.zeros(32),
        -torch.zeros(32),
        outlier,
        negative_max,
        tie_neg_first,
        tie_pos_first,
        torch.full((32,), -2.0),
        small * 1e-5,  # fp16 scale is subnormal
        small * 1e-7,  # q8_0: fp16 scale rounds to 0
        small * 1e-30,  # fp16 scale 0, float32 1/d still finite
        small / small.abs().max() * 65504,  # values at the fp16 limit
        small / small.abs().max() * (60000 * (127 if fmt == "q8_0" else 8)),  # scale near the fp16 limit
    ]
    assert_same_as_gguf(torch.stack(blocks), fmt, gguf_codec)


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_other_float_dtypes_quantize_their_float32_values(fmt, dtype, gguf_codec):
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(2)).to(dtype)
    assert torch.equal(quant.quantize(x, fmt), gguf_codec[0](x.float(), fmt))


# --- round-trip bounds, per block ------------------------------------------------------------------------------


def random_blocks(seed: int) -> torch.Tensor:
    """(48, 32): normal blocks at scales 1e-6 ... 30 (|x| < 65504 for nf4), some with an outlier or an offset."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(48, 32, generator=gen) * torch.logspace(-6, 1.5, 48).unsqueeze(1)  # (48, 32)
    x[::5, 3] *= 50  # outliers
    x[1::7] += 3 * x[1::7].abs().amax(-1, keepdim=True)  # all-positive blocks
    return x


def stored_scales(q: torch.Tensor, fmt: str) -> torch.Tensor:
    """(..., m) codes -> (blocks, 1) float32 scales, read from the first two bytes of every block."""
    return q.reshape(-1, quant.block_bytes(fmt))[:, :2].contiguous().view(torch.float16).float()


def test_q8_0_round_trip_within_half_a_step():
    x = random_blocks(3)
    q = quant.quantize(x, "q8_0")
    err = (quant.dequantize(q, "q8_0") - x).double().abs()  # (48, 32)
    xd = x.double()
    d = xd.abs().amax(-1, keepdim=True) / 127  # the exact step; codes are chosen with it, but the decoded
    # value is q * d16, with the stored fp16 d16 within fp16_rounding_error(d) of d: |q| <= 127 times that more
    bound = d / 2 + 127 * fp16_rounding_error(d) + slack(127 * d + xd.abs())
    assert (err <= bound).all(), f"worst excess {(err - bound).max().item():.3g}"
    assert (stored_scales(q, "q8_0") - d).abs().le(fp16_rounding_error(d) + slack(d)).all()


def test_q4_0_round_trip_within_half_a_step_inside_the_range():
    x = random_blocks(4)
    x[0, :2] = torch.tensor([2.0, -1.95])  # -1.95 / d = 7.8 > 7.5: clipped to code 15, value 7 d
    q = quant.quantize(x, "q4_0")
    err = (quant.dequantize(q, "q4_0") - x).double().abs()
    xd = x.double()
    signed_max = xd.gather(-1, xd.abs().argmax(-1, keepdim=True))
    d = signed_max / -8  # codes are x / d + 8 in [0, 15]: x / d in [-8, 7.5] rounds, above 7.5 clips to 7
    t = xd / d
    fp16_slack = 8 * fp16_rounding_error(d.abs())  # |code - 8| <= 8 times the fp16 error of d
    inside = t <= 7.5
    bound_inside = d.abs() / 2 + fp16_slack + slack(8 * d.abs() + xd.abs())
    assert (err <= bound_inside)[inside].all()
    clipped = ~inside
    assert clipped.sum() >= 1  # the constructed block
    bound_clipped = (t - 7) * d.abs() + fp16_slack + slack(8 * d.abs() + xd.abs())
    assert (err <= bound_clipped)[clipped].all()
    d16 = stored_scales(q, "q4_0")
    assert quant.dequantize(q, "q4_0")[0, 1] == 7 * d16[0, 0]  # code 15
    assert err[0, 1] > d.abs()[0, 0] / 2  # clipping costs (7.8 - 7) |d|, more than rounding's |d| / 2


def nf4_largest_gap() -> float:
    book = quant.NF4_CODEBOOK
    return max(b - a for a, b in zip(book, book[1:], strict=False))


def test_nf4_round_trip_within_half_the_largest_gap():
    x = random_blocks(5)
    q = quant.quantize(x, "nf4")
    x_hat = quant.dequantize(q, "nf4")
    err = (x_hat - x).double().abs()
    scale = stored_scales(q, "nf4").double()  # (48, 1)
    absmax = x.double().abs().amax(-1, keepdim=True)
    # The scale is absmax rounded up to fp16: |x| / scale <= 1, the codebook's range.
    assert (scale >= absmax).all() and (scale - absmax <= 2 * fp16_rounding_error(absmax)).all()
    bound = scale * nf4_largest_gap() / 2 + slack(scale + x.double().abs())
    assert (err <= bound).all(), f"worst excess {(err - bound).max().item():.3g}"


def test_nf4_picks_the_nearest_codebook_entry():
    x = random_blocks(6)
    q = quant.quantize(x, "nf4")
    scale = stored_scales(q, "nf4").double()
    u = x.double() / scale  # (48, 32) in [-1, 1]
    book = torch.tensor(quant.NF4_CODEBOOK, dtype=torch.float64)
    nearest = (u.unsqueeze(-1) - book).abs().amin(-1)  # distance to the nearest entry
    chosen = (quant.dequantize(q, "nf4").double() / scale - u).abs()
    assert (chosen <= nearest + slack(torch.ones_like(u))).all()


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "nf4"])
def test_blocks_below_float32_inverse_range_encode_as_zero(fmt):
    # |x| < 1e-37: 1 / d overflows float32 (ggml's behaviour is undefined there); here they decode to exact 0.
    x = torch.tensor([1e-38, -5e-39, 1e-45] + [0.0] * 29)
    q = quant.quantize(x, fmt)
    zero_code = {"q8_0": [0] * 32, "q4_0": [0x88] * 16, "nf4": [0x77] * 16}[fmt]  # code of 0.0, both nibbles
    assert q[2:].tolist() == zero_code
    assert torch.equal(quant.dequantize(q, fmt), torch.zeros(32))


# --- KIVI ------------------------------------------------------------------------------------------------------


def kivi_blocks(q: torch.Tensor, bits: int, group: int, n: int, per_channel: bool):
    """Stored (scale, min) of every block, shaped like the blocks: (..., rows, blocks per row, 1)."""
    n_blocks = n if per_channel else n // group
    blocks = q.reshape(*q.shape[:-1], n_blocks, 4 + group * bits // 8)
    scale = blocks[..., :2].contiguous().view(torch.float16).double()
    low = blocks[..., 2:4].contiguous().view(torch.float16).double()
    return scale, low


def as_blocks(x: torch.Tensor, group: int, per_channel: bool) -> torch.Tensor:
    """The test's own grouping of x (..., T, n) into (..., rows, blocks per row, group)."""
    if per_channel:
        return x.unflatten(-2, (-1, group)).transpose(-1, -2)  # (..., T/group, n, group)
    return x.unflatten(-1, (-1, group))  # (..., T, n/group, group)


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("offset", [0.0, 1000.0])
def test_kivi_round_trip_within_half_a_step_per_group(bits, per_channel, offset):
    group, n = 16, 48
    gen = torch.Generator().manual_seed(bits + 10 * per_channel)
    x = torch.randn(2, 32, n, generator=gen) * torch.logspace(-3, 2, n) + offset  # (B, T, n), channel scales vary
    q = quant.quantize_kivi(x, bits, group, per_channel)
    x_hat = quant.dequantize_kivi(q, bits, group, per_channel, n)
    assert x_hat.shape == x.shape and x_hat.dtype == torch.float32
    scale, low = kivi_blocks(q, bits, group, n, per_channel)
    xb = as_blocks(x.double(), group, per_channel)
    err = as_blocks((x_hat.double() - x.double()).abs(), group, per_channel)
    levels = 2**bits - 1
    # min rounded down and scale up to fp16: every block's range lies inside [low, low + levels * scale] ...
    assert (low <= xb.amin(-1, keepdim=True)).all()
    assert (low + levels * scale >= xb.amax(-1, keepdim=True) - slack(xb.abs().amax(-1, keepdim=True))).all()
    # ... so every value is within half a step of a code (a 1000 offset costs fp16 min precision, not accuracy)
    bound = scale / 2 + slack(low.abs() + levels * scale + xb.abs())
    assert (err <= bound).all(), f"worst excess {(err - bound).max().item():.3g}"


def test_kivi_constant_block_is_exact():
    x = torch.full((4, 32), 0.375)  # fp16-exact min, scale 0: no division by zero, exact decode
    for per_channel in (False, True):
        q = quant.quantize_kivi(x, 2, 4, per_channel)
        assert torch.equal(quant.dequantize_kivi(q, 2, 4, per_channel, 32), x)


@pytest.mark.parametrize("per_channel", [False, True])
def test_kivi_blocks_are_per_channel_for_keys_and_per_token_for_values(per_channel):
    bits, group, tokens, n = 4, 8, 16, 24
    x = torch.randn(tokens, n, generator=torch.Generator().manual_seed(7))
    q = quant.quantize_kivi(x, bits, group, per_channel)
    block = 4 + group * bits // 8
    t, c = 11, 13
    y = x.clone()
    y[t, c] = 50.0  # a new block max: only that block's bytes can change
    changed = (quant.quantize_kivi(y, bits, group, per_channel) != q).reshape(q.shape[0], -1, block).any(-1)
    expected = torch.zeros_like(changed)
    if per_channel:
        expected[t // group, c] = True  # row = token group, one block per channel
    else:
        expected[t, c // group] = True  # row = token, one block per group of channels
    assert torch.equal(changed, expected)


def test_kivi_packing_order():
    # per token, bits 2, group 8 (k = 4 codes per byte): byte j holds codes j, j + 2, j + 4, j + 6.
    x = torch.tensor([[0.0, 3.0, 1.0, 2.0, 2.0, 1.0, 3.0, 0.0]])  # min 0, scale 1: codes = x
    q = quant.quantize_kivi(x, 2, 8, per_channel=False)
    assert q[0, :4].contiguous().view(torch.float16).tolist() == [1.0, 0.0]  # scale, min
    assert q[0, 4:].tolist() == [0 | 1 << 2 | 2 << 4 | 3 << 6, 3 | 2 << 2 | 1 << 4 | 0 << 6]


# --- shapes, sizes, purity -------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", quant.FORMATS)
def test_shapes_dtypes_and_sizes(fmt):
    x = torch.randn(2, 3, 96, generator=torch.Generator().manual_seed(8))
    before = x.clone()
    q = quant.quantize(x, fmt)
    assert torch.equal(x, before)  # pure: the input is not modified
    assert q.dtype == torch.uint8 and q.shape == (2, 3, 3 * quant.block_bytes(fmt))
    assert q.numel() == x.numel() * quant.bytes_per_value(fmt)
    out = quant.dequantize(q, fmt)
    assert out.dtype == torch.float32 and out.shape == x.shape
    assert torch.equal(quant.quantize(x.transpose(0, 1), fmt), q.transpose(0, 1))  # non-contiguous input
    assert quant.quantize(torch.empty(5, 0), fmt).shape == (5, 0)
    assert quant.dequantize(torch.empty(5, 0, dtype=torch.uint8), fmt).shape == (5, 0)


def test_format_sizes():
    assert [quant.block_bytes(f) for f in quant.FORMATS] == [34, 18, 18]
    assert [quant.bytes_per_value(f) for f in quant.FORMATS] == [34 / 32, 18 / 32, 18 / 32]
    assert quant.kivi_bytes_per_value(2, 32) == 2 / 8 + 4 / 32
    assert quant.kivi_bytes_per_value(4, 128) == 4 / 8 + 4 / 128


@pytest.mark.parametrize("bits,group", [(2, 32), (4, 16), (8, 4), (2, 4)])
def test_kivi_shapes_match_the_formulas(bits, group):
    tokens, n = 2 * group, 3 * group
    x = torch.randn(2, tokens, n, generator=torch.Generator().manual_seed(9))
    values = quant.quantize_kivi(x, bits, group, per_channel=False)
    assert values.dtype == torch.uint8 and values.shape == (2, tokens, n * bits // 8 + n // group * 4)
    keys = quant.quantize_kivi(x, bits, group, per_channel=True)
    assert keys.shape == (2, tokens // group, group * n * bits // 8 + n * 4)
    for q in (values, keys):
        assert q.numel() == x.numel() * quant.kivi_bytes_per_value(bits, group)


# --- errors ----------------------------------------------------------------------------------------------------


def test_errors_name_the_value_and_the_fix():
    x = torch.randn(2, 64)
    with pytest.raises(InputError, match=r"'q5_0' \(valid: q8_0, q4_0, nf4, q4_1\)"):
        quant.quantize(x, "q5_0")
    with pytest.raises(InputError, match=r"valid: q8_0, q4_0, nf4"):
        quant.dequantize(torch.zeros(2, 34, dtype=torch.uint8), "Q8_0")
    with pytest.raises(InputError, match=r"shape=\(2, 33\).*multiple of the block size 32.*pad it to 64"):
        quant.quantize(torch.randn(2, 33), "q4_0")
    bad = x.clone()
    bad[0, 1], bad[1, 5] = float("nan"), float("inf")
    with pytest.raises(InputError, match=r"2 non-finite values .* out of 128; .*finite"):
        quant.quantize(bad, "q8_0")
    with pytest.raises(InputError, match=r"2 non-finite values"):
        quant.quantize_kivi(bad, 4, 32, per_channel=False)
    with pytest.raises(InputError, match=r"dtype torch.int64.*floating-point"):
        quant.quantize(torch.ones(64, dtype=torch.long), "nf4")
    with pytest.raises(InputError, match=r"dtype torch.float32, expected a torch.uint8"):
        quant.dequantize(torch.zeros(2, 34), "q8_0")
    with pytest.raises(InputError, match=r"shape=\(2, 35\).*34-byte q8_0 block"):
        quant.dequantize(torch.zeros(2, 35, dtype=torch.uint8), "q8_0")


@pytest.mark.parametrize("codec", ["q8_0", "q4_0", "nf4", "kivi values", "kivi keys"])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_every_codec_rejects_non_finite_values(codec, bad):
    x = torch.randn(2, 32, 64, generator=torch.Generator().manual_seed(10))
    x[1, 17, 40] = bad  # one value, in a block of the second half
    with pytest.raises(InputError, match=r"x has 1 non-finite values \(NaN or inf\) out of 4096"):
        if codec.startswith("kivi"):
            quant.quantize_kivi(x, 4, 16, per_channel=codec == "kivi keys")
        else:
            quant.quantize(x, codec)


@pytest.mark.parametrize("fmt,limit", [("q8_0", 65504 * 127), ("q4_0", 65504 * 8), ("nf4", 65504)])
def test_scale_overflow_is_an_error_not_an_inf(fmt, limit):
    ok = torch.full((32,), float(limit))
    assert quant.dequantize(quant.quantize(ok, fmt), fmt).isfinite().all()
    with pytest.raises(InputError, match=rf"\|x\| <= {re.escape(f'{limit:.6g}')}.*rescale"):
        quant.quantize(ok * 1.01, fmt)


def test_kivi_errors():
    x = torch.randn(8, 64)
    with pytest.raises(InputError, match=r"bits=3 .*valid: 2, 4, 8"):
        quant.quantize_kivi(x, 3, 32, per_channel=False)
    with pytest.raises(InputError, match=r"group=6 .*multiple of 4"):
        quant.quantize_kivi(x, 2, 6, per_channel=False)
    with pytest.raises(InputError, match=r"n=64 channels is not a multiple of group=24"):
        quant.quantize_kivi(x, 8, 24, per_channel=False)
    with pytest.raises(InputError, match=r"T=8 tokens is not a multiple of group=32"):
        quant.quantize_kivi(x, 4, 32, per_channel=True)
    with pytest.raises(InputError, match=r"\(\.\.\., T, n\)"):
        quant.quantize_kivi(torch.randn(64), 4, 32, per_channel=False)
    with pytest.raises(InputError, match=r"fp16 block min and scale .*\(\|x\| <= 65504\); rescale"):
        quant.quantize_kivi(x * 1e6, 4, 32, per_channel=False)
    q = quant.quantize_kivi(x, 4, 32, per_channel=False)  # (8, 40)
    with pytest.raises(InputError, match=r"n=96 channels .* take 60 bytes per row \(pass the n that x had\)"):
        quant.dequantize_kivi(q, 4, 32, False, 96)
    with pytest.raises(InputError, match=r"expected a torch.uint8"):
        quant.dequantize_kivi(q.float(), 4, 32, False, 64)


def test_exact_values_survive():
    # Values on the grid of every format decode exactly: a smoke test of scale and code placement.
    grid = torch.arange(-8, 8, dtype=torch.float32).repeat(2) / 4  # q4_0: max -2 -> d = 1/4
    assert torch.equal(quant.dequantize(quant.quantize(grid, "q4_0"), "q4_0"), grid)
    book = torch.tensor(quant.NF4_CODEBOOK).repeat(2) * 3  # nf4: scale 3 (exact in fp16)
    assert torch.equal(quant.dequantize(quant.quantize(book, "nf4"), "nf4"), book)
    ints = torch.arange(-127, 128, 8, dtype=torch.float32)  # (32,), q8_0: d = 1
    assert torch.equal(quant.dequantize(quant.quantize(ints, "q8_0"), "q8_0"), ints)
    assert math.isclose(quant.bytes_per_value("nf4"), 0.5625)


def test_results_do_not_depend_on_the_chunk_size(monkeypatch):
    x = torch.randn(3, 40, 96, generator=torch.Generator().manual_seed(11))  # (B, T, n)
    codecs = [(lambda x, f=f: quant.quantize(x, f), lambda q, f=f: quant.dequantize(q, f)) for f in quant.FORMATS]
    for per_channel in (False, True):
        codecs.append(
            (
                lambda x, p=per_channel: quant.quantize_kivi(x, 2, 8, p),
                lambda q, p=per_channel: quant.dequantize_kivi(q, 2, 8, p, 96),
            )
        )
    whole = [(encode(x), decode(encode(x))) for encode, decode in codecs]
    monkeypatch.setattr(quant, "_CHUNK_VALUES", 100)  # 3 blocks of 32, or one KIVI row, per chunk
    for (encode, decode), (q, x_hat) in zip(codecs, whole, strict=True):
        assert torch.equal(encode(x), q)
        assert torch.equal(decode(q), x_hat)
