"""Reward models and judges that cannot see what they score (issue 33, part 2).

a. A reward model whose tokenizer has ids past its embedding is refused at load, naming both numbers, before any
   work (it used to fail after generation with an IndexError, a device assert on CUDA).
b. A scorer whose context cannot hold the run's longest prompt and completion is refused before any work (dry runs
   too); a conversation still past a reward model's context is unscored (NaN), shapes nothing and is counted.
c. A step in which most of the scorer's outputs are unusable warns; UNUSABLE_STEPS of them in a row stop the run,
   naming reward.model and the counts.
d. A reward model whose forward is not finite stops naming its folder, how many scores and one pair, instead of
   later as non-finite advantages.
"""
import os
import sys
import warnings
from collections import Counter
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf_checkpoint import (IM_END, model_config, qwen_ranks_path, scorer_config_folder,  # noqa: E402
                           write_qwen_tokenizer)

import shaping  # noqa: E402
import train  # noqa: E402
from config import ConfigError, TrainConfig  # noqa: E402
from reward import RewardConfig  # noqa: E402
from shaping import rm_score  # noqa: E402
from reward_model import HFRewardModel, check_scorer_context, reward_model_for, scorer_model_config  # noqa: E402

transformers = pytest.importorskip("transformers", reason="a test-only dependency (requirements-dev.txt)")
needs_ranks = pytest.mark.skipif(qwen_ranks_path() is None, reason="needs dashscope's qwen.tiktoken (requirements-dev)")

NUM_RANKS = 1000  # Qwen's first ranks; its 9 specials follow: <|endoftext|> = 1000, <|im_start|> = 1001, ...
NUM_IDS = NUM_RANKS + 9
TINY = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "tiny.py")


def write_rm(path, *, rows: int = NUM_IDS, context: int = 512, huge: bool = False) -> str:
    """A random one-label Qwen3-MoE classifier (2 layers, width 64) saved by transformers with `rows` embedding rows
    and a `context`-token context, beside Qwen's first NUM_RANKS ranks and a ChatML template. huge: its final norm
    and score head at 1e30, finite weights whose fp32 forward overflows."""
    torch.manual_seed(0)
    config = model_config("qwen3_moe", vocab_size=rows, eos_token_id=IM_END - 151643 + NUM_RANKS,
                          pad_token_id=NUM_RANKS, num_labels=1, max_position_embeddings=context)
    model = transformers.AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
    if huge:
        with torch.no_grad():
            model.model.norm.weight.fill_(1e30)
            model.score.weight.fill_(1e30)
    model.save_pretrained(path)
    return write_qwen_tokenizer(str(path), num_ranks=NUM_RANKS)


# ----------------------------------------------------------------------------- a. tokenizer ids past the embedding

@needs_ranks
def test_a_reward_model_whose_tokenizer_outgrows_its_embedding_is_refused_at_load(tmp_path):
    """NUM_RANKS + 1 rows: ChatML's <|im_start|> (id 1001) has none, which the forward would index after generation."""
    path = write_rm(tmp_path / "rm", rows=NUM_RANKS + 1)
    with pytest.raises(ValueError, match=rf"reward model {path}: its tokenizer has {NUM_IDS} ids .* embedding only "
                                         rf"{NUM_RANKS + 1} rows .*resize_token_embeddings\({NUM_IDS}\)"):
        reward_model_for(RewardConfig(model=path))


# ----------------------------------------------------------------------------- b. a context too short

