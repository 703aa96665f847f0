"""The entry points' logging set-up (comera_rec/utils/logs.py)."""

import logging
import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.fx._symbolic_trace as symbolic_trace

from comera_rec.utils.logs import (
    FOREIGN_NOTICE_LOGGERS,
    PROFILER_BANNER,
    quiet_foreign_notices,
    quiet_profiler_banners,
    state_sparse_invariant_checks,
)


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
        (FutureWarning, "something else is deprecated"),
        (UserWarning, "`broadcast_buffers` is deprecated"),
    ]


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


SHOW_INFO = """
import logging
import torchrec  # imports fbgemm_gpu, which installs a root handler at WARNING
from comera_rec.utils.logs import setup_logging
setup_logging()
logging.getLogger("comera_rec.demo").info("shown")
logging.getLogger("torchrec.demo").info("not shown: another library's INFO")
logging.getLogger("torchrec.demo").warning("shown too")
"""


@pytest.mark.parametrize("env, prefix", [({}, ""), ({"WORLD_SIZE": "2", "RANK": "1"}, " [rank 1]")])
def test_setup_logging_shows_info_after_torchrec_import(env, prefix):
    import os
    import subprocess
    import sys

    run_env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK")} | env
    proc = subprocess.run([sys.executable, "-c", SHOW_INFO], capture_output=True, text=True, env=run_env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if "comera_rec.demo" in line]
    assert len(lines) == 1 and lines[0].endswith(f"{prefix} INFO comera_rec.demo: shown"), proc.stderr[-2000:]
    foreign = [line for line in proc.stderr.splitlines() if "torchrec.demo" in line]
    assert len(foreign) == 1 and foreign[0].endswith(f"{prefix} WARNING torchrec.demo: shown too"), proc.stderr[-2000:]


BANNER = b"USDT:2026-12-05 00:29:12 11488:11488 SyncActivityProfilerHandler.cpp:52] profiler_start\n"


def test_profiler_banners_are_dropped_and_other_lines_kept_in_order(capfd):
    with quiet_profiler_banners():
        os.write(2, b"first\n" + BANNER + b"second\n")
        os.write(2, BANNER.replace(b"USDT", b"STAGE").replace(b"profiler_start", b"Completed Stage: Warm Up"))
        os.write(2, b"USDT is named here but this is not a banner\n")
    assert capfd.readouterr().err == "first\nsecond\nUSDT is named here but this is not a banner\n"
    os.write(2, BANNER)  # after the block stderr is as before
    assert capfd.readouterr().err == BANNER.decode()


def test_profiler_banners_pass_on_an_error_raised_in_the_block(capfd):
    with pytest.raises(ValueError, match="inside"), quiet_profiler_banners():
        os.write(2, b"kept\n" + BANNER)
        raise ValueError("inside")
    assert capfd.readouterr().err == "kept\n"


def test_torch_profiler_writes_banners_the_pattern_names(capfd):
    def profiled() -> None:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
            torch.ones(4).sum()

    profiled()
    lines = capfd.readouterr().err.encode().splitlines(keepends=True)
    # torch's profiler still writes them, and in the form the pattern names
    assert any(PROFILER_BANNER.match(line) for line in lines), lines
    with quiet_profiler_banners():
        profiled()
    assert not any(PROFILER_BANNER.match(line) for line in capfd.readouterr().err.encode().splitlines())


def fresh_python(code: str) -> str:
    """What ``code`` prints in a new interpreter, which must exit cleanly."""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_profiler_banners_run_the_block_when_stderr_is_closed():
    # a daemon may run with file descriptor 2 closed: nothing to hold, the block still runs
    code = (
        "import os; os.close(2)\n"
        "from comera_rec.utils.logs import quiet_profiler_banners\n"
        "with quiet_profiler_banners():\n"
        "    print('ran')\n"
    )
    assert fresh_python(code) == "ran\n"


def test_sparse_invariant_checks_kept_on_where_the_process_turned_them_on():
    checks = torch.sparse.check_sparse_tensor_invariants
    try:
        checks.enable()
        state_sparse_invariant_checks()
        assert checks.is_enabled()
    finally:
        checks.disable()


@pytest.mark.parametrize("stated", [True, False])
def test_sparse_adagrad_warns_only_while_the_checks_are_left_implicit(stated: bool):
    # a fresh process: torch warns once per process, and only while nobody has said either way
    code = (
        "import warnings, torch\n"
        "from comera_rec.utils.logs import state_sparse_invariant_checks\n"
        + ("state_sparse_invariant_checks()\n" if stated else "")
        + "table = torch.nn.EmbeddingBag(10, 4, sparse=True)\n"
        "table(torch.tensor([1, 2]), torch.tensor([0])).sum().backward()\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    torch.optim.Adagrad(table.parameters()).step()\n"
        "print(sum('implicitly disabled' in str(w.message) for w in caught))\n"
    )
    assert fresh_python(code).strip() == ("0" if stated else "1")
