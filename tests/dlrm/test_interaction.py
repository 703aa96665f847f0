"""PairwiseDotInteraction against TorchRec's InteractionArch (float64), on the fused CPU
kernel and the PyTorch path, gradcheck; FlatSparseArch against TorchRec's SparseArch; their
use in the DLRM builder."""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.models.dlrm import InteractionArch, InteractionDCNArch, SparseArch

from comera_rec.dlrm import DLRMConfig, build_dlrm, build_dlrm_train
from comera_rec.dlrm.interaction import BlockDCNInteraction, FlatSparseArch, PairwiseDotInteraction
from comera_rec.dlrm.interaction_kernel import EXTENSION, pairwise_dots_cpu, pairwise_dots_op, pairwise_kernel_applies
from comera_rec.integration.mlp import TTLowRankCrossNet
from comera_rec.tensor import NarrowLinear, cached_weights
from tests.dlrm.test_dlrm import _batch, _config
from tests.tensor.test_compiled_ops import recording_backend
from tests.threads import assert_bit_identical, at_thread_counts, stamps_during_call


# dims 3 / 19 / 33: not whole vectors (the kernel's tail), 16: one float32 vector
@pytest.mark.parametrize("features,dim,batch", [(1, 4, 3), (5, 3, 7), (26, 16, 9), (16, 19, 70), (40, 33, 5)])
def test_equals_torchrec_interaction(features: int, dim: int, batch: int, lookup_path: str) -> None:
    g = torch.Generator().manual_seed(features)
    dense = torch.randn(batch, dim, generator=g, dtype=torch.float64, requires_grad=True)
    sparse = torch.randn(batch, features, dim, generator=g, dtype=torch.float64, requires_grad=True)
    ours = PairwiseDotInteraction(features)(dense, sparse)
    theirs = InteractionArch(features)(dense, sparse)
    if lookup_path == "torch":
        assert torch.equal(ours, theirs)  # the same GEMM and the same picks: bit for bit
    else:
        torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)
    grad = torch.randn(ours.shape, generator=g, dtype=torch.float64)
    for a, b in zip(
        torch.autograd.grad(ours, [dense, sparse], grad), torch.autograd.grad(theirs, [dense, sparse], grad)
    ):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@settings(max_examples=40, deadline=None)
@given(features=st.integers(1, 40), dim=st.integers(1, 20), batch=st.integers(1, 4))
def test_kernel_packs_every_pair_count(features: int, dim: int, batch: int) -> None:
    # the forward packs each row's pairs by whole vectors, spilling into the next row's
    # place, and lane by lane at the sample's end: every count of pairs, every sample
    g = torch.Generator().manual_seed(features * 100 + dim)
    dense = torch.randn(batch, dim, generator=g, dtype=torch.float64)
    sparse = torch.randn(batch, features, dim, generator=g, dtype=torch.float64)
    assert pairwise_kernel_applies(dense, sparse)
    rows = torch.cat([dense[:, None], sparse], dim=1)
    i, j = torch.triu_indices(features + 1, features + 1, offset=1)
    want = torch.cat([dense, (rows[:, i] * rows[:, j]).sum(-1)], dim=1)  # pairs by index lists
    torch.testing.assert_close(pairwise_dots_cpu(dense, sparse), want, rtol=1e-12, atol=1e-12)


