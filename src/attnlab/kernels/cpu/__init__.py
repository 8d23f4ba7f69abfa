"""CPU kernels in C: decode attention read straight from quantized KV rows (qattn.c, here), matmuls with
weights kept in a GGUF file's formats (qmatmul.c, wrapped by attnlab.kernels.cpu.qmatmul) and the bounded memory's
sequential routing (routing.c, wrapped by attnlab.kernels.cpu.routing).

Each source ships with the package and is compiled on first use with the system C compiler ($CC, split into
words as make splits it: CC='ccache gcc'; else cc) for this machine (-O3 -march=native), into
`<user cache>/attnlab/kernels/` under a name that hashes the source (and the headers of this folder), the flags,
the compiler's version and the CPU's feature flags; then loaded with ctypes. Where no compiler works, `library()`
is None and callers run their PyTorch path, which the kernels are tested against. ATTNLAB_CPU_KERNELS=0 turns
them off.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from attnlab import quant
from attnlab.data.files import atomic_write_text
from attnlab.envcheck import KERNELS_OFF, KERNELS_ON, kernels_env_problem
from attnlab.errors import AttnlabWarning, ConfigError
from attnlab.paths import cache_dir

SOURCE = Path(__file__).with_name("qattn.c")
FLAGS = ("-O3", "-march=native", "-std=gnu11", "-ffp-contract=off", "-shared", "-fPIC")  # no fused a*b+c: the
# quantizer's two roundings must stay two, as in attnlab.quant
# OpenMP where the compiler has it: the library then links libgomp.so.1, which is the copy PyTorch's CPU build
# has already loaded, so the kernels share torch's threads (torch.set_num_threads); else one thread.
THREADS = (("-fopenmp",), ("-fopenmp-simd",))
FORMAT_CODES = {"fp32": 0, "fp16": 1, "bf16": 2, "q8_0": 3, "q4_0": 4, "nf4": 5}  # as qattn.c numbers them

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
_SCORES_ARGS = [ctypes.c_int, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64, _i64, _ptr, _i64, _i64, _i64, _ptr, _i64, _i64]
_SCORES_ARGS.append(ctypes.c_int)
_QUANTIZE_ARGS = [ctypes.c_int, _ptr, _i64, _i64, _i64, _i64, _i64, _ptr, _i64, _i64, _ptr, _i64, _i64, _ptr, _ptr]
_SOFTMAX_ARGS = [_ptr, _i64, _i64, _i64, _i64, _i64, ctypes.c_float]
_ATTEND_ARGS = [_ptr, _i64, _i64, _i64, _i64, _i64, _ptr, _i64, _i64, ctypes.c_float, _ptr, _i64, _ptr, _i64, _i64]
_WSUM_ARGS = [ctypes.c_int, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64, _i64, _ptr, _i64, _i64, _i64, _ptr, _i64, _i64]


def kernel_dir() -> Path:
    return cache_dir() / "kernels"


def compiler_command(variable: str, defaults: tuple[str, ...]) -> list[str] | None:
    """The compiler command $variable gives, split into words as make and the shell split it (CC='ccache gcc',
    CC='gcc -m64'), else the first of `defaults` found on the PATH; None when there is none. RuntimeError naming
    the variable when its command is not a command line or its program is not found."""
    given = os.environ.get(variable, "")
    try:
        command = shlex.split(given)
    except ValueError as e:
        raise RuntimeError(f"${variable}={given!r} is not a command line ({e}): set {variable} to a compiler, e.g. "
                           f"{variable}={defaults[1]} or {variable}='ccache {defaults[1]}'") from None  # fmt: skip
    if not command:
        found = next((path for path in map(shutil.which, defaults) if path), None)
        return [found] if found else None
    if shutil.which(command[0]) is None:
        raise RuntimeError(f"${variable}={given!r}: {command[0]} is not found: set {variable} to an installed "
                           f"compiler (with its arguments if any, e.g. {variable}='ccache {defaults[1]}')")  # fmt: skip
    return command


def _compiler() -> list[str] | None:
    return compiler_command("CC", ("cc", "gcc", "clang"))


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def build(
    directory: Path | None = None,
    extra_flags: tuple[str, ...] = (),
    source: Path = SOURCE,
    includes: tuple[Path, ...] = (),
) -> Path:
    """Compiles `source` (default qattn.c; once per source, headers, flags, compiler and CPU) and returns the shared
    library's path. Raises RuntimeError with the compiler's message when it fails. extra_flags: for tests (e.g. a
    build without AVX-512). includes: other sources of this folder that `source` #includes (fused.c includes
    qmatmul.c), hashed with it so that a change to them builds it again."""
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler found (install gcc or clang, or set CC)")
    flags = " ".join((*FLAGS, *extra_flags)).encode()

    def make(target: str, folder: str) -> None:
        for threads in THREADS:
            command = [*cc, *FLAGS, *extra_flags, *threads, "-o", target, str(source), "-lm"]
            result = subprocess.run(command, capture_output=True, text=True, check=False)
            if result.returncode == 0:
                return
        raise RuntimeError(f"{shlex.join(cc)} failed on {source.name}: {result.stderr.strip()[:2000]}")

    key = [source, *includes, flags, compiler_version(cc)]
    return cached_build(directory or kernel_dir(), source.stem, key, make)


def compiler_version(compiler: list[str]) -> bytes:
    """What `compiler --version` prints, after the command's arguments when it has any (they may change the code)."""
    version = subprocess.run([*compiler, "--version"], capture_output=True, text=True, check=False).stdout
    return (f"{shlex.join(compiler[1:])}\n" if compiler[1:] else "").encode() + version.encode()


