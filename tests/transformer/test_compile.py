"""``torch.compile`` over the compressed encoder: the eager logits and gradients, and no
graph breaks but the two the lookups need: the id check reads its bounds on the host (to
name a bad id), and the de-duplication's ``unique`` has a data-dependent shape."""

import torch
from torch._dynamo.utils import counters

from comera_rec.transformer.config import EncoderConfig
from comera_rec.transformer.model import SequenceClassifier


def test_compiled_classifier_matches_eager() -> None:
    torch._dynamo.reset()
    torch.manual_seed(0)
    cfg = EncoderConfig(
        vocab_size=1000, num_layers=2, d_model=32, num_heads=4, d_ff=64, rank=4, embedding_rank=4, dropout=0.0
    )
    model = SequenceClassifier(cfg)
    ids = torch.randint(0, 1000, (2, 7))
    want = model(ids)
    want_grads = torch.autograd.grad(want.sum(), list(model.parameters()))
    counters.clear()
    try:
        # aot_eager: dynamo and AOT autograd as inductor runs them, without compiling C++
        got = torch.compile(model, backend="aot_eager")(ids)
        got_grads = torch.autograd.grad(got.sum(), list(model.parameters()))
        reasons = list(counters["graph_break"])
        inherent = ("Tensor.item()", "Dynamic shape operator")
        assert reasons and all(any(kind in reason for kind in inherent) for reason in reasons), reasons
    finally:
        torch._dynamo.reset()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
