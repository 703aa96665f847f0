"""The fused CPU TT-layer kernels as ``torch.library`` operators, for graphs that
``torch.compile`` makes.

Eager code calls the kernels through autograd functions (:mod:`.tt_linear_cpu`), which
``torch.compile`` cannot trace: a pybind call is a graph break. Under ``torch.compile`` the
same kernels are called as the operators here instead, each with a shape-only (fake)
implementation and its backward as another operator, so a compiled graph keeps the fused
kernels (without them the compiled TT layers take the PyTorch path: a slower step than
eager, docs/torchrec.md).

* ``comera_train::tt_linear``: the fused TT linear ``act((x @ left) @ right + bias)``,
  returning the output and ``x @ left`` kept for the backward; ``comera_train::
  tt_linear_backward`` its gradients.
* ``comera_train::tt_chain``: consecutive TT linears ``h = act_k((h @ left_k) @ right_k +
  bias_k)``, returning the output and each layer's
  ``x @ left`` kept for the backward (``tt_chain_forward`` in ``tt_linear_cpu.cpp``).
* ``comera_train::tt_chain_backward``: its gradients.
* ``comera_train::tt_chains``: a TT weight's two merged chains from its cores and controllers,
  with the products the backward reads; ``comera_train::tt_chains_backward`` its gradients.

An operator's outputs may not share memory with its inputs or each other, so the chains'
operator returns copies of the few small products the kernel hands out as views; and they
must have the fake outputs' (row-major) strides, so a gradient of a rank that is not a whole
number of vectors, a view of a padded one, is copied row-major.
An empty tensor stands for an absent bias or a gradient not asked for.
"""

from __future__ import annotations

from typing import Sequence

import torch

from comera_rec.tensor.halves import row_major
from comera_rec.tensor.kernels.cpu_extension import cpu_vector_bytes, extension

_NAMESPACE = "comera_train"


def _vector_lanes(dtype: torch.dtype) -> int:
    # the kernels pad ranks to whole vectors: the fake outputs need the padded width
    return cpu_vector_bytes() // torch.empty(0, dtype=dtype).element_size()


def _padded(n: int, lanes: int) -> int:
    return (n + lanes - 1) // lanes * lanes


