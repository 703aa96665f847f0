import pytest
import torch

from comera_rec.tensor.svd import tt_svd

from .reference import full_train


@pytest.mark.parametrize("shape", [(4, 5, 6), (3, 3), (2, 3, 2, 3), (50, 2, 3)])
def test_exact_at_full_rank(shape) -> None:
    t = torch.randn(*shape, dtype=torch.float64)
    cores = tt_svd(t, 10_000)
    torch.testing.assert_close(full_train(cores, []), t)


def test_low_rank_tensor_recovered_at_its_rank() -> None:
    # A tensor of TT ranks (2, 2) is reproduced exactly at rank 2 and not at rank 1.
    cores = [torch.randn(1, 6, 2), torch.randn(2, 7, 2), torch.randn(2, 8, 1)]
    t = full_train([c.double() for c in cores], [])
    torch.testing.assert_close(full_train(tt_svd(t, 2), []), t)
    assert (full_train(tt_svd(t, 1), []) - t).abs().max() > 1e-3


def test_wide_unfolding_goes_through_gram_matrix() -> None:
    # first unfolding is 3 x 4000: the Gram route must still be exact
    t = torch.randn(3, 40, 100, dtype=torch.float64)
    torch.testing.assert_close(full_train(tt_svd(t, [3, 100]), []), t)


def test_ranks_are_capped_and_dtype_kept() -> None:
    t = torch.randn(2, 3, 4)
    cores = tt_svd(t, [100, 1])
    assert [tuple(c.shape) for c in cores] == [(1, 2, 2), (2, 3, 1), (1, 4, 1)]
    assert all(c.dtype == torch.float32 for c in cores)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape, ranks", [((4, 6, 5), [3, 4]), ((8, 8), [8]), ((1, 5, 1, 3), [1, 2, 2])])
def test_cores_are_laid_out_row_major(shape, ranks, dtype) -> None:
    # the SVD's factors are column-major; parameters made from the cores must not be, else
    # autograd copies their gradients and DDP warns of its bucket views
    cores = tt_svd(torch.randn(shape, dtype=dtype), ranks)
    for c in cores:
        assert c.stride() == torch.empty(c.shape).stride(), (tuple(c.shape), c.stride())
        assert c.dtype == dtype


def test_bad_ranks() -> None:
    with pytest.raises(ValueError, match="expected 2 ranks"):
        tt_svd(torch.randn(2, 2, 2), [1])
    with pytest.raises(ValueError, match=">= 1"):
        tt_svd(torch.randn(2, 2, 2), 0)
