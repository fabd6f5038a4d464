# RL from Qwen3-30B-A3B (48 MoE layers, 128 experts of 768, top-8, 3.3B active) on math:
#   torchrun --nnodes=4 --nproc_per_node=8 ... train.py configs/qwen3_30b_a3b.py \
#       init_hf=/ckpt/Qwen3-30B-A3B train_data=/data/math_train.jsonl eval_data=/data/math500_test.jsonl
# Plan its memory first (no checkpoint needed): python train.py configs/qwen3_30b_a3b.py dry_run=True
out_dir = "out/qwen3_30b_a3b"
# the public config.json's shape, so the dry run plans it; init_hf must agree (checked field by field)
model = dict(vocab_size=151936, dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, head_dim=128,
             num_experts=128, top_k=8, moe_inter_dim=768, dense_inter_dim=6144, router="softmax",
             norm_topk_prob=True, qk_norm=True, rope_theta=1_000_000.0, norm_eps=1e-6,
             max_seq_len=40960, hf_model_type="qwen3_moe")
device = "cuda"
gpus_per_node = 8
ep = 8  # experts over the 8 GPUs of a node; FSDP over everything
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
sampling = dict(max_new_tokens=8192)
num_minibatches = 4
gen_batch_rows = 32  # rows per generate call: its static KV cache holds them at full length (1 GiB a row here)
# continuous batching over a paged KV cache: 96 rows decode at once in the pages of 32 full-length rows (320 Ki
# columns, 30 GiB by the plan), a stopped row's slot and pages taken by the next; a step logs the most its rows
# held (engine/kv_live_bytes) and rows preempted for pages (engine/preemptions): raise kv_tokens or lower slots
# if they preempt often. slots=0 goes back to static calls of gen_batch_rows
engine = dict(slots=96, kv_tokens=32 * 10240)
filter = dict(probe_size=4)  # stage 2: 4 probes per prompt, the other 12 only where the probes disagree
reward = dict(workers=8)  # math-verify scores while generation goes on
eval_every = 25
eval_size = 500  # all of MATH-500
eval_batch_rows = 32
ckpt_every = 50
