"""Bad inputs, as a new user would give them (issue 18): each is refused before any work, by one
error line that names the field or the file it comes from.

One table, BAD: a row is what the user sets (command-line overrides, a config file's text, a data
file's bad row, a pass-rate file, a corrupt checkpoint folder, a bad tensor to a public function)
and the words the error must hold: the field with its value (`group_size=1:`), or the file (and
line). A run's row goes through the entry point train.py's __main__ uses (parse_args, which checks every
field's rule and config.RELATIONS, then train.main, whose first act is train.prepare, reading and
checking every file) with train.run replaced by a tripwire, so a row that is not refused fails at
once instead of training; three rows run `python train.py` itself.
"""

import dataclasses
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

import config
import espo
import filter as zve
import reward
import shaping
import train
import trainer
from config import load_config, parse_args
from espo import LossConfig
from hf import save_hf
from model import Transformer, check_route_layout
from engines.sglang_server import check_routes
from rules import check_fields
from runs import MICRO
from tokenizer import build_tokenizer, demo_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG_ERRORS = (ValueError, FileNotFoundError)  # what train.py's __main__ prints as `config error: ...`
EVAL_SIZE = 24  # MICRO's
# room for a GSM8K prompt in the checkpoint's byte-level tokenizer; init_from holds the model to every field of
# the checkpoint's config.json but this one (positions only bound where the same function is read)
CKPT_CONTEXT = "model.max_seq_len=256"
# room for a GSM8K prompt in the demo BPE the micro config learns (its 64 positions leave 56 tokens, too few):
# train.prepare learns that tokenizer and checks eval_size held-out prompts fit before any work
DATA_CONTEXT = "model.max_seq_len=128"


def gsm8k(i: int, words: int = 0) -> dict:
    """A GSM8K row whose question is unique to i (and `words` words longer)."""
    return {"question": f"What is {i} plus {i}?" + " and" * words, "answer": f"{i} + {i} = {2 * i}\n#### {2 * i}"}


def jsonl(rows) -> str:
    return "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows)


GOOD_TRAIN = [gsm8k(i) for i in range(40)]
GOOD_EVAL = [gsm8k(i) for i in range(100, 130)]


@dataclasses.dataclass
class Workspace:
    """One row's folder (tmp) beside the shared good inputs (base): the micro config, data files, a checkpoint."""
    base: str
    tmp: str

    def file(self, name: str, text: str | bytes) -> str:
        path = os.path.join(self.tmp, name)
        with open(path, "wb" if isinstance(text, bytes) else "w") as f:
            f.write(text)
        return path

    def argv(self, *overrides, config_text: str = "") -> list[str]:
        """train.py's argv: the micro config (plus config_text), out_dir in tmp, then the overrides."""
        path = self.file("cfg.py", MICRO + config_text) if config_text else os.path.join(self.base, "micro.py")
        return [path, f"out_dir={os.path.join(self.tmp, 'run')}", *overrides]

    def data(self, name: str = "train.jsonl", text: str | bytes = "", eval_text: str | None = None) -> list[str]:
        """Overrides that train on file `name` holding text, held out on the good eval file (or eval_text)."""
        train_path = self.file(name, text)
        eval_path = (self.file("eval.jsonl", eval_text) if eval_text is not None
                     else os.path.join(self.base, "eval.jsonl"))
        return [f"train_data={train_path}", f"eval_data={eval_path}"]

    def checkpoint(self, corrupt) -> str:
        """A copy of the good checkpoint folder after corrupt(folder)."""
        path = os.path.join(self.tmp, "ckpt")
        shutil.copytree(os.path.join(self.base, "ckpt"), path)
        corrupt(path)
        return path


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> str:
    """The good inputs every row spoils one thing of: the micro config, two GSM8K files and a checkpoint
    folder of the micro model (hf.save_hf, and the demo tokenizer's files) that init_from loads."""
    root = tmp_path_factory.mktemp("good")
    (root / "micro.py").write_text(MICRO)
    (root / "train.jsonl").write_text(jsonl(GOOD_TRAIN))
    (root / "eval.jsonl").write_text(jsonl(GOOD_EVAL))
    cfg = load_config(str(root / "micro.py"), [])
    save_hf(Transformer(cfg.model), str(root / "ckpt"))
    demo_tokenizer(build_tokenizer(cfg.model.vocab_size)).save(str(root / "ckpt"))
    return str(root)


@pytest.fixture
def ws(base, tmp_path) -> Workspace:
    return Workspace(base, str(tmp_path))


