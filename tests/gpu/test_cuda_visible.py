"""GPU tests run only where CUDA is available (skipped elsewhere by conftest)."""

from __future__ import annotations

import pytest


@pytest.mark.gpu
def test_gpu_torch_sees_a_cuda_device() -> None:
    import torch

    assert torch.cuda.device_count() >= 1
    x = torch.ones(4, device="cuda")
    assert float((x * 2).sum()) == 8.0
