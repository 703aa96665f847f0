"""Shared test settings: deterministic, small, and no stray files in TMPDIR."""

import os

import pytest
import torch
from hypothesis import settings

settings.register_profile("ci", max_examples=25, deadline=None, derandomize=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
