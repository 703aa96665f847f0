"""The DLRM benchmark's variants (:mod:`comera_rec.dlrm.bench`): what it runs
(:class:`Setup`), each variant's model and optimizers, the synthetic batches, one training
step and the validation AUC."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

import torch
from torch import nn
from torchrec.modules.mlp import MLP
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

from comera_rec.data import SyntheticCriteo, SyntheticCriteoConfig
from comera_rec.dlrm.config import DLRMConfig
from comera_rec.dlrm.model import build_dlrm_train
from comera_rec.integration.distributed import EmbeddingOptimizerSpec, replicated_parameter_groups, wrap_model
from comera_rec.integration.mlp import unchain_layers
from comera_rec.tensor import kernels
from comera_rec.tensor.train import tensor_train_modules
from comera_rec.training.adamw import GroupStepAdamW
from comera_rec.training.metrics import BinaryMetrics
from comera_rec.training.step import forward_precision


@dataclass
class Setup:
    batch_size: int = 2048
    train_steps: int = 300
    val_rows: int = 65536
    zipf: float = 1.1
    rank: int = 32
    warmup_steps: int = 20  # per process (the first ~20 steps of a process run slow), before the timed steps
    timed_steps: int = 30  # per process: its median step time is the process's figure
    rounds: int = 3  # fresh processes per variant, the variants alternating
    keep_freed_memory: bool = True  # glibc malloc reuses freed activations (trainer.keep_freed_memory)
    fused_interaction: bool = (
        True  # PairwiseDotInteraction + FlatSparseArch (+ NarrowLinear) in the compressed models and in dense_fi
    )
    lookup_paths: bool = False  # also the compressed models with the CPU kernels off (tt_torch, tt_half_torch)
    unchained: bool = False  # also tt with its MLPs' TT layers one by one, not chained (tt_unchained)
    autocast: bool = False  # every variant's forward under torch.autocast("cpu", torch.bfloat16) (--autocast)


VARIANTS = ("dense", "tt", "tt_half")
# the dense model with the parts a dense model shares (not with --no-fused-interaction): PairwiseDotInteraction,
# FlatSparseArch and through it the fused CPU row-wise Adagrad lookup for all its tables
DENSE_FUSED = "dense_fi"


TORCH_LOOKUP = "_torch"  # suffix: the same compressed model with the fused CPU kernels off (PyTorch path)
UNCHAINED = "_unchained"  # suffix: the same compressed model, its MLPs' TT layers one kernel call each


def variants(setup: Setup) -> tuple[str, ...]:
    names = ("dense", DENSE_FUSED, "tt", "tt_half") if setup.fused_interaction else VARIANTS
    names += ("tt" + TORCH_LOOKUP, "tt_half" + TORCH_LOOKUP) if setup.lookup_paths else ()
    return names + (("tt" + UNCHAINED,) if setup.unchained else ())


def use_lookup_path(variant: str) -> None:
    """The fused CPU kernels (TTM lookup, TT linear, interaction, input checks) for every variant
    but the ``_torch`` ones (process-wide switch)."""
    kernels.set_cpu_kernel_enabled(not variant.endswith(TORCH_LOOKUP))


def base_variant(variant: str) -> str:
    """The model a variant trains (``tt_torch`` and ``tt_unchained`` train ``tt``)."""
    return variant.removesuffix(TORCH_LOOKUP).removesuffix(UNCHAINED)


def model_config(variant: str, setup: Setup, mlperf: bool) -> DLRMConfig:
    variant = base_variant(variant)
    base = DLRMConfig.mlperf_dcn() if mlperf else DLRMConfig.kaggle()
    # TorchRec's interaction for "dense" always: it is the baseline as TorchRec ships it
    fused = setup.fused_interaction and variant != "dense" and not mlperf
    return replace(
        base, compressed=not variant.startswith("dense"), rank=setup.rank, mlp_rank=setup.rank, fused_interaction=fused
    )


@torch.no_grad()
def cut_ranks_to_half(model: nn.Module) -> None:
    """Zero the controllers of the upper half of every bond, then truncate for real."""
    for _, module in tensor_train_modules(model):
        for d in module.controllers:
            r = d.shape[-1]
            d[..., (r + 1) // 2 :] = 0.0
        module.truncate_ranks(1e-6)


def build(variant: str, setup: Setup, mlperf: bool):
    torch.manual_seed(0)
    model = build_dlrm_train(model_config(variant, setup, mlperf), device="cpu")
    if base_variant(variant) == "tt_half":
        cut_ranks_to_half(model)
    if variant.endswith(UNCHAINED):
        for module in model.modules():
            if isinstance(module, MLP):
                unchain_layers(module)
    wrapped, _ = wrap_model(
        model,
        device="cpu",
        embedding_optimizer=EmbeddingOptimizerSpec(RowWiseAdagrad, {"lr": EMBEDDING_LR, "eps": 1e-8}),
    )
    return wrapped, adamw(replicated_parameter_groups(wrapped))


# The demo config's learning rates, the same for every variant.
LEARNING_RATES = {"cores": 3e-3, "controllers": 1e-2, "other": 1e-3}
EMBEDDING_LR = 0.05


def adamw(groups: dict[str, list[nn.Parameter]]) -> torch.optim.Optimizer:
    return GroupStepAdamW(
        [{"params": groups[k], "lr": LEARNING_RATES[k]} for k in LEARNING_RATES if groups[k]],
        weight_decay=0.0,
        fused=True,  # torch's fused AdamW kernel, stepped per group as the trainer does, for every variant alike
    )


def batches(setup: Setup, mlperf: bool, stream: str, rows: int):
    sizes = list(model_config("dense", setup, mlperf).table_sizes)
    cfg = SyntheticCriteoConfig(
        num_embeddings_per_feature=sizes,
        zipf_exponent=setup.zipf,
        batch_size=setup.batch_size,
        num_rows=rows,
        seed=0,
        stream=stream,
        drop_last=True,
    )
    return SyntheticCriteo(cfg)


def train_batches(setup: Setup, mlperf: bool, n: int) -> list:
    """``n`` distinct training batches, one per timed step. Not a few batches cycled: a dense
    model trained over and over on four batches fits them within ~40 steps, its gradients
    become denormal floats and its MLPs' GEMMs slow down several-fold (docs/performance-history.md)."""
    return list(itertools.islice(iter(batches(setup, mlperf, "train", setup.batch_size * n)), n))


CPU = torch.device("cpu")


def train_step(wrapped, optimizer, batch, autocast: bool = False) -> float:
    # --autocast: the forward in bfloat16 as the trainer's trainer.autocast runs it, the
    # backward outside autocast
    with forward_precision(CPU, "bfloat16" if autocast else "none"):
        loss, _ = wrapped(batch)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return float(loss.detach())


@torch.no_grad()
def auc(wrapped, setup: Setup, mlperf: bool) -> float:
    metrics = BinaryMetrics(torch.device("cpu"))
    wrapped.eval()
    for batch in batches(setup, mlperf, "val", setup.val_rows):
        with forward_precision(CPU, "bfloat16" if setup.autocast else "none"):
            _, (_, logits, labels) = wrapped(batch)
        metrics.update(logits, labels)
    wrapped.train()
    return metrics.compute()["auc"]


def model_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())
