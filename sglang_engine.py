"""SGLangEngine: rollouts from `sglang.Engine` with routed-expert capture, FP8 and weight sync.

The same interface and `Rollout` record as rollout.NativeEngine: `generate(prompts, params, *,
n, seed, group_ids) -> list[Rollout]` and `update_weights(named_tensors, version)`, so the
trainer and its router replay (R3, arXiv 2510.11370) need not know which engine ran.
SGLang is imported lazily (GPU machines only, requirements-gpu.txt); building the engine
without it or without CUDA raises with what to install.

Status: contract-tested on CPU only. The request building and response decoding are plain
functions, tested on CPU (tests/test_rollout.py) against payloads in SGLang's documented
format, and the weight sync against a fake engine that records its calls. This file has
not run on a real SGLang engine; the GPU test that would run it skips without CUDA and sglang.

Shapes: T, C, L, K (letters of the README's legend; T is one prompt's tokens here, as in rollout.py).

Notable choices:

1. One request per sample, each with a sampling_seed derived from (seed, group id, sample
   index) as NativeEngine keys its random streams, so a request's seed does not depend on
   its batch; SGLang's radix cache shares the prompt's prefill between the requests.
2. Requests ask for the sampled tokens' logprobs and the routed experts (`return_logprob`,
   `return_routed_experts`); the routes come back base64-encoded int32 over all of SGLang's
   hidden layers and are mapped to this project's MoE layers (`decode_routed_experts`).
3. FP8 serves a blockwise-FP8 checkpoint (DeepSeek-V3's recipe, arXiv 2412.19437; see
   rollout.py) and syncs weights quantised on the trainer's side (`quantize_fp8`, HF names).
4. Weights are sent bucketed by size through `update_weights_from_tensor`, bracketed by
   `begin_weight_update` / `end_weight_update` where the installed SGLang has them, and the
   prefix cache is flushed once at the end.
"""

from __future__ import annotations

import base64
import json
import os

import torch

from hf import config_from_hf, hf_tensors
from model import ModelConfig
from rollout import (DEFAULT_BUCKET_BYTES, Named, Rollout, SamplingParams, full_tensor, quantize_fp8, row_keys,
                     weight_buckets)


def _import_sglang():
    """sglang, or an error that says what is missing: the package (GPU machines only) or a CUDA device."""
    try:
        import sglang  # lazily: a CPU machine imports this file (and its tests) without sglang installed
    except ImportError as e:
        raise ImportError("SGLangEngine needs sglang, which runs on CUDA GPUs only: on a GPU machine run "
                          "`pip install -r requirements-gpu.txt`; on CPU use NativeEngine") from e
    if not torch.cuda.is_available():
        raise RuntimeError("SGLangEngine needs a CUDA GPU and none is visible (torch.cuda.is_available() is False); "
                           "on CPU use NativeEngine")
    return sglang


def sglang_engine_args(model_path: str, *, fp8: bool, tp_size: int = 1, mem_fraction_static: float = 0.8,
                       seed: int = 0, **extra) -> dict:
    """Keyword arguments of `sglang.Engine`: token ids in and out, routed-expert capture, optional FP8."""
    # skip_tokenizer_init: token ids in and out, the trainer's tokenizer's; enable_return_routed_experts: the
    # server-side switch that a request's return_routed_experts needs
    args = dict(model_path=model_path, tp_size=tp_size, mem_fraction_static=mem_fraction_static, random_seed=seed,
                skip_tokenizer_init=True, enable_return_routed_experts=True)
    if fp8:
        args["quantization"] = "fp8"  # block size and scales from the checkpoint (its quantization_config)
    return args | extra  # caller's keywords win


SGLANG_SEED_BITS = 31  # per-request sampling_seed kept a non-negative int32, a range every SGLang version takes


