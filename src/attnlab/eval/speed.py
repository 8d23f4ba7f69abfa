"""Speed and memory benchmarks over an EvalModel: cached decode latency, KV-cache and process memory.

latency  Time to first token (chunked prefill of a (B, L) prompt plus the first greedy token) and cached
         decode tokens/s, for each (prompt length, batch size), after warm-up runs: the median of repeats with
         min/max and the interquartile range. Timings are figures to record, never to assert; compare models
         as ratios measured in the same process on an otherwise idle machine.
memory   KV bytes held by a live cache at each length (`ModelCache.nbytes()`, measured from its tensors) next
         to the analytic `kv_report` figure, and the process's peak memory (ru_maxrss; on CUDA also
         torch.cuda.max_memory_allocated for that length alone).

Also the helpers the long-context benchmarks share: timing with device synchronisation and out-of-memory
detection, so a length that does not fit becomes an "oom" record instead of a crash.
"""

from __future__ import annotations

import gc
import resource
import sys
import time
from collections.abc import Callable
from functools import partial

import numpy as np
import torch

from attnlab.accounting import kv_report
from attnlab.cache.codecs import FLOAT_FORMATS, FORMAT_OF_DTYPE
from attnlab.config_memory import PRESSES
from attnlab.errors import InputError
from attnlab.eval.records import make_record
from attnlab.generate import decode_step, prefill

DTYPE_NAMES = FORMAT_OF_DTYPE  # torch.float16 -> "fp16"
TORCH_DTYPES = FLOAT_FORMATS  # "fp16" -> torch.float16
OOM_MESSAGES = ("out of memory", "not enough memory")  # CUDA / MPS and CPU allocator messages

# ----------------------------------------------------------------------------- shared helpers


def dtype_name(dtype: torch.dtype) -> str:
    """torch.float16 -> "fp16", the names `kv_report` takes."""
    if dtype not in DTYPE_NAMES:
        raise InputError(f"dtype {dtype} has no KV accounting (use one of {', '.join(TORCH_DTYPES)})")
    return DTYPE_NAMES[dtype]


