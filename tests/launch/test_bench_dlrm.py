"""The DLRM benchmark's own helpers (dlrm/bench.py, run by launch/bench_dlrm.py and comera-bench)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn

from comera_rec.dlrm import bench as bench_dlrm
from comera_rec.dlrm import bench_parts


def test_every_timed_step_gets_its_own_batch() -> None:
    # cycling a few batches lets a dense model fit them and slow down (denormal gradients)
    setup = replace(bench_dlrm.Setup(), batch_size=64)
    data = bench_dlrm.train_batches(setup, False, 5)
    assert len(data) == 5
    ids = [b.sparse_features.values() for b in data]
    assert all(len(v) == len(ids[0]) for v in ids)
    assert all(not torch.equal(ids[i], ids[j]) for i in range(5) for j in range(i + 1, 5))
    assert all(b.dense_features.shape == (64, 13) for b in data)


def test_isa_avx2_runs_the_command_again_under_the_switches(monkeypatch) -> None:
    from comera_rec.utils.isa import isa_environment

    for name in isa_environment("avx2"):
        monkeypatch.delenv(name, raising=False)
    calls = []

    def fake_execve(path, args, env):
        calls.append((path, args, env))
        raise SystemExit(0)  # execve does not return

    monkeypatch.setattr(bench_dlrm.os, "execve", fake_execve)
    try:
        bench_dlrm.main(["--quick", "--isa", "avx2"])
    except SystemExit:
        pass
    ((path, args, env),) = calls
    assert path == bench_dlrm.sys.executable
    assert args[1] == "-c" and "bench import main; main()" in args[2] and args[3:] == ["--quick", "--isa", "avx2"]
    assert all(env[k] == v for k, v in isa_environment("avx2").items())


def test_isa_is_checked_before_anything_runs(capsys) -> None:
    with pytest.raises(SystemExit):
        bench_dlrm.main(["--isa", "avx10"])
    assert "invalid choice: 'avx10'" in capsys.readouterr().err


def test_thread_scaling_orders_by_the_many_thread_time_and_names_the_gain() -> None:
    one = {"a": 4.0, "b": 1.0, "c": 3.0}
    more = {"a": 2.0, "b": 1.0, "c": 3.5, "d": 0.5}
    rows = bench_parts.thread_scaling(one, more, top=3)
    assert [r[0] for r in rows] == ["c", "a", "b"]
    assert rows[1] == ("a", 4.0, 2.0, 2.0)
    assert rows[0][3] < 1.0  # slower on more threads: a gain under 1
    assert bench_parts.thread_scaling({}, {"d": 0.5}, top=5) == [("d", 0.0, 0.5, 0.0)]


def test_op_self_times_profiles_the_step_at_the_thread_count() -> None:
    threads = torch.get_num_threads()
    a, b = torch.randn(64, 64), torch.randn(64, 64)
    calls = []

    def step() -> None:
        calls.append(torch.get_num_threads())
        torch.mm(a, b).relu_()

    try:
        times = bench_parts.op_self_times(step, 1, steps=4)
    finally:
        torch.set_num_threads(threads)
    assert calls == [1] * 7  # 3 to settle, then the 4 profiled
    assert times["aten::mm"] > 0 and times["aten::relu_"] > 0


def test_unchained_adds_the_tt_model_with_its_layers_one_by_one() -> None:
    from comera_rec.dlrm import bench_setup

    setup = replace(bench_dlrm.Setup(), unchained=True)
    names = bench_setup.variants(setup)
    assert names[-1] == "tt_unchained" and "tt_unchained" not in bench_setup.variants(bench_dlrm.Setup())
    assert bench_setup.base_variant("tt_unchained") == "tt" == bench_setup.base_variant("tt_torch")
    config = bench_setup.model_config("tt_unchained", setup, mlperf=False)
    assert config == bench_setup.model_config("tt", setup, mlperf=False)


def test_every_other_round_reverses_the_variants_order() -> None:
    from comera_rec.dlrm.bench_process import round_order

    names = ("dense", "dense_fi", "tt", "tt_half")
    assert round_order(names, 0) == names == round_order(names, 2)
    assert round_order(names, 1) == ("tt_half", "tt", "dense_fi", "dense") == round_order(names, 3)
    # over two rounds, tt runs after dense_fi once and after tt_half once
    two = round_order(names, 0) + round_order(names, 1)
    assert {two[i - 1] for i in range(1, len(two)) if two[i] == "tt"} == {"dense_fi", "tt_half"}


def test_paired_speedups_divide_the_processes_of_one_round() -> None:
    from comera_rec.dlrm.bench_process import paired_speedups

    steps = {"dense": [0.060, 0.080, 0.070], "tt": [0.030, 0.020, 0.035], "tt_half": [0.020, 0.040, 0.035]}
    paired = paired_speedups(steps)
    assert paired["dense"] == [1.0, 1.0, 1.0]
    assert paired["tt"] == pytest.approx([2.0, 4.0, 2.0])
    assert paired["tt_half"] == pytest.approx([3.0, 2.0, 2.0])
    with pytest.raises(ValueError, match="tt ran 2 rounds, dense 3"):
        paired_speedups({"dense": [0.06, 0.08, 0.07], "tt": [0.03, 0.02]})
    with pytest.raises(ValueError, match="no 'dense'"):
        paired_speedups({"tt": [0.03]})


def test_spread_warning_names_the_variants_whose_processes_drift_apart() -> None:
    from comera_rec.dlrm.bench_process import spread_warning

    # dense 1.10x apart (within 1.15), tt 1.30x, tt_half exactly at the limit: only tt named
    steps = {"dense": [0.050, 0.055, 0.052], "tt": [0.020, 0.026, 0.021], "tt_half": [0.0200, 0.0230]}
    line = spread_warning(steps)
    assert line is not None
    assert "tt 20.0-26.0 ms (1.30x apart)" in line
    assert "dense" not in line and "tt_half" not in line
    assert spread_warning(steps, limit=1.35) is None
    both = spread_warning(steps, limit=1.05)
    assert both is not None and "dense 50.0-55.0 ms (1.10x apart)" in both and "tt_half" in both
    assert spread_warning({"tt": [0.02]}) is None  # one process: no spread
    with pytest.raises(ValueError, match="limit must be >= 1"):
        spread_warning(steps, limit=0.9)
    with pytest.raises(ValueError, match="tt needs positive step times"):
        spread_warning({"tt": []})


def test_upstream_gradient_is_made_once_per_shape_and_kept() -> None:
    kept: dict = {}
    first = bench_parts.upstream_gradient(kept, torch.zeros(4, 3))
    again = bench_parts.upstream_gradient(kept, torch.randn(4, 3))
    other = bench_parts.upstream_gradient(kept, torch.zeros(4, 2))
    assert again is first and torch.equal(first, torch.ones(4, 3))
    assert other is not first and other.shape == (4, 2)
    as_double = bench_parts.upstream_gradient(kept, torch.zeros(4, 3, dtype=torch.float64))
    assert as_double.dtype == torch.float64 and kept[(4, 3)] is as_double


def test_sgemm_rate_is_the_median_gemm_and_the_probe_gives_its_spread() -> None:
    assert bench_parts.sgemm_rate([0.5, 0.25, 1.0], n=100) == pytest.approx(2 * 100**3 / 0.5)
    with pytest.raises(ValueError, match="at least one"):
        bench_parts.sgemm_rate([], n=100)
    probe = bench_parts.SgemmProbe(n=32)
    with pytest.raises(ValueError, match="at least one"):
        probe.spread()
    probe.time_once()
    assert len(probe.seconds) == 1 and probe.seconds[0] > 0  # the untimed warm-up call not counted
    probe.seconds[:] = [0.2, 0.1, 0.4]  # a host that drifted over the rounds
    assert probe.flops_per_second() == pytest.approx(2 * 32**3 / 0.2)
    slowest, fastest = probe.spread()
    assert slowest == pytest.approx(2 * 32**3 / 0.4) and fastest == pytest.approx(2 * 32**3 / 0.1)


def test_module_flops_counts_the_chosen_modules_phase_by_phase() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 2), nn.Linear(2, 2))
    x = torch.randn(5, 8)
    outputs = []

    def forward() -> None:
        outputs.append(net(x).sum())

    def backward() -> None:
        outputs.pop().backward()

    picked = (nn.Linear,)
    # forward: x W^T per layer; backward: every weight's gradient and the inputs' gradients of
    # the layers after the first (x needs none)
    forward_flops = 2 * 5 * (8 * 4 + 4 * 2 + 2 * 2)
    backward_flops = 2 * 5 * (8 * 4 + 4 * 2 + 2 * 2) + 2 * 5 * (4 * 2 + 2 * 2)
    assert bench_parts.module_flops(net, [forward, backward], picked) == [forward_flops, backward_flops]
    # one phase doing both counts their sum
    assert bench_parts.module_flops(net, [lambda: net(x).sum().backward()], picked) == [forward_flops + backward_flops]
    # only the modules of the chosen kinds count: none here
    assert bench_parts.module_flops(net, [forward, backward], (nn.ReLU,)) == [0.0, 0.0]


class _OneLayerTrain(nn.Module):
    """A stand-in for DLRMTrain: ``(loss, None)`` from a batch through one narrow layer and a
    dense head."""

    def __init__(self) -> None:
        super().__init__()
        from comera_rec.tensor.linear import NarrowLinear

        self.narrow = NarrowLinear.from_linear(nn.Linear(3, 8), relu=True)
        self.head = nn.Linear(8, 1)

    def forward(self, batch: torch.Tensor):
        return self.head(self.narrow(batch)).sum(), None


def test_fused_layer_flops_counts_only_the_fused_kinds_forward_and_backward() -> None:
    from comera_rec.tensor import kernels

    torch.manual_seed(0)
    model, batch = _OneLayerTrain(), torch.randn(6, 3)
    kernels.set_cpu_kernel_enabled(False)  # the PyTorch path, as --parts counts
    try:
        forward, backward = bench_parts.fused_layer_flops(model, batch)
    finally:
        kernels.set_cpu_kernel_enabled(True)
    # the narrow layer: x W^T forward; its weight's gradient backward (its input needs none);
    # the head's products are not counted
    assert forward == 2 * 6 * 3 * 8
    assert backward == 2 * 6 * 3 * 8
    assert all(p.grad is None for p in model.parameters())  # the counting step leaves no gradients


@pytest.mark.usefixtures("kernels_on")  # tests/conftest.py
def test_fused_kernel_times_finds_the_chain_and_single_layer_kernels() -> None:
    from comera_rec.integration.mlp import tt_mlp, unchain_layers
    from comera_rec.tensor import kernels

    torch.manual_seed(0)
    chained = tt_mlp(13, [64, 32], rank=4)  # two TT layers: one chain call each way
    x = torch.randn(32, 13)

    def step(mlp: nn.Module) -> None:
        mlp(x).sum().backward()

    one_layer, chain = bench_parts.TT_LAYER_KERNELS
    threads = torch.get_num_threads()
    times = bench_parts.op_self_times(lambda: step(chained), threads, steps=2)
    assert times.get(chain, 0) > 0 and times.get(f"{chain}Backward", 0) > 0 and one_layer not in times
    assert bench_parts.fused_kernel_times(times) == (times[chain], times[f"{chain}Backward"])
    single = unchain_layers(tt_mlp(13, [64, 32], rank=4))  # each TT layer its own kernel call
    times = bench_parts.op_self_times(lambda: step(single), threads, steps=2)
    assert times.get(one_layer, 0) > 0 and times.get(f"{one_layer}Backward", 0) > 0 and chain not in times
    assert bench_parts.fused_kernel_times(times) == (times[one_layer], times[f"{one_layer}Backward"])
    kernels.set_cpu_kernel_enabled(False)  # the PyTorch path runs no fused kernel
    times = bench_parts.op_self_times(lambda: step(chained), threads, steps=2)
    assert bench_parts.fused_kernel_times(times) == (0.0, 0.0)


class _TinyDLRM(nn.Module):
    """A stand-in for DLRM's parts as ``--parts`` reaches them: the sparse arch passes the
    pooled embeddings through, the dense arch is one layer, and the interaction is called
    with keyword tensors as TorchRec's DLRM calls it."""

    def __init__(self, num_sparse: int, dim: int) -> None:
        super().__init__()
        from comera_rec.dlrm.interaction import PairwiseDotInteraction

        self.sparse_arch = nn.Identity()
        self.dense_arch = nn.Linear(dim, dim)
        self.inter_arch = PairwiseDotInteraction(num_sparse)

    def forward(self, batch):
        sparse, dense = self.sparse_arch(batch.sparse_features), self.dense_arch(batch.dense_features)
        return self.inter_arch(dense_features=dense, sparse_features=sparse).sum(), None


