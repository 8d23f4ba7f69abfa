"""Pure quantization codecs: ggml block formats (q8_0, q4_0, q4_1), QLoRA's NF4, and KIVI's asymmetric ints.

Every function is a pure, vectorized map between a float tensor and one uint8 tensor that holds everything
(codes and fp16 scales), so a cache can store, slice and measure a single tensor per layer.

Block formats (`quantize` / `dequantize`), blocks of 32 consecutive values along the last dimension:

    q8_0  34 bytes: fp16 d, 32 x int8 q                  x = d * q,        d = absmax / 127
    q4_0  18 bytes: fp16 d, 16 bytes of nibbles          x = d * (q - 8),  d = (signed value of largest |x|) / -8
    q4_1  20 bytes: fp16 d, fp16 m, 16 bytes of nibbles  x = d * q + m,    d = (max - min) / 15, m = min
    nf4   18 bytes: fp16 s, 16 bytes of nibbles          x = s * NF4[q],   s = absmax (rounded up to fp16)

q8_0, q4_0 and q4_1 are byte-for-byte ggml's (as `gguf.quants` writes them): the codes are computed from the
float32 scale (and min) and the scale's float32 inverse, and only then are they rounded to fp16. Nibble order
(q4_0, q4_1, nf4): byte j holds element j in its low nibble and element j + 16 in its high nibble. The KV caches
store q8_0, q4_0 and nf4 (FORMATS); q4_1 is for weights (attnlab.model.qlinear, GGUF files).

KIVI (`quantize_kivi` / `dequantize_kivi`; Liu et al. 2024, "KIVI: a tuning-free asymmetric 2bit quantization for
KV cache", section 3): blocks of `group` values, x = min + scale * q with q in [0, 2^bits - 1]; keys are quantized
per channel (a block = one channel over `group` consecutive tokens), values per token (a block = `group`
consecutive channels of one token). Block layout, like ggml's q4_1: fp16 scale, fp16 min, then the codes packed
little-end first: byte j holds codes j, j + G/k, j + 2G/k, ... (k = 8 / bits codes per byte, G = group) at
bits 0, bits, 2 bits, ...

Inputs of any float dtype are converted to float32 first, as gguf does. Non-finite values, and values too large
for a format's fp16 scale, raise InputError (ggml would write an inf scale).
"""

from __future__ import annotations

import torch

from attnlab.errors import InputError

FORMATS = ("q8_0", "q4_0", "nf4")  # the KV caches' block formats
WEIGHT_FORMATS = ("q8_0", "q4_0", "q4_1")  # ggml's, for weights (attnlab.model.qlinear)
BLOCK = 32
KIVI_BITS = (2, 4, 8)
FP16_MAX = 65504.0
FP16_OVERFLOW = 65520.0  # the smallest |x| that float16 rounds to inf (65504 < |x| < 65520 round to 65504)

