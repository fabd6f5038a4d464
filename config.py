"""Configuration: TrainConfig, composed of one section per concern, and how a run's is built.

TrainConfig holds the run-wide settings and the loop's own (steps, learning rate, evals,
checkpoints: train.py alone reads them) and one section per concern a lower file owns, each a
dataclass declared beside the code that reads it: `model` (model.ModelConfig), `sampling`
(sampler.SamplingParams), `loss` (espo.LossConfig), `filter` (filter.FilterConfig), `reward`
(reward.RewardConfig), `engine` (EngineConfig, here: rollout.ENGINES holds the engines) and `tools`
(tool_calls.ToolConfig).
A value comes from the defaults, then a config file (configs/*.py: deltas only, a section as a
dict: `loss = dict(type="grpo")`), then `key=value` or `section.field=value` on the command line.
`load_config` checks it once: every field against the rule declared beside it (each class's
RULES, rules.py), then RELATIONS, the checks across sections. What only building the run can
find (a checkpoint's tensors, the held-out prompts that fit) is a ConfigError, still before work.

Notable choices:
1. A config file is Python run by runpy, so it can compute values and import what it needs (`from
   configs.x import *` included). A public name that is a setting (a field, a section or a MOVED key)
   is checked by that setting's rule whatever it is bound to (`def lr(): ...` is refused, naming lr
   and "a function"); any other public name bound to a module, function or class is the file's helper
   and dropped; any other value is an unknown key. Whatever the file raises, SystemExit and
   KeyboardInterrupt included, is a ValueError naming its line, and os._exit is refused.
2. A command-line value is parsed by its field's rule (the type is declared there once); lists
   and dicts are set in a config file only.
3. An unknown key is a ValueError naming the close matches; a key that moved into a section
   names its new home (`tis_cap` -> `loss.tis_cap`, MOVED).
4. "Off" is None where 0 would be a valid value (`loss.tis_cap`, `loss.clip_eps_low`), `none` on
   the command line; no field holds a sentinel that a builder translates.
5. With init_hf the model's shape is the checkpoint's config.json, read here, and unset fields
   take CHECKPOINT_DEFAULTS; with init_from the configured model must match the checkpoint's.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import runpy
import traceback
import types
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable
from urllib.parse import urlsplit

import torch

from espo import LossConfig
from filter import FilterConfig
from hf_config import read_config, shape_differences
from model import ModelConfig
from paged_kv import PAGE_SIZE, PREFILL_TOKENS, too_few_pages
from reward import RewardConfig
from rules import FLAG, NON_NEGATIVE, PATH, POSITIVE, Rule, check_fields, integer, kind, number, one_of, section, text
from sampler import SamplingParams
from tool_calls import ToolConfig


class ConfigError(ValueError):
    """A setting or file found wrong while the run is built, still before any work: a `config error:` line."""


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
    max_prompt_tokens=1024, num_minibatches=4, microbatch_tokens=16384, gen_batch_rows=2048, eval_every=25,
    eval_size=500, eval_batch_rows=2048, ckpt_every=50, sampling=dict(max_new_tokens=4096))
LOGGERS = ("none", "tensorboard", "wandb")  # metrics.MetricsLog's sinks
SEED_MAX = 2**32 - 1  # derived seeds ((seed + step) * 1000 + stream * 1e9, train.py) stay far inside int64


# ----------------------------------------------------------------------------- the engine section

def parse_sglang_urls(text: str) -> list[str]:
    """Base URLs ("http://host:port") of `engine.sglang_urls`, comma-separated; [] for "". Raises ValueError
    naming sglang_urls on an entry that is not a base URL, or on one listed twice."""
    if not text.strip():
        return []
    urls = []
    for raw in text.split(","):
        parts = urlsplit(raw.strip())
        try:
            bad = (parts.scheme not in ("http", "https") or not parts.hostname or parts.path.strip("/")
                   or parts.query or parts.fragment or parts.port == 0)
        except ValueError:  # .port of a non-numeric port
            bad = True
        if bad:
            raise ValueError(f"sglang_urls={text!r}: {raw.strip()!r} is not a server's base URL; expected "
                             f"http://host:port, comma-separated (e.g. 'http://10.0.0.2:30000,http://10.0.0.3:30000')")
        urls.append(f"{parts.scheme}://{parts.netloc}")
    if twice := sorted({u for u in urls if urls.count(u) > 1}):
        raise ValueError(f"sglang_urls={text!r} lists {twice[0]} twice: each server joins the weight sync once")
    return urls


@dataclass(frozen=True)
class EngineConfig:
    """The rollout engine: the run's `engine` section. Its name is checked against rollout.ENGINES (the
    registry) while the run is built; what name='sglang' needs of the rest of the run is RELATIONS'."""
    name: str = "native"
    """'native' (rollout.NativeEngine, PyTorch; under torchrun it decodes on the policy's own shards, no replica)
    or 'sglang' (sglang_engine.py: CUDA and the sglang package only): a name in rollout.ENGINES."""
    sglang_urls: str = ""
    """name='sglang': comma-separated base URLs of external SGLang servers (weights pushed over an NCCL group);
    "" = one SGLang engine per node colocated on the training GPUs, its memory released while the trainer trains."""
    sglang_mem_fraction: float = 0.0
    """name='sglang', colocated: the fraction of each GPU's memory SGLang's static pool (weights, KV cache) may take
    (its mem_fraction_static); 0 = the largest that leaves room for the trainer's state (plan.colocated_sglang,
    which also refuses a larger one before any work)."""
    fp8: bool = False
    """Rollouts with blockwise-FP8 weights (DeepSeek-V3's recipe): SGLang's FP8 serving, or the native engine in
    one process; the trainer stays bf16/fp32."""
    slots: int = 0
    """name='native': continuous batching (batching.ContinuousBatch). 0 = static calls: a step's rows go to the
    engine in generate calls of gen_batch_rows rows (eval_batch_rows for an eval), each decoding until its longest
    row stops, batched by predicted length (scheduler.generation_batches). slots > 0 = each generate round of a
    step, and each eval pass, is one call per rank holding all of its rows, of which `slots` decode at once, a
    stopped row's slot taking the next: slots replaces gen_batch_rows and eval_batch_rows as the bound on live rows
    (the KV cache holds that many rows; the dry run's plan sizes it so), and the length buckets have nothing left to do (the scheduler
    only deals the prompts over the ranks, longest-first round-robin, for balance). Reward workers then start
    scoring when the call returns. Under torchrun the ranks decode in lockstep, each MoE layer's all-to-all on
    fixed buffers of `slots` tokens (ep_decode.capacity_dispatch): no host sync per layer."""
    cuda_graph: bool = False
    """slots > 0: capture each generate call's decode step in a CUDA graph (graph_decode.GraphedDecode) at its first
    step and replay it at every later one, the step's kernel launches in one. Needs device='cuda' and bf16 (the
    experts' fp32 grouped GEMMs read their offsets on the host, which a capture refuses); every step then attends
    all of the call's cache columns, so logprobs differ from the eager step's by float rounding. Not yet run on a GPU."""
    page_size: int = PAGE_SIZE
    """With slots: the KV cache's page, in columns (paged_kv.PagedKVCache): memory goes to rows a page at a time,
    as they grow, and comes back when they stop; a row wastes under one page."""
    prefill_tokens: int = PREFILL_TOKENS
    """With slots: the most prompt tokens one admission round prefills (its new prompts; one prompt whatever its
    length), SGLang's max_prefill_tokens: it bounds a round's prefill activations (the dry run's plan sizes them
    so); the rows it leaves wait for the next round, before the next decode step."""
    kv_tokens: int = 0
    """With slots: the KV pages' columns in all, per rank (what the dry run's plan sizes the cache by). 0 = enough
    for every slot at full length (slots x (max_prompt_tokens + max_new_tokens) and one prompt's pages): no row
    is ever preempted. Fewer: a call keeps `slots` rows live while their tokens fit, and when a growing row finds
    no free page a younger row is preempted and generated again later, never an older one, so the oldest row
    always finishes and so does the call (batching.ContinuousBatch's choice 6); each step logs the most of the
    pool its rows held (engine/kv_live_bytes) and its preemptions (engine/preemptions), to size this by."""

    RULES = {  # each field's type and range (rules.py); not a field: no annotation
        "name": text("an engine's name in rollout.ENGINES ('native', 'sglang')", lambda v: bool(v.strip())),
        "sglang_urls": text("comma-separated http://host:port base URLs ('' = colocated)"),
        "sglang_mem_fraction": number(0, 1, high_open=True, why="0 = from the plan, else a fraction below 1"),
        "fp8": FLAG,
        "slots": integer(0, why="0 = static generate calls, else how many rows decode at once"),
        "cuda_graph": FLAG,
        "page_size": integer(1, why="columns a KV page holds"),
        "prefill_tokens": integer(1, why="prompt tokens one admission round prefills"),
        "kv_tokens": integer(0, why="0 = every slot at full length, else the KV pages' columns in all"),
    }

    def __post_init__(self):
        check_fields(self)
        if self.urls and self.name != "sglang":
            raise ValueError(f"sglang_urls={self.sglang_urls!r} is read only with name='sglang' (name={self.name!r})")
        # the native engine's continuous batching, which a recipe may set: with SGLang (which batches on its own)
        # slots only sends each generate round as one request batch, and the page settings are left unread, said at
        # start, so switching engines is one setting
        if self.slots and self.name != "native":
            warnings.warn(f"engine.slots={self.slots} with name={self.name!r}: each generate round goes to the server "
                          f"as one batch of requests (SGLang batches continuously on its own); page_size, kv_tokens, "
                          f"prefill_tokens and cuda_graph, the native engine's paging, are not read")
        elif self.kv_tokens and not self.slots:
            warnings.warn(f"engine.kv_tokens={self.kv_tokens}: the pages of continuous batching, not read with "
                          "engine.slots=0 (static generate calls hold gen_batch_rows rows at full length)")
        if self.cuda_graph and not self.slots:
            raise ValueError("cuda_graph=True captures the continuous-batching decode step: set slots > 0 (the "
                             "static engine's step has compile for its launch cost)")

    @property
    def urls(self) -> list[str]:
        """The external SGLang servers' base URLs ([] = colocated)."""
        return parse_sglang_urls(self.sglang_urls)


