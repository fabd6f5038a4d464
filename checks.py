"""Checks of a run's settings and files, all before any work: what cannot run is one `config error:` line.

Validation is data: RULES and MODEL_RULES give every field of TrainConfig and ModelConfig a
Rule (its type, its range or names, and what is valid in words), RELATIONS the checks that
span fields, and check_files opens every file the run will read. Every violation is one
ValueError, `<field>=<value!r>: <what is valid>` (a file's name and line where it has lines).

Notable choices:
1. RULES and MODEL_RULES give every field of TrainConfig and ModelConfig a
   Rule (its type, its range or names, and what is valid in words), RELATIONS the checks that
   span fields. Every violation is one ValueError, `<field>=<value!r>: <what is valid>`.
   load_config refuses a wrong type (a config file is Python: `group_size = "8"` arrives as a str)
   and a bad ModelConfig field before anything is built; check_config runs the rules, the
   relations, then opens every file the run will read (data, pass rates, checkpoint folders),
   all before any work. TrainConfig itself checks nothing when built, so code and tests may
   build one with an odd value for a part that checks its own.
6. Prompts longer than the limit (max_prompt_tokens, or max_seq_len - max_new_tokens) are
   skipped and counted, not an error (data.Prompts); what is an error, found by check_config
   where it is cheap, is too few held-out prompts left: fewer eval_data rows than eval_size
   unseen in training, or (with a checkpoint's tokenizer) fewer that fit the limit.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass
from typing import Any, Callable

import torch

from config import TrainConfig
from data import load_task
from espo import AGGREGATIONS, KL_ESTIMATORS, LOSS_TYPES
from filter import PromptHistory
from hf_config import config_from_hf
from model import HF_MODEL_TYPES, ModelConfig
from reward import REWARD_MODELS
from sglang_engine import ENGINES, check_sglang_config
from tokenizer import NUM_BYTES, SPECIALS, Tokenizer, load_hf_tokenizer

class ConfigError(ValueError):
    """A setting or file found wrong while the run is built (a checkpoint's tensors, the held-out
    prompts that fit): still before any work, so train.py prints it as a `config error:` line."""


# ----------------------------------------------------------------------------- the rules of each field

@dataclass(frozen=True)
class Rule:
    """What one field accepts: a value of one of `types` (a bool is no int or float here) for which
    `test` holds; `valid` says which, in words, for the error."""
    types: tuple
    valid: str
    test: Callable[[Any], bool] = lambda v: True

    def type_ok(self, value) -> bool:
        # bool is an int subclass: without this, `group_size = True` would be a group of 1
        return isinstance(value, self.types) and (bool in self.types or not isinstance(value, bool))

    def check_type(self, name: str, value):
        """Raises ValueError `<name>=<value!r> (a <type>): need <valid>` for a value of another type."""
        if not self.type_ok(value):
            raise ValueError(f"{name}={value!r} (a {type(value).__name__}): need {self.valid}")

    def check(self, name: str, value):
        """Raises ValueError `<name>=<value!r>: need <valid>` for a value of another type or out of range."""
        self.check_type(name, value)
        if not self.test(value):
            raise ValueError(f"{name}={value!r}: need {self.valid}")


def _because(why: str) -> str:
    return f" ({why})" if why else ""


def integer(low: int | None = None, high: int | None = None, why: str = "") -> Rule:
    """An int in [low, high] (None: unbounded)."""
    span = f" in [{low}, {high}]" if high is not None else f" >= {low}" if low is not None else ""
    return Rule((int,), f"an int{span}{_because(why)}",
                lambda v: (low is None or v >= low) and (high is None or v <= high))


def number(low: float | None = None, high: float | None = None, *, low_open: bool = False, high_open: bool = False,
           why: str = "") -> Rule:
    """A finite int or float between low and high, each bound closed unless said open (None: unbounded)."""
    lo = "(-inf" if low is None else f"{'(' if low_open else '['}{low:g}"
    hi = "inf)" if high is None else f"{high:g}{')' if high_open else ']'}"
    span = "" if low is None and high is None else f" in {lo}, {hi}"

    def test(v) -> bool:  # NaN fails every comparison; inf is no setting anywhere
        return (math.isfinite(v) and (low is None or (v > low if low_open else v >= low))
                and (high is None or (v < high if high_open else v <= high)))
    return Rule((int, float), f"a {'number' if span else 'finite number'}{span}{_because(why)}", test)


def one_of(*names: str, why: str = "") -> Rule:
    return Rule((str,), f"one of {', '.join(map(repr, names))}{_because(why)}", lambda v: v in names)


def text(valid: str = "a str", test: Callable[[str], bool] = lambda v: True) -> Rule:
    return Rule((str,), valid, test)


FLAG = Rule((bool,), "True or False")
PATH = text("a path (a str; '' = none)")
POSITIVE = number(0, low_open=True)
NON_NEGATIVE = number(0)
FRACTION = number(0, 1)
SEED_MAX = 2**32 - 1  # derived seeds ((seed + step) * 1000 + stream * 1e9, train.py) stay far inside int64
DEMO_IDS = NUM_BYTES + len(SPECIALS)  # ids the demo BPE holds before any merge: the bytes and its specials
LOGGERS = ("none", "tensorboard", "wandb")  # metrics.MetricsLog's sinks (metrics.py imports this file, not back)


def _device_ok(name: str) -> bool:
    try:
        return torch.device(name).type in ("cpu", "cuda")
    except RuntimeError:  # torch's error for a string that names no device
        return False


def _task_specs_ok(specs) -> bool:
    return len(specs) > 0 and all(isinstance(s, (list, tuple)) and len(s) == 2 and isinstance(s[0], str)
                                  and isinstance(s[1], dict) for s in specs)


# Every TrainConfig field, in declaration order (a test checks that none is missing). Ranges that
# depend on another field (probe_size < group_size, max_prompt_tokens <= max_seq_len - ...) are RELATIONS.
RULES: dict[str, Rule] = {
    "out_dir": text("a folder path (a non-empty str)", lambda v: bool(v.strip())),
    "seed": integer(0, SEED_MAX),
    "device": text("'cpu', 'cuda' or 'cuda:<index>'", _device_ok),
    "init_from": PATH,
    "init_hf": PATH,
    "dry_run": FLAG,
    "gpus_per_node": integer(1),
    "ep": integer(1),
    "dtype": one_of("auto", "bfloat16", "float32"),
    "activation_checkpoint": FLAG,
    "compile": FLAG,
    "dist_timeout_s": number(0, low_open=True, why="seconds; a dead rank must not hang the job"),
    "ckpt_every": integer(0, why="0 = no checkpoints"),
    "ckpt_keep": integer(1),
    "resume": text("'', 'auto' or a checkpoint folder"),
    "logger": one_of(*LOGGERS),
    "model": Rule((ModelConfig,), "a ModelConfig (a config file sets it as model = dict(field=value, ...))"),
    "train_data": PATH,
    "eval_data": PATH,
    "system_prompt": text(),
    "tasks": Rule((list, tuple), "a non-empty list of (reasoning-gym dataset name, kwargs dict) pairs", _task_specs_ok),
    "train_seed": integer(0),
    "train_size": integer(1),
    "eval_seed": integer(0),
    "eval_size": integer(1),
    "bpe_merges": integer(0),
    "sft_steps": integer(0),
    "sft_batch_size": integer(1),
    "sft_lr": POSITIVE,
    "rl_steps": integer(0),
    "prompts_per_step": integer(1),
    "group_size": integer(2, why="a group-relative advantage needs two rollouts"),
    "max_new_tokens": integer(1),
    "max_prompt_tokens": integer(why="0 = all that fits, else 1..max_seq_len - max_new_tokens"),
    "temperature": number(0, low_open=True, why="the trainer's logprobs and RL-ZVP divide by it; greedy evals "
                                                "use their own 0"),
    "top_p": number(0, 1, low_open=True),
    "top_k": integer(0, why="0 = off"),
    "gen_batch_rows": integer(1),
    "engine": one_of(*ENGINES),
    "sglang_urls": text(),
    "sglang_mem_fraction": number(0, 1, low_open=True, high_open=True),
    "rollout_fp8": FLAG,
    "lr": POSITIVE,
    "lr_warmup_steps": integer(0),
    "weight_decay": NON_NEGATIVE,
    "grad_clip": number(0, low_open=True, why="a max norm; a negative one would flip the gradient"),
    "num_minibatches": integer(1),
    "microbatch_tokens": integer(1),
    "loss_type": one_of(*LOSS_TYPES),
    "aggregation": one_of("", *AGGREGATIONS, why="'' = the loss's paper default"),
    "adv_scale_by_std": FLAG,
    "adv_std_over": one_of("group", "batch"),
    "espo_alpha": POSITIVE,
    "espo_top_frac": number(0, 1, low_open=True),
    "espo_num_bins": integer(1),
    "clip_eps_low": number(why="< 0 = the loss's paper value"),
    "clip_eps_high": number(why="< 0 = the loss's paper value"),
    "kl_coef": number(0, why="a weight on a penalty; a negative one would reward drifting from the reference"),
    "kl_estimator": one_of(*KL_ESTIMATORS),
    "tis_cap": number(0, why="0 = off"),
    "icepop_low": NON_NEGATIVE,
    "icepop_high": number(0, why="0 = off"),
    "router_replay": FLAG,
    "skip_prob": FRACTION,
    "skip_half_life": POSITIVE,
    "pass_rate_file": PATH,
    "probe_size": integer(0, why="0 = off"),
    "probe_stop_threshold": FRACTION,
    "enlarged_group_size": integer(0, why="0 = group_size"),
    "zero_variance": one_of("drop", "rl-zvp"),
    "zvp_alpha": NON_NEGATIVE,
    "oversample_rounds": integer(0),
    "overlong_buffer": integer(0, why="0 = off"),
    "repetition_weight": number(0, why="a penalty's weight; a negative one would pay for repeats"),
    "reward_model": one_of(*REWARD_MODELS),
    "rm_weight": NON_NEGATIVE,
    "judge_dead_band": number(0, 0.5, high_open=True),
    "shaping_margin": number(0, 0.5, high_open=True, why="at 1/2 a correct answer could get a negative advantage"),
    "reward_workers": integer(0),
    "reward_timeout_s": POSITIVE,
    "max_staleness": integer(0),
    "rollout_threads": integer(0),
    "trainer_threads": integer(0),
    "eval_every": integer(1, why="RL steps between evals"),
    "eval_samples": integer(1),
    "eval_batch_rows": integer(1),
}

# Every ModelConfig field, checked as `model.<field>`; ModelConfig's own __post_init__ checks the relations
# between them (n_heads a multiple of n_kv_heads, top_k <= num_experts, ...) as it is built.
MODEL_RULES: dict[str, Rule] = {
    **{k: integer(1) for k in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "num_experts",
                               "top_k", "moe_inter_dim", "n_group", "topk_group", "max_seq_len")},
    **{k: integer(0) for k in ("num_shared_experts", "first_k_dense_replace", "dense_inter_dim",
                               "rope_original_max_seq_len")},
    **{k: FLAG for k in ("norm_topk_prob", "qk_norm", "attention_bias", "attention_out_bias", "yarn_truncate",
                         "tie_embeddings")},
    **{k: POSITIVE for k in ("routed_scaling_factor", "rope_theta", "rope_factor", "yarn_beta_fast",
                             "yarn_beta_slow", "norm_eps", "init_std")},
    "router": one_of("softmax", "sigmoid"),  # model.py's routers
    "partial_rotary_factor": number(0, 1, low_open=True),
    "rope_type": one_of("default", "linear", "yarn"),  # model.rope_frequencies' types
    "rope_attention_factor": number(0, why="0 = YaRN's 0.1 ln(s) + 1"),
    "hf_model_type": one_of(*HF_MODEL_TYPES),
}


def _world() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))  # set by torchrun; absent in a plain python run


def _cuda_ok(device: str) -> bool:
    d = torch.device(device)
    return d.type != "cuda" or torch.cuda.is_available() and (d.index or 0) < torch.cuda.device_count()


# Checks that span fields, each (holds(cfg), message(cfg)), run in order once every field passed its
# Rule. The concerns' own configs (LossConfig, FilterConfig, ...) check these too; here the message
# names the field a user sets.
RELATIONS: list[tuple[Callable[[TrainConfig], Any], Callable[[TrainConfig], str]]] = [
    (lambda c: bool(c.train_data) == bool(c.eval_data),
     lambda c: f"train_data={c.train_data!r}, eval_data={c.eval_data!r}: give both (a dataset file to train on and "
               f"one held out for the evals), or neither (reasoning-gym's tasks)"),
    (lambda c: not (c.init_hf and c.init_from),
     lambda c: f"init_from={c.init_from!r}: start from init_hf={c.init_hf!r} or from init_from, not both"),
    (lambda c: c.train_data or c.eval_seed > c.train_seed + c.train_size,
     lambda c: f"eval_seed={c.eval_seed}: must exceed train_seed + train_size = {c.train_seed + c.train_size}, or "
               f"the held-out items overlap the training ones"),
    (lambda c: c.sft_batch_size >= _world(),
     lambda c: f"sft_batch_size={c.sft_batch_size}: need at least the world size {_world()}"),
    (lambda c: not c.model.tie_embeddings or _world() == 1,  # parallelize shards lm_head and the embedding apart
     lambda c: f"model.tie_embeddings=True (a checkpoint's tie_word_embeddings): one process only for now; "
               f"WORLD_SIZE={_world()}"),
    (lambda c: c.model.num_experts % c.ep == 0,
     lambda c: f"ep={c.ep}: must divide model.num_experts={c.model.num_experts}"),
    (lambda c: _world() == 1 or _world() % c.ep == 0,
     lambda c: f"ep={c.ep}: must divide the world size {_world()}"),
    (lambda c: _cuda_ok(c.device),
     lambda c: f"device={c.device!r}: this machine has {torch.cuda.device_count()} CUDA devices; use device='cpu'"),
    (lambda c: not c.rollout_fp8 or c.engine == "sglang" or _world() == 1,
     lambda c: f"rollout_fp8=True: the sharded native engine (WORLD_SIZE={_world()}) has no FP8 rollouts; use "
               f"engine='sglang' or one process"),
    (lambda c: c.top_k <= c.model.vocab_size,
     lambda c: f"top_k={c.top_k}: need 0 (off) or at most model.vocab_size={c.model.vocab_size}"),
    (lambda c: c.init_hf or c.init_from or c.bpe_merges <= c.model.vocab_size - DEMO_IDS,
     lambda c: f"bpe_merges={c.bpe_merges}: the demo tokenizer needs bpe_merges <= model.vocab_size - {DEMO_IDS} = "
               f"{c.model.vocab_size - DEMO_IDS} (model.vocab_size={c.model.vocab_size}; {NUM_BYTES} bytes and "
               f"{len(SPECIALS)} specials)"),
    (lambda c: not c.system_prompt or c.init_hf or c.init_from,
     lambda c: f"system_prompt={c.system_prompt[:40]!r}: goes in a chat template, which only a checkpoint's "
               f"tokenizer has (init_hf or init_from); the demo tokenizer has none"),
    (lambda c: c.probe_size == 0 or 2 <= c.probe_size < c.group_size,
     lambda c: f"probe_size={c.probe_size}: use 0 (off) or 2..{c.group_size - 1} (below group_size={c.group_size})"),
    (lambda c: c.enlarged_group_size == 0 or c.probe_size and c.enlarged_group_size >= c.group_size,
     lambda c: f"enlarged_group_size={c.enlarged_group_size}: 0 (= group_size) or >= group_size={c.group_size}; "
               f"it needs probe_size > 0 (probe_size={c.probe_size})"),
    (lambda c: not c.pass_rate_file or c.skip_prob > 0 or c.probe_size > 0,
     lambda c: f"pass_rate_file={c.pass_rate_file!r}: read by stage 1 (skip_prob > 0) and stage 2 (probe_size > 0), "
               f"and both are off"),
    (lambda c: c.overlong_buffer <= c.max_new_tokens,
     lambda c: f"overlong_buffer={c.overlong_buffer}: at most max_new_tokens={c.max_new_tokens}"),
    (lambda c: c.aggregation != "seq-mean-bin-mean-token-mean" or c.loss_type == "espo",
     lambda c: f"aggregation={c.aggregation!r}: ESPO's entropy bins; only with loss_type='espo' "
               f"(loss_type={c.loss_type!r})"),
    (lambda c: not (c.tis_cap > 0 and c.icepop_high > 0),
     lambda c: f"tis_cap={c.tis_cap}: 0 (off) when icepop_high={c.icepop_high} > 0; one mismatch correction at a time"),
    (lambda c: c.icepop_low == 0 == c.icepop_high or c.icepop_low < c.icepop_high,
     lambda c: f"icepop_low={c.icepop_low}: need icepop_low < icepop_high={c.icepop_high} (icepop_high > 0 turns "
               f"IcePop on; without it icepop_low would be silently unused)"),
    (lambda c: c.max_staleness > 0 or c.rollout_threads == c.trainer_threads == 0,
     lambda c: f"rollout_threads={c.rollout_threads}, trainer_threads={c.trainer_threads}: read only with "
               f"max_staleness > 0 (async rollouts); leave them 0"),
]


def check_fields(cfg: TrainConfig):
    """Each field of cfg and of cfg.model against its Rule (RULES, MODEL_RULES), no file opened, so
    cheap enough for a dry run. Raises ValueError `<field>=<value!r>: need <what is valid>`."""
    for name, rule in RULES.items():
        rule.check(name, getattr(cfg, name))
    for name, rule in MODEL_RULES.items():
        rule.check(f"model.{name}", getattr(cfg.model, name))


def check_config(cfg: TrainConfig):
    """Refuse settings that cannot run, before any work (tokenizer, SFT): every field's Rule, the
    RELATIONS, the concerns' own configs, then every file the run reads (`check_files`). Raises
    ValueError naming the field (or the file), its value and what would be valid."""
    check_fields(cfg)
    for holds, problem in RELATIONS:
        if not holds(cfg):
            raise ValueError(problem(cfg))
    cfg.prompt_limit()
    # each builds and checks its own settings: a backstop behind RELATIONS, which name the fields first
    cfg.loss_config(), cfg.filter_config(), cfg.sampling_params(), cfg.reward_config()
    dataclasses.replace(cfg.model)  # ModelConfig's own relations again, for a model changed after it was built
    check_sglang_config(cfg)  # engine, sglang_urls, sglang_mem_fraction, and what engine='sglang' needs
    check_files(cfg)


# ----------------------------------------------------------------------------- the files a run reads

def check_files(cfg: TrainConfig):
    """Open and check every file the run will read, before any work: the data files (every row;
    and enough held-out rows unseen in training), the pass-rate file, the checkpoint folder
    (init_hf or init_from), reasoning-gym's task specs, and the resume checkpoint. Raises ValueError
    naming the field and the file (and line, where a file has lines)."""
    for key in ("train_data", "eval_data", "pass_rate_file"):
        path = getattr(cfg, key)
        if path and not os.path.exists(path):  # exists: a parquet dataset may be a folder
            raise ValueError(f"{key}={path!r}: no such file")
    if os.path.exists(cfg.out_dir) and not os.path.isdir(cfg.out_dir):
        raise ValueError(f"out_dir={cfg.out_dir!r}: a file is there; need a folder (or nothing, to create one)")
    tok = None
    for key in ("init_hf", "init_from"):
        if getattr(cfg, key):
            tok = _check_checkpoint(cfg, key)
    if cfg.train_data:
        _check_data(cfg, tok)
    else:
        _check_tasks(cfg)
    if cfg.pass_rate_file:
        try:  # a throwaway history: the parse the run does, one line at a time
            PromptHistory().load_offline(cfg.pass_rate_file)
        except (OSError, ValueError, TypeError, AttributeError, KeyError) as e:  # a folder, bad bytes, a bad row
            raise ValueError(f"pass_rate_file={cfg.pass_rate_file!r}: {e}") from None
    from checkpoint import COMPLETE_MARKER  # lazily: checkpoint imports distributed, a heavier import
    # a named folder's marker only: whether it loads is checkpoint.resume_checkpoint's, a collective under torchrun
    if cfg.resume not in ("", "auto") and not os.path.isfile(os.path.join(cfg.resume, COMPLETE_MARKER)):
        raise ValueError(f"resume={cfg.resume!r}: not a complete checkpoint folder (valid: '', 'auto', or a folder "
                         f"holding {COMPLETE_MARKER})")


def _load(key: str, path: str):
    """load_task(path), its errors named by field (the message names the file and line)."""
    try:
        return load_task(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"{key}={path!r}: {e}") from None


def _check_data(cfg: TrainConfig, tok: Tokenizer | None):
    """Every row of both data files, then enough held-out prompts as start_run takes them: eval_size
    unseen in training and, with a checkpoint's tokenizer at hand, within the prompt limit."""
    task, held_out = _load("train_data", cfg.train_data), _load("eval_data", cfg.eval_data)
    unseen = held_out.exclude({it.question for it in task.items})
    if len(unseen) < cfg.eval_size:
        raise ValueError(f"eval_size={cfg.eval_size}: eval_data={cfg.eval_data!r} has {len(held_out)} usable rows, "
                         f"{len(unseen)} of them unseen in train_data; need at least eval_size")
    if tok is not None:  # the demo tokenizer is learned from the prompts at start: no lengths before then
        limit, fits = cfg.prompt_limit(), 0
        for it in unseen:
            try:
                fits += len(tok.prompt_ids(held_out.user_message(it), cfg.system_prompt)) <= limit
            except Exception as e:  # noqa: BLE001  the checkpoint's chat template may raise jinja2's errors too
                raise ValueError(f"eval_data={cfg.eval_data!r}: a prompt does not render in the checkpoint's chat "
                                 f"template ({type(e).__name__}: {e})") from None
            if fits == cfg.eval_size:
                return
        raise ValueError(f"eval_size={cfg.eval_size}: only {fits} prompts of eval_data={cfg.eval_data!r} unseen in "
                         f"training fit max_prompt_tokens={limit} (max_seq_len={cfg.model.max_seq_len} - "
                         f"max_new_tokens={cfg.max_new_tokens} when 0); longer ones are skipped")


