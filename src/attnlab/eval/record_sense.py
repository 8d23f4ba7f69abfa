"""Figures of a memory or kv_quant record that are each possible alone but not in the record they are in (probe AD7):
a table would show them side by side, contradicting each other. A record like that was changed by hand."""

from __future__ import annotations

import json
import math

KL_SLACK = 1e-6  # a KL divergence is >= 0; float sums over near-identical distributions may leave it a hair below


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _finite(*values) -> bool:  # (NaN: a figure shown as such, whatever stands beside it)
    return all(_number(v) and math.isfinite(v) for v in values)


def _shown(value) -> str:
    return json.dumps(value)[:40]


def figures_problem(record: dict) -> str | None:
    """Why a memory record's length (a cache of 0 tokens is not measured) or its stored `kv_matches_analytic` (beside
    its two byte counts), or a kv_quant record's bytes (a policy stores every token in some bytes) or KL (a
    divergence, >= 0) cannot be, or None (missing fields and fields of the wrong kind are said elsewhere)."""
    if record.get("benchmark") == "memory":
        if record.get("length") == 0:
            return "field 'length' is 0, which is impossible (a cache of 0 tokens is not measured)"
        measured, analytic, equal = (record.get(f) for f in ("kv_bytes", "kv_bytes_analytic", "kv_matches_analytic"))
        if _finite(measured, analytic) and isinstance(equal, bool) and equal != (measured == analytic):
            return (f"field 'kv_matches_analytic' is {_shown(equal)}, which is impossible beside 'kv_bytes' "
                    f"{_shown(measured)} and 'kv_bytes_analytic' {_shown(analytic)} (it says whether they are "
                    "equal)")  # fmt: skip
    if record.get("benchmark") == "kv_quant":
        for field in ("bytes_per_token", "vs_full"):
            if record.get(field) == 0:
                return f"field '{field}' is 0, which is impossible (a policy stores every token in some bytes)"
        kl = record.get("kl")
        if _number(kl) and kl < -KL_SLACK:
            return f"field 'kl' is {_shown(kl)}, which is impossible (a KL divergence is >= 0)"
    return None