@pytest.mark.parametrize("judge", [False, True], ids=["rm", "judge"])
def test_a_scorer_whose_context_cannot_hold_the_runs_conversations_is_refused_before_any_work(judge, tmp_path):
    """configs/tiny.py's longest prompt and completion (and a judge's reply room) against a context one token short:
    the checks before any work (train.prepare, a dry run's too) stop naming the numbers and the fix; a context that
    holds them passes."""
    cfg = train.parse_args([TINY, "reward.judge_max_new_tokens=8"])
    need = cfg.prompt_limit() + cfg.sampling.max_new_tokens + (8 if judge else 0)
    arch = "Qwen3MoeForCausalLM" if judge else "Qwen3MoeForSequenceClassification"
    for context in (need - 1, need):
        folder = scorer_config_folder(tmp_path / f"scorer{context}", arch, context=context, vocab_size=NUM_IDS)
        args = [TINY, "dry_run=True", f"out_dir={tmp_path / 'out'}", "reward.judge_max_new_tokens=8",
                f"reward.model={'judge:' if judge else ''}{folder}"]
        if context < need:
            with pytest.raises(ConfigError, match=rf"its context is {context} tokens .* = {need}, .*lower "
                                                  rf"max_prompt_tokens or sampling.max_new_tokens"):
                train.main(train.parse_args(args))
        else:
            assert train.prepare(train.parse_args(args)).scorer_model.max_seq_len == need


def test_the_context_rule_counts_the_policys_prompt_limit_new_tokens_and_a_judges_reply():
    scorer = scorer_model_config(RewardConfig(model="stub"))
    assert scorer is None  # a stand-in has no context to check
    small = SimpleNamespace(max_seq_len=100)
    check_scorer_context(RewardConfig(model="stub"), small, prompt_tokens=60, completion_tokens=40)
    with pytest.raises(ValueError, match=r"reward.judge_max_new_tokens=1 = 101"):
        check_scorer_context(RewardConfig(model="stub-judge", judge_max_new_tokens=1), small, prompt_tokens=60,
                             completion_tokens=40)


@needs_ranks
def test_a_conversation_past_the_reward_models_context_is_unscored_and_shapes_nothing(tmp_path):
    """A 48-token context: a short pair is scored as alone, a long one is NaN (never forwarded), which rm_score leaves
    out of its group's mean and shapes 0; shape_rewards counts it (rm/unscored) and averages the scored."""
    rm = HFRewardModel(write_rm(tmp_path / "rm", context=48), batch_size=2)
    long = "many words " * 40
    scores = rm.score(["2 + 3?"] * 3, ["5", long, "4"])
    assert torch.isnan(torch.tensor(scores[1])) and scores[0] == pytest.approx(rm.score(["2 + 3?"], ["5"])[0])
    shaped = rm_score(torch.tensor(scores), scale=1.0)
    assert shaped[1] == 0 and torch.equal(shaped[[0, 2]], rm_score(torch.tensor(scores)[[0, 2]], scale=1.0))
    assert torch.equal(rm_score(torch.full((3,), float("nan")), scale=1.0), torch.zeros(3))
    _, m = shape([1.0, 0.0, 1.0], FixedRewardModel(scores))
    assert m["rm/unscored"] == 1 and m["rm/scored"] == 2 and m["rm/score_mean"] == pytest.approx(
        (scores[0] + scores[2]) / 2)


# ----------------------------------------------------------------------------- c. mostly unusable, step after step

class FixedRewardModel:
    """A reward model (reward.RewardModel) that returns these scores, whatever it is given."""
    sharded = False

    def __init__(self, scores):
        self.scores = scores

    def score(self, prompts, completions):
        return list(self.scores)


class TooSmallJudge:
    """A pairwise judge (reward.PairwiseJudge) that can fit no prompt: every verdict a counted tie, as
    reward_model.GenerativeJudge's with a context shorter than its prompt."""

    def __init__(self):
        self.counts = Counter(judged=0, unparsed=0, too_long=0)

    def compare(self, prompts, completions, references):
        self.counts.update(judged=len(prompts), too_long=len(prompts))
        return [0.5] * len(prompts)


def shape(correct: list[float], scorer, **reward) -> tuple[list[torch.Tensor], dict]:
    """shaping.shape_rewards of one group of len(correct) rollouts (completion "x" per token), scorer's outputs."""
    g = [SimpleNamespace(rollout=SimpleNamespace(text="x" * (i + 1), completion_ids=[1] * (i + 1)), local=True)
         for i in range(len(correct))]
    cfg = RewardConfig(model="stub", rm_weight=1.0, **reward)
    return shaping.shape_rewards([(SimpleNamespace(question="2 + 3?", answer="5"), g)], [torch.tensor(correct)],
                                 step=0, cfg=cfg, max_new_tokens=TrainConfig().sampling.max_new_tokens,
                                 scorer=scorer, queue=None)


