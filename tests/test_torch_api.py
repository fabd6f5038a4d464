"""The project on the lent GPU machine's torch (2.11) as on this one's: a rollout phase (distributed.gathered)
ends with every FSDP2 unit resharded and no forward records left, also after an error mid-forward; and every
FSDP2 name and private torch module the project's code uses exists in torch 2.11, whose API tools/torch_api.json
holds (read from its wheel by tools/torch_api.py --refresh)."""
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


# ----------------------------------------------------------------------------- the names, against torch 2.11's

def torch_api():
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
    import torch_api
    return torch_api


def apis():
    api = torch_api()
    return api.load_snapshot(), api.installed_api()


def test_every_fsdp2_name_the_project_uses_exists_in_torch_2_11():
    api = torch_api()
    target, current = apis()
    problems, uses = api.check_project(target, current)
    assert not problems, "\n".join(problems)
    used = {u.rsplit(": ", 1)[1] for u in uses}
    # the rollout phase's calls (distributed.gathered, end_phase) are among those found and checked
    assert {".unshard", ".reshard", ".set_reshard_after_forward", "._post_forward_indices"} <= used, used


def test_the_fsdp2_check_finds_what_only_a_newer_torch_has():
    api = torch_api()
    target, current = apis()
    current = {**current, "torch": "newer"}
    current["classes"]["FSDPModule"]["methods"]["reset_iter_state"] = []  # 2.13's, whatever torch runs this test
    code = ("from torch.distributed.fsdp import fully_shard, no_such_name\n"
            "model.reset_iter_state()\n"
            "fully_shard(block, mesh=mesh, no_such_option=1)\n"
            "MixedPrecisionPolicy(param_dtype=torch.bfloat16, no_such_field=None)\n"
            "u.set_reshard_after_forward(False, recurse=False)\n"  # all there in 2.11
            "proc.wait(timeout=5)\n"  # a generic name: not FSDP2's call
            "from torch.utils._pytree import tree_flatten, no_such_function\n"  # a private module's names
            "import torch._no_such_private_module\n")
    problems, _ = api.check_source(code, "x.py", target, current)
    assert [p.split(": ", 1)[0] for p in problems] == ["x.py:1", "x.py:2", "x.py:3", "x.py:4", "x.py:7", "x.py:8"], \
        problems
    assert "no_such_name" in problems[0] and "reset_iter_state" in problems[1] and "no_such_function" in problems[4]


def test_the_snapshot_is_torch_2_11s_fsdp2_as_its_wheel_has_it():
    target, _ = apis()
    assert target["torch"] == "2.11.0" and target["wheel"].startswith("torch-2.11.0-cp312-")
    methods = target["classes"]["FSDPModule"]["methods"]
    assert {"unshard", "reshard", "set_reshard_after_forward", "set_requires_gradient_sync"} <= set(methods)
    assert "reset_iter_state" not in methods  # added after 2.11: why distributed.end_phase exists
    assert {"mesh", "mp_policy", "ignored_params", "reshard_after_forward"} <= set(target["functions"]["fully_shard"])
