# A 0.47B-parameter MoE (77M active per token) for one GPU: 12 layers, 32 experts of 512,
# top-4, softmax router; RL on multi-step arithmetic (the tiny config's task, harder).
# About 8 GB of weights, gradients and AdamW state, so rollouts and training share one
# 80-141 GB GPU. Plan its memory: python train.py configs/small.py dry_run=True
out_dir = "out/small"
device = "cuda"
gpus_per_node = 1
model = dict(vocab_size=1024, dim=768, n_layers=12, n_heads=12, n_kv_heads=4, head_dim=64,
             num_experts=32, top_k=4, moe_inter_dim=512, router="softmax", norm_topk_prob=True,
             qk_norm=True, max_seq_len=512)
bpe_merges = 512  # leaves room in the vocabulary for the specials
tasks = [
    ("chain_sum", dict(min_terms=2, max_terms=6, min_digits=1, max_digits=3)),
    ("basic_arithmetic", dict(min_terms=2, max_terms=5, min_digits=1, max_digits=2, operators=("+", "-", "*"),
                              allow_parentheses=True, allow_negation=False)),
]
train_size = 100_000
eval_seed = 10_000_000  # beyond train_seed + train_size
eval_size = 2000

sft_steps = 1000
sft_batch_size = 256
sft_lr = 1e-3
rl_steps = 1000
prompts_per_step = 256
group_size = 16  # 4096 rollouts per step
sampling = dict(max_new_tokens=64)
gen_batch_rows = 4096  # a whole step in one engine call: decode is latency-bound at this size
eval_batch_rows = 2048  # the greedy eval prefills 2048 distinct prompts per call: 37 GB at its peak, 75 at 4096
lr = 1e-5
num_minibatches = 4
microbatch_tokens = 32768
loss = dict(tis_cap=2.0)  # engine in its own precision and batch: correct the small train-inference gap
