"""Probe S's findings still open at stop 34, fixed after it: a bounded memory's gate thresholds accepted under
write_policy none, where every token's gate is 1 and passes any threshold (s1)."""

from __future__ import annotations

import pytest

from attnlab.config import ConfigError
from attnlab.config_memory import MEMORY_PRESETS, MemoryConfig

BOUNDED = {"kind": "bounded", "recent_window": 16, "exact_slots": 8, "summary_slots": 8}


@pytest.mark.parametrize("preset", sorted(MEMORY_PRESETS))
@pytest.mark.parametrize("key", ["tau_gate", "tau_gate_summary"])
def test_s1_gate_threshold_without_a_gate_is_refused(preset, key):
    with pytest.raises(ConfigError) as caught:
        MemoryConfig(**BOUNDED, preset=preset, write_policy="none", **{key: 0.3})
    assert f"memory.{key}=0.3 does nothing with memory.write_policy: none" in str(caught.value)
    # With the gate on, the same threshold is used, and is accepted.
    assert getattr(MemoryConfig(**BOUNDED, preset=preset, write_policy="gated", **{key: 0.3}), key) == 0.3


@pytest.mark.parametrize("preset", sorted(MEMORY_PRESETS))
def test_s1_a_saved_ungated_memory_reads_back(preset):
    """A saved config carries the preset's tau_gate (to_dict keeps it): reading it back is not refused."""
    saved = MemoryConfig(**BOUNDED, preset=preset, write_policy="none").to_dict()
    assert saved["tau_gate"] == MEMORY_PRESETS[preset]["tau_gate"]
    assert MemoryConfig(**saved).to_dict() == saved
