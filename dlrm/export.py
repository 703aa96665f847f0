"""An inference form of a DLRM, dense or compressed, for ``torch.export``.

:func:`serving_model` turns a trained TorchRec ``DLRM`` / ``DLRM_DCN`` (as
:func:`dlrm.model.make_dlrm` builds it, dense or with TTM tables and TT layers) into a
:class:`ServingDLRM`: the same logits from plain PyTorch operators, every shape a function
of the input shapes or of one ``torch.unique`` (no Python branching on data, no C++ kernel
without a fake kernel, no rank controllers). :func:`export_dlrm` exports it with a dynamic
batch and id count; the program is saved with ``torch.export.save`` and runs after
``torch.export.load`` without comera-rec's training code.

What is folded when the serving form is made (values equal up to rounding):

* TTM tables: the controllers go into the cores and each stacked train's two halves (the
  first ``ceil(d / 2)`` cores and the rest) are contracted over all their row indices once;
  a lookup takes the distinct ``(table, id)`` keys of the batch (``torch.unique``), one
  prefix and one suffix per key, one small contraction per key, and pools the bags with
  ``embedding_bag`` over those rows: the de-duplicated TTM lookup.
* TT layers: the controllers go into the cores and each side's chain is merged once into
  ``left (in, r)`` and ``right (r, out)``; the layer is ``x @ left @ right + bias``.
* Uncompressed tables: concatenated into one table read by one ``embedding_bag``
  (the table-batched layout FBGEMM uses); ids of other tables read row 0 with weight 0.
* ``NarrowLinear`` -> linear + ReLU; ``PairwiseDotInteraction`` -> batched GEMM + gather.

With ``kernels=True`` the sparse lookup, TT layers, pairwise-dot interaction and TT cross net
are calls of the fused CPU kernels as PyTorch operators instead (``torch.ops.comera_rec.*``,
:mod:`comera_rec.dlrm.serving_ops`): the same values (to float rounding), as fast as the
eager compressed model. Such a program runs where the operator library is loaded
(``torch.ops.load_library``, before ``torch.export.load``), still without comera-rec's
Python code or TorchRec; :func:`load_exported` loads it when a program needs it. A DCN
model's TT cross net and its top MLP's TT layers are then one call
(:func:`~comera_rec.dlrm.export_layers.fuse_cross_net_and_top_mlp`).

Inputs of the program: ``dense_features (B, 13)`` float, and the KeyedJaggedTensor as
``values (N,)`` and ``lengths (F, B)`` (its key-major lengths, one row per feature in
``ServingDLRM.feature_names`` order; :func:`kjt_inputs` makes them). Output: logits ``(B, 1)``.
Ids are not range-checked (an out-of-range id is an indexing error, not a named one; with
``kernels=True`` an id outside its uncompressed table or its TT row shape is a named error).

The dense parts' inference forms are :mod:`comera_rec.dlrm.export_layers`, the lookup's
:mod:`comera_rec.dlrm.export_lookup`; their names are importable from here too.
"""

from __future__ import annotations

import zipfile
from pathlib import Path
from typing import Optional, Union

import torch
from torch import nn
from torch.export import Dim, ExportedProgram
from torchrec.models.dlrm import DLRM, DLRMTrain
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

# re-exported: importable from here as before the split
from comera_rec.dlrm.export_layers import (  # noqa: F401
    ExportError,
    ServingCrossNet,
    ServingLinear,
    ServingPairwiseDot,
    ServingTTLinear,
    fuse_cross_net_and_top_mlp,
    serving_dense_part,
)
from comera_rec.dlrm.export_lookup import ServingLookup
from comera_rec.dlrm.serving_ops import LIBRARY, NAMESPACE, operator_library, operators_loaded
from comera_rec.tensor.linear import TTLinear

PathLike = Union[str, Path]


# ------------------------------------------------------------------------------ the model


