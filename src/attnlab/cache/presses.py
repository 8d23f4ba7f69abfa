"""KV presses as memory kinds (memory.kind snapkv, tova, knorm): each KV head keeps the tokens that score best.

The presses researchers compare a KV scheme against, as NVIDIA's kvpress 0.5.5 defines them (its ScorerPress:
scores (B, H_kv, S), the best n_kept per KV head, the same count for every head), on attnlab's cache contract, so
that they run with every attention variant and inside attnlab's harness:

    knorm   score = -||k||: the smallest key norms are kept (Devoto et al. 2024; keys as cached, after RoPE)
    tova    the newest query's attention, softmax in fp32 over every held key, averaged over all query heads
            (one ranking for every KV head), the newest token always kept (Oren et al. 2024)
    snapkv  the attention of the last `window_size` queries over the keys before them (softmax in fp32 over
            every key a query sees, the window's columns then dropped without renormalising), averaged over
            those queries, average-pooled over `kernel_size` neighbouring keys (zero padding counted), averaged
            over the query heads of each KV head; the window's own tokens always kept (Li et al. 2024), the
            newest first when fewer can be kept (a prompt no longer than the window, which kvpress refuses, or a
            decode-mode budget below the window)

n_kept is `budget`, or kvpress's max(1, int(S * (1 - compression_ratio))) for S held tokens. `press_at`:

    prefill  (kvpress's setting) the first chunk, from an empty cache, attends in full, then each KV head keeps
             its n_kept; later chunks and decode steps are appended and nothing is dropped again
    decode   after every update that leaves more than n_kept tokens (a ratio counts every token seen so far:
             kvpress's CompressionRatioDecodingPress), so with a budget the cache holds at most `budget` tokens
             between steps. A chunk's queries all see the chunk (the drop comes after the chunk's attention), so
             a chunk equals token-by-token decoding only when nothing is dropped inside it.

Kept tokens keep their positions (and their keys their RoPE rotation): later tokens continue the stream's
positions, as in kvpress's pipeline. Slots stay in position order (SnapKV's pooling in decode mode runs over the
held keys in that order). The scores are computed from the queries and keys of the attention call the variant
makes (`resolve`): DBA's [k_sem | k_geo], MLA's latent and RoPE key (absorbed path), DIFF's signal stream, CoDA's
two streams as the call's query heads. With a KV policy every token is stored in its field's format as it comes,
each KV head's row on its own (`press_codecs`), and the attention and the scores read the keys as stored.
kvpress's ExpectedAttentionPress needs statistics of the un-rotated queries
of the hidden states, which a cache never sees: it is not offered.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from attnlab.cache.base import LayerCache, Write
from attnlab.cache.codecs import FORMAT_OF_DTYPE, Codec, KVPolicy
from attnlab.cache.memories import four
from attnlab.config import MemoryConfig
from attnlab.errors import ConfigError, InputError
from attnlab.ops.attend import grouped_logits
from attnlab.ops.masks import with_null_column


def n_kept(held: int, memory: MemoryConfig) -> int:
    """Tokens each KV head keeps of `held`: the budget, or kvpress's max(1, int(held * (1 - ratio)))."""
    if memory.budget is not None:
        return min(held, memory.budget)
    return max(1, int(held * (1.0 - memory.compression_ratio)))


def token_bytes(layout, codecs: dict | None, dtype_size: int) -> float:
    """Bytes one token takes in a layer's press cache, over every KV head: its fields at `dtype_size` bytes a value,
    or in their codecs' formats (press_codecs: one head's row each)."""
    if codecs is None:
        return sum(f.width for f in layout.fields) * layout.heads * dtype_size
    return sum(codec.bytes_per_token for codec in codecs.values()) * layout.heads


