"""Matmuls with weights kept in a GGUF file's formats (qmatmul.c): y = x W^T + bias, W (n, k) as ggml's blocks.

    y = matmul("q4_1", blocks, x)          # blocks (n, k / 32 * 20) uint8, x (..., k) float32 -> (..., n)
    w = dequantize("q4_1", blocks, k)      # (n, k) float32, ggml's values

Formats: fp16 (ggml's F16) and the block formats q8_0, q4_0, q4_1 (attnlab.quant). The activations stay fp32:
the result is a fp32 matmul over the dequantized weights, summed in another order. Few rows of x (decoding) run
the kernel, which reads each weight once and decodes it in registers; from GEMM_MIN_ROWS rows on (prefill), tiles
of W are dequantized in C and multiplied by torch's GEMM, which is faster there than any decode-bound loop.
Built and loaded as qattn.c is (attnlab.kernels.cpu.compiled); callers check `available()` first.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from attnlab import quant
from attnlab.kernels import cpu

SOURCE = Path(__file__).with_name("qmatmul.c")
FORMAT_CODES = {"fp16": 1, "q4_0": 2, "q4_1": 3, "q8_0": 8}  # ggml's type ids, as qmatmul.c numbers them
FORMATS = tuple(FORMAT_CODES)
# Rows of x from which torch's GEMM over dequantized tiles is as fast as the kernel: the kernel decodes each block
# once per 4 rows of x (3 multiplies per 32 products), the GEMM pays a dequantized copy of W first. Measured with
# bench/qmatmul.py --rows (q4_1, 576 -> 1536 and 1536 -> 576, one thread): they cross between 24 and 64 rows.
GEMM_MIN_ROWS = 32
GEMM_TILE_VALUES = 1 << 19  # weights dequantized per GEMM tile: 2 MB of fp32, about one core's L2

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled qmatmul.c, or None (see attnlab.kernels.cpu.compiled; warned once)."""
    return cpu.compiled(SOURCE, load)


def load(path: Path) -> ctypes.CDLL:
    """A built qmatmul.c (attnlab.kernels.cpu.build(source=SOURCE)) with its functions' argument types declared."""
    lib = ctypes.CDLL(str(path))
    lib.attnlab_qmatmul.argtypes = [ctypes.c_int, _ptr, _i64, _i64, _ptr, _i64, _ptr, _ptr]
    lib.attnlab_qmatmul_q8.argtypes = lib.attnlab_qmatmul.argtypes
    lib.attnlab_dequantize.argtypes = [ctypes.c_int, _ptr, _i64, _i64, _ptr]
    lib.attnlab_quantize_q8.argtypes = [_ptr, _i64, _i64, _ptr, _ptr, _ptr]
    lib.attnlab_block_dot_q8.argtypes = [ctypes.c_int, _ptr, _ptr, ctypes.c_int32]
    lib.attnlab_qmatmul_q8p.argtypes = lib.attnlab_qmatmul.argtypes
    lib.attnlab_pack_q8.argtypes = [ctypes.c_int, _ptr, _i64, _i64, _ptr]
    lib.attnlab_packed_q8_fast.argtypes = []
    names = ("attnlab_qmatmul", "attnlab_qmatmul_q8", "attnlab_qmatmul_q8p", "attnlab_dequantize",
             "attnlab_quantize_q8", "attnlab_pack_q8", "attnlab_packed_q8_fast")  # fmt: skip
    for name in names:
        getattr(lib, name).restype = ctypes.c_int
    lib.attnlab_block_dot_q8.restype = ctypes.c_int32
    return lib


@functools.cache
def _qmatmul():
    return library().attnlab_qmatmul  # looked up once: ctypes' attribute access costs a few µs per call


def available() -> bool:
    """Whether the kernels are built and not switched off (attnlab.kernels.cpu.disabled() switches these off too)."""
    return not cpu.switched_off() and library() is not None


def row_bytes(fmt: str, k: int) -> int:
    """Bytes of one row of k weights in `fmt` (ggml's layout)."""
    return 2 * k if fmt == "fp16" else k // quant.BLOCK * quant.block_bytes(fmt)


