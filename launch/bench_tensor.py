"""Tensor-core benchmark: TT layers and TTM lookups against their dense baselines.

Every comparison is timed interleaved in one process (ratios of medians); every
variant's peak memory is measured in its own fresh process.

    python launch/bench_tensor.py                # full sizes (about 2 minutes here)
    python launch/bench_tensor.py --quick        # small sizes, for a smoke run
    python launch/bench_tensor.py --only cross   # one comparison: linear, lookup, cross or chain
"""

from __future__ import annotations

import argparse
import functools
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from comera_rec import TTLinear, TTMEmbeddingBag
from comera_rec.utils.benchmark import fmt_bytes, peak_rss_of, time_interleaved


@dataclass
class Sizes:
    rows: int = 4096
    table_rows: int = 10_131_227
    bags: int = 2048
    repeats: int = 15


QUICK = Sizes(rows=512, table_rows=200_000, bags=512, repeats=5)


# ----------------------------------------------------------------------------- linear


def linear_step(layer: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> None:
    layer.zero_grad(set_to_none=True)
    layer(x).backward(grad)


def make_linear(kind: str, n_in: int, n_out: int, rank: int, rows: int):
    torch.manual_seed(0)
    layer = nn.Linear(n_in, n_out) if kind == "dense" else TTLinear(n_in, n_out, rank)
    x = torch.randn(rows, n_in, requires_grad=True)
    return layer, x, torch.randn(rows, n_out)


def linear_memory(kind: str, n_in: int, n_out: int, rank: int, rows: int) -> None:
    layer, x, grad = make_linear(kind, n_in, n_out, rank, rows)
    for _ in range(3):
        linear_step(layer, x, grad)


def bench_linear(n_in: int, n_out: int, rank: int, sizes: Sizes) -> None:
    dense, xd, gd = make_linear("dense", n_in, n_out, rank, sizes.rows)
    tt, xt, gt = make_linear("tt", n_in, n_out, rank, sizes.rows)
    t = time_interleaved(
        {"dense": lambda: linear_step(dense, xd, gd), "tt": lambda: linear_step(tt, xt, gt)}, sizes.repeats
    )
    mem = {k: peak_rss_of(functools.partial(linear_memory, k, n_in, n_out, rank, sizes.rows)) for k in ("dense", "tt")}
    grow = {k: peak - base for k, (base, peak) in mem.items()}
    flops_dense = 3 * 2 * sizes.rows * n_in * n_out
    r = tt.ranks[len(tt.in_shape) - 1]
    flops_tt = 4 * 2 * sizes.rows * r * (n_in + n_out) / 2 + 2 * 2 * sizes.rows * r * n_in
    print(f"\nTTLinear({n_in}, {n_out}, rank={rank}) vs nn.Linear, {sizes.rows} rows, forward+backward")
    print(
        f"  shape {tt.shape}, ranks {tt.ranks}, params {tt.num_parameters():,} vs {dense.weight.numel() + n_out:,} "
        f"({tt.compression_ratio():.0f}x fewer)"
    )
    print(
        f"  time   dense {t['dense'] * 1e3:8.2f} ms   tt {t['tt'] * 1e3:8.2f} ms   "
        f"speed-up {t['dense'] / t['tt']:.1f}x  (FLOP ratio allows {flops_dense / flops_tt:.0f}x)"
    )
    print(
        f"  memory dense +{fmt_bytes(grow['dense'])}   tt +{fmt_bytes(grow['tt'])}   "
        f"ratio {grow['dense'] / max(1, grow['tt']):.1f}x  (peak RSS growth during the steps, own process)"
    )


# ----------------------------------------------------------------------------- lookup


def zipf_ids(n: int, count: int, exponent: float, seed: int = 0) -> torch.Tensor:
    """Zipf ranks spread over the table by a multiplicative hash (hot rows are not adjacent)."""
    rng = np.random.default_rng(seed)
    ranks = (rng.zipf(exponent, size=count) - 1) % n
    return torch.from_numpy((ranks * 2_654_435_761) % n).long()


def uniform_ids(n: int, count: int, seed: int = 0) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).integers(0, n, size=count)).long()


