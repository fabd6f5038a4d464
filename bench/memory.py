"""Planned against measured peak memory: plan.py's numbers checked on real runs on this CPU.

For each small config (overrides of configs/tiny.py) and both dtypes, two measurements, each
in a fresh process:
1. trainer: the policy built as train.py builds it (distributed.setup_distributed and
   build_model: a plain model in fp32, FSDP2 mixed precision on a one-rank mesh in bf16) and
   its RL AdamW, then two training steps of one full micro-batch (plan.microbatch_shape):
   forward with the chunked logprobs, backward, optimizer step. Planned: plan.trainer_memory.
2. engine: a NativeEngine in the run's dtype, one generate call of gen_batch_rows rows whose
   prompts are max_prompt_tokens long (EOS id -1, so every row decodes sampling.max_new_tokens), its
   rollouts kept. Planned: plan.engine_memory.
Measured two ways, from the moment the model is built (its own construction left out):
- tensors: the peak bytes of live tensor storages (`LiveTensors`), what
  torch.cuda.max_memory_allocated reports on a GPU and what the plan models. The headline.
- RSS: the process's peak resident set (VmHWM, reset once the model is built) minus its
  resident set before the model, after a small warm-up run of the same code (a kernel's first
  call maps its code pages, resident from then on and in no tensor), with glibc handing freed
  memory back at once and oneDNN keeping no kernel cache (MEASURE_ENV). In fp32 it agrees with
  the tensors; in bf16 this CPU's matmuls (oneDNN) hold buffers of their own, outside any
  tensor, that a GPU run does not have.
Then the logits: a model with Qwen3's vocabulary (V = 151,936), one micro-batch's logprobs and
entropy and their backward, computed as the trainer does (chunked, recomputed in backward)
and as it did before (the full [tokens, V] fp32 logits and their log-softmax kept).

    python bench/memory.py [--quick] [--dtypes float32 bfloat16] [--one-process] [--logits-tokens N]
        [--overrides k=v ...] [--smoke] [--out PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import subprocess
import sys
import weakref

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
from torch.distributed._tools.common_utils import get_untyped_storages  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_flatten  # noqa: E402

from sampler import Vocab
from bench import smoke  # noqa: E402  (bench/smoke.py)

# glibc hands freed blocks back at once, and oneDNN (CPU bf16 matmuls) keeps no cache of kernels
# it compiled, one per shape: otherwise the resident set reads high by caches, not by what the code holds
MEASURE_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0", "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "0",
               "OMP_NUM_THREADS": "2"}
# three small shapes (overrides of configs/tiny.py): the demo, one with a dense first block,
# qk-norm and activation checkpointing, one with a wider vocabulary and more experts
CONFIGS = {
    "tiny": [],
    "dense-first+AC": ["model.n_layers=6", "model.first_k_dense_replace=1", "model.dense_inter_dim=384",
                       "model.qk_norm=True", "activation_checkpoint=True", "microbatch_tokens=4096"],
    "wide-vocab": ["model.vocab_size=16384", "model.dim=256", "model.num_experts=16", "model.top_k=4",
                   "model.max_seq_len=512", "microbatch_tokens=4096", "gen_batch_rows=64", "sampling.max_new_tokens=64"],
}
DTYPES = ("float32", "bfloat16")
QWEN3_VOCAB = 151936
# --smoke: the quick set in fp32 (tests/test_plan.py measures bf16 too, through measure_many) in one process, at
# a few rows and tokens
SMOKE = {"quick": True, "dtypes": ["float32"], "one_process": True, "logits_tokens": 64,
         "overrides": ["gen_batch_rows=16", "microbatch_tokens=512", "sampling.max_new_tokens=8"]}


class LiveTensors(TorchDispatchMode):
    """Bytes of the tensor storages alive while it is active (`now`) and their `peak`: on CPU, what
    torch.cuda.max_memory_allocated is on a GPU. A storage counts from the op that first returns it
    (a DTensor's: its local shard's) until it is freed, at its size, which follows
    `UntypedStorage.resize_` (FSDP2 frees its gathered weights and regrows them in place that way)."""

    def __init__(self):
        super().__init__()
        self.sizes, self.now, self.peak = {}, 0, 0

    def __enter__(self):
        self._resize = torch.UntypedStorage.resize_
        live = self

        def resize_(storage, nbytes):
            key, before = storage._cdata, storage.nbytes()
            out = live._resize(storage, nbytes)
            if key in live.sizes:
                live._add(key, storage.nbytes() - before)
            else:
                live._track(storage)
            return out
        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._resize
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                for storage in get_untyped_storages(t):  # a DTensor's local shard, made below this mode
                    self._track(storage)
        return out

    def _track(self, storage):
        """Counts a storage not yet seen, keyed by its StorageImpl (the same across a resize)."""
        key = storage._cdata
        if key not in self.sizes:
            self.sizes[key] = 0
            weakref.finalize(storage, self._free, key)
            self._add(key, storage.nbytes())

    def _add(self, key, nbytes):
        self.sizes[key] += nbytes
        self.now += nbytes
        self.peak = max(self.peak, self.now)

    def _free(self, key):
        self.now -= self.sizes.pop(key, 0)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _hwm() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def _reset_peaks(live: LiveTensors):
    gc.collect()
    live.peak = live.now
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets the peak resident set to the current one (Linux >= 4.0)


def _measure_trainer(cfg, meshes, shape: tuple[int, int] | None = None) -> dict[str, int]:
    from distributed import build_model
    from plan import microbatch_shape
    from train import rl_optimizer
    base = _rss()
    with LiveTensors() as live:
        model = build_model(cfg, meshes)
        opt = rl_optimizer(model, cfg)
        tokens = torch.randint(cfg.model.vocab_size, shape or microbatch_shape(cfg, cfg.model.num_experts))
        _reset_peaks(live)  # past build_model's full initial copy, which a sharded run frees
        for _ in range(2):
            (logp, _), _ = model(tokens, tokens, temperature=cfg.sampling.temperature)
            (-logp.mean()).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    return {"tensors": live.peak, "rss": _hwm() - base}


def _measure_engine(cfg) -> dict[str, int]:
    from rollout import NativeEngine
    base = _rss()
    with LiveTensors() as live:
        engine = NativeEngine(cfg.model, Vocab(-1, 0), dtype=cfg.compute_dtype())
        U = max(1, cfg.gen_batch_rows // cfg.group_size)  # distinct prompts, group_size rows each
        prompts = torch.randint(cfg.model.vocab_size, (U, cfg.prompt_limit())).tolist()
        _reset_peaks(live)  # past the engine's fp32 construction
        rollouts = engine.generate(prompts, cfg.sampling, n=cfg.group_size, seed=0)
    assert all(len(r.completion_ids) == cfg.sampling.max_new_tokens for r in rollouts)
    return {"tensors": live.peak, "rss": _hwm() - base}


def _measure_logits(mode: str, tokens: int) -> dict[str, int]:
    """Peak bytes of one micro-batch's logprobs, entropy and backward at V = 151,936, `mode`
    'chunked' (the trainer's forward) or 'full' (the [tokens, V] logits kept, as before)."""
    from model import ModelConfig, Transformer
    cfg = ModelConfig(vocab_size=QWEN3_VOCAB, dim=256, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=64,
                      num_experts=4, top_k=2, moe_inter_dim=128, max_seq_len=tokens)
    model = Transformer(cfg)
    x = torch.randint(QWEN3_VOCAB, (1, tokens))
    base = _rss()
    with LiveTensors() as live:
        _reset_peaks(live)
        if mode == "chunked":
            (logp, entropy), _ = model(x, x)
        else:
            logp_BTV = model(x)[0].log_softmax(-1)  # [1, tokens, V] fp32, held for backward
            logp = logp_BTV.gather(-1, x[..., None]).squeeze(-1)
            entropy = -(logp_BTV.exp() * logp_BTV).sum(-1).detach()
        (-logp.mean()).backward()
        del entropy  # kept through the backward, as a trainer keeps it for its loss
    return {"tensors": live.peak, "rss": _hwm() - base}


def measure(part: str, args: list[str]) -> dict[str, int]:
    """Measured peak bytes of `part` ('trainer', 'engine', 'logits-chunked', 'logits-full') in a fresh
    process (MEASURE_ENV): {"tensors": live tensor storages, "rss": resident set}. args: config
    overrides of configs/tiny.py (for the logits, the micro-batch's tokens)."""
    return measure_many([(part, args)])[0]


def measure_many(runs: list[tuple[str, list[str]]]) -> list[dict[str, int]]:
    """`measure` of each (part, args), one after the other in one fresh process (saves its start-up;
    each is measured from its own baseline, and at most one may be a bf16 trainer)."""
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--measure", json.dumps(runs)],
                         env={**os.environ, **MEASURE_ENV}, capture_output=True, text=True, cwd=ROOT)
    if out.returncode:
        raise RuntimeError(f"measuring {runs} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _measure_here(part: str, args: list[str]) -> dict[str, int]:
    """One measurement in this process, after a small warm-up of the same code (see the docstring)."""
    if part.startswith("logits-"):
        return _measure_logits(part.split("-")[1], int(args[0]))
    from config import parse_args
    from distributed import setup_distributed
    cfg = parse_args([os.path.join(ROOT, "configs", "tiny.py"), *args, "device=cpu"])
    if part == "trainer":
        meshes = setup_distributed(cfg)  # bf16: a one-rank process group, as train.py runs it
        _measure_trainer(cfg, meshes, shape=(1, 16))
        return _measure_trainer(cfg, meshes)
    _measure_engine(dataclasses.replace(cfg, gen_batch_rows=cfg.group_size,
                                        sampling=dataclasses.replace(cfg.sampling, max_new_tokens=2)))
    return _measure_engine(cfg)


def planned(part: str, args: list[str]) -> int:
    """plan.py's bytes for `part` ('trainer' or 'engine') of configs/tiny.py with `args`, on one rank."""
    import plan
    from config import parse_args
    cfg = parse_args([os.path.join(ROOT, "configs", "tiny.py"), *args, "device=cpu"])
    if part == "trainer":
        return plan.trainer_memory(cfg, 1, activation_checkpoint=cfg.activation_checkpoint)["total"]
    # the one call measured: gen_batch_rows rows of group_size samples each (the run's peak is over all its calls)
    return plan.engine_memory(cfg)["weights"] + plan.generate_peak(cfg, 1, cfg.gen_batch_rows,
                                                                   max(1, cfg.gen_batch_rows // cfg.group_size))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="the tiny config only, and a shorter logits micro-batch")
    ap.add_argument("--dtypes", nargs="+", choices=DTYPES, default=list(DTYPES), help="the dtypes measured")
    ap.add_argument("--one-process", action="store_true",
                    help="every measurement in one fresh process, one after the other (saves the start-ups; each from "
                         "its own baseline, the resident set's less clean); at most one bf16 trainer: --quick")
    ap.add_argument("--logits-tokens", type=int, default=None, help="the logits micro-batch (default 4096, "
                                                                     "2048 with --quick)")
    ap.add_argument("--overrides", nargs="*", default=[], help="overrides of configs/tiny.py added to every config's")
    ap.add_argument("--measure", help=argparse.SUPPRESS)
    a = smoke.parse_args(ap, SMOKE)
    if a.measure:  # internal: measure_many's process
        torch.set_num_threads(2)
        print(json.dumps([_measure_here(part, args) for part, args in json.loads(a.measure)]))
        return

    configs = [(name, [*overrides, *a.overrides])
               for name, overrides in (list(CONFIGS.items())[:1] if a.quick else CONFIGS.items())]
    tokens = a.logits_tokens or (2048 if a.quick else 4096)
    runs = [(part, [*overrides, f"dtype={dtype}"]) for _, overrides in configs for dtype in a.dtypes
            for part in ("trainer", "engine")] + [(f"logits-{mode}", [str(tokens)]) for mode in ("chunked", "full")]
    bf16_trainers = sum(part == "trainer" and "dtype=bfloat16" in args for part, args in runs)
    if a.one_process and bf16_trainers > 1:  # measure_many: a process sets up one bf16 trainer's process group
        raise ValueError(f"--one-process with {bf16_trainers} bf16 trainers: one process can set up one; give --quick "
                         f"or --dtypes float32 with it, or leave it out")
    measured = iter(measure_many(runs)) if a.one_process else (measure(*run) for run in runs)  # in runs' order

    MiB = 2 ** 20
    rows = []
    print(f"{'config':<15} {'dtype':<9} {'part':<8} {'planned MiB':>11} {'tensors MiB':>11} {'ratio':>6} "
          f"{'RSS MiB':>8} {'ratio':>6}")
    for name, overrides in configs:
        for dtype in a.dtypes:
            for part in ("trainer", "engine"):
                args = [*overrides, f"dtype={dtype}"]
                p, m = planned(part, args), next(measured)
                rows.append({"config": name, "overrides": overrides, "dtype": dtype, "part": part, "planned": p,
                             "tensors": m["tensors"], "rss": m["rss"], "ratio": p / m["tensors"],
                             "ratio_rss": p / m["rss"]})
                print(f"{name:<15} {dtype:<9} {part:<8} {p / MiB:>11.1f} {m['tensors'] / MiB:>11.1f} "
                      f"{p / m['tensors']:>6.3f} {m['rss'] / MiB:>8.1f} {p / m['rss']:>6.3f}", flush=True)
    logits = {mode: next(measured) for mode in ("chunked", "full")}
    print(f"\nlogprobs + entropy + backward of {tokens} tokens at V = {QWEN3_VOCAB:,} ({tokens * QWEN3_VOCAB * 4 / MiB:.0f} "
          f"MiB of fp32 logits), peak MiB:")
    for mode in ("chunked", "full"):
        print(f"  {mode:<8} tensors {logits[mode]['tensors'] / MiB:>7.0f}   RSS {logits[mode]['rss'] / MiB:>7.0f}")
    worst = max(rows, key=lambda r: abs(r["ratio"] - 1))["ratio"]
    worst_rss = max(rows, key=lambda r: abs(r["ratio_rss"] - 1))["ratio_rss"]
    smoke.write_results(a, "memory", {"rows": rows, "logits_tokens": tokens, "logits_peak": logits,
                                      "worst_ratio": worst, "worst_ratio_rss": worst_rss})
    print(f"(against the resident set the worst ratio is {worst_rss:.3f}x)")
    print(f"{worst:.3f}x planned/measured peak memory (worst of {len(rows)}, measured as live tensors; "
          f"within 0.85-1.15: {'yes' if 0.85 <= worst <= 1.15 else 'NO'})")


if __name__ == "__main__":
    main()
