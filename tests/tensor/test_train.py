import torch
from torch import nn

from comera_rec import TTLinear, TTMEmbeddingBag, parameter_groups, tensor_train_modules
from comera_rec.tensor.train import TensorTrainModule


class StackedTrain(TensorTrainModule):
    """Two stacked 3-core trains, to test truncation across a stack."""

    def __init__(self) -> None:
        super().__init__()
        self._init_train([(2, 1, 3, 4), (2, 4, 3, 4), (2, 4, 3, 1)], 1, [(2, 4), (2, 4)], None, torch.float64)
        self._init_cores_normal(1.0)

    def dense_num_parameters(self) -> int:
        return 2 * 27


def test_stacked_slice_is_cut_only_when_dead_in_every_train() -> None:
    m = StackedTrain()
    with torch.no_grad():
        m.controllers[0][0, 1] = 0.0  # dead in train 0 only
        m.controllers[0][:, 2] = 0.0  # dead in both
    assert m.live_ranks(1e-2) == [3, 4]
    assert m.truncate_ranks(1e-2)
    assert m.ranks == [3, 4]
    assert tuple(m.cores[0].shape) == (2, 1, 3, 3) and tuple(m.cores[1].shape) == (2, 3, 3, 4)
    assert m.tt_size() == 2 * (1 * 3 * 3 + 3 * 3 * 4 + 4 * 3 * 1)


def test_parameter_groups_split_cores_controllers_rest() -> None:
    model = nn.Sequential(TTLinear(16, 16, rank=2), nn.Linear(16, 4))
    model.append(TTMEmbeddingBag(50, 4, rank=2))
    groups = parameter_groups(model)
    assert len(groups["cores"]) == 4 + 2
    assert len(groups["controllers"]) == 3 + 1
    assert len(groups["other"]) == 1 + 2  # TTLinear bias, Linear weight and bias
    assert len(list(tensor_train_modules(model))) == 2
    total = sum(len(v) for v in groups.values())
    assert total == len(list(model.parameters()))
