"""The static-shape TTM lookup against the de-duplicated one (float64), and its shapes."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from comera_rec.tensor import TTMEmbeddingBag, set_static_shapes
from comera_rec.tensor.bags import pool_bags, pool_bags_static
from comera_rec.tensor.contract import ttm_embedding_bag
from comera_rec.tensor.stacked import StackedTTMTables

ROWS, COLS = (3, 4, 2, 3), (2, 3, 2, 1)


def _cores(d: int, tables: int, rank: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    full = [1] + [rank] * (d - 1) + [1]
    return [
        torch.randn(tables, full[k], ROWS[k], COLS[k], full[k + 1], generator=g, dtype=torch.float64).requires_grad_()
        for k in range(d)
    ]


def _inputs(d: int, tables: int, n_ids: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, math.prod(ROWS[:d]), (n_ids // 2,), generator=g).repeat(2)  # repeated ids
    trains = torch.randint(0, tables, (n_ids,), generator=g) if tables > 1 else None
    offsets = torch.tensor([0, 0, 3, n_ids // 2, n_ids // 2, n_ids - 1, n_ids])  # empty bags too
    weights = torch.rand(n_ids, generator=g, dtype=torch.float64).requires_grad_()
    return ids, trains, offsets, weights


@pytest.mark.parametrize("d,tables", [(2, 1), (3, 2), (4, 2)])
@pytest.mark.parametrize("mode,weighted", [("sum", False), ("mean", False), ("sum", True), ("mean", True)])
def test_static_equals_deduplicated(d: int, tables: int, mode: str, weighted: bool) -> None:
    cores = _cores(d, tables, rank=3, seed=d)
    ids, trains, offsets, weights = _inputs(d, tables, 12, seed=10 + d)
    w = weights if weighted else None
    dim = math.prod(COLS[:d]) - 1  # D < M: truncated rows
    ref = ttm_embedding_bag(cores, ROWS[:d], dim, ids, offsets, mode, w, trains)
    out = ttm_embedding_bag(cores, ROWS[:d], dim, ids, offsets, mode, w, trains, static_shapes=True)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    grad = torch.randn(ref.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    params = cores + ([weights] if weighted else [])
    for a, b in zip(torch.autograd.grad(out, params, grad), torch.autograd.grad(ref, params, grad)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def _embedding_bag_reference(rows, row_of_id, offsets, mode, weights):
    """torch's own ``F.embedding_bag`` (weighted sum, then / length for mean)."""
    out = torch.nn.functional.embedding_bag(
        row_of_id, rows, offsets, mode="sum", per_sample_weights=weights, include_last_offset=True
    )
    if mode == "mean":
        out = out / (offsets[1:] - offsets[:-1]).clamp_min(1).to(out.dtype).unsqueeze(1)
    return out


def test_pooling_equals_torch_embedding_bag() -> None:
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(5, 3, generator=g, dtype=torch.float64, requires_grad=True)
    row_of_id = torch.tensor([4, 0, 0, 2, 4, 1, 4])  # repeats, an unused row (3)
    offsets, w = torch.tensor([0, 2, 2, 7]), torch.rand(7, generator=g, dtype=torch.float64)
    grad = torch.randn(3, 3, generator=g, dtype=torch.float64)
    for mode in ("sum", "mean"):
        for weights in (None, w):
            ref = _embedding_bag_reference(rows, row_of_id, offsets, mode, weights)
            ref_grad = torch.autograd.grad(ref, rows, grad)[0]
            for out in (
                pool_bags(rows, row_of_id, offsets, mode, weights),
                pool_bags_static(rows.index_select(0, row_of_id), offsets, mode, weights),
            ):
                torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
                torch.testing.assert_close(torch.autograd.grad(out, rows, grad)[0], ref_grad, rtol=0, atol=1e-12)


class _Shapes(TorchDispatchMode):
    """Records every dispatched operator and the shapes of its tensor outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, tuple]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        flat = out if isinstance(out, (tuple, list)) else (out,)
        self.seen.append((str(func), tuple(tuple(t.shape) for t in flat if isinstance(t, torch.Tensor))))
        return out


@pytest.mark.parametrize("static", [True, False])
def test_shapes_depend_only_on_input_shapes(static: bool) -> None:
    """Forward and backward: the same operators and shapes whether ids repeat or not.

    The de-duplicated path (static=False) is the control: its shapes follow the data.
    """
    cores = _cores(4, 2, rank=2, seed=1)
    offsets = torch.tensor([0, 3, 8])
    runs = []
    for ids in (torch.arange(8) * 5, torch.zeros(8, dtype=torch.long)):  # 8 distinct ids vs 1
        trains = torch.tensor([0, 1] * 4)
        with _Shapes() as rec:
            out = ttm_embedding_bag(cores, ROWS, 11, ids, offsets, "mean", None, trains, static_shapes=static)
            torch.autograd.grad(out.sum(), cores)
        runs.append(rec.seen)
    assert (runs[0] == runs[1]) == static


def test_modules_switch_to_static_shapes() -> None:
    torch.manual_seed(0)
    bag = TTMEmbeddingBag(24, 6, rank=3, mode="mean", shape=((3, 8), (2, 3)), dtype=torch.float64)
    stacked = StackedTTMTables([24, 20], 6, 3, row_shape=(3, 8), col_shape=(2, 3), dtype=torch.float64)
    model = torch.nn.ModuleList([bag, stacked])
    ids, offsets, trains = torch.tensor([1, 23, 1, 5]), torch.tensor([0, 1, 1, 4]), torch.tensor([0, 1, 1, 0])
    before = bag(ids, offsets), stacked(ids, offsets, trains)
    assert set_static_shapes(model) == 2 and bag.static_shapes and stacked.static_shapes
    after = bag(ids, offsets), stacked(ids, offsets, trains)
    for a, b in zip(after, before):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    assert "static_shapes" not in str(bag.state_dict().keys())
    assert set_static_shapes(model, False) == 2 and not bag.static_shapes
