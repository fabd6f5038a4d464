# RL from GLM-4.5-Air (106B total, 12B active: 46 layers, the first dense; 128 routed experts of
# 1408 plus 1 shared, top-8; sigmoid router with expert bias; qkv bias; half rotary) on math:
#   torchrun --nnodes=4 --nproc_per_node=8 ... train.py configs/100b.py \
#       init_hf=/ckpt/GLM-4.5-Air train_data=/data/math_train.jsonl eval_data=/data/math500_test.jsonl
# Plan its memory first (no checkpoint needed): python train.py configs/100b.py dry_run=True
out_dir = "out/100b"
# the public config.json's shape, so the dry run plans it; init_hf must agree (checked field by field)
model = dict(vocab_size=151552, dim=4096, n_layers=46, n_heads=96, n_kv_heads=8, head_dim=128,
             num_experts=128, top_k=8, moe_inter_dim=1408, num_shared_experts=1,
             first_k_dense_replace=1, dense_inter_dim=10944, router="sigmoid", norm_topk_prob=True,
             routed_scaling_factor=1.0, n_group=1, topk_group=1, attention_bias=True,
             partial_rotary_factor=0.5, rope_theta=1_000_000.0, norm_eps=1e-5, max_seq_len=131072,
             qk_norm=False, hf_model_type="glm4_moe")
device = "cuda"
gpus_per_node = 8
ep = 8
activation_checkpoint = True
microbatch_tokens = 16384

# The recipe: CHECKPOINT_DEFAULTS (config.py; DAPO's optimizer, no SFT), written out here so the
# dry run without init_hf plans the same run, with longer completions for a reasoning model.
sft_steps = 0
rl_steps = 500
lr = 1e-6
lr_warmup_steps = 10
weight_decay = 0.1
prompts_per_step = 128
group_size = 16  # 2048 rollouts per step
max_prompt_tokens = 2048  # longer prompts are skipped; the engine plan sizes its KV cache by it
max_new_tokens = 8192
num_minibatches = 4
gen_batch_rows = 2048
probe_size = 4  # stage 2: 4 probes per prompt, the other 12 only where the probes disagree
reward_workers = 8  # math-verify scores while generation goes on
eval_every = 25
eval_size = 500  # all of MATH-500
eval_batch_rows = 2048
ckpt_every = 50