def synchronize(device: torch.device) -> None:
    """Waits for queued kernels, so wall-clock time covers the work (a no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def timed(fn: Callable[[], object], device: torch.device) -> tuple[object, float]:
    """(fn(), wall-clock seconds of the call), the device synchronised before and after."""
    synchronize(device)
    start = time.perf_counter()
    out = fn()
    synchronize(device)
    return out, time.perf_counter() - start


def is_out_of_memory(error: BaseException) -> bool:
    """torch.OutOfMemoryError, MemoryError, or a RuntimeError saying the allocator ran out of memory."""
    if isinstance(error, torch.OutOfMemoryError | MemoryError):
        return True
    return isinstance(error, RuntimeError) and any(m in str(error).lower() for m in OOM_MESSAGES)


def run_guarded(fn: Callable[[], object]) -> tuple[object | None, str | None]:
    """(fn(), None), or (None, the error's first line) when fn runs out of memory; any other error propagates.
    Memory is released after the traceback (which holds the failed call's tensors) is gone."""
    try:
        return fn(), None
    except (RuntimeError, MemoryError) as error:
        if not is_out_of_memory(error):
            raise
        message = f"{type(error).__name__}: {(str(error).splitlines() or [''])[0][:300]}"
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return None, message


def spread(values: list[float], name: str) -> dict:
    """{name: values, name_median, name_min, name_max, name_q25, name_q75}."""
    array = np.asarray(values, dtype=np.float64)
    q25, median, q75 = np.percentile(array, [25, 50, 75])
    return {
        name: [float(v) for v in array], f"{name}_median": float(median), f"{name}_min": float(array.min()),
        f"{name}_max": float(array.max()), f"{name}_q25": float(q25), f"{name}_q75": float(q75),
    }  # fmt: skip


def peak_memory(device: torch.device) -> dict:
    """The process's peak resident memory so far (bytes; ru_maxrss is KiB on Linux, bytes on macOS) and, on
    CUDA, the peak allocated since the last torch.cuda.reset_peak_memory_stats."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    out = {"peak_rss_bytes": int(rss)}
    if device.type == "cuda":
        out["cuda_peak_bytes"] = int(torch.cuda.max_memory_allocated(device))
    return out


def random_prompt(vocab_size: int, batch: int, length: int, seed: int, device) -> torch.Tensor:
    """(batch, length) int64 uniform token ids, reproducible from `seed` (speed does not depend on content)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (batch, length), generator=generator).to(device)


# ----------------------------------------------------------------------------- latency


@torch.no_grad()
def time_generation(
    module, prompt: torch.Tensor, new_tokens: int, chunk_size: int, kv_policy=None
) -> tuple[float, float]:
    """prompt (B, L) -> (seconds to the first token, seconds of the new_tokens - 1 cached greedy decode steps)."""
    device = prompt.device
    cache = module.new_cache(prompt.shape[0], prompt.shape[1] + new_tokens - 1, policy=kv_policy)

    def first_token():
        return prefill(module, prompt, cache, chunk_size).argmax(dim=-1, keepdim=True)  # (B, 1)

    token, ttft = timed(first_token, device)

    def decode():
        nonlocal token
        for _ in range(new_tokens - 1):
            token = decode_step(module, token, cache).argmax(dim=-1, keepdim=True)  # (B, 1)

    _, decode_seconds = timed(decode, device)
    return ttft, decode_seconds


def run_latency(
    model,
    prompt_lengths=(128, 512, 2048),
    batch_sizes=(1,),
    new_tokens: int = 32,
    warmup: int = 1,
    repeats: int = 5,
    chunk_size: int = 512,
    seed: int = 0,
    kv_policy: str | None = None,
) -> list[dict]:
    """`latency` records, one per (prompt length, batch size): time to first token (ms) and decode tokens/s
    (all sequences of the batch; new_tokens - 1 timed steps after the first token), each as every repeat plus
    median, min, max and quartiles, after `warmup` untimed runs. Prompts whose L + new_tokens - 1 passes
    max_seq_len are too_long; out of memory is oom."""
    for name, value, least in (("new_tokens", new_tokens, 2), ("repeats", repeats, 1), ("warmup", warmup, 0)):
        if value < least:  # the one violated, not every condition
            raise InputError(f"{name}={value} must be >= {least}")
    cfg, device, n_runs = model.cfg, model.device, warmup + repeats
    rows = []
    for length in sorted(prompt_lengths):
        for batch in sorted(batch_sizes):
            common = {"prompt_length": length, "batch_size": batch, "new_tokens": new_tokens, "warmup": warmup,
                      "repeats": repeats, "chunk_size": chunk_size, "max_seq_len": cfg.max_seq_len,
                      "kv_policy": kv_policy}  # fmt: skip
            record = partial(make_record, "latency", model, **common)  # record(status=..., **figures)
            if length + new_tokens - 1 > cfg.max_seq_len:
                rows.append(record(status="too_long"))
                continue
            prompt = random_prompt(cfg.vocab_size, batch, length, seed, device)
            runs, error = run_guarded(  # warm-up runs first, then the timed repeats
                lambda p=prompt: [
                    time_generation(model.model, p, new_tokens, chunk_size, kv_policy) for _ in range(n_runs)
                ]
            )
            if error is not None:
                rows.append(record(status="oom", error=error))
                continue
            ttft_ms = [ttft * 1e3 for ttft, _ in runs[warmup:]]
            tokens_per_s = [batch * (new_tokens - 1) / seconds for _, seconds in runs[warmup:]]  # all sequences
            figures = spread(ttft_ms, "ttft_ms") | spread(tokens_per_s, "decode_tokens_per_s")
            rows.append(record(status="ok", **figures))
    return rows


# ----------------------------------------------------------------------------- memory


@torch.no_grad()
def measure_cache(module, batch: int, length: int, dtype: torch.dtype, fill: bool, chunk_size: int, seed: int,
                  kv_policy=None):  # fmt: skip
    """A live cache for (batch, length) tokens in `dtype` (quantized by `kv_policy`), filled by a chunked prefill
    of random tokens when `fill`: (bytes of the K/V tensors it holds, bytes of its slot-position bookkeeping,
    capacity)."""
    cache = module.new_cache(batch, length, dtype=dtype, policy=kv_policy)
    if fill:
        prompt = random_prompt(module.cfg.vocab_size, batch, length, seed, next(module.parameters()).device)
        prefill(module, prompt, cache, chunk_size)
    overhead = cache.overhead_nbytes()
    return cache.nbytes(), overhead, cache.layers[0].capacity


def run_memory(
    model,
    lengths=(512, 1024, 2048, 4096),
    batch_size: int = 1,
    cache_dtype: str | None = None,
    fill: bool = True,
    chunk_size: int = 512,
    seed: int = 0,
    kv_policy: str | None = None,
) -> list[dict]:
    """`memory` records, one per length: `kv_bytes` measured from a live cache holding `length` tokens for each
    of `batch_size` sequences (filled by a real prefill when `fill`), `kv_bytes_analytic` =
    batch_size * kv_report(cfg, cache_dtype, length)["kv_bytes"], whether they agree, and peak memory.
    cache_dtype: "fp32" | "fp16" | "bf16" (default the model's dtype). A bounded cache (sliding window)
    holds min(length, capacity) tokens. kv_policy: a quantized cache (attnlab.cache.quantized), its residual
    window in cache_dtype."""
    device = model.device
    name = cache_dtype or dtype_name(next(model.model.parameters()).dtype)
    if name not in TORCH_DTYPES:
        raise InputError(f"cache_dtype={name!r} is not known (use one of {', '.join(TORCH_DTYPES)})")
    rows = []
    for length in sorted(lengths):
        common = {"length": length, "batch_size": batch_size, "cache_dtype": name, "filled": fill,
                  "max_seq_len": model.cfg.max_seq_len, "kv_policy": kv_policy}  # fmt: skip
        record = partial(make_record, "memory", model, **common)  # record(status=..., **figures)
        if length > model.cfg.max_seq_len:
            rows.append(record(status="too_long"))
            continue
        analytic = kv_report(model.cfg, name, length, kv_policy)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        measured, error = run_guarded(
            lambda n=length: measure_cache(
                model.model, batch_size, n, TORCH_DTYPES[name], fill, chunk_size, seed, kv_policy
            )
        )
        if error is not None:
            rows.append(record(status="oom", error=error, **peak_memory(device)))
            continue
        kv_bytes, overhead, capacity = measured
        expected = batch_size * analytic["kv_bytes"]
        held = length if capacity is None else min(length, capacity)
        if model.cfg.memory.kind in PRESSES and model.cfg.memory.press_at == "decode":  # a ratio has no capacity
            held = analytic["memory"]["held_tokens"]
        rows.append(record(
            status="ok", kv_bytes=kv_bytes, kv_bytes_analytic=expected, kv_matches_analytic=kv_bytes == expected,
            kv_bytes_per_token=analytic["kv_bytes_per_token"], cache_overhead_bytes=overhead, capacity=capacity,
            held_tokens=held, **peak_memory(device),
        ))  # fmt: skip
    return rows
