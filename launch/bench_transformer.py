"""Transformer benchmark: the six-encoder at the reference shapes (method.md section 4),
compressed vs dense vs GaLore vs LTE, then a small model trained to the end.

Part 1 times one training step (forward, loss, backward, every optimiser step; the
compressed model also adds the rank-adaptive size term) at batch 1 and 32, sequence 128.
The four methods are timed interleaved in one process (medians); each method's peak
memory is measured in a fresh process of its own. Ratios are given against dense and
against GaLore.

Part 2 trains the small synthetic-task configuration (configs/transformer_synthetic.yaml)
with the compressed and the dense model and reports both validation accuracies.

    python launch/bench_transformer.py              # both parts (about 7 minutes here)
    python launch/bench_transformer.py --quick      # fewer repeats, batch 32 timed once, shorter training
    python launch/bench_transformer.py --skip-train # part 1 only
    python launch/bench_transformer.py --compile    # compressed and dense, eager against
                                                    # torch.compile, batch 32 (about 4 minutes)
"""

from __future__ import annotations

import argparse
import functools
import time
from typing import Callable

import torch
import torch.nn.functional as F

from comera_rec.config import load_config
from comera_rec.rank import RankSchedule, RankScheduleConfig
from comera_rec.training import OptimConfig, build_optimizer
from comera_rec.transformer import baselines
from comera_rec.transformer.baselines import MethodConfig
from comera_rec.transformer.config import encoder_preset
from comera_rec.transformer.model import SequenceClassifier
from comera_rec.utils.benchmark import fmt_bytes, peak_rss_of, time_interleaved

METHODS = ("compressed", "dense", "galore", "lte")
SEQ = 128


def method_config(name: str, galore_rank: int, lte_heads: int, lte_rank: int) -> MethodConfig:
    return MethodConfig(
        name=name,
        galore_rank=galore_rank,
        galore_update_proj_gap=200,
        galore_scale=0.25,
        lte_heads=lte_heads,
        lte_rank=lte_rank,
        lte_merge_every=10,
    )


def make_step(name: str, batch: int, galore_rank: int, lte_heads: int, lte_rank: int) -> Callable[[], float]:
    """Build the reference model for one method and return a closure running one training step."""
    return make_steps(name, batch, galore_rank, lte_heads, lte_rank)["eager"]


