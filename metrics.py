"""Run outputs: metrics.jsonl (and TensorBoard or Weights & Biases when asked) and the end-of-run plot.

Legend: one record = one JSON object per SFT step, RL step or eval, with its "stage" and "step".
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os

from config import TrainConfig
from distributed import rank_world


class MetricsLog:
    """metrics.jsonl, plus TensorBoard or Weights & Biases when cfg.logger asks; only rank 0 writes.
    Without a cfg the records are only kept in memory (`records`).

    keep: on resume, how many records of the existing metrics.jsonl to keep (those the
    checkpoint had seen); later ones are dropped and written again by the resumed run.
    Raises ValueError on an unknown logger, or one whose package is not installed.
    """

    def __init__(self, cfg: TrainConfig | None = None, keep: int | None = None):
        self.records, self.backend = [], None
        self.enabled = cfg is not None and rank_world()[0] == 0
        if cfg is None:
            return
        path = os.path.join(cfg.out_dir, "metrics.jsonl")
        if keep is not None and os.path.exists(path):
            with open(path) as f:
                self.records = [json.loads(line) for line in itertools.islice(f, keep)]
        if cfg.logger not in ("none", "tensorboard", "wandb"):
            raise ValueError(f"logger={cfg.logger!r}; valid: 'none', 'tensorboard', 'wandb'")
        if not self.enabled:
            return
        self.file = open(path, "w")
        for rec in self.records:
            self.file.write(json.dumps(rec) + "\n")
        try:
            if cfg.logger == "tensorboard":
                from torch.utils.tensorboard import SummaryWriter
                self.backend = SummaryWriter(os.path.join(cfg.out_dir, "tensorboard"))
            elif cfg.logger == "wandb":
                import wandb
                self.backend = wandb.init(project="everyprompt", name=os.path.basename(os.path.abspath(cfg.out_dir)),
                                          dir=cfg.out_dir, config=dataclasses.asdict(cfg))
        except ImportError as e:
            raise ValueError(f"logger={cfg.logger!r} needs its package ({e}); pip install {cfg.logger}, "
                             f"or set logger=none") from None

    def __call__(self, rec: dict):
        self.records.append(rec)
        if not self.enabled:
            return
        self.file.write(json.dumps(rec) + "\n")
        self.file.flush()
        nums = {f"{rec.get('stage', 'run')}/{k}": v for k, v in rec.items()
                if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step"}
        if self.backend is not None and hasattr(self.backend, "add_scalar"):
            for k, v in nums.items():
                self.backend.add_scalar(k, v, global_step=rec.get("step", 0))
        elif self.backend is not None:
            self.backend.log(nums)

    def close(self):
        if self.enabled:
            self.file.close()
            if self.backend is not None:
                (self.backend.close if hasattr(self.backend, "add_scalar") else self.backend.finish)()


def plot(records: list[dict], path: str):
    """Training reward, eval accuracy (+- SE) and zero-variance fraction against RL step."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rl = [r for r in records if r.get("stage") == "rl" and "reward" in r]  # a step with no rollouts has no reward
    ev = [r for r in records if r.get("stage") == "eval"]
    fig, ax = plt.subplots(1, 3, figsize=(13, 3.6))
    ax[0].plot([r["step"] for r in rl], [r["reward"] for r in rl])
    ax[0].set(title="training reward (mean over rollouts)", xlabel="RL step")
    for key, label in (("eval_acc", "sampled (mean@k)"), ("eval_greedy_acc", "greedy")):
        ax[1].errorbar([r["step"] for r in ev], [r[key] for r in ev], yerr=[r[key.replace("acc", "se")] for r in ev],
                       marker="o", capsize=3, label=label)
    ax[1].set(title="held-out accuracy (+- 1 SE)", xlabel="RL step")
    ax[1].legend()
    ax[2].plot([r["step"] for r in rl], [r["filter/zero_variance_frac"] for r in rl])
    ax[2].set(title="zero-variance group fraction", xlabel="RL step")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
