"""The SGLang path end to end on CPU: train.py with engine.name=sglang against tools/sglang_standin.py, a stand-in
server that answers sglang_engine.SGLangEngine's routes as sglang 0.5.21 does and generates with the native engine
on a small hub-layout checkpoint (tests/hf_checkpoint.py), taking the weight sync over a gloo group."""
import json
import os
import pathlib
import shutil
import subprocess
import sys
import time

import pytest

import train
from config import load_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
hf_checkpoint = pytest.importorskip("hf_checkpoint", reason="tests/hf_checkpoint.py builds the checkpoint")
if hf_checkpoint.qwen_ranks_path() is None:
    pytest.skip("needs Qwen's vocabulary from dashscope (requirements-dev.txt)", allow_module_level=True)
from test_hf_run import gsm8k_rows, write_jsonl  # noqa: E402  GSM8K-format rows and their file


@pytest.fixture(scope="module")
def standin(tmp_path_factory):
    """A stand-in server on a free port, serving a random Qwen3-MoE checkpoint in fp32: (url, checkpoint, the file
    its output goes to)."""
    root = tmp_path_factory.mktemp("standin")
    checkpoint = hf_checkpoint.build_checkpoint(str(root / "qwen3_moe"), "qwen3_moe")
    log = root / "standin.log"
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "tools", "sglang_standin.py"), "--checkpoint",
                                 checkpoint, "--port", "0"], stdout=f, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while " at http://" not in log.read_text():  # "sglang_standin: serving DIR at http://127.0.0.1:PORT"
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.2)
    yield log.read_text().split(" at ", 1)[1].split()[0], checkpoint, log
    proc.terminate()
    proc.wait(timeout=30)


def run_against(standin, tmp_path, name: str, steps: int, *extra: str, checkpoint: str | None = None) -> list[dict]:
    """train.main against the stand-in, with a large lr (each sync moves the weights visibly) and the recipes'
    continuous-batching settings (engine.slots, page_size: the native engine's, warned of and not read); its RL
    records."""
    url, served, _ = standin
    checkpoint = checkpoint or served
    out = tmp_path / name
    cfg = load_config("configs/hf_tiny.py", [
        f"init_hf={checkpoint}", f"train_data={write_jsonl(tmp_path / 'train.jsonl', gsm8k_rows(32))}",
        f"eval_data={write_jsonl(tmp_path / 'test.jsonl', gsm8k_rows(4, start=100))}", f"out_dir={out}",
        "engine.name=sglang", f"engine.sglang_urls={url}", "engine.slots=8", "engine.page_size=16",
        f"rl_steps={steps}", "prompts_per_step=4", "group_size=4", "sampling.max_new_tokens=12", "lr=1e-3",
        "lr_warmup_steps=0", f"eval_every={steps}", "eval_size=2", "eval_samples=1", *extra])
    train.main(cfg)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r["stage"] == "rl"]


def test_rl_steps_against_the_standin_sync_weights_and_replay_the_servers_logprobs_in_fp32(standin, tmp_path):
    rl = run_against(standin, tmp_path, "first", steps=3)
    assert len(rl) == 3 and not any(r.get("skipped_update") for r in rl)  # RL-ZVP: every step trains
    for r in rl:
        # the trainer's pi_old, routes replayed, is the server's logprob to fp32 rounding: the server generated with
        # the weights the trainer pushed after the step before (lr 1e-3 moves logprobs far more than 1e-5)
        assert r["mismatch/max_abs_logp"] < 1e-5, r["mismatch/max_abs_logp"]
        assert "engine/ids_past_tokenizer" in r  # SGLang samples padded rows too: counted, decoded to nothing
    # a second run reaches the same server: the update group the first formed is left and formed anew
    assert len(run_against(standin, tmp_path, "second", steps=1)) == 1
    # the stand-in's own account: the first sync before any rollout, then one per RL step, all of fp32 tensors
    syncs = [line for line in standin[2].read_text().splitlines() if "weight sync" in line]
    assert [line.split(":")[1] for line in syncs] == [f" weight sync {i}" for i in range(1, 7)], syncs
    assert all("['float32']" in line for line in syncs)


def test_a_run_with_tools_generates_its_rounds_through_the_standin(standin, tmp_path):
    """tools.enabled over SGLang: the served checkpoint's minimal template cannot render tool calls and is refused
    before any work, naming it; with Qwen3's own chat template (the served weights and vocabulary, the template
    of tests/chat_templates/qwen3.jinja) the prompts show the calculator and the rounds go to the server through a
    ToolEngine (a random model calls no tool here: the rounds' stream, masking and routes are
    tests/test_tool_rollout.py's)."""
    from config import ConfigError
    with pytest.raises(ConfigError, match="does not render an assistant message's tool_calls"):
        run_against(standin, tmp_path, "refused", 1, "tools.enabled=calculator")
    qwen3 = shutil.copytree(standin[1], tmp_path / "qwen3_template")
    config = json.loads((qwen3 / "tokenizer_config.json").read_text())
    config["chat_template"] = (pathlib.Path(ROOT) / "tests" / "chat_templates" / "qwen3.jinja").read_text()
    (qwen3 / "tokenizer_config.json").write_text(json.dumps(config))
    rl = run_against(standin, tmp_path, "tools", 1, "tools.enabled=calculator", checkpoint=str(qwen3))
    assert len(rl) == 1 and "engine/tool_calls" in rl[0] and "engine/ids_past_tokenizer" in rl[0]