@pytest.mark.parametrize("scorer", ["judge", "rm_only"])
def test_a_scorer_whose_outputs_are_mostly_unusable_warns_then_stops_the_run_naming_it(scorer):
    """A judge that fits no prompt (every verdict a tie), or under rm_only a reward model that scores nothing (the
    reward identically 0): steps 0 and 1 warn, step 2 (UNUSABLE_STEPS) raises naming reward.model and the counts."""
    assert shaping.UNUSABLE_STEPS == 3
    judge = TooSmallJudge()
    run = lambda: (shape([1.0, 0.0, 1.0, 0.0], judge) if scorer == "judge" else  # noqa: E731
                   shape([0.0] * 4, FixedRewardModel([float("nan")] * 4), rm_only=True))
    streak = shaping.UnusableStreak("/ckpt/rm")
    for step in range(2):
        rewards, m = run()
        if scorer == "rm_only":
            assert torch.equal(rewards[0], torch.zeros(4))
        with pytest.warns(UserWarning, match=rf"reward.model='/ckpt/rm': 4 of 4 outputs unusable at rl step {step}"):
            streak.observe(step, m)
    with pytest.raises(shaping.BlindScorerError, match=r"reward.model='/ckpt/rm': 4 of 4 outputs unusable at rl "
                                                        r"step 2 \((4 prompts too long|4 conversations past)"):
        streak.observe(2, run()[1])


@pytest.mark.parametrize("outputs", [[0.5, float("inf"), 0.1, 0.2], [0.5, float("-inf"), 0.1, 0.2]],
                         ids=["inf", "-inf"])
def test_any_scorers_infinite_score_stops_the_step_naming_it(outputs):
    """A reward model other than HFRewardModel (a user's implementation of the protocol) returning inf: shaping
    raises naming reward.model, the group and the count, where it would have shaped with tanh(inf) or NaN."""
    with pytest.raises(shaping.BlindScorerError, match=r"reward.model='stub': group 0 at rl step 0: 1 of 4 outputs "
                                                        r"infinite \(first -?inf\)"):
        shape([1.0, 0.0, 1.0, 0.0], FixedRewardModel(outputs))


def test_a_judge_whose_output_is_no_probability_stops_the_step_naming_it():
    judge = TooSmallJudge()
    judge.compare = lambda prompts, completions, references: [0.5, 1.5, float("nan"), 0.0]
    with pytest.raises(shaping.BlindScorerError, match=r"group 0 at rl step 0: 2 of 4 outputs not in \[0, 1\] "
                                                        r"\(first 1.5\)"):
        shape([1.0, 0.0, 1.0, 0.0], judge)


def test_a_usable_step_ends_the_streak_and_a_minority_unusable_is_quiet():
    streak = shaping.UnusableStreak("judge:/ckpt/lm")
    mostly = {"judge/judged": 8, "judge/too_long": 3, "judge/unparsed": 2}
    few = {"judge/judged": 8, "judge/too_long": 2, "judge/unparsed": 2}  # half: not most
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(10):  # two in a row at most, never three
            streak.observe(step, mostly if step % 3 else few)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        streak.observe(10, few)
        streak.observe(11, {})  # no scorer, or a stand-in that counts nothing
    assert streak.steps == 0


# ----------------------------------------------------------------------------- d. a forward that is not finite

@needs_ranks
def test_a_reward_model_whose_forward_overflows_stops_naming_it_the_count_and_a_pair(tmp_path):
    """Finite weights of 1e30 (its final norm and score head), an fp32 forward of inf or NaN: score raises
    FloatingPointError naming the folder, how many scores were not finite and the first pair's index and prompt."""
    path = write_rm(tmp_path / "rm", huge=True)
    rm = HFRewardModel(path, batch_size=2)
    with pytest.raises(FloatingPointError, match=rf"reward.model='{path}': 3 of 3 scores not finite \(.* for pair 0 "
                                                 rf"of the call, prompt '2 \+ 3\?'\)"):
        rm.score(["2 + 3?"] * 3, ["5", "4", "6"])
