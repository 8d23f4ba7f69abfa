"""What a quantized KV cache costs in quality, on held-out text (`attnlab kv-eval`, `attnlab kv-tune`).

Each window of held-out tokens is fed through the model's cache `chunk` tokens at a time (chunk 1 is
token-by-token decoding: every query sees the earlier tokens exactly as the cache stores them), once
with the full-precision cache and once per policy. Per policy, against the full-precision pass:

    dnll        mean NLL(quantized) - mean NLL(full), nats/token (ppl_ratio = exp(dnll)); dnll_ci: a 95% paired
                bootstrap interval over blocks of BLOCK consecutive positions (neighbouring tokens' losses are
                correlated; the blocks are resampled, the same blocks for both caches)
    kl          mean KL(p_full || p_quant) per token, nats
    top1        fraction of positions whose argmax agrees
    greedy      mean fraction of a greedy continuation that matches the full-precision one, token for
                token up to the first disagreement (prompts: the first half of the first windows)
    bytes       KV bytes per token, stored form (all layers), and at seq_len with the residual window in
                `dtype`; `vs_full` is the ratio to the plain cache in that dtype
"""

from __future__ import annotations

import itertools
import math
import warnings
from dataclasses import dataclass, field

import numpy as np
import torch

from attnlab.accounting import kv_report
from attnlab.cache.codecs import KIVI_FORMATS, SHORT, Codec, KVPolicy, as_policy
from attnlab.data.sources import NAMED_SOURCES, SPLITS, WIKITEXT, local_path
from attnlab.errors import AttnlabWarning, ConfigError, DataError, InputError, LengthWarning, UnquantizedWarning
from attnlab.eval.perplexity import eval_tokens, score_bar
from attnlab.eval.records import make_record
from attnlab.eval.stats import bootstrap_ci
from attnlab.generate import generate, refuse_nan_logits
from attnlab.interop.tokenizer import warn_unknown_tokens
from attnlab.paths import brief

OWN_SPLITS = (*WIKITEXT, "wikitext2-nounk")  # datasets with train/val/test files of their own (others: split by hash)


def split_problem(dataset: str, split: str) -> str | None:
    """Why `dataset` (a named dataset or local file) has no split `split`, or None: a dataset without split files
    of its own (a local file, tinyshakespeare, fineweb-edu) is divided by a hash of each document's text into
    train and val (5%) only, as a run's data is with its default fractions."""
    if dataset in OWN_SPLITS or split not in SPLITS or split in ("train", "val"):
        return None
    return (f"{dataset} has no {split!r} split: a dataset without split files of its own (a local file, "
            "tinyshakespeare, fineweb-edu) is divided by a hash of each document's text into train and val (5% of "
            "the documents, held out)")  # fmt: skip


@dataclass
class Totals:
    nll: float = 0.0
    kl: float = 0.0
    top1: float = 0.0
    tokens: int = 0
    blocks: list = field(default_factory=list)  # per window: NLL(quantized) - NLL(full) summed over each block


BLOCK = 64  # positions per block of the dNLL interval
KV_TOKENS = 8192  # held-out tokens kv-eval and kv-tune score by default (fewer when the split holds fewer)
# Inputs per window: the greedy agreement continues the first half of a window's inputs, which must hold a token
MIN_SEQ_LEN = 2
SEQ_LEN_NEED = (f"a window needs at least {MIN_SEQ_LEN} inputs: the greedy agreement continues the first half of "
                "each window's inputs (seq_len // 2 tokens)")  # fmt: skip


def block_sums(diff: torch.Tensor, block: int = BLOCK) -> list[float]:
    """(B, T) per-position differences -> the sums over each whole block of `block` positions of each row (a row's
    last partial block is left out of the interval, not of dnll)."""
    whole = diff.shape[1] // block * block
    return diff[:, :whole].reshape(diff.shape[0], -1, block).sum(dim=-1).flatten().tolist()


@torch.no_grad()
def chunked_logits(model, window: torch.Tensor, policy: KVPolicy | None, chunk: int) -> torch.Tensor:
    """window (B, L) -> logits (B, L, V), fed through a cache (quantized by `policy`) `chunk` tokens at a time."""
    cache = model.new_cache(window.shape[0], window.shape[1], policy=policy)
    out = [model(window[:, s : s + chunk], cache=cache)[0] for s in range(0, window.shape[1], chunk)]
    logits = torch.cat(out, dim=1).float()
    refuse_nan_logits(model, logits, f"on a held-out window of {window.shape[1]} tokens")
    return logits


