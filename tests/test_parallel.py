"""Several CPU processes (gloo): one training step under FSDP, EP and expert FSDP equals the 1-process step."""
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from hf import load_hf, save_hf
from distributed import unwrapped
from model import ModelConfig, Transformer
from runs import free_port

CFG = dict(vocab_size=64, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=8, num_experts=4, top_k=2,
           moe_inter_dim=16, num_shared_experts=1, first_k_dense_replace=1, dense_inter_dim=24, router="sigmoid",
           n_group=2, topk_group=2, routed_scaling_factor=1.5, qk_norm=True, attention_bias=True,
           partial_rotary_factor=0.5, hf_model_type="glm4_moe", max_seq_len=64)
B, T = 4, 9


def batch():
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, 64, (B, T), generator=g), torch.randint(0, 64, (B, T), generator=g)


def step(model, tokens, targets):
    logits, _ = model(tokens)
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    loss.backward()
    return loss


def worker(rank, world, port, ep, ac, ckpt, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        import distributed
        meshes = distributed.build_meshes(world, ep)
        with torch.device("meta"):
            model = Transformer(ModelConfig(**CFG))
        distributed.parallelize(model, meshes, activation_checkpoint=ac)  # fp32 end to end
        model.to_empty(device="cpu")
        load_hf(ckpt, model, offsets=distributed.shard_offsets(model))  # each rank reads only its slice
        tokens, targets = batch()
        rows = slice(rank * B // world, (rank + 1) * B // world)
        loss = step(model, tokens[rows], targets[rows]).detach()
        dist.all_reduce(loss)  # each rank has the same token count: the mean of the means is the mean
        grads = {unwrapped(n): (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad)
                 for n, p in model.named_parameters()}
        if rank == 0:
            torch.save({"loss": loss / world, "grads": grads}, out)
    finally:
        dist.destroy_process_group()



@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**CFG))
    with torch.no_grad():
        for b in model.layers:
            if b.is_moe:
                b.mlp.expert_bias.normal_(0, 0.05)
    ckpt = str(tmp_path_factory.mktemp("ckpt"))
    save_hf(model, ckpt)
    loss = step(model, *batch())
    return ckpt, loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("world, ep, ac", [(2, 1, False), (2, 2, False), (2, 2, True),
                                           pytest.param(4, 2, False, marks=pytest.mark.slow)],  # 4 processes: slow
                         ids=["fsdp2", "fsdp2_ep2", "fsdp2_ep2_ac", "fsdp4_ep2_efsdp2"])
def test_several_process_step_equals_one_process_step(reference, tmp_path, world, ep, ac):
    """FSDP over all ranks, the experts split over ep of them; with 4 ranks and ep = 2 each expert is also
    FSDP-sharded over 2 ranks (efsdp), whose gradient reduction must still give the 1-process gradient."""
    ckpt, want_loss, want_grads = reference
    out = str(tmp_path / "result.pt")
    mp.start_processes(worker, args=(world, free_port(), ep, ac, ckpt, out), nprocs=world, join=True,
                       start_method="spawn")
    got = torch.load(out)
    assert abs(float(got["loss"] - want_loss)) <= 1e-6
    assert set(got["grads"]) == set(want_grads)
    for name, g in want_grads.items():
        assert (got["grads"][name] - g).abs().max() <= 1e-5, name