def sglang_request(prompts: list[list[int]], params: SamplingParams, *, n: int, seed: int | None, eos_id,
                   group_ids: list[int] | None = None) -> dict:
    """Keyword arguments of `sglang.Engine.generate` for n samples of each prompt, prompt-major.

    Each sample is its own request (SGLang's radix cache shares the prompt's prefill).
    Sample j of group g gets sampling_seed derived from (seed, g, j) as NativeEngine keys
    its streams, so a request's seed does not depend on its batch. Logprobs of output
    tokens only (logprob_start_len=-1); routes from the first prompt token
    (routed_experts_start_len=0: SGLang's io_struct documents the response as covering
    [routed_experts_start_len, seqlen - 1)). top_k 0 (off) is SGLang's -1.
    """
    rows = [list(p) for p in prompts for _ in range(n)]  # row i = sample i % n of prompt i // n, as NativeEngine
    # stop on EOS; no_stop_trim and skip_special_tokens=False ask SGLang to remove nothing from the output, so the
    # EOS stays part of the completion, as in NativeEngine's
    stop_ids = [eos_id] if isinstance(eos_id, int) else list(eos_id)  # one id, or a chat model's several
    base = dict(max_new_tokens=params.max_new_tokens, temperature=params.temperature, top_p=params.top_p,
                top_k=params.top_k if params.top_k > 0 else -1, stop_token_ids=stop_ids, skip_special_tokens=False,
                no_stop_trim=True)
    per_row = [dict(base) for _ in rows]  # a copy per request: each gets its own sampling_seed
    if seed is not None:  # without a seed, sampling is SGLang's own (its engine-wide random_seed)
        groups = group_ids if group_ids is not None else list(range(len(prompts)))
        # the same (seed, group id, sample index) keys as NativeEngine.generate
        keys = row_keys(seed, [g for g in groups for _ in range(n)], [j for _ in prompts for j in range(n)])
        # the key's low 31 bits: mix64 output, so every bit is as random as the others
        for p, k in zip(per_row, (keys & ((1 << SGLANG_SEED_BITS) - 1)).tolist()):
            p["sampling_seed"] = k
    return dict(input_ids=rows, sampling_params=per_row, return_logprob=True, logprob_start_len=-1,
                return_routed_experts=True, routed_experts_start_len=0)


def decode_routed_experts(payload, num_tokens: int, cfg: ModelConfig) -> torch.Tensor:
    """SGLang's meta_info["routed_experts"] -> int32 [num_tokens, L, K] over the MoE layers only.

    SGLang sends base64 of int32 [num_tokens, num_hidden_layers, top_k] (logical expert
    ids); the first `first_k_dense_replace` layers are dense (GLM-4.5) and their rows are
    dropped. num_tokens is T + C - 1 when the request set routed_experts_start_len=0.
    Raises ValueError when the size does not match.
    """
    # Format as SGLang documents it (sgl-project/sglang R3 usage notes, and sglang-jax
    # docs/features/return_routed_experts.md, after sglang PR 12162): base64-decode,
    # read int32, reshape(-1, num_layers, top_k); a list payload is accepted as well.
    if isinstance(payload, (str, bytes)):
        # bytearray: frombuffer needs a writable buffer (bytes would warn); the raw bytes are read in native order
        flat = torch.frombuffer(bytearray(base64.b64decode(payload)), dtype=torch.int32)
    else:
        flat = torch.as_tensor(payload).to(torch.int32).flatten()
    want = num_tokens * cfg.n_layers * cfg.top_k  # n_layers: SGLang reports every hidden layer, dense ones too
    if flat.numel() != want:
        raise ValueError(f"routed_experts holds {flat.numel()} ids; expected {num_tokens} tokens x {cfg.n_layers} "
                         f"layers x {cfg.top_k} = {want}")
    # (num_tokens, n_layers, K) -> (num_tokens, L, K): the dense layers come first; clone() owns the memory
    return flat.view(num_tokens, cfg.n_layers, cfg.top_k)[:, cfg.first_k_dense_replace:].clone()