def _check_tasks(cfg: TrainConfig):
    """Each reasoning-gym spec builds (its name is registered, its kwargs are accepted), as one item."""
    import reasoning_gym  # here: only a run without train_data needs it (reward.TaskMix imports it so too)
    for i, (name, kwargs) in enumerate(cfg.tasks):
        try:
            reasoning_gym.create_dataset(name, seed=cfg.train_seed, size=1, **kwargs)
        except Exception as e:  # noqa: BLE001  reasoning-gym raises ValueError, KeyError, TypeError, AssertionError
            raise ValueError(f"tasks[{i}]=({name!r}, {kwargs!r}): reasoning-gym refuses it "
                             f"({type(e).__name__}: {e})") from None


def _read_json(name: str, path: str, file: str, default=None):
    """json of folder path's file, or default if absent (None: required). Raises ValueError naming it."""
    full = os.path.join(path, file)
    if not os.path.isfile(full):
        if default is not None:
            return default
        raise ValueError(f"{name}: holds no {file}; need a hub-layout checkpoint folder (config.json, "
                         f"*.safetensors, tokenizer.json)")
    try:
        with open(full, encoding="utf-8") as f:
            return json.load(f)
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
        raise ValueError(f"{name}: {file} is not JSON ({e})") from None


def _check_weights(name: str, path: str):
    """The safetensors files exist (every one the index names) and their headers read."""
    from safetensors import safe_open
    index = _read_json(name, path, "model.safetensors.index.json", default={})
    if index:
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{name}: model.safetensors.index.json has no weight_map of tensor -> file")
        files = sorted(set(weight_map.values()))
    elif os.path.isfile(os.path.join(path, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        raise ValueError(f"{name}: holds no model.safetensors or model.safetensors.index.json; need a hub-layout "
                         f"checkpoint folder")
    for file in files:
        if not os.path.isfile(os.path.join(path, file)):
            raise ValueError(f"{name}: {file}, named in model.safetensors.index.json, is not there")
        try:
            with safe_open(os.path.join(path, file), "pt") as f:
                f.keys()
        except Exception as e:  # noqa: BLE001  safetensors' SafetensorError subclasses nothing of ours
            raise ValueError(f"{name}: {file} is not a readable safetensors file ({e})") from None


def _check_checkpoint(cfg: TrainConfig, key: str) -> Tokenizer:
    """A hub-layout folder: config.json the model matches, weights, and the tokenizer (loaded; it fits
    the vocabulary and holds a chat template if system_prompt needs one). Returns the tokenizer."""
    path = getattr(cfg, key)
    name = f"{key}={path!r}"
    if not os.path.isdir(path):
        raise ValueError(f"{name}: no such folder")
    hf_config = _read_json(name, path, "config.json")
    try:
        want = config_from_hf(hf_config)
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{name}: config.json: {e}") from None
    if isinstance(hf_config, dict) and hf_config.get("quantization_config"):
        raise ValueError(f"{name}: config.json is quantised ({hf_config['quantization_config']}); only "
                         f"unquantised weights load")
    # as hf.load_hf compares: max_seq_len only bounds the positions, init_std is no function, and
    # dense_inter_dim is read only by dense blocks
    ignore = {"max_seq_len", "init_std"} | ({"dense_inter_dim"} if not want.first_k_dense_replace else set())
    differ = {k: (v, getattr(want, k)) for k, v in vars(cfg.model).items() if k not in ignore and getattr(want, k) != v}
    if differ:
        first = next(iter(differ))
        raise ValueError(f"model.{first}={differ[first][0]!r}: {path}/config.json has {differ[first][1]!r} ({key} "
                         f"loads its weights into the configured model); all that differ (config, file): {differ}")
    _check_weights(name, path)
    for file in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):  # each named if broken
        _read_json(name, path, file, default=None if file == "tokenizer.json" else {})
    try:
        tok = load_hf_tokenizer(path)
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{name}: its tokenizer: {e}") from None
    check_tokenizer(cfg, tok, name)
    return tok


def check_tokenizer(cfg: TrainConfig, tok: Tokenizer, source: str):
    """The run's tokenizer fits the model (its ids within vocab_size) and has a chat template when
    system_prompt needs one; source names it in the error (a checkpoint folder, or the demo BPE)."""
    if tok.enc.n_vocab > cfg.model.vocab_size:
        raise ValueError(f"model.vocab_size={cfg.model.vocab_size}: the tokenizer of {source} has "
                         f"{tok.enc.n_vocab} ids; need at least as many embedding rows")
    if cfg.system_prompt and tok.chat_template is None:
        raise ValueError(f"system_prompt={cfg.system_prompt[:40]!r}: the tokenizer of {source} has no chat template "
                         f"to put it in")