class _TinyTrain(nn.Module):
    """A stand-in for DLRMTrain: the model under ``.model``."""

    def __init__(self, num_sparse: int, dim: int) -> None:
        super().__init__()
        self.model = _TinyDLRM(num_sparse, dim)

    def forward(self, batch):
        return self.model(batch)


def test_interaction_pass_flops_counts_the_grid_and_nothing_after_it() -> None:
    from types import SimpleNamespace

    from comera_rec.tensor import kernels

    torch.manual_seed(0)
    rows, num_sparse, dim = 5, 3, 4
    wrapped = _TinyTrain(num_sparse, dim)
    batch = SimpleNamespace(dense_features=torch.randn(rows, dim), sparse_features=torch.randn(rows, num_sparse, dim))
    kernels.set_cpu_kernel_enabled(False)  # the PyTorch path, as --parts counts
    try:
        forward, backward = bench_parts.interaction_pass_flops(wrapped, batch)
        # counted by module over the whole step, the keyword call keeps the interaction
        # "running" through the dense layer's backward: why the interaction has its own count
        losses = []
        _, through_step = bench_parts.module_flops(
            wrapped,
            (lambda: losses.append(wrapped(batch)[0]), lambda: losses.pop().backward()),
            (type(wrapped.model.inter_arch),),
        )
        wrapped.zero_grad(set_to_none=True)
    finally:
        kernels.set_cpu_kernel_enabled(True)
    n = num_sparse + 1
    # the whole (n, n) grid forward; backward one batched product of the pairs' grid with
    # the features
    assert forward == 2 * rows * n * n * dim
    assert backward == 2 * rows * n * n * dim
    assert through_step == backward + 2 * rows * dim * dim  # + the dense layer's weight gradient
    assert all(p.grad is None for p in wrapped.parameters())


