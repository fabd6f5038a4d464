# The tiny MoE learns to use a calculator: arithmetic it cannot do in its head (3-digit operands, 3-4 terms,
# + - *), a short SFT on demonstrations of which half call the calculator (tools.sft_call_share), then RL with
# the calculator answering each call between turns (tool_rollout.ToolEngine).
out_dir = "out/tiny_tools"
model = dict(vocab_size=512, dim=128, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=32,
             num_experts=8, top_k=2, moe_inter_dim=128, max_seq_len=256)
bpe_merges = 200
tasks = [("basic_arithmetic", dict(min_terms=3, max_terms=4, min_digits=3, max_digits=3,
                                   operators=("+", "-", "*")))]  # parentheses allowed: without, the gold
# answers of reasoning-gym 0.1.x follow a bracketing the question does not show ("86 + 369 * 855" -> 389025)
tools = dict(enabled=["calculator"], max_turns=2)
sampling = dict(max_new_tokens=96)

sft_steps = 300
rl_steps = 100
prompts_per_step = 32
group_size = 8
lr = 5e-5

eval_size = 1000
eval_every = 50
