"""The attention variants, keyed by `attention.kind`. A new variant is one file and one line here."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from torch import nn

from attnlab.attention.bottleneck import Bottleneck, BottleneckConfig
from attnlab.attention.coda import CoDA, CoDAConfig
from attnlab.attention.decoupled import Decoupled, DecoupledConfig
from attnlab.attention.differential import DiffConfig, Differential
from attnlab.attention.mha import MHA, MHAConfig
from attnlab.attention.mla import MLA, MLAConfig
from attnlab.attention.sliding import Sliding, SlidingConfig
from attnlab.config import AttentionConfig, ModelConfig
from attnlab.config_checks import build_collecting, dataclass_kwargs, unknown_key_problem
from attnlab.paths import brief


class Kind(StrEnum):
    MHA = "mha"
    BOTTLENECK = "bottleneck"
    DECOUPLED = "decoupled"
    SLIDING = "sliding"
    MLA = "mla"
    DIFF = "diff"
    CODA = "coda"


@dataclass(frozen=True)
class Variant:
    config: type
    module: type
    summary: str
    layer_index: bool = False  # the module's constructor takes layer_index= (its maths depends on depth)

    def build(self, model: ModelConfig, layer_index: int) -> nn.Module:
        """The attention module of layer `layer_index` (0-based) of `model`."""
        return self.module(model, layer_index=layer_index) if self.layer_index else self.module(model)


REGISTRY: dict[str, Variant] = {
    Kind.MHA: Variant(MHAConfig, MHA, "standard multi-head attention; n_kv_heads < n_heads = GQA, 1 = MQA"),
    Kind.BOTTLENECK: Variant(BottleneckConfig, Bottleneck, "Q/K/V projected to d_attn < d_model, optional null token"),
    Kind.DECOUPLED: Variant(DecoupledConfig, Decoupled, "DBA: low-rank semantic path + RoPE geometric path"),
    Kind.SLIDING: Variant(SlidingConfig, Sliding, "causal attention over the last `window` positions, ring cache"),
    Kind.MLA: Variant(MLAConfig, MLA, "multi-head latent attention: cache a d_latent latent + d_rope key"),
    Kind.DIFF: Variant(DiffConfig, Differential, "DIFF V1: softmax(q1 k1) - lambda softmax(q2 k2)", layer_index=True),
    Kind.CODA: Variant(CoDAConfig, CoDA, "CoDA: signal minus gated inhibitory stream from a rotated query"),
}


def parse_attention(data: Any, problems: list[str]) -> AttentionConfig | None:
    """The `attention:` section as its kind's config; problems are appended (every one at once)."""
    if not isinstance(data, dict):
        problems.append(f"attention must be a mapping with a 'kind', got {type(data).__name__}")
        return None
    kind = data.get("kind", "mha")
    if not isinstance(kind, str):
        problems.append(f"attention.kind={brief(kind)} must be str, got {type(kind).__name__} "
                        f"(one of: {', '.join(REGISTRY)})")  # fmt: skip
        return None
    if kind not in REGISTRY:
        problems.append(unknown_key_problem(kind, list(REGISTRY), "attention.kind=", "value"))
        return None
    cls = REGISTRY[kind].config
    fields_of = {name: {f.name for f in dataclasses.fields(v.config)} for name, v in REGISTRY.items()}
    misplaced = {}  # a real option of another kind: say whose, rather than guess a near name
    for key in data:
        if key != "kind" and key not in fields_of[kind]:
            owners = [name for name, names in fields_of.items() if key in names]
            if owners:
                misplaced[key] = owners
                problems.append(f"attention.{key} belongs to attention kind {' or '.join(owners)}, not {kind} "
                                f"(set attention.kind: {owners[0]}, or remove {key})")  # fmt: skip
    data = {key: value for key, value in data.items() if key not in misplaced}
    kwargs = dataclass_kwargs(cls, data, "attention.", problems, skip=("kind",))
    return None if problems else build_collecting(cls, kwargs, problems)
