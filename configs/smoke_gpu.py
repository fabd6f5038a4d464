# A one-node GPU smoke test of the cluster path, in minutes, no checkpoint needed: GLM-4.5-Air's
# widths (configs/100b.py) cut to 4 layers (the dense first one and 3 MoE), ep=8 over 8 GPUs,
# activation checkpointing, router replay, the native engine decoding on the policy's own shards,
# a DCP checkpoint every 2 steps, and the restart recipe (docs/gpus.md, "Runs that last days"). From random weights every
# group is all wrong; RL-ZVP trains on them, so each RL step takes num_minibatches optimizer steps (the replayed
# routes and the loss run; the run's last lines count them, as the dry run does):
#   torchrun --nproc_per_node=8 --max-restarts=3 train.py configs/smoke_gpu.py resume=auto
# Not run yet: no GPU has been lent to this project. Plan it: python train.py configs/smoke_gpu.py dry_run=True
from configs.qwen3_30b_a3b import *  # noqa: F403  the cluster settings: cuda, 8 GPUs a node, ep=8, checkpointing
from configs.tiny import bpe_merges  # noqa: F401  a tokenizer learned from the default reasoning-gym prompts
from importlib import import_module  # configs/100b.py's name is no identifier

out_dir = "out/smoke_gpu"
model = dict(import_module("configs.100b").model, n_layers=4, max_seq_len=4096)  # GLM-4.5-Air, 4 layers
sft_steps = 4
sft_batch_size = 64
rl_steps = 6
prompts_per_step = 64
group_size = 8  # 512 rollouts a step, 64 a GPU
max_prompt_tokens = 256
sampling = dict(max_new_tokens=256)
gen_batch_rows = 64
microbatch_tokens = 8192
filter = dict(probe_size=0, zero_variance="rl-zvp")  # random weights: every group all wrong, trained on by RL-ZVP
reward = dict(workers=2)
train_size = 10_000
eval_seed = 1_000_000
eval_size = 64
eval_every = 3
eval_batch_rows = 64
ckpt_every = 2
ckpt_keep = 2