def edit_json(file: str, **changes):
    def corrupt(path):
        with open(os.path.join(path, file)) as f:
            obj = json.load(f)
        with open(os.path.join(path, file), "w") as f:
            json.dump({**obj, **changes}, f)
    return corrupt


def write(file: str, text: str | bytes):
    def corrupt(path):
        with open(os.path.join(path, file), "wb" if isinstance(text, bytes) else "w") as f:
            f.write(text)
    return corrupt


def remove(file: str):
    return lambda path: os.remove(os.path.join(path, file))


def bigger_tokenizer(path):
    demo_tokenizer(build_tokenizer(400)).save(path)  # 400 ids for the micro model's 320 embedding rows


def no_eos(path):
    edit_json("tokenizer_config.json", eos_token=None, pad_token=None)(path)
    os.remove(os.path.join(path, "generation_config.json"))


# Row constructors: each returns pytest.param(kind, payload, names); a "run" payload maps a Workspace
# to (argv, environment), a "call" payload raises, a "cli" payload is a run through `python train.py`.

def over(*overrides, names, id, env=None):
    return pytest.param("run", lambda w: (w.argv(*overrides), env or {}), names, id=id)


def conf(text, *, names, id):
    return pytest.param("run", lambda w: (w.argv(config_text="\n" + text + "\n"), {}), names, id=id)


def data(*, names, id, name="train.jsonl", text="", eval_text=None, more=()):
    return pytest.param("run", lambda w: (w.argv(*w.data(name, text, eval_text), DATA_CONTEXT, *more), {}), names,
                        id=id)


def rates(text, *, names, id, more=("filter.skip_prob=0.5",)):
    return pytest.param("run", lambda w: (w.argv(f"filter.pass_rate_file={w.file('rates.jsonl', text)}", *more), {}),
                        names, id=id)


def ckpt(corrupt, *, names, id, key="init_from", more=(), data_rows=None):
    def payload(w):
        extra = w.data(text=jsonl(GOOD_TRAIN), eval_text=jsonl(data_rows)) if data_rows else []
        return w.argv(f"{key}={w.checkpoint(corrupt)}", CKPT_CONTEXT, *extra, *more), {}
    return pytest.param("run", payload, names, id=id)


def call(fn, *, names, id):
    return pytest.param("call", fn, names, id=id)


def cli(*overrides, names, id, config_text=""):
    return pytest.param("cli", (overrides, config_text), names, id=id)


LOSS = LossConfig(type="grpo")
Z_BT, ONES_BT = torch.zeros(2, 3), torch.ones(2, 3)