def resolve_budget(memory: MemoryConfig, per_token: float) -> MemoryConfig:
    """`memory` with budget_bytes turned into a budget of tokens per KV head (per_token: token_bytes); ConfigError
    when not one token fits."""
    if memory.budget_bytes is None:
        return memory
    tokens = int(memory.budget_bytes // per_token)
    if tokens < 1:
        raise ConfigError(f"memory.budget_bytes={memory.budget_bytes} holds no token: one takes {per_token:g} bytes "
                          "per layer here (raise budget_bytes, or store the cache in a smaller format)")  # fmt: skip
    return dataclasses.replace(memory, budget=tokens, budget_bytes=None)


def knorm_scores(k: torch.Tensor) -> torch.Tensor:
    """k (B, H_kv, S, D) -> (B, H_kv, S): minus each key's L2 norm (in fp32)."""
    return -torch.linalg.vector_norm(k.float(), dim=-1)


def tova_scores(q: torch.Tensor, k: torch.Tensor, visible: torch.Tensor, scale: float) -> torch.Tensor:
    """The newest query's attention averaged over every query head, for each KV head alike; the newest key
    (the last column) scored +inf. q (B, H, 1, D) the newest query, k (B, H_kv, S, D), visible (B, H_kv, S)."""
    logits = grouped_logits(q, k, scale)[..., 0, :]  # (B, H_kv, G, S)
    logits = logits.masked_fill(~visible[:, :, None], float("-inf"))
    probs = logits.softmax(dim=-1).flatten(1, 2)  # (B, H, S)
    scores = probs.mean(dim=1, keepdim=True).expand(-1, k.shape[1], -1).clone()  # (B, H_kv, S)
    scores[..., -1] = float("inf")
    return scores


def snapkv_scores(q: torch.Tensor, k: torch.Tensor, visible: torch.Tensor, scale: float, kernel_size: int,
                  in_window: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """SnapKV's scores: q (B, H, w, D) the observation window's queries; k (B, H_kv, S, D); visible (B, H_kv, w, S)
    what each window query sees; in_window (B, H_kv, S) the held tokens that are the window's own (by default the
    newest min(w, S)). Returns (B, H_kv, S).

    The window's tokens score 2 + their slot index: above any pooled probability (<= 1), so they are kept first,
    and newest first when fewer than the window can be kept (a prompt no longer than the window, or a decode-mode
    budget below it); when the budget covers the window this keeps what kvpress's +inf keeps. Their columns are
    zeroed before the pooling, which is kvpress's zero padding of the columns before the window."""
    batch, n_kv, length = k.shape[0], k.shape[1], k.shape[2]
    if in_window is None:
        in_window = (torch.arange(length, device=k.device) >= length - q.shape[2]).expand(batch, n_kv, length)
    logits = grouped_logits(q, k, scale).masked_fill(~visible[:, :, None], float("-inf"))  # (B, H_kv, G, w, S)
    # A decode-mode window query whose keys were all dropped sees nothing (a NaN row): it adds nothing.
    probs = logits.softmax(dim=-1).nan_to_num(0.0)
    probs = probs.masked_fill(in_window[:, :, None, None], 0.0)  # the window's columns dropped, not renormalised
    scores = probs.mean(dim=-2)  # (B, H_kv, G, S): the mean over the window's queries
    group = scores.shape[2]
    pooled = F.avg_pool1d(scores.reshape(batch, n_kv * group, length), kernel_size, stride=1,
                          padding=kernel_size // 2)  # fmt: skip
    scores = pooled.reshape(batch, n_kv, group, length).mean(dim=2)  # (B, H_kv, S)
    ramp = 2.0 + torch.arange(length, dtype=scores.dtype, device=scores.device)
    return torch.where(in_window, ramp, scores)


class PressCache(LayerCache):
    """Every buffer of the layout per KV head, (B, H_kv, S, width) (H_kv = 1 for MLA's shared latent), with each
    slot's position per head, (B, H_kv, S); a press drops slots per KV head after a chunk's attention."""

    selects = True  # `resolve` gets the queries: it scores the held keys and drops the worst after the chunk
    per_sequence = True

    def __init__(self, layout, batch: int, memory: MemoryConfig, dtype: torch.dtype, device=None,
                 max_len: int | None = None, policy: KVPolicy | None = None):  # fmt: skip
        super().__init__(layout)
        self.memory, self.max_len, self.dtype, self.seen = memory, max_len, dtype, 0
        self.policy = policy  # (named by a refusal: attnlab.cache.codecs.KVValueError)
        heads = layout.heads
        self.buffers = {name: torch.zeros(batch, heads, 0, layout.buffer_width(name), dtype=dtype, device=device)
                        for name, _ in layout.buffers}  # fmt: skip
        # With a KV policy each field of each KV head is stored per token in its format: (B * H_kv, S, ...) arrays
        # (a head keeps its own tokens, so a token's row cannot span the heads as in the other quantized caches).
        self.codecs = press_codecs(layout, policy, FORMAT_OF_DTYPE[dtype]) if policy is not None else None
        self.memory = memory = resolve_budget(memory, token_bytes(layout, self.codecs, dtype.itemsize))
        self.capacity = memory.slots
        if self.codecs is not None:
            self.buffers = {}
            self.arrays = {name: codec.allocate(batch * heads, 0, device) for name, codec in self.codecs.items()}
        self.slot_positions = torch.zeros(batch, heads, 0, dtype=torch.long, device=device)
        self.window_queries: torch.Tensor | None = None  # snapkv in decode mode: the last window_size queries
        self.window_positions: torch.Tensor | None = None
        self._chunk: tuple[torch.Tensor, bool] | None = None  # the chunk's positions, and whether it compresses

    def positions(self) -> torch.Tensor:
        """(B, H_kv, S): each KV head holds its own tokens."""
        return self.slot_positions

    def nbytes(self) -> int:
        if self.codecs is not None:
            return sum(a.nbytes for arrays in self.arrays.values() for a in arrays)
        return sum(b.nbytes for b in self.buffers.values())

    def overhead_nbytes(self) -> int:
        queries = 0 if self.window_queries is None else self.window_queries.nbytes + self.window_positions.nbytes
        return self.slot_positions.nbytes + queries

    def update(self, new: dict[str, torch.Tensor], positions: torch.Tensor, write: Write | None = None):
        start, length = self.seen, positions.shape[0]
        if self.max_len is not None and start + length > self.max_len:
            raise InputError(f"KV cache is full: {start + length} tokens exceed its max_len={self.max_len} "
                             "(make a larger cache)")  # fmt: skip
        headless = self.layout.kv_heads is None
        batch, heads = self.slot_positions.shape[:2]
        held = {}
        if self.codecs is not None:
            held = self._append_stored(new)
        for name, t in new.items() if self.codecs is None else ():
            t = four(t)  # (B, H_kv, T, width)
            held[name] = torch.cat((self.buffers[name].to(t.dtype), t), dim=2)
            self.buffers[name] = held[name].detach().to(self.dtype)
        self.slot_positions = torch.cat((self.slot_positions, positions.expand(batch, heads, -1)), dim=2)
        self.seen += length
        compress = start == 0 if self.memory.press_at == "prefill" else True
        self._chunk = (positions, compress)
        out = {name: t[:, 0] for name, t in held.items()} if headless else held
        return out, self.slot_positions

    def mask(self, q_pos, k_pos, window=None, null=False):
        """(B, H_kv, Tq, S): a held token is visible to the queries at or after its position."""
        mask = k_pos[:, :, None, :] <= q_pos[None, None, :, None]
        return (with_null_column(mask) if null else mask), False

    @torch.no_grad()
    def resolve(self, q, k, scale, mask, null):
        """Scores the held keys k (B, H_kv, null + S, D) with the chunk's queries q (B, H, T, D) and drops the worst
        slots of each KV head (after this call the attention reads the tensors `update` returned, unchanged)."""
        positions, compress = self._chunk
        self._chunk = None
        k = k[:, :, int(null) :]
        visible = mask[..., int(null) :]  # (B, H_kv, T, S)
        kind = self.memory.kind
        if kind == "snapkv" and self.memory.press_at == "decode":
            self._remember_queries(q, positions)
        held = k.shape[2]
        kept = n_kept(self.seen if self.memory.press_at == "decode" and self.memory.budget is None else held,
                      self.memory)  # fmt: skip
        if not compress or kept >= held:
            return mask
        if kind == "knorm":
            scores = knorm_scores(k)
        elif kind == "tova":
            scores = tova_scores(q[:, :, -1:], k, visible[:, :, -1], scale)
        else:
            scores = self._snapkv(q, k, positions, visible, scale)
        self._keep(scores, kept)
        return mask

    def _snapkv(self, q, k, positions, visible, scale) -> torch.Tensor:
        """SnapKV's scores over the held keys: the chunk's last window_size queries (prefill), or the last
        window_size queries seen so far (decode), each seeing the held keys at or before its position."""
        if self.window_queries is None:
            window = min(self.memory.window_size, q.shape[2])
            return snapkv_scores(q[:, :, -window:], k, visible[:, :, -window:], scale, self.memory.kernel_size)
        query_positions = self.window_positions
        k_pos = self.slot_positions
        seen = k_pos[:, :, None, :] <= query_positions[None, None, :, None]  # (B, H_kv, w, S)
        # The window's own tokens are those held at its queries' positions (some may have been dropped already).
        in_window = k_pos >= query_positions.min()
        return snapkv_scores(self.window_queries.to(q.dtype), k, seen, scale, self.memory.kernel_size, in_window)

    def _remember_queries(self, q: torch.Tensor, positions: torch.Tensor) -> None:
        window = self.memory.window_size
        if self.window_queries is None:
            self.window_queries, self.window_positions = q[:, :, -window:], positions[-window:]
            return
        self.window_queries = torch.cat((self.window_queries, q), dim=2)[:, :, -window:]
        self.window_positions = torch.cat((self.window_positions, positions))[-window:]

    def _keep(self, scores: torch.Tensor, kept: int) -> None:
        """Keeps the `kept` best slots of each KV head (scores (B, H_kv, S)), in position order."""
        index = scores.topk(kept, dim=-1).indices.sort(dim=-1).values  # (B, H_kv, kept)
        self.slot_positions = self.slot_positions.gather(2, index)
        for name, b in self.buffers.items():
            self.buffers[name] = b.gather(2, index[..., None].expand(-1, -1, -1, b.shape[-1]))
        if self.codecs is not None:
            rows = index.flatten(0, 1)  # (B * H_kv, kept)
            for name, arrays in self.arrays.items():
                self.arrays[name] = [a.gather(1, _rows_index(rows, a)) for a in arrays]

    def _append_stored(self, new: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Each field of the new tokens encoded into its arrays; returns every held token of each buffer as stored
        (decoded), (B, H_kv, S, width): the attention and the press read the stored keys, as llama.cpp's do."""
        held = {}
        for buffer, fields in self.layout.buffers:
            t = four(new[buffer])  # (B, H_kv, T, width)
            batch, heads, length, _ = t.shape
            parts = []
            for field in fields:
                _, lo, hi = self.layout.slices[field.name]
                codec = self.codecs[field.name]
                rows = t[..., lo:hi].detach().reshape(batch * heads, length, hi - lo).contiguous()
                arrays = self.arrays[field.name]
                self.arrays[field.name] = [torch.cat((a, e), dim=1) for a, e in zip(arrays, codec.encode(rows),
                                                                                       strict=True)]  # fmt: skip
                parts.append(codec.decode(self.arrays[field.name], t.dtype).view(batch, heads, -1, hi - lo))
            held[buffer] = torch.cat(parts, dim=-1)
        return held


def _rows_index(rows: torch.Tensor, array: torch.Tensor) -> torch.Tensor:
    """rows (N, kept) as a gather index along axis 1 of an (N, S, ...) storage array."""
    return rows.view(*rows.shape, *[1] * (array.dim() - 2)).expand(-1, -1, *array.shape[2:])


def press_codecs(layout, policy: KVPolicy, default: str) -> dict[str, Codec]:
    """The codec of each field of a press's slots under `policy`: rows of one KV head's values (a head keeps its own
    tokens); ConfigError for a per-channel format (several tokens quantized together), a residual window or a
    flush (every slot is stored in its format as it comes), and a block format wider than a head's row allows."""
    policy.check([f.name for f in layout.fields])
    problems = []
    if policy.resid or policy.flush != 1:
        problems.append(f"kv policy {policy}: a press stores every token in its format as it comes (leave resid and "
                        "flush out)")  # fmt: skip
    codecs = {}
    for f in layout.fields:
        fmt = policy.format_of(f.name, default)
        try:
            codecs[f.name] = Codec(fmt, f.width, f.name.startswith("k"), policy.group_size, f.name)
        except ConfigError:  # a block format: rows of 32 values
            problems.append(f"kv policy {f.name}={fmt}: a press stores each KV head's {f.width} values of {f.name} "
                            "on their own, not a multiple of the format's 32-value blocks (use fp16 or bf16 for "
                            "it)")  # fmt: skip
            continue
        if codecs[f.name].tokens_per_block > 1:
            problems.append(f"kv policy {f.name}={fmt} quantizes {policy.group_size} tokens together per channel, "
                            "but a press drops single tokens (use a per-token format: fp16, bf16, q8_0, q4_0, "
                            "nf4)")  # fmt: skip
    if problems:
        raise ConfigError(problems)
    return codecs
