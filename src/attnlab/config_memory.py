"""The memory config: which bounded memory a model reads through (window, StreamingLLM, H2O, the CoDA-GQA-L banks)
and its options, validated when built; `memory.preset` fills the bounded banks' options a config leaves out.
Split from attnlab.config (which re-exports these names)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

from attnlab.config_checks import MAX_WIDTH, field_problems, unknown_key_problem
from attnlab.errors import ConfigError

MEMORY_KINDS = ("none", "window", "streaming", "h2o", "bounded", "quest", "snapkv", "tova", "knorm")
PRESSES = ("snapkv", "tova", "knorm")  # kvpress's scorer presses as memory kinds (cache/presses.py)
# The options each memory kind reads (besides kind); another kind's option is refused, not ignored.
MEMORY_OPTIONS = {
    "none": (),
    "window": ("recent_window", "block", "positions"),
    "streaming": ("recent_window", "block", "positions", "sink_tokens"),
    "h2o": ("recent_window", "block", "positions", "heavy_slots"),
    "bounded": ("recent_window", "block", "positions", "exact_slots", "summary_slots", "tau_gate", "tau_novel",
                "tau_match", "write_policy", "detach_evicted", "preset", "tau_gate_summary", "exact_candidates",
                "summary_candidates", "write_bias", "exact_refresh", "summary_routing", "summary_energy_scale",
                "summary_update", "eta_logit_init"),
    "quest": ("recent_window", "block", "sink_tokens", "page_size", "pages", "dense_prefill"),
    "snapkv": ("block", "budget", "budget_bytes", "compression_ratio", "press_at", "window_size", "kernel_size"),
    "tova": ("block", "budget", "budget_bytes", "compression_ratio", "press_at"),
    "knorm": ("block", "budget", "budget_bytes", "compression_ratio", "press_at"),
}  # fmt: skip
# What `memory.preset` fills in for the bounded memory's options a config leaves out: attnlab's choices (the paper's
# text, §3.2-3.3), or those of the authors' package coda-gqa-l 1.3.1 that produced the paper's numbers
# (CoDAGQALandmarkPerf2's defaults: write_gate_init_bias, write_gate_threshold_exact/_summary,
# exact_candidates_per_block, summary_candidates_per_block, the LRU touch of any non-novel match, summary routing
# by argmax, energy_scale, _summary_update_block_hard, summary_eta_init_logit). README: "The reference preset".
MEMORY_PRESETS = {
    "attnlab": {"tau_gate": 0.5, "tau_gate_summary": None, "exact_candidates": None, "summary_candidates": None,
                "write_bias": None, "exact_refresh": "tau_match", "summary_routing": "novelty",
                "summary_energy_scale": False, "summary_update": "sequential", "eta_logit_init": 0.0},
    "reference": {"tau_gate": 0.10, "tau_gate_summary": 0.05, "exact_candidates": 8, "summary_candidates": 64,
                  "write_bias": -2.0, "exact_refresh": "tau_novel", "summary_routing": "argmax",
                  "summary_energy_scale": True, "summary_update": "block", "eta_logit_init": -3.0},
}  # fmt: skip


class _Unset:
    """The default of an option a memory preset fills: left out of the config (None is a value of its own)."""

    def __repr__(self) -> str:
        return "<from memory.preset>"


UNSET: Any = _Unset()


def misplaced_problem(key: str, kind: str) -> str:
    """The line refusing memory option `key` under memory.kind `kind`, whose option it is not (MEMORY_OPTIONS)."""
    owners = [k for k, options in MEMORY_OPTIONS.items() if key in options]
    return (f"memory.{key} belongs to memory.kind {' or '.join(owners)}, not {kind} "
            f"(remove it, or set memory.kind: {owners[0]})")  # fmt: skip


@dataclass(frozen=True)
class MemoryConfig:
    """A KV memory of fixed size per layer instead of a cache that grows with the sequence (cache/memories.py).

    none: the variant's own cache. window: the last `recent_window` tokens. streaming (StreamingLLM): the
    first `sink_tokens` tokens + the recent window. h2o: the `heavy_slots` tokens with the largest
    accumulated attention + the recent window. bounded (CoDA-GQA-L §3.2): recent window + `exact_slots`
    landmark bank (novelty-filtered LRU, value-routed) + `summary_slots` EMA prototype bank, fed by the
    tokens leaving the window whose write gate g = sigmoid(W_write x) >= tau_gate (write_policy gated;
    `none` offers every token with g = 1). quest (dynamic sparse attention, Tang et al. 2024, with the Longformer
    pattern): keeps every token, and each query reads only the `pages` pages of `page_size` tokens whose
    per-channel key bounds promise the largest scores, plus the recent window and the first `sink_tokens` tokens
    (cache/sparse.py); it holds as much as the dense cache and reads less. snapkv, tova, knorm (kvpress's presses,
    cache/presses.py): each KV head keeps the `budget` tokens (or 1 - `compression_ratio` of them) that score best:
    SnapKV's pooled attention from the last `window_size` queries, TOVA's attention from the newest query, the
    smallest key norms; `press_at` prefill compresses once, after the first chunk (kvpress's setting), decode
    after every update that leaves more than the budget. An option of another kind (MEMORY_OPTIONS) set away from
    its default is an error: it would do nothing but change the config's hash (one written at all in a memory
    section read by config_io.memory_from_dict is refused too; a saved config carries their defaults).

    The bounded memory's options that differ between the paper's text and the authors' code (cache/banks.py):

    preset               fills in the options below (and tau_gate) that the config leaves out: `attnlab`
                         (default, the paper's text) or `reference` (the package coda-gqa-l 1.3.1 that produced
                         the paper's numbers; MEMORY_PRESETS). Options written beside it win; the config then
                         holds the filled-in values (its dict and hash say what runs)
    tau_gate             the write gate a token needs to be offered to the exact bank (and to the summary bank
                         unless tau_gate_summary): 0.5 | reference 0.10
    tau_gate_summary     the summary bank's own gate threshold; None = tau_gate | reference 0.05
    exact_candidates     a block's tokens offered to the exact bank: the ones with the largest gates, at most
                         this many per update (decoding offers one token at a time); None = every one |
                         reference 8
    summary_candidates   likewise for the summary bank; None = every one | reference 64
    write_bias           None: g = sigmoid(W_write x); a number: g = sigmoid(W_write x + b_write), b_write a
                         learned scalar initialised at it (write_policy gated only) | reference -2.0
    exact_refresh        the cosine from which a token refreshes its best exact slot's recency: `tau_match`
                         (only a match) | reference `tau_novel` (any token that is not new, a medium match too)
    summary_routing      `novelty`: a token below tau_novel against every prototype opens a free slot, else it
                         moves its best match | reference `argmax`: the best of all M_s slots, an empty slot
                         scoring cosine 0 (the package with its memory initialised at zero); landing on an empty
                         slot opens it; no novelty threshold
    summary_energy_scale the low-frequency channels of RoPE fields stored in a prototype are scaled by
                         sqrt(width / low-frequency width) (sqrt(2)): false | reference true
    summary_update       `sequential`: a block's candidates one after another, each moving its prototype by
                         eta = sigmoid(eta_logit) * g | reference `block`: a block's candidates routed against
                         the bank as it was before the block, their gate-weighted mean per slot blended by one
                         step of eta = sigmoid(eta_logit) (1 into an empty slot), seen from the next block on;
                         a decoding step (one token) is sequential in both
    eta_logit_init       the summary bank's EMA logit at init: 0.0 (eta = 0.5) | reference -3.0
    """

    kind: str = "none"
    recent_window: int = 128
    sink_tokens: int = 4
    heavy_slots: int = 32
    exact_slots: int = 32
    summary_slots: int = 32
    tau_gate: float = UNSET
    tau_novel: float = 0.70
    tau_match: float = 0.90
    write_policy: str = "gated"
    detach_evicted: bool = True
    block: int | None = None  # tokens per memory update when the model reads a whole sequence (training,
    # scoring): the sequence goes through the memory `block` tokens at a time; None = recent_window
    positions: str = "absolute"  # RoPE positions the attention reads: `absolute` (each token's place in the
    # stream) or `cache` (StreamingLLM: its place among the tokens the memory holds, so relative distances stay
    # within the slots however long the stream)
    preset: str = "attnlab"
    tau_gate_summary: float | None = UNSET
    exact_candidates: int | None = UNSET
    summary_candidates: int | None = UNSET
    write_bias: float | None = UNSET
    exact_refresh: str = UNSET
    summary_routing: str = UNSET
    summary_energy_scale: bool = UNSET
    summary_update: str = UNSET
    eta_logit_init: float = UNSET
    page_size: int = 16  # quest: tokens per page (its keys' min/max bound a query's scores over the page)
    pages: int = 8  # quest: pages each query reads besides the recent window and the sinks (per KV head)
    # quest: a chunk of several tokens (a prompt) attends in full, as Quest's paper selects only when decoding (a
    # sequence read in blocks then no longer equals decoding it token by token)
    dense_prefill: bool = False
    budget: int | None = None  # presses: tokens each KV head keeps at most (or compression_ratio)
    compression_ratio: float | None = None  # presses: the fraction of a chunk's tokens dropped (kvpress's ratio)
    # presses: bytes a layer's cache holds at most (all KV heads), in tokens per KV head once the layout and the KV
    # policy's formats say what a token costs (cache/presses.py: resolve_budget)
    budget_bytes: int | None = None
    press_at: str = "prefill"  # presses: `prefill` compresses once after the first chunk, `decode` after every update
    window_size: int = 64  # snapkv: the last queries whose attention scores the keys (kept whatever their score)
    kernel_size: int = 5  # snapkv: the width of the average pooling over neighbouring keys' scores
    int_limit: ClassVar[int] = MAX_WIDTH

    def __post_init__(self) -> None:
        problems = self._fill_preset()
        problems += field_problems(self, "memory.")
        if problems:
            raise ConfigError(problems)
        if self.kind not in MEMORY_KINDS:
            problems.append(unknown_key_problem(str(self.kind), list(MEMORY_KINDS), "memory.kind=", "value"))
        else:
            for f in dataclasses.fields(self):
                default = MEMORY_PRESETS["attnlab"].get(f.name, f.default)
                if f.name != "kind" and f.name not in MEMORY_OPTIONS[self.kind] and getattr(self, f.name) != default:
                    problems.append(misplaced_problem(f.name, self.kind))
        if self.recent_window < 1:
            problems.append(f"memory.recent_window={self.recent_window} must be >= 1")
        for key in ("sink_tokens", "heavy_slots", "exact_slots", "summary_slots"):
            if getattr(self, key) < 0:
                problems.append(f"memory.{key}={getattr(self, key)} must be >= 0 (0 = no such slots)")
        nothing = {"streaming": "sink_tokens", "h2o": "heavy_slots"}.get(self.kind)  # options that would do nothing
        if nothing and getattr(self, nothing) == 0:
            problems.append(f"memory.{nothing}=0 makes {self.kind} the window memory: use memory.kind window (or "
                            f"give memory.{nothing} >= 1)")  # fmt: skip
        for key in ("tau_gate", "tau_novel", "tau_match", "tau_gate_summary"):
            if getattr(self, key) is not None and not 0.0 <= getattr(self, key) <= 1.0:
                problems.append(f"memory.{key}={getattr(self, key)} must be in [0, 1]")
        if self.tau_novel > self.tau_match:
            problems.append(
                f"memory.tau_novel={self.tau_novel} must be <= memory.tau_match={self.tau_match} "
                "(below tau_novel a token is new, above tau_match it refreshes its match)"
            )
        for key in ("exact_candidates", "summary_candidates"):
            if getattr(self, key) is not None and getattr(self, key) < 1:
                bank = key.split("_")[0]
                problems.append(f"memory.{key}={getattr(self, key)} must be >= 1 (or null: every token leaving "
                                f"the window; no {bank} bank at all is {bank}_slots: 0)")  # fmt: skip
        if self.kind == "quest":
            problems += self._quest_problems()
        if self.kind in PRESSES:
            problems += self._press_problems()
        if self.block is not None and self.block < 1:
            problems.append(f"memory.block={self.block} must be >= 1 (or leave it out: recent_window)")
        choices = {"positions": ("absolute", "cache"), "write_policy": ("none", "gated"),
                   "exact_refresh": ("tau_match", "tau_novel"), "summary_routing": ("novelty", "argmax"),
                   "summary_update": ("sequential", "block")}  # fmt: skip
        for key, known in choices.items():
            if getattr(self, key) not in known:
                use = " or ".join(map(repr, known))
                problems.append(f"memory.{key}={getattr(self, key)!r} is not known (use {use})")
        if self.write_bias is not None and self.write_policy != "gated":
            problems.append(f"memory.write_bias={self.write_bias} needs memory.write_policy: gated (with "
                            f"write_policy {self.write_policy!r} there is no write gate to bias)")  # fmt: skip
        problems += self._idle_gate_problems()
        if problems:
            raise ConfigError(problems)

    def _idle_gate_problems(self) -> list[str]:
        """Under write_policy none every token's gate is 1, so a gate threshold in [0, 1] admits every token: a
        threshold other than the preset's (which a saved config carries) would do nothing."""
        if self.kind != "bounded" or self.write_policy != "none" or self.preset not in MEMORY_PRESETS:
            return []
        return [
            f"memory.{key}={getattr(self, key)} does nothing with memory.write_policy: none (every token's gate is "
            f"1 and passes any threshold; remove {key}, or set memory.write_policy: gated)"
            for key in ("tau_gate", "tau_gate_summary")
            if getattr(self, key) != MEMORY_PRESETS[self.preset][key]
            and (getattr(self, key) is None or 0.0 <= getattr(self, key) <= 1.0)  # (out of range: said already)
        ]

    def _quest_problems(self) -> list[str]:
        problems = []
        for key in ("page_size", "pages"):
            if getattr(self, key) < 1:
                problems.append(f"memory.{key}={getattr(self, key)} must be >= 1")
        if not problems and self.recent_window % self.page_size:
            fits = self.page_size * max(1, round(self.recent_window / self.page_size))
            problems.append(
                f"memory.page_size={self.page_size} must divide memory.recent_window={self.recent_window}: the window "
                f"covers whole pages (use recent_window {fits}, or a page_size that divides {self.recent_window})"
            )
        return problems

    def _press_problems(self) -> list[str]:
        problems = []
        if sum(x is not None for x in (self.budget, self.budget_bytes, self.compression_ratio)) != 1:
            problems.append(f"memory.kind={self.kind} needs exactly one of memory.budget (tokens kept per KV head), "
                            "memory.budget_bytes (bytes a layer holds) and memory.compression_ratio (the fraction "
                            "dropped, as kvpress's)")  # fmt: skip
        if self.budget_bytes is not None and self.budget_bytes < 1:
            problems.append(f"memory.budget_bytes={self.budget_bytes} must be >= 1 (bytes a layer's cache holds)")
        if self.budget is not None and self.budget < 1:
            problems.append(f"memory.budget={self.budget} must be >= 1 (tokens kept per KV head)")
        if self.compression_ratio is not None and not 0.0 <= self.compression_ratio < 1.0:
            problems.append(
                f"memory.compression_ratio={self.compression_ratio} must be in [0, 1) (the fraction dropped)"
            )
        if self.press_at not in ("prefill", "decode"):
            problems.append(f"memory.press_at={self.press_at!r} is not known (use 'prefill' or 'decode')")
        if self.window_size < 1:
            problems.append(f"memory.window_size={self.window_size} must be >= 1")
        if self.kernel_size < 1 or self.kernel_size % 2 == 0:
            problems.append(
                f"memory.kernel_size={self.kernel_size} must be odd and >= 1 (the pooling keeps the length)"
            )
        return problems

    def _fill_preset(self) -> list[str]:
        """Sets every option left out (UNSET) to the preset's value; the problem with the preset, if any."""
        problems, preset = [], self.preset
        if not isinstance(preset, str) or preset not in MEMORY_PRESETS:
            problems.append(unknown_key_problem(str(preset), list(MEMORY_PRESETS), "memory.preset=", "value"))
        # Other kinds take attnlab's values (their dict and hash as before presets); a preset there is refused.
        values = MEMORY_PRESETS[preset if not problems and self.kind == "bounded" else "attnlab"]
        for key, value in values.items():
            if getattr(self, key) is UNSET:
                # No write gate to bias without one (write_policy none): the preset leaves write_bias out.
                value = None if key == "write_bias" and self.write_policy == "none" else value
                object.__setattr__(self, key, value)
        return problems

    @property
    def slots(self) -> int | None:
        """Slots per layer (and sequence) the memory holds at most; None for kind none (the variant's cache) and
        quest (it keeps every token)."""
        extra = {"window": 0, "streaming": self.sink_tokens, "h2o": self.heavy_slots}
        if self.kind in PRESSES:  # bounded only when it compresses to a budget at every update
            return self.budget if self.press_at == "decode" else None
        if self.kind in ("none", "quest"):
            return None
        if self.kind == "bounded":
            return self.recent_window + self.exact_slots + self.summary_slots
        return self.recent_window + extra[self.kind]

    @property
    def read_slots(self) -> int | None:
        """Tokens a decode step reads per layer and KV head at most: the slots of a bounded memory; for quest its
        pages, recent window and sinks; None for kind none (every token)."""
        if self.kind == "quest":
            return self.pages * self.page_size + self.recent_window + self.sink_tokens
        return self.slots

    @property
    def block_size(self) -> int:
        if self.kind in PRESSES:  # a press compresses after a chunk: a sequence is one chunk unless `block` says
            return self.block if self.block is not None else MAX_WIDTH
        return self.block if self.block is not None else self.recent_window

    @property
    def summary_gate(self) -> float:
        """The write gate a token needs to be offered to the summary bank."""
        return self.tau_gate if self.tau_gate_summary is None else self.tau_gate_summary

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        # Options added later are left out at attnlab's defaults: configs written before them keep their hash.
        # Under another preset every option it fills is kept (read back, a left-out one would take its value).
        later = {"block": None, "positions": "absolute", "preset": "attnlab", "page_size": 16, "pages": 8,
                 "dense_prefill": False, "budget": None, "budget_bytes": None, "compression_ratio": None,
                 "press_at": "prefill", "window_size": 64, "kernel_size": 5}  # fmt: skip
        if self.preset == "attnlab":
            later.update({k: v for k, v in MEMORY_PRESETS["attnlab"].items() if k != "tau_gate"})
        for key, default in later.items():
            if out[key] == default:
                del out[key]
        return out


def misplaced_options(data: dict) -> list[str]:
    """The options of another kind than data's memory.kind that a memory section written by hand names, whatever
    their values: each would do nothing. (A saved config, MemoryConfig.to_dict, carries the first options' defaults
    under every kind, kept for its hash: it is read without this check.)"""
    kind = data.get("kind", "none")
    if not isinstance(kind, str) or kind not in MEMORY_KINDS:
        return []  # said by MemoryConfig
    names = {f.name for f in dataclasses.fields(MemoryConfig)}
    return [key for key in data if key in names and key != "kind" and key not in MEMORY_OPTIONS[kind]]
