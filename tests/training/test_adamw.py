"""GroupStepAdamW against torch.optim.AdamW(fused=True): the same parameters and state bit for
bit, through steps with missing gradients, state-dict round trips in both directions, and the
settings it leaves to torch's own step."""

from __future__ import annotations

import copy

import pytest
import torch

from comera_rec.training.adamw import GroupStepAdamW

SHAPES = [(3, 4), (7,), (2, 5, 3), (1,), (16, 8)]


def make_params(seed: int = 0, dtype=torch.float32) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g, dtype=dtype)) for s in SHAPES]


def groups(params, **extra) -> list[dict]:
    """Three groups with learning rates and decays of their own, as the trainer makes."""
    return [
        {"params": params[:2], "lr": 3e-3, **extra},
        {"params": params[2:4], "lr": 1e-2, "weight_decay": 0.1, **extra},
        {"params": params[4:], "lr": 1e-3, **extra},
    ]


def set_grads(params, step: int, skip=()) -> None:
    g = torch.Generator().manual_seed(100 + step)
    for i, p in enumerate(params):
        grad = torch.randn(p.shape, generator=g, dtype=p.dtype)
        p.grad = None if i in skip else grad


def step_alike(a_params, a_opt, b_params, b_opt, steps) -> None:
    """The same gradients for both parameter sets at each of ``steps``, then a step of each."""
    for step in steps:
        set_grads(a_params, step)
        set_grads(b_params, step)
        a_opt.step()
        b_opt.step()


def assert_same(a_params, b_params, a_opt, b_opt) -> None:
    for i, (a, b) in enumerate(zip(a_params, b_params)):
        assert torch.equal(a, b), f"parameter {i}"
        sa, sb = a_opt.state.get(a, {}), b_opt.state.get(b, {})
        assert sa.keys() == sb.keys(), f"state keys of parameter {i}"
        for key in sa:
            assert torch.equal(sa[key], sb[key]), f"{key} of parameter {i}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_steps_equal_torch_fused_adamw_bit_for_bit(dtype) -> None:
    ours_p, torch_p = make_params(dtype=dtype), make_params(dtype=dtype)
    ours = GroupStepAdamW(groups(ours_p), fused=True, weight_decay=0.01, betas=(0.8, 0.99))
    ref = torch.optim.AdamW(groups(torch_p), fused=True, weight_decay=0.01, betas=(0.8, 0.99))
    for step in range(6):
        # step 2: two parameters without a gradient (their step counts stay behind);
        # step 4: a learning rate changed by a scheduler
        skip = (0, 3) if step == 2 else ()
        if step == 4:
            for opt in (ours, ref):
                opt.param_groups[0]["lr"] = 5e-4
        set_grads(ours_p, step, skip)
        set_grads(torch_p, step, skip)
        ours.step()
        ref.step()
        assert_same(ours_p, torch_p, ours, ref)
    assert float(ours.state[ours_p[0]]["step"]) == 5 and float(ours.state[ours_p[1]]["step"]) == 6


def test_equal_step_counts_share_one_tensor() -> None:
    params = make_params()
    opt = GroupStepAdamW(groups(params), fused=True)
    set_grads(params, 0)
    opt.step()
    for group in opt.param_groups:  # one count for each group's parameters
        assert len({id(opt.state[p]["step"]) for p in group["params"]}) == 1
    set_grads(params, 1, skip=(1,))
    opt.step()
    # the parameter without a gradient got a count of its own, which stayed at 1
    assert float(opt.state[params[1]]["step"]) == 1
    assert opt.state[params[1]]["step"] is not opt.state[params[0]]["step"]
    assert float(opt.state[params[0]]["step"]) == 2


@pytest.mark.parametrize("direction", ["ours to torch", "torch to ours"])
def test_state_dict_round_trips_with_torch(direction) -> None:
    first_cls, second_cls = (GroupStepAdamW, torch.optim.AdamW)
    if direction == "torch to ours":
        first_cls, second_cls = second_cls, first_cls
    params = make_params()
    first = first_cls(groups(params), fused=True)
    for step in range(3):
        set_grads(params, step, skip=(2,) if step == 1 else ())
        first.step()
    saved = first.state_dict()
    steps = [s["step"] for s in saved["state"].values()]
    assert len({id(t) for t in steps}) == len(steps)  # a count of its own per parameter

    # the same state continued by both classes
    a_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    b_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    a = second_cls(groups(a_params), fused=True)
    b = first_cls(groups(b_params), fused=True)
    # copies: torch's load keeps the given tensors where dtype and device fit (no copy)
    a.load_state_dict(copy.deepcopy(saved))
    b.load_state_dict(copy.deepcopy(saved))
    step_alike(a_params, a, b_params, b, range(3, 6))
    assert_same(a_params, b_params, a, b)


def test_load_shares_equal_counts_again() -> None:
    params = make_params()
    opt = GroupStepAdamW(groups(params), fused=True)
    for step in range(2):
        set_grads(params, step, skip=(4,) if step == 1 else ())
        opt.step()
    fresh = GroupStepAdamW(groups([torch.nn.Parameter(p.detach().clone()) for p in params]), fused=True)
    fresh.load_state_dict(opt.state_dict())
    by_group = [[fresh.state[p]["step"] for p in g["params"]] for g in fresh.param_groups]
    assert [len({id(t) for t in counts}) for counts in by_group] == [1, 1, 1]
    assert [float(c[0]) for c in by_group] == [2.0, 2.0, 1.0]


@pytest.mark.parametrize(
    "options",
    [{"fused": False, "foreach": True}, {"fused": True, "amsgrad": True}, {"fused": True, "maximize": True}],
)
def test_other_settings_step_as_torch(options) -> None:
    ours_p, torch_p = make_params(), make_params()
    ours = GroupStepAdamW(groups(ours_p), **options)
    ref = torch.optim.AdamW(groups(torch_p), **options)
    step_alike(ours_p, ours, torch_p, ref, range(3))
    assert_same(ours_p, torch_p, ours, ref)


def test_closure_loss_is_returned_and_hooks_run() -> None:
    params = make_params()
    opt = GroupStepAdamW(groups(params), fused=True)
    calls = []
    opt.register_step_post_hook(lambda *_: calls.append("post"))

    def closure():
        set_grads(params, 0)
        return torch.tensor(1.5)

    assert float(opt.step(closure)) == 1.5
    assert calls == ["post"]
    assert float(opt.state[params[0]]["step"]) == 1