def cached_build(directory: Path, stem: str, key_parts: list, make: Callable[[str, str], None]) -> Path:
    """The library `<stem>-<machine>-<hash>.so` in `directory`, hashing key_parts (paths are read, bytes taken as
    they are), this folder's headers and the CPU's flags; made when missing by make(target, scratch folder),
    which writes target (a temporary name, renamed into place once made: atomic). Beside it, `<name>.so.sha256`
    holds the library's sha256, checked before it is handed out: a library damaged in the cache (truncated, emptied,
    overwritten: loading one can kill the process with SIGBUS) or one without its checksum is built again over it."""
    parts = [p.read_bytes() if isinstance(p, Path) else p for p in key_parts]
    headers = [h.read_bytes() for h in sorted(SOURCE.parent.glob("*.h"))]  # what the sources may #include
    key = hashlib.sha256(b"\0".join([*parts, *headers, _cpu_flags().encode()]))
    target = directory / f"{stem}-{platform.machine()}-{key.hexdigest()[:16]}.so"
    checksum = target.with_name(target.name + ".sha256")
    if _intact(target, checksum):
        return target
    directory.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{stem}-", suffix=".so")
    os.close(fd)
    try:
        with tempfile.TemporaryDirectory(dir=directory, prefix=f".{stem}-") as scratch:
            make(tmp, scratch)
        digest = hashlib.sha256(Path(tmp).read_bytes()).hexdigest()
        os.replace(tmp, target)  # atomic: a concurrent build of the same key writes the same bytes
        atomic_write_text(checksum, digest + "\n")
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _intact(library: Path, checksum: Path) -> bool:
    """Whether `library` exists and its bytes have the sha256 that `checksum` records."""
    try:
        return checksum.read_text().strip() == hashlib.sha256(library.read_bytes()).hexdigest()
    except (OSError, UnicodeDecodeError):
        return False


def _loaded_from_cache(builder: Callable[..., Path], load: Callable[[Path], object]):
    """The cache's library, loaded; one that does not load though its checksum matches (rewritten with it: a cache
    restored from elsewhere) is deleted and built again in place, once, as one with a wrong checksum is."""
    library = builder(None)
    try:
        return load(library)
    except OSError:
        if not library.is_file():
            raise
    for stale in (library, library.with_name(library.name + ".sha256")):
        stale.unlink(missing_ok=True)
    return load(builder(None))