def decode_sglang_output(out: dict, prompt_ids: list[int], *, cfg: ModelConfig, group_id: int,
                         weight_version: int) -> Rollout:
    """One SGLang generate() result -> Rollout.

    Reads meta_info["output_token_logprobs"] ((logprob, token id, text) per output token,
    the stop token included), meta_info["finish_reason"] ({"type": "stop" | "length" |
    "abort", ...}) and meta_info["routed_experts"]. Raises ValueError on a payload that
    does not add up, RuntimeError on an aborted request.
    """
    meta = out["meta_info"]
    lp = meta["output_token_logprobs"]
    ids = [int(x[1]) for x in lp]  # the completion, read from the logprob entries so each id has its logprob
    if "output_ids" in out and [int(i) for i in out["output_ids"]] != ids:  # when both are present they must agree
        raise ValueError(f"output_ids {list(out['output_ids'])[:8]}... disagree with output_token_logprobs' ids {ids[:8]}...")
    reason = meta["finish_reason"]
    kind = reason.get("type") if isinstance(reason, dict) else reason  # documented as a dict; a plain str taken too
    if kind == "abort":
        raise RuntimeError(f"SGLang aborted the request: {reason}")
    if kind not in ("stop", "length"):
        raise ValueError(f"finish_reason {reason!r}; expected type 'stop', 'length' or 'abort'")
    T, C = len(prompt_ids), len(ids)
    # routes of every token fed to the model: the prompt and all but the last completion token, as NativeEngine
    return Rollout(prompt_ids=list(prompt_ids), completion_ids=ids, logprobs=torch.tensor([float(x[0]) for x in lp]),
                   routes=decode_routed_experts(meta["routed_experts"], T + C - 1, cfg), finish_reason=kind,
                   group_id=group_id, weight_version=weight_version)


def _ok(result, what: str):
    """Raise RuntimeError when an SGLang control call reports failure ((ok, msg), {"success": ...} or .success)."""
    # SGLang versions answer in each of these shapes; anything else (None included) counts as success
    ok, msg = True, ""
    if isinstance(result, tuple) and result and isinstance(result[0], bool):
        ok, msg = result[0], " ".join(map(str, result[1:]))
    elif isinstance(result, dict) and "success" in result:
        ok, msg = result["success"], result.get("message", "")
    elif hasattr(result, "success"):
        ok, msg = result.success, getattr(result, "message", "")
    if not ok:
        raise RuntimeError(f"SGLang {what} failed: {msg}")


