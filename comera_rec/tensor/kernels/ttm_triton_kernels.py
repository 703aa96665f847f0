"""The Triton kernels of the fused TTM lookup (:mod:`.ttm_triton`), and their jitting.

The four kernel bodies (forward, backward into the prefixes, into the suffixes, into the
per-sample weights) are plain functions, jitted by :func:`jit_kernel` on first launch, once
per interpreter setting (``TRITON_INTERPRET``). Triton is imported here, not by
:mod:`comera_rec.tensor.kernels`; without it the module still imports and launching raises.
The launchers are in :mod:`.ttm_triton_launch`.
"""

from __future__ import annotations

import functools
import os
from typing import Callable

try:
    import triton
    import triton.language as tl
except ImportError:  # the module stays importable; launching raises
    triton = None
    tl = None


# ---------------------------------------------------------------------------- kernels
# Plain functions, jitted by jit_kernel() at first launch. Layouts (all contiguous):
#   prefix (K_p, M_L, R), suffix (K_s, R, M_R), out / grad_out (B, D) with D <= M_L * M_R,
#   output column d = a * M_R + b (a < M_L, b < M_R).


def ttm_bag_fwd_kernel(
    prefix_ptr,
    suffix_ptr,
    p_of_id_ptr,
    s_of_id_ptr,
    weights_ptr,
    offsets_ptr,
    out_ptr,
    D,
    M_L,
    M_R,
    R,
    HAS_WEIGHTS: tl.constexpr,
    MEAN: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    bag = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)  # (BLOCK_D,) output columns
    d_mask = d < D
    a = d // M_R  # prefix row of each column
    b = d % M_R  # suffix column of each column
    k = tl.arange(0, BLOCK_R)
    start = tl.load(offsets_ptr + bag)
    end = tl.load(offsets_ptr + bag + 1)
    acc = tl.zeros([BLOCK_D], dtype=ACC)
    for i in range(start, end):
        p = tl.load(p_of_id_ptr + i)
        s = tl.load(s_of_id_ptr + i)
        row = tl.zeros([BLOCK_D], dtype=ACC)
        for k0 in range(0, R, BLOCK_R):
            kk = k0 + k
            m = d_mask[:, None] & (kk < R)[None, :]  # (BLOCK_D, BLOCK_R)
            pv = tl.load(prefix_ptr + p * (M_L * R) + a[:, None] * R + kk[None, :], mask=m, other=0.0)
            sv = tl.load(suffix_ptr + s * (R * M_R) + kk[None, :] * M_R + b[:, None], mask=m, other=0.0)
            row += tl.sum(pv.to(ACC) * sv.to(ACC), axis=1)
        if HAS_WEIGHTS:
            row = row * tl.load(weights_ptr + i).to(ACC)
        acc += row
    if MEAN:
        acc = acc / tl.maximum(end - start, 1).to(ACC)
    tl.store(out_ptr + bag * D + d, acc, mask=d_mask)


def ttm_bag_bwd_prefix_kernel(
    grad_out_ptr,
    suffix_ptr,
    s_of_id_ptr,
    bag_of_id_ptr,
    coef_ptr,
    order_ptr,
    item_key_ptr,
    item_lo_ptr,
    item_hi_ptr,
    grad_prefix_ptr,
    D,
    M_L,
    M_R,
    R,
    ACC: tl.constexpr,
    BLOCK_ML: tl.constexpr,
    BLOCK_MR: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    item = tl.program_id(0)
    kk = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)  # (BLOCK_R,) rank slice
    a = tl.arange(0, BLOCK_ML)
    b = tl.arange(0, BLOCK_MR)
    k_mask = kk < R
    col = a[:, None] * M_R + b[None, :]  # (BLOCK_ML, BLOCK_MR) output column
    g_mask = (a[:, None] < M_L) & (b[None, :] < M_R) & (col < D)
    s_mask = k_mask[:, None] & (b[None, :] < M_R)  # (BLOCK_R, BLOCK_MR)
    key = tl.load(item_key_ptr + item)
    lo = tl.load(item_lo_ptr + item)
    hi = tl.load(item_hi_ptr + item)
    acc = tl.zeros([BLOCK_ML, BLOCK_R], dtype=ACC)
    for j in range(lo, hi):
        i = tl.load(order_ptr + j)
        s = tl.load(s_of_id_ptr + i)
        bag = tl.load(bag_of_id_ptr + i)
        g = tl.load(grad_out_ptr + bag * D + col, mask=g_mask, other=0.0).to(ACC)  # (ML, MR)
        g = g * tl.load(coef_ptr + i).to(ACC)
        sv = tl.load(suffix_ptr + s * (R * M_R) + kk[:, None] * M_R + b[None, :], mask=s_mask, other=0.0)
        acc += tl.sum(g[:, None, :] * sv.to(ACC)[None, :, :], axis=2)  # (ML, R): g @ suffix^T
    # static segments have empty items (lo == hi): no add (broadcast: a scalar mask upsets the interpreter)
    p_mask = (a[:, None] < M_L) & (k_mask & (kk * 0 + hi > lo))[None, :]
    tl.atomic_add(grad_prefix_ptr + key * (M_L * R) + a[:, None] * R + kk[None, :], acc, mask=p_mask)