BAD = [
    # ------------------------------------------------ command-line values: one field's type, range or names
    over("group_size=1", names=("group_size=1:",), id="group_size=1"),
    over("group_size=0", names=("group_size=0:",), id="group_size=0"),
    over("group_size=8.0", names=("group_size='8.0'",), id="group_size-float-spelling"),
    over("prompts_per_step=0", names=("prompts_per_step=0:",), id="prompts_per_step=0"),
    over("sft_batch_size=0", names=("sft_batch_size=0:",), id="sft_batch_size=0"),
    over("eval_every=0", names=("eval_every=0:",), id="eval_every=0"),
    over("eval_size=0", names=("eval_size=0:",), id="eval_size=0"),
    over("eval_samples=0", names=("eval_samples=0:",), id="eval_samples=0"),
    over("eval_batch_rows=0", names=("eval_batch_rows=0:",), id="eval_batch_rows=0"),
    over("gen_batch_rows=0", names=("gen_batch_rows=0:",), id="gen_batch_rows=0"),
    over("microbatch_tokens=0", names=("microbatch_tokens=0:",), id="microbatch_tokens=0"),
    over("num_minibatches=0", names=("num_minibatches=0:",), id="num_minibatches=0"),
    over("sampling.max_new_tokens=0", names=("sampling.max_new_tokens=0:",), id="max_new_tokens=0"),
    over("sampling.top_p=0", names=("sampling.top_p=0.0:",), id="top_p=0"),
    over("sampling.top_p=1.5", names=("sampling.top_p=1.5:",), id="top_p=1.5"),
    over("sampling.top_k=-1", names=("sampling.top_k=-1:",), id="top_k=-1"),
    over("sampling.top_k=100000", names=("sampling.top_k=100000:", "model.vocab_size=320"), id="top_k-above-vocab"),
    over("sampling.temperature=0", names=("sampling.temperature=0.0:",), id="temperature=0"),
    over("sampling.temperature=0", "filter.zero_variance=rl-zvp", names=("sampling.temperature=0.0:",),
         id="temperature=0-rl-zvp"),
    over("sampling.temperature=-1", names=("sampling.temperature=-1.0:",), id="temperature<0"),
    over("sampling.temperature=inf", names=("sampling.temperature=inf:",), id="temperature=inf"),
    over("grad_clip=-1", names=("grad_clip=-1.0:",), id="grad_clip<0"),
    over("grad_clip=0", names=("grad_clip=0.0:",), id="grad_clip=0"),
    over("loss.kl_coef=-0.1", names=("loss.kl_coef=-0.1:",), id="kl_coef<0"),
    over("lr=nan", names=("lr=nan:",), id="lr=nan"),
    over("lr=fast", names=("lr='fast'",), id="lr-not-a-number"),
    over("sft_lr=-1", names=("sft_lr=-1.0:",), id="sft_lr<0"),
    over("weight_decay=-0.1", names=("weight_decay=-0.1:",), id="weight_decay<0"),
    over("loss.type=ppo", names=("loss.type='ppo':",), id="loss.type-unknown"),
    over("loss.aggregation=mean", names=("loss.aggregation='mean':",), id="aggregation-unknown"),
    over("loss.type=grpo", "loss.aggregation=seq-mean-bin-mean-token-mean",
         names=("loss.aggregation='seq-mean-bin-mean-token-mean':", "type='grpo'"), id="espo-aggregation-on-grpo"),
    over("loss.kl_estimator=k2", names=("loss.kl_estimator='k2':",), id="kl_estimator-unknown"),
    over("loss.adv_std_over=prompt", names=("loss.adv_std_over='prompt':",), id="adv_std_over-unknown"),
    over("filter.zero_variance=keep", names=("filter.zero_variance='keep':",), id="zero_variance-unknown"),
    over("dtype=float16", names=("dtype='float16':",), id="dtype-unknown"),
    over("device=gpu", names=("device='gpu':",), id="device-unknown"),
    over("logger=mlflow", names=("logger='mlflow':",), id="logger-unknown"),
    over("engine.name=vllm", names=("engine.name='vllm':",), id="engine-unknown"),
    over("engine.slots=-1", names=("engine.slots=-1:",), id="engine.slots<0"),
    over("reward.model=gpt4", names=("reward.model='gpt4':",), id="reward.model-unknown"),
    # a reward that could never read the scorer (issue 33): identically 0, or the penalties alone
    over("reward.rm_only=true", "reward.model=stub", "reward.rm_weight=0",
         names=("reward.rm_weight=0.0 with reward.rm_only=True:", "rm_weight > 0"), id="rm_only-with-rm_weight=0"),
    over("reward.rm_only=true", names=("reward.rm_only=True with reward.model='':",), id="rm_only-without-a-scorer"),
    over("ckpt_keep=0", names=("ckpt_keep=0:",), id="ckpt_keep=0"),
    over("ckpt_every=-1", names=("ckpt_every=-1:",), id="ckpt_every<0"),
    over("dist_timeout_s=0", names=("dist_timeout_s=0.0:",), id="dist_timeout_s=0"),
    over("max_staleness=-1", names=("max_staleness=-1:",), id="max_staleness<0"),
    over("rollout_threads=2", names=("rollout_threads=2",), id="rollout_threads-without-async"),
    over("filter.probe_size=1", names=("filter.probe_size=1:",), id="probe_size=1"),
    over("filter.probe_size=4", names=("filter.probe_size=4:", "group_size=4"), id="probe_size=group_size"),
    over("filter.enlarged_group_size=8", names=("filter.enlarged_group_size=8:",),
         id="enlarged_group_size-without-probes"),
    over("filter.skip_prob=1.5", names=("filter.skip_prob=1.5:",), id="skip_prob>1"),
    over("filter.skip_half_life=0", names=("filter.skip_half_life=0.0:",), id="skip_half_life=0"),
    over("filter.probe_stop_threshold=2", names=("filter.probe_stop_threshold=2.0:",), id="probe_stop_threshold>1"),
    over("reward.shaping_margin=0.5", names=("reward.shaping_margin=0.5:",), id="shaping_margin=0.5"),
    over("reward.judge_dead_band=0.5", names=("reward.judge_dead_band=0.5:",), id="judge_dead_band=0.5"),
    over("reward.overlong_buffer=100", names=("reward.overlong_buffer=100:", "sampling.max_new_tokens=8"),
         id="overlong_buffer>max_new"),
    over("reward.rm_weight=-1", names=("reward.rm_weight=-1.0:",), id="rm_weight<0"),
    over("reward.repetition_weight=-1", names=("reward.repetition_weight=-1.0:",), id="repetition_weight<0"),
    over("filter.zvp_alpha=-0.1", names=("filter.zvp_alpha=-0.1:",), id="zvp_alpha<0"),
    over("filter.oversample_rounds=-1", names=("filter.oversample_rounds=-1:",), id="oversample_rounds<0"),
    over("loss.espo_top_frac=0", names=("loss.espo_top_frac=0.0:",), id="espo_top_frac=0"),
    over("loss.espo_num_bins=0", names=("loss.espo_num_bins=0:",), id="espo_num_bins=0"),
    over("loss.tis_cap=-1", names=("loss.tis_cap=-1.0:",), id="tis_cap<0"),
    over("loss.tis_cap=2", "loss.icepop=0.5,5", names=("loss.tis_cap=2.0:", "icepop=(0.5, 5"), id="tis_cap-and-icepop"),
    over("loss.icepop=0.5", names=("loss.icepop='0.5':", "two numbers"), id="icepop-one-bound"),
    over("loss.icepop=3,2", names=("loss.icepop=(3.0, 2.0):",), id="icepop-low>high"),
    over("loss.clip_eps_low=nan", names=("loss.clip_eps_low=nan:",), id="clip_eps_low=nan"),
    over("max_prompt_tokens=1000", names=("max_prompt_tokens=1000:",), id="max_prompt_tokens-too-long"),
    over("model.max_seq_len=8", names=("model.max_seq_len=8", "sampling.max_new_tokens=8:"),
         id="max_seq_len-leaves-no-prompt"),
    over("ep=3", names=("ep=3:", "model.num_experts=4"), id="ep-not-dividing-experts"),
    over("bpe_merges=1000", names=("bpe_merges=1000:",), id="bpe_merges-above-vocab"),
    over("model.vocab_size=100", names=("model.vocab_size=100",), id="vocab-below-demo-tokenizer"),
    over("eval_seed=5", names=("eval_seed=5:",), id="eval_seed-overlaps-training"),
    over("seed=-1", names=("seed=-1:",), id="seed<0"),
    over("rl_steps=-1", names=("rl_steps=-1:",), id="rl_steps<0"),
    over("lr_warmup_steps=-1", names=("lr_warmup_steps=-1:",), id="lr_warmup_steps<0"),
    over("reward.timeout_s=0", names=("reward.timeout_s=0.0:",), id="reward.timeout_s=0"),
    over("tools.enabled=abacus", names=("tools.enabled=('abacus',):",), id="tools.enabled-unknown"),
    over("tools.call_timeout_s=0", names=("tools.call_timeout_s=0.0:",), id="tools.call_timeout_s=0"),
    over("engine.sglang_mem_fraction=1.5", names=("engine.sglang_mem_fraction=1.5:",), id="sglang_mem_fraction>1"),
    over("gpus_per_node=0", names=("gpus_per_node=0:",), id="gpus_per_node=0"),
    over("compile=maybe", names=("compile='maybe'",), id="bool-not-a-bool"),
    over("grop_size=4", names=("'grop_size'", "group_size"), id="unknown-key"),
    over("model=big", names=("model='big'",), id="model-on-command-line"),
    over("loss.tis_capp=2", names=("'loss.tis_capp'", "loss.tis_cap"), id="unknown-section-field"),
    over("sampling.temperatur=0.5", names=("'sampling.temperatur'", "sampling.temperature"),
         id="unknown-sampling-field"),
    over("los.tis_cap=2", names=("'los.tis_cap'", "loss.tis_cap"), id="unknown-section"),
    over("system_prompt=Be brief.", names=("system_prompt='Be brief.'",), id="system_prompt-without-template"),
    over("resume=/nonexistent", names=("resume='/nonexistent'",), id="resume-not-a-checkpoint"),
    over("out_dir=" + __file__, names=("out_dir=",), id="out_dir-is-a-file"),
    over("model.n_group=0", names=("model.n_group=0:",), id="model.n_group=0"),
    over("model.n_heads=5", names=("n_heads=5",), id="model.n_heads-not-multiple-of-kv"),
    over("model.router=topk", names=("model.router='topk':",), id="model.router-unknown"),
    over("model.rope_type=ntk", names=("model.rope_type='ntk':",), id="model.rope_type-unknown"),
    over("model.partial_rotary_factor=0", names=("model.partial_rotary_factor=0.0:",), id="model.rotary=0"),
    over("model.norm_eps=0", names=("model.norm_eps=0.0:",), id="model.norm_eps=0"),
    over("model.hf_model_type=llama", names=("model.hf_model_type='llama':",), id="model.hf_model_type-unknown"),
    over("model.num_shared_experts=-1", names=("model.num_shared_experts=-1:",), id="model.shared<0"),
    over("sft_batch_size=2", names=("sft_batch_size=2:",), env={"WORLD_SIZE": "4"}, id="sft_batch-below-world"),
    over("ep=2", names=("ep=2:", "world size 3"), env={"WORLD_SIZE": "3"}, id="ep-not-dividing-world"),
    over("model.tie_embeddings=true", names=("model.tie_embeddings=True",), env={"WORLD_SIZE": "2"},
         id="tied-embeddings-multi-rank"),
    # ------------------------------------------------ a flat key from before the sections: named with its new home
    over("tis_cap=2", names=("tis_cap is loss.tis_cap",), id="old:tis_cap"),
    over("loss_type=grpo", names=("loss_type is loss.type",), id="old:loss_type"),
    over("icepop_high=5", names=("icepop_high is loss.icepop",), id="old:icepop_high"),
    over("icepop_low=0.5", names=("icepop_low is loss.icepop",), id="old:icepop_low"),
    over("temperature=0.7", names=("temperature is sampling.temperature",), id="old:temperature"),
    over("max_new_tokens=8", names=("max_new_tokens is sampling.max_new_tokens",), id="old:max_new_tokens"),
    over("probe_size=2", names=("probe_size is filter.probe_size",), id="old:probe_size"),
    over("reward_model=stub", names=("reward_model is reward.model",), id="old:reward_model"),
    over("reward_timeout_s=10", names=("reward_timeout_s is reward.timeout_s",), id="old:reward_timeout_s"),
    over("engine=sglang", names=("engine='sglang'", "engine.name"), id="old:engine"),
    over("rollout_fp8=true", names=("rollout_fp8 is engine.fp8",), id="old:rollout_fp8"),
    over("sglang_urls=http://h:1", names=("sglang_urls is engine.sglang_urls",), id="old:sglang_urls"),
    conf("max_new_tokens = 8", names=("max_new_tokens is sampling.max_new_tokens",), id="old:file:max_new_tokens"),
    conf("tis_cap = 2.0", names=("tis_cap is loss.tis_cap", "loss = dict(tis_cap=...)"), id="old:file:tis_cap"),
    conf('engine = "sglang"', names=("engine='sglang'", "engine.name"), id="old:file:engine"),
    conf('loss = dict(loss_type="grpo")', names=("'loss.loss_type'", "loss.type"), id="old:file:loss_type-in-loss"),
    # ------------------------------------------------ a config file: Python, so any type can arrive
    conf('group_size = "8"', names=("group_size='8'",), id="file:group_size-str"),
    conf('lr = "1e-3"', names=("lr='1e-3'",), id="file:lr-str"),
    conf("group_size = True", names=("group_size=True",), id="file:group_size-bool"),
    conf("group_size = 8.0", names=("group_size=8.0",), id="file:group_size-float"),
    conf("compile = 1", names=("compile=1",), id="file:bool-as-int"),
    conf("sampling = dict(top_p=None)", names=("sampling.top_p=None",), id="file:None"),
    conf('sampling = dict(temperature=float("nan"))', names=("sampling.temperature=nan",), id="file:temperature-nan"),
    conf("init_hf = None", names=("init_hf=None",), id="file:path-None"),
    conf('model = dict(dim="64")', names=("model.dim='64'",), id="file:model.dim-str"),
    conf("model = dict(n_group=0)", names=("model.n_group=0",), id="file:model.n_group=0"),
    conf("model = 5", names=("model=5",), id="file:model-not-a-dict"),
    conf("model = dict(dimm=64)", names=("model.dimm", "model.dim"), id="file:model-unknown-key"),
    conf("loss = dict(tis_capp=2.0)", names=("'loss.tis_capp'", "loss.tis_cap"), id="file:loss-unknown-key"),
    conf("loss = 2.0", names=("loss=2.0",), id="file:loss-not-a-dict"),
    conf("loss = dict(icepop=(3, 2))", names=("loss.icepop=(3, 2):",), id="file:icepop-low>high"),
    conf("loss = dict(icepop=(0.5,))", names=("loss.icepop=(0.5,):",), id="file:icepop-one-bound"),
    conf('tasks = [("chain_sum",)]', names=("tasks=",), id="file:tasks-malformed"),
    conf('tasks = [("chain_sun", {})]', names=("tasks[0]=('chain_sun'",), id="file:tasks-unknown-dataset"),
    conf('tasks = [("chain_sum", dict(min_terms="x"))]', names=("tasks[0]=('chain_sum'",), id="file:tasks-bad-kwargs"),
    conf("group_size = ", names=("cfg.py', line ", "SyntaxError"), id="file:syntax-error"),
    conf("lr = learning_rate", names=("cfg.py', line ", "NameError"), id="file:name-error"),
    # ------------------------------------------------ data files: the row is named by file and line
    data(text=jsonl([gsm8k(0), "{not json"]), names=("train_data=", "train.jsonl, line 2"), id="data:not-json"),
    data(text=jsonl([gsm8k(0), {"question": "q"}]), names=("train.jsonl, line 2", "'answer'"),
         id="data:missing-field"),
    data(text=jsonl([gsm8k(0), {"question": "q", "answer": "4"}]), names=("train.jsonl, line 2", "####"),
         id="data:no-gold-line"),
    data(text=jsonl([gsm8k(0), "[1, 2]"]), names=("train.jsonl, line 2",), id="data:row-not-an-object"),
    data(text=jsonl([gsm8k(0), {"question": 7, "answer": "#### 1"}]), names=("train.jsonl, line 2", "'question'"),
         id="data:field-not-a-string"),
    data(text=jsonl([gsm8k(0)]).encode() + b"\xff\xfe\n", names=("train.jsonl, line 2", "UTF-8"), id="data:not-utf8"),
    data(text="", names=("train_data=", "train.jsonl: no rows"), id="data:empty-file"),
    data(name="train.csv", text="question,answer\n", names=("train_data=", "train.csv"), id="data:not-jsonl"),
    data(text=jsonl(GOOD_TRAIN), eval_text=jsonl([GOOD_EVAL[0], GOOD_EVAL[1], "{"]),
         names=("eval_data=", "eval.jsonl, line 3"), id="data:bad-eval-row"),
    data(text=jsonl(GOOD_TRAIN), eval_text=jsonl(GOOD_EVAL[:4]), names=(f"eval_size={EVAL_SIZE}:", "eval_data="),
         id="data:eval-smaller-than-eval_size"),
    data(text=jsonl(GOOD_TRAIN), eval_text=jsonl(GOOD_TRAIN), names=(f"eval_size={EVAL_SIZE}:", "0 of them unseen"),
         id="data:eval-all-seen-in-training"),
    over("train_data=/nonexistent/train.jsonl", "eval_data=/nonexistent/eval.jsonl",
         names=("train_data='/nonexistent/train.jsonl'", "no such file"), id="data:missing-file"),
    over("train_data=/nonexistent/train.jsonl", names=("train_data=", "eval_data=''"), id="data:train-without-eval"),
    # ------------------------------------------------ the pass-rate file: read at the check, not after SFT
    rates(jsonl([{"id": "a", "pass_rate": 0.5}, "{oops"]), names=("filter.pass_rate_file=", "line 2"),
          id="rates:not-json"),
    rates(jsonl([{"id": "a", "pass_rate": 1.5}]), names=("filter.pass_rate_file=", "line 1"), id="rates:above-1"),
    rates(jsonl([{"id": "a", "pass_rate": "0.5"}]), names=("filter.pass_rate_file=", "line 1"), id="rates:a-string"),
    rates(jsonl([{"pass_rate": 0.5}]), names=("filter.pass_rate_file=", "line 1"), id="rates:no-id"),
    over("filter.pass_rate_file=/nonexistent.jsonl", "filter.skip_prob=0.5",
         names=("filter.pass_rate_file='/nonexistent.jsonl'",),
         id="rates:missing-file"),
    rates(jsonl([{"id": "a", "pass_rate": 0.5}]), more=(), names=("filter.pass_rate_file=", "both are off"),
          id="rates:read-by-no-stage"),
    # ------------------------------------------------ checkpoint folders (init_from, init_hf): each file named
    ckpt(remove("config.json"), names=("init_from=", "config.json"), id="ckpt:no-config.json"),
    ckpt(write("config.json", "{oops"), names=("init_from=", "config.json is not JSON"), id="ckpt:config-not-json"),
    ckpt(edit_json("config.json", model_type="llama"), names=("init_from=", "config.json", "model_type='llama'"),
         id="ckpt:config-unknown-family"),
    ckpt(edit_json("config.json", hidden_size=64), names=("model.dim=32", "config.json"), id="ckpt:other-shape"),
    ckpt(edit_json("config.json", quantization_config={"quant_method": "fp8"}), names=("init_from=", "quantised"),
         id="ckpt:quantised"),
    ckpt(remove("model.safetensors"), names=("init_from=", "model.safetensors"), id="ckpt:no-weights"),
    ckpt(write("model.safetensors", b"\x00" * 64), names=("model.safetensors is not a readable safetensors",),
         id="ckpt:weights-corrupt"),
    ckpt(write("model.safetensors.index.json", json.dumps({"weight_map": {"embed": "model-00002.safetensors"}})),
         names=("model-00002.safetensors",), id="ckpt:index-names-a-missing-shard"),
    ckpt(remove("tokenizer.json"), names=("init_from=", "holds no tokenizer.json"), id="ckpt:no-tokenizer"),
    ckpt(write("tokenizer.json", "{"), names=("tokenizer.json is not JSON",), id="ckpt:tokenizer-not-json"),
    ckpt(write("generation_config.json", "["), names=("generation_config.json is not JSON",),
         id="ckpt:generation-config-not-json"),
    ckpt(no_eos, names=("init_from=", "eos"), id="ckpt:no-stop-token"),
    ckpt(bigger_tokenizer, names=("model.vocab_size=320", "400 ids"), id="ckpt:tokenizer-exceeds-vocab"),
    ckpt(lambda p: None, more=("system_prompt=Be brief.",), names=("system_prompt='Be brief.'", "chat template"),
         id="ckpt:system-prompt-without-template"),
    ckpt(lambda p: None, data_rows=[gsm8k(i, words=100) for i in range(100, 130)],
         names=(f"eval_size={EVAL_SIZE}:", "max_prompt_tokens=248"), id="ckpt:eval-prompts-longer-than-max_seq_len"),
    ckpt(write("config.json", "{oops"), key="init_hf", names=("init_hf=", "config.json"), id="ckpt:init_hf-config"),
    over("init_from=/nonexistent", names=("init_from='/nonexistent'", "no such folder"), id="ckpt:missing-folder"),
    # ------------------------------------------------ bad tensors to public pure functions: ValueError naming it
    call(lambda: espo.group_advantages(torch.tensor([0.0, 1.0])), names=("rewards must be [P, G]",),
         id="tensor:advantages-1d"),
    call(lambda: espo.group_advantages(torch.zeros(3, 1)), names=("G >= 2",), id="tensor:advantages-group-of-1"),
    call(lambda: espo.group_advantages(torch.zeros(2, 2), std_over="prompt"), names=("std_over='prompt'",),
         id="tensor:advantages-std_over"),
    call(lambda: espo.kl_penalty(Z_BT, Z_BT, ONES_BT, estimator="k2"), names=("kl_estimator='k2'",),
         id="tensor:kl-estimator"),
    call(lambda: espo.policy_loss(Z_BT, Z_BT, Z_BT, ONES_BT, LossConfig(type="gmpo")),
         names=("loss type 'gmpo'",), id="tensor:token-advantages-to-gmpo"),
    call(lambda: espo.policy_loss(Z_BT, Z_BT, torch.zeros(2), ONES_BT, LossConfig(type="grpo", kl_coef=0.1)),
         names=("ref_logp_BT",), id="tensor:kl-without-reference"),
    call(lambda: espo.policy_loss(Z_BT, Z_BT, torch.zeros(2), ONES_BT, LossConfig(), vocab_size=64),
         names=("old_entropy_BT",), id="tensor:espo-without-entropy"),
    call(lambda: check_routes(torch.full((1, 2, 2, 2), 9), 8), names=("routed_experts",),
         id="tensor:route-id-out-of-range"),
    call(lambda: check_route_layout(torch.zeros(1, 2, 2, 3, dtype=torch.long), (1, 2, 2, 2)),
         names=("routed_experts has shape",), id="tensor:routes-shape"),
    call(lambda: check_route_layout(torch.zeros(1, 2, 2, 2), (1, 2, 2, 2)), names=("dtype torch.float32",),
         id="tensor:routes-float"),
    call(lambda: zve.post_rollout_filter(torch.zeros(1, 2), torch.ones(1, 3)), names=("rewards",),
         id="tensor:filter-rewards-vs-lengths"),
    call(lambda: shaping.adjust_rewards(torch.full((2, 2), 0.5), torch.zeros(2, 2)), names=("correct must hold",),
         id="tensor:correct-not-0-1"),
    call(lambda: shaping.adjust_rewards(torch.zeros(2, 2), torch.zeros(2, 3)), names=("shaping (2, 3)",),
         id="tensor:shaping-shape"),
    call(lambda: trainer.pack_microbatches([3, 4], 0), names=("token_budget=0",), id="tensor:token-budget=0"),
    call(lambda: shaping.rm_score(torch.zeros(2, 2), scale=0.0), names=("scale",), id="tensor:rm-scale=0"),
    # ------------------------------------------------ `python train.py`: stderr is one config error line, exit != 0
    cli("sampling.temperature=0", "filter.zero_variance=rl-zvp", names=("sampling.temperature=0.0:",),
        id="cli:temperature=0-rl-zvp"),
    cli("grad_clip=-1", names=("grad_clip=-1.0:",), id="cli:grad_clip<0"),
    cli(config_text='\ngroup_size = "8"\n', names=("group_size='8'",), id="cli:file-str-for-int"),
]