def _cache_problem(err: OSError) -> str:
    """The warning's line when the cache folder could not be used (the kernels were built for this run only): what
    stands in the way, and what to do about it."""
    folder = kernel_dir()
    blocked = next((p for p in (folder, *folder.parents) if p.exists() and not p.is_dir()), None)
    if blocked is not None:  # (a dangling link too: exists() follows it, is_symlink() does not)
        what = "the kernels folder" if blocked == folder else f"a folder of the kernels cache {folder}"
        return (f"{blocked} is a file, where {what} goes: delete it (or set XDG_CACHE_HOME to another cache); built "
                "for this run only")  # fmt: skip
    where = f"{err.filename}: " if err.filename and Path(err.filename) != folder else ""  # a path in it
    if isinstance(err, PermissionError) or err.errno in (errno.EROFS, errno.ENOSPC, errno.EDQUOT):
        fix = "make it writable, or set XDG_CACHE_HOME, to keep them"
    else:  # (a library that did not load even when built again)
        fix = f"delete {err.filename or folder} to build it again, or set XDG_CACHE_HOME to another cache"
    return f"cannot use the cache {folder} ({where}{err.strerror or err}): built for this run only ({fix})"


_CACHE_WARNED: set[str] = set()  # the cache-folder warnings given


def compiled(source: Path, load: Callable[[Path], object], builder: Callable[..., Path] | None = None):
    """`source` built (by `builder(folder or None)`, default `build`) and loaded by `load` (which declares its
    functions), or None: turned off, no compiler, or the build failed (warned). When the cache folder cannot be
    used (read-only, full, a file), it is built in a temporary folder, removed once loaded (warned)."""
    if turned_off():
        return None
    builder = builder or functools.partial(build, source=source)
    try:
        try:
            return _loaded_from_cache(builder, load)
        except OSError as err:
            with tempfile.TemporaryDirectory(prefix="attnlab-kernels-") as folder:
                lib = load(builder(Path(folder)))  # the loaded library outlives its file
            line = f"attnlab CPU kernels: {_cache_problem(err)}"
            if line not in _CACHE_WARNED:  # once per process, not once per kernel (qattn, qmatmul, fused ...)
                _CACHE_WARNED.add(line)
                warnings.warn(line, AttnlabWarning, stacklevel=3)
            return lib
    except (OSError, RuntimeError) as err:
        warnings.warn(f"attnlab CPU kernels unavailable, using the PyTorch path: {err}", AttnlabWarning, stacklevel=3)
        return None


OFF, ON = KERNELS_OFF, KERNELS_ON


def turned_off() -> bool:
    """Whether ATTNLAB_CPU_KERNELS turns the kernels off (0, false, no, off; unset, empty or 1, true, yes, on: on).
    ConfigError for any other value (a typo would otherwise silently mean "on")."""
    problem = kernels_env_problem()
    if problem:
        raise ConfigError(problem)
    value = os.environ.get("ATTNLAB_CPU_KERNELS", "").strip().lower()
    return value in OFF


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled qattn.c, or None (see `compiled`; warned once)."""
    return compiled(SOURCE, load)


def load(path: Path) -> ctypes.CDLL:
    """A built library (see `build`) with its functions' argument types declared."""
    lib = ctypes.CDLL(str(path))
    for name, args, result in (
        ("scores", _SCORES_ARGS, ctypes.c_int),
        ("wsum", _WSUM_ARGS, ctypes.c_int),
        ("quantize", _QUANTIZE_ARGS, ctypes.c_int),
        ("softmax", _SOFTMAX_ARGS, None),
        ("attend", _ATTEND_ARGS, ctypes.c_int),
    ):
        function = getattr(lib, f"attnlab_{name}")
        function.argtypes, function.restype = args, result
    return lib


