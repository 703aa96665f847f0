"""Fixtures of the integration tests."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from comera_rec.integration import destroy_distributed


@pytest.fixture
def gloo(tmp_path):
    """A one-process gloo group (world size 1), destroyed afterwards."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    yield
    destroy_distributed()
