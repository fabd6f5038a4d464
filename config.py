"""Configuration: TrainConfig (every field with its default and a docstring) and how a run's is built.

This file owns every setting of a run and where it comes from: the defaults below, then a
config file (configs/*.py: plain assignments of TrainConfig fields, deltas from the defaults
only, with `model = dict(...)` for ModelConfig fields), then `key=value` on the command line,
which overrides either (`lr=1e-4`, `model.dim=128`). load_config and parse_args build the
TrainConfig; its builder methods hand each concern its own small config (the loss, the
filter, the sampler, the rewards); checks.py refuses what cannot run, before any work.

Notable choices:
1. A config file is Python run by runpy, not exec'd into this module's globals: only its
   plain assignments are kept, so it can compute values and import what it needs.
2. A command-line value is parsed to the type of the field's default; lists, dicts and
   ModelConfig are set in a config file only.
3. An unknown key, in a file or on the command line, is a ValueError that names the close matches.
4. TrainConfig is flat and stores an "off" setting as a plain sentinel (0, -1 or ""); the
   builder methods alone turn sentinels into None, and the configs they build check the values.
5. Validation is data, in checks.py (RULES per field, RELATIONS across fields, the files a run
   reads): load_config refuses a wrong type and a bad ModelConfig field before anything is
   built; checks.check_config refuses the rest before any work.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import runpy
import traceback
from dataclasses import dataclass, field

import torch

from espo import LossConfig
from filter import FilterConfig
from hf_config import config_from_hf
from model import ModelConfig
from reward import RewardConfig
from sampler import SamplingParams

# Small-number arithmetic in two surface forms, with item spaces large enough (tens of
# thousands of distinct questions) that held-out prompts unseen in training are plentiful.
DEFAULT_TASKS = [
    ("chain_sum", dict(min_terms=2, max_terms=4, min_digits=1, max_digits=1)),
    ("basic_arithmetic", dict(min_terms=2, max_terms=4, min_digits=1, max_digits=1, operators=("+", "-"),
                              allow_parentheses=False, allow_negation=False)),
]
# What a run from a real checkpoint (init_hf) starts from instead of the defaults below, which are the tiny
# demo's: no SFT warm-up (the checkpoint already answers), and the lengths, batch and optimizer of a
# published recipe, DAPO's (arXiv 2503.14476: lr 1e-6 with 10 warm-up steps, weight decay 0.1, 16 rollouts
# per prompt), with fewer prompts per step and shorter completions as a first run's starting point. A field
# the config file or the command line sets wins over these.
CHECKPOINT_DEFAULTS = dict(
    sft_steps=0, rl_steps=500, lr=1e-6, lr_warmup_steps=10, weight_decay=0.1, prompts_per_step=128, group_size=16,
    max_prompt_tokens=1024, max_new_tokens=4096, num_minibatches=4, microbatch_tokens=16384, gen_batch_rows=2048,
    eval_every=25, eval_size=500, eval_batch_rows=2048, ckpt_every=50)


@dataclass
class TrainConfig:
    out_dir: str = "out/run"
    """Folder of the run's outputs: the final model in the HF hub layout (config.json, model.safetensors, the
    tokenizer files), run_config.json, metrics.jsonl, plot.png and ckpt/."""
    seed: int = 1337
    """Seed of the model init, the training-prompt order and rollout sampling."""
    device: str = "cpu"
    """torch device of the trainer and the engine ('cpu', 'cuda'); under torchrun with CUDA, each rank's own GPU."""
    init_from: str = ""
    """Output folder of an earlier run of this project to start from (its model and tokenizer, e.g. after its
    SFT warm-up); the defaults stay this file's. "" = random init and a tokenizer trained on the task."""
    init_hf: str = ""
    """HF hub-layout checkpoint folder (config.json, safetensors, tokenizer.json, tokenizer_config.json or
    chat_template.jinja, generation_config.json): the run's model shape, weights, tokenizer, chat template
    and stop tokens. Unset fields take CHECKPOINT_DEFAULTS (no SFT; a real recipe's lengths, lr, batch); a
    model field that disagrees with config.json is an error. Multi-rank, each rank reads only its slice."""
    dry_run: bool = False
    """Build the model on the meta device, print parameter counts and the per-GPU memory plan, and exit."""
    gpus_per_node: int = 8
    """GPUs per node (the dry-run plan's unit)."""
    ep: int = 1
    """Expert-parallel degree: each MoE layer's experts are split over this many ranks (1 = not split); it must
    divide the number of ranks and the number of experts."""
    dtype: str = "auto"
    """Compute dtype of the trainer and the engine: 'bfloat16' (fp32 master weights, AdamW state and gradient
    reductions; the router and the loss in fp32), 'float32', or 'auto' = bfloat16 on CUDA, float32 on CPU."""
    activation_checkpoint: bool = False
    """Recompute each block's activations in backward instead of keeping them."""
    compile: bool = False
    """torch.compile the trainer's blocks and the engine's decode step; it pays where per-op launch cost
    dominates (GPUs)."""
    dist_timeout_s: float = 600.0
    """Seconds a collective may wait for the other ranks before the job fails (> 0; a dead rank must not hang it)."""
    # checkpoints and logging
    ckpt_every: int = 100
    """Optimizer steps (SFT and RL counted together) between checkpoints under out_dir/ckpt (0 = none)."""
    ckpt_keep: int = 2
    """Complete checkpoints kept (>= 1), counted up to the position just written; older ones are deleted once a
    newer one is complete."""
    resume: str = ""
    """"" = start afresh; "auto" = the newest complete checkpoint in out_dir/ckpt that loads (newer ones that do not
    are skipped with a warning naming them); or a checkpoint folder."""
    logger: str = "none"
    """Metrics sink besides metrics.jsonl and the console: 'none', 'tensorboard' or 'wandb' (imported lazily)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """Model shape; a config file sets it as a dict of deltas."""
    # task
    train_data: str = ""
    """Training prompts: a JSONL or parquet file of GSM8K, MATH or HumanEval rows (the format is read from the
    fields; reward.load_task). "" = the reasoning-gym `tasks`. Needs eval_data."""
    eval_data: str = ""
    """Held-out prompts for the evals, a file as train_data (the first eval_size rows that fit)."""
    system_prompt: str = ""
    """System message of a chat template's prompt ("" = none); only with a checkpoint's chat template."""
    tasks: list = field(default_factory=lambda: list(DEFAULT_TASKS))
    """(reasoning-gym dataset name, kwargs) pairs, mixed round-robin (without train_data)."""
    train_seed: int = 1
    """reasoning-gym seed of the training pool."""
    train_size: int = 8_000
    """Training prompts generated; eval_seed must exceed train_seed + train_size (checked at start)."""
    eval_seed: int = 1_000_000
    """reasoning-gym seed of held-out prompts (items also seen in training are dropped)."""
    eval_size: int = 1000
    """Held-out prompts per eval; the run stops with a ValueError if fewer are unseen in training."""
    bpe_merges: int = 64
    """BPE merges learned from the training prompts and demonstrations (0 = byte-level); at most
    model.vocab_size - 259 (256 bytes and 3 specials)."""
    # SFT warm-up
    sft_steps: int = 200
    """Optimizer steps of the cold-start SFT warm-up (0 = none)."""
    sft_batch_size: int = 64
    """Demonstrations per SFT step (at least the number of ranks)."""
    sft_lr: float = 3e-3
    """Peak SFT learning rate (linear warm-up, cosine decay to 10%)."""
    # RL
    rl_steps: int = 100
    """RL steps (one rollout batch each)."""
    prompts_per_step: int = 64
    """Prompts sampled per RL step."""
    group_size: int = 8
    """Rollouts G per prompt: the size of a group."""
    max_new_tokens: int = 24
    """Generation limit per rollout, in tokens."""
    max_prompt_tokens: int = 0
    """Longest prompt, in tokens (verl's max_prompt_length): longer ones are skipped, counted and logged.
    0 = max_seq_len - max_new_tokens, all that fits. The dry run's engine plan sizes its KV cache by it."""
    temperature: float = 1.0
    """Rollout sampling temperature, > 0 (the trainer's logprobs divide the logits by the same)."""
    top_p: float = 1.0
    """Rollout nucleus sampling mass, in (0, 1] (1 = off)."""
    top_k: int = 0
    """Rollout top-k sampling: only the k most likely tokens can be drawn (0 = off)."""
    gen_batch_rows: int = 256
    """Rows (prompts x G) per engine.generate call on each rank (the KV cache holds this many); a call holds at
    least one prompt whatever this is. Under torchrun a generation batch spans every rank: world x this."""
    engine: str = "native"
    """Rollout engine: 'native' (rollout.NativeEngine, PyTorch; under torchrun it decodes on the policy's own
    shards, no replica) or 'sglang' (sglang_engine.py: CUDA and the sglang package only)."""
    sglang_urls: str = ""
    """engine='sglang': comma-separated base URLs of external SGLang servers (weights pushed over an NCCL group);
    "" = one SGLang engine per node colocated on the training GPUs, its memory released while the trainer trains."""
    sglang_mem_fraction: float = 0.8
    """engine='sglang', colocated: the fraction of each GPU's memory SGLang's static pool (weights, KV cache) may take."""
    rollout_fp8: bool = False
    """Rollouts with blockwise-FP8 weights (DeepSeek-V3's recipe): SGLang's FP8 serving, or the native engine in
    one process; the trainer stays bf16/fp32."""
    lr: float = 5e-5
    """RL AdamW learning rate (constant after a short warm-up)."""
    lr_warmup_steps: int = 5
    """Optimizer steps of linear warm-up at the start of both the SFT and the RL schedule."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    grad_clip: float = 1.0
    """Max global gradient norm (L2, over all parameters and ranks) before each optimizer step; > 0, no off value."""
    num_minibatches: int = 2
    """Optimizer steps per rollout batch (PPO-style; >1 makes ratios leave 1 and clipping matter)."""
    microbatch_tokens: int = 8192
    """Padded-token budget of one micro-batch (one forward/backward): rows x the longest row's tokens."""
    loss_type: str = "espo"
    """'espo', 'grpo' (DAPO token clip), 'drgrpo', 'gspo', 'gspo-token', 'gmpo' or 'cispo' (espo.py)."""
    aggregation: str = ""
    """'token-mean', 'seq-mean-token-mean', 'seq-mean-token-sum', 'seq-mean-token-sum-norm' or (ESPO only)
    'seq-mean-bin-mean-token-mean'; "" = the loss's paper default (espo.PAPER_AGGREGATION)."""
    adv_scale_by_std: bool = True
    """Divide advantages by the reward std (GRPO); false for Dr.GRPO."""
    adv_std_over: str = "group"
    """With adv_scale_by_std: the std of each group's rewards ('group') or of the whole batch's ('batch')."""
    espo_alpha: float = 0.02
    """ESPO clip scale: eps_tau = alpha * mean entropy / log|V| (arXiv 2512.00499)."""
    espo_top_frac: float = 0.2
    """Fraction of highest-entropy tokens in ESPO's first entropy bin."""
    espo_num_bins: int = 2
    """ESPO entropy bins per sequence (the paper's "entropy groups"): the top fraction, then the rest split
    evenly."""
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
    """Stage 2: rollouts of a prompt whose probes differ, >= group_size (0 = group_size)."""
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
    """Rollouts may come from weights up to this many RL steps old, generated while the trainer trains
    (0 = synchronous on-policy). Under torchrun the producer decodes on a sharded copy of the policy."""
    rollout_threads: int = 0
    """With max_staleness > 0: torch CPU threads of the rollout producer thread (0 = half of torch's on CPU,
    else torch's default)."""
    trainer_threads: int = 0
    """With max_staleness > 0: torch CPU threads of the trainer thread during RL (0 = the rest of torch's on CPU)."""
    eval_every: int = 50
    """RL steps between evals (> 0; the last RL step always evaluates)."""
    eval_samples: int = 4
    """Completions per held-out prompt for the sampled accuracy (mean@k at the rollout temperature)."""
    eval_batch_rows: int = 512
    """Rows (prompts x completions each) per eval generate call."""

    # Each concern's own settings, built once from these fields. Why sentinels are translated here and
    # nowhere else: a field must hold a plain value that `key=value` can set and _parse can type from
    # its default, so "off" is spelled 0, -1 or ""; the concerns' configs take None for off instead.
    # Translating in these four methods gives each sentinel one meaning, in one place, and leaves the
    # functions downstream testing `is None` only. Their constructors check the values, and
    # train.check_config builds all four before any work, so a bad setting fails at once.
    def compute_dtype(self) -> torch.dtype:
        """torch's dtype for `dtype` ('auto': bfloat16 on CUDA, float32 elsewhere). Raises ValueError on another name."""
        if self.dtype not in ("auto", "bfloat16", "float32"):
            raise ValueError(f"dtype={self.dtype!r}; valid: 'auto', 'bfloat16', 'float32'")
        if self.dtype == "auto":
            return torch.bfloat16 if torch.device(self.device).type == "cuda" else torch.float32
        return getattr(torch, self.dtype)

    def prompt_limit(self) -> int:
        """The longest prompt a run takes: max_prompt_tokens, or all that fits beside max_new_tokens.
        Raises ValueError when no prompt, or a longer one than fits, is allowed."""
        fits = self.model.max_seq_len - self.max_new_tokens
        if fits < 1:  # max_new_tokens alone leaves no room: name it, not the prompt limit the user may not have set
            raise ValueError(f"max_new_tokens={self.max_new_tokens}: need less than model.max_seq_len="
                             f"{self.model.max_seq_len}, so a prompt of at least one token fits beside it")
        if not 0 <= self.max_prompt_tokens <= fits:
            raise ValueError(f"max_prompt_tokens={self.max_prompt_tokens}: need 0 (all that fits) or 1..{fits} "
                             f"(max_seq_len={self.model.max_seq_len} - max_new_tokens={self.max_new_tokens})")
        return self.max_prompt_tokens or fits

    def loss_config(self) -> LossConfig:
        """The policy loss's settings (espo.LossConfig). Raises ValueError on a bad loss setting."""
        return LossConfig(
            loss_type=self.loss_type, aggregation=self.aggregation or None,  # "" = the paper's aggregation
            # < 0 = the loss's paper value: 0 is a valid epsilon, so it cannot be the sentinel here
            clip_eps_low=self.clip_eps_low if self.clip_eps_low >= 0 else None,
            clip_eps_high=self.clip_eps_high if self.clip_eps_high >= 0 else None,
            espo_alpha=self.espo_alpha, espo_top_frac=self.espo_top_frac, espo_num_bins=self.espo_num_bins,
            vocab_size=self.model.vocab_size, max_tokens=self.max_new_tokens, kl_coef=self.kl_coef,
            kl_estimator=self.kl_estimator, tis_cap=self.tis_cap if self.tis_cap > 0 else None,
            # both bounds or none: icepop_high > 0 switches IcePop on, and icepop_low may well be 0
            icepop_bounds=(self.icepop_low, self.icepop_high) if self.icepop_high > 0 else None)

    def filter_config(self) -> FilterConfig:
        """The zero-variance stages' settings (filter.FilterConfig). Raises ValueError on a bad filter setting."""
        return FilterConfig(group_size=self.group_size, skip_prob=self.skip_prob, skip_half_life=self.skip_half_life,
                            probe_size=self.probe_size, stop_threshold=self.probe_stop_threshold,
                            enlarged_group_size=self.enlarged_group_size, oversample_rounds=self.oversample_rounds,
                            # any spelling but 'rl-zvp' reads as 'drop' here; check_config's RULES refuse them
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


# ----------------------------------------------------------------------------- building a TrainConfig

def _parse(value: str, like, key: str):
    """Parse a command-line string into the type of the field's default."""
    # Why the default's type: every value on the command line is a string, and the annotations are
    # strings too (`from __future__ import annotations`), so the default is the one typed value at
    # hand. A field is thus typed once, where it is declared, and a mistyped value names its key.
    # bool first: it is a subclass of int, and bool("false") would be True.
    if isinstance(like, bool):
        if value.lower() in ("1", "true", "yes"):
            return True
        if value.lower() in ("0", "false", "no"):
            return False
        raise ValueError(f"{key}={value!r}: expected a bool (true/false)")
    # int("1e3") fails: an int field takes an integer spelling only, never a silently truncated float.
    if isinstance(like, (int, float, str)):
        try:
            return type(like)(value)
        except ValueError:
            raise ValueError(f"{key}={value!r}: expected {type(like).__name__}") from None
    # A list, dict or dataclass has no single obvious string form: set it in a config file.
    raise ValueError(f"{key} is a {type(like).__name__}: set it in a config file, not on the command line")


def _unknown(key: str, valid) -> ValueError:
    # Returned, not raised, so each caller's `raise` shows where the unknown key was found.
    close = difflib.get_close_matches(key, list(valid), n=3)
    return ValueError(f"unknown config key {key!r}" + (f"; did you mean {', '.join(close)}?" if close else ""))


def _run_file(path: str) -> dict:
    """The namespace of config file `path` after running it. Raises ValueError naming the file and the
    line of what failed in it (a syntax error, a name it lacks, ...), FileNotFoundError without it."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"config file {path!r}: no such file")
    try:
        return runpy.run_path(path)
    except Exception as e:  # noqa: BLE001  anything a Python file can raise is a mistake in that file
        if isinstance(e, SyntaxError):
            line = e.lineno
        else:  # the innermost frame in the config file itself
            here = os.path.abspath(path)
            frames = [f for f in traceback.extract_tb(e.__traceback__) if os.path.abspath(f.filename) == here]
            line = frames[-1].lineno if frames else "?"
        raise ValueError(f"config file {path!r}, line {line}: {type(e).__name__}: {e}") from None


def load_config(path: str | None, overrides: list[str]) -> TrainConfig:
    """TrainConfig from defaults, then the config file's assignments, then key=value overrides.

    Raises ValueError on an unknown key (naming close matches), a value of the wrong type (the
    field's Rule in RULES: `group_size = "8"` in a file), a bad ModelConfig field (MODEL_RULES,
    then ModelConfig's own checks), or a config file that fails to run.
    Ranges and relations of TrainConfig's fields are check_config's.
    """
    values = {}
    if path:
        # The file's namespace after running it, less what is not a setting: private and dunder names
        # (`__name__`, helpers), functions and classes, and imported modules.
        ns = _run_file(path)
        values = {k: v for k, v in ns.items() if not k.startswith("_") and not callable(v) and type(v).__name__ != "module"}
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    model_fields = {f.name: f for f in dataclasses.fields(ModelConfig)}
    # The file's `model` holds deltas from ModelConfig's defaults, merged with model.* overrides below.
    model_kw = values.pop("model", {})
    if not isinstance(model_kw, dict):
        raise ValueError(f"model={model_kw!r}: need a dict of ModelConfig fields, deltas from the defaults "
                         f"(model = dict(dim=128, n_layers=2))")
    model_kw = dict(model_kw)
    # Every key of the file is checked before any override, so a typo in the file is named even
    # when the command line is empty.
    for k in values:
        if k not in fields:
            raise _unknown(k, fields)
    for k in model_kw:
        if k not in model_fields:
            raise _unknown(f"model.{k}", (f"model.{m}" for m in model_fields))
    defaults, model_defaults = TrainConfig(), ModelConfig()  # the typed values _parse reads types from
    # Overrides come after the file, in command-line order, so the last word is the command line's.
    for item in overrides:
        key, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"override {item!r} is not key=value")
        if key.startswith("model."):
            name = key[len("model."):]
            if name not in model_fields:
                raise _unknown(key, (f"model.{m}" for m in model_fields))
            model_kw[name] = _parse(value, getattr(model_defaults, name), key)
        elif key == "model":
            raise ValueError(f"model={value!r}: set model.<field>=value on the command line, or model = dict(...) "
                             f"in a config file")
        elif key in fields:
            values[key] = _parse(value, getattr(defaults, key), key)
        else:
            raise _unknown(key, fields)
    # Types now, before anything reads a value: a str where a number belongs would otherwise be a
    # TypeError deep in the run. ModelConfig fields in full: ModelConfig is built (and checks its own
    # relations) next, and its checks compare numbers.
    from checks import MODEL_RULES, RULES  # checks.py reads TrainConfig: imported when first needed
    for k, v in values.items():
        RULES[k].check_type(k, v)
    for k, v in model_kw.items():
        MODEL_RULES[k].check(f"model.{k}", v)
    if values.get("init_hf"):  # a real checkpoint: its shape, and CHECKPOINT_DEFAULTS under what was set
        return TrainConfig(**{**CHECKPOINT_DEFAULTS, **values}, model=checkpoint_model(values["init_hf"], model_kw))
    try:
        model = ModelConfig(**model_kw)
    except ValueError as e:  # ModelConfig's own relations name its fields bare: say they are the model's
        raise ValueError(f"model: {e}") from None
    return TrainConfig(**values, model=model)


def checkpoint_model(path: str, model_kw: dict) -> ModelConfig:
    """The ModelConfig of the HF checkpoint folder `path` (its config.json, hf.config_from_hf).

    model_kw, the model fields a config file or the command line set, must agree with it, except
    max_seq_len, which may be shorter (the same function on the positions it allows). Raises
    ValueError naming the field otherwise, or the missing or unreadable config.json.
    """
    file = os.path.join(path, "config.json")
    if not os.path.isdir(path):
        raise ValueError(f"init_hf={path!r}: no such folder")
    if not os.path.isfile(file):
        raise ValueError(f"init_hf={path!r}: no config.json there; need a hub-layout folder (config.json, "
                         f"*.safetensors, tokenizer.json, tokenizer_config.json)")
    try:
        model = config_from_hf(file)
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:  # a JSONDecodeError is a ValueError
        raise ValueError(f"init_hf={path!r}: config.json: {e}") from None
    for k, v in model_kw.items():
        theirs = getattr(model, k)
        if k == "max_seq_len" and not 0 < v <= theirs:
            raise ValueError(f"model.max_seq_len={v!r}: at most the checkpoint's {theirs} ({file}); a shorter "
                             f"context may be set, a longer one would need RoPE scaling the checkpoint lacks")
        if v != theirs and k != "max_seq_len":
            raise ValueError(f"model.{k}={v!r} disagrees with {file} ({theirs!r}): the checkpoint sets the model's "
                             f"shape; drop model.{k}")
    return dataclasses.replace(model, **{k: v for k, v in model_kw.items() if k == "max_seq_len"})


def parse_args(argv: list[str]) -> TrainConfig:
    """`[config.py] [key=value ...]` -> TrainConfig. Raises ValueError on a bad key or value."""
    # The config file is optional: a first argument without "=" is its path, the rest are overrides.
    path = argv[0] if argv and "=" not in argv[0] else None
    return load_config(path, argv[1:] if path else argv)
