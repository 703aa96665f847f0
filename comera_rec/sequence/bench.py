"""Sequence lookup benchmark: TTMEmbeddingCollection against TorchRec's EmbeddingCollection
on FBGEMM, one large item table, as each trains.

Per variant, in a fresh process of its own (so its peak RSS is its own):

* ``fbgemm``: TorchRec's ``EmbeddingCollection`` sharded by ``DistributedModelParallel``
  in a one-process gloo group, so the lookup is FBGEMM's table-batched CPU kernel with
  row-wise Adagrad fused into the backward pass (``apply_optimizer_in_backward``), as
  TorchRec trains it. (TorchRec's ``FusedEmbeddingCollection`` takes CUDA or meta only.)
* ``tt``: ``TTMEmbeddingCollection`` with the item table as a TTM tensor train (the
  compression policy's shape at ``--rank``), unwrapped as the engine trains it in one
  process, its cores stepped by torch's fused AdamW.

Each step is: a KJT of ``--batch`` sequences of ``L`` item ids (Zipf popularity over the
catalogue, ranks scattered over the ids by a fixed bijection), forward, a squared-norm
loss of the embeddings, backward, and the optimiser update; the median step time after a
warm-up, for every ``L`` of ``--seq-lens``. Bytes: the table's parameters and the
optimiser state. The ratios are against ``fbgemm`` from the same run, printed as a
markdown table.

    python launch/bench_seq_lookup.py            # 10M items, dim 64, L = 50 and 200
    python launch/bench_seq_lookup.py --quick    # 100k items: a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Optional, Sequence

import numpy as np
import torch
from torch import nn

VARIANTS = ("fbgemm", "tt")


@dataclass
class LookupSetup:
    """One benchmark setting (the command line's values)."""

    num_items: int = 10_000_000
    """Rows of the item table."""
    embedding_dim: int = 64
    """Columns of the item table."""
    batch_size: int = 64
    """Sequences per step."""
    seq_lens: list[int] = field(default_factory=lambda: [50, 200])
    """Sequence lengths measured (every sequence of a step has this length)."""
    zipf: float = 1.05
    """Zipf exponent of item popularity."""
    rank: int = 32
    """TT rank of the compressed table."""
    warmup_steps: int = 3
    """Untimed steps per length."""
    timed_steps: int = 10
    """Timed steps per length (the median is reported)."""
    threads: int = 0
    """torch threads in each child (0: torch's default)."""


def zipf_ids(setup: LookupSetup, length: int, step: int) -> torch.Tensor:
    """``(batch * length,)`` item ids of one step: Zipf ranks, scattered over the ids by
    ``rank * p mod n`` (p a prime not dividing n) so the popular items are not all in the
    first rows (which would favour any row-blocked layout)."""
    from comera_rec.data.synthetic import ZipfSampler

    rng = np.random.default_rng(1000 * length + step)
    ranks = ZipfSampler(setup.num_items, setup.zipf).sample(rng, setup.batch_size * length)
    prime = 2_147_483_647 if setup.num_items % 2_147_483_647 else 1_000_000_007
    return torch.from_numpy((ranks.astype(np.int64) * prime) % setup.num_items)


def _tensor_bytes(value: Any) -> int:
    """Bytes of a tensor, a ShardedTensor's local shards, or the tensors inside a container."""
    if hasattr(value, "local_shards"):
        return sum(s.tensor.numel() * s.tensor.element_size() for s in value.local_shards())
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(_tensor_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    return 0


class _Loss(nn.Module):
    """The collection, and a loss of its output: the mean squared embedding entry."""

    def __init__(self, collection: nn.Module) -> None:
        super().__init__()
        self.collection = collection

    def forward(self, features: Any) -> torch.Tensor:
        out = self.collection(features)
        if not isinstance(out, dict) and hasattr(out, "wait"):
            out = out.wait()
        return out["items"].values().square().mean()


def _build(variant: str, setup: LookupSetup) -> tuple[nn.Module, Any, int, int]:
    """``(model, optimiser or None, table bytes, optimiser state bytes)`` of a variant."""
    from torchrec.modules.embedding_configs import EmbeddingConfig

    tables = [
        EmbeddingConfig(
            name="item", embedding_dim=setup.embedding_dim, num_embeddings=setup.num_items, feature_names=["items"]
        )
    ]
    torch.manual_seed(0)
    if variant == "tt":
        from comera_rec.integration.embedding_collection import TTMEmbeddingCollection
        from comera_rec.integration.policy import CompressionPolicy

        policy = CompressionPolicy(rank=setup.rank, min_rows_to_compress=0, min_params_to_compress=0, min_gain=1.0)
        model = _Loss(TTMEmbeddingCollection(tables, policy))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        return model, optimizer, _tensor_bytes(list(model.parameters())), 0

    import torch.distributed as dist
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.modules.embedding_modules import EmbeddingCollection
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    with socket.socket() as s:  # a free port for the one-process group
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    model = _Loss(EmbeddingCollection(tables, device=torch.device("meta")))
    apply_optimizer_in_backward(RowWiseAdagrad, model.collection.parameters(), {"lr": 0.01, "eps": 1e-8})
    sharders = [EmbeddingCollectionSharder()]
    planner = EmbeddingShardingPlanner(topology=Topology(world_size=1, compute_device="cpu"))
    plan = planner.collective_plan(model, sharders, dist.GroupMember.WORLD)
    wrapped = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=sharders)
    table = _tensor_bytes([v for k, v in wrapped.state_dict().items() if k.endswith("weight")])
    state = _tensor_bytes(wrapped.fused_optimizer.state_dict()["state"])
    return wrapped, None, table, state


def child(variant: str, setup: LookupSetup) -> dict[str, Any]:
    """Build one variant and time its training steps (runs in its own process)."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from comera_rec.utils.benchmark import peak_rss_bytes
    from comera_rec.utils.host import keep_freed_memory

    if setup.threads:
        torch.set_num_threads(setup.threads)
    keep_freed_memory()  # as the trainer does on CPU, for both variants
    start = time.perf_counter()
    model, optimizer, table_bytes, state_bytes = _build(variant, setup)
    build_s = time.perf_counter() - start
    step_s: dict[str, float] = {}
    for length in setup.seq_lens:
        lengths = torch.full((setup.batch_size,), length, dtype=torch.int64)
        times = []
        for step in range(setup.warmup_steps + setup.timed_steps):
            kjt = KeyedJaggedTensor(keys=["items"], values=zipf_ids(setup, length, step), lengths=lengths)
            t0 = time.perf_counter()
            loss = model(kjt)
            loss.backward()
            if optimizer is not None:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - t0)
        step_s[str(length)] = statistics.median(times[setup.warmup_steps :])
    if optimizer is not None:
        state_bytes = _tensor_bytes([s for s in optimizer.state.values()])
    return {
        "variant": variant,
        "step_s": step_s,
        "table_bytes": table_bytes,
        "state_bytes": state_bytes,
        "peak_rss": peak_rss_bytes(),
        "build_s": build_s,
        "threads": torch.get_num_threads(),
    }


def run_child(variant: str, setup: LookupSetup) -> dict[str, Any]:
    """:func:`child` in a fresh Python process; its result."""
    cmd = [sys.executable, "-m", "comera_rec.sequence.bench", "--child", variant, "--setup", json.dumps(asdict(setup))]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"bench child {variant} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1])


def _mb(n: float) -> str:
    return f"{n / 2**20:,.1f} MB"


def table(results: dict[str, dict[str, Any]], setup: LookupSetup) -> str:
    """The markdown table: per variant the step time per length, bytes and peak RSS, and
    each against ``fbgemm``."""
    base = results["fbgemm"]
    head = [f"step L={n} (ms)" for n in setup.seq_lens]
    lines = [
        "| variant | " + " | ".join(head) + " | table | optimiser state | peak RSS |",
        "|---|" + "---|" * (len(head) + 3),
    ]
    for v, r in results.items():
        steps = [
            f"{1e3 * r['step_s'][str(n)]:.2f} ({r['step_s'][str(n)] / base['step_s'][str(n)]:.2f}x)"
            for n in setup.seq_lens
        ]
        size = _mb(r["table_bytes"])
        if r is not base:
            size += f" ({base['table_bytes'] / max(r['table_bytes'], 1):.0f}x smaller)"
        state = _mb(r["state_bytes"])
        rss = f"{_mb(r['peak_rss'])} ({r['peak_rss'] / base['peak_rss']:.2f}x)"
        lines.append(f"| {v} | " + " | ".join(steps) + f" | {size} | {state} | {rss} |")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> dict[str, dict[str, Any]]:
    """Run the benchmark; print the setup and the markdown table; return the results.

    Example::

        >>> main(["--quick"])  # doctest: +SKIP
    """
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="100k items, batch 16, L = 20 and 50, 3 timed steps")
    parser.add_argument("--items", type=int, help="rows of the item table (default 10M)")
    parser.add_argument("--dim", type=int, default=64, help="embedding dimension")
    parser.add_argument("--batch", type=int, help="sequences per step (default 64)")
    parser.add_argument("--seq-lens", type=int, nargs="+", help="sequence lengths (default 50 200)")
    parser.add_argument("--rank", type=int, default=32, help="TT rank")
    parser.add_argument("--zipf", type=float, default=1.05, help="Zipf exponent of item popularity")
    parser.add_argument("--steps", type=int, help="timed steps per length (default 10)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads per child (0: default)")
    parser.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--setup", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        from comera_rec.utils.logs import quiet_foreign_notices

        quiet_foreign_notices()
        result = child(args.child, LookupSetup(**json.loads(args.setup)))
        print(json.dumps(result), flush=True)
        sys.stdout.flush()
        os._exit(0)  # skip the interpreter's teardown (gloo, Triton's exit messages)
    quick = LookupSetup(num_items=100_000, batch_size=16, seq_lens=[20, 50], warmup_steps=2, timed_steps=3)
    setup = quick if args.quick else LookupSetup()
    setup.embedding_dim, setup.rank, setup.zipf, setup.threads = args.dim, args.rank, args.zipf, args.threads
    if args.items:
        setup.num_items = args.items
    if args.batch:
        setup.batch_size = args.batch
    if args.seq_lens:
        setup.seq_lens = args.seq_lens
    if args.steps:
        setup.timed_steps = args.steps
    results = {v: run_child(v, setup) for v in VARIANTS}
    print(
        f"{setup.num_items:,} items x {setup.embedding_dim}, batch {setup.batch_size}, lengths {setup.seq_lens}, "
        f"Zipf {setup.zipf}, TT rank {setup.rank}, {results['tt']['threads']} threads, "
        f"median of {setup.timed_steps} steps after {setup.warmup_steps}"
    )
    print(table(results, setup))
    return results


if __name__ == "__main__":
    main()
