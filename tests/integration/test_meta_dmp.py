"""Models built, or compressed, on the meta device under stock ``DistributedModelParallel``.

TorchRec's examples build the ``EmbeddingBagCollection`` on ``device="meta"`` and call
``DistributedModelParallel(module=model, device=..., sharders=[EmbeddingBagCollectionSharder()])``.
DMP allocates every meta parameter with ``torch.empty_like`` and resets only modules that
own one directly; TT cores live in ``ParameterList`` children, so before the fix they
stayed uninitialised memory (absmean ~1e29 or NaN) and the loss was NaN from step 0.
Here they must come out as a build on the CPU would: same values under the same seed
where DMP draws nothing else first, else the same distribution.
"""

from __future__ import annotations

import math
from typing import Callable

import pytest
import torch
from torch import nn
from torchrec.datasets.utils import Batch
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.models.dlrm import DLRM, DLRMTrain
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import comera_rec
from comera_rec import TTLinear, TTMEmbeddingBag
from comera_rec.integration import CompressionPolicy, TTLowRankCrossNet, TTMEmbeddingBagCollection
from comera_rec.tensor.stacked import StackedTTMTables
from comera_rec.tensor.train import TensorTrainModule
from tests.integration.helpers import STOCK_DMP_WARNINGS, kjt, policy, tables

CPU = torch.device("cpu")

pytestmark = [
    *STOCK_DMP_WARNINGS,
]


def stock_dmp(model: nn.Module) -> DistributedModelParallel:
    """TorchRec's examples' call, nothing of this project's in it."""
    return DistributedModelParallel(module=model, device=CPU, sharders=[EmbeddingBagCollectionSharder()])


def _target_stds(module: TensorTrainModule) -> list[float]:
    """Std of the reconstructed weight's entries of each train, as the classes document it
    (``nn.Linear``: variance 1 / (3 in_features); TorchRec tables: 1 / (3 num_embeddings))."""
    if isinstance(module, TTLinear):
        return [1.0 / math.sqrt(3.0 * module.in_features)]
    if isinstance(module, TTMEmbeddingBag):
        return [1.0 / math.sqrt(3.0 * module.num_embeddings)]
    assert isinstance(module, StackedTTMTables)
    return [1.0 / math.sqrt(3.0 * n) for n in module.num_embeddings]


def normalised_second_moment(module: TensorTrainModule) -> float:
    """Mean of (core entry / expected core std)^2 over all cores: 1 for the documented init.

    A weight entry is a sum over prod(r_k) paths of products of K independent core entries,
    so a core entry of std s gives weight variance prod(r_k) * s^(2K); solved for s.
    """
    total, count = 0.0, 0
    paths, k = math.prod(module.ranks), module.num_cores
    for t, target in enumerate(_target_stds(module)):
        std = (target**2 / paths) ** (1.0 / (2 * k))
        for core in module.cores:
            c = core.detach()[t] if isinstance(module, StackedTTMTables) else core.detach()
            total += float(((c / std) ** 2).sum())
            count += c.numel()
    return total / count


def assert_initialised(model: nn.Module, tt_modules: list[TensorTrainModule]) -> None:
    for name, p in model.named_parameters():
        assert not p.is_meta, name
        assert torch.isfinite(p).all(), f"{name}: not finite"
        assert p.abs().max() < 10.0, f"{name}: absmax {p.abs().max().item():.3g}"
    for m in tt_modules:
        for d in m.controllers:
            assert torch.equal(d, torch.ones_like(d))
        assert 0.6 < normalised_second_moment(m) < 1.5, type(m).__name__


def _was_meta(model: nn.Module) -> list[TensorTrainModule]:
    return [m for m in model.modules() if isinstance(m, TensorTrainModule) and any(p.is_meta for p in m.parameters())]


# ---------------------------------------------------------------------------- DLRM, compress, stock DMP

SIZES = [100, 90, 20]  # two TTM tables (stacked), one dense
DIM = 8


def _dlrm_batch(seed: int, batch: int = 16) -> Batch:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 3, (len(SIZES), batch), generator=g)
    values = torch.cat([torch.randint(0, n, (int(lengths[f].sum()),), generator=g) for f, n in enumerate(SIZES)])
    features = KeyedJaggedTensor.from_lengths_sync(
        keys=[f"f{i}" for i in range(len(SIZES))], values=values, lengths=lengths.reshape(-1)
    )
    return Batch(
        dense_features=torch.rand(batch, 4, generator=g),
        sparse_features=features,
        labels=torch.randint(0, 2, (batch,), generator=g),
    )


