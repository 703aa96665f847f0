"""Assemble TorchRec's ``DLRM`` / ``DLRM_DCN``, dense or compressed, from a config."""

from __future__ import annotations

from typing import Literal

import torch
from torchrec.models.dlrm import DLRM, DLRM_DCN, DLRMTrain
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingBagCollectionInterface

from comera_rec.dlrm.config import DLRMConfig
from comera_rec.dlrm.interaction import BlockDCNInteraction, FlatSparseArch, PairwiseDotInteraction
from comera_rec.integration.collection import TTMEmbeddingBagCollection
from comera_rec.integration.compress import ModelSize, model_size
from comera_rec.integration.mlp import TTLowRankCrossNet, fuse_narrow_layers, tt_mlp
from comera_rec.integration.policy import CompressionPolicy
from comera_rec.integration.torchrec_internals import perceptron_linear, perceptrons


def criteo_tables(
    table_sizes: list[int], embedding_dim: int, feature_names: list[str], pooling: str = "sum"
) -> list[EmbeddingBagConfig]:
    """One table ``t_<feature>`` per sparse feature."""
    kind = {"sum": PoolingType.SUM, "mean": PoolingType.MEAN}[pooling]
    return [
        EmbeddingBagConfig(
            name=f"t_{f}", embedding_dim=embedding_dim, num_embeddings=n, feature_names=[f], pooling=kind
        )
        for f, n in zip(feature_names, table_sizes)
    ]


def check_dlrm_tables(tables: list[EmbeddingBagConfig], bottom_mlp: list[int]) -> int:
    """DLRM needs one embedding dim for all tables, equal to the bottom MLP's output.

    Returns:
        The embedding dim.

    Raises:
        ValueError: naming the tables (or layer) that disagree.
    """
    if not tables:
        raise ValueError("DLRM: need at least one embedding table")
    dim = tables[0].embedding_dim
    odd = [f"{t.name} ({t.embedding_dim})" for t in tables if t.embedding_dim != dim]
    if odd:
        raise ValueError(
            f"DLRM: all tables need the same embedding_dim; {tables[0].name} has {dim} but {', '.join(odd)}"
        )
    if not bottom_mlp or bottom_mlp[-1] != dim:
        raise ValueError(
            f"DLRM: the bottom MLP's last layer ({bottom_mlp[-1] if bottom_mlp else None}) must equal "
            f"the embedding_dim ({dim})"
        )
    return dim