# ----------------------------------------------------------------------------- the run's settings

def _device_ok(name: str) -> bool:
    try:
        return torch.device(name).type in ("cpu", "cuda")
    except RuntimeError:  # torch's error for a string that names no device
        return False


def _task_specs_ok(specs) -> bool:
    return len(specs) > 0 and all(isinstance(s, (list, tuple)) and len(s) == 2 and isinstance(s[0], str)
                                  and isinstance(s[1], dict) for s in specs)


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
    """Steps (SFT steps and RL steps counted together) between checkpoints under out_dir/ckpt (0 = none)."""
    ckpt_keep: int = 2
    """Complete checkpoints kept (>= 1), counted up to the position just written; older ones are deleted once a
    newer one is complete."""
    resume: str = ""
    """"" = start afresh; "auto" = the newest complete checkpoint in out_dir/ckpt that loads (newer ones that do not
    are skipped with a warning naming them); or a checkpoint folder."""
    resume_changed: bool = False
    """With resume set: continue a checkpoint written with other settings (all but checkpoint.RESUMABLE), each change
    printed as `name: old -> new`; without it such a resume is an error naming them, before any work."""
    logger: str = "none"
    """Metrics sink besides metrics.jsonl and the console: 'none', 'tensorboard' or 'wandb' (imported lazily)."""
    # task
    train_data: str = ""
    """Training prompts: a JSONL or parquet file of GSM8K, MATH or HumanEval rows (the format is read from the
    fields; data.load_task). "" = the reasoning-gym `tasks`. Needs eval_data."""
    eval_data: str = ""
    """Held-out prompts for the evals, a file as train_data (the first eval_size rows that fit)."""
    system_prompt: str = ""
    """System message of a chat template's prompt ("" = none); only with a checkpoint's chat template."""
    tasks: list = field(default_factory=lambda: list(DEFAULT_TASKS))
    """(reasoning-gym dataset name, kwargs) pairs, mixed round-robin (without train_data)."""
    train_seed: int = 1
    """reasoning-gym seed of the training pool."""
    train_size: int = 8_000
    """Training prompts generated; eval_seed must exceed train_seed + train_size."""
    eval_seed: int = 1_000_000
    """reasoning-gym seed of held-out prompts (items also seen in training are dropped)."""
    eval_size: int = 1000
    """Held-out prompts per eval; the run refuses to start if fewer are unseen in training."""
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
    max_prompt_tokens: int = 0
    """Longest prompt, in tokens (verl's max_prompt_length): longer ones are skipped, counted and logged.
    0 = model.max_seq_len - sampling.max_new_tokens, all that fits. The dry run's engine plan sizes its KV cache
    by it."""
    gen_batch_rows: int = 256
    """Rows (prompts x G) per engine.generate call on each rank (the KV cache holds this many); a call holds at
    least one prompt whatever this is. Under torchrun a generation batch spans every rank: world x this."""
    lr: float = 5e-5
    """RL AdamW learning rate (constant after a short warm-up)."""
    lr_warmup_steps: int = 5
    """Steps of linear warm-up at the start of both the SFT schedule (SFT steps) and the RL schedule (RL steps)."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    grad_clip: float = 1.0
    """Max global gradient norm (L2, over all parameters and ranks) before each optimizer step; > 0, no off value."""
    num_minibatches: int = 2
    """Optimizer steps per rollout batch (PPO-style; >1 makes ratios leave 1 and clipping matter)."""
    microbatch_tokens: int = 8192
    """Padded-token budget of one micro-batch (one forward/backward): rows x the longest row's tokens."""
    router_replay: bool = True
    """Replay the engine's routed experts in every trainer forward (R3)."""
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
    eval_before_rl: bool = True
    """Evaluate before the first RL step (the summary's "before" column and the RL gain). False: the first
    optimizer step comes one eval pass sooner (at scale, eval_size prompts of up to max_new_tokens each)."""
    eval_samples: int = 4
    """Completions per held-out prompt for the sampled accuracy (mean@k at the rollout temperature)."""
    eval_batch_rows: int = 512
    """Rows (prompts x completions each) per eval generate call."""
    # the sections: each concern's settings, declared (and checked) beside the code that reads them
    model: ModelConfig = field(default_factory=ModelConfig)
    """The network's shape (model.py)."""
    sampling: SamplingParams = field(default_factory=SamplingParams)
    """How rollouts are sampled (sampler.py)."""
    loss: LossConfig = field(default_factory=LossConfig)
    """The policy loss, its train-inference corrections and the advantages (espo.py)."""
    filter: FilterConfig = field(default_factory=FilterConfig)
    """Zero-variance elimination, stages 1-3 (filter.py)."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Reward shaping inside the correctness class, and the reward workers (reward.py, scoring.py)."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    """The rollout engine (rollout.py, sglang_engine.py)."""
    tools: ToolConfig = field(default_factory=ToolConfig)
    """The tools a rollout may call and the limits on its calls (tool_calls.py; none by default)."""

    # Ranges that depend on another field (max_prompt_tokens <= max_seq_len - ...) are RELATIONS.
    RULES = {  # each field's type and range (rules.py); not a field: no annotation
        **{k: integer(1) for k in ("gpus_per_node", "ep", "ckpt_keep", "train_size", "eval_size", "sft_batch_size",
                                   "prompts_per_step", "gen_batch_rows", "num_minibatches", "microbatch_tokens",
                                   "eval_samples", "eval_batch_rows")},
        **{k: integer(0) for k in ("train_seed", "eval_seed", "bpe_merges", "sft_steps", "rl_steps", "lr_warmup_steps",
                                   "max_staleness", "rollout_threads", "trainer_threads")},
        **{k: FLAG for k in ("dry_run", "activation_checkpoint", "compile", "router_replay", "resume_changed",
                             "eval_before_rl")},
        **{k: PATH for k in ("init_from", "init_hf", "train_data", "eval_data")},
        **{k: POSITIVE for k in ("sft_lr", "lr")},
        "out_dir": text("a folder path (a non-empty str)", lambda v: bool(v.strip())),
        "seed": integer(0, SEED_MAX),
        "device": text("'cpu', 'cuda' or 'cuda:<index>'", _device_ok),
        "dtype": one_of("auto", "bfloat16", "float32"),
        "dist_timeout_s": number(0, low_open=True, why="seconds; a dead rank must not hang the job"),
        "ckpt_every": integer(0, why="0 = no checkpoints"),
        "resume": text("'', 'auto' or a checkpoint folder"),
        "logger": one_of(*LOGGERS),
        "system_prompt": text(),
        "tasks": Rule((list, tuple), "a non-empty list of (reasoning-gym dataset name, kwargs dict) pairs",
                      _task_specs_ok, parse=None),
        "group_size": integer(2, why="a group-relative advantage needs two rollouts"),
        "max_prompt_tokens": integer(0, why="0 = all that fits, else 1..model.max_seq_len - sampling.max_new_tokens"),
        "weight_decay": NON_NEGATIVE,
        "grad_clip": number(0, low_open=True, why="a max norm; a negative one would flip the gradient"),
        "eval_every": integer(1, why="RL steps between evals"),
        **{name: section(cls) for name, cls in (("model", ModelConfig), ("sampling", SamplingParams),
                                                ("loss", LossConfig), ("filter", FilterConfig),
                                                ("reward", RewardConfig), ("engine", EngineConfig),
                                                ("tools", ToolConfig))},
    }

    def __post_init__(self):
        check_fields(self)

    def compute_dtype(self) -> torch.dtype:
        """torch's dtype for `dtype` ('auto': bfloat16 on CUDA, float32 elsewhere)."""
        if self.dtype == "auto":
            return torch.bfloat16 if torch.device(self.device).type == "cuda" else torch.float32
        return getattr(torch, self.dtype)

    def prompt_limit(self) -> int:
        """The longest prompt a run takes: max_prompt_tokens, or all that fits beside sampling.max_new_tokens.
        Raises ValueError when no prompt, or a longer one than fits, is allowed."""
        max_new, seq = self.sampling.max_new_tokens, self.model.max_seq_len
        fits = seq - max_new
        if fits < 1:  # max_new_tokens alone leaves no room: name it, not the prompt limit the user may not have set
            raise ValueError(f"sampling.max_new_tokens={max_new}: need less than model.max_seq_len={seq}, so a "
                             f"prompt of at least one token fits beside it")
        if self.max_prompt_tokens > fits:
            raise ValueError(f"max_prompt_tokens={self.max_prompt_tokens}: need 0 (all that fits) or 1..{fits} "
                             f"(model.max_seq_len={seq} - sampling.max_new_tokens={max_new})")
        return self.max_prompt_tokens or fits


