# RL from Qwen3-30B-A3B on prompts without trusted gold answers, rewarded by a reward model alone:
#   torchrun --nnodes=4 --nproc_per_node=8 ... train.py configs/qwen3_30b_a3b_rm.py \
#       init_hf=/ckpt/Qwen3-30B-A3B reward.model=/ckpt/<a Qwen3-MoE or GLM-4.5 ForSequenceClassification folder> \
#       train_data=/data/prompts_train.jsonl eval_data=/data/prompts_test.jsonl
# (reward.model=judge:/ckpt/<a causal LM> judges each rollout against the row's answer instead.)
# The reward (reward.rm_only): rm_weight * tanh(score - the group's mean score) (reward.rm_score), in [-1, 1];
# the verifier's correctness is not read, so a group is one correctness class, adjust_rewards' ordering
# guarantee holds vacuously and the shaping is the reward. The files still need a format data.py reads (GSM8K,
# MATH or HumanEval rows): a row without a gold answer takes a placeholder ("#### 0"), graded and then ignored;
# a prompt-only format is not written yet. Eval accuracy is the verifier's, meaningful only on real gold answers.
# Plan it (the plan leaves the reward model's memory out): python train.py configs/qwen3_30b_a3b_rm.py dry_run=True
from configs.qwen3_30b_a3b import *  # noqa: F403  the model, cluster and optimizer recipe of RL on math

out_dir = "out/qwen3_30b_a3b_rm"
# stages 1 and 2 decide on the verifier's pass rates, which mean nothing here; stage 3 drops a group whose
# reward-model scores are all equal (no signal)
filter = dict(probe_size=0)
reward = dict(rm_only=True, rm_weight=1.0, rm_batch_size=16)