def make_dlrm(
    tables: list[EmbeddingBagConfig],
    *,
    dense_in_features: int,
    bottom_mlp: list[int],
    top_mlp: list[int],
    interaction: Literal["dot", "dcn"] = "dot",
    fused_interaction: bool = False,
    dcn_num_layers: int = 3,
    dcn_low_rank: int = 512,
    policy: CompressionPolicy | None = None,
    validate_inputs: bool = True,
    device: torch.device | str | None = None,
) -> DLRM:
    """TorchRec ``DLRM`` (``interaction="dot"``) or ``DLRM_DCN`` (``"dcn"``).

    With a ``policy`` the tables go into a :class:`TTMEmbeddingBagCollection` and the
    bottom MLP, top MLP and DCN projections use ``TTLinear`` where it pays; without one
    the model is TorchRec's dense model. With a policy or ``fused_interaction``, MLP layers
    with few inputs (the bottom MLP's first) become ``NarrowLinear`` (same values, one pass
    forward and one backward on CPU). A compressed DCN model takes :class:`FlatSparseArch`
    and :class:`BlockDCNInteraction` (same parameters and values): the pooled embeddings
    reach its cross net without being copied.

    Args:
        tables: embedding table configs (one embedding_dim for all).
        dense_in_features: dense input features.
        bottom_mlp: bottom MLP sizes (last = embedding_dim).
        top_mlp: top MLP sizes (last = 1).
        interaction: ``"dot"`` or ``"dcn"``.
        fused_interaction: replace the dot interaction by :class:`PairwiseDotInteraction`
            (same values, cheaper backward; a fused kernel on CPU), the sparse arch by
            :class:`FlatSparseArch` (no split and concatenation of the embeddings) and narrow
            MLP layers by ``NarrowLinear``: the fused parts a dense model shares.
        dcn_num_layers: DCN cross layers.
        dcn_low_rank: DCN inner size.
        policy: compression policy, ``None`` for dense.
        validate_inputs: range-check sparse ids (compressed collection only).
        device: where to allocate (``"meta"`` allowed).

    Example::

        >>> tables = criteo_tables([100_000, 50], 8, ["cat_0", "cat_1"])
        >>> model = make_dlrm(tables, dense_in_features=13, bottom_mlp=[64, 8], top_mlp=[64, 1],
        ...                   policy=CompressionPolicy(rank=8))
    """
    dim = check_dlrm_tables(tables, bottom_mlp)
    if len(top_mlp) < 2:
        raise ValueError(f"DLRM: the top MLP needs at least two layers, got {top_mlp}")
    if interaction not in ("dot", "dcn"):
        raise ValueError(f"DLRM: interaction must be 'dot' or 'dcn', got {interaction!r}")
    if fused_interaction and interaction != "dot":
        raise ValueError("DLRM: fused_interaction replaces the 'dot' interaction; the DCN one has none to replace")
    ebc: EmbeddingBagCollectionInterface
    if policy is None:
        ebc = EmbeddingBagCollection(tables, device=torch.device(device) if device is not None else None)
    else:
        ebc = TTMEmbeddingBagCollection(tables, policy, device=device, validate_inputs=validate_inputs)
    dense_device = torch.device(device) if device is not None else None
    model: DLRM
    if interaction == "dot":
        model = DLRM(ebc, dense_in_features, bottom_mlp, top_mlp, dense_device=dense_device)
        if fused_interaction:
            model.sparse_arch = FlatSparseArch(ebc)
            model.inter_arch = PairwiseDotInteraction(len(tables_features(tables)))
    else:
        model = DLRM_DCN(
            ebc, dense_in_features, bottom_mlp, top_mlp, dcn_num_layers, dcn_low_rank, dense_device=dense_device
        )
    if policy is None:
        if fused_interaction:
            fuse_narrow_layers(model.dense_arch.model)
        return model
    rank = policy.mlp_rank
    if policy.compress_mlps:
        model.dense_arch.model = tt_mlp(
            dense_in_features, bottom_mlp, rank=rank, min_gain=policy.mlp_min_gain, device=device
        )
        over_in = perceptron_linear(perceptrons(model.over_arch.model[0])[0]).in_features
        model.over_arch.model[0] = tt_mlp(over_in, top_mlp[:-1], rank=rank, min_gain=policy.mlp_min_gain, device=device)
    fuse_narrow_layers(model.dense_arch.model)
    if interaction == "dcn" and policy.compress_crossnet:
        n = (len(tables_features(tables)) + 1) * dim
        crossnet = TTLowRankCrossNet(
            n, dcn_num_layers, dcn_low_rank, tt_rank=rank, min_gain=policy.mlp_min_gain, device=device
        )
        # no copies of the pooled embeddings between the lookups and the cross net: the
        # sparse arch hands on the collection's values as they are, the cross net reads
        # them beside the dense features (MLPerf: two 54-56 MB copies per 4096 rows)
        model.sparse_arch = FlatSparseArch(ebc)
        model.inter_arch = BlockDCNInteraction(len(tables_features(tables)), crossnet)
    return model


def tables_features(tables: list[EmbeddingBagConfig]) -> list[str]:
    return [f for t in tables for f in t.feature_names]


def build_dlrm(config: DLRMConfig, *, device: torch.device | str | None = None) -> DLRM:
    """The model ``config`` describes (see :func:`make_dlrm`).

    Example::

        >>> model = build_dlrm(DLRMConfig.kaggle(), device="meta")
        >>> round(dlrm_size(model).compression_ratio) > 10
        True
    """
    tables = criteo_tables(config.table_sizes, config.embedding_dim, config.features(), config.pooling)
    return make_dlrm(
        tables,
        dense_in_features=config.dense_in_features,
        bottom_mlp=list(config.bottom_mlp),
        top_mlp=list(config.top_mlp),
        interaction=config.interaction,
        fused_interaction=config.fused_interaction,
        dcn_num_layers=config.dcn_num_layers,
        dcn_low_rank=config.dcn_low_rank,
        policy=config.policy() if config.compressed else None,
        validate_inputs=config.validate_inputs,
        device=device,
    )


def build_dlrm_train(config: DLRMConfig, *, device: torch.device | str | None = None) -> DLRMTrain:
    """``DLRMTrain(build_dlrm(config))``: ``batch -> (loss, (loss, logits, labels))``."""
    return DLRMTrain(build_dlrm(config, device=device))


def dlrm_size(model: torch.nn.Module) -> ModelSize:
    """Bytes and parameters of ``model`` and of its dense counterpart (``compression_ratio``)."""
    return model_size(model)
