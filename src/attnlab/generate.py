"""Generation, gpt-fast style: chunked prefill, then one cached decode step per token."""

from __future__ import annotations

import functools
import math
import operator
import os
import tempfile
import time
import warnings
import weakref
from collections.abc import Iterable, Sequence

import torch

from attnlab.cache.base import ModelCache
from attnlab.cache.codecs import KVPolicy, as_policy, policy_type_problem
from attnlab.config_memory import PRESSES
from attnlab.errors import AttnlabWarning, InputError, LengthWarning, UnquantizedWarning, given
from attnlab.model.fused import FusedDecode, fused_problem

# Inductor options of the compiled decode step, measured on bench/decode.py's model (per step):
# cpp_wrapper calls the step's kernels from C++, not Python (293 -> 239 µs, 1 thread); decompose_mm_pass
# turns one-token matmuls (M = 1, weights up to 2048 wide) into reductions fused with their neighbours, not
# BLAS calls (-15%); cpp.threads 1 keeps the generated kernels single-threaded: their OpenMP regions are
# too small to gain from a second thread (2 threads: 260-275 -> 217-222 µs). Calls to torch's kernels
# (the LM head's matmul) still use torch's threads. Inductor's `freezing` gave nothing, and it would bake
# the weights into the step. compile_threads 1 compiles in this process: a pool of compiling processes took
# a core for seconds after the compile (SmolLM2-135M decoded 10-40x slower meanwhile) and saves nothing on
# one region.
COMPILE_OPTIONS: dict = {
    "cpp_wrapper": True,
    "post_grad_fusion_options": {"decompose_mm_pass": {}},
    "cpp.threads": 1,
    "compile_threads": 1,
}
RECOMPILE_LIMIT = 32  # compiled graphs of a model's block region (kinds of block, batch sizes); beyond it, eager
# generate(compile=None) decodes eagerly first and compiles once the tokens left pay for it: when
#   tokens left x eager seconds per token x COMPILE_SAVES > COMPILE_SECONDS.
# Measured by bench/compile_cost.py on SmolLM2-135M (2 threads, this machine): compiling its block region cold
# (an empty inductor cache) takes 13-17 s and importing inductor 1 s more, warm 3-4 s; a compiled step takes
# 0.73x the eager step's time with the GGUF's own weights, 0.77x with fp32 weights (0.3-0.5x on bench/decode.py's
# small models, where Python's overhead is all there is).
COMPILE_SECONDS = 20.0
COMPILE_SAVES = 0.25
EAGER_STEPS_TIMED = 3  # eager steps timed before deciding (the first one is left out: it warms up)


@torch.no_grad()
def prefill(model, tokens: torch.Tensor, cache: ModelCache, chunk_size: int = 512) -> torch.Tensor:
    """Feeds tokens (B, T) into the cache `chunk_size` at a time; returns the last position's logits (B, V)."""
    logits = None
    for start in range(0, tokens.shape[1], chunk_size):
        logits, cache = model(tokens[:, start : start + chunk_size], cache=cache)
    return logits[:, -1]


@torch.no_grad()
def decode_step(model, token: torch.Tensor, cache: ModelCache) -> torch.Tensor:
    """token: (B, 1) -> next-token logits (B, V)."""
    logits, _ = model(token, cache=cache)
    return logits[:, -1]


@torch.no_grad()
def prefill_last(model, tokens: torch.Tensor, cache: ModelCache, chunk_size: int = 512) -> torch.Tensor:
    """`prefill` through `model.forward_at`, with the LM head on each chunk's last position only (all that
    generating needs): the last position's logits (B, V). A dense cache may be in either mode; a quantized
    cache must not be in static mode (it takes one token per step there)."""
    logits = None
    for start in range(0, tokens.shape[1], chunk_size):
        chunk = tokens[:, start : start + chunk_size]  # (B, T)
        positions = torch.arange(cache.seen, cache.seen + chunk.shape[1], device=tokens.device)
        logits = model.forward_at(chunk, positions, cache.layers, last_only=True)
        cache.seen += chunk.shape[1]
    return logits[:, -1]


