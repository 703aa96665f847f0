"""The graphed training step on CPU: static buffers, eager recorder in place of CUDA graphs,
host-sync checks of the capturable pieces, and the engine's graphed loop against its eager one.

The CUDA capture itself (``CudaGraphCapture``) needs a GPU and is not run here.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torchrec.datasets.utils import Batch
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from toy_task import ToyTask

from comera_rec.integration import CompressionPolicy, TTMEmbeddingBagCollection
from comera_rec.rank import RankSchedule, RankScheduleConfig
from comera_rec.tensor import TTLinear, TTMEmbeddingBag, set_static_shapes
from comera_rec.training import OptimConfig, Trainer, TrainerConfig, build_optimizer
from comera_rec.training.cuda_graph import (
    BatchLayoutError,
    CaptureError,
    EagerCapture,
    GraphedTrainStep,
    HostSyncError,
    StepGraphs,
    capturable_objective,
    copy_into,
    forbid_host_syncs,
    make_static,
)
from comera_rec.training.engine_graphs import eager_cuda_hint


def _kjt(ids: list[int], lengths: list[int], weights: bool = False) -> KeyedJaggedTensor:
    values = torch.tensor(ids)
    return KeyedJaggedTensor.from_lengths_sync(
        keys=["f0", "f1"],
        values=values,
        lengths=torch.tensor(lengths),
        weights=torch.rand(len(ids)) if weights else None,
    )


# ---------------------------------------------------------------------------- static buffers


def test_static_buffers_copy_every_field() -> None:
    first = Batch(
        dense_features=torch.randn(2, 3),
        sparse_features=_kjt([1, 2, 3, 4], [1, 1, 1, 1]),
        labels=torch.tensor([0.0, 1.0]),
    )
    static = make_static({"batch": first, "extra": [torch.zeros(2), 7]}, "cpu")
    kjt = static["batch"].sparse_features
    assert kjt.length_per_key() == [2, 2] and kjt.offset_per_key() == [0, 2, 4]  # fixed host metadata
    assert static["batch"].dense_features.data_ptr() != first.dense_features.data_ptr()  # own buffers
    buffers = [static["batch"].dense_features, kjt.values(), kjt.lengths(), kjt.offsets()]
    new = Batch(
        dense_features=torch.randn(2, 3),
        sparse_features=_kjt([5, 6, 7, 8], [1, 1, 1, 1]),
        labels=torch.tensor([1.0, 1.0]),
    )
    copy_into(static, {"batch": new, "extra": [torch.ones(2), 7]})
    kjt = static["batch"].sparse_features
    assert [b.data_ptr() for b in buffers] == [
        static["batch"].dense_features.data_ptr(),
        kjt.values().data_ptr(),
        kjt.lengths().data_ptr(),
        kjt.offsets().data_ptr(),
    ]  # in place
    assert torch.equal(static["batch"].dense_features, new.dense_features)
    assert kjt.values().tolist() == [5, 6, 7, 8] and torch.equal(static["batch"].labels, new.labels)
    assert static["extra"][0].tolist() == [1.0, 1.0]


@pytest.mark.parametrize(
    "change,field",
    [
        (lambda b: {**b, "dense": torch.randn(3, 3)}, r"batch\['dense'\]: shape \[3, 3\]"),
        (lambda b: {**b, "dense": b["dense"].double()}, r"batch\['dense'\]: dtype"),
        (lambda b: {**b, "kjt": _kjt([1, 2, 3, 4], [3, 0, 1, 0])}, r"batch\['kjt'\]: ids per feature"),
        (lambda b: {**b, "kjt": _kjt([1, 2, 3, 4], [1, 1, 1, 1], weights=True)}, r"batch\['kjt'\].weights"),
        (lambda b: {**b, "n": 4}, r"batch\['n'\]: value 4 differs"),
        (lambda b: {"dense": b["dense"]}, r"batch: keys \['dense'\]"),
    ],
)
def test_a_different_batch_is_an_error_naming_the_field(change, field) -> None:
    batch = {"dense": torch.randn(2, 3), "kjt": _kjt([1, 2, 3, 4], [1, 1, 1, 1]), "n": 3}
    static = make_static(batch, "cpu")
    with pytest.raises(BatchLayoutError, match=field):
        copy_into(static, change(batch))
    with pytest.raises(BatchLayoutError, match=r"batch\['x'\]: a object"):
        make_static({"x": object()}, "cpu")


# ---------------------------------------------------------------------------- the graphed step


def _tiny_model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.ModuleDict({"emb": TTMEmbeddingBag(24, 4, rank=2, shape=((4, 6), (2, 2))), "head": nn.Linear(7, 1)})
    set_static_shapes(model)
    return model


def _batches(n: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [
        {
            "ids": torch.randint(0, 24, (8,), generator=g),
            "dense": torch.randn(4, 3, generator=g),
            "y": torch.randint(0, 2, (4,), generator=g).float(),
        }
        for _ in range(n)
    ]


def _step_fn(model: nn.Module, opt: torch.optim.Optimizer):
    offsets = torch.arange(0, 9, 2)

    def step(b: dict[str, torch.Tensor]) -> torch.Tensor:
        h = torch.cat([model["emb"](b["ids"], offsets), b["dense"]], dim=1)
        loss = F.binary_cross_entropy_with_logits(model["head"](h).squeeze(1), b["y"])
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    return step


@pytest.mark.parametrize("name", ["SGD", "Adam"])
def test_graphed_step_equals_the_eager_step(name: str) -> None:
    cfg = OptimConfig(name=name, lr_cores=0.05, lr_controllers=0.05, lr_other=0.05, momentum=0.9)
    eager_model, graph_model = _tiny_model(), _tiny_model()
    eager_step = _step_fn(eager_model, build_optimizer(eager_model, cfg))
    backend = EagerCapture(warmup_steps=2)
    graphed = GraphedTrainStep(_step_fn(graph_model, build_optimizer(graph_model, cfg)), capture=backend)
    outs, batches = [], _batches(6)
    for b in batches:
        want = eager_step(b)
        got = graphed(b)
        outs.append(got)
        assert torch.equal(got, want)
    assert backend.log == ["eager", "eager", "capture"] + ["replay"] * 4
    assert (graphed.eager_runs, graphed.captures, graphed.replays) == (2, 1, 4)
    assert outs[2] is outs[-1]  # replays return the same static output tensor
    assert torch.equal(graphed.static_inputs["ids"], batches[-1]["ids"])
    for (k, a), b in zip(eager_model.state_dict().items(), graph_model.state_dict().values()):
        assert torch.equal(a, b), k


def test_invalidate_warms_up_and_captures_again() -> None:
    backend = EagerCapture(warmup_steps=1)
    step = GraphedTrainStep(lambda b: b * 2, capture=backend)
    for x in (1.0, 2.0, 3.0):
        step(torch.tensor([x]))
    step.invalidate()
    assert not step.is_captured and step.static_inputs is None
    assert step(torch.tensor([4.0, 4.0])).tolist() == [8.0, 8.0]  # new buffers: a new shape is fine
    assert step(torch.tensor([5.0, 5.0])).tolist() == [10.0, 10.0]
    assert backend.log == ["eager", "capture", "replay", "replay", "eager", "capture", "replay"]
    assert step.captures == 2
    with pytest.raises(BatchLayoutError, match=r"batch: shape \[3\] differs from the captured \[2\]"):
        step(torch.ones(3))


def test_a_failed_capture_names_the_usual_causes() -> None:
    class Broken(EagerCapture):
        def capture(self, fn, inputs):
            raise RuntimeError("operation not permitted when stream is capturing")

    step = GraphedTrainStep(lambda b: b, capture=Broken(warmup_steps=0), name="forward_backward")
    with pytest.raises(CaptureError, match=r"forward_backward: capturing the step failed .*host synchronisation"):
        step(torch.ones(1))


def test_step_graphs_learning_rates() -> None:
    """Capturable optimisers read a device lr tensor refreshed each step; others recapture on a change."""
    p = nn.Parameter(torch.ones(2))
    adam = torch.optim.Adam([p], lr=0.1, capturable=True)  # never stepped: a CPU stand-in
    sgd = torch.optim.SGD([nn.Parameter(torch.ones(2))], lr=0.5)
    seen = []
    graphs = StepGraphs(
        lambda b: b,
        lambda: seen.append((adam.param_groups[0]["lr"], sgd.param_groups[0]["lr"])),
        capture=EagerCapture(warmup_steps=1),
    )
    for lr in (0.1, 0.2, 0.3):
        adam.param_groups[0]["lr"] = lr  # as set_lr_factor does: a float
        graphs.update([adam, sgd])
    tensors = [a for a, _ in seen]
    assert all(isinstance(t, torch.Tensor) for t in tensors) and tensors[1] is tensors[2]
    assert float(tensors[2]) == pytest.approx(0.3) and adam.param_groups[0]["lr"] == 0.3  # float restored
    assert graphs.update_step.captures == 1  # a tensor rate changes without a new capture
    sgd.param_groups[0]["lr"] = 0.25  # baked into the graph: capture again after a warm-up
    graphs.update([adam, sgd])
    graphs.update([adam, sgd])
    assert graphs.update_step.captures == 2 and seen[-1][1] == 0.25


# ---------------------------------------------------------------------------- host syncs


def _collection() -> TTMEmbeddingBagCollection:
    torch.manual_seed(0)
    tables = [
        EmbeddingBagConfig(
            name=f"t{i}",
            embedding_dim=4,
            num_embeddings=n,
            feature_names=[f"f{i}"],
            pooling=PoolingType.MEAN if i else PoolingType.SUM,
        )
        for i, n in enumerate([60, 50])
    ]
    return TTMEmbeddingBagCollection(
        tables,
        CompressionPolicy(rank=3, min_rows_to_compress=0, min_params_to_compress=0, min_gain=0.0),
        is_weighted=True,
    )


def test_static_lookups_and_objective_do_not_sync() -> None:
    ebc = _collection()
    lin = TTLinear(6, 3, rank=2)
    model = nn.ModuleDict({"ebc": ebc, "lin": lin})
    sched = RankSchedule(RankScheduleConfig(mode="threshold", threshold=0.5, gamma=0.1))
    kjt = make_static(_kjt([1, 59, 3, 49, 0, 7], [2, 1, 2, 1], weights=True), "cpu")  # length_per_key cached

    def step() -> None:
        emb = ebc(kjt).values()  # (2, 8)
        loss = (emb.sum(1) + lin(torch.ones(2, 6)).sum(1)).pow(2).mean()
        objective, _ = capturable_objective(sched, model, loss)
        objective.backward()

    with pytest.raises(HostSyncError):  # the de-duplicated lookup and validation sync
        with forbid_host_syncs():
            step()
    assert set_static_shapes(model) == 1 + len(ebc.groups)
    ref = {k: v.clone() for k, v in ebc(kjt).to_dict().items()}
    step()  # eager: makes the collection's device constants first, as a warm-up would
    with forbid_host_syncs():
        step()
    set_static_shapes(model, False)
    for k, v in ebc(kjt).to_dict().items():
        torch.testing.assert_close(v, ref[k])


@pytest.mark.parametrize("kw", [dict(), dict(surrogate="sum", beta=0.01), dict(enabled=False)])
def test_capturable_objective_equals_the_schedule(kw: dict) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(TTLinear(8, 6, rank=3), TTMEmbeddingBag(30, 4, rank=3))
    with torch.no_grad():
        model[0].controllers[0][0] = 0.1  # one dead rank
    sched = RankSchedule(RankScheduleConfig(mode="threshold", threshold=0.5, gamma=0.3, **kw))
    loss = model[0](torch.randn(3, 8)).pow(2).mean()
    want = sched.objective(model, loss, 0).loss
    got, _ = capturable_objective(sched, model, loss)
    assert torch.equal(got, want)
    params = list(model.parameters())
    for a, b in zip(
        torch.autograd.grad(got, params, allow_unused=True, retain_graph=True),
        torch.autograd.grad(want, params, allow_unused=True),
    ):
        assert (a is None and b is None) or torch.equal(a, b)
    sched.stage = "late"
    if sched.config.enabled:
        with pytest.raises(ValueError, match="late"):
            capturable_objective(sched, model, loss)


# ---------------------------------------------------------------------------- optimisers and engine


def test_capturable_optimisers_only_when_asked() -> None:
    model = nn.Linear(2, 1)
    assert build_optimizer(model, OptimConfig(name="AdamW")).defaults["capturable"] is False
    assert build_optimizer(model, OptimConfig(name="AdamW"), capturable=True).defaults["capturable"] is True
    assert isinstance(build_optimizer(model, OptimConfig(name="SGD"), capturable=True), torch.optim.SGD)
    with pytest.raises(ValueError, match="Adagrad"):
        build_optimizer(model, OptimConfig(name="Adagrad"), capturable=True)


class StaticToyTask(ToyTask):
    """The toy task with static-shape lookups (the numerics of the graphed run)."""

    def build_model(self, device: torch.device) -> nn.Module:
        model = super().build_model(device)
        set_static_shapes(model)
        return model


def _run(tmp_path, graphed: bool, sched: dict, task_kw: dict, capture: EagerCapture | None = None) -> Trainer:
    task = (ToyTask if graphed else StaticToyTask)(batches_per_epoch=4, batch=16, val_batches=1, **task_kw)
    trainer = Trainer(
        task,
        TrainerConfig(
            run_dir=str(tmp_path / ("graphed" if graphed else "eager")),
            max_steps=8,
            log_every=4,
            checkpoint_at_end=False,
            progress=False,
            plots=False,
            seed=1,
            device="cpu",  # EagerCapture's buffers are on CPU; a CUDA machine would pick cuda
            cuda_graphs=graphed,
        ),
        RankScheduleConfig(**{"mode": "threshold", "threshold": 0.999, "truncate_every": 3, **sched}),
        OptimConfig(lr_cores=1e-2, lr_controllers=1e-2, lr_other=1e-2, clip_grad_norm=1.0),
        graph_capture=capture,
    )
    trainer.fit()
    return trainer


@pytest.mark.parametrize(
    "case,sched,task_kw",
    [
        ("truncation_and_nonfinite_loss", {}, {"nan_batches": (4,)}),
        ("late_stage_runs_eagerly", {"late_stage": True, "switch_step": 5}, {}),
    ],
)
def test_engine_graphed_loop_equals_eager_loop(tmp_path, case: str, sched: dict, task_kw: dict) -> None:
    capture = EagerCapture(warmup_steps=1)
    graphed = _run(tmp_path, True, sched, task_kw, capture)
    eager = _run(tmp_path, False, sched, task_kw)
    assert graphed.losses == eager.losses and len(graphed.losses) == 8 - graphed.nonfinite
    assert graphed.truncations == eager.truncations >= 1 and graphed.nonfinite == eager.nonfinite
    for (k, a), b in zip(eager.model.state_dict().items(), graphed.model.state_dict().values()):
        assert torch.equal(a, b), k
    captures = capture.log.count("capture")
    if case == "late_stage_runs_eagerly":  # steps 1-3 and 4-5 graphed (truncation at 3), then eager
        assert graphed.schedule.stage == "late" and graphed.truncations == 1 and captures == 2 * 2
        assert capture.log[-1] == "replay" and capture.log.count("replay") == 2 * (2 + 1)
    else:  # both graphs captured again after every truncation (at step 3; at 6 no rank is cut)
        assert captures == 2 * (1 + graphed.truncations)
        # batch 4 (a replay of the captured forward/backward) is skipped: its update never runs
        assert graphed.nonfinite == 1 and capture.log.count("replay") == 2 * (8 - graphed.truncations - 1) - 1


def test_engine_refuses_cuda_graphs_on_cpu(tmp_path) -> None:
    trainer = Trainer(
        ToyTask(),
        TrainerConfig(run_dir=str(tmp_path), max_steps=1, progress=False, plots=False, device="cpu", cuda_graphs=True),
    )
    with pytest.raises(ValueError, match=r"cuda_graphs=True needs a CUDA device, but the device is cpu"):
        trainer.fit()
    assert not (tmp_path / "checkpoints").exists() and TrainerConfig().cuda_graphs is False


class CheckedToyTask(StaticToyTask):
    """Counts the batches the engine hands to ``check_batch``; refuses the fifth."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.checked = 0

    def check_batch(self, batch) -> None:
        self.checked += 1
        if self.checked == 5:
            raise ValueError("batch 5 is bad")


