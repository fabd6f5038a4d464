"""RL from a Hugging Face checkpoint: train.py with init_hf, train_data and eval_data, end to end.

Each test builds a small random checkpoint with transformers (hub layout, Qwen's real
vocabulary and a ChatML template: tests/hf_checkpoint.py), runs a few RL steps on GSM8K-format
rows, and loads what the run saved in transformers.
"""
import json
import shutil

import pytest
import torch

import data
import train
from config import load_config
from tokenizer import load_hf_tokenizer

transformers = pytest.importorskip("transformers", reason="transformers is a test-only dependency (requirements-dev.txt)")
hf_checkpoint = pytest.importorskip("hf_checkpoint", reason="tests/hf_checkpoint.py builds the checkpoints")
if hf_checkpoint.qwen_ranks_path() is None:
    pytest.skip("needs Qwen's vocabulary from dashscope (requirements-dev.txt)", allow_module_level=True)


def gsm8k_rows(n: int, start: int = 0) -> list[dict]:
    """GSM8K-format rows: a word problem, a worked answer ending in '#### <number>'."""
    rows = []
    for i in range(start, start + n):
        a, b = 3 + i % 7, 10 + 3 * i
        rows.append({"question": f"Sam has {a} boxes with {b} pens in each. How many pens does Sam have?",
                     "answer": f"Each box holds {b} pens, so {a} boxes hold {a}*{b}=<<{a}*{b}={a * b}>>{a * b}.\n"
                               f"#### {a * b:,}"})
    return rows


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {f: hf_checkpoint.build_checkpoint(str(root / f), f) for f in hf_checkpoint.FAMILIES}


# GLM-4.5 slow: its loading and saving are tested apart (test_hf.py); the whole run once, on Qwen3-MoE, by default
@pytest.mark.parametrize("family", [f if f == "qwen3_moe" else pytest.param(f, marks=pytest.mark.slow)
                                    for f in hf_checkpoint.FAMILIES])
def test_rl_from_an_hf_checkpoint_on_gsm8k_rows_saves_a_model_transformers_loads(tmp_path, checkpoints, family,
                                                                             monkeypatch):
    graded = []

    def math_reward(completion, gold):  # the verifier MathTask calls: count it, then grade with math-verify
        graded.append(gold)
        return real(completion, gold)
    real = data.math_reward
    monkeypatch.setattr(data, "math_reward", math_reward)
    out = tmp_path / "out"
    cfg = load_config("configs/hf_tiny.py", [
        f"init_hf={checkpoints[family]}", f"train_data={write_jsonl(tmp_path / 'train.jsonl', gsm8k_rows(32))}",
        f"eval_data={write_jsonl(tmp_path / 'test.jsonl', gsm8k_rows(8, start=100))}", f"out_dir={out}",
        "rl_steps=2", "prompts_per_step=4", "group_size=4", "sampling.max_new_tokens=8", "eval_every=2", "eval_size=4",
        "eval_samples=1", "ckpt_every=2"])
    # the checkpoint sets the model and CHECKPOINT_DEFAULTS what the config file leaves unset
    assert cfg.model.hf_model_type == family and cfg.model.vocab_size == hf_checkpoint.QWEN_VOCAB
    assert cfg.sft_steps == 0 and cfg.weight_decay == 0.1
    train.main(cfg)

    # rewards came from math-verify's grading of the gold answers (commas dropped), rollouts and evals
    assert graded and set(graded) <= {str(r["answer"].rsplit("#### ", 1)[1]).replace(",", "")
                                      for r in gsm8k_rows(32) + gsm8k_rows(8, start=100)}
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in records if r["stage"] == "rl"]
    assert len(rl) == 2 and all(r["reward/errors"] == 0 for r in rl)
    assert not any(r.get("skipped_update") for r in rl)  # RL-ZVP: all-wrong groups train too

    # what the run saved loads in transformers, with the run's policy's logits (its last checkpoint's weights)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ours = train.build_model(cfg)
    train.read_checkpoint(str(out / "ckpt" / "step_00000002"), ours, train.rl_optimizer(ours, cfg))
    ids = torch.tensor([load_hf_tokenizer(str(out)).prompt_ids("What is 12 times 3?")])
    with torch.no_grad():
        torch.testing.assert_close(ours(ids)[0], theirs(ids).logits, rtol=1e-4, atol=1e-4)
    # and the tokenizer round-trips: transformers renders the same prompt ids
    tok = transformers.AutoTokenizer.from_pretrained(out)
    rendered = tok.apply_chat_template([{"role": "user", "content": "What is 12 times 3?"}],
                                       add_generation_prompt=True, tokenize=True)
    assert list(getattr(rendered, "input_ids", rendered)) == ids[0].tolist()


def test_a_model_field_that_disagrees_with_the_checkpoint_is_refused(checkpoints):
    with pytest.raises(ValueError, match=r"model\.dim=32 disagrees with .*config\.json \(64\)"):
        load_config("configs/hf_tiny.py", [f"init_hf={checkpoints['qwen3_moe']}", "model.dim=32"])
    # a shorter context is the same function on the positions it allows (with lengths that fit in it:
    # CHECKPOINT_DEFAULTS' sampling.max_new_tokens=4096 and max_prompt_tokens=1024 would not)
    assert load_config(None, [f"init_hf={checkpoints['qwen3_moe']}", "model.max_seq_len=128",
                              "sampling.max_new_tokens=64", "max_prompt_tokens=0"]).model.max_seq_len == 128
    with pytest.raises(ValueError, match=r"model\.max_seq_len=1024: at most the checkpoint's 512"):
        load_config(None, [f"init_hf={checkpoints['qwen3_moe']}", "model.max_seq_len=1024"])


def test_a_bad_data_row_or_an_incomplete_checkpoint_is_refused_before_any_work(tmp_path, checkpoints):
    good = write_jsonl(tmp_path / "good.jsonl", gsm8k_rows(4))
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(gsm8k_rows(1)[0]) + "\n{not json\n")
    cfg = load_config("configs/hf_tiny.py", [f"init_hf={checkpoints['qwen3_moe']}", f"train_data={bad}",
                                             f"eval_data={good}"])
    with pytest.raises(ValueError, match=r"bad\.jsonl, line 2"):
        train.prepare(cfg)
    empty = tmp_path / "no_tokenizer"
    empty.mkdir()
    for name in ("config.json", "model.safetensors"):  # the weights without the tokenizer files
        shutil.copy(f"{checkpoints['qwen3_moe']}/{name}", empty / name)
    cfg = load_config("configs/hf_tiny.py", [f"init_hf={empty}", f"train_data={good}", f"eval_data={good}"])
    with pytest.raises(ValueError, match="holds no tokenizer.json"):
        train.prepare(cfg)