@settings(max_examples=40, deadline=None)
@given(features=st.integers(1, 40), dim=st.integers(1, 20), batch=st.integers(1, 4))
def test_kernel_backward_sums_every_row_tile(features: int, dim: int, batch: int) -> None:
    # the backward sums gradient rows in tiles of a few rows: every count of rows past the
    # last whole tile, every tail of D, against autograd through pairs by index lists
    g = torch.Generator().manual_seed(features * 100 + dim)
    dense = torch.randn(batch, dim, generator=g, dtype=torch.float64, requires_grad=True)
    sparse = torch.randn(batch, features, dim, generator=g, dtype=torch.float64, requires_grad=True)
    rows = torch.cat([dense[:, None], sparse], dim=1)
    i, j = torch.triu_indices(features + 1, features + 1, offset=1)
    want = torch.cat([dense, (rows[:, i] * rows[:, j]).sum(-1)], dim=1)
    grad = torch.randn(want.shape, generator=g, dtype=torch.float64)
    ours = torch.autograd.grad(pairwise_dots_cpu(dense, sparse), [dense, sparse], grad)
    for a, b in zip(ours, torch.autograd.grad(want, [dense, sparse], grad)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_gradcheck(lookup_path: str) -> None:
    g = torch.Generator().manual_seed(0)
    dense = torch.randn(3, 2, generator=g, dtype=torch.float64, requires_grad=True)
    sparse = torch.randn(3, 4, 2, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(PairwiseDotInteraction(4), (dense, sparse))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_kernel_operator_passes_opcheck_and_compiles_into_the_graph(dtype: torch.dtype) -> None:
    # under torch.compile the interaction calls the kernel as comera_train::pairwise_dots
    g = torch.Generator().manual_seed(3)
    dense = torch.randn(21, 19, generator=g, dtype=dtype, requires_grad=True)
    sparse = torch.randn(21, 6, 19, generator=g, dtype=dtype, requires_grad=True)
    torch.library.opcheck(pairwise_dots_op, (dense, sparse))
    grad = torch.randn(21, 19 + 7 * 6 // 2, generator=g, dtype=dtype)
    want = pairwise_dots_cpu(dense, sparse)
    want_grads = torch.autograd.grad(want, [dense, sparse], grad)
    names: set[str] = set()
    torch._dynamo.reset()
    try:
        got = torch.compile(PairwiseDotInteraction(6), backend=recording_backend(names))(dense, sparse)
        got_grads = torch.autograd.grad(got, [dense, sparse], grad)
    finally:
        torch._dynamo.reset()
    assert {"comera_train.pairwise_dots.default", "comera_train.pairwise_dots_backward.default"} <= names, names
    assert torch.equal(got, want)
    for a, b in zip(got_grads, want_grads):
        assert torch.equal(a, b)


def test_kernel_in_float32_and_across_thread_counts() -> None:
    g = torch.Generator().manual_seed(1)
    dense = torch.randn(300, 16, generator=g, requires_grad=True)
    sparse = torch.randn(300, 26, 16, generator=g, requires_grad=True)
    grad = torch.randn(300, 16 + 27 * 26 // 2, generator=g)
    want = InteractionArch(26)(dense.double(), sparse.double())
    assert pairwise_kernel_applies(dense, sparse)

    def run():  # every sample is done by one thread: the same bits for any count
        out = pairwise_dots_cpu(dense, sparse)
        return [out, *torch.autograd.grad(out, [dense, sparse], grad)]

    results = at_thread_counts(run, (1, 2, 3))
    torch.testing.assert_close(results[0][0].double(), want, rtol=1e-5, atol=1e-5)
    assert_bit_identical(results)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_kernel_gives_a_sample_the_same_bits_anywhere_in_the_batch(dtype: torch.dtype) -> None:
    # the forward takes a vector's width of samples at once (one a lane) and the batch's last
    # few one by one: 2 x 16 + 5 samples are blocks and a tail at every width and dtype here;
    # each sample alone is a tail of one
    g = torch.Generator().manual_seed(2)
    batch, features, dim = 37, 7, 19  # 19: whole vectors of d and a tail
    dense = torch.randn(batch, dim, generator=g, dtype=dtype)
    sparse = torch.randn(batch, features, dim, generator=g, dtype=dtype)
    together = pairwise_dots_cpu(dense, sparse)
    alone = torch.cat([pairwise_dots_cpu(dense[b : b + 1], sparse[b : b + 1]) for b in range(batch)])
    assert torch.equal(together, alone)
    rows = torch.cat([dense[:, None], sparse], dim=1).double()
    i, j = torch.triu_indices(features + 1, features + 1, offset=1)
    want = torch.cat([dense.double(), (rows[:, i] * rows[:, j]).sum(-1)], dim=1)
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(together.double(), want, rtol=tol, atol=tol)


def test_kernel_lets_other_python_threads_run() -> None:
    def make_call(rows: int):
        dense, sparse = torch.randn(rows, 16), torch.randn(rows, 26, 16)
        return functools.partial(EXTENSION.load().pairwise_dots_forward, dense, sparse)

    assert stamps_during_call(make_call) > 0


def _two_table_ebc() -> EmbeddingBagCollection:
    return EmbeddingBagCollection(
        [
            EmbeddingBagConfig(name=f"t{i}", embedding_dim=4, num_embeddings=10, feature_names=[f"f{i}"])
            for i in range(2)
        ]
    )


@pytest.mark.parametrize("reordered", [False, True])
def test_flat_sparse_arch_equals_torchrec(reordered: bool) -> None:
    # the collection's order: its values as they are; another order: split and concatenated
    torch.manual_seed(0)
    ebc = _two_table_ebc()
    kjt = KeyedJaggedTensor.from_lengths_sync(["f0", "f1"], torch.tensor([1, 2, 3, 4, 5]), torch.tensor([1, 2, 0, 2]))
    flat, plain = FlatSparseArch(ebc), SparseArch(ebc)
    if reordered:
        flat._sparse_feature_names = plain._sparse_feature_names = ["f1", "f0"]
    ours, theirs = flat(kjt), plain(kjt)
    assert torch.equal(ours, theirs)
    grad = torch.randn(ours.shape)
    (g_ours,) = torch.autograd.grad(ours, [ebc.embedding_bags["t0"].weight], grad)
    (g_theirs,) = torch.autograd.grad(theirs, [ebc.embedding_bags["t0"].weight], grad)
    assert torch.equal(g_ours, g_theirs)


def test_flat_sparse_arch_traces_as_torchrec() -> None:
    # TorchRec's pipelines FX-trace the model: on a proxy the arch is TorchRec's own
    import torchrec.fx

    ebc = _two_table_ebc()
    kjt = KeyedJaggedTensor.from_lengths_sync(["f0", "f1"], torch.tensor([1, 2, 3, 4, 5]), torch.tensor([1, 2, 0, 2]))
    traced = torchrec.fx.symbolic_trace(FlatSparseArch(ebc))
    assert torch.equal(traced(kjt), SparseArch(ebc)(kjt))


def test_block_dcn_interaction_equals_torchrec() -> None:
    torch.manual_seed(0)
    net = TTLowRankCrossNet(24, 2, 16, tt_rank=4, min_gain=0.0, dtype=torch.float64)
    with torch.no_grad():
        for b in net.bias:
            b.normal_()
    ours, theirs = BlockDCNInteraction(2, net), InteractionDCNArch(2, net)
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    dense, sparse = torch.randn(5, 8, dtype=torch.float64), torch.randn(5, 2, 8, dtype=torch.float64)
    with torch.inference_mode(), cached_weights():
        torch.testing.assert_close(ours(dense, sparse), theirs(dense, sparse))
    # training: TorchRec's path, the same gradients
    grads = []
    for arch in (ours, theirs):
        d, s = dense.clone().requires_grad_(), sparse.clone().requires_grad_()
        params = list(net.parameters())
        grads.append(torch.autograd.grad(arch(d, s).square().sum(), [d, s, *params]))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)
    traced = torch.fx.symbolic_trace(ours)
    with torch.no_grad():
        torch.testing.assert_close(traced(dense, sparse), theirs(dense, sparse))


def test_compressed_dcn_model_takes_the_block_interaction() -> None:
    torch.manual_seed(0)
    compressed = build_dlrm_train(_config(compressed=True, interaction="dcn"))
    dense = build_dlrm_train(_config(compressed=False, interaction="dcn"))
    assert isinstance(compressed.model.inter_arch, BlockDCNInteraction)
    assert isinstance(compressed.model.sparse_arch, FlatSparseArch)
    assert type(dense.model.inter_arch) is InteractionDCNArch  # the dense baseline as TorchRec ships it
    assert type(dense.model.sparse_arch) is SparseArch
    arch = compressed.model
    # TorchRec's own arches on the same modules name every parameter alike (checkpoints carry over)
    assert InteractionDCNArch(arch.inter_arch.F, arch.inter_arch.crossnet).state_dict().keys() == (
        arch.inter_arch.state_dict().keys()
    )
    assert SparseArch(arch.sparse_arch.embedding_bag_collection).state_dict().keys() == (
        arch.sparse_arch.state_dict().keys()
    )
    batch = _batch()
    recorded = compressed.model(batch.dense_features, batch.sparse_features)
    with torch.inference_mode(), cached_weights():
        scored = compressed.model(batch.dense_features, batch.sparse_features)
    torch.testing.assert_close(scored, recorded.detach())


def test_bad_shapes_are_named() -> None:
    with pytest.raises(ValueError, match="at least one sparse feature"):
        PairwiseDotInteraction(0)
    with pytest.raises(ValueError, match=r"expected sparse features \(B, 3, D\), got \(2, 4, 5\)"):
        PairwiseDotInteraction(3)(torch.randn(2, 5), torch.randn(2, 4, 5))


@pytest.mark.parametrize("compressed", [False, True])
def test_builder_swaps_the_interaction_and_keeps_the_loss(compressed: bool, lookup_path: str) -> None:
    torch.manual_seed(0)
    plain = build_dlrm_train(_config(compressed=compressed))
    torch.manual_seed(0)
    fused = build_dlrm_train(_config(compressed=compressed, fused_interaction=True))
    assert isinstance(fused.model.inter_arch, PairwiseDotInteraction)
    assert isinstance(fused.model.sparse_arch, FlatSparseArch)
    assert not isinstance(plain.model.inter_arch, PairwiseDotInteraction)
    # the bottom MLP's first layer (13 inputs) is fused for compressed models and with the flag
    first = lambda train: train.model.dense_arch.model._mlp[0]._linear  # noqa: E731
    assert isinstance(first(fused), NarrowLinear) and first(fused).relu
    assert isinstance(first(plain), NarrowLinear) == compressed
    assert plain.model.state_dict().keys() == fused.model.state_dict().keys()  # checkpoints carry over
    batch = _batch()
    loss_plain, _ = plain(batch)
    loss_fused, _ = fused(batch)
    torch.testing.assert_close(loss_plain, loss_fused, rtol=1e-6, atol=1e-7)
    loss_plain.backward()
    loss_fused.backward()
    for (name, a), (_, b) in zip(plain.named_parameters(), fused.named_parameters()):
        if a.grad is not None:
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-7, msg=name)


def test_fused_interaction_needs_the_dot_interaction() -> None:
    with pytest.raises(ValueError, match="fused_interaction replaces the 'dot' interaction"):
        build_dlrm(
            DLRMConfig(
                table_sizes=[100, 50],
                embedding_dim=8,
                bottom_mlp=[16, 8],
                top_mlp=[16, 1],
                interaction="dcn",
                fused_interaction=True,
            ),
            device="meta",
        )


def test_builds_on_meta_and_holds_no_state() -> None:
    model = build_dlrm(_config(compressed=False, fused_interaction=True), device="meta")
    assert isinstance(model.inter_arch, PairwiseDotInteraction)
    assert dict(model.inter_arch.state_dict()) == {}


def test_under_cpu_autocast_takes_bfloat16_dense_features(lookup_path: str) -> None:
    # under autocast the bottom MLP's last layer hands on bfloat16, the lookups float32: the
    # kernel takes both in float32; the PyTorch path's products run in bfloat16, its
    # backward too (it once multiplied a bfloat16 gradient by the float32 features)
    g = torch.Generator().manual_seed(3)
    dense = torch.randn(7, 16, generator=g).to(torch.bfloat16).requires_grad_()
    sparse = torch.randn(7, 5, 16, generator=g, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = PairwiseDotInteraction(5)(dense, sparse)
    grad = torch.randn(ours.shape, generator=g)
    ours.backward(grad.to(ours.dtype))
    dense64 = dense.detach().double().requires_grad_()
    sparse64 = sparse.detach().double().requires_grad_()
    want = InteractionArch(5)(dense64, sparse64)
    want.backward(grad.double())
    # float32 on the kernel; bfloat16 products (8 bits of mantissa) on the PyTorch path
    tol = dict(rtol=1e-5, atol=1e-5) if lookup_path == "kernel" else dict(rtol=2e-2, atol=0.15)
    assert ours.dtype == torch.float32  # the kernel's; on the PyTorch path autocast's cat widens the pairs
    torch.testing.assert_close(ours.double(), want, **tol)
    assert (dense.grad.dtype, sparse.grad.dtype) == (torch.bfloat16, torch.float32)  # each its input's
    torch.testing.assert_close(sparse.grad.double(), sparse64.grad, **tol)
    torch.testing.assert_close(dense.grad.double(), dense64.grad, rtol=2e-2, atol=0.15)  # a bfloat16 gradient


@pytest.mark.parametrize("compressed", [False, True])
def test_train_step_under_cpu_autocast_follows_the_float32_step(compressed: bool, lookup_path: str) -> None:
    # the whole model's forward under autocast, the backward outside it (torch's advice): every
    # gradient float32, finite and pointing where the float32 step's does
    torch.manual_seed(0)
    train = build_dlrm_train(_config(compressed=compressed, fused_interaction=True))
    batch = _batch()
    loss32, _ = train(batch)
    grads32 = torch.autograd.grad(loss32, [p for p in train.parameters() if p.requires_grad], allow_unused=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss16, _ = train(batch)
    torch.testing.assert_close(loss16.float(), loss32, rtol=2e-2, atol=2e-2)
    loss16.backward()
    params = [p for p in train.parameters() if p.requires_grad]
    checked = 0
    for p, g32 in zip(params, grads32):
        if g32 is None or p.grad is None:
            continue
        assert p.grad.dtype == p.dtype == torch.float32 and torch.isfinite(p.grad).all()
        if g32.norm() > 1e-6:
            cosine = torch.nn.functional.cosine_similarity(p.grad.flatten(), g32.flatten(), dim=0)
            assert cosine > 0.98, (tuple(p.shape), float(cosine))
            checked += 1
    assert checked >= 6
