"""Names every doctest in the package may use without importing them."""

import pytest
import torch
from torch import nn


@pytest.fixture(autouse=True)
def _doctest_names(doctest_namespace: dict) -> None:
    from comera_rec import TTLinear, TTMEmbeddingBag

    doctest_namespace.update(torch=torch, nn=nn, TTLinear=TTLinear, TTMEmbeddingBag=TTMEmbeddingBag)
