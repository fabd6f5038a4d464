# A GLM-4.5-Air-shaped MoE (106B total, 12B active): 46 layers, the first dense; 128 routed
# experts of 1408 plus 1 shared, top-8; sigmoid router with expert bias; qkv bias; half rotary.
# Plan its memory: python train.py configs/100b.py dry_run=True
out_dir = "out/100b"
model = dict(vocab_size=151552, dim=4096, n_layers=46, n_heads=96, n_kv_heads=8, head_dim=128,
             num_experts=128, top_k=8, moe_inter_dim=1408, num_shared_experts=1,
             first_k_dense_replace=1, dense_inter_dim=10944, router="sigmoid", norm_topk_prob=True,
             routed_scaling_factor=1.0, n_group=1, topk_group=1, attention_bias=True,
             partial_rotary_factor=0.5, rope_theta=1_000_000.0, norm_eps=1e-5, max_seq_len=131072,
             hf_model_type="glm4_moe")
gpus_per_node = 8
ep = 8
activation_checkpoint = True
microbatch_tokens = 16384
max_prompt_tokens = 2048  # longer prompts are skipped; the engine plan sizes its KV cache by it