SECTIONS: dict[str, type] = {f.name: f.default_factory for f in dataclasses.fields(TrainConfig)
                             if dataclasses.is_dataclass(f.default_factory)}
"""TrainConfig's sections, by field name: what `<section>.<field>=value` reaches."""
MOVED = {"loss_type": "loss.type", "icepop_low": "loss.icepop", "icepop_high": "loss.icepop", "reward_model": "reward.model",
         "reward_workers": "reward.workers", "reward_timeout_s": "reward.timeout_s", "rollout_fp8": "engine.fp8",
         **{f.name: f"{s}.{f.name}" for s in ("sampling", "loss", "filter", "reward", "engine")
            for f in dataclasses.fields(SECTIONS[s]) if f.name not in SECTIONS}}
"""Flat keys of earlier versions -> their home in a section (the error for an old command names it)."""


# ----------------------------------------------------------------------------- checks across sections

def _world() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))  # set by torchrun; absent in a plain python run


def _cuda_ok(device: str) -> bool:
    d = torch.device(device)
    return d.type != "cuda" or torch.cuda.is_available() and (d.index or 0) < torch.cuda.device_count()


# Checks across sections (a section checks its own fields' relations when built): (holds(cfg), message(cfg)),
# run in order by check_relations once every field passed its rule.
RELATIONS: list[tuple[Callable[[TrainConfig], Any], Callable[[TrainConfig], str]]] = [
    (lambda c: bool(c.train_data) == bool(c.eval_data),
     lambda c: f"train_data={c.train_data!r}, eval_data={c.eval_data!r}: give both (a dataset file to train on and "
               f"one held out for the evals), or neither (reasoning-gym's tasks)"),
    (lambda c: not c.resume_changed or c.resume,
     lambda c: "resume_changed=True is read only when resuming: set resume='auto' or a checkpoint folder"),
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
    (lambda c: c.dry_run or _cuda_ok(c.device),  # a dry run plans for another machine
     lambda c: f"device={c.device!r}: this machine has {torch.cuda.device_count()} CUDA devices; use device='cpu'"),
    (lambda c: c.sampling.temperature > 0,
     lambda c: f"sampling.temperature={c.sampling.temperature}: need > 0 for a run's rollouts (the trainer's logprobs "
               f"and RL-ZVP divide by it; greedy evals use their own 0)"),
    (lambda c: c.sampling.top_k <= c.model.vocab_size,
     lambda c: f"sampling.top_k={c.sampling.top_k}: need 0 (off) or at most model.vocab_size={c.model.vocab_size}"),
    (lambda c: not c.system_prompt or c.init_hf or c.init_from,
     lambda c: f"system_prompt={c.system_prompt[:40]!r}: goes in a chat template, which only a checkpoint's "
               f"tokenizer has (init_hf or init_from); the demo tokenizer has none"),
    (lambda c: c.filter.probe_size < c.group_size,
     lambda c: f"filter.probe_size={c.filter.probe_size}: use 0 (off) or 2..{c.group_size - 1} (below "
               f"group_size={c.group_size})"),
    (lambda c: c.filter.enlarged_group_size == 0 or c.filter.enlarged_group_size >= c.group_size,
     lambda c: f"filter.enlarged_group_size={c.filter.enlarged_group_size}: 0 (= group_size) or >= "
               f"group_size={c.group_size}"),
    # a recipe (configs/qwen3_30b_a3b_rm.py) leaves reward.model to the command line: its dry run plans without one
    (lambda c: not c.reward.rm_only or c.reward.model or c.dry_run,
     lambda c: f"reward.rm_only=True with reward.model='': the reward is the scorer's alone, and there is none, so "
               f"every reward would be 0; set reward.model to a reward model's folder, 'judge:<folder>' or a stand-in "
               f"('stub', 'stub-judge'), or reward.rm_only=False"),
    (lambda c: c.reward.overlong_buffer <= c.sampling.max_new_tokens,
     lambda c: f"reward.overlong_buffer={c.reward.overlong_buffer}: at most sampling.max_new_tokens="
               f"{c.sampling.max_new_tokens}"),
    (lambda c: c.max_staleness > 0 or c.rollout_threads == c.trainer_threads == 0,
     lambda c: f"rollout_threads={c.rollout_threads}, trainer_threads={c.trainer_threads}: read only with "
               f"max_staleness > 0 (async rollouts); leave them 0"),
    (lambda c: not c.engine.fp8 or c.engine.name == "sglang" or _world() == 1,
     lambda c: f"engine.fp8=True: the sharded native engine (WORLD_SIZE={_world()}) has no FP8 rollouts; use "
               f"engine.name='sglang' or one process"),
    (lambda c: not (c.max_staleness and _world() > 1 and torch.device(c.device).type == "cuda"),
     lambda c: f"max_staleness={c.max_staleness}: async rollouts on several GPUs are refused for now: the producer "
               f"thread's NCCL collectives would run beside the trainer thread's, which NCCL does not promise to "
               f"keep free of deadlock; use max_staleness=0 under torchrun on GPUs (async runs in one process, or "
               f"on CPU ranks)"),
    (lambda c: c.engine.name != "sglang" or c.init_hf or c.init_from,
     lambda c: "engine.name='sglang' serves a hub-layout checkpoint folder: set init_hf (or init_from, an earlier "
               "run's output folder); both are empty"),
    (lambda c: c.engine.name != "sglang" or c.engine.urls or torch.device(c.device).type == "cuda",
     lambda c: f"device={c.device!r}: engine.name='sglang' with colocated servers (engine.sglang_urls='') needs "
               f"device='cuda' (SGLang runs on CUDA GPUs only, and its weight sync uses CUDA IPC); a trainer on the "
               f"CPU reaches external servers only (set engine.sglang_urls; its weight sync then goes over gloo, as "
               f"tools/sglang_standin.py takes it)"),
    (lambda c: not (c.engine.slots and c.engine.kv_tokens and too_few_pages(c.engine.kv_tokens, c.prompt_limit(),
                                                          c.sampling.max_new_tokens, c.engine.page_size)),
     lambda c: "engine." + too_few_pages(c.engine.kv_tokens, c.prompt_limit(), c.sampling.max_new_tokens,
                                         c.engine.page_size)),
    (lambda c: not c.engine.cuda_graph or (torch.device(c.device).type, c.compute_dtype()) == ("cuda", torch.bfloat16),
     lambda c: f"engine.cuda_graph=True: a CUDA graph needs bf16 on CUDA (device='cuda' with dtype 'auto' or "
               f"'bfloat16'; the experts' fp32 grouped GEMMs read their offsets on the host); got device={c.device!r}, "
               f"dtype={c.dtype!r}, which computes in {str(c.compute_dtype()).removeprefix('torch.')}"),
    (lambda c: not (c.engine.cuda_graph and _world() > 1),
     lambda c: f"engine.cuda_graph=True under torchrun (WORLD_SIZE={_world()}): capturing the decode step on the sharded "
               f"policy would read the CUDA RNG (activation checkpointing's saved RNG state) and take FSDP2's streams "
               f"into the graph, which CUDA refuses; the graphed step runs in one process only (engine.cuda_graph=False "
               f"here: the sharded engine decodes eagerly, its step compiled with compile=True)"),
    (lambda c: not c.engine.slots or c.engine.page_size <= c.model.max_seq_len,
     lambda c: f"engine.page_size={c.engine.page_size}: a page holds at most model.max_seq_len={c.model.max_seq_len} "
               f"columns (every row would hold a whole page of them); use 1..{c.model.max_seq_len} (16 by default)"),
    (lambda c: c.engine.name != "sglang" or c.max_staleness == 0,
     lambda c: f"max_staleness={c.max_staleness}: engine.name='sglang' runs synchronous steps for now (a colocated "
               f"engine sleeps while the trainer trains); use max_staleness=0"),
]


