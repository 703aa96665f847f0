"""Configs that cannot run to their end fail before training starts, with an error naming
the config field, and leave nothing behind: no log.jsonl, no checkpoints, no model built."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from comera_rec.config import ConfigError
from comera_rec.data import DataConfig
from comera_rec.dlrm.task import DLRMTask, load_run_config
from comera_rec.rank import RankScheduleConfig
from comera_rec.training import OptimConfig, Trainer, TrainerConfig
from launch.train_dlrm import main
from tests.reliability.helpers import DEMO, TINY
from tests.training.toy_task import ToyTask

RUN = TINY + ["trainer.max_steps=2"]


class CountingToyTask(ToyTask):
    """The toy task, counting build_model calls: 0 means the run stopped before any set-up."""

    def __init__(self) -> None:
        super().__init__(batches_per_epoch=5)
        self.builds = 0

    def build_model(self, device: torch.device) -> torch.nn.Module:
        self.builds += 1
        return super().build_model(device)


def toy_fit(run_dir: Path, **trainer_kw: object) -> tuple[CountingToyTask, Trainer]:
    """Run the toy task for 2 steps into ``run_dir``; returns the task and the trainer."""
    kw: dict = dict(run_dir=str(run_dir), max_steps=2, log_every=1, progress=False, plots=False, seed=1)
    kw.update(trainer_kw)
    task = CountingToyTask()
    trainer = Trainer(
        task,
        TrainerConfig(**kw),
        RankScheduleConfig(truncate_every=0),
        OptimConfig(lr_cores=1e-2, lr_controllers=1e-2, lr_other=1e-2),
    )
    trainer.fit()
    return task, trainer


def assert_nothing_trained(run_dir: Path) -> None:
    assert not (run_dir / "log.jsonl").exists()
    assert not (run_dir / "summary.json").exists()
    ckpts = run_dir / "checkpoints"
    assert not ckpts.is_dir() or not list(ckpts.glob("step_*"))


# ----------------------------------------------------------------- silent cases, now named


@pytest.mark.parametrize("text", ["", "# only a comment\n\n"])
def test_empty_config_file_is_an_error_naming_the_file(tmp_path: Path, text: str) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=rf"{path}: the config file is empty"):
        load_run_config(str(path))
    run_dir = tmp_path / "run"
    with pytest.raises(ConfigError, match="is empty"):
        main(["--config", str(path), f"trainer.run_dir={run_dir}"])
    assert not run_dir.exists()


@pytest.mark.parametrize("value", ["", "' '"])
def test_empty_run_dir_is_an_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.chdir(tmp_path)  # where an empty run_dir used to write
    with pytest.raises(ConfigError, match=r"trainer\.run_dir.* is empty.*working directory"):
        main(["--config", DEMO, *RUN, f"trainer.run_dir={value}"])
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match=r"trainer\.run_dir"):
        TrainerConfig(run_dir="")


@pytest.mark.parametrize(
    "override,field",
    [
        ("data.batch_size=0", "data.batch_size"),
        ("data.batch_size=-8", "data.batch_size"),
        ("data.val_batch_size=0", "data.val_batch_size"),
    ],
)
def test_batch_size_below_one_is_refused_at_config_load(override: str, field: str) -> None:
    with pytest.raises(ConfigError, match=rf"{field} must be an integer >= 1"):
        load_run_config(DEMO, [*RUN, override])
    with pytest.raises(ValueError, match=r"data\.batch_size"):  # built directly, too
        DataConfig(batch_size=0)
    assert DataConfig(batch_size=1, val_batch_size=None).batch_size == 1


def test_resume_without_a_checkpoint_is_an_error_naming_the_folder(tmp_path: Path) -> None:
    typo = tmp_path / "rnu"
    with pytest.raises(
        FileNotFoundError,
        match=rf"{typo / 'checkpoints'} does not exist.*trainer\.run_dir"
        r".*trainer\.resume_missing_ok=true",
    ):
        main(["--config", DEMO, "--resume", *RUN, f"trainer.run_dir={typo}"])
    assert not typo.exists()  # not even created

    # the engine, on the toy task: an existing folder without a complete checkpoint
    run = tmp_path / "run"
    (run / "checkpoints" / ".tmp-step_000000002").mkdir(parents=True)
    task = CountingToyTask()
    trainer = Trainer(task, TrainerConfig(run_dir=str(run), resume=True, max_steps=2, progress=False, plots=False))
    with pytest.raises(FileNotFoundError, match=r"checkpoints holds no complete checkpoint"):
        trainer.fit()
    assert task.builds == 0
    assert_nothing_trained(run)


def test_resume_missing_ok_starts_afresh(tmp_path: Path) -> None:
    task, trainer = toy_fit(tmp_path / "run", resume=True, resume_missing_ok=True)
    assert trainer.step == 2 and (tmp_path / "run" / "log.jsonl").is_file()
    # and with a checkpoint there, it resumes as before
    _, resumed = toy_fit(tmp_path / "run", resume=True, resume_missing_ok=True, max_steps=3)
    assert len(resumed.losses) == 1 and resumed.step == 3


def test_torchrun_restart_without_a_checkpoint_stays_lenient(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # a worker restarted by torchrun before the first checkpoint: resume is implied, none is there yet
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    _, trainer = toy_fit(tmp_path / "run", resume=True)
    assert trainer.step == 2


# ----------------------------------------------------------------- fail fast, before training


@pytest.mark.parametrize("eval_every", [0, 5])
def test_no_validation_set_fails_before_training(tmp_path: Path, eval_every: int) -> None:
    train = tmp_path / "day_0.tsv"
    train.write_text("")  # never read: the check comes first
    run_dir = tmp_path / "run"
    args = [
        "--config",
        DEMO,
        *RUN,
        "data.source=tsv",
        f"data.train_paths=[{train}]",
        "data.holdout=none",
        f"trainer.eval_every={eval_every}",
        f"trainer.run_dir={run_dir}",
    ]
    expected = r"no validation set \(data\.holdout='none' and data\.val_paths is empty\).*"
    expected += r"every trainer\.eval_every=5 steps" if eval_every else r"at the end of the run"
    with pytest.raises(ValueError, match=expected):
        main(args)
    assert not run_dir.exists()
    with pytest.raises(ValueError, match=r"data\.val_paths"):
        DLRMTask(load_run_config(DEMO, args[2:]))
    # a hold-out or validation files make it valid
    DLRMTask(load_run_config(DEMO, args[2:] + ["data.holdout=kaggle"]))
    DLRMTask(load_run_config(DEMO, args[2:] + [f"data.val_paths=[{train}]"]))


def test_run_dir_that_cannot_be_written_fails_before_training(tmp_path: Path) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("in the way")
    task = CountingToyTask()
    trainer = Trainer(task, TrainerConfig(run_dir=str(blocker / "run"), max_steps=2, progress=False, plots=False))
    with pytest.raises(OSError, match=rf"trainer\.run_dir=.*cannot write into {blocker / 'run'}"):
        trainer.fit()
    assert task.builds == 0


def test_checkpoints_folder_that_cannot_be_written_fails_before_training(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "checkpoints").write_text("a file where the folder goes")
    task = CountingToyTask()
    trainer = Trainer(task, TrainerConfig(run_dir=str(run), max_steps=2, progress=False, plots=False))
    with pytest.raises(
        OSError,
        match=r"checkpoints are on \(trainer\.checkpoint_at_end.*cannot write into "
        rf"{run / 'checkpoints'}",
    ):
        trainer.fit()
    assert task.builds == 0
    assert not (run / "log.jsonl").exists()
    # without checkpoints the folder is never needed: the run trains
    _, trained = toy_fit(run, checkpoint_at_end=False, checkpoint_every=0)
    assert trained.step == 2


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root writes into read-only folders")
def test_read_only_run_dir_fails_before_training(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    run.chmod(0o500)
    try:
        task = CountingToyTask()
        trainer = Trainer(task, TrainerConfig(run_dir=str(run), max_steps=2, progress=False, plots=False))
        with pytest.raises(OSError, match=rf"cannot write into {run}"):
            trainer.fit()
        assert task.builds == 0
    finally:
        run.chmod(0o700)


def test_cuda_device_without_cuda_is_a_named_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for device in ("cuda", "cuda:1"):
        task = CountingToyTask()
        trainer = Trainer(
            task, TrainerConfig(run_dir=str(tmp_path / "run"), device=device, max_steps=2, progress=False, plots=False)
        )
        with pytest.raises(
            ValueError,
            match=rf"trainer\.device='{device}' asks for a GPU, but CUDA is not "
            r"available.*trainer\.device=cpu",
        ):
            trainer.fit()
        assert task.builds == 0
    assert not (tmp_path / "run").exists()
    # a GPU index past the machine's devices
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    trainer = Trainer(
        CountingToyTask(), TrainerConfig(run_dir=str(tmp_path / "run"), device="cuda:3", progress=False, plots=False)
    )
    with pytest.raises(ValueError, match=r"trainer\.device='cuda:3', but this machine has 1 CUDA device"):
        trainer.fit()