def make_steps(
    name: str,
    batch: int,
    galore_rank: int,
    lte_heads: int,
    lte_rank: int,
    compiled: bool = False,
    dropout: float | None = None,
) -> dict[str, Callable[[], float]]:
    """Build the reference model for one method: ``{"eager": step}`` and, with ``compiled``,
    ``"compiled"``: the same training step, optimisers and batch with the model under
    ``torch.compile`` (inductor), on the same parameters. ``dropout``: the encoder's, if
    not the preset's."""
    torch.manual_seed(0)
    method = method_config(name, galore_rank, lte_heads, lte_rank)
    cfg = encoder_preset("reference", compressed=method.compressed)
    if dropout is not None:
        cfg = cfg.replace(dropout=dropout)
    model = baselines.prepare_model(SequenceClassifier(cfg), method).train()
    optimizers = [build_optimizer(model, OptimConfig(), baselines.engine_parameters(model, method))]
    optimizers += baselines.extra_optimizers(model, method)
    schedule = RankSchedule(RankScheduleConfig(enabled=method.compressed))
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (batch, SEQ), generator=gen)
    mask = torch.ones(batch, SEQ, dtype=torch.bool)
    segments = (torch.arange(SEQ) >= SEQ // 2).long().expand(batch, SEQ)
    labels = torch.randint(0, cfg.num_labels, (batch,), generator=gen)
    state = {"step": 0}
    forwards = {"eager": model, **({"compiled": torch.compile(model)} if compiled else {})}

    def step_with(forward: Callable[..., torch.Tensor]) -> float:
        loss = F.cross_entropy(forward(ids, mask, segments), labels)
        objective = schedule.objective(model, loss, state["step"], global_task_loss=float(loss.detach())).loss
        objective.backward()
        for opt in optimizers:
            opt.step()
        for opt in optimizers:
            opt.zero_grad(set_to_none=True)
        state["step"] += 1
        return float(loss.detach())

    return {kind: functools.partial(step_with, forward) for kind, forward in forwards.items()}


def bench_compiled(batches: list[int], repeats: int, args: argparse.Namespace) -> None:
    """The compressed and the dense model's training step eager against the model under
    ``torch.compile`` (the compressed TT layers call the fused CPU kernels as operators there),
    interleaved in one process on the same parameters."""
    kw = dict(galore_rank=args.galore_rank, lte_heads=args.lte_heads, lte_rank=args.lte_rank, dropout=args.dropout)
    dropout = encoder_preset("reference").dropout if args.dropout is None else args.dropout
    print(
        f"six-encoder, reference shapes, sequence {SEQ}, dropout {dropout}: eager against torch.compile (inductor) "
        "of the whole model"
    )
    for batch in batches:
        print(f"\nbatch {batch} x {SEQ} tokens: median of {repeats} steps each way, interleaved")
        print(f"  {'method':10s} {'eager':>10s} {'compiled':>10s} {'compiled/eager':>15s} {'compiling':>10s}")
        for name in ("compressed", "dense"):
            steps = make_steps(name, batch, compiled=True, **kw)
            start = time.perf_counter()
            steps["compiled"]()  # traced and compiled here
            compiling = time.perf_counter() - start
            times = time_interleaved(steps, repeats=repeats, warmup=1)
            print(
                f"  {name:10s} {times['eager'] * 1e3:8.1f}ms {times['compiled'] * 1e3:8.1f}ms "
                f"{times['eager'] / times['compiled']:14.3f}x {compiling:9.0f}s"
            )
            del steps
            torch._dynamo.reset()
        print("  (compiled/eager above 1: the compiled step is faster; compiling: its first step)")


def memory_probe(name: str, batch: int, galore_rank: int, lte_heads: int, lte_rank: int) -> None:
    """Build the model and its optimisers and run one step, which allocates the optimiser
    state (run in a fresh process)."""
    make_step(name, batch, galore_rank, lte_heads, lte_rank)()


def bench_reference(batches: list[int], repeats: int, warmup: int, args: argparse.Namespace) -> None:
    kw = dict(galore_rank=args.galore_rank, lte_heads=args.lte_heads, lte_rank=args.lte_rank)
    cfg = encoder_preset("reference")
    params = {}
    for name in METHODS:
        method = method_config(name, **kw)
        with torch.device("meta"):
            model = baselines.prepare_model(SequenceClassifier(cfg.replace(compressed=method.compressed)), method)
        params[name] = (
            sum(p.numel() for p in model.parameters()),
            sum(p.numel() for p in model.parameters() if p.requires_grad),
        )
    print(
        f"six-encoder, reference shapes: {cfg.num_layers} layers, d_model {cfg.d_model}, {cfg.num_heads} heads, "
        f"d_ff {cfg.d_ff}, vocabulary {cfg.vocab_size}, sequence {SEQ}; torch threads {torch.get_num_threads()}"
    )
    print(
        f"GaLore rank {args.galore_rank} (update gap 200, scale 0.25); LTE {args.lte_heads} heads of rank "
        f"{args.lte_rank}, merge every 10 steps"
    )
    for name in METHODS:
        print(f"  {name:10s} parameters {params[name][0] / 1e6:7.2f} M stored, {params[name][1] / 1e6:7.2f} M trained")
    for batch in batches:
        t0 = time.perf_counter()
        steps = {name: make_step(name, batch, **kw) for name in METHODS}
        times = time_interleaved(steps, repeats=repeats, warmup=warmup)
        del steps
        mem, train_mem = {}, {}
        for name in METHODS:
            base, peak = peak_rss_of(functools.partial(memory_probe, name, batch, **kw))
            mem[name], train_mem[name] = peak, peak - base
        print(
            f"\nbatch {batch} x {SEQ} tokens: median of {repeats} steps after {warmup} warm-up "
            f"({time.perf_counter() - t0:.0f} s for this batch size)"
        )
        print(
            f"  {'method':10s} {'step':>10s} {'speed-up':>9s} {'vs GaLore':>9s} {'peak RSS':>10s} "
            f"{'vs GaLore':>9s} {'training':>10s} {'vs dense':>9s} {'vs GaLore':>9s}"
        )
        for name in METHODS:
            print(
                f"  {name:10s} {times[name] * 1e3:8.1f}ms "
                f"{times['dense'] / times[name]:8.2f}x {times['galore'] / times[name]:8.2f}x "
                f"{fmt_bytes(mem[name]):>10s} {mem['galore'] / mem[name]:8.2f}x "
                f"{fmt_bytes(train_mem[name]):>10s} {train_mem['dense'] / train_mem[name]:8.2f}x "
                f"{train_mem['galore'] / train_mem[name]:8.2f}x"
            )
        print(
            "  (ratios: dense or GaLore / method; >1 means the method is faster / smaller. Peak RSS: the "
            "whole fresh process building the model and running one step, runtime and libraries "
            f"included ({fmt_bytes(min(mem[n] - train_mem[n] for n in METHODS))} or more before the "
            "model). Training: peak RSS minus that warmed process's RSS before the model, i.e. parameters, "
            "gradients, optimiser state and activations, what a GPU's allocator would count.)"
        )


def train_small(config: str, steps: int) -> None:
    from comera_rec.transformer.runs import ClassificationRun, run_classification

    results = {}
    for name in ("compressed", "dense"):
        cfg = load_config(
            ClassificationRun,
            config,
            [
                f"method.name={name}",
                f"trainer.max_steps={steps}",
                f"trainer.run_dir=runs/bench_transformer/{name}",
                "trainer.progress=false",
                "trainer.plots=false",
            ],
        )
        t0 = time.perf_counter()
        results[name] = (run_classification(cfg), time.perf_counter() - t0)
    print(f"\nsmall configuration on the synthetic task ({config}, {steps} steps):")
    for name, (s, wall) in results.items():
        print(
            f"  {name:10s} val accuracy {s['val_accuracy'] * 100:6.2f}%  val loss {s['val_log_loss']:.4f}  "
            f"compression {s['compression']:5.1f}x  parameters {s['parameters']:,}  ({wall:.0f} s)"
        )
    gap = (results["dense"][0]["val_accuracy"] - results["compressed"][0]["val_accuracy"]) * 100
    print(f"  dense - compressed accuracy: {gap:+.2f} points (goal: at most 1)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer repeats and a shorter training run")
    parser.add_argument(
        "--batches", type=int, nargs="+", default=None, help="batch sizes to time (default 1 and 32; 32 with --compile)"
    )
    parser.add_argument("--repeats", type=int, default=None, help="timed steps per method")
    parser.add_argument("--galore-rank", type=int, default=128)
    parser.add_argument("--lte-heads", type=int, default=4)
    parser.add_argument("--lte-rank", type=int, default=32)
    parser.add_argument(
        "--compile",
        action="store_true",
        help="instead of both parts: the compressed and the dense model's step eager against torch.compile",
    )
    parser.add_argument(
        "--dropout",
        type=float,
        default=None,
        help="with --compile: the encoder's dropout (default the preset's; eager dropout is slow on CPU, compiled "
        "dropout fused, so 0 shows the rest of the step)",
    )
    parser.add_argument("--skip-reference", action="store_true", help="skip part 1")
    parser.add_argument("--skip-train", action="store_true", help="skip part 2")
    parser.add_argument("--train-config", default="configs/transformer_synthetic.yaml")
    parser.add_argument("--train-steps", type=int, default=None, help="steps of part 2 (default: the config's)")
    args = parser.parse_args(argv)
    if args.dropout is not None and not args.compile:
        parser.error("--dropout sets the encoder's dropout for --compile only")
    t0 = time.perf_counter()
    if args.compile:
        bench_compiled(args.batches or [32], args.repeats or (2 if args.quick else 6), args)
        print(f"\ntotal {time.perf_counter() - t0:.0f} s")
        return
    if not args.skip_reference:
        for batch in args.batches or [1, 32]:
            repeats = args.repeats or (1 if args.quick and batch > 8 else 2 if args.quick or batch > 8 else 4)
            bench_reference([batch], repeats, warmup=1, args=args)
    if not args.skip_train:
        steps = args.train_steps
        if steps is None:
            steps = (
                300
                if args.quick
                else load_config(
                    __import__("comera_rec.transformer.runs", fromlist=["ClassificationRun"]).ClassificationRun,
                    args.train_config,
                ).trainer.max_steps
            )
        train_small(args.train_config, steps)
    print(f"\ntotal {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