def check_relations(cfg: TrainConfig):
    """RELATIONS, then the prompt limit. Raises ValueError naming the fields, their values and what is valid."""
    for holds, problem in RELATIONS:
        if not holds(cfg):
            raise ValueError(problem(cfg))
    cfg.prompt_limit()


# ----------------------------------------------------------------------------- building a TrainConfig

def _unknown(key: str, valid) -> ValueError:
    """The error for a key no field has: its new home if it moved into a section, else the close matches.
    Returned, not raised, so each caller's `raise` shows where the unknown key was found."""
    if key in MOVED:
        home = MOVED[key]
        return ValueError(f"{key} is {home} now (set {home}=... on the command line, or {home.split('.')[0]} = "
                          f"dict({home.split('.')[1]}=...) in a config file)")
    close = difflib.get_close_matches(key, list(valid), n=3)
    return ValueError(f"unknown config key {key!r}" + (f"; did you mean {', '.join(close)}?" if close else ""))


def _all_keys() -> list[str]:
    top = [f.name for f in dataclasses.fields(TrainConfig) if f.name not in SECTIONS]
    return top + [f"{s}.{f.name}" for s, cls in SECTIONS.items() for f in dataclasses.fields(cls)]


class _ExitCalled(Exception):
    """os._exit(status) called while a config file runs (the stand-in _run_file puts in its place)."""


