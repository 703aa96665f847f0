"""TT-SVD: tensor-train cores from a dense tensor, used to convert trained dense layers."""

from __future__ import annotations

from typing import Sequence

import torch


def _left_factor(matrix: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Best rank-``rank`` split ``matrix ~= U @ R`` with orthonormal U.

    A wide matrix (few rows, very many columns: the first unfoldings of a large table)
    goes through the small Gram matrix, so no SVD of a huge matrix is ever formed.
    """
    rows, cols = matrix.shape
    if rows <= cols:
        gram = matrix @ matrix.t()  # (rows, rows)
        _, vectors = torch.linalg.eigh(gram)  # ascending eigenvalues
        u = vectors[:, -rank:].flip(1)  # (rows, rank), largest first
        return u, u.t() @ matrix
    u, s, vh = torch.linalg.svd(matrix, full_matrices=False)
    return u[:, :rank], s[:rank, None] * vh[:rank]


def tt_svd(tensor: torch.Tensor, max_rank: int | Sequence[int]) -> list[torch.Tensor]:
    """Decompose ``tensor`` of shape ``(n_1, ..., n_K)`` into K cores ``(r_{k-1}, n_k, r_k)``.

    Works in float64; the cores are returned in the input's dtype. At a rank at least
    the tensor's TT ranks the decomposition is exact (to float tolerance).

    Args:
        tensor: the dense tensor (K >= 1 modes).
        max_rank: the largest rank of every bond, or one value per bond (K - 1 values).

    Returns:
        The cores; bond k has rank ``min(max_rank_k, n_1...n_k, n_{k+1}...n_K)``.

    Example::

        >>> t = torch.randn(4, 5, 6, dtype=torch.float64)
        >>> cores = tt_svd(t, 30)
        >>> [tuple(c.shape) for c in cores]
        [(1, 4, 4), (4, 5, 6), (6, 6, 1)]
    """
    shape = list(tensor.shape)
    k_modes = len(shape)
    caps = [max_rank] * (k_modes - 1) if isinstance(max_rank, int) else list(max_rank)
    if len(caps) != k_modes - 1:
        raise ValueError(f"tt_svd: expected {k_modes - 1} ranks for {k_modes} modes, got {caps}")
    if any(r < 1 for r in caps):
        raise ValueError(f"tt_svd: ranks must be >= 1, got {caps}")
    work = tensor.detach().to(torch.float64)
    cores: list[torch.Tensor] = []
    r_prev = 1
    rest = work.reshape(shape[0], -1)
    for k in range(k_modes - 1):
        mat = rest.reshape(r_prev * shape[k], -1)
        r = min(caps[k], mat.shape[0], mat.shape[1])
        u, rest = _left_factor(mat, r)
        cores.append(u.reshape(r_prev, shape[k], r))
        r_prev = r
    cores.append(rest.reshape(r_prev, shape[-1], 1))
    # row-major copies: the SVD's factors are column-major, and a parameter laid out otherwise
    # than its gradients makes autograd copy each gradient and DDP warn of its bucket views
    return [torch.empty(c.shape, dtype=tensor.dtype, device=c.device).copy_(c) for c in cores]
