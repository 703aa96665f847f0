"""FBGEMM's CUDA kernels asked for before training: a clear error instead of a failed first step."""

from __future__ import annotations

import importlib.metadata

import fbgemm_gpu
import pytest
import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from comera_rec.integration import CompressionPolicy, TTMEmbeddingBagCollection, kernel_support
from comera_rec.integration.distributed import wrap_model
from comera_rec.integration.kernel_support import check_dense_table_kernels, dense_table_names, fbgemm_has_cuda_kernels
from tests.integration.helpers import policy, tables


def _installed(distribution: str) -> bool:
    try:
        importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


@pytest.mark.skipif(not _installed("fbgemm-gpu-cpu"), reason="the CPU package of fbgemm-gpu is not the one installed")
def test_the_cpu_package_has_no_cuda_kernels() -> None:
    # the package's own metadata, against the dispatcher's answer the check reads
    assert fbgemm_has_cuda_kernels() is False


def test_the_dispatcher_is_asked_when_the_package_does_not_say(monkeypatch) -> None:
    monkeypatch.setattr(fbgemm_gpu, "__variant__", "cuda", raising=False)  # a package that claims CUDA
    has_cuda = torch._C._dispatch_has_kernel_for_dispatch_key("fbgemm::get_infos_metadata", "CUDA")
    assert fbgemm_has_cuda_kernels() is has_cuda  # on this machine: registered for CPU only
    monkeypatch.setattr(kernel_support, "_TBE_PROBE_OPERATOR", "fbgemm::no_such_operator")
    assert fbgemm_has_cuda_kernels() is True  # an unknown operator blocks nothing


def test_a_torch_without_the_dispatcher_question_blocks_nothing(monkeypatch) -> None:
    monkeypatch.setattr(fbgemm_gpu, "__variant__", "cuda", raising=False)
    monkeypatch.delattr(torch._C, "_dispatch_has_kernel_for_dispatch_key")
    assert fbgemm_has_cuda_kernels() is True


def test_dense_table_names_are_the_uncompressed_tables() -> None:
    ttm = TTMEmbeddingBagCollection(tables(), policy())  # "c" (10 rows) stays dense
    assert dense_table_names(ttm) == ["c"]
    every_table_tt = CompressionPolicy(rank=4, min_rows_to_compress=0, min_params_to_compress=0, min_gain=0.0)
    assert dense_table_names(TTMEmbeddingBagCollection(tables(), every_table_tt)) == []
    plain = EmbeddingBagCollection(tables(), device=torch.device("meta"))
    assert dense_table_names(plain) == ["a", "b", "c", "d"]


def test_wrap_model_on_cuda_without_fbgemm_cuda_names_the_dense_tables(monkeypatch) -> None:
    monkeypatch.setattr(kernel_support, "fbgemm_has_cuda_kernels", lambda: False)
    ttm = TTMEmbeddingBagCollection(tables(), policy())
    with pytest.raises(RuntimeError, match=r"1 table\(s\) left uncompressed \(c\).*no CUDA kernels.*min_gain=0"):
        wrap_model(ttm, device="cuda")  # raised before anything moves to the (absent) GPU


def test_many_dense_tables_are_named_six_and_counted(monkeypatch) -> None:
    monkeypatch.setattr(kernel_support, "fbgemm_has_cuda_kernels", lambda: False)
    configs = [
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=4, num_embeddings=5, feature_names=[f"f{i}"]) for i in range(9)
    ]
    plain = EmbeddingBagCollection(configs, device=torch.device("meta"))
    with pytest.raises(RuntimeError, match=r"9 table\(s\) left uncompressed \(t0, t1, t2, t3, t4, t5 and 3 more\)"):
        check_dense_table_kernels(plain, torch.device("cuda:0"))


def test_nothing_is_raised_where_fbgemm_can_run_the_tables(monkeypatch) -> None:
    ttm = TTMEmbeddingBagCollection(tables(), policy())
    monkeypatch.setattr(kernel_support, "fbgemm_has_cuda_kernels", lambda: False)
    check_dense_table_kernels(ttm, "cpu")  # FBGEMM's CPU kernels are always there
    every_table_tt = CompressionPolicy(rank=4, min_rows_to_compress=0, min_params_to_compress=0, min_gain=0.0)
    check_dense_table_kernels(TTMEmbeddingBagCollection(tables(), every_table_tt), "cuda")  # no table for FBGEMM
    monkeypatch.setattr(kernel_support, "fbgemm_has_cuda_kernels", lambda: True)
    check_dense_table_kernels(ttm, "cuda")