def greedy_agreement(model, prompts: torch.Tensor, want: torch.Tensor, policy: KVPolicy) -> float:
    """Mean fraction of the full-precision cache's greedy tokens `want` (B, N) that the policy's cache also
    produces, up to the first disagreement (later tokens follow another context and are not compared)."""
    # Short continuations decode eagerly: compiling the step would cost more than it saves.
    with warnings.catch_warnings():  # a policy that quantizes nothing here: run_kv_eval says so once, per policy
        warnings.simplefilter("ignore", UnquantizedWarning)
        got = generate(model, prompts, max_new_tokens=want.shape[1], kv_policy=policy, compile=False)
    same = (want == got).long().cumprod(dim=1)  # 1 until the first disagreement
    return float(same.sum(dim=1).float().mean() / want.shape[1])


def held_out_windows(eval_model, split: str, seq_len: int, max_tokens: int, data_dir=None,
                     dataset: str | None = None, over_split: str | None = None) -> torch.Tensor:  # fmt: skip
    """(N, seq_len) non-overlapping windows of the checkpoint's own held-out split, or of `split` of `dataset`
    tokenized with the model's tokenizer (a pretrained model: e.g. wikitext2-raw). Text of `dataset` the model's
    char or word vocabulary cannot spell is said in a warning (it is scored as <unk>); so is a max_tokens the user
    gave (over_split: the flag that gave it) that is more than the split holds."""
    problem = split_problem(dataset, split) if dataset is not None else None
    if problem:
        raise DataError(f"{problem}: score split 'val'")
    try:
        tokens, source = eval_tokens(eval_model, split, data_dir, dataset)[:2]
    except MemoryError:  # a text too large to read and tokenize as one stream here
        raise DataError(too_large(dataset or eval_model.config.get("data", {}).get("source"), data_dir)) from None
    if max_tokens < seq_len:  # the budget, not the split, is too small
        raise InputError(f"max_tokens={max_tokens} is fewer than one window of {seq_len} tokens (seq_len {seq_len - 1} "
                         f"inputs and the last target): give max_tokens >= {seq_len} or a smaller seq_len")  # fmt: skip
    n = min(max_tokens, len(tokens)) // seq_len
    if n < 1:
        shorter = f", or seq_len {len(tokens) - 1} or less" if len(tokens) - 1 >= MIN_SEQ_LEN else ""
        raise DataError(f"{source}: its {split!r} split holds {len(tokens)} token(s) for {eval_model.name}'s "
                        f"tokenizer, fewer than one window of {seq_len} (seq_len {seq_len - 1} inputs and one more "
                        f"target): give a longer text{shorter}")  # fmt: skip
    if over_split and max_tokens > len(tokens):
        warnings.warn(f"{over_split} {max_tokens:,} is more than {source}'s {split!r} split holds ({len(tokens):,} "
                      f"tokens for {eval_model.name}'s tokenizer): scoring {n * seq_len:,}", LengthWarning,
                      stacklevel=2)  # fmt: skip
    if dataset is not None:  # (the model's own prepared split is the text it was trained to read)
        warn_unknown_tokens(eval_model.tokenizer, tokens[: n * seq_len], f"{dataset}:{split} scored")
    return torch.from_numpy(tokens[: n * seq_len].astype(np.int64)).view(n, seq_len)


def too_large(dataset, data_dir=None) -> str:
    """What is said when reading `dataset` as one stream of tokens runs out of memory: the file and its size."""
    what = str(dataset)
    if dataset is not None and dataset not in NAMED_SOURCES:
        try:
            path = local_path(dataset, data_dir)
            what = f"{path} ({path.stat().st_size / 2**30:.1f} GiB)"
        except (DataError, OSError):  # (said as given)
            pass
    return (f"{what}: out of memory reading and tokenizing it: the whole split is read as one stream of tokens, "
            "which is too large for this machine: give a smaller file (e.g. its first part: head -c 100M FILE > "
            "part.txt)")  # fmt: skip