def matmul(
    fmt: str,
    blocks: torch.Tensor,
    x: torch.Tensor,
    bias: torch.Tensor | None = None,
    gemm: bool | None = None,
    activations: str = "fp32",
    packed: bool = False,
) -> torch.Tensor:
    """x (..., k) float32 (CPU) times W^T, W the rows `blocks` (n, row_bytes(fmt, k)) uint8, contiguous, plus bias
    (n,) float32 -> (..., n) float32. k must be a multiple of 32. gemm: torch's GEMM over dequantized tiles (True)
    or the kernel (False); None chooses by the rows of x (GEMM_MIN_ROWS). activations "q8" (q8_0, q4_0, q4_1):
    x quantized to 8 bits per block first (attnlab.model.qlinear.quantize_activations); the kernel then takes
    integer dot products (attnlab_qmatmul_q8), the GEMM those values in float32. packed: `blocks` is pack_q8's
    layout (activations "q8", the kernel only: a GEMM needs the rows as they are)."""
    n, k = blocks.shape[0], x.shape[-1]
    q8 = activations == "q8" and fmt != "fp16"
    if not x.is_contiguous():
        x = x.contiguous()
    m = x.numel() // k  # rows of x
    if packed:
        if not q8 or gemm:
            raise ValueError("packed weights are multiplied by the q8 kernel only (activations='q8', gemm=False)")
    elif gemm if gemm is not None else m >= GEMM_MIN_ROWS:
        rows = quantized(x.view(m, k)) if q8 else x.view(m, k)
        return _gemm(fmt, blocks, rows, bias).view(x.shape[:-1] + (n,))
    out = torch.empty(x.shape[:-1] + (n,), dtype=torch.float32)
    bias_pointer = None if bias is None else bias.data_ptr()
    kernel = library().attnlab_qmatmul_q8p if packed else _qmatmul_q8() if q8 else _qmatmul()
    status = kernel(FORMAT_CODES[fmt], blocks.data_ptr(), n, k, x.data_ptr(), m, out.data_ptr(), bias_pointer)
    _check(status, fmt, k)
    return out


@functools.cache
def _qmatmul_q8():
    return library().attnlab_qmatmul_q8


def packed_fast() -> bool:
    """Whether this machine multiplies packed rows (pack_q8) with its vector kernel (AVX-512 VNNI or AVX2); where it
    does not, the packed kernel runs portable loops and attnlab keeps the rows as they are."""
    return available() and bool(library().attnlab_packed_q8_fast())


def pack_q8(fmt: str, blocks: torch.Tensor, k: int) -> torch.Tensor:
    """The rows `blocks` (n, row_bytes(fmt, k)) uint8 (q8_0, q4_0, q4_1; n a multiple of 16) interleaved 16 at a time
    for the 8-bit-activation kernel (qmatmul.c's attnlab_pack_q8): the same bytes, another order, the same shape."""
    blocks = blocks.contiguous()
    out = torch.empty_like(blocks)
    status = library().attnlab_pack_q8(FORMAT_CODES[fmt], blocks.data_ptr(), blocks.shape[0], k, out.data_ptr())
    if status:
        raise ValueError(f"qmatmul.c cannot pack {blocks.shape[0]} rows of {k} {fmt} weights (q8_0, q4_0 or q4_1; "
                         "rows a multiple of 16, k of 32)")  # fmt: skip
    return out


def quantize_q8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x (m, k) float32, k a multiple of 32 -> qmatmul.c's 8-bit activations: codes (m, k) int8, scales (m, k / 32)
    float32 and each block's sum of codes (m, k / 32) int32."""
    x = x.contiguous()
    m, k = x.shape
    codes = torch.empty(m, k, dtype=torch.int8)
    scales, sums = torch.empty(m, k // 32), torch.empty(m, k // 32, dtype=torch.int32)
    _check(library().attnlab_quantize_q8(x.data_ptr(), m, k, codes.data_ptr(), scales.data_ptr(), sums.data_ptr()),
           "q8", k)  # fmt: skip
    return codes, scales, sums


def quantized(x: torch.Tensor) -> torch.Tensor:
    """x (m, k) as its 8-bit activations' values, codes times scales (quantize_q8), float32."""
    codes, scales, _ = quantize_q8(x)
    return (codes.view(x.shape[0], -1, 32).float() * scales.unsqueeze(-1)).view(x.shape)


def dequantize(fmt: str, blocks: torch.Tensor, k: int) -> torch.Tensor:
    """The rows `blocks` (n, row_bytes(fmt, k)) uint8, contiguous, as float32 (n, k): ggml's values."""
    out = torch.empty(blocks.shape[0], k, dtype=torch.float32)
    _check(library().attnlab_dequantize(FORMAT_CODES[fmt], blocks.data_ptr(), blocks.shape[0], k, out.data_ptr()),
           fmt, k)  # fmt: skip
    return out


def _gemm(fmt: str, blocks: torch.Tensor, rows: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """rows (M, k) @ W^T over tiles of W dequantized into one reused buffer (it stays in L2 for the GEMM)."""
    n, k = blocks.shape[0], rows.shape[1]
    out = torch.empty(rows.shape[0], n, dtype=torch.float32)
    step = max(1, GEMM_TILE_VALUES // k)
    buffer = torch.empty(min(step, n), k, dtype=torch.float32)
    lib = library()
    for first in range(0, n, step):
        tile = buffer[: min(step, n - first)]  # (rows of W, k)
        status = lib.attnlab_dequantize(FORMAT_CODES[fmt], blocks[first].data_ptr(), tile.shape[0], k, tile.data_ptr())
        _check(status, fmt, k)
        part = out[:, first : first + tile.shape[0]]  # (M, tile rows): a column slice, row stride n
        if bias is None:
            torch.mm(rows, tile.T, out=part)
        else:
            torch.addmm(bias[first : first + tile.shape[0]], rows, tile.T, out=part)
    return out


def _check(status: int, fmt: str, k: int) -> None:
    if status:
        raise ValueError(f"qmatmul.c refused format {fmt!r} with k={k} (k must be a multiple of 32)")