@pytest.mark.usefixtures("kernels_on")  # tests/conftest.py
def test_fused_kernel_times_finds_the_interaction_kernel() -> None:
    from comera_rec.dlrm.interaction import PairwiseDotInteraction
    from comera_rec.tensor import kernels

    torch.manual_seed(0)
    interaction = PairwiseDotInteraction(3)
    dense, sparse = torch.randn(8, 4, requires_grad=True), torch.randn(8, 3, 4, requires_grad=True)

    def step() -> None:
        interaction(dense, sparse).sum().backward()

    (name,) = bench_parts.INTERACTION_KERNELS
    threads = torch.get_num_threads()
    times = bench_parts.op_self_times(step, threads, steps=2)
    assert times.get(name, 0) > 0 and times.get(f"{name}Backward", 0) > 0
    assert bench_parts.fused_kernel_times(times, bench_parts.INTERACTION_KERNELS) == (
        times[name],
        times[f"{name}Backward"],
    )
    assert bench_parts.fused_kernel_times(times) == (0.0, 0.0)  # no TT layer in this step
    kernels.set_cpu_kernel_enabled(False)  # the PyTorch path runs no fused kernel
    times = bench_parts.op_self_times(step, threads, steps=2)
    assert bench_parts.fused_kernel_times(times, bench_parts.INTERACTION_KERNELS) == (0.0, 0.0)


