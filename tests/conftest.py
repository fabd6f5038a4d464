import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from model import ModelConfig  # noqa: E402


@pytest.fixture
def tiny_cfg() -> ModelConfig:
    """A model small enough for exact fp32 checks in milliseconds."""
    return ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                       num_experts=8, top_k=2, moe_inter_dim=16, max_seq_len=64)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