@pytest.mark.parametrize("dense_device", ["cpu", "meta"])
def test_dlrm_compressed_on_meta_trains_under_stock_dmp(gloo, dense_device: str) -> None:
    torch.manual_seed(0)
    configs = [
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=DIM, num_embeddings=n, feature_names=[f"f{i}"])
        for i, n in enumerate(SIZES)
    ]
    ebc = EmbeddingBagCollection(tables=configs, device=torch.device("meta"))  # as TorchRec's examples
    model = DLRMTrain(
        DLRM(
            embedding_bag_collection=ebc,
            dense_in_features=4,
            dense_arch_layer_sizes=[16, DIM],
            over_arch_layer_sizes=[16, 1],
            dense_device=torch.device(dense_device),
        )
    )
    report = comera_rec.compress(
        model, CompressionPolicy(rank=4, min_rows_to_compress=50, min_params_to_compress=0, min_gain=0.0)
    )
    collection = model.model.sparse_arch.embedding_bag_collection
    assert isinstance(collection, TTMEmbeddingBagCollection)
    assert collection.compressed_tables() == ["t0", "t1"] and collection.dense_tables() == ["t2"]
    assert any(m.kind == "TTLinear" for m in report.modules)
    fresh = _was_meta(model)
    assert collection.groups[0] in fresh
    assert (len(fresh) > 1) == (dense_device == "meta")  # the TT MLP layers too when built on meta

    wrapped = stock_dmp(model)

    assert_initialised(wrapped, fresh)
    assert collection.device == CPU
    for name in ("t0", "t1"):  # the reconstructed tables: variance 1 / (3 num_embeddings)
        n = dict(zip(["t0", "t1"], SIZES))[name]
        std = collection.table_weight(name).std().item()
        assert 0.3 / math.sqrt(3 * n) < std < 3 / math.sqrt(3 * n)
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    batch = _dlrm_batch(0)
    losses = []
    for _ in range(6):
        loss, _ = wrapped(batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses), losses
    # random labels: the loss stays near log 2 but falls at every step
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    del wrapped, optimizer


# ---------------------------------------------------------------------------- TTMEmbeddingBagCollection(device="meta")


class _Head(nn.Module):
    """A collection and a linear head with a squared loss (``forward(kjt) -> loss``)."""

    def __init__(self, collection: nn.Module, width: int) -> None:
        super().__init__()
        self.collection = collection
        self.head = nn.Linear(width, 1)

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        out = self.head(self.collection(features).values())
        return ((out - 1.0) ** 2).mean()


def test_ttm_collection_on_meta_trains_under_stock_dmp(gloo) -> None:
    torch.manual_seed(0)
    collection = TTMEmbeddingBagCollection(tables(), policy(), device="meta")
    assert collection.compressed_tables() == ["a", "b", "d"] and collection.dense_tables() == ["c"]
    model = _Head(collection, 40)
    fresh = _was_meta(model)
    assert len(fresh) == 2  # {a, b} stacked, {d}

    wrapped = stock_dmp(model)

    assert_initialised(wrapped, fresh)
    assert collection.device == CPU
    for name, n in (("a", 100), ("b", 90), ("d", 300)):
        std = collection.table_weight(name).std().item()
        assert 0.3 / math.sqrt(3 * n) < std < 3 / math.sqrt(3 * n), name
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.5)
    features = kjt(batch=8)
    losses = []
    for _ in range(6):
        loss = wrapped(features)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses), losses
    assert losses[-1] < losses[0] - 1e-3, losses
    del wrapped, optimizer


def test_scoring_under_cached_weights_follows_training_under_stock_dmp(gloo) -> None:
    """A user's loop: meta tables, stock DMP, train steps with their optimiser, scoring in
    between inside ``inference_mode`` and ``cached_weights``: the scores equal the ones
    made without kept values, step after step (nothing stale survives an update)."""
    torch.manual_seed(0)
    collection = TTMEmbeddingBagCollection(tables(), policy(), device="meta")
    wrapped = stock_dmp(_Head(collection, 40))
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.5)
    features = kjt(batch=8)
    with comera_rec.cached_weights():
        for _ in range(3):
            with torch.inference_mode():
                kept = [collection(features).values() for _ in range(2)]  # the second from kept values
            fresh = collection(features).values().detach()  # gradients on: nothing kept is used
            torch.testing.assert_close(kept[0], fresh, rtol=0, atol=0)
            torch.testing.assert_close(kept[1], fresh, rtol=0, atol=0)
            wrapped(features).backward()
            optimizer.step()
            optimizer.zero_grad()
    del wrapped, optimizer


