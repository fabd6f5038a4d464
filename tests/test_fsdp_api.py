"""FSDP2 as this project calls it, on the lent GPU machine's torch (2.11) as on this one's: a rollout phase
(distributed.gathered) ends with every unit resharded and no forward records left, also after an error
mid-forward."""
import contextlib
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import distributed
from model import ModelConfig, Transformer

CFG = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, num_experts=4, top_k=2,
                  moe_inter_dim=16, max_seq_len=64)


@contextlib.contextmanager
def one_rank_policy():
    """A policy FSDP2-sharded on a one-rank gloo group (as bench/gpu.py and a one-GPU bf16 run shard it)."""
    from torch.distributed.device_mesh import init_device_mesh
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = Transformer(CFG)
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("fsdp",))
        yield distributed.parallelize(model, distributed.Meshes(fsdp=mesh))
    finally:
        dist.destroy_process_group()


def forward_records(model) -> int:
    """What FSDP2 records per forward for the next backward's prefetching: the units' post-forward order."""
    from torch.distributed.fsdp import FSDPModule
    root = model._get_fsdp_state()
    groups = [u._get_fsdp_state()._fsdp_param_group for u in model.modules() if isinstance(u, FSDPModule)]
    return len(root._comm_ctx.post_forward_order) + sum(len(g._post_forward_indices) for g in groups if g)


def training_loss_and_grads(model, tokens_BT):
    logits_BTV, _ = model(tokens_BT)
    loss = F.cross_entropy(logits_BTV.flatten(0, 1), tokens_BT.flatten())
    loss.backward()
    grads = {n: p.grad.full_tensor().clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return loss.item(), grads


def test_a_rollout_phase_ends_with_every_unit_resharded_and_no_forward_records():
    from torch.distributed.tensor import DTensor
    tokens_BT = torch.randint(CFG.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    with one_rank_policy() as model:
        want = training_loss_and_grads(model, tokens_BT)
        with torch.no_grad(), distributed.gathered(model):
            assert not any(isinstance(p, DTensor) for p in model.parameters())  # gathered: plain tensors
            for _ in range(3):
                model(tokens_BT)
            assert forward_records(model) > 0  # what end_phase has to clear
        assert forward_records(model) == 0
        assert all(isinstance(p, DTensor) for p in model.parameters())  # every unit back to its shard
        got = training_loss_and_grads(model, tokens_BT)
    assert got[0] == want[0]
    for name in want[1]:
        assert torch.equal(got[1][name], want[1][name]), name


def test_an_error_mid_forward_in_a_rollout_phase_leaves_the_policy_ready_to_train():
    from torch.distributed.tensor import DTensor
    tokens_BT = torch.randint(CFG.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    with one_rank_policy() as model:
        want = training_loss_and_grads(model, tokens_BT)
        with torch.no_grad(), distributed.gathered(model):  # the first phase's forward settles FSDP's root
            pass

        def fail(*_):
            raise RuntimeError("mid-forward")
        hook = model.layers[1].register_forward_pre_hook(fail)  # after layer 0's forward, inside the root's
        with pytest.raises(RuntimeError, match="mid-forward"), torch.no_grad(), distributed.gathered(model):
            model(tokens_BT)
        hook.remove()
        assert forward_records(model) == 0
        assert all(isinstance(p, DTensor) for p in model.parameters())
        assert model._get_fsdp_state()._state_ctx.iter_forward_root is None  # the next forward is a root's again
        got = training_loss_and_grads(model, tokens_BT)
    assert got[0] == want[0]
    for name in want[1]:
        assert torch.equal(got[1][name], want[1][name]), name