def test_fused_kernel_report_names_a_variant_without_fused_layers() -> None:
    lines = bench_parts.fused_kernel_report({"dense": (0.0, 0.0), "tt": (0.003, 0.009)}, {"tt": (3e8, 6e8)}, rate=1e11)
    assert lines[1].startswith("dense") and "no fused TT layer" in lines[1]
    assert "forward  3.00 ms /  3.00 ms = 1.00x" in lines[2] and "backward  9.00 ms /  6.00 ms = 1.50x" in lines[2]
    # kernels timed but no FLOPs found for their layers: said, not divided by
    uncounted = bench_parts.fused_kernel_report({"tt": (0.003, 0.009)}, {"tt": (0.0, 0.0)}, rate=1e11)
    assert uncounted[1].count("(no FLOPs counted)") == 2
    # another kernel's lines: its heading, and its own word for a variant without it
    lines = bench_parts.fused_kernel_report(
        {"dense": (0.0, 0.0), "tt": (0.001, 0.002)},
        {"tt": (1e8, 1e8)},
        rate=1e11,
        heading=bench_parts.INTERACTION_HEADING,
        absent="no fused interaction kernel",
    )
    assert lines[0] == bench_parts.INTERACTION_HEADING and lines[1].endswith("no fused interaction kernel")
    assert "forward  1.00 ms /  1.00 ms = 1.00x" in lines[2] and "backward  2.00 ms /  1.00 ms = 2.00x" in lines[2]