def _refuse_exit(status):
    raise _ExitCalled(f"os._exit({status!r})")


def _run_file(path: str) -> dict:
    """The namespace of config file `path` after running it. Raises ValueError naming the file and the
    line of what failed in it (a syntax error, a name it lacks, sys.exit, a KeyboardInterrupt: any
    BaseException), FileNotFoundError without it.

    os._exit ends the process at once, past any handler, so while the file runs os._exit is replaced
    by a stand-in that raises (and put back after): the call is refused as an error on its line. The
    swap is process-wide for that moment, and a file that reaches the call another way (posix._exit,
    a signal) is not stopped: this catches a slip in the user's own file, not a file set on exiting."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"config file {path!r}: no such file")
    real_exit, os._exit = os._exit, _refuse_exit
    try:
        return runpy.run_path(path)
    except BaseException as e:  # noqa: BLE001  anything a Python file raises (exits included) is a mistake in it
        if isinstance(e, SyntaxError):
            line = e.lineno
        else:  # the innermost frame in the config file itself
            here = os.path.abspath(path)
            frames = [f for f in traceback.extract_tb(e.__traceback__) if os.path.abspath(f.filename) == here]
            line = frames[-1].lineno if frames else "?"
        if isinstance(e, (SystemExit, _ExitCalled)):
            what = f"SystemExit({e.code!r})" if isinstance(e, SystemExit) else str(e)
            problem = f"{what}: a config file sets values; it may not end the run"
        else:  # KeyboardInterrupt() says nothing but its name
            problem = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        raise ValueError(f"config file {path!r}, line {line}: {problem}") from None
    finally:
        os._exit = real_exit


def _section(name: str, kw: dict):
    """Section `name` built from its fields' values; its errors name each of its fields as `<name>.<field>`."""
    try:
        return SECTIONS[name](**kw)
    except ValueError as e:
        fields = "|".join(f.name for f in dataclasses.fields(SECTIONS[name]))
        # a section names its own fields bare (`tis_cap=2.0: ... icepop=(0.5, 5.0)`): the user set loss.tis_cap
        raise ValueError(re.sub(rf"(?<![\w.])({fields})(?==)", rf"{name}.\1", str(e))) from None


