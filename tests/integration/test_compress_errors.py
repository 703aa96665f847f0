"""compress(): a wrong model or policy fails with a TypeError naming the argument."""

from __future__ import annotations

import pytest
from torch import nn

import comera_rec
from comera_rec.integration import CompressionPolicy
from comera_rec.integration.compress import compress


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))


@pytest.mark.parametrize(
    "policy, message",
    [
        (8, r"policy must be a CompressionPolicy or None, got 8 \(int\); for a rank pass CompressionPolicy\(rank=8\)"),
        ({"rank": 8}, r"policy must be a CompressionPolicy or None, got \{'rank': 8\} \(dict\)$"),
        ("dense", r"policy must be a CompressionPolicy or None, got 'dense' \(str\)$"),
        (True, r"policy must be a CompressionPolicy or None, got True \(bool\)$"),
    ],
)
def test_policy_that_is_not_a_compression_policy(policy: object, message: str) -> None:
    model = _model()
    with pytest.raises(TypeError, match=f"^compress: {message}"):
        comera_rec.compress(model, policy)
    assert all(type(m) in (nn.Sequential, nn.Linear, nn.ReLU) for m in model.modules())  # untouched


def test_model_that_is_not_a_module() -> None:
    with pytest.raises(TypeError, match="^compress: model must be a torch.nn.Module, got dict"):
        compress({"layer": nn.Linear(4, 4)})


def test_policy_fields_are_named() -> None:
    with pytest.raises(ValueError, match=r"CompressionPolicy\.rank: expected an integer >= 1, got 4\.5"):
        CompressionPolicy(rank=4.5)
    with pytest.raises(ValueError, match=r"CompressionPolicy\.linear_rank: expected an integer >= 1, got '8'"):
        CompressionPolicy(linear_rank="8")


def test_none_and_a_policy_still_work() -> None:
    assert compress(_model()).params_before >= 0
    report = compress(_model(), CompressionPolicy(rank=4, min_gain=0.0))
    assert report.modules and report.params_after < report.params_before
