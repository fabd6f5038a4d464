# Qwen3-30B-A3B (public HF config): 48 MoE layers, 128 experts of 768, top-8, 3.3B active.
# Plan its memory: python train.py configs/qwen3_30b_a3b.py dry_run=True
out_dir = "out/qwen3_30b_a3b"
model = dict(vocab_size=151936, dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, head_dim=128,
             num_experts=128, top_k=8, moe_inter_dim=768, dense_inter_dim=6144, router="softmax",
             norm_topk_prob=True, qk_norm=True, rope_theta=1_000_000.0, norm_eps=1e-6,
             max_seq_len=40960, hf_model_type="qwen3_moe")
gpus_per_node = 8
ep = 8  # experts over the 8 GPUs of a node; FSDP over everything
activation_checkpoint = True
microbatch_tokens = 16384
max_prompt_tokens = 2048  # longer prompts are skipped; the engine plan sizes its KV cache by it