def load_config(path: str | None, overrides: list[str]) -> TrainConfig:
    """TrainConfig from the defaults, the config file's assignments, then `key=value` / `section.field=value`
    overrides, checked once: every field against its rule, then RELATIONS. Raises ValueError on an unknown
    key (naming close matches, or a moved key's new home), a value its rule refuses, a relation that does
    not hold, a checkpoint folder whose config.json does not fit, or a config file that fails to run."""
    values = {}
    top_fields = {f.name for f in dataclasses.fields(TrainConfig)} - set(SECTIONS)
    if path:
        # The file's namespace after running it, less what is not a setting: private and dunder names
        # (`__name__`, `_helpers`), and the modules, functions and classes it defines or imports under
        # a name no setting has. A setting's name is kept whatever it holds, so its rule refuses
        # `def lr(): ...` or `import filter` rather than the default standing in silently (choice 1).
        settings = top_fields | set(SECTIONS) | set(MOVED)
        values = {k: v for k, v in _run_file(path).items() if not k.startswith("_")
                  and (k in settings or not (callable(v) or isinstance(v, types.ModuleType)))}
    top, parts = {}, {name: {} for name in SECTIONS}
    # Every key of the file is checked before any override, so a typo in the file is named even
    # when the command line is empty.
    for k, v in values.items():
        if k in SECTIONS:
            if not isinstance(v, dict):
                raise ValueError(f"{k}={v!r} ({kind(v)}): need a dict of {SECTIONS[k].__name__} fields, deltas from "
                                 f"the defaults ({k} = dict(field=value, ...))" + _hint(k, v))
            for name in v:
                _field_of(k, name)
            parts[k].update(v)
        elif k in top_fields:
            top[k] = v
        else:
            raise _unknown(k, _all_keys())
    # Overrides come after the file, in command-line order, so the last word is the command line's.
    for item in overrides:
        key, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"override {item!r} is not key=value")
        name, dot, sub = key.partition(".")
        if dot and name in SECTIONS:
            parts[name][sub] = _field_of(name, sub).read(key, value)
        elif key in SECTIONS:
            raise ValueError(f"{key}={value!r}: {key} is a section; set {key}.<field>=value on the command line, "
                             f"or {key} = dict(...) in a config file" + _hint(key, value))
        elif key in top_fields:
            top[key] = TrainConfig.RULES[key].read(key, value)
        else:
            raise _unknown(key, _all_keys())
    if top.get("init_hf"):  # a real checkpoint: CHECKPOINT_DEFAULTS under what was set
        top = {**{k: v for k, v in CHECKPOINT_DEFAULTS.items() if k not in SECTIONS}, **top}
        parts = {name: {**CHECKPOINT_DEFAULTS.get(name, {}), **kw} for name, kw in parts.items()}
    sections = {name: _section(name, kw) for name, kw in parts.items() if name != "model"}
    if isinstance(top.get("init_hf"), str) and top["init_hf"]:  # the checkpoint's shape (TrainConfig checks the type)
        model = checkpoint_model(top["init_hf"], parts["model"])
    else:
        model = _section("model", parts["model"])
    cfg = TrainConfig(**top, **sections, model=model)
    if cfg.init_from:
        check_checkpoint_model(cfg)
    check_relations(cfg)
    return cfg