class ServingDLRM(nn.Module):
    """A DLRM in inference form: ``(dense_features, values, lengths) -> logits (B, 1)``.

    Args:
        model: TorchRec ``DLRM`` or ``DLRM_DCN`` (or ``DLRMTrain`` around one),
            unsharded, dense or compressed.
        kernels: the sparse lookup, TT layers, pairwise-dot interaction and TT cross net
            as ``torch.ops.comera_rec`` calls (see the module docstring).

    Raises:
        ExportError: naming the part that has no inference form, or (``kernels``) why
            the operator library is not available.
    """

    def __init__(self, model: nn.Module, kernels: bool = False) -> None:
        super().__init__()
        if kernels:
            _require_operators()
        if isinstance(model, DLRMTrain):
            model = model.model
        if not isinstance(model, DLRM):  # DLRM_DCN is a DLRM
            raise ExportError(f"model ({type(model).__name__}): expected TorchRec's DLRM, DLRM_DCN or DLRMTrain")
        sparse = model.sparse_arch
        ebc = getattr(sparse, "embedding_bag_collection", None)
        if ebc is None:
            raise ExportError(f"sparse_arch ({type(sparse).__name__}): has no embedding_bag_collection")
        self.feature_names: list[str] = list(sparse.sparse_feature_names)
        self.dense_in_features = _in_features(model.dense_arch)
        self.dense_arch = serving_dense_part(model.dense_arch, "dense_arch", kernels)
        self.sparse_arch = ServingLookup(self.feature_names, ebc, "sparse_arch.embedding_bag_collection", kernels)
        self.inter_arch = serving_dense_part(model.inter_arch, "inter_arch", kernels)
        self.over_arch = serving_dense_part(model.over_arch, "over_arch", kernels)
        if kernels:
            fuse_cross_net_and_top_mlp(self.inter_arch, self.over_arch)

    def forward(self, dense_features: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Logits ``(B, 1)`` of ``dense_features (B, in)``, ids ``values (N,)`` and ``lengths (F, B)``."""
        embedded_dense = self.dense_arch(dense_features)
        embedded_sparse = self.sparse_arch(values, lengths)
        return self.over_arch(self.inter_arch(dense_features=embedded_dense, sparse_features=embedded_sparse))

    def example_inputs(self, batch_size: int = 4, ids_per_bag: int = 1) -> tuple[torch.Tensor, ...]:
        """Inputs of the right kinds for tracing: id 0 in every bag.

        Args:
            batch_size: B (at least 2: export specialises sizes 0 and 1).
            ids_per_bag: ids in every bag.
        """
        lengths = torch.full((len(self.feature_names), batch_size), ids_per_bag, dtype=torch.long)
        values = torch.zeros(int(lengths.sum()), dtype=torch.long)
        return torch.randn(batch_size, self.dense_in_features), values, lengths


def _in_features(dense_arch: nn.Module) -> int:
    """The dense input width: the first linear layer's ``in_features``."""
    for module in dense_arch.modules():
        if isinstance(module, nn.Linear):
            return module.in_features
        if isinstance(module, TTLinear):
            return module.in_features
    raise ExportError(f"dense_arch ({type(dense_arch).__name__}): no linear layer to take the dense features")


def _require_operators() -> None:
    """Load the operator library of ``kernels=True`` programs, or say why it cannot be."""
    if operator_library() is None:
        why = LIBRARY.error or "the CPU kernels are switched off (set_cpu_kernel_enabled / COMERA_DISABLE_CPU_KERNEL)"
        raise ExportError(f"kernels=True: the operator library torch.ops.comera_rec is not available ({why})")


def serving_model(model: nn.Module, kernels: bool = False) -> ServingDLRM:
    """The inference form of a trained DLRM (see the module docstring), in eval mode.

    Args:
        model: TorchRec ``DLRM`` / ``DLRM_DCN`` (or ``DLRMTrain``), dense or compressed.
        kernels: the fused CPU kernels as ``torch.ops.comera_rec`` calls (module docstring).

    Raises:
        ExportError: naming the part that has no inference form, or why the operator
            library is not available (``kernels``).

    Example::

        >>> from comera_rec.dlrm.config import DLRMConfig
        >>> from comera_rec.dlrm.model import build_dlrm
        >>> cfg = DLRMConfig(table_sizes=[20_000, 50], embedding_dim=8, bottom_mlp=[16, 8],
        ...                  top_mlp=[16, 1], rank=4, min_params_to_compress=0)
        >>> serving = serving_model(build_dlrm(cfg))
        >>> serving(*serving.example_inputs(3)).shape
        torch.Size([3, 1])
    """
    return ServingDLRM(model, kernels).eval()


def kjt_inputs(features: KeyedJaggedTensor, feature_names: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values (N,), lengths (F, B))``, int64, of a KeyedJaggedTensor, keys in ``feature_names`` order.

    Args:
        features: one bag per sample and feature (stride B), unweighted.
        feature_names: the model's features (``ServingDLRM.feature_names``).

    Raises:
        ValueError: a feature is missing, or the KJT has variable strides per key.
    """
    if features.variable_stride_per_key():
        raise ValueError("kjt_inputs: variable batch sizes per feature do not export")
    keys = features.keys()
    missing = [f for f in feature_names if f not in keys]
    if missing:
        raise ValueError(f"kjt_inputs: the KeyedJaggedTensor lacks feature(s) {missing}; its keys are {keys}")
    if keys != feature_names:
        features = features.permute([keys.index(f) for f in feature_names])
    # int64: the exported program checks its inputs' dtypes, and traces with int64 ids
    return features.values().long(), features.lengths().long().view(len(feature_names), -1)


def dynamic_shapes() -> tuple[dict[int, Dim], dict[int, Dim], dict[int, Dim]]:
    """The dynamic dims of ``(dense_features, values, lengths)``: batch B and id count N."""
    batch, nnz = Dim("batch", min=1), Dim("nnz", min=0)
    return {0: batch}, {0: nnz}, {1: batch}


def export_dlrm(
    model: nn.Module, example: Optional[tuple[torch.Tensor, ...]] = None, *, kernels: bool = False
) -> ExportedProgram:
    """``torch.export`` of a DLRM's inference form, batch and id count dynamic.

    Args:
        model: a ``ServingDLRM``, or a DLRM to make one of (:func:`serving_model`).
        example: example ``(dense_features, values, lengths (F, B))``; made when ``None``.
        kernels: for a DLRM, make its inference form with the fused CPU kernels as
            ``torch.ops.comera_rec`` calls (a ``ServingDLRM`` keeps its own choice).

    Returns:
        The exported program: ``ep.module()(dense, values, lengths) -> (B, 1)`` logits.

    Raises:
        ExportError: naming the part that has no inference form or fails to export.

    Example::

        >>> ep = export_dlrm(build_dlrm(cfg))  # doctest: +SKIP
        >>> torch.export.save(ep, "model.pt2")  # doctest: +SKIP
    """
    serving = model if isinstance(model, ServingDLRM) else serving_model(model, kernels)
    serving.eval()
    args = example if example is not None else serving.example_inputs()
    with torch.no_grad():
        try:
            return torch.export.export(serving, args, dynamic_shapes=dynamic_shapes(), strict=False)
        except Exception as error:  # find which part fails, for a message that names it
            raise _failing_part(serving, args, error) from error


def _failing_part(serving: ServingDLRM, args: tuple[torch.Tensor, ...], error: Exception) -> ExportError:
    """An ``ExportError`` naming the first part of ``serving`` that does not export alone."""
    dense, values, lengths = args
    embedded_dense = serving.dense_arch(dense)
    embedded_sparse = serving.sparse_arch(values, lengths)
    inter = serving.inter_arch(dense_features=embedded_dense, sparse_features=embedded_sparse)
    parts = [
        ("dense_arch", serving.dense_arch, (dense,), {}),
        ("sparse_arch", serving.sparse_arch, (values, lengths), {}),
        ("inter_arch", serving.inter_arch, (), {"dense_features": embedded_dense, "sparse_features": embedded_sparse}),
        ("over_arch", serving.over_arch, (inter,), {}),
    ]
    for name, part, part_args, kwargs in parts:
        try:
            torch.export.export(part, part_args, kwargs, strict=False)
        except Exception as part_error:
            return ExportError(f"{name} ({type(part).__name__}) does not export: {part_error}")
    return ExportError(f"the model does not export (each part alone does): {error}")


def save_exported(program: ExportedProgram, path: PathLike) -> Path:
    """``torch.export.save`` to ``path`` (parents made); the path written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.export.save(program, str(path))
    return path


def load_exported(path: PathLike) -> nn.Module:
    """The runnable module of a program saved by :func:`save_exported` (``torch.export.load``);
    the operator library is loaded first when the program calls ``torch.ops.comera_rec``.

    Raises:
        ExportError: the program calls ``torch.ops.comera_rec`` and the library is not
            available.
    """
    if not operators_loaded() and calls_operators(path):
        _require_operators()
    return torch.export.load(str(path)).module()


def calls_operators(path: PathLike) -> bool:
    """Whether the program saved at ``path`` calls ``torch.ops.comera_rec`` operators (an
    export with ``kernels=True``): it then loads only where the operator library is loaded.

    Raises:
        ValueError: ``path`` is not a saved program (a ``torch.export.save`` archive).
    """
    target = f'"torch.ops.{NAMESPACE}.'.encode()  # an operator node's target in the graph
    try:
        with zipfile.ZipFile(path) as archive:
            graphs = [n for n in archive.namelist() if "/models/" in n and n.endswith(".json")]
            return any(target in archive.read(n) for n in graphs)
    except zipfile.BadZipFile as error:
        raise ValueError(f"{path}: not a saved program (torch.export.save archive): {error}") from error