def test_graphed_loop_checks_every_batch_on_the_host(tmp_path) -> None:
    """Replays run no Python of the step, so the graphed loop calls the task's
    ``check_batch`` on each batch before copying it in; its error stops the run."""
    task = CheckedToyTask(batches_per_epoch=4, batch=16, val_batches=1)
    trainer = Trainer(
        task,
        TrainerConfig(
            run_dir=str(tmp_path),
            max_steps=8,
            progress=False,
            plots=False,
            checkpoint_at_end=False,
            device="cpu",
            cuda_graphs=True,
        ),
        graph_capture=EagerCapture(warmup_steps=1),
    )
    with pytest.raises(ValueError, match="batch 5 is bad"):
        trainer.fit()
    assert task.checked == 5 and len(trainer.losses) == 4


def test_an_eager_run_on_one_gpu_is_told_about_cuda_graphs() -> None:
    hint = eager_cuda_hint(torch.device("cuda:0"), False, 1)
    assert hint is not None and "cuda:0 eagerly" in hint and "trainer.cuda_graphs=true" in hint
    assert eager_cuda_hint(torch.device("cuda:0"), True, 1) is None  # already graphed
    assert eager_cuda_hint(torch.device("cuda:0"), False, 2) is None  # graphs are for one process
    assert eager_cuda_hint(torch.device("cpu"), False, 1) is None  # no graphs on CPU
