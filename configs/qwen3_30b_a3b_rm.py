# RL from Qwen3-30B-A3B on prompts without trusted gold answers, rewarded by a reward model alone:
#   torchrun --nnodes=4 --nproc_per_node=8 ... train.py configs/qwen3_30b_a3b_rm.py \
#       init_hf=/ckpt/Qwen3-30B-A3B reward.model=/ckpt/<a Qwen3-MoE or GLM-4.5 ForSequenceClassification folder> \
#       train_data=/data/prompts_train.jsonl eval_data=/data/prompts_test.jsonl
# (reward.model=judge:/ckpt/<a causal LM> reward.rm_shard=False judges each rollout against the row's answer instead.)
# The reward (reward.rm_only): rm_weight * tanh(score - the group's mean score) (shaping.rm_score), in [-1, 1];
# the verifier's correctness is not read, so a group is one correctness class, adjust_rewards' ordering
# guarantee holds vacuously and the shaping is the reward. The data is prompt-only: JSONL (or parquet) rows of
# {"prompt": "..."} and no answer field (data.py's format 4; refused unless reward.rm_only with a scalar reward
# model, which a judge is not). Eval accuracy is the verifier's: 0 on prompt-only rows, meaningful only on an
# eval_data file with gold answers (GSM8K, MATH or HumanEval rows), which a prompt-only train_data allows.
# Plan it (the reward model's weights and scoring peak are a line of it):
#   python train.py configs/qwen3_30b_a3b_rm.py dry_run=True reward.model=/ckpt/<the reward model>
from configs.qwen3_30b_a3b import *  # noqa: F403  the model, cluster and optimizer recipe of RL on math

out_dir = "out/qwen3_30b_a3b_rm"
# stages 1 and 2 decide on the verifier's pass rates, which mean nothing here; stage 3 drops a group whose
# reward-model scores are all equal (no signal)
filter = dict(probe_size=0)
reward = dict(rm_only=True, rm_weight=1.0, rm_batch_size=16, rm_shard=True)  # the RM FSDP-sharded like the policy