def static_decode_step(
    model, token: torch.Tensor, positions: torch.Tensor, layer_caches: list, run_block=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """token (B, 1) at positions (1,) through static-mode layer caches -> (next-token logits (B, V), their
    argmax (B, 1), the greedy choice, computed inside the step rather than by the caller).

    Every input keeps its identity and shape from step to step and no Python counter is read, so each block
    compiles once (run_block: see `RegionalStep`). The caller advances `cache.seen`."""
    logits = model.forward_at(token, positions, layer_caches, run_block=run_block)[:, -1]
    return logits, logits.argmax(dim=-1, keepdim=True)


def static_decode_supported(model, cache) -> bool:
    """Whether `model` and `cache` can run `static_decode_step` (dense caches and quantized caches the C
    kernels read; not ring buffers)."""
    return isinstance(cache, ModelCache) and cache.supports_static()


def _block_region(block, x: torch.Tensor, positions: torch.Tensor, cache) -> torch.Tensor:
    """One block of a decode step: the region that is compiled."""
    return block(x, positions, cache)[0]


class RegionalStep:
    """`static_decode_step` with each block run through one compiled region (regional compilation): blocks of
    the same kind share one compiled graph, whatever their layer (parameters and caches are its inputs), and the
    graph's sizes are symbolic (dynamic=True), so a new cache length or prompt length compiles nothing; a new
    batch size or kind of block compiles once more. The embedding, the final norm, the LM head and the argmax
    run eagerly (a few large ops). Compiling one block of SmolLM2-135M takes about 20 s cold, where the whole
    step as one graph took 60-85 s (and again for every cache size).

    Beyond RECOMPILE_LIMIT graphs for this model the blocks run eagerly (same tokens, slower), with a warning:
    the limit is met before a block runs, so no block runs twice."""

    def __init__(self):
        self.region = torch.compile(
            _block_region,
            fullgraph=True,
            dynamic=True,
            options=COMPILE_OPTIONS,
            recompile_limit=RECOMPILE_LIMIT,
            isolate_recompiles=True,
        )
        self.eager = False
        self.compiled = False  # whether a region has run compiled (a later step compiles nothing new)

    def run_block(self, block, x: torch.Tensor, positions: torch.Tensor, cache) -> torch.Tensor:
        if not self.eager:
            try:
                x = self.region(block, x, positions, cache)
                self.compiled = True
                return x
            except torch._dynamo.exc.FailOnRecompileLimitHit:  # raised before the block runs
                self.eager = True
                warnings.warn(
                    f"the compiled decode step reached {RECOMPILE_LIMIT} graphs for this model: decoding eagerly "
                    "(same tokens, slower)",
                    stacklevel=4,
                )
        return _block_region(block, x, positions, cache)

    def __call__(self, model, token, positions, layer_caches):
        return static_decode_step(model, token, positions, layer_caches, run_block=self.run_block)


_COMPILED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its RegionalStep


def compiled_decode_step(model) -> RegionalStep:
    """The compiled static decode step of `model` (see RegionalStep), made once per model."""
    step = _COMPILED.get(model)
    if step is None:
        step = _COMPILED[model] = RegionalStep()
    return step


def compiling_pays(eager_seconds: float, tokens_left: int) -> bool:
    """Whether compiling the decode step is expected to save more time than it takes (see COMPILE_SECONDS)."""
    return tokens_left * eager_seconds * COMPILE_SAVES > COMPILE_SECONDS


@functools.cache
def can_compile_on_cpu() -> bool:
    """Whether inductor finds a C++ compiler (compiled CPU code needs one) and a cache folder it may write (when
    it may not, decoding is eager, and an AttnlabWarning says so once)."""
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler  # importing inductor makes its cache folder
        from torch._inductor.runtime.cache_dir_utils import cache_dir

        get_cpp_compiler()
        tempfile.TemporaryDirectory(dir=cache_dir()).cleanup()
    except RuntimeError:
        return False
    except OSError as e:
        where = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or e.filename  # cache_dir() sets it before it makes it
        warnings.warn(f"torch.compile's cache {where}: {e.strerror or e}: decoding without compiling (slower; set "
                      "TORCHINDUCTOR_CACHE_DIR to a folder you may write)", AttnlabWarning, stacklevel=2)  # fmt: skip
        return False
    return True


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


MAX_SEED = 2**64 - 1  # torch.Generator.manual_seed takes 0 .. 2**64 - 1


def _whole(value) -> int | None:
    """`value` as an int if it is a whole number (not a bool, not a float), else None."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def _real(value) -> float | None:
    """`value` as a float if it is a number (not a bool or a string), else None."""
    if isinstance(value, (bool, str, bytes)):
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def check_sampling(max_new_tokens=32, temperature=0.0, top_k=None, top_p=None, seed=None, prefill_chunk=512) -> None:
    """Raises InputError naming every argument of `generate` that cannot be used, with its value and the
    values it may take: max_new_tokens a whole number >= 0, temperature a finite number >= 0, top_k a whole
    number >= 1 (or None), top_p in (0, 1] (or None), seed 0 .. 2**64 - 1 (or None), prefill_chunk >= 1."""
    problems = []
    n = _whole(max_new_tokens)
    if n is None or n < 0:
        problems.append(f"max_new_tokens={max_new_tokens!r} must be a whole number >= 0 (0 generates nothing)")
    t = _real(temperature)
    if t is None or not math.isfinite(t) or t < 0:
        problems.append(f"temperature={temperature!r} must be a finite number >= 0 (0 = greedy, 1 = sample the "
                        "model's distribution as it is)")  # fmt: skip
    k = None if top_k is None else _whole(top_k)
    if top_k is not None and (k is None or k < 1):
        problems.append(f"top_k={top_k!r} must be a whole number >= 1: the k most likely tokens are kept (leave it "
                        "out to keep every token)")  # fmt: skip
    p = None if top_p is None else _real(top_p)
    if top_p is not None and (p is None or not 0 < p <= 1):  # NaN fails the comparison too
        problems.append(f"top_p={top_p!r} must be in (0, 1]: the most likely tokens whose probabilities add up to "
                        "top_p are kept (1, or leaving it out, keeps every token)")  # fmt: skip
    s = None if seed is None else _whole(seed)
    if seed is not None and (s is None or not 0 <= s <= MAX_SEED):
        problems.append(f"seed={seed!r} must be a whole number from 0 to 2**64 - 1")
    c = _whole(prefill_chunk)
    if c is None or c < 1:
        problems.append(f"prefill_chunk={prefill_chunk!r} must be a whole number >= 1")
    if problems:
        raise InputError("; ".join(problems))


def greedy_ignores(temperature, top_k=None, top_p=None, seed=None) -> dict:
    """The sampling arguments given (top_k, top_p, seed not None) with temperature 0, which is greedy: they would
    change nothing, and the same text whatever they say would pass for a sample. generate() refuses them (the
    CLI's --top-k, --top-p and --seed too); lm-eval's tasks may hold them beside do_sample: false and are not
    checked here."""
    if _real(temperature) != 0:
        return {}
    return {name: value for name, value in (("top_k", top_k), ("top_p", top_p), ("seed", seed)) if value is not None}


def greedy_problem(temperature, top_k=None, top_p=None, seed=None, flags: bool = False) -> str | None:
    """The one line for sampling arguments given to a greedy generate (greedy_ignores), or None; `flags` names them
    as the CLI's flags (--top-k 40) rather than as the API's arguments (top_k=40)."""
    ignored = greedy_ignores(temperature, top_k, top_p, seed)
    if not ignored:
        return None
    if flags:
        given = ", ".join(f"--{name.replace('_', '-')} {value}" for name, value in ignored.items())
        setting, temp = "--temperature", f"--temperature {temperature:g}"
    else:
        given = ", ".join(f"{name}={value!r}" for name, value in ignored.items())
        setting, temp = "temperature", f"temperature={temperature!r}"
    applies = "applies" if len(ignored) == 1 else "apply"
    return (
        f"{given} only {applies} when sampling: give {setting} > 0 too ({temp} is greedy: the most likely token "
        "every time, nothing is sampled)"
    )


def sample(logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float | None, generator) -> torch.Tensor:
    """logits (B, V) -> next tokens (B, 1). temperature 0 is greedy (argmax)."""
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    # In float64 (a temperature such as 1e-300 is 0 in float32), shifted so the largest is 0 before dividing: a
    # tiny temperature then gives -inf elsewhere, never inf - inf = nan, and sampling tends to greedy.
    logits = logits.double()
    logits = (logits - logits.max(dim=-1, keepdim=True).values) / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative - sorted_logits.softmax(dim=-1) >= top_p  # keep the smallest set reaching top_p
        drop[:, 0] = False  # the most likely token always stays (a top_p below its probability keeps it alone)
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator)


def room_problem(cfg, length: int, max_new_tokens: int, held: int = 0) -> str | None:
    """Why a prompt of `length` tokens (after `held` cached ones) leaves no room to generate within cfg.max_seq_len,
    or None (a bounded memory streams past it: always room). Said by generate, and by a caller before its warnings
    about the prompt, so that a command ends in the one line."""
    if cfg.memory.kind != "none":
        return None
    room = cfg.max_seq_len - held - length
    if room < 0 or (room == 0 and max_new_tokens > 0):
        after = f" after the cache's {held}" if held else ""
        return (f"prompt of {length} tokens{after} leaves no room to generate: max_seq_len={cfg.max_seq_len} "
                "(shorten the prompt or raise max_seq_len)")  # fmt: skip
    return None


IDS = "give token ids (an integer tensor or a list of ints)"


def check_options(kv_policy=None, stop_tokens=(), fused=None, compile=None, callback=None) -> list[int]:
    """Raises InputError naming every one of generate's kv_policy (None, a policy string or a KVPolicy), stop_tokens
    (token ids: a list, tuple or 1-D tensor of whole numbers), fused and compile (True, False or None: a string such
    as 'false' or a 0 would read as another choice) and callback (None or callable) that cannot be used; returns the
    stop token ids."""
    problems, stop = [], []
    problem = policy_type_problem(kv_policy, "kv_policy=")
    if problem:
        problems.append(problem)
    values = None
    if isinstance(stop_tokens, torch.Tensor) and stop_tokens.dim() <= 1:
        values = stop_tokens.reshape(-1).tolist()
    elif isinstance(stop_tokens, Iterable) and not isinstance(stop_tokens, (str, bytes, dict)):
        values = list(stop_tokens)
    stop = [] if values is None else [_whole(v) for v in values]
    if values is None or any(v is None for v in stop):
        problems.append(f"stop_tokens={stop_tokens!r} must be a list of token ids (whole numbers, e.g. [2])")
    if fused is not None and not isinstance(fused, bool):
        problems.append(f"fused={fused!r} must be True, False or None (auto: the fused step where it applies)")
    if compile is not None and not isinstance(compile, bool):
        problems.append(f"compile={compile!r} must be True, False or None (auto: compile when the tokens pay for it)")
    if callback is not None and not callable(callback):
        problems.append(f"callback must be callable (called with each new token) or None, got {given(callback)}")
    if problems:
        raise InputError("; ".join(problems))
    return stop


def nan_logits(model, where: str) -> str:
    """The refusal of NaN logits `where` (e.g. "at new token 3"): the model's activations overflow, or NaN within it."""
    dtype = next(model.parameters()).dtype
    low = dtype in (torch.float16, torch.bfloat16)
    name = str(dtype).removeprefix("torch.")
    fix = f"a {name} model's activations overflow: load it with dtype=torch.float32" if low else "they overflow"
    return (f"the model's logits are NaN {where} ({fix}; check the checkpoint: its weights may be "
            "far too large or diverged)")  # fmt: skip


def refuse_nan_logits(model, logits: torch.Tensor, where: str) -> None:
    """InputError (`nan_logits`) when `logits` hold a NaN or +inf (either makes every score from them NaN: a loss,
    a log-likelihood, an argmax that reads NaN as the largest). One reduction, a small part of the forward's cost."""
    if not math.isfinite(logits.max().item()):
        raise InputError(nan_logits(model, where))


def prompt_ids(prompt, device) -> torch.Tensor:
    """generate's prompt as an int64 tensor on `device`. InputError (one line) for values that are no token ids
    (floats, bools, text: never truncated or read as 0/1) and for a batch of rows of different lengths. An empty
    prompt has no values to be of the wrong type (torch.tensor([]), an empty text's ids, is float32)."""
    if isinstance(prompt, torch.Tensor):
        if prompt.numel() and (prompt.is_floating_point() or prompt.is_complex() or prompt.dtype == torch.bool):
            raise InputError(f"prompt is a {prompt.dtype} tensor: {IDS}")
        if prompt.device.type == "meta" and device.type != "meta":  # (shapes only: no ids to copy)
            raise InputError(f"prompt is on device meta; the model is on {device}: give a tensor of token ids (on "
                             f"{device}, or any device holding values)")  # fmt: skip
        return prompt.to(device=device, dtype=torch.long)
    text = "; text goes through the model's tokenizer first (tokenizer.encode(text))"
    if isinstance(prompt, (str, bytes)):
        raise InputError(f"prompt is a {type(prompt).__name__}: {IDS}{text}")
    try:
        tokens = torch.as_tensor(prompt)
    except (TypeError, ValueError, RuntimeError, OverflowError) as e:
        rows = list(prompt) if isinstance(prompt, Sequence) else []
        nested = [isinstance(row, Sequence) and not isinstance(row, (str, bytes)) for row in rows]
        values = [x for row, n in zip(rows, nested, strict=True) for x in (row if n else [row])]
        words = [x for x in values if isinstance(x, (str, bytes))]
        if words:
            raise InputError(f"prompt holds a {type(words[0]).__name__} ({words[0]!r}): {IDS}{text}") from None
        if rows and all(nested):
            lengths = [len(row) for row in rows]
            shown = ", ".join(map(str, lengths[:-1])) + f" and {lengths[-1]}" if len(lengths) > 1 else str(lengths)
            raise InputError(f"prompt rows have lengths {shown}: a batch needs rows of one length (generate them one "
                             "at a time, or pad)") from None  # fmt: skip
        if any(nested):
            raise InputError(f"prompt mixes ids and lists: {IDS}, or a list of rows of ids") from None
        raise InputError(f"prompt cannot be read as token ids ({' '.join(str(e).split())[:200]}): {IDS}") from None
    if tokens.numel() and (tokens.is_floating_point() or tokens.is_complex() or tokens.dtype == torch.bool):
        values = tokens.flatten()
        odd = values[values != values.round()] if tokens.is_floating_point() else values
        kind = "bool" if tokens.dtype == torch.bool else "float" if tokens.is_floating_point() else "complex"
        example = (odd if odd.numel() else values)[0].item()
        example = repr(float(f"{example:.6g}")) if isinstance(example, float) else repr(example)  # 1.0, not 1
        given = getattr(prompt, "dtype", None)  # a numpy array's (a list's values have none)
        given = f", dtype {given}" if given is not None else ""
        raise InputError(f"prompt holds {kind} values (e.g. {example}{given}): token ids are integers, e.g. [1, 2]: "
                         f"{IDS}")  # fmt: skip
    return tokens.to(device=device, dtype=torch.long)


@torch.no_grad()
def generate(
    model,
    prompt: Sequence[int] | torch.Tensor,
    max_new_tokens: int = 32,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    stop_tokens: Sequence[int] = (),
    seed: int | None = None,
    prefill_chunk: int = 512,
    kv_policy=None,
    cache: ModelCache | None = None,
    compile: bool | None = None,
    callback=None,
    fused: bool | None = None,
) -> torch.Tensor:
    """Continues prompt(s): a list of ids or a (T,) / (B, T) tensor. Returns the new tokens, (N,) or (B, N).

    Greedy when temperature is 0 (top_k, top_p and seed then change nothing: given, they are refused, InputError;
    see `greedy_ignores`). Stops once every sequence has produced a stop token (the stop token
    is included) or after max_new_tokens. `seed` makes sampling reproducible. `kv_policy` (a KVPolicy or
    a string such as "k=q8_0,v=q4_0,resid=128") stores the KV cache quantized; a K or V value its block format
    cannot store (not finite, or beyond its fp16 scale) raises InputError (attnlab.cache.codecs.KVValueError) naming
    the layer and the policy, from the fused step as from the eager one. The layers before that one have then stored
    the token: generate's own cache is dropped with the error, and a given `cache` is left unusable. Bad arguments raise
    InputError (see `check_sampling`): temperature finite and >= 0, top_k >= 1, top_p in (0, 1],
    max_new_tokens >= 0 (0 returns no tokens), seed 0 .. 2**64 - 1.

    Length: a model without a memory (memory.kind none) reads at most max_seq_len tokens, and the prompt
    (after what a given cache holds) and the new tokens stay within it. A prompt that leaves no room raises
    InputError; a max_new_tokens beyond the room left generates what fits and warns (a LengthWarning,
    attnlab.errors, naming the prompt's length, the room and max_seq_len; turn it into an error with
    warnings.simplefilter("error", LengthWarning)). A model with a memory streams past max_seq_len: no limit.

    A model whose memory is a press applied at prefill (snapkv, tova or knorm with press_at prefill, kvpress's
    setting) prefills a new cache's prompt as one chunk, whatever prefill_chunk says: such a press compresses the
    first chunk once, so chunks would leave the rest of the prompt unpressed.

    `cache` continues a cache that already holds `cache.seen` tokens (e.g. a loaded memory state,
    attnlab.memory) instead of starting a new one: the prompt follows those tokens, and the cache is updated
    in place (pass a copy to keep the original).

    compile: decode through a `torch.compile`d step, each block one compiled region (`RegionalStep`; same
    tokens, 1.1-3x faster per token on CPU). True compiles before the first decode step (once per model and
    batch size: about 20 s for SmolLM2-135M with an empty inductor cache, 3 s with a warm one). None (auto, on
    CPU when a C++ compiler is found) uses a step this model has compiled already; otherwise it decodes
    eagerly, times a few steps, and compiles only when the tokens left pay for it (`compiling_pays`), so a
    short generation never waits for a compiler. False never compiles. Caches without a static mode (the
    sliding window's ring buffer, bounded memories, quantized caches the C kernels cannot read, e.g. KIVI)
    and a given `cache` decode eagerly either way; a quantized cache's attention is one opaque op inside the
    compiled region.
    fused: decode each token in one C call through the whole model (attnlab.model.fused: batch 1, attention mha,
    decoupled (not rope_semantic or null_attn) or MLA (absorbed), SwiGLU, RMSNorm, every linear layer packed for
    8-bit activations or float32 / fp16 weights, a new dense float32 cache or a quantized one of per-token formats:
    fp16, q8_0, q4_0, ...): faster than the compiled step and nothing to compile. Its logits are the eager step's up
    to float32 rounding, which the 8-bit activations' rounding amplifies as it does any change of summation order
    (the compiled step's too): greedy tokens may then differ where the two best logits nearly tie
    (tests/test_fused_decode.py, test_fused_variants.py). None (auto) uses it where it applies (`fused_problem`;
    ATTNLAB_CPU_KERNELS=0 turns it off), `compile` then changes nothing; True requires it (InputError naming why it
    does not apply); False never uses it.
    callback(tokens (B, 1)) is called with each new token as soon as it is chosen.
    """
    if not hasattr(getattr(model, "cfg", None), "max_seq_len") or not callable(getattr(model, "new_cache", None)):
        raise InputError(f"model must be an attnlab model (from attnlab.load_model or build_model), got "
                         f"{type(model).__name__}")  # fmt: skip
    check_sampling(max_new_tokens, temperature, top_k, top_p, seed, prefill_chunk)
    stop_ids = check_options(kv_policy, stop_tokens, fused, compile, callback)
    problem = greedy_problem(temperature, top_k, top_p, seed)
    if problem:
        raise InputError(problem)
    max_new_tokens = operator.index(max_new_tokens)
    top_k = None if top_k is None else operator.index(top_k)
    seed = None if seed is None else operator.index(seed)
    cfg = model.cfg
    device = next(model.parameters()).device
    tokens = prompt_ids(prompt, device)
    single = tokens.dim() == 1
    tokens = tokens[None] if single else tokens
    if tokens.dim() != 2:
        raise InputError(f"prompt has shape {tuple(tokens.shape)}: give a list of ids or a (T,) or (B, T) tensor")
    if tokens.shape[0] == 0:  # (a (0, T) tensor: no sequence to continue)
        raise InputError(f"prompt has shape {tuple(tokens.shape)}, a batch of no prompts: give at least one")
    if tokens.shape[1] == 0:
        raise InputError("prompt is empty: give at least one token (text to continue, or a BOS token)")
    low, high = int(tokens.min()), int(tokens.max())
    if low < 0 or high >= cfg.vocab_size:
        raise InputError(f"prompt token ids must be in 0 .. {cfg.vocab_size - 1} (vocab_size={cfg.vocab_size}), got "
                         f"{low if low < 0 else high}")  # fmt: skip
    outside = [t for t in stop_ids if not 0 <= t < cfg.vocab_size]  # (would never stop the generation)
    if outside:
        raise InputError(f"stop_tokens {outside} are not token ids of this model (0 .. {cfg.vocab_size - 1}): give "
                         "ids of its vocabulary")  # fmt: skip
    if cache is not None and kv_policy is not None:
        raise InputError("kv_policy chooses how a new cache is stored: it does not apply to a given cache")
    held = cache.seen if cache is not None else 0
    streams = cfg.memory.kind != "none"  # a bounded memory reads streams of any length: no limit
    if not streams:
        # The prompt and what follows it stay within max_seq_len (the last new token is never fed).
        room = cfg.max_seq_len - held - tokens.shape[1]
        after = f" after the cache's {held}" if held else ""
        problem = room_problem(cfg, tokens.shape[1], max_new_tokens, held)
        if problem:
            raise InputError(problem)
        if max_new_tokens > room:
            # Produce what fits and say so (warnings.simplefilter("error", LengthWarning) makes it an error).
            # stacklevel 3: the caller of generate, past torch.no_grad's wrapper.
            warnings.warn(
                f"the prompt of {_count(tokens.shape[1], 'token')}{after} leaves room for {_count(room, 'new token')} "
                f"of the max_new_tokens={max_new_tokens} asked (max_seq_len {cfg.max_seq_len}): generating {room}",
                LengthWarning,
                stacklevel=3,
            )
            max_new_tokens = room
    if max_new_tokens == 0 and cache is None:  # nothing to generate (a given cache still reads the prompt)
        empty = tokens.new_zeros(tokens.shape[0], 0)
        return empty[0] if single else empty
    generator = torch.Generator(device=device).manual_seed(seed) if seed is not None else None
    was_training = model.training
    if was_training:
        model.eval()
    if compile is None:  # auto: compile once the tokens left pay for it (see compiling_pays)
        compile = "auto" if device.type == "cpu" else False  # can_compile_on_cpu (a 1 s import): when it would
    elif compile:
        compile = device.type != "cpu" or can_compile_on_cpu()
    try:
        step, timed = None, None  # timed: the eager steps' seconds while an auto compile is being weighed
        own = cache is None
        if own and cfg.memory.kind in PRESSES and cfg.memory.press_at == "prefill":
            prefill_chunk = max(prefill_chunk, tokens.shape[1])  # the press compresses the whole prompt, once
        if own:
            policy = {} if kv_policy is None else {"policy": kv_policy}  # models of other kinds need not take one
            cache = model.new_cache(tokens.shape[0], tokens.shape[1] + max_new_tokens, **policy)
            if kv_policy is not None and all(getattr(layer, "store_slots", None) == 0 for layer in cache.layers):
                held = tokens.shape[1] + max(max_new_tokens - 1, 0)  # the last is never fed
                cause, fix = (as_policy(kv_policy) or KVPolicy()).idle_cause(held)  # (or a KIVI group, a flush)
                warnings.warn(f"kv_policy {kv_policy} quantizes nothing in this generation: {cause}, so the cache "
                              f"is the plain one (give {fix}, or leave the policy out)", UnquantizedWarning,
                              stacklevel=3)  # fmt: skip
        fused_step = None
        if fused and not own:
            raise InputError("fused=True decodes through generate's own new cache: leave out `cache` (or fused)")
        if own and static_decode_supported(model, cache):
            # A new cache: its slots are its positions, so the decode may switch to the static step at any
            # token. The prompt goes in before static mode (its queries attend over the held slots only).
            problem = "fused=False" if fused is False else fused_problem(model, cache)  # before a long prefill
            if fused and problem:
                raise InputError(f"fused=True: the fused decode step does not apply: {problem}")
            logits = prefill_last(model, tokens, cache, prefill_chunk)
            warm = model in _COMPILED and _COMPILED[model].compiled and not _COMPILED[model].eager
            if problem is None:
                fused_step = FusedDecode(model, cache)  # one C call per token: nothing to compile
            elif compile is True or (compile == "auto" and warm and can_compile_on_cpu()):
                cache.set_static(True)
                step = compiled_decode_step(model)
            elif compile == "auto":
                timed = []
        else:  # a given cache (e.g. a memory state), or one without a static mode: eager
            if fused:
                raise InputError(f"fused=True: the fused decode step does not apply: {fused_problem(model, cache)}")
            logits = prefill(model, tokens, cache, prefill_chunk)
        positions = torch.tensor([cache.seen], device=device)
        stop = torch.tensor(stop_ids, dtype=torch.long, device=device)
        done = torch.zeros(tokens.shape[0], dtype=torch.bool, device=device)
        out, greedy = [], None  # greedy: the static step's argmax of `logits`
        for i in range(max_new_tokens):
            # (max keeps a NaN; ~7 us, a tenth of isnan().any()) argmax would read NaN logits as token 0, every step
            refuse_nan_logits(model, logits, f"at new token {i}")
            if greedy is not None and temperature == 0:
                next_token = greedy  # (B, 1)
            else:
                next_token = sample(logits, temperature, top_k, top_p, generator)  # (B, 1)
            out.append(next_token)
            if callback is not None:
                callback(next_token)
            if len(stop):
                done |= torch.isin(next_token[:, 0], stop)
                if bool(done.all()):
                    break
            if i + 1 < max_new_tokens:
                if fused_step is not None:
                    logits, greedy = fused_step(next_token)  # (advances cache.seen)
                elif step is None:
                    start = time.perf_counter()
                    logits = decode_step(model, next_token, cache)
                    if timed is not None:
                        timed.append(time.perf_counter() - start)
                        if len(timed) > EAGER_STEPS_TIMED:  # the first step warms up: left out
                            if compiling_pays(min(timed[1:]), max_new_tokens - i - 2) and can_compile_on_cpu():
                                cache.set_static(True)
                                step, positions = compiled_decode_step(model), torch.tensor([cache.seen], device=device)
                            timed = None
                else:
                    logits, greedy = step(model, next_token, positions, cache.layers)
                    positions += 1  # in place: the step's inputs keep their identity and shape
                    cache.seen += 1
    finally:
        if was_training:
            model.train()
    result = torch.cat(out, dim=1) if out else tokens.new_zeros(tokens.shape[0], 0)
    return result[0] if single else result
