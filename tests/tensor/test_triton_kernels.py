"""The Triton TTM lookup kernels against the PyTorch path, run by the Triton interpreter.

Triton decides at import time whether it interprets (``TRITON_INTERPRET=1``), and other
modules of a test session (or the doctest collection of the package) may import it
first. So the kernel cases run in one child process started with the variable set:
this file is also the worker script (``python tests/tensor/test_triton_kernels.py``
prints one JSON line of per-case results); each case is one test here. The dispatch
switch is tested in-process, without launching a kernel.

Skipped when triton is not installed.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
import traceback
from typing import Callable

if __name__ == "__main__":  # worker: interpret before anything imports triton
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ.pop("COMERA_DISABLE_TRITON", None)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import pytest
import torch

# ---------------------------------------------------------------------------- worker cases


class _FakeCuda(torch.Tensor):
    """A CPU tensor that says it is on CUDA: drives the dispatch in contract.py on CPU."""

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True


def _bags(n_ids: int, n_bags: int, seed: int) -> torch.Tensor:
    """``(n_bags + 1,)`` offsets whose first, middle and last bags are empty."""
    g = torch.Generator().manual_seed(seed)
    cuts = torch.sort(torch.randint(0, n_ids + 1, (n_bags - 1,), generator=g)).values
    offsets = torch.cat([torch.tensor([0]), cuts, torch.tensor([n_ids])])
    mid = n_bags // 2
    offsets[1], offsets[mid + 1], offsets[-2] = 0, offsets[mid], n_ids
    return offsets


def _close(name: str, a: torch.Tensor, b: torch.Tensor, tol: float) -> float:
    if a.shape != b.shape:
        raise AssertionError(f"{name}: shape {tuple(a.shape)} != {tuple(b.shape)}")
    err = (a - b).abs().max().item() if a.numel() else 0.0
    scale = max(1.0, b.abs().max().item() if b.numel() else 0.0)
    if not err <= tol * scale:
        raise AssertionError(f"{name}: max abs error {err:.3g} > {tol:.1g} * {scale:.3g}")
    return err


def _bag_case(
    mode: str,
    weighted: bool,
    chunk: int,
    block_elems: int,
    n_ids: int = 14,
    dtype: torch.dtype = torch.float32,
    static: bool = False,
) -> float:
    """``ttm_bag_triton`` against gathered rows pooled by ``pool_bags``: output and grads.

    ``static``: the backward's work items without host synchronisation (one per id)."""
    from comera_rec.tensor.bags import pool_bags
    from comera_rec.tensor.kernels.ttm_triton import ttm_bag_triton

    g = torch.Generator().manual_seed(1)
    k_p, k_s, m_l, m_r, r, dim = 3, 4, 2, 3, 3, 5  # D = 5 < M_l * M_r = 6: truncated rows
    prefix = torch.randn(k_p, m_l, r, generator=g, dtype=dtype).requires_grad_()
    suffix = torch.randn(k_s, r, m_r, generator=g, dtype=dtype).requires_grad_()
    p_of_id = torch.randint(0, k_p, (n_ids,), generator=g)  # 3 keys for 14 ids: repeats
    s_of_id = torch.randint(0, k_s, (n_ids,), generator=g)
    if n_ids:
        p_of_id[1], s_of_id[1] = p_of_id[0], s_of_id[0]  # one exactly repeated row
    offsets = _bags(n_ids, 7, seed=2)
    weights = torch.rand(n_ids, generator=g, dtype=dtype).requires_grad_() if weighted else None
    out = ttm_bag_triton(
        prefix,
        suffix,
        p_of_id,
        s_of_id,
        offsets,
        weights,
        mode,
        dim,
        chunk=chunk,
        block_elems=block_elems,
        static_shapes=static,
    )
    rows = torch.bmm(prefix[p_of_id], suffix[s_of_id]).reshape(n_ids, m_l * m_r)[:, :dim]  # (N, D)
    ref = pool_bags(rows, torch.arange(n_ids), offsets, mode, weights)
    err = _close("forward", out, ref, 1e-5)
    grad = torch.randn(out.shape, generator=g, dtype=dtype)
    params = [prefix, suffix] + ([weights] if weighted else [])
    got = torch.autograd.grad(out, params, grad, allow_unused=True)
    want = torch.autograd.grad(ref, params, grad, allow_unused=True)
    for name, a, b in zip(("prefix", "suffix", "weights"), got, want):
        a = torch.zeros_like(params[0]) if a is None else a
        b = torch.zeros_like(a) if b is None else b
        err = max(err, _close(f"grad {name}", a, b, 1e-5))
    return err


