"""The entry points' logging set-up (comera_rec/utils/logs.py)."""

import logging

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