def test_all_compressed_collection_on_meta_equals_cpu_build(gloo) -> None:
    # no dense table: DMP shards nothing and draws nothing before initialising the TT
    # tables, so they get the very values of a build on the CPU under the same seed
    configs = [t for t in tables() if t.name != "c"]
    torch.manual_seed(5)
    reference = TTMEmbeddingBagCollection(configs, policy(), device="cpu")
    collection = TTMEmbeddingBagCollection(configs, policy(), device="meta")
    assert collection.dense is None
    model = _Head(collection, 32)
    torch.manual_seed(5)
    wrapped = stock_dmp(model)
    assert collection.device == CPU
    for (name, got), (_, want) in zip(collection.state_dict().items(), reference.state_dict().items()):
        assert torch.equal(got, want), name
    torch.testing.assert_close(collection(kjt()).values(), reference(kjt()).values())
    del wrapped


# ---------------------------------------------------------------------------- each module alone


def _ttm_bag(device: str) -> nn.Module:
    return TTMEmbeddingBag(100, 8, 4, shape=((10, 10), (2, 4)), device=device)


def _stacked(device: str) -> nn.Module:
    return StackedTTMTables([100, 60], 8, 3, row_shape=(10, 10), col_shape=(2, 4), device=device)


def _tt_linear(device: str) -> nn.Module:
    return TTLinear(24, 16, 3, device=device)


def _tt_linear_no_bias(device: str) -> nn.Module:
    return TTLinear(24, 16, 3, bias=False, device=device)


@pytest.mark.parametrize("build", [_ttm_bag, _stacked, _tt_linear, _tt_linear_no_bias])
def test_tt_module_on_meta_equals_cpu_build(gloo, build: Callable[[str], nn.Module]) -> None:
    torch.manual_seed(7)
    reference = build("cpu")
    module = build("meta")
    torch.manual_seed(7)
    wrapped = stock_dmp(module)
    assert not any(p.is_meta for p in module.parameters())
    for (name, got), (_, want) in zip(module.state_dict().items(), reference.state_dict().items()):
        assert torch.equal(got, want), name
    del wrapped


@pytest.mark.parametrize("min_gain, kind", [(2.0, "TTLinear"), (1e9, "Linear")])
def test_tt_crossnet_on_meta_is_initialised_under_stock_dmp(gloo, min_gain: float, kind: str) -> None:
    torch.manual_seed(0)
    net = TTLowRankCrossNet(64, num_layers=2, low_rank=8, tt_rank=2, min_gain=min_gain, device="meta")
    assert {type(m).__name__ for m in (*net.V, *net.W)} == {kind}
    fresh = _was_meta(net)
    assert len(fresh) == (4 if kind == "TTLinear" else 0)

    wrapped = stock_dmp(net)

    assert_initialised(net, fresh)
    for b in net.bias:  # ParameterList children: empty_like garbage before the fix
        assert torch.equal(b, torch.zeros_like(b))  # as a new LowRankCrossNet
    if kind == "Linear":  # Xavier-normal as built on the CPU (DMP's own reset is Kaiming-uniform)
        w = torch.cat([m.weight.flatten() for m in (*net.V, *net.W)])
        assert abs(w.std().item() / math.sqrt(2 / 72) - 1) < 0.1
    x = torch.randn(5, 64)
    assert torch.isfinite(wrapped(x)).all()
    del wrapped


def test_materialize_tensor_trains_initialises_a_meta_crossnet() -> None:
    # wrap_model's one-process path: to_empty + reset_parameters, biases included
    from comera_rec.integration import materialize_tensor_trains

    net = TTLowRankCrossNet(64, num_layers=2, low_rank=4, tt_rank=2, device="meta")
    fresh = _was_meta(net)
    materialize_tensor_trains(net, CPU)
    assert_initialised(net, fresh)
    assert all(torch.equal(b, torch.zeros_like(b)) for b in net.bias)
