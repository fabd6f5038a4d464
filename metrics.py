"""Run outputs: metrics.jsonl (and TensorBoard or Weights & Biases when asked) and the end-of-run plot.

This file owns what a run reports. MetricsLog writes one JSON object per line to
out_dir/metrics.jsonl for every SFT step, RL step and eval, each with its "stage" ('sft',
'rl' or 'eval') and "step", mirrors the numeric values to the sink `logger` names, and
keeps every record in memory; plot draws the training reward, the held-out accuracy and
the zero-variance group fraction against the RL step at the end of a run.
Terms (step, zero-variance group) as the README's Legend defines them.

Notable choices:
1. metrics.jsonl is the record; TensorBoard and Weights & Biases only mirror it and are
   imported when asked for, so neither is a dependency.
2. Only rank 0 writes: the metrics are already reduced over ranks, so the ranks agree.
3. On resume the file is rewritten with the records the checkpoint had seen, so a resumed
   run ends with the records an uninterrupted one would have, none twice.
"""

from __future__ import annotations

import itertools
import json
import os


class MetricsLog:
    """out_dir/metrics.jsonl, plus TensorBoard or Weights & Biases when `logger` asks ('none',
    'tensorboard', 'wandb'; its name is config.TrainConfig's rule). Without an out_dir the records are
    only kept in memory (`records`).

    write: whether this process writes (rank 0 only: the logged metrics are reduced over ranks, so rank
    0's records stand for all, and several writers would interleave their lines in one file).
    config: the run's resolved settings, for wandb's run page. keep: on resume, how many records of the
    existing metrics.jsonl to keep (those the checkpoint had seen); later ones are dropped and written
    again by the resumed run. Raises ValueError when the logger's package is not installed.
    """

    def __init__(self, out_dir: str | None = None, *, logger: str = "none", config: dict | None = None,
                 keep: int | None = None, write: bool = True):
        self.records, self.backend = [], None
        self.enabled = out_dir is not None and write
        if out_dir is None:
            return
        path = os.path.join(out_dir, "metrics.jsonl")
        # Records past `keep` were logged after the checkpoint was written; the resumed run logs them
        # again, so they are left out here rather than written twice.
        if keep is not None and os.path.exists(path):
            with open(path) as f:
                self.records = [json.loads(line) for line in itertools.islice(f, keep)]
        if not self.enabled:
            return
        # "w", not "a": truncate, then write back the kept records, which drops the ones past `keep`.
        self.file = open(path, "w")
        for rec in self.records:
            self.file.write(json.dumps(rec) + "\n")
        try:
            if logger == "tensorboard":
                from torch.utils.tensorboard import SummaryWriter
                self.backend = SummaryWriter(os.path.join(out_dir, "tensorboard"))
            elif logger == "wandb":
                import wandb
                self.backend = wandb.init(project="everyprompt", name=os.path.basename(os.path.abspath(out_dir)),
                                          dir=out_dir, config=config)
        except ImportError as e:  # a missing optional package is a config problem: say how to fix it
            raise ValueError(f"logger={logger!r} needs its package ({e}); pip install {logger}, "
                             f"or set logger=none") from None

    def __call__(self, rec: dict):
        self.records.append(rec)
        if not self.enabled:
            return
        self.file.write(json.dumps(rec) + "\n")
        self.file.flush()  # each record reaches the file as it comes, so a killed run keeps all it logged
        # Only numbers are curves; the stage prefix keeps SFT's loss apart from RL's, bool is left out
        # although it is an int, and "step" is the x-axis, not a curve.
        nums = {f"{rec.get('stage', 'run')}/{k}": v for k, v in rec.items()
                if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step"}
        # Told apart by their methods, so neither package is imported here: TensorBoard's SummaryWriter
        # takes one scalar per call at the record's step; a wandb run takes the whole dict per call, at
        # wandb's own step counter (one per call), not at the record's step.
        if self.backend is not None and hasattr(self.backend, "add_scalar"):
            for k, v in nums.items():
                self.backend.add_scalar(k, v, global_step=rec.get("step", 0))
        elif self.backend is not None:
            self.backend.log(nums)

    def close(self):
        if self.enabled:
            self.file.close()
            if self.backend is not None:
                # SummaryWriter.close flushes its event file; a wandb run ends with finish().
                (self.backend.close if hasattr(self.backend, "add_scalar") else self.backend.finish)()


def plot(records: list[dict], path: str):
    """Training reward, eval accuracy (+- SE) and zero-variance fraction against RL step."""
    import matplotlib
    matplotlib.use("Agg")  # draws to files only: no display needed, as on a headless server
    import matplotlib.pyplot as plt
    rl = [r for r in records if r.get("stage") == "rl" and "reward" in r]  # a step with no rollouts has no reward
    ev = [r for r in records if r.get("stage") == "eval"]
    fig, ax = plt.subplots(1, 3, figsize=(13, 3.6))
    ax[0].plot([r["step"] for r in rl], [r["reward"] for r in rl])
    ax[0].set(title="training reward (mean over rollouts)", xlabel="RL step")
    # Each accuracy's standard error is logged under the same name with "se" for "acc".
    for key, label in (("eval_acc", "sampled (mean@k)"), ("eval_greedy_acc", "greedy")):
        ax[1].errorbar([r["step"] for r in ev], [r[key] for r in ev], yerr=[r[key.replace("acc", "se")] for r in ev],
                       marker="o", capsize=3, label=label)
    ax[1].set(title="held-out accuracy (+- 1 SE)", xlabel="RL step")
    ax[1].legend()
    ax[2].plot([r["step"] for r in rl], [r["filter/zero_variance_frac"] for r in rl])
    ax[2].set(title="zero-variance group fraction", xlabel="RL step")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)  # pyplot keeps every figure alive until closed
