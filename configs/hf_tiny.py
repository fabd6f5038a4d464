# The real-checkpoint path on a laptop CPU: RL from a small HF checkpoint (hub layout, a real
# Qwen vocabulary and chat template) on GSM8K rows, graded by math-verify. The tests build such
# a checkpoint; so does `python tests/hf_checkpoint.py /tmp/hf_tiny [--family glm4_moe]`:
#   python train.py configs/hf_tiny.py init_hf=/tmp/hf_tiny \
#       train_data=../shared/data/gsm8k_train.jsonl eval_data=../shared/data/gsm8k_test.jsonl
# A random checkpoint answers nothing right: every group is all wrong, and RL-ZVP (below) still
# gives them token advantages, so the policy trains. Everything else is CHECKPOINT_DEFAULTS scaled down.
out_dir = "out/hf_tiny"
rl_steps = 4
prompts_per_step = 8
group_size = 8
max_prompt_tokens = 256
sampling = dict(max_new_tokens=64)
lr = 1e-5
num_minibatches = 1
microbatch_tokens = 4096
gen_batch_rows = 64
filter = dict(zero_variance="rl-zvp")
eval_every = 2
eval_size = 16
eval_samples = 2
eval_batch_rows = 64
ckpt_every = 0