def _or_empty(t: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return t if t is not None else like.new_empty(0)


def _unshared(outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``outputs`` with each one that shares memory with an input or an earlier output
    copied (an operator's outputs must be tensors of their own)."""
    seen = {t.untyped_storage().data_ptr() for t in inputs if t.numel()}
    out = []
    for t in outputs:
        ptr = t.untyped_storage().data_ptr()
        if t.numel() and ptr in seen:
            t = t.clone()
            ptr = t.untyped_storage().data_ptr()
        seen.add(ptr)
        out.append(t)
    return out


# ----------------------------------------------------------------------- tt_linear


@torch.library.custom_op(f"{_NAMESPACE}::tt_linear", mutates_args=(), device_types="cpu")
def tt_linear_op(
    x: torch.Tensor, left: torch.Tensor, right: torch.Tensor, bias: torch.Tensor, relu: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y (B, N_out), t (B, R))``: one fused TT linear and its ``x @ left`` padded to ``R``,
    the rank rounded up to whole vectors (``tt_linear_forward`` in ``tt_linear_cpu.cpp``).
    ``bias``: ``(N_out,)`` or empty for none."""
    y, t = extension().tt_linear_forward(x, left, right, bias, relu)
    return y, t


@tt_linear_op.register_fake
def _tt_linear_fake(x, left, right, bias, relu):
    rows = x.shape[0]
    return x.new_empty((rows, right.shape[1])), x.new_empty((rows, _padded(left.shape[1], _vector_lanes(x.dtype))))


@torch.library.custom_op(f"{_NAMESPACE}::tt_linear_backward", mutates_args=(), device_types="cpu")
def tt_linear_backward_op(
    grad_y: torch.Tensor,
    x: torch.Tensor,
    left: torch.Tensor,
    right: torch.Tensor,
    t: torch.Tensor,
    y: torch.Tensor,
    need_grad_x: bool,
    need_grad_bias: bool,
    need_grad_left: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(grad_x, grad_left, grad_right, grad_bias)``, each one not asked for empty. ``y``:
    the forward's output where it applied the ReLU (its mask), else empty."""
    grads = extension().tt_linear_backward(
        grad_y.contiguous(), x, left, right, t, y, need_grad_x, need_grad_bias, need_grad_left
    )
    wanted = (need_grad_x, need_grad_left, True, need_grad_bias)
    grad_x, grad_left, grad_right, grad_bias = (
        row_major(_or_empty(g if want else None, x)) for g, want in zip(grads, wanted)
    )
    return grad_x, grad_left, grad_right, grad_bias


@tt_linear_backward_op.register_fake
def _tt_linear_backward_fake(grad_y, x, left, right, t, y, need_grad_x, need_grad_bias, need_grad_left):
    return (
        x.new_empty(x.shape) if need_grad_x else x.new_empty(0),
        left.new_empty(left.shape) if need_grad_left else x.new_empty(0),
        right.new_empty(right.shape),
        x.new_empty((right.shape[1],)) if need_grad_bias else x.new_empty(0),
    )


def _tt_linear_setup(ctx, inputs, output):
    x, left, right, bias, relu = inputs
    y, t = output
    ctx.has_bias = bias.numel() > 0
    ctx.save_for_backward(x, left, right, t, y if relu else x.new_empty(0))


def _tt_linear_backward(ctx, grad_y, grad_t):
    x, left, right, t, y = ctx.saved_tensors
    need_x, need_left, need_right, need_bias, _ = ctx.needs_input_grad
    need_bias = ctx.has_bias and bool(need_bias)
    if grad_y is None:
        grad_y = x.new_zeros((x.shape[0], right.shape[1]))
    grad_x, grad_left, grad_right, grad_bias = tt_linear_backward_op(
        grad_y, x, left, right, t, y, bool(need_x), need_bias, bool(need_left)
    )
    return (
        grad_x if need_x else None,
        grad_left if need_left else None,
        grad_right if need_right else None,
        grad_bias if need_bias else None,
        None,
    )


tt_linear_op.register_autograd(_tt_linear_backward, setup_context=_tt_linear_setup)


def tt_linear_compiled(
    x: torch.Tensor, left: torch.Tensor, right: torch.Tensor, bias: torch.Tensor | None = None, relu: bool = False
) -> torch.Tensor:
    """:func:`~comera_rec.tensor.kernels.tt_linear_cpu` through the ``tt_linear`` operator: the
    same values, traceable by ``torch.compile``.

    Example::

        >>> x, left, right = torch.randn(4, 8), torch.randn(8, 2), torch.randn(2, 6)
        >>> torch.allclose(tt_linear_compiled(x, left, right), x @ left @ right, atol=1e-5)
        True
    """
    return tt_linear_op(x, left, right, _or_empty(bias, x), bool(relu))[0]


# ------------------------------------------------------------------------ tt_chain


@torch.library.custom_op(f"{_NAMESPACE}::tt_chain", mutates_args=(), device_types="cpu")
def tt_chain_op(
    x: torch.Tensor,
    lefts: list[torch.Tensor],
    rights: list[torch.Tensor],
    biases: list[torch.Tensor],
    relus: list[bool],
) -> list[torch.Tensor]:
    """``[y (B, N_K), t_1 (B, R_1), ..., t_K (B, R_K)]``: the chain's output and each layer's
    ``input @ left_k`` padded to ``R_k``, the rank rounded up to whole vectors.

    Args:
        x: ``(B, N_0)``.
        lefts: per layer ``(N_{k-1}, r_k)``.
        rights: per layer ``(r_k, N_k)``.
        biases: per layer ``(N_k,)``, or empty for none.
        relus: per layer, whether its ReLU is applied.
    """
    return list(extension().tt_chain_forward(x, list(lefts), list(rights), list(biases), list(relus)))


@tt_chain_op.register_fake
def _tt_chain_fake(x, lefts, rights, biases, relus):
    lanes = _vector_lanes(x.dtype)
    rows = x.shape[0]
    return [x.new_empty((rows, rights[-1].shape[1]))] + [
        x.new_empty((rows, _padded(left.shape[1], lanes))) for left in lefts
    ]


@torch.library.custom_op(f"{_NAMESPACE}::tt_chain_backward", mutates_args=(), device_types="cpu")
def tt_chain_backward_op(
    grad_y: torch.Tensor,
    x: torch.Tensor,
    lefts: list[torch.Tensor],
    rights: list[torch.Tensor],
    biases: list[torch.Tensor],
    relus: list[bool],
    ts: list[torch.Tensor],
    y: torch.Tensor,
    need_grad_x: bool,
    need_grad_left: list[bool],
    need_grad_bias: list[bool],
) -> list[torch.Tensor]:
    """``[grad_x, then per layer grad_left, grad_right, grad_bias]``, each one not asked for
    empty. ``y``: the forward's output where the last layer has a ReLU (its mask), else empty."""
    grad_x, *grads = extension().tt_chain_backward(
        grad_y.contiguous(),
        x,
        list(lefts),
        list(rights),
        list(biases),
        list(relus),
        list(ts),
        y,
        need_grad_x,
        list(need_grad_left),
        list(need_grad_bias),
    )
    out = [grad_x if need_grad_x else None]
    for k in range(len(lefts)):
        grad_left, grad_right, grad_bias = grads[3 * k : 3 * k + 3]
        out += [grad_left if need_grad_left[k] else None, grad_right, grad_bias if need_grad_bias[k] else None]
    return [row_major(_or_empty(t, x)) for t in out]


@tt_chain_backward_op.register_fake
def _tt_chain_backward_fake(
    grad_y, x, lefts, rights, biases, relus, ts, y, need_grad_x, need_grad_left, need_grad_bias
):
    out = [x.new_empty(x.shape) if need_grad_x else x.new_empty(0)]
    for k, (left, right) in enumerate(zip(lefts, rights)):
        out += [
            left.new_empty(left.shape) if need_grad_left[k] else x.new_empty(0),
            right.new_empty(right.shape),
            x.new_empty((right.shape[1],)) if need_grad_bias[k] else x.new_empty(0),
        ]
    return out


def _tt_chain_setup(ctx, inputs, output):
    x, lefts, rights, biases, relus = inputs
    y, *ts = output
    ctx.num_layers = len(lefts)
    ctx.relus = list(relus)
    ctx.has_bias = [b.numel() > 0 for b in biases]
    # the output is the last layer's ReLU mask
    ctx.save_for_backward(x, *lefts, *rights, *biases, *ts, y if relus[-1] else x.new_empty(0))


def _tt_chain_backward(ctx, grads):
    grad_y = grads[0]
    k = ctx.num_layers
    saved = ctx.saved_tensors
    x, lefts, rights, biases, ts = (
        saved[0],
        list(saved[1 : 1 + k]),
        list(saved[1 + k : 1 + 2 * k]),
        list(saved[1 + 2 * k : 1 + 3 * k]),
        list(saved[1 + 3 * k : 1 + 4 * k]),
    )
    need_x, need_lefts, need_rights, need_biases, _ = ctx.needs_input_grad
    need_left = [bool(n) for n in need_lefts]
    need_bias = [ctx.has_bias[j] and bool(need_biases[j]) for j in range(k)]
    if grad_y is None:
        grad_y = x.new_zeros((x.shape[0], rights[-1].shape[1]))
    grad_x, *per_layer = tt_chain_backward_op(
        grad_y, x, lefts, rights, biases, ctx.relus, ts, saved[-1], bool(need_x), need_left, need_bias
    )
    grad_lefts = [per_layer[3 * j] if need_left[j] else None for j in range(k)]
    grad_rights = [per_layer[3 * j + 1] if need_rights[j] else None for j in range(k)]
    grad_biases = [per_layer[3 * j + 2] if need_bias[j] else None for j in range(k)]
    return grad_x if need_x else None, grad_lefts, grad_rights, grad_biases, None


tt_chain_op.register_autograd(_tt_chain_backward, setup_context=_tt_chain_setup)


def tt_chain_compiled(
    x: torch.Tensor, layers: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, bool]]
) -> torch.Tensor:
    """:func:`~comera_rec.tensor.kernels.tt_chain_cpu` through the ``tt_chain`` operator: the
    same values, traceable by ``torch.compile``.

    Args:
        x: ``(B, N_0)``.
        layers: per layer ``(left, right, bias or None, relu)``.

    Returns:
        ``(B, N_K)``.

    Example::

        >>> x = torch.randn(4, 8)
        >>> left, right = torch.randn(8, 2), torch.randn(2, 6)
        >>> y = tt_chain_compiled(x, [(left, right, None, True)])
        >>> torch.allclose(y, torch.relu(x @ left @ right), atol=1e-5)
        True
    """
    lefts = [layer[0] for layer in layers]
    rights = [layer[1] for layer in layers]
    biases = [_or_empty(layer[2], x) for layer in layers]
    return tt_chain_op(x, lefts, rights, biases, [bool(layer[3]) for layer in layers])[0]


# ----------------------------------------------------------------------- tt_chains


def _chains_saved_shapes(cores: Sequence[torch.Tensor], d: int) -> list[tuple[int, int]]:
    # the products chains_forward keeps, in its order: (P_k, Q_k) per input-side bond k,
    # each (n_1 ... n_{k+1}, r_{k+1}); then (R_k, S_k) per output-side bond from the last,
    # each (r_k, n_{k+1} ... n_{2d})
    shapes = []
    rows = 1
    for k in range(d):
        rows *= cores[k].shape[1]
        shapes += [(rows, cores[k].shape[2])] * 2
    cols = cores[2 * d - 1].shape[1]
    for k in range(2 * d - 2, d - 1, -1):
        shapes += [(cores[k].shape[2], cols)] * 2
        cols *= cores[k].shape[1]
    return shapes


@torch.library.custom_op(f"{_NAMESPACE}::tt_chains", mutates_args=(), device_types="cpu")
def tt_chains_op(
    cores: list[torch.Tensor], controllers: list[torch.Tensor], d: int, in_features: int, out_features: int
) -> list[torch.Tensor]:
    """``[left (in_features, r), right (r, out_features), then the products the backward
    reads]`` of a TT weight with ``d`` input-side cores (``tt_chains_forward`` in
    ``tt_linear_cpu.cpp``)."""
    left, right, *saved = extension().tt_chains_forward(list(cores), list(controllers), d, in_features, out_features)
    # left and right are views of the train's first rows / columns: the fake's strides are a
    # whole matrix's
    return _unshared([row_major(left), row_major(right), *saved], list(cores) + list(controllers))


@tt_chains_op.register_fake
def _tt_chains_fake(cores, controllers, d, in_features, out_features):
    like = cores[0]
    left = like.new_empty((in_features, cores[d - 1].shape[2]))
    right = like.new_empty((cores[d].shape[0], out_features))
    return [left, right] + [like.new_empty(shape) for shape in _chains_saved_shapes(cores, d)]


@torch.library.custom_op(f"{_NAMESPACE}::tt_chains_backward", mutates_args=(), device_types="cpu")
def tt_chains_backward_op(
    grad_left: torch.Tensor,
    grad_right: torch.Tensor,
    cores: list[torch.Tensor],
    controllers: list[torch.Tensor],
    saved: list[torch.Tensor],
    d: int,
) -> list[torch.Tensor]:
    """The gradients of the ``2d`` cores, then of the ``2d - 1`` controllers."""
    grads = extension().tt_chains_backward(
        grad_left.contiguous(), grad_right.contiguous(), list(cores), list(controllers), list(saved), d
    )
    return _unshared([row_major(g) for g in grads], [grad_left, grad_right, *cores, *controllers, *saved])


@tt_chains_backward_op.register_fake
def _tt_chains_backward_fake(grad_left, grad_right, cores, controllers, saved, d):
    return [c.new_empty(c.shape) for c in cores] + [c.new_empty(c.shape) for c in controllers]


def _tt_chains_setup(ctx, inputs, output):
    cores, controllers, d, _, _ = inputs
    ctx.d = d
    ctx.num_cores = len(cores)
    ctx.save_for_backward(*cores, *controllers, *output[2:])


def _tt_chains_backward(ctx, grads):
    grad_left, grad_right = grads[0], grads[1]
    n, d = ctx.num_cores, ctx.d
    saved = ctx.saved_tensors
    cores, controllers, products = list(saved[:n]), list(saved[n : 2 * n - 1]), list(saved[2 * n - 1 :])
    if grad_left is None:
        grad_left = products[2 * d - 1].new_zeros(products[2 * d - 1].shape)
    if grad_right is None:
        grad_right = cores[d].new_zeros((cores[d].shape[0], 1))
    out = tt_chains_backward_op(grad_left, grad_right, cores, controllers, products, d)
    need_cores, need_controllers = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    grad_cores = [g if need else None for g, need in zip(out[:n], need_cores)]
    grad_controllers = [g if need else None for g, need in zip(out[n:], need_controllers)]
    return grad_cores, grad_controllers, None, None, None


tt_chains_op.register_autograd(_tt_chains_backward, setup_context=_tt_chains_setup)


def tt_chains_compiled(
    cores: Sequence[torch.Tensor], controllers: Sequence[torch.Tensor], d: int, in_features: int, out_features: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`~comera_rec.tensor.kernels.tt_chains_cpu` through the ``tt_chains`` operator:
    the same ``(left, right)``, traceable by ``torch.compile``.

    Args:
        cores: the ``d`` input-side cores, then the ``d`` output-side ones.
        controllers: the ``2d - 1`` bond controllers.
        d: the input-side cores.
        in_features: rows of ``left`` kept.
        out_features: columns of ``right`` kept.
    """
    out = tt_chains_op(list(cores), list(controllers), d, in_features, out_features)
    return out[0], out[1]