def naive_ttm_lookup(bag: TTMEmbeddingBag, ids: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """The unoptimised TTM lookup: chain the core slices of every occurrence, no sharing."""
    cores = bag.scaled_cores()
    digits, rest = [], ids
    for n in reversed(bag.row_shape):
        digits.append(rest % n)
        rest = rest // n
    digits.reverse()
    out = None
    for core, digit in zip(cores, digits):
        s = core[:, digit].permute(1, 0, 2, 3)  # (N, r_prev, m, r)
        N, r_prev, m, r = s.shape
        if out is None:
            out = s.reshape(N, m, r)
        else:
            cols = out.shape[1]
            out = torch.bmm(out, s.reshape(N, r_prev, m * r)).reshape(N, cols * m, r)
    rows = out.reshape(ids.numel(), -1)[:, : bag.embedding_dim]
    return torch.nn.functional.embedding_bag(
        torch.arange(ids.numel()), rows, offsets, mode="sum", include_last_offset=True
    )


def make_tt_table(rows: int):
    torch.manual_seed(0)
    bag = TTMEmbeddingBag(rows, 16, rank=32)
    opt = torch.optim.Adam(bag.parameters(), lr=1e-3)
    return bag, opt


def tt_step(bag, opt, ids, offsets, lookup) -> None:
    opt.zero_grad(set_to_none=True)
    lookup(ids, offsets).sum().backward()
    opt.step()


def make_fbgemm_table(rows: int):
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    return SplitTableBatchedEmbeddingBagsCodegen(
        [(rows, 16, EmbeddingLocation.HOST, ComputeDevice.CPU)],
        optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD,
        learning_rate=0.01,
    )


def fbgemm_step(tbe, ids, offsets) -> None:
    tbe(ids, offsets).sum().backward()  # the row-wise Adagrad update is fused into backward


def lookup_memory(kind: str, rows: int, bags: int) -> None:
    ids, offsets = zipf_ids(rows, bags, 1.2), torch.arange(bags + 1)
    if kind == "fbgemm":
        tbe = make_fbgemm_table(rows)
        for _ in range(3):
            fbgemm_step(tbe, ids, offsets)
    else:
        bag, opt = make_tt_table(rows)
        lookup = bag if kind == "ttm" else functools.partial(naive_ttm_lookup, bag)
        for _ in range(3):
            tt_step(bag, opt, ids, offsets, lookup)


def bench_lookup(sizes: Sizes) -> None:
    rows, bags = sizes.table_rows, sizes.bags
    bag, opt = make_tt_table(rows)
    tbe = make_fbgemm_table(rows)
    offsets = torch.arange(bags + 1)
    print(f"\nTTMEmbeddingBag({rows}, 16, rank=32), {bags} bags of one id, forward+backward+optimizer step")
    print(
        f"  shape {bag.shape}, params {bag.num_parameters():,} vs {rows * 16:,} ({bag.compression_ratio():.0f}x fewer)"
    )
    for name, ids in (("zipf(1.2)", zipf_ids(rows, bags, 1.2)), ("uniform", uniform_ids(rows, bags))):
        t = time_interleaved(
            {
                "dedup": lambda: tt_step(bag, opt, ids, offsets, bag),
                "naive": lambda: tt_step(bag, opt, ids, offsets, functools.partial(naive_ttm_lookup, bag)),
                "fbgemm": lambda: fbgemm_step(tbe, ids, offsets),
            },
            sizes.repeats,
        )
        uniq = ids.unique().numel()
        print(
            f"  {name:10s} ({uniq} unique ids)  de-duplicated {t['dedup'] * 1e3:7.2f} ms   "
            f"naive {t['naive'] * 1e3:7.2f} ms  -> {t['naive'] / t['dedup']:.1f}x faster   |   "
            f"FBGEMM fused {t['fbgemm'] * 1e3:6.2f} ms  -> time ratio ttm/fbgemm {t['dedup'] / t['fbgemm']:.2f}"
        )
    mem = {k: peak_rss_of(functools.partial(lookup_memory, k, rows, bags)) for k in ("ttm", "naive", "fbgemm")}
    grow = {k: peak - base for k, (base, peak) in mem.items()}
    print(
        f"  memory (peak RSS growth, own process): ttm +{fmt_bytes(grow['ttm'])}   "
        f"naive +{fmt_bytes(grow['naive'])}   fbgemm +{fmt_bytes(grow['fbgemm'])}   "
        f"fbgemm/ttm {grow['fbgemm'] / max(1, grow['ttm']):.0f}x"
    )
    dense_bytes = rows * 16 * 4 + rows * 4
    print(
        f"  stored state: ttm {fmt_bytes(bag.num_parameters() * 4 * 3)} (params + Adam moments)   "
        f"fbgemm {fmt_bytes(dense_bytes)} (table + row-wise Adagrad)   ratio {dense_bytes / (bag.num_parameters() * 12):.0f}x"
    )


# ----------------------------------------------------------------------------- cross net


def bench_cross(sizes: Sizes) -> None:
    """Scoring a DCN cross net at MLPerf DLRM-DCNv2 shapes: TorchRec's dense
    ``LowRankCrossNet``, the TT one layer by layer (``forward_layers``), the TT one in the
    fused kernel (its ``forward`` under ``inference_mode``)."""
    from torchrec.modules.crossnet import LowRankCrossNet

    from comera_rec.integration.mlp import TTLowRankCrossNet
    from comera_rec.tensor import cached_weights
    from comera_rec.utils.host import SERVING_MMAP_THRESHOLD, keep_freed_memory

    # as a scoring process runs (predict_dlrm, bench_serving): freed (B, N) activations are
    # reused, not fresh pages each batch, which would cost the layer-by-layer path most
    keep_freed_memory(mmap_threshold_bytes=SERVING_MMAP_THRESHOLD)
    n, layers, low_rank, rank = 3456, 3, 512, 32
    torch.manual_seed(0)
    dense = LowRankCrossNet(n, layers, low_rank=low_rank).eval()
    tt = TTLowRankCrossNet(n, layers, low_rank, tt_rank=rank).eval()
    x = torch.randn(sizes.rows, n)
    print(f"\nDCN cross net scoring, N={n}, {layers} layers, low rank {low_rank}, TT rank {rank}, {sizes.rows} rows")
    with torch.inference_mode(), cached_weights():
        t = time_interleaved(
            {"dense": lambda: dense(x), "layers": lambda: tt.forward_layers(x), "fused": lambda: tt(x)},
            sizes.repeats,
        )
        diff = (tt(x) - tt.forward_layers(x)).abs().max().item()
    print(
        f"  dense LowRankCrossNet {t['dense'] * 1e3:8.2f} ms   TT layer by layer {t['layers'] * 1e3:8.2f} ms   "
        f"TT fused {t['fused'] * 1e3:8.2f} ms"
    )
    print(
        f"  fused vs layer by layer {t['layers'] / t['fused']:.2f}x, vs dense {t['dense'] / t['fused']:.2f}x  "
        f"(max |fused - layers| {diff:.1e})"
    )


# ----------------------------------------------------------------------------- MLP chains


def bench_chain(sizes: Sizes) -> None:
    """Training DLRM's Kaggle MLPs (forward + backward): each run of fused layers as one
    kernel chain (``ChainedPerceptrons``) against the same layers one by one (TorchRec's
    ``nn.Sequential`` over the same perceptrons), and TorchRec's dense ``MLP``."""
    from torchrec.modules.mlp import MLP

    from comera_rec.integration.mlp import fuse_narrow_layers, tt_mlp
    from comera_rec.integration.torchrec_internals import perceptrons
    from comera_rec.utils.host import keep_freed_memory

    # as the trainer runs (trainer.keep_freed_memory): freed activations are reused, not fresh
    # pages each step, which would cost the layers one by one (more and larger buffers) most
    keep_freed_memory()
    rows = min(sizes.rows, 2048)  # the Kaggle batch
    print(f"\nDLRM Kaggle MLPs, training (forward + backward), rank 32, {rows} rows")
    for name, n_in, widths in (("bottom", 13, [512, 256, 64, 16]), ("top", 367, [512, 256])):
        torch.manual_seed(0)
        chained = fuse_narrow_layers(tt_mlp(n_in, widths, rank=32))
        layers = nn.Sequential(*perceptrons(chained))  # the same modules, one by one
        dense = MLP(n_in, widths)
        x = torch.randn(rows, n_in, requires_grad=name == "top")  # the top MLP's input has a gradient
        grad = torch.randn(rows, widths[-1])

        def step(module: nn.Module) -> None:
            module(x).backward(grad)

        t = time_interleaved(
            {"dense": lambda: step(dense), "layers": lambda: step(layers), "chain": lambda: step(chained)},
            sizes.repeats,
        )
        print(
            f"  {name:6s} {n_in} -> {widths}: dense MLP {t['dense'] * 1e3:7.2f} ms   TT layers one by one "
            f"{t['layers'] * 1e3:7.2f} ms   TT chained {t['chain'] * 1e3:7.2f} ms   chained vs one by one "
            f"{t['layers'] / t['chain']:.2f}x, vs dense {t['dense'] / t['chain']:.2f}x"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes for a smoke run")
    parser.add_argument(
        "--only",
        choices=("linear", "lookup", "cross", "chain"),
        default=None,
        help="one comparison only (default: all)",
    )
    args = parser.parse_args()
    sizes = QUICK if args.quick else Sizes()
    from comera_rec.tensor import kernels

    print(f"host: {kernels.host_description()}; torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"ratios of medians over {sizes.repeats} interleaved rounds")
    if args.only in (None, "linear"):
        bench_linear(1024, 1024, 16, sizes)
        bench_linear(768, 3072, 30, sizes)
    if args.only in (None, "lookup"):
        bench_lookup(sizes)
    if args.only in (None, "cross"):
        bench_cross(sizes)
    if args.only in (None, "chain"):
        bench_chain(sizes)


if __name__ == "__main__":
    main()