def evaluate_policies(
    model,
    windows: torch.Tensor,
    policies: list[KVPolicy | str],
    chunk: int = 1,
    batch: int = 4,
    greedy_prompts: int = 4,
    greedy_tokens: int = 32,
    dtype: str = "fp16",
) -> list[dict]:
    """Figures per policy (see the module docstring) on windows (N, L) of token ids."""
    policies = [as_policy(p) or KVPolicy() for p in policies]
    if chunk < 1:
        raise InputError(f"chunk={chunk} must be >= 1")
    if windows.shape[1] - 1 < MIN_SEQ_LEN:  # (a window holds its inputs and one more target)
        raise InputError(f"seq_len={windows.shape[1] - 1}: {SEQ_LEN_NEED}")
    device = next(model.parameters()).device
    windows = windows.to(device)
    totals = [Totals() for _ in policies]
    full_nll = 0.0
    model.eval()
    bar = score_bar(windows.shape[0], "kv policies", "window")
    for start in range(0, windows.shape[0], batch):
        ids = windows[start : start + batch]
        inputs, targets = ids[:, :-1], ids[:, 1:]
        logp_full = chunked_logits(model, inputs, None, chunk).log_softmax(dim=-1)  # (B, L-1, V)
        nll_full = -logp_full.gather(-1, targets[..., None])[..., 0]  # (B, L-1)
        full_nll += nll_full.sum().item()
        top_full = logp_full.argmax(dim=-1)
        for policy, total in zip(policies, totals, strict=True):
            logp = chunked_logits(model, inputs, policy, chunk).log_softmax(dim=-1)
            nll = -logp.gather(-1, targets[..., None])[..., 0]
            total.nll += nll.sum().item()
            total.blocks += block_sums(nll.double() - nll_full.double())
            total.kl += (logp_full.exp() * (logp_full - logp)).sum().item()
            total.top1 += (logp.argmax(dim=-1) == top_full).sum().item()
            total.tokens += targets.numel()
        bar.update(ids.shape[0])
    bar.close()
    seq_len = windows.shape[1] - 1  # inputs per window (a window also holds its last target)
    full_bytes = kv_report(model.cfg, dtype, seq_len)
    prompts = windows[:greedy_prompts, : seq_len // 2]
    if model.cfg.memory.kind == "none":  # the greedy continuation fits the context (else generate cuts it, warning)
        greedy_tokens = min(greedy_tokens, model.cfg.max_seq_len - prompts.shape[1])
    if greedy_tokens < 1:  # no room after the prompt: no greedy figure
        greedy_prompts = 0
    if greedy_prompts:
        want = generate(model, prompts, max_new_tokens=greedy_tokens, compile=False)  # (B, N), full precision
    rows = []
    for policy, total in zip(policies, totals, strict=True):
        report = kv_report(model.cfg, dtype, seq_len, policy)
        dnll = (total.nll - full_nll) / total.tokens
        rows.append({
            "policy": str(policy),
            "bytes_per_token": report["kv_bytes_per_token"],
            "bytes_at_seq_len": report["kv_bytes"],
            "vs_full": report["kv_bytes"] / full_bytes["kv_bytes"],
            "nll_full": full_nll / total.tokens,
            "dnll": dnll,
            "dnll_ci": [v / BLOCK for v in bootstrap_ci(total.blocks, n=2000)] if total.blocks else None,
            "ppl_ratio": math.exp(dnll),
            "kl": total.kl / total.tokens,
            "top1": total.top1 / total.tokens,
            "greedy": greedy_agreement(model, prompts, want, policy) if greedy_prompts else None,
            "tokens": total.tokens,
            "seq_len": seq_len,
            "chunk": chunk,
            "dtype": dtype,
        })  # fmt: skip
    return rows


def table(rows: list[dict], at_seq_len: bool = False) -> str:
    """A plain-text table of evaluate_policies rows. at_seq_len: the bytes column is the bytes held at seq_len per
    token (residual window included, what kv-tune's --budget applies to), not the stored form's bytes per token."""
    column = f"B/tok@{rows[0]['seq_len']}" if at_seq_len and rows else "B/token"
    head = (f"{'policy':<40} {column:>9} {'vs full':>8} {'dNLL':>9} {'95% interval':>21} {'ppl x':>7} {'KL':>9} "
            f"{'top-1':>6} {'greedy':>6}")  # fmt: skip
    lines = [head, "-" * len(head)]
    for r in rows:
        greedy = "n/a" if r["greedy"] is None else f"{r['greedy']:.3f}"
        ci = r.get("dnll_ci")
        interval = "n/a" if ci is None else f"[{ci[0]:+.5f}, {ci[1]:+.5f}]"
        lines.append(
            f"{r['policy']:<40} {bytes_column(r, at_seq_len):>9,.0f} {r['vs_full']:>8.3f} {r['dnll']:>+9.5f} "
            f"{interval:>21} {r['ppl_ratio']:>7.4f} {kl_shown(r['kl']):>9.6f} {r['top1']:>6.3f} {greedy:>6}"
        )
    return "\n".join(lines)


def kl_shown(kl: float) -> float:
    """A KL as the table prints it: the float sum for two distributions equal but for rounding can end a hair below
    0 (printed -0.000000, a sign KL cannot have); the record keeps the sum as it came (its sign and size tell a
    policy that changes almost nothing from one that changes nothing)."""
    return max(kl, 0.0)


def bytes_column(row: dict, at_seq_len: bool) -> float:
    return row["bytes_at_seq_len"] / row["seq_len"] if at_seq_len else row["bytes_per_token"]


def candidate_formats(model, tensor: str, formats: tuple[str, ...]) -> list[str]:
    """The formats of `formats` that can store `tensor` (block formats need rows of 32 values)."""
    width = model.cfg.attention.cache_layout(model.cfg).values_per_token()[tensor]
    usable = []
    for fmt in formats:
        try:
            Codec(fmt, int(width), tensor.startswith("k"), 32, tensor)
        except ConfigError:  # a format that cannot hold this row width is not a candidate
            continue
        usable.append(fmt)
    return usable


def policy_text(assignment: dict[str, str], resid: int) -> str:
    items = [f"{SHORT.get(name, name)}={fmt}" for name, fmt in assignment.items()]
    return ",".join(items + ([f"resid={resid}"] if resid else []))


def tune(
    model,
    windows: torch.Tensor,
    budget: float,
    max_dnll: float | None = None,
    formats: tuple[str, ...] = ("fp16", "q8_0", "q4_0", "nf4"),
    resids: tuple[int, ...] = (0, 32, 128),
    verify: int = 3,
    chunk: int = 1,
    dtype: str = "fp16",
    log=print,
) -> dict:
    """The policy with the least quality loss whose bytes per token at seq_len (residual window included) fit
    `budget`. Quality loss is measured as KL(p_full || p_quant) per token: always >= 0 and additive to first
    order, where dNLL on a few thousand tokens is noise of either sign (see BENCHMARKS.md).

    1. Sensitivity: KL of each (tensor, format, resid) with every other tensor in `dtype`.
    2. Every combination of per-tensor formats and a residual size under the budget gets a predicted KL,
       the sum of its tensors' sensitivities at that residual size.
    3. The `verify` best predictions are evaluated together; the least measured KL wins. `max_dnll` is the
       guardrail on the winner's dNLL.
    Returns {"best": row or None, "meets_max_dnll": bool, "sensitivity": rows, "verified": rows}.
    """
    tensors = list(model.cfg.attention.cache_layout(model.cfg).values_per_token())
    seq_len = windows.shape[1] - 1  # inputs per window (a window also holds its last target)
    problem = chunk_problem(seq_len, chunk)  # nothing would be measured: the pick would be on nothing
    if problem:
        raise InputError(problem)
    options = {t: candidate_formats(model, t, formats) for t in tensors}
    baseline = {t: dtype for t in tensors}
    sens_policies = [
        policy_text({**baseline, t: fmt}, resid)
        for resid in resids
        for t in tensors
        for fmt in options[t]
        if fmt != dtype and resid < seq_len  # (resid >= seq_len: nothing quantized, nothing to measure)
    ]
    fitting, unread, idle = [], [], []  # (assignment, resid, bytes per token at seq_len, policy) under the budget
    plain = kv_report(model.cfg, dtype, seq_len)["kv_bytes"]
    last = last_chunk_start(seq_len, chunk)
    full_seen = False  # the full-precision cache is one candidate, whatever its residual window: kept once, resid 0
    for each_resid in resids:
        for combo in itertools.product(*(options[t] for t in tensors)):
            assignment = dict(zip(tensors, combo, strict=True))
            resid = each_resid
            if all(fmt == dtype for fmt in combo):
                if full_seen:
                    continue
                full_seen, resid = True, 0
            text = policy_text(assignment, resid)
            held = kv_report(model.cfg, dtype, seq_len, text)["kv_bytes"]
            if held / seq_len > budget:
                continue
            if resid >= seq_len and any(fmt != dtype for fmt in combo):
                idle.append(text)  # every token in the full-precision residual window: labelled quantized, is not
                continue
            if held != plain and first_read(model.cfg, KVPolicy.parse(text), dtype) > last:
                unread.append(text)  # its bytes count quantized tokens no query reads: its KL would be 0 unmeasured
                continue
            fitting.append((assignment, resid, held / seq_len, text))
    if idle:  # said before minutes of measuring, as kv-eval says it (warn_unquantized)
        what = (f"{len(idle)} polic{'ies' if len(idle) > 1 else 'y'} under the budget ({idle[0]}"
                f"{', ...' * (len(idle) > 1)}): resid >= seq_len {seq_len} keeps every token in the full-precision "
                "residual window, so nothing is quantized (the bytes and dNLL of the full-precision cache); give "
                f"--resids below {seq_len}, or a longer --seq-len")  # fmt: skip
        if not fitting and not unread:
            raise InputError(f"no policy under --budget {budget:g} bytes/token can be measured: {what}")
        warnings.warn(f"left out of the choice: {what}", AttnlabWarning, stacklevel=2)
    if unread:  # said before minutes of measuring
        what = (f"{len(unread)} polic{'ies' if len(unread) > 1 else 'y'} under the budget ({unread[0]}"
                f"{', ...' * (len(unread) > 1)}) quantize{'s' * (len(unread) == 1)} tokens "
                f"no query of a window of seq_len {seq_len} reads, fed {chunk} token(s) at a time (a query reads the "
                "tokens held before its chunk, once a whole block has left the residual window): "
                f"{'their' if len(unread) > 1 else 'its'} KL would be 0, measured on nothing; give a longer "
                "--seq-len, smaller --resids or a smaller --chunk")  # fmt: skip
        if not fitting:
            raise InputError(f"no policy under --budget {budget:g} bytes/token can be measured: {what}")
        warnings.warn(f"left out of the choice: {what}", AttnlabWarning, stacklevel=2)
    if not fitting:
        smallest, resid = min(
            (kv_report(model.cfg, dtype, seq_len, policy_text(dict(zip(tensors, combo, strict=True)), resid))[
                "kv_bytes"], resid)
            for resid in resids
            for combo in itertools.product(*(options[t] for t in tensors))
        )  # fmt: skip
        tried = (f"the smallest tried, all tensors in their tightest format with resid={resid}, takes "
                 f"{smallest / seq_len:,.1f} at seq_len {seq_len}")  # fmt: skip
        if min(resids) >= seq_len:  # the residual window holds the whole context: nothing is quantized
            raise InputError(f"no policy fits --budget {budget:g} bytes/token: {tried}, because --resids "
                             f"{','.join(map(str, resids))} >= seq_len {seq_len} keeps every token at full precision "
                             f"(give --resids below {seq_len}, e.g. 0)")  # fmt: skip
        raise InputError(f"no policy fits --budget {budget:g} bytes/token ({tried}): raise the budget, or try smaller "
                         "--resids or --formats")  # fmt: skip
    log(f"kv-tune: measuring {len(sens_policies)} single-tensor policies on {windows.numel():,} tokens")
    sensitivity = evaluate_policies(model, windows, sens_policies, chunk=chunk, greedy_prompts=0, dtype=dtype)
    cost = {row["policy"]: row["kl"] for row in sensitivity}
    candidates = [
        (sum(cost[policy_text({**baseline, t: fmt}, resid)] for t, fmt in assignment.items() if fmt != dtype),
         per_token, text)
        for assignment, resid, per_token, text in fitting
    ]  # fmt: skip
    candidates.sort()
    chosen = [text for _, _, text in candidates[:verify]]
    log(f"kv-tune: {len(candidates)} policies fit the budget; verifying the {len(chosen)} best predicted")
    verified = evaluate_policies(model, windows, chosen, chunk=chunk, dtype=dtype)
    best = min(verified, key=lambda r: (r["kl"], r["bytes_at_seq_len"]))
    meets = max_dnll is None or best["dnll"] <= max_dnll
    return {"best": best, "meets_max_dnll": meets, "sensitivity": sensitivity, "verified": verified}


def quantized_block(cfg, policy: KVPolicy, dtype: str = "fp16") -> tuple[int, str]:
    """(tokens that leave the residual window together, what makes them that many): `flush` tokens, and all of a
    cache's tokens a KIVI key group at a time when a key tensor is in a KIVI format (cache.quantized.slot_counts).
    A memory stores every slot in its format as it comes (it takes no resid, flush or KIVI format): 1."""
    if cfg.memory.kind != "none":
        return 1, "one token"
    tensors = cfg.attention.cache_layout(cfg).values_per_token()
    grouped = any(name.startswith("k") and policy.format_of(name, dtype) in KIVI_FORMATS for name in tensors)
    why = ([f"KIVI keys quantized group={policy.group_size} tokens at a time"] if grouped else []) + (
        [f"flush={policy.flush}"] if policy.flush > 1 else [])  # fmt: skip
    return math.lcm(policy.flush, policy.group_size if grouped else 1), " and ".join(why) or "one token"


def first_read(cfg, policy: KVPolicy, dtype: str = "fp16") -> int:
    """How many tokens a cache must hold before a query reads one of them quantized: the residual window and one
    whole block past it (quantized_block)."""
    return policy.resid + quantized_block(cfg, policy, dtype)[0]


def last_chunk_start(seq_len: int, chunk: int) -> int:
    """The first position of a window's last chunk: its queries read the most tokens held before their chunk."""
    return (seq_len - 1) // chunk * chunk


def chunk_problem(seq_len: int, chunk: int) -> str | None:
    """Why windows of `seq_len` inputs fed `chunk` tokens at a time measure no KV policy, or None: every window goes
    in as one chunk, whose queries read their own keys at full precision (nothing is read from the cache)."""
    if chunk < seq_len:
        return None
    return (f"--chunk {chunk} >= --seq-len {seq_len}: each window goes in as one chunk, whose queries read its own "
            "keys and values at full precision, so no policy's quantized cache is ever read (every row would show "
            f"dNLL 0, KL 0): give --chunk below {seq_len} (1, the default, decodes token by token)")  # fmt: skip


def formatless_problem(text: str) -> str | None:
    """Why a policy text that names no format (e.g. 'resid=64': nothing quantized, so its row would silently measure
    the full-precision cache) is refused; None for one that names a format, or 'none'/'fp' (the full-precision row)."""
    if text.strip() in ("", "none", "fp") or KVPolicy.parse(text).formats:
        return None
    return ("names no format, so it quantizes nothing and its row would measure the full-precision "
            f"cache: name one, e.g. 'k=q8_0,{text.strip()}' (or 'none' for the full-precision row)")  # fmt: skip


def policy_problem(key: str, value) -> str | None:
    """A bench KV policy parameter (kv_policy, or kv_quant's policies) that does not parse, checked before any
    benchmark runs (a run whose lengths all fit no cache would otherwise never read it); policies that are not
    strings, name no format, or name one policy twice."""
    if key == "policies" and isinstance(value, list):
        seen: dict[tuple, str] = {}
        for i, policy in enumerate(value):
            if not isinstance(policy, str):  # (YAML reads `- k: q8_0` as a mapping, `[[...]]` as a list)
                return (f"holds {brief(policy)} at [{i}], which is not a policy string: give each as a string such "
                        "as 'k=q8_0,v=q4_0' (quote it in YAML)")  # fmt: skip
            try:
                parsed = KVPolicy.parse(policy)
            except ConfigError as e:
                return f"holds {brief(policy)}, which is not a KV policy: {e}"
            if formatless_problem(policy):
                return (f"holds {brief(policy)}, which {formatless_problem(policy)}; YAML splits an unquoted "
                        "[k=q8_0,resid=64] at its comma into two policies: quote each policy, e.g. policies: "
                        "['k=q8_0,resid=64']")  # fmt: skip
            same = (tuple(sorted(parsed.formats)), parsed.resid, parsed.group, parsed.flush)
            if same in seen:
                return f"names one policy twice ({brief(seen[same])} and {brief(policy)}): give each once"
            seen[same] = policy
        return None
    if key != "kv_policy" or not isinstance(value, str):
        return None
    try:
        KVPolicy.parse(value)
    except ConfigError as e:
        return f"is not a KV policy: {e}"
    return None if value.strip() else "is empty (leave kv_policy out for the full-precision cache)"


def warn_unquantized(policies: list[KVPolicy | str], seq_len: int, cfg=None, chunk: int = 1,
                     dtype: str = "fp16") -> None:  # fmt: skip
    """AttnlabWarnings (one line each) naming the policies that store some tensor quantized but whose rows measure
    the full-precision cache, not the formats they name: every token of a window of `seq_len` stays in the
    residual window (resid >= seq_len); with the model's config `cfg`, also no query holds a whole block past the
    window before it (a KIVI group or flush too long for seq_len: first_read), or none does before its chunk of
    `chunk` tokens (a chunk's own keys are read at full precision)."""
    quantized = [p for p in (as_policy(p) or KVPolicy() for p in policies) if p.formats]
    idle = [p for p in quantized if p.resid >= seq_len]
    if idle:
        warnings.warn(f"kv policy {'; '.join(map(str, idle))}: resid >= seq_len {seq_len} keeps every token in the "
                      "full-precision residual window, so nothing is quantized and the row measures the "
                      f"full-precision cache (vs full 1, dNLL 0); give a resid below {seq_len}, or a longer "
                      "seq_len", AttnlabWarning, stacklevel=3)  # fmt: skip
    if cfg is None:
        return
    last = last_chunk_start(seq_len, chunk)
    for policy in [p for p in quantized if p.resid < seq_len]:
        first = first_read(cfg, policy, dtype)
        if first <= last:
            continue
        step, why = quantized_block(cfg, policy, dtype)
        held = f"{first} token" if first == 1 else f"{first} tokens (resid={policy.resid} at full precision, then " + (
            "one more" if step == 1 else f"a block of {step}: {why}") + ")"  # fmt: skip
        if first <= seq_len - 1:  # a smaller chunk would read them
            warnings.warn(f"kv policy {policy}: fed {chunk} tokens at a time, the last chunk of a window of seq_len "
                          f"{seq_len} starts at token {last}, and a query reads a quantized token only once the "
                          f"cache holds {held} before its chunk (the chunk's own keys are read at full precision): "
                          "the row measures the full-precision cache (dNLL 0, KL 0); give a smaller chunk (1 decodes "
                          "token by token)", AttnlabWarning, stacklevel=3)  # fmt: skip
        else:
            warnings.warn(f"kv policy {policy}: a query reads a quantized token only once the cache holds {held}, "
                          f"but the last query of a window of seq_len {seq_len} reads the {seq_len - 1} before it: "
                          "nothing quantized is read and the row measures the full-precision cache (dNLL 0, KL 0); "
                          f"give a seq_len above {first}, or a smaller resid, group or flush", AttnlabWarning,
                          stacklevel=3)  # fmt: skip


def run_kv_eval(eval_model, policies: list[str], split: str = "test", seq_len: int = 512, max_tokens: int = KV_TOKENS,
                chunk: int = 1, dtype: str = "fp16", data_dir=None, dataset: str | None = None,
                over_split: str | None = None) -> list[dict]:  # fmt: skip
    """`kv_quant` records, one per policy, on the checkpoint's own held-out split (or `split` of `dataset`). A policy
    whose residual window holds the whole window (nothing quantized) is said in a warning."""
    if seq_len < MIN_SEQ_LEN:
        raise InputError(f"seq_len={seq_len}: {SEQ_LEN_NEED}")
    warn_unquantized(policies, seq_len, eval_model.model.cfg, chunk, dtype)
    windows = held_out_windows(eval_model, split, seq_len + 1, max_tokens, data_dir, dataset, over_split)
    rows = evaluate_policies(eval_model.model, windows, policies, chunk=chunk, dtype=dtype)
    dataset = dataset or eval_model.config.get("data", {}).get("source")
    return [make_record("kv_quant", eval_model, split=split, dataset=dataset, **row) for row in rows]