_DISABLED = [0]  # depth of `disabled()` blocks


def available() -> bool:
    return not switched_off() and library() is not None


def switched_off() -> bool:
    """Whether a `disabled()` block is running (it switches off every kernel of this folder)."""
    return bool(_DISABLED[0])


@contextlib.contextmanager
def disabled():
    """Within this block the kernels count as unavailable (callers run their PyTorch path): for comparisons. A
    quantized cache already in static mode (inside generate's compiled step) keeps using them."""
    _DISABLED[0] += 1
    try:
        yield
    finally:
        _DISABLED[0] -= 1


def _segment(arrays: list[torch.Tensor], first: int, n: int) -> tuple[int, int, int, int]:
    """(quants pointer, scales pointer or 0, their batch strides in bytes) of rows [first, first + n) of stored
    arrays, contiguous tensors (B, slots, ...)."""
    quants = arrays[0]
    if first < 0 or first + n > quants.shape[1] or not all(a.is_contiguous() for a in arrays):
        raise ValueError(f"rows [{first}, {first + n}) must lie in contiguous arrays of {quants.shape[1]} rows")
    item = quants.element_size()
    if len(arrays) == 1:
        return quants.data_ptr() + first * quants.stride(1) * item, 0, quants.stride(0) * item, 0
    scales = arrays[1]  # uint8, like quants
    return (
        quants.data_ptr() + first * quants.stride(1),
        scales.data_ptr() + first * scales.stride(1),
        quants.stride(0),
        scales.stride(0),
    )


