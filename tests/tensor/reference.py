"""Reference reconstructions written independently of the library's contraction code."""

from __future__ import annotations

import string

import torch


def full_train(cores: list[torch.Tensor], controllers: list[torch.Tensor]) -> torch.Tensor:
    """Contract a whole train ``G_1 D_1 G_2 ... G_K`` with one einsum.

    Each core is ``(r_{k-1}, *modes, r_k)``; the result has all modes in order.
    """
    letters = iter(string.ascii_letters)
    rank_letters = [next(letters) for _ in range(len(cores) + 1)]
    terms, operands, out = [], [], []
    for k, core in enumerate(cores):
        modes = [next(letters) for _ in range(core.dim() - 2)]
        out += modes
        terms.append(rank_letters[k] + "".join(modes) + rank_letters[k + 1])
        operands.append(core)
        if k < len(controllers):
            terms.append(rank_letters[k + 1])
            operands.append(controllers[k])
    expr = ",".join(terms) + "->" + rank_letters[0] + "".join(out) + rank_letters[-1]
    full = torch.einsum(expr, *operands)
    return full.reshape(full.shape[1:-1])


def linear_weight(layer) -> torch.Tensor:
    """(out_features, in_features) weight of a TTLinear from its cores."""
    d = len(layer.in_shape)
    full = full_train(list(layer.cores), list(layer.controllers))  # (n_1..n_d, n_d+1..n_2d)
    n_in = 1
    for n in layer.in_shape:
        n_in *= n
    w = full.reshape(n_in, -1)[: layer.in_features, : layer.out_features]
    assert d == len(layer.out_shape)
    return w.t()


def ttm_table(bag) -> torch.Tensor:
    """(num_embeddings, embedding_dim) table of a TTMEmbeddingBag from its cores."""
    d = len(bag.row_shape)
    full = full_train(list(bag.cores), list(bag.controllers))  # (n_1, m_1, ..., n_d, m_d)
    full = full.permute(*range(0, 2 * d, 2), *range(1, 2 * d, 2))  # (n_1..n_d, m_1..m_d)
    rows = full.reshape(-1, full[(0,) * d].numel())
    return rows[: bag.num_embeddings, : bag.embedding_dim]


def embedding_bag(table, ids, offsets, mode, weights=None) -> torch.Tensor:
    """Plain-Python pooled lookup over include_last_offset offsets."""
    out = []
    for b in range(offsets.numel() - 1):
        lo, hi = int(offsets[b]), int(offsets[b + 1])
        acc = table.new_zeros(table.shape[1])
        for j in range(lo, hi):
            w = 1.0 if weights is None else weights[j]
            acc = acc + w * table[ids[j]]
        if mode == "mean" and hi > lo:
            acc = acc / (hi - lo)
        out.append(acc)
    return torch.stack(out)
