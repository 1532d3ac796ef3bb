"""engine/host_memory.py: the allocator setting is applied once, and the CPU engine applies it unless told not to.

What it buys (page faults and time per decode step) is measured in docs/benchmarks/host_memory.md,
not here."""
from __future__ import annotations

import sys

import pytest

from dspark.engine import host_memory


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mallopt is glibc's")
def test_the_setting_is_in_force_under_glibc_and_applied_once():
    first = host_memory.retain_freed_memory()
    assert first is True
    assert host_memory.retain_freed_memory() is first


@pytest.mark.parametrize("retain", [True, False])
def test_the_cpu_engine_keeps_freed_memory_unless_its_config_says_not_to(monkeypatch, tiny_target, retain):
    from dspark.engine.runtime import EngineConfig, SpecEngine

    calls = []
    monkeypatch.setattr(host_memory, "retain_freed_memory", lambda: calls.append(1) or True)
    SpecEngine(tiny_target, None, EngineConfig(mode="target_only", max_batch=2, retain_host_memory=retain))
    assert calls == ([1] if retain else [])