def _float32_rows(**tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.dtype != torch.float32 or t.stride(-1) != 1:
            raise ValueError(f"{name} must be float32 with unit last stride")


def scores(
    fmt: str, arrays: list[torch.Tensor], n: int, kv_heads: int, q: torch.Tensor, out: torch.Tensor, accumulate: bool
) -> None:
    """out[b, h, t] (+)= q[b, h] . K[b, t, h // G] for t < n, K the rows of stored arrays (the cache's layout:
    block formats [quants, scales] (uint8), float formats [rows] (their bytes as uint8, or float32 rows)); q
    (B, H, d) and out (B, H, >= n) float32 with unit last stride."""
    _float32_rows(q=q, out=out)
    quants, scales, qstride, sstride = _segment(arrays, 0, n)
    batch, heads, d = q.shape
    status = library().attnlab_scores(
        FORMAT_CODES[fmt], quants, scales, qstride, sstride, batch, n, kv_heads, d, q.data_ptr(), q.stride(0),
        q.stride(1), heads // kv_heads, out.data_ptr(), out.stride(0), out.stride(1), int(accumulate),
    )  # fmt: skip
    _check(status)


def wsum(fmt: str, arrays: list[torch.Tensor], n: int, kv_heads: int, p: torch.Tensor, out: torch.Tensor) -> None:
    """out[b, h] += sum over t < n of p[b, h, t] V[b, t, h // G], V the rows of stored arrays (as in `scores`);
    p (B, H, >= n) and out (B, H, d) float32 with unit last stride."""
    _float32_rows(p=p, out=out)
    quants, scales, qstride, sstride = _segment(arrays, 0, n)
    batch, heads, d = out.shape
    status = library().attnlab_wsum(
        FORMAT_CODES[fmt], quants, scales, qstride, sstride, batch, n, kv_heads, d, p.data_ptr(), p.stride(0),
        p.stride(1), heads // kv_heads, out.data_ptr(), out.stride(0), out.stride(1),
    )  # fmt: skip
    _check(status)


def attend(
    keys: list[tuple],
    values: list[tuple],
    kv_heads: int,
    q: torch.Tensor,
    scale: float,
    n_columns: int,
    out: torch.Tensor,
) -> None:
    """One decode step's attention in one call: out[b, h] += softmax(scale * q K^T) V, K and V given as runs of
    rows, each (fmt, arrays, first row, rows n, first score column, lo, d) (as `scores` and `wsum` take them; a
    key run with lo > 0 adds its scores to an earlier part's). q (B, H, D) and out (B, H, d_v) float32 with unit
    last stride; the runs' columns must cover 0..n_columns - 1."""
    _float32_rows(q=q, out=out)
    batch, heads = q.shape[:2]
    records = []
    for i, (fmt, arrays, first, n, column, lo, d) in enumerate((*keys, *values)):
        quants, scales, qstride, sstride = _segment(arrays, first, n)
        accumulate = int(i < len(keys) and lo > 0)  # a later part of the key rows
        # qattn.c's segment record: SEGMENT_FIELDS (10) int64 in this order
        records += (FORMAT_CODES[fmt], quants, scales, qstride, sstride, n, column, lo, d, accumulate)
    workspace = q.new_empty(batch, heads, n_columns)
    status = library().attnlab_attend(
        (ctypes.c_int64 * len(records))(*records), len(keys), len(values), batch, kv_heads, heads // kv_heads,
        q.data_ptr(), q.stride(0), q.stride(1), scale, workspace.data_ptr(), n_columns, out.data_ptr(),
        out.stride(0), out.stride(1),
    )  # fmt: skip
    _check(status)


def _check(status: int) -> None:
    if status:
        raise MemoryError("the CPU attention kernel could not allocate its row buffers")


def quantize(fmt: str, x: torch.Tensor) -> list[torch.Tensor] | None:
    """x (..., width) float32 on the CPU, width % 32 == 0 -> the cache's arrays of its q8_0 / q4_0 / nf4 blocks,
    [quants (..., width / 32, 32 | 16) uint8, fp16 scale bytes (..., width / 32, 2)], the bytes of
    attnlab.quant.quantize(x, fmt); None where that function must speak (a non-finite value, an fp16 scale
    overflow): the caller then runs it."""
    rows = x.reshape(1, -1, x.shape[-1])
    nb = x.shape[-1] // quant.BLOCK
    quants = torch.empty(1, rows.shape[1], nb, quant.block_bytes(fmt) - 2, dtype=torch.uint8)
    scales = torch.empty(1, rows.shape[1], nb, 2, dtype=torch.uint8)
    if not quantize_into(fmt, rows, [quants, scales], 0):
        return None
    return [quants.view(*x.shape[:-1], nb, -1), scales.view(*x.shape[:-1], nb, 2)]


def quantize_into(fmt: str, x: torch.Tensor, arrays: list[torch.Tensor], start: int) -> bool:
    """Quantizes rows x (B, n, width) float32 (unit last stride) into the cache's arrays [quants (B, slots, nb,
    32 | 16), scales (B, slots, nb, 2)] at slots start..start + n, as `quantize` would; False (having written
    who knows what there) where quant.quantize must name a problem."""
    quants, scales = arrays
    _float32_rows(x=x)
    status = library().attnlab_quantize(
        FORMAT_CODES[fmt], x.data_ptr(), x.shape[0], x.shape[1], x.shape[2], x.stride(0), x.stride(1),
        quants.data_ptr() + start * quants.stride(1), quants.stride(0), quants.stride(1),
        scales.data_ptr() + start * scales.stride(1), scales.stride(0), scales.stride(1),
        quant._NF4_BELOW.data_ptr(), quant._NF4_INSIDE.data_ptr(),
    )  # fmt: skip
    return status == 0


def softmax_(scores: torch.Tensor, scale: float) -> torch.Tensor:
    """scores (B, H, n) float32 (unit last stride) -> softmax(scale * scores, dim=-1), in place."""
    _float32_rows(scores=scores)
    batch, heads, n = scores.shape
    library().attnlab_softmax(scores.data_ptr(), batch, heads, n, scores.stride(0), scores.stride(1), scale)
    return scores