class SGLangEngine:
    """Rollouts from `sglang.Engine` (CUDA only), in the same `Rollout` record as NativeEngine.

    fp8=True serves a blockwise-FP8 checkpoint (write one with `hf.save_hf(model, path,
    fp8=True)`) and syncs weights quantised on the trainer side (`quantize_fp8`, HF names);
    otherwise weights go in the trainer's dtype. Weight sync sends buckets with
    `update_weights_from_tensor` inside `begin_weight_update()` / `end_weight_update()` where
    the installed SGLang has them (0.5.23: begin restores packed quantised weights to a
    loadable layout, end re-finalises them), and without them where not (0.5.7), then flushes
    the prefix cache. Logprobs are SGLang's `output_token_logprobs` (the tempered distribution
    unless SGLANG_RETURN_ORIGINAL_LOGPROB is set, which would not match the trainer).
    Contract-tested on CPU against SGLang's documented payloads and a fake engine; it has not
    run on a real SGLang engine.
    """
    # Weight-update sessions: sglang PR 28001 ("refactor weight processing in RL weight
    # update") added begin_weight_update / end_weight_update and makes
    # update_weights_from_* assert that a session is open; Engine.update_weights_from_tensor
    # takes (named_tensors, load_format=None, flush_cache=True) in the versions we read.

    def __init__(self, model_path: str, *, eos_id: int, fp8: bool = False, tp_size: int = 1,
                 mem_fraction_static: float = 0.8, seed: int = 0, bucket_bytes: int = DEFAULT_BUCKET_BYTES, **engine_kwargs):
        sglang = _import_sglang()  # first, so a CPU machine fails with what to install before reading any file
        with open(os.path.join(model_path, "config.json")) as f:
            hf_config = json.load(f)
        # checked here, not left to SGLang: a high-precision checkpoint would load unquantised and the FP8 sync
        # would then send e4m3 tensors with scales into weights that have none
        if fp8 and (hf_config.get("quantization_config") or {}).get("quant_method") != "fp8":
            raise ValueError(f"fp8=True needs a blockwise-FP8 checkpoint and {model_path} has no fp8 quantization_config; "
                             f"write one with hf.save_hf(model, path, fp8=True)")
        engine = sglang.Engine(**sglang_engine_args(model_path, fp8=fp8, tp_size=tp_size,
                                                    mem_fraction_static=mem_fraction_static, seed=seed, **engine_kwargs))
        # our ModelConfig from the same config.json: layer counts, top_k and dense layers for decoding routes
        self._setup(engine, config_from_hf(hf_config), eos_id=eos_id, fp8=fp8, bucket_bytes=bucket_bytes)

    @classmethod
    def from_engine(cls, engine, cfg: ModelConfig, *, eos_id: int, fp8: bool = False,
                    bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> SGLangEngine:
        """Wrap an already running sglang.Engine (or anything with its methods)."""
        self = cls.__new__(cls)  # skips __init__: no sglang import, no CUDA check (how the CPU tests build one)
        self._setup(engine, cfg, eos_id=eos_id, fp8=fp8, bucket_bytes=bucket_bytes)
        return self

    def _setup(self, engine, cfg: ModelConfig, *, eos_id: int, fp8: bool, bucket_bytes: int):
        self.engine, self.cfg, self.eos_id, self.fp8, self.bucket_bytes = engine, cfg, eos_id, fp8, bucket_bytes
        self.weight_version = 0
        # sessions exist from sglang PR 28001 on (0.5.23); older versions (0.5.7) take updates without them
        self.sessions = hasattr(engine, "begin_weight_update") and hasattr(engine, "end_weight_update")

    def generate(self, prompts: list[list[int]], params: SamplingParams, *, n: int = 1, seed: int | None = None,
                 group_ids: list[int] | None = None) -> list[Rollout]:
        """As NativeEngine.generate (prompt-major n rollouts per prompt)."""
        if not prompts:
            return []
        # one batched call; SGLang schedules the len(prompts) * n requests itself and answers in request order
        outs = self.engine.generate(**sglang_request(prompts, params, n=n, seed=seed, eos_id=self.eos_id,
                                                     group_ids=group_ids))
        if len(outs) != len(prompts) * n:
            raise RuntimeError(f"SGLang returned {len(outs)} outputs for {len(prompts) * n} requests")
        # output i is sample i % n of prompt i // n, the order sglang_request built
        return [decode_sglang_output(out, prompts[i // n], cfg=self.cfg, weight_version=self.weight_version,
                                     group_id=group_ids[i // n] if group_ids is not None else i // n)
                for i, out in enumerate(outs)]

    def update_weights(self, named_tensors: Named, version: int):
        """Send the trainer's tensors (`policy_tensors(model)`) in HF names, bucket by bucket (FP8 when fp8)."""
        # lazily, one tensor at a time: shards gathered whole, renamed and split into HF's per-matrix layout
        tensors = hf_tensors(((n, full_tensor(t)) for n, t in named_tensors), self.cfg)
        if self.fp8:
            tensors = quantize_fp8(tensors, hf=True)  # after hf_tensors: the 128x128 blocks are HF's matrices'
        if self.sessions:
            _ok(self.engine.begin_weight_update(), "begin_weight_update")
        try:
            # flush_cache=False per bucket: the prefix cache is flushed once, after the last bucket
            for bucket in weight_buckets(tensors, self.bucket_bytes):
                _ok(self.engine.update_weights_from_tensor(named_tensors=[(k, t.detach().contiguous()) for k, t in bucket],
                                                           flush_cache=False), "update_weights_from_tensor")
        finally:
            if self.sessions:  # a failed bucket still closes the session, so the engine is not left mid-update
                _ok(self.engine.end_weight_update(), "end_weight_update")
        self.engine.flush_cache()  # cached prefixes were computed with the old weights
        self.weight_version = version  # only after every bucket landed: a failed sync keeps the old version
