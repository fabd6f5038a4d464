# RL from GLM-4.5-Air (106B total, 12B active: 46 layers, the first dense; 128 routed experts of
# 1408 plus 1 shared, top-8; sigmoid router with expert bias; qkv bias; half rotary) on math:
#   torchrun --nnodes=4 --nproc_per_node=8 ... train.py configs/100b.py \
#       init_hf=/ckpt/GLM-4.5-Air train_data=/data/math_train.jsonl eval_data=/data/math500_test.jsonl
# Plan its memory first (no checkpoint needed): python train.py configs/100b.py dry_run=True
from configs.qwen3_30b_a3b import *  # noqa: F403  the same recipe (parallelism, lengths, optimizer, filter)

out_dir = "out/100b"
# the public config.json's shape, so the dry run plans it; init_hf must agree (checked field by field)
model = dict(vocab_size=151552, dim=4096, n_layers=46, n_heads=96, n_kv_heads=8, head_dim=128,
             num_experts=128, top_k=8, moe_inter_dim=1408, num_shared_experts=1,
             first_k_dense_replace=1, dense_inter_dim=10944, router="sigmoid", norm_topk_prob=True,
             routed_scaling_factor=1.0, n_group=1, topk_group=1, attention_bias=True,
             partial_rotary_factor=0.5, rope_theta=1_000_000.0, norm_eps=1e-5, max_seq_len=131072,
             qk_norm=False, hf_model_type="glm4_moe")
gen_batch_rows = 16  # rows per generate call: its static KV cache holds them at full length (1.9 GiB a row here)
engine = dict(slots=48, kv_tokens=16 * 10240)  # 48 rows at once in the pages of 16 full-length rows (28.7 GiB)
eval_batch_rows = 16