def _tripwire(*args, **kwargs):
    raise AssertionError("train.run started: the bad input was not refused before any work")


def no_sft_ran(out_dir: str) -> bool:
    path = os.path.join(out_dir, "metrics.jsonl")
    return not os.path.exists(path) or not any(json.loads(line).get("stage") == "sft" for line in open(path))


@pytest.fixture(scope="module")
def cli_runs(base, tmp_path_factory) -> dict:
    """Every "cli" row of BAD run by `python train.py`, all at once (each mostly imports): payload ->
    (exit code, stderr, its out_dir)."""
    started = {}
    for row in BAD:
        kind, payload, _ = row.values
        if kind == "cli":
            w = Workspace(base, str(tmp_path_factory.mktemp("cli")))
            overrides, config_text = payload
            argv = [sys.executable, os.path.join(ROOT, "train.py"), *w.argv(*overrides, config_text=config_text)]
            proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            started[payload] = (proc, os.path.join(w.tmp, "run"))
    results = {}
    for payload, (proc, out) in started.items():
        _, stderr = proc.communicate(timeout=300)  # communicate, not wait: a long stderr cannot fill the pipe
        results[payload] = (proc.returncode, stderr, out)
    return results


@pytest.mark.parametrize("kind, payload, names", BAD)
def test_a_bad_input_is_refused_before_any_work_by_one_line_naming_it(kind, payload, names, ws, monkeypatch, request):
    out_dir = os.path.join(ws.tmp, "run")
    if kind == "call":
        with pytest.raises(ValueError) as e:
            payload()
        message = str(e.value)
    elif kind == "run":
        argv, env = payload(ws)
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        monkeypatch.setattr(train, "run", _tripwire)
        with pytest.raises(CONFIG_ERRORS) as e:
            train.main(parse_args(argv))  # parse_args checks the config, then train.prepare the files: __main__'s path
        message = str(e.value)
    else:
        returncode, stderr, out_dir = request.getfixturevalue("cli_runs")[payload]
        assert returncode != 0 and stderr.startswith("config error: "), stderr[-2000:]
        message = stderr.strip()
    assert "\n" not in message, message
    assert all(n in message for n in names), f"{names} not all in: {message}"
    assert no_sft_ran(out_dir)


