# A 1.9M-parameter MoE that learns one-digit arithmetic on a laptop CPU: a short SFT
# warm-up from random init, then RL. About 6 minutes on 2 idle cores.
out_dir = "out/tiny"
model = dict(vocab_size=336, dim=128, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=32,
             num_experts=8, top_k=2, moe_inter_dim=128, max_seq_len=256)
bpe_merges = 64  # the tokenizer's merges, learned from the training prompts

sft_steps = 350  # a cold start: format and partial skill (12-17% held-out accuracy), leaving RL room
rl_steps = 350
prompts_per_step = 64
group_size = 8
lr = 5e-5  # 1e-4 was noisier; 5e-4 collapsed (one step moved token probabilities by ~50%)

eval_size = 1000  # SE about 0.012 at 15% accuracy
eval_every = 50
