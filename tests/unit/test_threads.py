"""The engine states the thread budget it runs under."""
from __future__ import annotations

import pytest
import torch

from dspark.engine import threads


def test_configure_sets_the_count_and_zero_keeps_torchs_choice():
    before = torch.get_num_threads()
    try:
        assert threads.configure(0) == before
        assert threads.configure(1) == 1 == torch.get_num_threads()
        info = threads.describe()
        assert info["threads"] == 1 and info["cores"] >= 1 and info["pinning"]
    finally:
        torch.set_num_threads(before)
    with pytest.raises(ValueError, match="threads must be >= 0"):
        threads.configure(-1)