ROWS = (6, 5, 4, 7)  # a 4-core table of 840 rows, columns (2, 2, 2, 2), ranks (1, 4, 4, 4, 1)


def small_lookup(g: torch.Generator) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """``(cores, ids, offsets)``: 16 bags of 4 ids over a table of ``ROWS``."""
    cols, ranks = (2, 2, 2, 2), (1, 4, 4, 4, 1)
    cores = [torch.randn(1, ranks[k], ROWS[k], cols[k], ranks[k + 1], generator=g) for k in range(4)]
    return cores, torch.randint(0, 6 * 5 * 4 * 7, (64,), generator=g), torch.arange(0, 65, 4)


@pytest.mark.usefixtures("kernels_on")  # tests/conftest.py
def test_lookup_phases_finds_the_fused_lookup_in_the_profile() -> None:
    from comera_rec.tensor import kernels
    from comera_rec.tensor.contract import ttm_embedding_bag

    cores, ids, offsets = small_lookup(torch.Generator().manual_seed(0))
    cores = [c.requires_grad_() for c in cores]

    def step() -> None:
        ttm_embedding_bag(cores, ROWS, 16, ids, offsets, "sum", None, torch.zeros_like(ids)).sum().backward()

    # at the current thread count; the kernels_on fixture switches the kernels back on
    times = bench_parts.op_self_times(step, torch.get_num_threads(), steps=3)
    assert all(times.get(name, 0.0) > 0 for name in bench_parts.TTM_LOOKUP_KERNELS), sorted(times)
    # every phase of a lookup without a middle controller is in the profile, and no other
    ran = {name for name in bench_parts.TTM_LOOKUP_PHASES if name in times}
    assert ran == set(bench_parts.TTM_LOOKUP_PHASES) - {"ttm_lookup: controller", "ttm_lookup backward: controller"}
    assert all(times[name] > 0 for name in ran)
    phases, flops = bench_parts.lookup_phases(*bench_parts.kernel_times(step, steps=3))
    assert set(phases) == ran | {"calls"} and all(t > 0 for t in phases.values())
    # both halves of these cores have 2 cores: per distinct prefix and suffix one (m0, r_mid) x
    # (r_mid, m1 r) product forward, two backward
    keys = ids // (4 * 7), ids % (4 * 7)
    per_slot = 2 * 4 * 2 * 4  # m0 r_mid m1 r, the same for both halves here
    expected = 2 * 3 * per_slot * (keys[0].unique().numel() + keys[1].unique().numel())
    assert flops == expected
    kinds = bench_parts.phases_by_kind(phases)
    assert set(kinds) == {"contraction", "per id", "pass", "calls"}
    assert sum(kinds.values()) == pytest.approx(sum(phases.values()))
    kernels.set_cpu_kernel_enabled(False)  # the PyTorch path: no fused lookup to find
    assert bench_parts.lookup_phases(*bench_parts.kernel_times(step, steps=3)) == ({}, 0.0)


@pytest.mark.usefixtures("kernels_on")  # tests/conftest.py
def test_the_lookup_with_a_middle_controller_profiles_its_controller_phases() -> None:
    from comera_rec.tensor import kernels

    g = torch.Generator().manual_seed(0)
    cores, ids, offsets = small_lookup(g)
    cores = [c.requires_grad_() for c in cores]
    middle = torch.rand(1, 4, generator=g).requires_grad_()

    def step() -> None:
        kernels.ttm_embedding_bag_cpu(cores, ROWS, 16, ids, offsets, middle=middle).sum().backward()

    times = bench_parts.op_self_times(step, torch.get_num_threads(), steps=2)
    assert {"ttm_lookup: controller", "ttm_lookup backward: controller"} <= set(times), sorted(times)


