"""A train.Run for tests: a micro model, a byte tokenizer, a stand-in task and a fresh engine; and a free port
for the multi-process tests' rendezvous."""

import random
import socket

import torch

import train
from config import TrainConfig, load_config
from model import Transformer
from data import Item, Task
from reward_model import reward_model_for
from sampler import Vocab
from rollout import NativeEngine
from scheduler import LengthPredictor
from scoring import RewardPool
from tokenizer import build_tokenizer, demo_tokenizer


def free_port() -> int:
    """A TCP port nothing on this machine listens on now (for MASTER_PORT)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


MICRO = """
model = dict(vocab_size=320, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, num_experts=4, top_k=2,
             moe_inter_dim=32, max_seq_len=64)
bpe_merges = 40
train_size = 300
eval_size = 24
sft_steps = 4
sft_batch_size = 8
rl_steps = 3
prompts_per_step = 4
group_size = 4
sampling = dict(max_new_tokens=8)
eval_every = 2
"""


class ParityTask(Task):
    """Stand-in task: prompts "question i", reward 1 for completions of even character length (mixed groups)."""

    def __init__(self, size: int = 10_000):
        self.items = [Item(f"question {i}", "0", 0, i) for i in range(size)]

    def score(self, completion, item):
        return float(len(completion) % 2 == 0)


def micro_config(tmp_path, overrides=()) -> TrainConfig:
    """The micro config with overrides, writing to tmp_path."""
    path = tmp_path / "micro.py"
    path.write_text(MICRO)
    return load_config(str(path), [f"out_dir={tmp_path / 'run'}", *overrides])


def make_run(cfg: TrainConfig, task=None) -> train.Run:
    """A Run over `task` (default ParityTask) drawn in order, its engine on the fresh policy's weights."""
    task = task or ParityTask()
    tok = demo_tokenizer(build_tokenizer(cfg.model.vocab_size))
    model = Transformer(cfg.model)
    engine = NativeEngine(cfg.model, Vocab(tok.stop_ids, tok.pad_id, decode=tok.decode))
    engine.update_weights(model.named_parameters(), version=0)
    return train.Run(cfg=cfg, engine=engine, tok=tok, model=model,
                     prompts=train.Prompts(task, list(range(len(task))), tok, cfg.prompt_limit()),
                     predictor=LengthPredictor(prior=cfg.sampling.max_new_tokens / 2), filter_rng=random.Random(cfg.seed),
                     opt=torch.optim.AdamW(model.parameters(), lr=cfg.lr), scorer=reward_model_for(cfg.reward),
                     pool=RewardPool(task.score, workers=cfg.reward.workers, timeout_s=cfg.reward.timeout_s)
                     if cfg.reward.workers else None)
