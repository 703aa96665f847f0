"""Bad input along the whole path, end to end through launch/train_dlrm.py and DLRMTask:
each case fails with an error naming what was wrong, or follows the skip policy."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from comera_rec.config import ConfigError
from comera_rec.data.readers import BadInputError
from comera_rec.data.synthetic import SyntheticCriteo, SyntheticCriteoConfig
from comera_rec.dlrm.task import DLRMTask, load_run_config
from comera_rec.integration.collection import TTMEmbeddingBagCollection
from comera_rec.training import IncompatibleCheckpointError
from launch.train_dlrm import main
from tests.reliability.helpers import DEMO, TABLE_SIZES, TINY

RUN = TINY + ["trainer.max_steps=2", "trainer.checkpoint_at_end=false"]


def write_npy(folder: Path, sparse: np.ndarray) -> str:
    """A TorchRec-layout npy triplet with the given [N, 26] ids; returns the *_dense.npy path."""
    n = sparse.shape[0]
    rng = np.random.default_rng(0)
    np.save(folder / "day_dense.npy", rng.random((n, 13), dtype=np.float32))
    np.save(folder / "day_sparse.npy", sparse.astype(np.int64))
    np.save(folder / "day_labels.npy", rng.integers(0, 2, (n, 1)).astype(np.int32))
    return str(folder / "day_dense.npy")


@pytest.mark.parametrize("feature,value", [(3, 40), (15, 10**9), (7, -5)])
def test_ids_out_of_range_from_files_name_feature_value_and_table(tmp_path: Path, feature: int, value: int) -> None:
    sparse = np.zeros((512, 26), dtype=np.int64)
    sparse[300, feature] = value
    path = write_npy(tmp_path, sparse)
    args = [
        "--config",
        DEMO,
        *RUN,
        "data.source=npy",
        f"data.train_paths=[{path}]",
        f"data.val_paths=[{path}]",
        "table_sizes_from_data=false",
        f"trainer.run_dir={tmp_path / 'run'}",
    ]
    size = TABLE_SIZES[feature]
    with pytest.raises(
        ValueError,
        match=rf"feature 'cat_{feature}' has id {value} out of range \[0, {size}\) "
        rf"of table 't_cat_{feature}'",
    ):
        main(args)
    if value < 0:  # hashing configured: the same file trains (ids are reduced modulo the table sizes)
        sizes = ",".join(map(str, TABLE_SIZES))
        # a new folder: the failed run's log is kept (a fresh start never overwrites another run's log)
        summary = main(args + [f"data.num_embeddings_per_feature=[{sizes}]", f"trainer.run_dir={tmp_path / 'run2'}"])
        assert summary["steps"] == 2


def test_malformed_data_lines_strict_and_skip(tmp_path: Path) -> None:
    path = SyntheticCriteo(SyntheticCriteoConfig(num_rows=1024)).write_tsv(tmp_path / "day_0.tsv", 1024)
    lines = path.read_text().splitlines()
    lines[5] = "1\t2\t3"  # too few fields
    fields = lines[9].split("\t")
    fields[3] = "abc"  # a non-integer dense value
    lines[9] = "\t".join(fields)
    path.write_text("\n".join(lines) + "\n")
    sizes = ",".join(map(str, TABLE_SIZES))
    args = [
        "--config",
        DEMO,
        *RUN,
        "data.source=tsv",
        f"data.train_paths=[{path}]",
        "data.holdout=none",
        f"data.val_paths=[{path}]",
        f"data.num_embeddings_per_feature=[{sizes}]",
        "table_sizes_from_data=false",
        f"trainer.run_dir={tmp_path / 'run'}",
    ]
    with pytest.raises(BadInputError, match=rf"{path.name}:6: wrong number of fields: 3, expected 40"):
        main(args + ["data.bad_input=strict"])
    assert main(args)["steps"] == 2  # skip (the default): the bad line is dropped and counted


def test_unknown_and_malformed_config(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"unknown config key 'trainer.max_stpes'.*valid keys of trainer"):
        main(["--config", DEMO, *RUN, "trainer.max_stpes=3"])
    with pytest.raises(ConfigError, match=r"trainer.max_steps"):
        main(["--config", DEMO, *RUN, "trainer.max_steps=many"])
    with pytest.raises(ConfigError, match="="):
        main(["--config", DEMO, *RUN, "trainer.max_steps"])


def test_tt_shape_that_cannot_hold_the_table(tmp_path: Path) -> None:
    with pytest.raises(
        ValueError,
        match=r"table 't_cat_0' rows: shape \[10, 10\] has product 100, which cannot "
        r"hold dimension 20000",
    ):
        main(
            [
                "--config",
                DEMO,
                *RUN,
                "model.per_table={t_cat_0: {shape: [[10, 10], [2, 4]]}}",
                f"trainer.run_dir={tmp_path}",
            ]
        )


def test_checkpoint_of_another_model_is_refused_naming_keys(tmp_path: Path) -> None:
    run = tmp_path / "run"
    main(["--config", DEMO, *TINY, "trainer.max_steps=1", f"trainer.run_dir={run}"])
    sizes = list(TABLE_SIZES)
    sizes[0], sizes[2] = 25000, 301  # a TT table whose cores still fit, a dense table one row longer
    with pytest.raises(IncompatibleCheckpointError) as err:
        main(
            [
                "--config",
                DEMO,
                "--resume",
                *TINY,
                "trainer.max_steps=2",
                f"trainer.run_dir={run}",
                f"model.table_sizes=[{','.join(map(str, sizes))}]",
            ]
        )
    text = str(err.value)
    assert "does not fit this model" in text
    assert "t_cat_2.weight: shape [300, 8] in the checkpoint, [301, 8] in the model" in text
    assert "config model.table_sizes (checkpoint [20000, 15000, 300" in text  # caught even where shapes fit
    with pytest.raises(
        IncompatibleCheckpointError,
        match=r"embedding_bags.t_cat_\d+.weight: shape \[\d+, 8\] in the "
        r"checkpoint, \[\d+, 16\] in the model",
    ):
        main(
            [
                "--config",
                DEMO,
                "--resume",
                *TINY,
                "trainer.max_steps=2",
                f"trainer.run_dir={run}",
                "model.embedding_dim=16",
                "model.bottom_mlp=[64,32,16]",
            ]
        )


# ----------------------------------------------------------------- batches into DLRMTask


@pytest.fixture(scope="module")
def task_and_model():
    task = DLRMTask(load_run_config(DEMO, TINY))
    model = task.build_model(torch.device("cpu"))
    return task, task.wrap(model)


def good_batch(task: DLRMTask, b: int = 4) -> Batch:
    values = torch.zeros(26 * b, dtype=torch.int64)
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=[f"cat_{i}" for i in range(26)], values=values, lengths=torch.ones(26 * b, dtype=torch.int32)
    )
    return Batch(dense_features=torch.rand(b, 13), sparse_features=kjt, labels=torch.ones(b))


def with_sparse(batch: Batch, **kjt_args) -> Batch:
    kjt = KeyedJaggedTensor(keys=[f"cat_{i}" for i in range(26)], **kjt_args)
    return Batch(dense_features=batch.dense_features, sparse_features=kjt, labels=batch.labels)


def test_bad_batches_through_the_task(task_and_model, lookup_path: str) -> None:
    # both validation paths: one C++ pass ("kernel") and tensor ops ("torch")
    task, wrapped = task_and_model
    b = good_batch(task)
    loss, logits, _ = task.step_loss(wrapped, b)
    assert torch.isfinite(loss) and logits.shape == (4,)
    n = 26 * 4
    with pytest.raises(TypeError, match=r"values \(ids\) must be an integer tensor, got torch.float32"):
        task.step_loss(wrapped, with_sparse(b, values=torch.zeros(n), lengths=torch.ones(n, dtype=torch.int32)))
    with pytest.raises(TypeError, match="dense_features must be float32, got torch.float64"):
        task.step_loss(wrapped, Batch(b.dense_features.double(), b.sparse_features, b.labels))
    with pytest.raises(ValueError, match=r"dense_features must have shape \[B, 13\]"):
        task.step_loss(wrapped, Batch(b.dense_features[:, :12], b.sparse_features, b.labels))
    with pytest.raises(ValueError, match=r"labels must be 0 or 1 for training, got -1.0 \(a file without labels"):
        task.step_loss(wrapped, Batch(b.dense_features, b.sparse_features, -torch.ones(4)))
    lengths = torch.ones(n, dtype=torch.int32)
    lengths[5] = 2  # sums to n + 1 for n values
    with pytest.raises(ValueError, match=rf"lengths sum to {n + 1} but it holds {n} values"):
        task.step_loss(wrapped, with_sparse(b, values=torch.zeros(n, dtype=torch.int64), lengths=lengths))
    offsets = torch.arange(n + 1, dtype=torch.int32)
    lengths = torch.ones(n, dtype=torch.int32)
    lengths[9], lengths[10] = 2, 0  # same sum, but not what the offsets say
    with pytest.raises(ValueError, match=r"offsets and lengths disagree at feature 'cat_2', sample 1"):
        task.step_loss(
            wrapped, with_sparse(b, values=torch.zeros(n, dtype=torch.int64), lengths=lengths, offsets=offsets)
        )
    lengths = torch.ones(n, dtype=torch.int32)
    lengths[6], lengths[7] = -1, 3
    with pytest.raises(ValueError, match=r"negative bag length -1 at feature 'cat_1', sample 2"):
        task.step_loss(wrapped, with_sparse(b, values=torch.zeros(n, dtype=torch.int64), lengths=lengths))


def test_empty_bags_pool_to_zero(task_and_model) -> None:
    task, wrapped = task_and_model
    ebc = next(m for m in wrapped.modules() if isinstance(m, TTMEmbeddingBagCollection))
    b = 4
    lengths = torch.ones(26 * b, dtype=torch.int32)
    lengths[0 * b + 1] = 0  # cat_0 (TT table), sample 1
    lengths[2 * b + 3] = 0  # cat_2 (dense table), sample 3
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=[f"cat_{i}" for i in range(26)], values=torch.ones(int(lengths.sum()), dtype=torch.int64), lengths=lengths
    )
    out = ebc(kjt).to_dict()
    assert torch.equal(out["cat_0"][1], torch.zeros(8)) and out["cat_0"][0].abs().sum() > 0
    assert torch.equal(out["cat_2"][3], torch.zeros(8)) and out["cat_2"][0].abs().sum() > 0
    batch = Batch(torch.rand(b, 13), kjt, torch.ones(b))
    loss, _, _ = task.step_loss(wrapped, batch)  # a batch with empty bags trains
    assert torch.isfinite(loss)
