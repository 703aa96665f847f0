"""The generic YAML + overrides config loader."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import pytest

from comera_rec.config import ConfigError, load_config, parse_override, save_config, to_dict
from comera_rec.rank import RankScheduleConfig
from comera_rec.training import OptimConfig, TrainerConfig


@dataclass
class RunConfig:
    """A run of the toy trainer."""

    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """The loop."""
    schedule: RankScheduleConfig = field(default_factory=RankScheduleConfig)
    """The rank schedule."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """The optimiser."""
    tables: list[int] = field(default_factory=lambda: [10, 20])
    """Table sizes."""
    note: Optional[str] = None
    """Free text."""


def test_defaults_and_overrides(tmp_path):
    cfg = load_config(
        RunConfig,
        None,
        ["optim.lr_cores=0.5", "trainer.max_steps=7", "tables=[1, 2, 3]", "schedule.switch=plateau", "note=hello"],
    )
    assert cfg.optim.lr_cores == 0.5 and cfg.trainer.max_steps == 7
    assert cfg.tables == [1, 2, 3] and cfg.schedule.switch == "plateau" and cfg.note == "hello"
    assert cfg.optim.betas == (0.9, 0.999)


def test_yaml_file_then_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("trainer:\n  max_steps: 12\n  run_dir: runs/x\noptim:\n  lr_other: 1e-5\n  betas: [0.8, 0.9]\n")
    cfg = load_config(RunConfig, path, ["trainer.max_steps=3"])
    assert cfg.trainer.max_steps == 3 and cfg.trainer.run_dir == "runs/x"
    assert cfg.optim.lr_other == 1e-5 and cfg.optim.betas == (0.8, 0.9)
    out = tmp_path / "saved.yaml"
    save_config(cfg, out)
    assert to_dict(load_config(RunConfig, out)) == to_dict(cfg)


def test_unknown_key_lists_valid_keys(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("trainer:\n  max_step: 3\n")
    with pytest.raises(ConfigError, match=r"'trainer.max_step'.*max_steps.*eval_every"):
        load_config(RunConfig, path)
    with pytest.raises(ConfigError, match=r"'optimizer'.*trainer, schedule, optim, tables, note"):
        load_config(RunConfig, None, ["optimizer.lr=1"])
    with pytest.raises(ConfigError, match=r"'optim.learning_rate'.*lr_cores"):
        load_config(RunConfig, None, ["optim.learning_rate=1"])


def test_type_and_value_errors():
    with pytest.raises(ConfigError, match=r"trainer.max_steps.*integer.*'many'"):
        load_config(RunConfig, None, ["trainer.max_steps=many"])
    with pytest.raises(ConfigError, match=r"tables\[1\].*integer"):
        load_config(RunConfig, None, ["tables=[1, x]"])
    with pytest.raises(ConfigError, match=r"'sometimes'"):
        load_config(RunConfig, None, ["schedule.switch=sometimes"])
    with pytest.raises(ConfigError, match="key.sub=value"):
        parse_override("trainer.max_steps")
    with pytest.raises(ConfigError, match="tables: expected a list"):
        load_config(RunConfig, None, ["tables.x=1"])


def test_top_level_must_be_mapping(tmp_path):
    path = tmp_path / "list.yaml"
    path.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(RunConfig, path)


def test_autocast_takes_the_named_dtypes_only():
    assert TrainerConfig().autocast == "none"
    assert load_config(RunConfig, None, ["trainer.autocast=bfloat16"]).trainer.autocast == "bfloat16"
    with pytest.raises(ValueError, match=r"trainer.autocast\) must be one of none, bfloat16, got 'fp8'"):
        TrainerConfig(autocast="fp8")
    with pytest.raises(ValueError, match="autocast with cuda_graphs has not been run on a GPU"):
        TrainerConfig(autocast="bfloat16", cuda_graphs=True)