def test_the_good_inputs_the_rows_spoil_pass_every_check(ws):
    """So each row fails for what it spoils: the micro config, the data files, the checkpoint, the pass rates."""
    # parse_args checks every field's rule and the relations; train.prepare reads and checks every file
    train.prepare(parse_args(ws.argv()))
    train.prepare(parse_args(ws.argv(*ws.data(text=jsonl(GOOD_TRAIN)), DATA_CONTEXT)))
    train.prepare(parse_args(ws.argv(f"init_from={ws.checkpoint(lambda p: None)}", CKPT_CONTEXT,
                                     *ws.data(text=jsonl(GOOD_TRAIN)))))
    start = train.prepare(parse_args(ws.argv(
        f"filter.pass_rate_file={ws.file('r.jsonl', jsonl([{'id': 'a', 'pass_rate': 1}]))}", "filter.skip_prob=0.5")))
    assert start.offline_rates  # the pass-rate file was read


CONFIG_CLASSES = [config.TrainConfig, *config.SECTIONS.values()]


# that every field has exactly one rule is tests/test_structure.py's
@pytest.mark.parametrize("cls", CONFIG_CLASSES, ids=lambda c: c.__name__)
def test_every_default_passes_its_own_rule(cls):
    check_fields(cls())  # construction checks its rules; check_fields once more, explicitly
