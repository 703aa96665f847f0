"""The entry points' logging set-up (comera_rec/utils/logs.py)."""

import logging
import warnings

import pytest
import torch.fx._symbolic_trace as symbolic_trace

from comera_rec.utils.logs import FOREIGN_NOTICE_LOGGERS, quiet_foreign_notices


def test_torchrec_tracing_notice_is_quieted():
    # the name must still be torch's logger of that notice, or the set-up quiets nothing
    assert symbolic_trace.log.name in FOREIGN_NOTICE_LOGGERS
    logger = logging.getLogger(symbolic_trace.log.name)
    level = logger.level
    try:
        quiet_foreign_notices()
        assert not symbolic_trace.log.isEnabledFor(logging.WARNING)
        assert symbolic_trace.log.isEnabledFor(logging.ERROR)
    finally:
        logger.setLevel(level)


def test_ddp_broadcast_buffers_notice_is_ignored_and_others_kept():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_foreign_notices()  # inside catch_warnings: its filters end with the block
        warnings.warn("`broadcast_buffers` is deprecated. Use `forward_sync_buffers` instead.", FutureWarning)
        warnings.warn("something else is deprecated", FutureWarning)
        warnings.warn("`broadcast_buffers` is deprecated", UserWarning)  # another category: kept
    assert [(w.category, str(w.message)) for w in caught] == [
        (FutureWarning, "something else is deprecated"), (UserWarning, "`broadcast_buffers` is deprecated")]


def test_the_ddp_notice_is_still_what_torch_says(tmp_path):
    # the filter's text must still match torch's, or it quiets nothing
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        with pytest.warns(FutureWarning, match="^`broadcast_buffers` is deprecated"):
            DistributedDataParallel(nn.Linear(2, 2), broadcast_buffers=False)
    finally:
        dist.destroy_process_group()