def _cores(d: int, tables: int, rank: int, rows: tuple, cols: tuple, dtype: torch.dtype, seed: int) -> list:
    g = torch.Generator().manual_seed(seed)
    full = [1] + [rank] * (d - 1) + [1]
    return [
        torch.randn(tables, full[k], rows[k], cols[k], full[k + 1], generator=g, dtype=dtype).mul_(0.7).requires_grad_()
        for k in range(d)
    ]


def _lookup_case(
    d: int,
    tables: int,
    rank: int,
    mode: str,
    weighted: bool,
    dtype: torch.dtype = torch.float32,
    chunk: int = 3,
    dispatch: bool = False,
    static: bool = False,
) -> float:
    """The fused lookup against ``ttm_embedding_bag`` on the same cores: output and core grads.

    ``dispatch``: go through ``contract.ttm_embedding_bag`` with ids that claim to be on
    CUDA, so the dispatch line itself picks the fused path. ``static``: the fused lookup
    with static shapes (whole halves, per-id keys), against the de-duplicated reference.
    """
    from comera_rec.tensor import contract, kernels
    from comera_rec.tensor.kernels.ttm_triton import ttm_embedding_bag_triton

    rows, cols = (3, 4, 2, 3)[:d], (2, 3, 2, 1)[:d]
    dim = math.prod(cols) - 1
    cores = _cores(d, tables, rank, rows, cols, dtype, seed=3 + d)
    g = torch.Generator().manual_seed(4)
    n_ids = 16
    ids = torch.randint(0, math.prod(rows), (n_ids // 2,), generator=g).repeat(2)  # repeated ids
    trains = torch.randint(0, tables, (n_ids,), generator=g) if tables > 1 else None
    if trains is not None:
        trains[n_ids // 2 :] = trains[: n_ids // 2]  # repeated (train, id) pairs too
    offsets = _bags(n_ids, 6, seed=5)
    weights = torch.rand(n_ids, generator=g, dtype=dtype).requires_grad_() if weighted else None
    if dispatch:
        calls = []
        real = kernels.ttm_embedding_bag_triton

        def fused(*args, **kw):
            calls.append(kw.get("static_shapes", False))
            ids_arg = args[3].as_subclass(torch.Tensor)
            return ttm_embedding_bag_triton(*args[:3], ids_arg, *args[4:], chunk=chunk, **kw)

        kernels.ttm_embedding_bag_triton = fused
        try:
            out = contract.ttm_embedding_bag(
                cores, rows, dim, ids.as_subclass(_FakeCuda), offsets, mode, weights, trains, static_shapes=static
            )
        finally:
            kernels.ttm_embedding_bag_triton = real
        if calls != [static]:
            raise AssertionError(f"contract.ttm_embedding_bag did not dispatch to the fused path: {calls}")
        out = out.as_subclass(torch.Tensor)
    else:
        out = ttm_embedding_bag_triton(
            cores, rows, dim, ids, offsets, mode, weights, trains, chunk=chunk, static_shapes=static
        )
    ref = contract.ttm_embedding_bag(cores, rows, dim, ids, offsets, mode, weights, trains)
    tol = 1e-10 if dtype == torch.float64 else 1e-5
    err = _close("forward", out, ref, tol)
    grad = torch.randn(out.shape, generator=g, dtype=dtype)
    params = list(cores) + ([weights] if weighted else [])
    got = torch.autograd.grad(out, params, grad)
    want = torch.autograd.grad(ref, params, grad)
    for k, (a, b) in enumerate(zip(got, want)):
        err = max(err, _close(f"grad {k}", a.as_subclass(torch.Tensor), b, tol))
        if a.stride() != params[k].stride():  # DDP would warn of its bucket views, autograd copy it
            raise AssertionError(f"grad {k}: strides {a.stride()}, its parameter's {params[k].stride()}")
    return err


def _scoring_case(d: int, tables: int, mode: str, weighted: bool) -> float:
    """Scoring (``cached_weights``, no gradients): the whole halves are made once and kept,
    remade after an in-place change of a core, not kept outside the scope or over the size
    bound; every lookup equals the float64 de-duplicated reference."""
    from comera_rec.tensor import cached_weights, contract
    from comera_rec.tensor.kernels import ttm_triton

    rows, cols = (3, 4, 2, 3)[:d], (2, 3, 2, 1)[:d]
    dim = math.prod(cols) - 1
    cores = [c.detach() for c in _cores(d, tables, 3, rows, cols, torch.float32, seed=7 + d)]
    g = torch.Generator().manual_seed(8)
    n_ids = 12
    ids = torch.randint(0, math.prod(rows), (n_ids,), generator=g)
    trains = torch.randint(0, tables, (n_ids,), generator=g) if tables > 1 else None
    offsets = _bags(n_ids, 5, seed=9)
    weights = torch.rand(n_ids, generator=g) if weighted else None
    made: list[int] = []
    real_whole_halves = ttm_triton.whole_halves

    def counting_whole_halves(stack_cores):
        made.append(1)
        return real_whole_halves(stack_cores)

    def lookup() -> torch.Tensor:
        return ttm_triton.ttm_embedding_bag_triton(cores, rows, dim, ids, offsets, mode, weights, trains)

    def reference() -> torch.Tensor:
        wide = [c.double() for c in cores]
        w = None if weights is None else weights.double()
        return contract.ttm_embedding_bag(wide, rows, dim, ids, offsets, mode, w, trains).float()

    def expect(name: str, made_now: int) -> float:
        made.clear()
        err = _close(name, lookup(), reference(), 1e-5)
        if len(made) != made_now:
            raise AssertionError(f"{name}: halves made {len(made)} times, expected {made_now}")
        return err

    ttm_triton.whole_halves = counting_whole_halves
    try:
        with torch.no_grad():
            err = expect("outside cached_weights: made per call", 0)  # the de-duplicated path
            with cached_weights():
                err = max(err, expect("first scoring call", 1))
                err = max(err, expect("second scoring call: kept", 0))
                kept = ttm_triton.scoring_halves(cores)
                if kept is None or any(t.untyped_storage().data_ptr() == cores[0].data_ptr() for t in kept):
                    raise AssertionError("the kept halves must exist and not share a core's storage")
                cores[0].mul_(1.5)  # an in-place write: the kept halves are stale
                err = max(err, expect("after an in-place write", 1))
                bound = ttm_triton.SCORING_HALVES_MAX_BYTES
                ttm_triton.SCORING_HALVES_MAX_BYTES = 0
                try:
                    cores[1].mul_(0.5)
                    err = max(err, expect("over the size bound: not kept", 0))
                finally:
                    ttm_triton.SCORING_HALVES_MAX_BYTES = bound
            if ttm_triton.scoring_halves(cores) is not None:
                raise AssertionError("halves still kept after leaving cached_weights")
    finally:
        ttm_triton.whole_halves = real_whole_halves
    return err


CASES: dict[str, Callable[[], float]] = {
    "bag_sum": lambda: _bag_case("sum", False, chunk=2, block_elems=4),
    "bag_sum_weighted": lambda: _bag_case("sum", True, chunk=2, block_elems=4),
    "bag_mean": lambda: _bag_case("mean", False, chunk=2, block_elems=4),
    "bag_mean_weighted": lambda: _bag_case("mean", True, chunk=2, block_elems=4),
    "bag_default_blocks": lambda: _bag_case("mean", True, chunk=64, block_elems=2048),
    "bag_no_ids": lambda: _bag_case("sum", True, chunk=2, block_elems=4, n_ids=0),
    "bag_float64": lambda: _bag_case("sum", True, chunk=1, block_elems=8, dtype=torch.float64),
    "lookup_d2_mean": lambda: _lookup_case(2, 1, 4, "mean", False),
    "lookup_d3_sum_weighted": lambda: _lookup_case(3, 1, 3, "sum", True),
    "lookup_d4_stacked_mean_weighted": lambda: _lookup_case(4, 2, 2, "mean", True),
    "lookup_d3_stacked_float64": lambda: _lookup_case(3, 2, 3, "sum", True, dtype=torch.float64),
    "dispatch_from_contract": lambda: _lookup_case(3, 2, 2, "sum", True, dispatch=True),
    # static shapes (CUDA-graph capturable): whole halves, per-id keys, one backward item per id
    "static_bag_mean_weighted": lambda: _bag_case("mean", True, chunk=2, block_elems=4, static=True),
    "static_bag_no_ids": lambda: _bag_case("sum", False, chunk=2, block_elems=4, n_ids=0, static=True),
    "static_lookup_d2_sum": lambda: _lookup_case(2, 1, 3, "sum", False, chunk=2, static=True),
    "static_lookup_d4_stacked_mean_weighted_float64": lambda: _lookup_case(
        4, 2, 2, "mean", True, dtype=torch.float64, chunk=2, static=True
    ),
    "static_dispatch_from_contract": lambda: _lookup_case(3, 2, 2, "sum", True, dispatch=True, static=True),
    # scoring: whole halves kept between calls
    "scoring_d2_sum": lambda: _scoring_case(2, 1, "sum", False),
    "scoring_d4_stacked_mean_weighted": lambda: _scoring_case(4, 2, "mean", True),
}


def _run_cases() -> dict[str, dict]:
    results = {}
    for name, case in CASES.items():
        start = time.perf_counter()
        try:
            results[name] = {"ok": True, "err": case(), "s": time.perf_counter() - start}
        except Exception:
            results[name] = {"ok": False, "msg": traceback.format_exc(limit=6), "s": time.perf_counter() - start}
    return results


# ---------------------------------------------------------------------------- pytest side

pytest.importorskip("triton")
pytest.importorskip("numpy")

from comera_rec.tensor import contract, kernels  # noqa: E402  (after the skip)


@pytest.fixture(scope="module")
def interpreted() -> dict[str, dict]:
    """Run every kernel case in one interpreter process; per-case results by name."""
    env = {k: v for k, v in os.environ.items() if k != kernels.DISABLE_ENV}
    env["TRITON_INTERPRET"] = "1"
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"worker failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", list(CASES))
def test_kernel_matches_torch_path(interpreted: dict[str, dict], case: str) -> None:
    result = interpreted[case]
    assert result["ok"], result.get("msg")


def _spy(monkeypatch: pytest.MonkeyPatch) -> list:
    calls: list = []
    monkeypatch.setattr(
        kernels, "ttm_embedding_bag_triton", lambda *args, **kwargs: calls.append((args, kwargs)) or "fused"
    )
    return calls


def _lookup_args(ids: torch.Tensor) -> tuple:
    cores = [torch.randn(1, 1, 3, 2, 2), torch.randn(1, 2, 4, 2, 1)]
    return cores, (3, 4), 4, ids, torch.tensor([0, 2, 3]), "sum"


def test_dispatch_only_for_cuda_ids(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(kernels.DISABLE_ENV, raising=False)
    calls = _spy(monkeypatch)
    ids = torch.tensor([1, 5, 11])
    out = contract.ttm_embedding_bag(*_lookup_args(ids))
    assert calls == [] and isinstance(out, torch.Tensor) and out.shape == (2, 4)
    assert contract.ttm_embedding_bag(*_lookup_args(ids.as_subclass(_FakeCuda))) == "fused"
    assert len(calls) == 1


@pytest.mark.parametrize("how", ["env", "flag"])
def test_dispatch_can_be_disabled(monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    calls = _spy(monkeypatch)
    if how == "env":
        monkeypatch.setenv(kernels.DISABLE_ENV, "1")
    else:
        monkeypatch.delenv(kernels.DISABLE_ENV, raising=False)
        monkeypatch.setattr(kernels, "_enabled", True)
        kernels.set_triton_enabled(False)
    assert not kernels.triton_enabled()
    out = contract.ttm_embedding_bag(*_lookup_args(torch.tensor([1, 5, 11]).as_subclass(_FakeCuda)))
    assert calls == [] and out.shape == (2, 4)


def test_static_segments_are_the_same_work_items() -> None:
    """``_segments_static`` (one slot per id, empty ones skipped) cuts the same items as ``_segments``."""
    from comera_rec.tensor.kernels.ttm_triton_launch import segments as _segments
    from comera_rec.tensor.kernels.ttm_triton_launch import segments_static as _segments_static

    g = torch.Generator().manual_seed(0)
    keys = torch.cat([torch.full((7,), 3), torch.randint(0, 6, (20,), generator=g)])  # a hot key
    keys = keys[torch.randperm(keys.numel(), generator=g)]
    for chunk in (1, 2, 3, 64):
        items = []
        for order, key, lo, hi in (_segments(keys, 6, chunk), _segments_static(keys, chunk)):
            items.append(sorted((int(k), tuple(order[a:b].tolist())) for k, a, b in zip(key, lo, hi) if b > a))
        assert items[0] == items[1], chunk
        assert all(0 < len(ids) <= chunk and all(int(keys[i]) == k for i in ids) for k, ids in items[1])


# ---------------------------------------------------------------------------- ahead-of-time compile

_INDEX_ARGS = (
    "p_of_id_ptr",
    "s_of_id_ptr",
    "offsets_ptr",
    "bag_of_id_ptr",
    "order_ptr",
    "item_key_ptr",
    "item_lo_ptr",
    "item_hi_ptr",
)
_ACCUMULATORS = ("grad_prefix_ptr", "grad_suffix_ptr", "grad_weights_ptr")


@pytest.mark.parametrize("capability,dtype", [(80, "fp32"), (90, "fp32"), (90, "bf16")])
def test_kernels_compile_for_gpu(tmp_path, monkeypatch: pytest.MonkeyPatch, capability: int, dtype: str) -> None:
    """The real compiler (not the interpreter) lowers every kernel to a cubin for sm_80 / sm_90.

    Needs no GPU: Triton's NVIDIA backend and its bundled ptxas compile ahead of time.
    This catches what the interpreter accepts but the compiler rejects; it runs nothing.
    """
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from comera_rec.tensor.kernels import ttm_triton_kernels

    if ttm_triton_kernels.interpreting():
        pytest.skip("TRITON_INTERPRET is set in this process")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")  # the default; set to silence its warning
    kernels_and_blocks = [
        (ttm_triton_kernels.ttm_bag_fwd_kernel, dict(HAS_WEIGHTS=True, MEAN=True, BLOCK_D=16, BLOCK_R=32)),
        (ttm_triton_kernels.ttm_bag_bwd_prefix_kernel, dict(BLOCK_ML=4, BLOCK_MR=4, BLOCK_R=32)),
        (ttm_triton_kernels.ttm_bag_bwd_suffix_kernel, dict(BLOCK_ML=4, BLOCK_MR=4, BLOCK_R=32)),
        (ttm_triton_kernels.ttm_bag_bwd_weights_kernel, dict(BLOCK_D=16, BLOCK_R=32)),
    ]
    for fn, constants in kernels_and_blocks:
        jitted = triton.jit(fn)
        constants = {**constants, "ACC": tl.float32}
        signature = {}
        for name in jitted.arg_names:
            if name in constants:
                signature[name] = "constexpr"
            elif not name.endswith("_ptr"):
                signature[name] = "i32"
            elif name in _INDEX_ARGS:
                signature[name] = "*i64"
            else:
                signature[name] = "*fp32" if name in _ACCUMULATORS else f"*{dtype}"
        compiled = triton.compile(
            ASTSource(jitted, signature, constants),
            target=GPUTarget("cuda", capability, 32),
            options={"num_warps": 2},
        )
        assert compiled.asm["cubin"], fn.__name__


if __name__ == "__main__":
    torch.manual_seed(0)
    print(json.dumps(_run_cases()))