_BLOCK_BYTES = {"q8_0": 2 + BLOCK, "q4_0": 2 + BLOCK // 2, "nf4": 2 + BLOCK // 2, "q4_1": 4 + BLOCK // 2}
# Largest |x| each format's fp16 scale can represent: d = absmax / 127 (q8_0), |max| / 8 (q4_0), absmax (nf4);
# q4_1's min is stored in fp16 itself (and its scale, (max - min) / 15, then fits).
_MAX_ABS = {"q8_0": FP16_MAX * 127, "q4_0": FP16_MAX * 8, "q4_1": FP16_MAX, "nf4": FP16_MAX}

# The 4-bit NormalFloat codebook of QLoRA (Dettmers et al. 2023, appendix E; bitsandbytes' NF4 table): quantiles
# of N(0, 1) rescaled to [-1, 1], with an exact zero.
NF4_CODEBOOK = (
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982608795166,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
)
_NF4_TABLE = torch.tensor(NF4_CODEBOOK, dtype=torch.float32)
# Decision boundaries of nearest-entry rounding: the midpoints between consecutive codebook entries.
_NF4_MIDPOINTS = tuple((a + b) / 2 for a, b in zip(NF4_CODEBOOK, NF4_CODEBOOK[1:], strict=False))


def block_bytes(fmt: str) -> int:
    """Bytes of one block of BLOCK=32 values in format `fmt`."""
    return _BLOCK_BYTES[_check_format(fmt)]


def bytes_per_value(fmt: str) -> float:
    """Stored bytes per value, scales included (q8_0 1.0625, q4_0 and nf4 0.5625, q4_1 0.625)."""
    return block_bytes(fmt) / BLOCK


def kivi_bytes_per_value(bits: int, group: int) -> float:
    """Stored bytes per value of KIVI with `bits`-bit codes and one fp16 scale + fp16 min per `group` values."""
    _check_kivi(bits, group)
    return bits / 8 + 4 / group


def quantize(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """x: float (..., n) with n % 32 == 0 -> uint8 (..., n // 32 * block_bytes(fmt))."""
    nbytes = block_bytes(fmt)
    x = _float32(x)
    n = x.shape[-1] if x.dim() else 0
    if x.dim() == 0 or n % BLOCK:
        raise InputError(
            f"x.shape={tuple(x.shape)}: the last dimension must be a multiple of the block size {BLOCK} "
            f"for {fmt} (pad it to {(n + BLOCK - 1) // BLOCK * BLOCK or BLOCK})"
        )
    blocks = x.reshape(-1, BLOCK)  # (B, 32)
    out = torch.empty(blocks.shape[0], nbytes, dtype=torch.uint8, device=x.device)  # (B, block_bytes)
    encode = {"q8_0": _q8_0_encode, "q4_0": _q4_0_encode, "q4_1": _q4_1_encode, "nf4": _nf4_encode}[fmt]
    for rows in _chunks(blocks.shape[0], BLOCK):
        scale = encode(blocks[rows], out[rows])
        if not torch.isfinite(scale).all():  # a non-finite x, or an fp16 scale overflow, shows in the scale
            raise _bad_values(x, f"{fmt}'s fp16 block scale", _MAX_ABS[fmt])
    return out.reshape(*x.shape[:-1], n // BLOCK * nbytes)


def dequantize(q: torch.Tensor, fmt: str) -> torch.Tensor:
    """q: uint8 (..., m) from `quantize(x, fmt)`, m % block_bytes(fmt) == 0 -> float32 (..., m // block_bytes * 32)."""
    nbytes = block_bytes(fmt)
    _check_codes(q, nbytes, f"{fmt} block", f"quantize(x, {fmt!r})")
    blocks = q.reshape(-1, nbytes)  # (B, block_bytes)
    out = torch.empty(blocks.shape[0], BLOCK, dtype=torch.float32, device=q.device)  # (B, 32)
    for rows in _chunks(blocks.shape[0], BLOCK):
        chunk, x = blocks[rows], out[rows]
        if fmt == "q4_1":
            _unpack_into(chunk[:, 4:], 4, x)
            # ggml's d * q + m: the product is exact (11 by 4 bits), the sum rounded once
            x.mul_(_fp16_from_bytes(chunk[:, :2])).add_(_fp16_from_bytes(chunk[:, 2:4]))
            continue
        if fmt == "q8_0":
            x.copy_(chunk[:, 2:].view(torch.int8))
        elif fmt == "q4_0":
            _unpack_into(chunk[:, 2:], 4, x)
            x.sub_(8)  # codes 0..15 -> -8..7, exact in float32
        else:
            codes = _unpack(chunk[:, 2:], 4).long().flatten()  # (c * 32,)
            x.copy_(_NF4_TABLE.to(q.device).index_select(0, codes).view_as(x))
        x.mul_(_fp16_from_bytes(chunk[:, :2]))  # the one float32 rounding of ggml's d * q
    return out.reshape(*q.shape[:-1], q.shape[-1] // nbytes * BLOCK)


def quantize_kivi(x: torch.Tensor, bits: int, group: int, per_channel: bool) -> torch.Tensor:
    """KIVI asymmetric quantization of x: float (..., T, n).

    per_channel=False (values): blocks of `group` consecutive channels of one token; n % group == 0
        -> uint8 (..., T, n * bits / 8 + n / group * 4).
    per_channel=True (keys): each channel over `group` consecutive tokens; T % group == 0
        -> uint8 (..., T / group, group * n * bits / 8 + n * 4).
    Each value is within scale / 2 of its reconstruction, with `scale` the block's stored fp16 scale.
    """
    _check_kivi(bits, group)
    x = _float32(x)
    blocks = _kivi_blocks(x, group, per_channel)  # (rows, blocks per row, group), a view of x
    out = torch.empty(*blocks.shape[:2], 4 + group * bits // 8, dtype=torch.uint8, device=x.device)
    for rows in _chunks(blocks.shape[0], blocks.shape[1] * group):
        scale_and_min = _kivi_encode(blocks[rows], bits, out[rows])
        if not torch.isfinite(scale_and_min).all():
            raise _bad_values(x, "KIVI's fp16 block min and scale", FP16_MAX)
    rows_shape = (*x.shape[:-2], x.shape[-2] // group) if per_channel else x.shape[:-1]
    return out.reshape(*rows_shape, blocks.shape[1] * out.shape[-1])  # (..., rows, row bytes)


def dequantize_kivi(q: torch.Tensor, bits: int, group: int, per_channel: bool, n: int) -> torch.Tensor:
    """Inverse of `quantize_kivi(x, bits, group, per_channel)` for x with n channels -> float32 (..., T, n)."""
    _check_kivi(bits, group)
    block = 4 + group * bits // 8
    if not per_channel and n % group:
        raise InputError(f"n={n} channels is not a multiple of group={group} (per_channel=False)")
    n_blocks = n if per_channel else n // group  # blocks per row
    _check_codes(q, block, "KIVI block", "quantize_kivi(x, bits, group, per_channel)")
    if q.dim() < 2:
        raise InputError(f"q.shape={tuple(q.shape)}: expected (..., rows, row bytes) from quantize_kivi")
    if q.shape[-1] != n_blocks * block:
        raise InputError(
            f"q.shape[-1]={q.shape[-1]} bytes, but n={n} channels with bits={bits}, group={group}, "
            f"per_channel={per_channel} take {n_blocks * block} bytes per row (pass the n that x had)"
        )
    blocks = q.reshape(-1, n_blocks, block)  # (rows, blocks per row, block bytes)
    tokens = q.shape[-2] * group if per_channel else q.shape[-2]
    out = torch.empty(*q.shape[:-2], tokens, n, dtype=torch.float32, device=q.device)  # (..., T, n)
    out_blocks = _kivi_blocks(out, group, per_channel)  # (rows, blocks per row, group), a view of out
    for rows in _chunks(blocks.shape[0], n_blocks * group):
        chunk, x = blocks[rows], out_blocks[rows]
        _unpack_into(chunk[..., 4:], bits, x)
        x.mul_(_fp16_from_bytes(chunk[..., :2])).add_(_fp16_from_bytes(chunk[..., 2:4]))  # min + scale * q
    return out


# --- the codecs of one chunk of blocks: read blocks (c, 32), write their bytes into out (c, block_bytes) ---------


def q8_0_codes(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ggml's quantize_row_q8_0_ref on blocks (c, 32) float32: (the codes q = round(x * (1 / d)), half away from
    zero, as float32 (c, 32); d = absmax / 127 in float32 (c, 1), before ggml rounds it to fp16)."""
    d = _absmax(blocks) / 127  # (c, 1)
    p = blocks * _inverse(d)  # (c, 32)
    # Round half away from zero exactly as gguf's np_roundf: floor(|p|) + floor(2 * frac(|p|)), sign of p. Not
    # floor(|p| + 0.5): in float32, |p| + 0.5 rounds up to 1.0 for |p| = 0.5 - 2^-25.
    a = p.abs()
    whole = a.floor()
    return whole.add_(a.sub_(whole).mul_(2).floor_()).copysign_(p), d


def _q8_0_encode(blocks: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """As ggml's quantize_row_q8_0_ref (q8_0_codes), the scale stored as fp16."""
    codes, d = q8_0_codes(blocks)
    out[:, 2:].view(torch.int8).copy_(codes)  # integral, |q| <= 127
    return _write_fp16(out[:, :2], d)


def _q4_0_encode(blocks: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """As ggml's quantize_row_q4_0_ref: d = max / -8 with max the signed value of largest magnitude,
    q = min(15, trunc(x * (1 / d) + 8.5))."""
    high, low = blocks.amax(dim=-1, keepdim=True), blocks.amin(dim=-1, keepdim=True)  # (c, 1)
    signed_max = torch.where(-low > high, low, high)
    tied = (-low == high).flatten().nonzero().flatten()  # +a and -a (or all zeros): ggml keeps the first
    if tied.numel():
        sub = blocks[tied]  # (ties, 32)
        signed_max[tied] = sub.gather(-1, sub.abs().argmax(dim=-1, keepdim=True))  # argmax: first maximum
    d = signed_max / -8
    # Two float32 roundings (product, then + 8.5), as the reference, so near-ties come out the same; the sum is
    # in [0.5, 16.5], where the cast to uint8 truncates as the reference's trunc.
    codes = (blocks * _inverse(d)).add_(8.5).to(torch.uint8).clamp_max_(15)  # (c, 32)
    _pack_into(codes, 4, out[:, 2:])
    return _write_fp16(out[:, :2], d)


def _q4_1_encode(blocks: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """As ggml's quantize_row_q4_1_ref: d = (max - min) / 15, q = min(15, trunc((x - min) * (1 / d) + 0.5)), the
    min stored as m; three float32 roundings (difference, product, + 0.5) as the reference."""
    high, low = blocks.amax(dim=-1, keepdim=True), blocks.amin(dim=-1, keepdim=True)  # (c, 1)
    d = (high - low) / 15
    codes = (blocks - low).mul_(_inverse(d)).add_(0.5).to(torch.uint8).clamp_max_(15)  # (c, 32), sum in [0.5, 15.5]
    _pack_into(codes, 4, out[:, 4:])
    _write_fp16(out[:, 2:4], low)
    return torch.cat([_write_fp16(out[:, :2], d), low.half()], dim=-1)  # an fp16 overflow of either shows


def _nf4_encode(blocks: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """s = absmax rounded up to fp16 (so |x| / s <= 1, the codebook's range), q = nearest NF4 entry to x / s."""
    scale = _fp16_round(_absmax(blocks), up=True)  # (c, 1)
    divisor = scale.float().masked_fill_(scale == 0, 1.0)  # an all-zero block encodes as 0 / 1
    v = blocks * (_NF4_CELLS / 2 / divisor)  # (c, 32): x / s in units of a lookup cell, in [-128, 128]
    cell = (v + _NF4_CELLS / 2).to(torch.int64).clamp_(0, _NF4_CELLS - 1).flatten()  # (c * 32,)
    # index_select, not below[cell]: advanced indexing is 4x slower on CPU
    codes = _NF4_BELOW.to(blocks.device).index_select(0, cell).view_as(v)  # NF4 midpoints below the cell
    codes += v > _NF4_INSIDE.to(blocks.device).index_select(0, cell).view_as(v)  # + the one inside, if passed
    _pack_into(codes, 4, out[:, 2:])
    out[:, :2].copy_(scale.view(torch.uint8))
    return scale


def _kivi_encode(blocks: torch.Tensor, bits: int, out: torch.Tensor) -> torch.Tensor:
    """(c, k, G) float32 -> out (c, k, 4 + G * bits / 8): fp16 scale, fp16 min, packed codes."""
    levels = 2**bits - 1
    # The min is rounded down and the scale up to fp16, so the block's range fits in [low, low + levels * scale]
    # and every value is within scale / 2 of a code, whatever the fp16 rounding of a large offset.
    low = _fp16_round(blocks.amin(dim=-1, keepdim=True), up=False)  # (c, k, 1)
    scale = _fp16_round((blocks.amax(dim=-1, keepdim=True) - low.float()) / levels, up=True)  # (c, k, 1)
    divisor = scale.float().masked_fill_(scale == 0, 1.0)  # a constant block encodes as code 0
    codes = (blocks - low.float()).div_(divisor).round_().clamp_(0, levels).to(torch.uint8)  # (c, k, G)
    out[..., :2].copy_(scale.view(torch.uint8))
    out[..., 2:4].copy_(low.view(torch.uint8))
    _pack_into(codes, bits, out[..., 4:])
    return torch.cat([scale, low], dim=-1)


def _kivi_blocks(x: torch.Tensor, group: int, per_channel: bool) -> torch.Tensor:
    """x (..., T, n) -> a view (rows, blocks per row, group), in the order the blocks are stored."""
    if x.dim() < 2:
        raise InputError(f"x.shape={tuple(x.shape)}: KIVI quantizes (..., T, n) tensors (add a token dimension)")
    tokens, n = x.shape[-2:]
    if per_channel:
        if tokens % group:
            raise InputError(
                f"x.shape={tuple(x.shape)}: T={tokens} tokens is not a multiple of group={group} "
                f"(per_channel=True quantizes whole groups of tokens; keep the last {tokens % group} in full precision)"
            )
        return x.reshape(-1, group, n).transpose(1, 2)  # (..., T, n) -> (rows = .../T/group, n, group)
    if n % group:
        raise InputError(f"x.shape={tuple(x.shape)}: n={n} channels is not a multiple of group={group}")
    return x.reshape(-1, n // group, group)  # (..., T, n) -> (rows = ...T, n/group, group)


# --- helpers ---------------------------------------------------------------------------------------------------

# Values per chunk of the loops above: one op over a whole 16M-value tensor spends more time faulting in its
# fresh 64 MB result than computing it; over 2^18-value chunks the temporaries are reused and stay in cache.
_CHUNK_VALUES = 1 << 18
_NF4_CELLS = 256  # nearest-entry lookup: x / s in [-1, 1] cut into 256 cells, each holding at most one midpoint


def _chunks(rows: int, values_per_row: int) -> list[slice]:
    step = max(1, _CHUNK_VALUES // max(1, values_per_row))
    return [slice(start, start + step) for start in range(0, rows, step)]


def _nf4_tables() -> tuple[torch.Tensor, torch.Tensor]:
    """Per lookup cell: the number of NF4 midpoints below it (uint8) and the midpoint inside it (or +inf), with a
    margin of 1e-3 cell for the float32 rounding of the cell index; the midpoints are >= 10 cells apart."""
    mids = [m * _NF4_CELLS / 2 for m in _NF4_MIDPOINTS]  # midpoints in cell units, in (-128, 128)
    below, inside = [], []
    for cell in range(_NF4_CELLS):
        lo, hi = cell - _NF4_CELLS / 2 - 1e-3, cell - _NF4_CELLS / 2 + 1 + 1e-3
        below.append(sum(m < lo for m in mids))
        inside.append(next((m for m in mids if lo <= m <= hi), float("inf")))
    return torch.tensor(below, dtype=torch.uint8), torch.tensor(inside, dtype=torch.float32)


_NF4_BELOW, _NF4_INSIDE = _nf4_tables()


def _absmax(blocks: torch.Tensor) -> torch.Tensor:
    """max |x| over the last dim without a full-size |x| temporary (abs_: +0, never -0, for all-zero blocks)."""
    return torch.maximum(blocks.amax(dim=-1, keepdim=True), -blocks.amin(dim=-1, keepdim=True)).abs_()


def _inverse(d: torch.Tensor) -> torch.Tensor:
    """1 / d in float32, 0 where d == 0 (as ggml), and 0 where 1 / d overflows (|d| < 2^-128, a block of
    |x| < ~1e-37: the reference's behaviour is undefined there, casting inf or NaN to int; here such a block
    encodes as all-zero, which its fp16 scale, 0, makes exact up to 1e-37)."""
    inv = d.reciprocal()
    return inv.masked_fill_(inv.isinf(), 0.0)


def _fp16_round(t: torch.Tensor, up: bool) -> torch.Tensor:
    """float32 t -> float16, rounded toward +inf (up) or -inf, so the fp16 value is >= t (up) or <= t."""
    half = t.half()
    wrong_side = half.float() < t if up else half.float() > t
    toward = torch.full_like(half, float("inf") if up else float("-inf"))
    return torch.where(wrong_side, torch.nextafter(half, toward), half)


def _write_fp16(dst: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """Writes float32 value (..., 1) rounded to fp16 as 2 bytes into dst (..., 2); returns the fp16 value."""
    half = value.half()
    dst.copy_(half.view(torch.uint8))  # little-endian on the usual hosts, as numpy's view in gguf
    return half


def _fp16_from_bytes(b: torch.Tensor) -> torch.Tensor:
    """(..., 2) uint8 -> (..., 1) float32."""
    return b.contiguous().view(torch.float16).to(torch.float32)


def _pack_into(codes: torch.Tensor, bits: int, out: torch.Tensor) -> None:
    """codes (..., G) uint8 < 2^bits -> out (..., G * bits / 8): byte j holds codes j, j + G/k, ... (k = 8 / bits)."""
    per_byte = 8 // bits
    planes = codes.unflatten(-1, (per_byte, codes.shape[-1] // per_byte))  # (..., k, G/k)
    packed = planes[..., 0, :].clone()
    for i in range(1, per_byte):  # over the k <= 4 bit planes, not over blocks
        packed |= planes[..., i, :] << (i * bits)
    out.copy_(packed)


def _unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of `_pack_into`: (..., G * bits / 8) uint8 -> codes (..., G) uint8."""
    per_byte = 8 // bits
    if per_byte == 1:
        return packed
    mask = 2**bits - 1
    planes = [(packed >> (i * bits)) & mask for i in range(per_byte)]
    return torch.stack(planes, dim=-2).flatten(-2)  # (..., k, G/k) -> (..., G)


def _unpack_into(packed: torch.Tensor, bits: int, out: torch.Tensor) -> None:
    """Codes of packed (..., G * bits / 8) converted into the float tensor out (..., G), plane by plane."""
    per_byte, width = 8 // bits, packed.shape[-1]
    mask = 2**bits - 1
    for i in range(per_byte):
        out[..., i * width : (i + 1) * width].copy_(packed >> (i * bits) & mask if per_byte > 1 else packed)


class UnstorableError(InputError):
    """x holds `bad` values that are not finite, or (bad 0) values up to |x| = `peak`, beyond `limit`, what a format's
    fp16 scale can represent (a KV cache turns it into attnlab.cache.codecs.KVValueError, which names its layer)."""

    def __init__(self, message: str, bad: int, peak: float, limit: float):
        super().__init__(message)
        self.bad, self.peak, self.limit = bad, peak, limit


def _bad_values(x: torch.Tensor, what: str, limit: float) -> UnstorableError:
    bad = int((~torch.isfinite(x)).sum())
    if bad:
        return UnstorableError(
            f"x has {bad} non-finite values (NaN or inf) out of {x.numel()}; quantization needs finite input "
            f"(replace or mask them first)",
            bad, float("nan"), limit,
        )  # fmt: skip
    peak = x.abs().max().item()
    return UnstorableError(
        f"x has values up to |x|={peak:.6g}, beyond what {what} can represent (|x| <= {limit:.6g}); rescale x first",
        0, peak, limit,
    )  # fmt: skip


def _check_format(fmt: str) -> str:
    if fmt not in _BLOCK_BYTES:
        raise InputError(f"unknown quantization format {fmt!r} (valid: {', '.join(_BLOCK_BYTES)})")
    return fmt


def _check_kivi(bits: int, group: int) -> None:
    if bits not in KIVI_BITS:
        raise InputError(f"KIVI bits={bits!r} is not supported (valid: {', '.join(map(str, KIVI_BITS))})")
    if not isinstance(group, int) or group < 1 or group * bits % 8:
        raise InputError(
            f"KIVI group={group!r} must be a positive integer with group * bits a multiple of 8 "
            f"(bits={bits}: use a multiple of {8 // bits}, e.g. 32 or 128)"
        )


def _float32(x: torch.Tensor) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        kind = f"a tensor of dtype {x.dtype}" if isinstance(x, torch.Tensor) else f"a {type(x).__name__}"
        raise InputError(f"x is {kind}; quantization needs a floating-point tensor (convert with x.float())")
    return x.detach().to(torch.float32)  # codes have no gradient: do not record a graph


def _check_codes(q: torch.Tensor, nbytes: int, what: str, source: str) -> None:
    if not isinstance(q, torch.Tensor) or q.dtype != torch.uint8:
        kind = f"dtype {q.dtype}" if isinstance(q, torch.Tensor) else f"type {type(q).__name__}"
        raise InputError(f"q has {kind}, expected a torch.uint8 tensor (pass the output of {source})")
    if q.dim() == 0 or q.shape[-1] % nbytes:
        raise InputError(
            f"q.shape={tuple(q.shape)}: the last dimension must be a multiple of the {nbytes}-byte {what} "
            f"(pass the output of {source})"
        )
