"""Values kept between forwards without gradients (comera_rec/tensor/derived.py) and the
TT modules that keep them: a kept value must never outlive a change of its parameters."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

from comera_rec.tensor import TTLinear
from comera_rec.tensor.derived import DerivedCache, DerivedCaches, cache_applies, cached_weights, derived_cache
from comera_rec.tensor.kernels import ttm_cpu
from comera_rec.tensor.kernels.cpu_extension import cpu_kernel_enabled, extension
from comera_rec.tensor.stacked import StackedTTMTables

needs_kernels = pytest.mark.skipif(not cpu_kernel_enabled(), reason="fused CPU kernels not built")


def _counting(value_of):
    calls = []

    def compute():
        calls.append(1)
        return value_of()

    return calls, compute


def test_kept_while_unchanged_and_recomputed_after_every_kind_of_change():
    w = torch.nn.Parameter(torch.arange(4.0))
    cache = DerivedCache()
    calls, compute = _counting(lambda: w * 2)
    with torch.no_grad(), cached_weights():
        first = cache.get([w], compute)
        assert cache.get([w], compute) is first and len(calls) == 1
        w.mul_(3)  # in place: the version counter moves
        assert torch.equal(cache.get([w], compute), torch.arange(4.0) * 6) and len(calls) == 2
        w.data = torch.ones(4)  # new storage, as .to() and load_state_dict(assign=True) give
        assert torch.equal(cache.get([w], compute), torch.full((4,), 2.0)) and len(calls) == 3
        other = torch.nn.Parameter(w.detach().clone())  # another tensor of equal values
        cache.get([other], compute)
        assert len(calls) == 4


def test_nothing_kept_outside_the_scope_with_gradients_on_or_for_meta_tensors():
    w = torch.nn.Parameter(torch.ones(3))
    cache = DerivedCache()
    calls, compute = _counting(lambda: w * 2)
    with cached_weights():
        cache.get([w], compute)
        out = cache.get([w], compute)
    assert len(calls) == 2 and out.requires_grad  # differentiable, computed each time
    with torch.no_grad():
        cache.get([w], compute)
        w.data.add_(1)  # a write through .data keeps the version counter: why a scope is needed
        assert torch.equal(cache.get([w], compute), torch.full((3,), 4.0)) and len(calls) == 4
        with cached_weights():
            assert not cache_applies([torch.empty(2, device="meta")])
            assert cache_applies([w])
        assert not cache_applies([w])


def test_leaving_the_outermost_scope_drops_kept_values():
    w = torch.nn.Parameter(torch.ones(3))
    cache, caches = DerivedCache(), DerivedCaches(slots=2)
    with torch.no_grad():
        with cached_weights():
            with cached_weights():
                cache.get([w], lambda: w + 1)
                caches.get([w], lambda: w + 1)
            assert not cache.is_empty() and not caches.is_empty()  # the inner exit keeps them
        assert cache.is_empty() and caches.is_empty()


def test_inference_mode_values_are_not_reused_outside_it():
    w = torch.nn.Parameter(torch.ones(3))
    cache = DerivedCache()
    calls, compute = _counting(lambda: w + 1)
    with cached_weights():
        with torch.inference_mode():
            inner = cache.get([w], compute)
        with torch.no_grad():
            outer = cache.get([w], compute)
    assert len(calls) == 2 and inner.is_inference() and not outer.is_inference()


def test_copies_and_pickles_start_empty():
    layer = TTLinear(8, 6, rank=2, shape=((2, 4), (2, 3)))
    with torch.no_grad(), cached_weights():
        layer.scaled_cores()
        assert not derived_cache(layer, "scaled_cores").is_empty()
        for clone in (copy.deepcopy(layer), pickle.loads(pickle.dumps(layer))):
            assert derived_cache(clone, "scaled_cores").is_empty()
            x = torch.randn(3, 8)
            torch.testing.assert_close(clone(x), layer(x), rtol=0, atol=0)


def test_least_recently_used_set_goes_first():
    a, b, c = torch.ones(1), torch.ones(1), torch.ones(1)
    caches = DerivedCaches(slots=2)
    with torch.no_grad(), cached_weights():
        va = caches.get([a], lambda: a + 1)
        caches.get([b], lambda: b + 1)
        assert caches.get([a], lambda: a + 9) is va  # a is now the most recent
        caches.get([c], lambda: c + 1)  # b goes
        assert float(caches.get([b], lambda: b + 5)) == 6.0
    with pytest.raises(ValueError, match="slots"):
        DerivedCaches(slots=0)


def test_byte_bound_evicts_least_recently_used_first():
    a, b, c = torch.ones(4), torch.ones(4), torch.ones(4)  # each value below: 16 or 32 bytes
    caches = DerivedCaches(slots=8, max_bytes=40)
    with torch.no_grad(), cached_weights():
        va = caches.get([a], lambda: a + 1)
        vb = caches.get([b], lambda: (b + 1, b + 2))  # 32 bytes: a (16) goes
        assert caches.nbytes() == 32 and caches.peek([a]) is None and caches.peek([b]) is vb
        caches.get([c], lambda: c + 1)  # 16 more: b goes
        assert caches.nbytes() == 16 and caches.peek([b]) is None and len(caches) == 1
        big = caches.get([a], lambda: torch.ones(20))  # alone over the bound: kept, alone
        assert caches.peek([a]) is big and len(caches) == 1 and caches.peek([c]) is None
        assert va is not big
    assert caches.nbytes() == 0  # dropped with the scope
    with pytest.raises(ValueError, match="max_bytes"):
        DerivedCaches(slots=2, max_bytes=-1)
    assert copy.deepcopy(caches).max_bytes == 40


def test_peek_hands_back_only_an_unchanged_kept_value():
    w = torch.nn.Parameter(torch.arange(3.0))
    cache = DerivedCaches(slots=2)
    with torch.no_grad(), cached_weights():
        assert cache.peek([w]) is None  # nothing kept yet
        kept = cache.get([w], lambda: w * 2)
        assert cache.peek([w]) is kept
        assert cache.peek([torch.nn.Parameter(w.detach().clone())]) is None  # equal values, another tensor
        assert cache.peek([w, w]) is None  # other sources
        w.add_(1)
        assert cache.peek([w]) is None  # an in-place write
        w.data = w.detach()[:2].clone()
        assert cache.peek([w]) is None
    with cached_weights():  # gradients on: nothing is handed back, even what is kept
        with torch.no_grad():
            kept = cache.get([w], lambda: w * 2)
        assert cache.peek([w]) is None
        with torch.no_grad(), torch.inference_mode():
            assert cache.peek([w]) is None  # kept outside inference mode


def test_get_when_asks_its_check_only_without_a_kept_value():
    w = torch.nn.Parameter(torch.arange(3.0))
    cache = DerivedCache()
    asked = []

    def when(answer):
        return lambda: asked.append(answer) or answer

    with torch.no_grad():
        assert cache.get_when([w], lambda: w * 2, when(False)) is None  # the check fails: nothing made
        out = cache.get_when([w], lambda: w * 2, when(True))  # outside the scope: made, not kept
        assert torch.equal(out, w * 2) and cache.is_empty() and asked == [False, True]
        with cached_weights():
            kept = cache.get_when([w], lambda: w * 2, when(True))
            assert cache.get_when([w], lambda: w * 3, when(False)) is kept  # kept: not asked again
            assert asked == [False, True, True]


def test_peek_after_a_shape_only_change_of_the_same_storage():
    # a rank truncation may leave a parameter's storage where it was and only shrink it
    w = torch.nn.Parameter(torch.ones(4, 3))
    cache = DerivedCache()
    with torch.no_grad(), cached_weights():
        cache.get([w], lambda: w.sum())
        w.data = w.data[:2]  # same first element, same version counter
        assert cache.peek([w]) is None
        assert float(cache.get([w], lambda: w.sum())) == 6.0


def _train_step(module: torch.nn.Module, loss) -> None:
    opt = torch.optim.SGD(module.parameters(), lr=0.5)
    opt.zero_grad()
    loss().backward()
    opt.step()


@pytest.mark.parametrize("kernels_on", [True, False])
def test_tt_linear_scoring_follows_training_load_and_truncation(kernels_on):
    if kernels_on and not cpu_kernel_enabled():
        pytest.skip("fused CPU kernels not built")
    torch.manual_seed(0)
    previous = ttm_cpu.cpu_kernels_switched_on()
    ttm_cpu.set_cpu_kernel_enabled(kernels_on)
    try:
        with cached_weights():  # training inside the scope too: versions must tell
            layer = TTLinear(12, 10, rank=3, shape=((3, 4), (2, 5)), relu=True).double()
            x = torch.randn(5, 12, dtype=torch.float64)

            def scored():
                with torch.no_grad():
                    return layer(x)

            def reference():  # the weight reconstructed whole, gradients on (nothing kept)
                return torch.relu(x @ layer.dense_weight().t() + layer.bias)

            for _ in range(2):
                torch.testing.assert_close(scored(), reference().detach())
                _train_step(layer, lambda: layer(x).square().sum())  # in-place optimiser updates
            with torch.no_grad():
                layer.controllers[0][0] = 0.0
            torch.testing.assert_close(scored(), reference().detach())
            assert layer.truncate_ranks(1e-9)
            torch.testing.assert_close(scored(), reference().detach())
            # load_state_dict copies into the parameters a kept value was derived from
            torch.manual_seed(1)
            scorer = TTLinear(12, 10, rank=3, shape=((3, 4), (2, 5)), relu=True).double()
            other = TTLinear(12, 10, rank=3, shape=((3, 4), (2, 5)), relu=True).double()
            with torch.no_grad():
                before = scorer(x)
                scorer.load_state_dict(other.state_dict())
                torch.testing.assert_close(scorer(x), other(x))
                assert not torch.allclose(scorer(x), before)
    finally:
        ttm_cpu.set_cpu_kernel_enabled(previous)


@needs_kernels
@pytest.mark.parametrize("rows, cols", [((4, 3, 5, 2), (2, 1, 2, 2)), ((10, 10), (2, 4)), ((4, 5, 6), (2, 2, 2))])
def test_stacked_lookup_scoring_follows_training(rows, cols):
    torch.manual_seed(0)
    stack = StackedTTMTables([100, 60], 8, rank=3, row_shape=rows, col_shape=cols).double()
    ids = torch.tensor([0, 5, 99, 7, 59, 3])
    trains = torch.tensor([0, 0, 0, 1, 1, 1])
    offsets = torch.tensor([0, 2, 3, 6])

    def reference():
        tables = [stack.dense_weight(t) for t in range(2)]
        rows_ = torch.stack([tables[t][i] for i, t in zip(ids.tolist(), trains.tolist())])
        return torch.stack([rows_[offsets[b] : offsets[b + 1]].sum(0) for b in range(3)])

    with cached_weights():
        for _ in range(3):
            with torch.inference_mode():
                first = stack(ids, offsets, trains)
                again = stack(ids, offsets, trains)  # from the kept whole halves
                assert not derived_cache(stack, "whole_halves").is_empty()
                assert derived_cache(stack, "scaled_cores").is_empty()  # not kept beside them
            torch.testing.assert_close(first, reference().detach())
            torch.testing.assert_close(again, first, rtol=0, atol=0)
            _train_step(stack, lambda: stack(ids, offsets, trains).square().sum())


@needs_kernels
def test_kept_layouts_must_match_the_cores():
    torch.manual_seed(0)
    a = StackedTTMTables([100], 8, rank=3, row_shape=(4, 3, 5, 2), col_shape=(2, 1, 2, 2))
    b = StackedTTMTables([100], 8, rank=4, row_shape=(4, 3, 5, 2), col_shape=(2, 1, 2, 2))
    ids, offsets, trains = torch.tensor([1, 2]), torch.tensor([0, 2]), torch.tensor([0, 0])
    with torch.no_grad():
        wrong = extension().ttm_forward_layouts(list(a.scaled_cores()))
        cores = list(b.scaled_cores())
        with pytest.raises(RuntimeError, match="kept left layout does not match"):
            extension().ttm_bag_forward(
                cores, ids, trains, offsets, torch.empty(0), 8, 0, wrong, torch.empty(0), torch.empty(0), 0, []
            )
        right = extension().ttm_forward_layouts(cores)
        out = extension().ttm_bag_forward(
            cores, ids, trains, offsets, torch.empty(0), 8, 0, right, torch.empty(0), torch.empty(0), 0, []
        )[0]
        ref = extension().ttm_bag_forward(
            cores, ids, trains, offsets, torch.empty(0), 8, 0, [], torch.empty(0), torch.empty(0), 0, []
        )[0]
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
