"""Fixtures of the MoE backend tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def grouped_mm_calls(monkeypatch):
    """Counts `torch._grouped_mm` calls (the large-batch routes make three a forward, per expert group for FP4)."""
    calls = []
    real = torch._grouped_mm

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "_grouped_mm", spy)
    return calls