def test_the_lookup_kernel_report_sets_each_variant_against_its_flops() -> None:
    phases = {
        "ttm_lookup: contractions": 0.002,
        "ttm_lookup: pooling": 0.0005,
        "ttm_lookup backward: core gradients": 0.001,
        "ttm_lookup backward: core layouts": 0.0002,
        "calls": 0.0003,
    }
    measured = {"tt": (phases, 1e8), "tt_torch": ({}, 0.0)}
    lines = bench_parts.lookup_kernel_report(measured, {"tt": 4e8, "tt_torch": 4e8}, rate=1e11)
    text = "\n".join(lines)
    # 4.0 ms in all against 4e8 FLOP at 1e11 FLOP/s (4 ms); by kind: contraction 3 ms, per id
    # 0.5, pass 0.2, calls 0.3
    assert "tt               4.00 ms /  4.00 ms = 1.00x" in text
    assert "(calls 0.30  contraction 3.00  pass 0.20  per id 0.50)" in text
    assert "tt_torch       the fused CPU lookup not used" in text
    # the contraction phases: 3 ms for 1e8 FLOP (1 ms at the rate)
    assert "tt               3.00 ms for 0.100 GFLOP ( 1.00 ms) = 3.00x" in text
    rows = {line.split("  ")[0]: line.split()[-1] for line in lines if line.startswith(("ttm_lookup", "calls"))}
    assert rows == {
        "ttm_lookup: contractions": "2.000",
        "ttm_lookup: pooling": "0.500",
        "ttm_lookup backward: core layouts": "0.200",
        "ttm_lookup backward: core gradients": "1.000",
        "calls": "0.300",
    }
    # no variant on the kernel: the first part only
    assert len(bench_parts.lookup_kernel_report({"tt": ({}, 0.0)}, {"tt": 4e8}, rate=1e11)) == 2


def test_autocast_runs_the_forward_under_bfloat16_and_the_backward_outside() -> None:
    class Recorder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(4))
            self.forward_autocast: list[bool] = []
            self.backward_autocast: list[bool] = []
            self.w.register_hook(lambda g: self.backward_autocast.append(torch.is_autocast_enabled("cpu")))

        def forward(self, batch: torch.Tensor):
            self.forward_autocast.append(torch.is_autocast_enabled("cpu"))
            return (batch * self.w).sum(), None

    model = Recorder()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for autocast in (True, False):
        bench_dlrm.train_step(model, optimizer, torch.ones(2, 4), autocast)
    assert model.forward_autocast == [True, False]
    assert model.backward_autocast == [False, False]
    with bench_dlrm.forward_precision(torch.device("cpu"), "bfloat16"):  # the trainer's, re-exported
        assert torch.get_autocast_dtype("cpu") == torch.bfloat16


@pytest.mark.parametrize("other", [["--parts"], ["--ops", "tt"], ["--mlperf"], ["--against", "HEAD"]])
def test_autocast_is_refused_with_the_other_modes(other: list[str], capsys) -> None:
    with pytest.raises(SystemExit):
        bench_dlrm.main(["--autocast", *other])
    assert f"--autocast times the Kaggle variants' training step; not with {other[0]}" in capsys.readouterr().err


def test_autocast_is_refused_with_avx2_code(monkeypatch, capsys) -> None:
    monkeypatch.setattr(bench_dlrm, "check_host_runs", lambda isa: None)  # any host
    with pytest.raises(SystemExit):
        bench_dlrm.main(["--autocast", "--isa", "avx2"])
    assert "--autocast with --isa avx2: torch's bfloat16 products are oneDNN's" in capsys.readouterr().err


def test_autocast_is_refused_on_a_cpu_without_bfloat16_kernels(monkeypatch, capsys) -> None:
    monkeypatch.setattr(bench_dlrm, "cpu_bfloat16_products", lambda: False)
    with pytest.raises(SystemExit):
        bench_dlrm.main(["--autocast", "--quick"])
    err = capsys.readouterr().err
    assert "--autocast: torch has no bfloat16 matrix kernels for this CPU (ATen " in err
    assert "reference loop" in err
