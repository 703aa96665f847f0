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


def test_rank_one_bond_all_dead_is_not_a_change() -> None:
    layer = TTLinear(16, 8, rank=[1, 1, 4], shape=((4, 4), (2, 4)))
    with torch.no_grad():
        layer.controllers[0].zero_()
    assert not layer.truncate_ranks(1e-2)
    assert layer.ranks == [1, 1, 4]


def test_dead_bond_counts_zero_size() -> None:
    layer = TTLinear(16, 8, rank=4, shape=((4, 4), (2, 4)))
    with torch.no_grad():
        layer.controllers[1].zero_()
    assert layer.live_ranks(1e-2) == [4, 0, 4]
    assert layer.tt_size(1e-2) == 0


def test_kept_indices_match_truncation() -> None:
    layer = TTLinear(16, 16, rank=4, shape=((4, 4), (4, 4)))
    with torch.no_grad():
        layer.controllers[1][[0, 2]] = 0.0
    kept = layer.kept_indices(1e-2)
    assert [k.tolist() for k in kept] == [[0, 1, 2, 3], [1, 3], [0, 1, 2, 3]]
    old = layer.controllers[1].detach().clone()
    layer.truncate_ranks(1e-2)
    torch.testing.assert_close(layer.controllers[1].detach(), old[kept[1]])


def test_train_tensors_are_the_cores_then_the_controllers_after_a_truncation() -> None:
    layer = TTLinear(16, 8, rank=4)
    assert all(a is b for a, b in zip(layer.train_tensors(), [*layer.cores, *layer.controllers], strict=True))
    with torch.no_grad():
        layer.controllers[0][:2] = 0.0  # two dead slices of the first bond
    assert layer.truncate_ranks(1e-6)  # replaces entries of both parameter lists
    now = layer.train_tensors()
    assert all(a is b for a, b in zip(now, [*layer.cores, *layer.controllers], strict=True))
    assert now[len(layer.cores)].shape[-1] == 2
