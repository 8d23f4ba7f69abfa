"""CPU kernels in C (qattn.c): decode attention read straight from quantized KV rows.

The source ships with the package and is compiled on first use with the system C compiler ($CC, else cc)
for this machine (-O3 -march=native), into `<user cache>/attnlab/kernels/` under a name that hashes the
source, the flags, the compiler's version and the CPU's feature flags; then loaded with ctypes. Where no
compiler works, `library()` is None and callers run their PyTorch path, which the kernels are tested
against. ATTNLAB_CPU_KERNELS=0 turns them off.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch

from attnlab.paths import data_dirs

SOURCE = Path(__file__).with_name("qattn.c")
FLAGS = ("-O3", "-march=native", "-std=gnu11", "-ffp-contract=off", "-shared", "-fPIC")  # no fused a*b+c: the
# quantizer's two roundings must stay two, as in attnlab.quant
# OpenMP where the compiler has it: the library then links libgomp.so.1, which is the copy PyTorch's CPU build
# has already loaded, so the kernels share torch's threads (torch.set_num_threads); else one thread.
THREADS = (("-fopenmp",), ("-fopenmp-simd",))
FORMAT_CODES = {"fp32": 0, "fp16": 1, "bf16": 2, "q8_0": 3, "q4_0": 4, "nf4": 5}  # as qattn.c numbers them
MAX_WIDTH = 4096  # values in a K/V row (H_kv * d), qattn.c's MAX_WIDTH

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
_SCORES_ARGS = [ctypes.c_int, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64, _i64, _ptr, _i64, _i64, _i64, _ptr, _i64, _i64]
_SCORES_ARGS.append(ctypes.c_int)
_QUANTIZE_ARGS = [ctypes.c_int, _ptr, _i64, _i64, _i64, _ptr, _ptr, _ptr, _ptr]
_WSUM_ARGS = [ctypes.c_int, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64, _i64, _ptr, _i64, _i64, _i64, _ptr, _i64, _i64]


def kernel_dir() -> Path:
    return data_dirs(None)[-1] / "kernels"


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def build(directory: Path | None = None, extra_flags: tuple[str, ...] = ()) -> Path:
    """Compiles qattn.c (once per source, flags, compiler and CPU) and returns the shared library's path.
    Raises RuntimeError with the compiler's message when it fails. extra_flags: for tests (e.g. a build
    without AVX-512)."""
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler found (install gcc or clang, or set CC)")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=False).stdout
    source = SOURCE.read_bytes()
    flags = " ".join((*FLAGS, *extra_flags)).encode()
    key = hashlib.sha256(b"\0".join([source, flags, version.encode(), _cpu_flags().encode()]))
    directory = directory or kernel_dir()
    target = directory / f"qattn-{platform.machine()}-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    directory.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".qattn-", suffix=".so")
    os.close(fd)
    try:
        for threads in THREADS:
            command = [cc, *FLAGS, *extra_flags, *threads, "-o", tmp, str(SOURCE), "-lm"]
            result = subprocess.run(command, capture_output=True, text=True, check=False)
            if result.returncode == 0:
                break
        else:
            raise RuntimeError(f"{cc} failed on {SOURCE.name}: {result.stderr.strip()[:2000]}")
        os.replace(tmp, target)  # atomic: a concurrent build of the same key writes the same bytes
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled kernels, or None (turned off, no compiler, or the build failed: warned once)."""
    if os.environ.get("ATTNLAB_CPU_KERNELS", "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    try:
        lib = ctypes.CDLL(str(build()))
    except (OSError, RuntimeError) as err:
        warnings.warn(f"attnlab CPU kernels unavailable, using the PyTorch path: {err}", stacklevel=2)
        return None
    lib.attnlab_scores.argtypes, lib.attnlab_scores.restype = _SCORES_ARGS, ctypes.c_int
    lib.attnlab_wsum.argtypes, lib.attnlab_wsum.restype = _WSUM_ARGS, ctypes.c_int
    lib.attnlab_quantize.argtypes, lib.attnlab_quantize.restype = _QUANTIZE_ARGS, ctypes.c_int
    return lib


def available() -> bool:
    return library() is not None


def _segment(arrays: list[torch.Tensor], fmt: str, n: int) -> tuple[int, int, int, int]:
    """(quants pointer, scales pointer or 0, their batch strides in bytes) of rows [0, n) of stored arrays."""
    quants = arrays[0]
    scales = arrays[1] if len(arrays) > 1 else None
    if quants.shape[1] < n or not quants[0, :n].is_contiguous():
        raise ValueError("kernel rows must be contiguous within each sequence")
    item = quants.element_size()
    return (
        quants.data_ptr(),
        0 if scales is None else scales.data_ptr(),
        quants.stride(0) * item,
        0 if scales is None else scales.stride(0) * scales.element_size(),
    )


def scores(
    fmt: str, arrays: list[torch.Tensor], n: int, kv_heads: int, q: torch.Tensor, out: torch.Tensor, accumulate: bool
) -> None:
    """out[b, h, :n] (+)= q[b, h] . K[b, t, h // G] for the first n rows of stored arrays (the cache's layout:
    block formats [quants, scales], float formats [row bytes]); q (B, H, d) and out (B, H, >= n) float32 with
    unit last stride."""
    if n == 0:
        return
    quants, scales, qstride, sstride = _segment(arrays, fmt, n)
    batch, heads, d = q.shape
    assert q.stride(2) == 1 and out.stride(2) == 1 and q.dtype == out.dtype == torch.float32
    status = library().attnlab_scores(
        FORMAT_CODES[fmt], quants, scales, qstride, sstride, batch, n, kv_heads, d,
        q.data_ptr(), q.stride(0), q.stride(1), heads // kv_heads, out.data_ptr(), out.stride(0), out.stride(1),
        int(accumulate),
    )  # fmt: skip
    _check(status, kv_heads * d)


def wsum(fmt: str, arrays: list[torch.Tensor], n: int, kv_heads: int, p: torch.Tensor, out: torch.Tensor) -> None:
    """out[b, h] += sum over the first n stored rows of p[b, h, t] V[b, t, h // G]; p (B, H, >= n) and
    out (B, H, d) float32 with unit last stride."""
    if n == 0:
        return
    quants, scales, qstride, sstride = _segment(arrays, fmt, n)
    batch, heads, d = out.shape
    assert p.stride(2) == 1 and out.stride(2) == 1 and p.dtype == out.dtype == torch.float32
    status = library().attnlab_wsum(
        FORMAT_CODES[fmt], quants, scales, qstride, sstride, batch, n, kv_heads, d,
        p.data_ptr(), p.stride(0), p.stride(1), heads // kv_heads, out.data_ptr(), out.stride(0), out.stride(1),
    )  # fmt: skip
    _check(status, kv_heads * d)


def _check(status: int, width: int) -> None:
    if status == -1:
        raise ValueError(f"rows of {width} values exceed the kernel's {MAX_WIDTH}")
    if status:
        raise MemoryError("the CPU attention kernel could not allocate its row buffers")


def quantize(fmt: str, x: torch.Tensor) -> list[torch.Tensor] | None:
    """x (..., width) float32 on the CPU, width % 32 == 0 -> the cache's arrays of its q8_0 / q4_0 / nf4 blocks,
    [quants (..., width / 32, 32 | 16) uint8, fp16 scale bytes (..., width / 32, 2)], the bytes of
    attnlab.quant.quantize(x, fmt); None where that function must speak (a non-finite value, an fp16 scale
    overflow): the caller then runs it."""
    from attnlab import quant

    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    nb = x.shape[-1] // quant.BLOCK
    quants = torch.empty(*x.shape[:-1], nb, quant.block_bytes(fmt) - 2, dtype=torch.uint8)
    scales = torch.empty(*x.shape[:-1], nb, 2, dtype=torch.uint8)
    below, inside = quant._NF4_BELOW, quant._NF4_INSIDE
    status = library().attnlab_quantize(
        FORMAT_CODES[fmt], rows.data_ptr(), rows.shape[0], rows.shape[1], rows.stride(0), quants.data_ptr(),
        scales.data_ptr(), below.data_ptr(), inside.data_ptr(),
    )  # fmt: skip
    return None if status else [quants, scales]
