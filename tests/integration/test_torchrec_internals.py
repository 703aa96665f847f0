"""The TorchRec internals comera-rec relies on are where comera_rec.integration.torchrec_internals
expects them (this fails, naming them, when a TorchRec upgrade moves one)."""

from __future__ import annotations

import importlib.metadata

import pytest
import torch
from torch import nn
from torchrec.modules.mlp import MLP

from comera_rec.integration import torchrec_internals as internals


def test_every_internal_is_where_the_installed_torchrec_has_it() -> None:
    versions = {name: importlib.metadata.version(name.replace("_", "-")) for name in ("torchrec",)}
    missing = internals.missing_internals()
    assert missing == [], (
        f"TorchRec {versions['torchrec']} (tested: {internals.TESTED_VERSIONS['torchrec']}) moved "
        f"internals comera-rec uses: {missing}; update comera_rec/integration/torchrec_internals.py"
    )


def test_the_check_names_an_internal_that_moved(monkeypatch: pytest.MonkeyPatch) -> None:
    class MovedMLP(MLP):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.layers = self._mlp
            del self._mlp

    monkeypatch.setattr(internals, "MLP", MovedMLP)
    assert "torchrec.modules.mlp.MLP._mlp" in internals.missing_internals()


def test_perceptron_accessors_replace_layer_and_activation() -> None:
    torch.manual_seed(0)
    mlp = MLP(4, [3, 2])
    first = internals.perceptrons(mlp)[0]
    x = torch.randn(5, 4)
    expected = torch.relu(internals.perceptron_linear(first)(x))

    internals.set_perceptron_activation(first, nn.Identity())  # a module over a module
    assert isinstance(internals.perceptron_activation(first), nn.Identity)
    internals.set_perceptron_activation(first, torch.relu)  # a function over a registered module
    assert internals.perceptron_activation(first) is torch.relu
    torch.testing.assert_close(first(x), expected)

    replacement = nn.Linear(4, 3)
    internals.set_perceptron_linear(first, replacement)
    assert internals.perceptron_linear(first) is replacement
    assert "_mlp.0._linear.weight" in mlp.state_dict()