def _field_of(name: str, sub: str) -> Rule:
    """The rule of field `sub` of section `name`; raises ValueError naming close matches for a field it lacks."""
    rules = SECTIONS[name].RULES
    if sub not in rules:
        raise _unknown(f"{name}.{sub}", (f"{name}.{f}" for f in rules))
    return rules[sub]


def _hint(key: str, value: str) -> str:
    # `engine=sglang` was a field before engine became a section
    return f" (engine.name={value!r}?)" if key == "engine" else ""


def read_checkpoint_model(key: str, path: str) -> ModelConfig:
    """The ModelConfig of HF checkpoint folder `path` (hf_config.read_config), for the field `key` (init_hf or
    init_from). Raises ValueError naming the field and what is wrong."""
    if not os.path.isdir(path):
        raise ValueError(f"{key}={path!r}: no such folder")
    try:
        return read_config(path)
    except ValueError as e:
        raise ValueError(f"{key}={path!r}: {e}") from None


def checkpoint_model(path: str, model_kw: dict) -> ModelConfig:
    """The ModelConfig of init_hf's checkpoint folder `path`. model_kw, the model fields a config file or
    the command line set, must agree with it, except max_seq_len, which may be shorter (the same
    function on the positions it allows). Raises ValueError naming the field otherwise."""
    model = read_checkpoint_model("init_hf", path)
    file = os.path.join(path, "config.json")
    for k, v in model_kw.items():
        theirs = getattr(model, k)
        if k == "max_seq_len" and not (isinstance(v, int) and 0 < v <= theirs):
            raise ValueError(f"model.max_seq_len={v!r}: at most the checkpoint's {theirs} ({file}); a shorter "
                             f"context may be set, a longer one would need RoPE scaling the checkpoint lacks")
        if v != theirs and k != "max_seq_len":
            raise ValueError(f"model.{k}={v!r} disagrees with {file} ({theirs!r}): the checkpoint sets the model's "
                             f"shape; drop model.{k}")
    return dataclasses.replace(model, **{k: v for k, v in model_kw.items() if k == "max_seq_len"})


def check_checkpoint_model(cfg: TrainConfig):
    """init_from's checkpoint holds the configured model (hf_config.shape_differences finds none). Raises
    ValueError naming the first field that differs."""
    differ = shape_differences(cfg.model, read_checkpoint_model("init_from", cfg.init_from))
    if differ:
        first = next(iter(differ))
        raise ValueError(f"model.{first}={differ[first][0]!r}: {cfg.init_from}/config.json has {differ[first][1]!r} "
                         f"(init_from loads its weights into the configured model); all that differ (config, file): "
                         f"{differ}")


def parse_args(argv: list[str]) -> TrainConfig:
    """`[config.py] [key=value ...]` -> TrainConfig. Raises ValueError on a bad key or value."""
    # The config file is optional: a first argument without "=" is its path, the rest are overrides.
    path = argv[0] if argv and "=" not in argv[0] else None
    return load_config(path, argv[1:] if path else argv)