def ttm_bag_bwd_suffix_kernel(
    grad_out_ptr,
    prefix_ptr,
    p_of_id_ptr,
    bag_of_id_ptr,
    coef_ptr,
    order_ptr,
    item_key_ptr,
    item_lo_ptr,
    item_hi_ptr,
    grad_suffix_ptr,
    D,
    M_L,
    M_R,
    R,
    ACC: tl.constexpr,
    BLOCK_ML: tl.constexpr,
    BLOCK_MR: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    item = tl.program_id(0)
    kk = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)  # (BLOCK_R,) rank slice
    a = tl.arange(0, BLOCK_ML)
    b = tl.arange(0, BLOCK_MR)
    k_mask = kk < R
    col = a[:, None] * M_R + b[None, :]  # (BLOCK_ML, BLOCK_MR) output column
    g_mask = (a[:, None] < M_L) & (b[None, :] < M_R) & (col < D)
    p_mask = (a[:, None] < M_L) & k_mask[None, :]  # (BLOCK_ML, BLOCK_R)
    key = tl.load(item_key_ptr + item)
    lo = tl.load(item_lo_ptr + item)
    hi = tl.load(item_hi_ptr + item)
    acc = tl.zeros([BLOCK_R, BLOCK_MR], dtype=ACC)
    for j in range(lo, hi):
        i = tl.load(order_ptr + j)
        p = tl.load(p_of_id_ptr + i)
        bag = tl.load(bag_of_id_ptr + i)
        g = tl.load(grad_out_ptr + bag * D + col, mask=g_mask, other=0.0).to(ACC)  # (ML, MR)
        g = g * tl.load(coef_ptr + i).to(ACC)
        pv = tl.load(prefix_ptr + p * (M_L * R) + a[:, None] * R + kk[None, :], mask=p_mask, other=0.0)
        acc += tl.sum(pv.to(ACC)[:, :, None] * g[:, None, :], axis=0)  # (R, MR): prefix^T @ g
    s_mask = (k_mask & (kk * 0 + hi > lo))[:, None] & (b[None, :] < M_R)  # no add for an empty item
    tl.atomic_add(grad_suffix_ptr + key * (R * M_R) + kk[:, None] * M_R + b[None, :], acc, mask=s_mask)


def ttm_bag_bwd_weights_kernel(
    grad_out_ptr,
    prefix_ptr,
    suffix_ptr,
    p_of_id_ptr,
    s_of_id_ptr,
    bag_of_id_ptr,
    scale_ptr,
    grad_weights_ptr,
    D,
    M_L,
    M_R,
    R,
    ACC: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    p = tl.load(p_of_id_ptr + i)
    s = tl.load(s_of_id_ptr + i)
    bag = tl.load(bag_of_id_ptr + i)
    k = tl.arange(0, BLOCK_R)
    total = tl.zeros([BLOCK_D], dtype=ACC)
    for d0 in range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        d_mask = d < D
        a = d // M_R
        b = d % M_R
        row = tl.zeros([BLOCK_D], dtype=ACC)
        for k0 in range(0, R, BLOCK_R):
            kk = k0 + k
            m = d_mask[:, None] & (kk < R)[None, :]
            pv = tl.load(prefix_ptr + p * (M_L * R) + a[:, None] * R + kk[None, :], mask=m, other=0.0)
            sv = tl.load(suffix_ptr + s * (R * M_R) + kk[None, :] * M_R + b[:, None], mask=m, other=0.0)
            row += tl.sum(pv.to(ACC) * sv.to(ACC), axis=1)
        g = tl.load(grad_out_ptr + bag * D + d, mask=d_mask, other=0.0).to(ACC)
        total += row * g
    dw = tl.sum(total, axis=0) * tl.load(scale_ptr + i).to(ACC)
    tl.store(grad_weights_ptr + i, dw)


@functools.lru_cache(maxsize=None)
def _jitted(fn: Callable, interpret: bool) -> Callable:
    """``triton.jit(fn)``, made once per kernel and interpreter setting."""
    return triton.jit(fn)


def interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter (``TRITON_INTERPRET=1``)."""
    knobs = getattr(triton, "knobs", None)  # triton >= 3.4
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def jit_kernel(fn: Callable) -> Callable:
    """The jitted form of one of this module's kernels, for the current interpreter setting.

    Args:
        fn: a kernel of this module (a plain function), e.g. :func:`ttm_bag_fwd_kernel`.

    Returns:
        ``triton.jit(fn)``, made on first use and cached.

    Raises:
        RuntimeError: triton is not installed.
    """
    if triton is None:
        raise RuntimeError("comera_rec Triton kernels: triton is not installed (pip install 'comera-rec[gpu]')")
    return _jitted(fn, interpreting())
