"""Configuration: TrainConfig (every field with its default and a docstring) and how a run's is built.

A config file (configs/*.py) is plain assignments of TrainConfig fields, deltas from the
defaults only, with `model = dict(...)` for ModelConfig fields; `key=value` on the command
line overrides either (`model.dim=128`), parsed to the field's type. An unknown key is a
ValueError that names the close matches.
"""

from __future__ import annotations

import dataclasses
import difflib
import runpy
from dataclasses import dataclass, field

from espo import LossConfig
from filter import FilterConfig
from model import ModelConfig
from reward import RewardConfig
from rollout import SamplingParams

# Small-number arithmetic in two surface forms, with item spaces large enough (tens of
# thousands of distinct questions) that held-out prompts unseen in training are plentiful.
DEFAULT_TASKS = [
    ("chain_sum", dict(min_terms=2, max_terms=4, min_digits=1, max_digits=1)),
    ("basic_arithmetic", dict(min_terms=2, max_terms=4, min_digits=1, max_digits=1, operators=("+", "-"),
                              allow_parentheses=False, allow_negation=False)),
]
@dataclass
class TrainConfig:
    out_dir: str = "out/run"
    """Where metrics, checkpoint and plot are written."""
    seed: int = 1337
    """Seeds init, data order and sampling."""
    device: str = "cpu"
    """torch device for trainer and engine."""
    init_from: str = ""
    """Output folder of an earlier run to start from (its model.safetensors and tokenizer); "" = random init."""
    init_hf: str = ""
    """HF hub-layout checkpoint folder (config.json + safetensors) whose weights start the policy; its
    shape must be model's; the tokenizer is still this run's. Multi-rank, each rank reads only its slice."""
    dry_run: bool = False
    """Build the model on the meta device, print parameter counts and the per-GPU memory plan, and exit."""
    gpus_per_node: int = 8
    """GPUs per node (the dry-run plan's unit)."""
    ep: int = 1
    """Expert-parallel degree: each MoE layer's experts are split over this many GPUs."""
    activation_checkpoint: bool = False
    """Recompute each block's activations in backward instead of keeping them."""
    compile: bool = False
    """torch.compile the trainer's blocks and the engine's decode step (pays where per-op launch cost dominates: GPUs)."""
    dist_timeout_s: float = 600.0
    """Seconds a collective may wait for the other ranks before the job fails (a dead rank must not hang it)."""
    # checkpoints and logging
    ckpt_every: int = 100
    """Optimizer steps (SFT and RL counted together) between checkpoints under out_dir/ckpt (0 = none)."""
    ckpt_keep: int = 2
    """Complete checkpoints kept; older ones are deleted once a newer one is complete."""
    resume: str = ""
    """"" = start afresh; "auto" = the newest complete checkpoint in out_dir/ckpt if any; or a checkpoint folder."""
    logger: str = "none"
    """Metrics sink besides metrics.jsonl and the console: 'none', 'tensorboard' or 'wandb' (imported lazily)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """Model shape; a config file sets it as a dict of deltas."""
    # task
    tasks: list = field(default_factory=lambda: list(DEFAULT_TASKS))
    """(reasoning-gym dataset name, kwargs) pairs, mixed round-robin."""
    train_seed: int = 1
    """reasoning-gym seed of the training pool."""
    train_size: int = 8_000
    """Training prompts generated; eval seed must exceed train_seed by more than this."""
    eval_seed: int = 1_000_000
    """reasoning-gym seed of held-out prompts (items also seen in training are dropped)."""
    eval_size: int = 1000
    """Held-out prompts per eval."""
    bpe_merges: int = 64
    """BPE merges learned from the training prompts and demonstrations (0 = byte-level)."""
    # SFT warm-up
    sft_steps: int = 200
    """Optimizer steps of the cold-start SFT warm-up (0 = none)."""
    sft_batch_size: int = 64
    """Demonstrations per SFT step."""
    sft_lr: float = 3e-3
    """Peak SFT learning rate (linear warm-up, cosine decay to 10%)."""
    # RL
    rl_steps: int = 100
    """RL steps (one rollout batch each)."""
    prompts_per_step: int = 64
    """Prompts sampled per RL step."""
    group_size: int = 8
    """Rollouts G per prompt."""
    max_new_tokens: int = 24
    """Generation limit per rollout, in tokens."""
    temperature: float = 1.0
    """Rollout sampling temperature (the trainer's logprobs use the same)."""
    top_p: float = 1.0
    """Rollout nucleus sampling mass."""
    top_k: int = 0
    """Rollout top-k sampling: only the k most likely tokens can be drawn (0 = off)."""
    gen_batch_rows: int = 256
    """Rows (prompts x G) per engine.generate call."""
    lr: float = 5e-5
    """RL AdamW learning rate (constant after a short warm-up)."""
    lr_warmup_steps: int = 5
    """Linear warm-up steps of both stages' schedules."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    grad_clip: float = 1.0
    """Max global grad norm."""
    num_minibatches: int = 2
    """Optimizer steps per rollout batch (PPO-style; >1 makes ratios leave 1 and clipping matter)."""
    microbatch_tokens: int = 8192
    """Padded-token budget of one forward/backward."""
    loss_type: str = "espo"
    """'espo', 'grpo' (DAPO token clip), 'drgrpo', 'gspo', 'gspo-token', 'gmpo' or 'cispo' (espo.py)."""
    aggregation: str = ""
    """'token-mean', 'seq-mean-token-mean', 'seq-mean-token-sum' or 'seq-mean-token-sum-norm'; "" = the paper's."""
    adv_scale_by_std: bool = True
    """Divide advantages by the reward std (GRPO); false for Dr.GRPO."""
    adv_std_over: str = "group"
    """Std of each prompt's group ('group') or of the whole batch ('batch')."""
    espo_alpha: float = 0.02
    """ESPO clip scale: eps_tau = alpha * mean entropy / log|V| (arXiv 2512.00499)."""
    espo_top_frac: float = 0.2
    """Fraction of highest-entropy tokens in ESPO's first entropy bin."""
    espo_num_bins: int = 2
    """ESPO entropy bins per sequence (the paper's "entropy groups"): the top fraction, then the rest split evenly."""
    clip_eps_low: float = -1.0
    """Lower clip epsilon of the non-ESPO losses; < 0 = the loss's paper value (espo.PAPER_CLIP_EPS, DAPO's 0.2)."""
    clip_eps_high: float = -1.0
    """Upper clip epsilon; < 0 = the loss's paper value (DAPO's clip-higher 0.28, GSPO's 4e-4)."""
    kl_coef: float = 0.0
    """KL-to-reference penalty weight (reference = a frozen copy of the policy as RL starts, sharded as the policy is on
    several ranks); 0 = none, no reference kept."""
    kl_estimator: str = "k3"
    """'k1' or 'k3' (Schulman's estimators)."""
    tis_cap: float = 0.0
    """TIS cap C on pi_old/pi_infer per token (2.0 in Yao et al.); 0 = off."""
    icepop_low: float = 0.0
    """IcePop lower bound a on pi_old/pi_infer (0.5 in Ring-1T); icepop_high > 0 turns IcePop on."""
    icepop_high: float = 0.0
    """IcePop upper bound b (5.0 in Ring-1T); 0 = off."""
    router_replay: bool = True
    """Replay the engine's routed experts in every trainer forward (R3)."""
    # zero-variance elimination (filter.py): the defaults run none of stages 1-2 and drop zero-variance groups
    skip_prob: float = 0.0
    """Stage 1: probability of skipping a prompt last seen all-correct or all-wrong, at once (0 = off)."""
    skip_half_life: float = 200.0
    """Stage 1: RL steps over which that skip probability halves, so skipped prompts come back."""
    pass_rate_file: str = ""
    """Stage 1: JSONL of {"id": question, "pass_rate": p} (e.g. from a smaller model), read once ("" = none)."""
    probe_size: int = 0
    """Stage 2: probe rollouts k per prompt; the other G - k are generated only if their rewards differ (0 = off)."""
    probe_stop_threshold: float = 0.5
    """Stage 2: agreeing probes stop a prompt when the other G - k would agree too with at least this chance, a
    posterior given the prompt's last group (filter.rest_agree_probability); 0 = always stop when they agree."""
    enlarged_group_size: int = 0
    """Stage 2: rollouts for prompts whose probes differ, >= group_size (0 = group_size)."""
    zero_variance: str = "drop"
    """Stage 3: 'drop' zero-variance groups, or 'rl-zvp' to train on them with entropy-shaped token advantages."""
    zvp_alpha: float = 0.1
    """RL-ZVP scale a: all correct A_t = a H_t, all wrong A_t = -a (max H - H_t) (arXiv 2509.21880)."""
    oversample_rounds: int = 0
    """Extra rounds of prompts drawn per step until prompts_per_step groups are informative (0 = none)."""
    # rewards (reward.py): shaping enters inside the correctness class, so no advantage inversion
    overlong_buffer: int = 0
    """DAPO soft overlong penalty: tokens before max_new_tokens where it ramps from 0 to -1 (0 = off)."""
    repetition_weight: float = 0.0
    """Weight of the repeated-4-gram penalty in the shaping score (0 = off)."""
    reward_model: str = ""
    """Scorer mixed into the shaping score: '' (none), 'stub' (a reward model of deterministic noise) or 'stub-judge'
    (a pairwise judge against the gold answer); both stand-ins test the wiring (reward.py)."""
    rm_weight: float = 0.5
    """Weight of the reward model's (or judge's) score in the shaping score."""
    judge_dead_band: float = 0.1
    """Judge verdicts within this of 1/2 count as ties and add exactly nothing (reward.judge_score)."""
    shaping_margin: float = 0.4
    """Shaping scale m < 1/2 in r = correct + m min(p, 1 - p) s."""
    reward_workers: int = 0
    """Threads that score rollouts while generation goes on (0 = score inline after generating)."""
    reward_timeout_s: float = 30.0
    """Per-rollout scoring limit; a timeout or an exception gives reward 0, counted in the metrics."""
    # async rollouts (scheduler.Pipeline)
    max_staleness: int = 0
    """Rollouts may come from weights up to this many RL steps old, generated while the trainer trains (0 = synchronous on-policy)."""
    rollout_threads: int = 0
    """With max_staleness > 0: torch CPU threads of the rollout producer thread (0 = half of torch's on CPU, else default)."""
    trainer_threads: int = 0
    """With max_staleness > 0: torch CPU threads of the trainer thread during RL (0 = the rest of torch's on CPU)."""
    eval_every: int = 50
    """RL steps between evals."""
    eval_samples: int = 4
    """Completions per held-out prompt for the sampled accuracy (mean@k at the rollout temperature)."""
    eval_batch_rows: int = 512
    """Rows per eval generate call."""

    # Each concern's own settings, built once from these fields; a field's "off" value (0, -1, "")
    # becomes None here, so the functions that take them never translate sentinels.
    def loss_config(self) -> LossConfig:
        """The policy loss's settings (espo.LossConfig). Raises ValueError on a bad loss setting."""
        return LossConfig(
            loss_type=self.loss_type, aggregation=self.aggregation or None,
            clip_eps_low=self.clip_eps_low if self.clip_eps_low >= 0 else None,
            clip_eps_high=self.clip_eps_high if self.clip_eps_high >= 0 else None,
            espo_alpha=self.espo_alpha, espo_top_frac=self.espo_top_frac, espo_num_bins=self.espo_num_bins,
            vocab_size=self.model.vocab_size, max_tokens=self.max_new_tokens, kl_coef=self.kl_coef,
            kl_estimator=self.kl_estimator, tis_cap=self.tis_cap if self.tis_cap > 0 else None,
            icepop_bounds=(self.icepop_low, self.icepop_high) if self.icepop_high > 0 else None)

    def filter_config(self) -> FilterConfig:
        """The zero-variance stages' settings (filter.FilterConfig). Raises ValueError on a bad filter setting."""
        return FilterConfig(group_size=self.group_size, skip_prob=self.skip_prob, skip_half_life=self.skip_half_life,
                            probe_size=self.probe_size, stop_threshold=self.probe_stop_threshold,
                            enlarged_group_size=self.enlarged_group_size, oversample_rounds=self.oversample_rounds,
                            keep_zero_variance=self.zero_variance == "rl-zvp", zvp_alpha=self.zvp_alpha)

    def sampling_params(self) -> SamplingParams:
        """How rollouts are sampled (rollout.SamplingParams). Raises ValueError on a bad sampling setting."""
        return SamplingParams(max_new_tokens=self.max_new_tokens, temperature=self.temperature, top_p=self.top_p,
                              top_k=self.top_k)

    def reward_config(self) -> RewardConfig:
        """How rewards are shaped (reward.RewardConfig). Raises ValueError on a bad reward setting."""
        return RewardConfig(max_new_tokens=self.max_new_tokens, overlong_buffer=self.overlong_buffer,
                            repetition_weight=self.repetition_weight, reward_model=self.reward_model,
                            rm_weight=self.rm_weight, judge_dead_band=self.judge_dead_band,
                            shaping_margin=self.shaping_margin)


def _parse(value: str, like, key: str):
    """Parse a command-line string into the type of the field's default."""
    if isinstance(like, bool):
        if value.lower() in ("1", "true", "yes"):
            return True
        if value.lower() in ("0", "false", "no"):
            return False
        raise ValueError(f"{key}={value!r}: expected a bool (true/false)")
    if isinstance(like, (int, float, str)):
        try:
            return type(like)(value)
        except ValueError:
            raise ValueError(f"{key}={value!r}: expected {type(like).__name__}") from None
    raise ValueError(f"{key} is a {type(like).__name__}: set it in a config file, not on the command line")


def _unknown(key: str, valid) -> ValueError:
    close = difflib.get_close_matches(key, list(valid), n=3)
    return ValueError(f"unknown config key {key!r}" + (f"; did you mean {', '.join(close)}?" if close else ""))


def load_config(path: str | None, overrides: list[str]) -> TrainConfig:
    """TrainConfig from defaults, then the config file's assignments, then key=value overrides.

    Raises ValueError on an unknown key (naming close matches) or a badly typed value.
    """
    values = {}
    if path:
        ns = runpy.run_path(path)
        values = {k: v for k, v in ns.items() if not k.startswith("_") and not callable(v) and type(v).__name__ != "module"}
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    model_fields = {f.name: f for f in dataclasses.fields(ModelConfig)}
    model_kw = dict(values.pop("model", {}))
    for k in values:
        if k not in fields:
            raise _unknown(k, fields)
    for k in model_kw:
        if k not in model_fields:
            raise _unknown(f"model.{k}", (f"model.{m}" for m in model_fields))
    defaults, model_defaults = TrainConfig(), ModelConfig()
    for item in overrides:
        key, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"override {item!r} is not key=value")
        if key.startswith("model."):
            name = key[len("model."):]
            if name not in model_fields:
                raise _unknown(key, (f"model.{m}" for m in model_fields))
            model_kw[name] = _parse(value, getattr(model_defaults, name), key)
        elif key in fields and key != "model":
            values[key] = _parse(value, getattr(defaults, key), key)
        else:
            raise _unknown(key, fields)
    return TrainConfig(**values, model=ModelConfig(**model_kw))


def parse_args(argv: list[str]) -> TrainConfig:
    """`[config.py] [key=value ...]` -> TrainConfig. Raises ValueError on a bad key or value."""
    path = argv[0] if argv and "=" not in argv[0] else None
    return load_config(path, argv[1:] if path else argv)
