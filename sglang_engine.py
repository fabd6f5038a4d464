"""SGLangEngine: rollouts from SGLang servers, with routed-expert capture, FP8 and weight sync.

An engine of rollout.Engine's interface (`generate`, `update_weights`, `phase`, `sleep`, `wake`,
`memory`, `counters`, `weight_version`), returning sampler.Rollout records, so the trainer and its router
replay (R3, arXiv 2510.11370) need not know which engine ran; `sleep()` / `wake()` release and
resume its memory while the trainer trains. `build_sglang_engine(cfg, tok, policy)` builds it
for a run (engine.name='sglang', rollout.ENGINES). SGLang is imported lazily (GPU machines only,
requirements-sglang.txt).

Status: contract-tested on CPU only; has not run on a real SGLang engine. Requests and
responses are checked against SGLang's documented formats, the HTTP client against a fake
server that checks every payload and the call order, the in-process path against a fake
`sglang.Engine`; the end-to-end GPU test skips without CUDA and sglang.

Sources (sgl-project/sglang, python/sglang/srt/): entrypoints/engine.py (Engine's methods),
entrypoints/http_server.py (endpoints and bodies), entrypoints/http_server_engine.py
(launch_server_process), managers/io_struct.py (request fields), server_args.py and
arg_groups/fields/ (server arguments, flat in /server_info), sampling/sampling_batch_info.py
(sampling_seed), constants.py (memory tags), the model runner's weight updater; PRs 12162
(routed experts), 28710 / 28001 (weight-update sessions). Each use below names what it was checked
against: the sglang 0.5.21 wheel's code (requirements-sglang.txt), which shares the trainer's torch 2.13.0 and
its NCCL (engines/sglang_server.py lists the endpoints and answers).

Shapes: T, C, L, K (letters of the README's legend; T is one prompt's tokens here, as in rollout.py).

Notable choices:

1. Two deployments. Colocated (engine.sglang_urls ""): local rank 0 of each node launches one SGLang
   server on the node's GPUs (tensor parallel over them, expert parallel where the experts
   divide evenly), with SGLang's memory saver: `sleep()` releases its weights, KV cache and
   CUDA graphs while the trainer trains, `wake()` takes the memory back. External
   (engine.sglang_urls set): servers someone else launched; sleep and wake do nothing.
2. Every rank posts its own prompts to /generate: its node's server, or the external servers
   round-robin by group id. No rank waits on another (ranks run different numbers of batches:
   a gather to the leader could deadlock), and a server batches all ranks' requests together.
3. One request per sample, each with a sampling_seed derived from (seed, group id, sample
   index) as NativeEngine keys its random streams, so a request's seed does not depend on
   its batch; SGLang's radix cache shares the prompt's prefill between the requests. SGLang
   honours sampling_seed only on a server with deterministic inference on (its batch-invariant
   kernels, so a sample does not depend on its batch either): the colocated server turns it on;
   an external server without it is warned of at connect (`SGLangEngine.seeded` False), its
   rollouts not reproducible. Logprobs
   of the sampled tokens and the routed experts come back with each (`return_logprob`,
   `return_routed_experts`); routes arrive as base64 int32 over all of SGLang's hidden layers
   and are mapped to this project's MoE layers (`decode_routed_experts`). A server that does not
   capture them is refused at connect (`sglang_server.check_server`).
4. Weight sync: every rank gathers each sharded tensor (`full_tensor`, a collective); one rank
   sends them in HF names, bucket by bucket, inside begin/end_weight_update where the server
   has them, then flushes the prefix cache. Colocated, the node leader passes CUDA IPC handles
   (/update_weights_from_tensor: NCCL cannot pair two ranks on one GPU); external, rank 0
   broadcasts each tensor over an NCCL group formed once with every server's GPUs (a server whose
   NCCL is not exactly the trainer's is refused at connect: `sglang_server.nccl_pairing`). A barrier
   after the sync keeps every rank from generating on old weights.
5. FP8 serves a blockwise-FP8 checkpoint (DeepSeek-V3's recipe, arXiv 2412.19437; see
   weights.py) and syncs weights quantised on the trainer's side (`quantize_fp8`, HF names).
   Other tensors go in the dtype the server holds them in: its --dtype (/server_info; "auto" resolved from the
   checkpoint's config.json as SGLang resolves it, `sglang_server.served_dtype`), GLM-4.5's router in fp32. The
   colocated server is started with --dtype bfloat16.
6. Memory released by `sleep()` comes back without its values (no CPU backup), so after
   `wake()` the engine refuses to generate until `update_weights` has run: a wrong call order
   fails loudly instead of sampling from garbage.
"""

from __future__ import annotations

import atexit
import json
import multiprocessing
import os
import re
import socket
import warnings
from concurrent.futures import ThreadPoolExecutor
from importlib import metadata
from contextlib import contextmanager
from itertools import accumulate
from typing import TYPE_CHECKING, Protocol
from urllib.parse import urlsplit

import torch

from distributed import all_gather_list, barrier, rank_world
from hf import hf_tensors, save_hf
from model import ModelConfig
from sampler import Rollout, SamplingParams, Vocab
from engines.sglang_server import (ABSENT, SGLangServer, check_server, checkpoint_dtype, decode_sglang_output,
                                   launch_wait_s, nccl_pairing, served_dtype, sglang_request, wait_until_serving)
from weights import (DEFAULT_BUCKET_BYTES, Named, fp8_bf16_modules, full_tensor, quantize_fp8, sglang_ep,
                     weight_buckets)

if TYPE_CHECKING:
    from config import TrainConfig
    from tokenizer import Tokenizer

UPDATE_GROUP = "everyprompt_weight_sync"
"""Name of the NCCL group rank 0 broadcasts weights on (SGLang keeps one group per name)."""
GROUP_TIMEOUT_S = 1800.0
"""Seconds the weight-update group waits for the servers to join, or for one broadcast to complete."""
LAUNCHED: list = []
"""How to stop each SGLang server this process launched (colocated), and its scheduler processes."""


def stop_launched_servers():
    """Stop the SGLang servers this process launched: at exit (atexit), and on the abort path of a failed
    multi-rank job (train.abort), which exits without running atexit."""
    while LAUNCHED:
        LAUNCHED.pop()()


# ----------------------------------------------------------------------------- requests and responses


def _import_sglang():
    """sglang, or an error that says what is missing: the package (GPU machines only) or a CUDA device."""
    try:
        import sglang  # lazily: a CPU machine imports this file (and its tests) without sglang installed
    except ImportError as e:
        raise ImportError("SGLangEngine needs sglang, which runs on CUDA GPUs only: on a GPU machine run "
                          "`pip install -r requirements-sglang.txt`; on CPU use NativeEngine") from e
    if not torch.cuda.is_available():
        raise RuntimeError("SGLangEngine needs a CUDA GPU and none is visible (torch.cuda.is_available() is False); "
                           "on CPU use NativeEngine")
    return sglang


def sglang_server_args(model_path: str, *, fp8: bool, tp_size: int = 1, ep_size: int = 1,
                       mem_fraction_static: float = 0.8, seed: int = 0, **extra) -> dict:
    """Keyword arguments of SGLang's ServerArgs for a colocated server (names as in server_args.py, whose fields
    sglang 0.5.21 declares in arg_groups/fields/ and ServerArgs(**args) takes flat)."""
    # skip_tokenizer_init: token ids in and out, the trainer's tokenizer's; enable_return_routed_experts: the
    # server-side switch a request's return_routed_experts needs; enable_memory_saver: what makes
    # release_memory_occupation / resume_memory_occupation work; enable_deterministic_inference: the switch without
    # which SGLang drops every request's sampling_seed (sampling_batch_info.py). Its cost, as 0.5.21 resolves it
    # (arg_groups/overrides.py, attention_hook.py): batch-invariant kernels, the pytorch sampler, attention fa3 on
    # Hopper (flashinfer on Blackwell, where the radix cache is then off), and with TP > 1 NCCL's tree all-reduce in
    # place of the custom one; dtype bfloat16: --dtype auto would serve a float32 checkpoint (an init_from run's) in
    # float16 (configs/model_config.py)
    args = dict(model_path=model_path, tp_size=tp_size, ep_size=ep_size, mem_fraction_static=mem_fraction_static,
                random_seed=seed, skip_tokenizer_init=True, enable_return_routed_experts=True,
                enable_memory_saver=True, enable_deterministic_inference=True, dtype="bfloat16")
    if fp8:
        args["quantization"] = "fp8"  # block size and scales from the checkpoint (its quantization_config)
    return args | extra  # caller's keywords win


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


def join_update_group(master_address: str, master_port: int, world_size: int, group_name: str, *,
                      backend: str = "nccl", rank: int = 0):
    """Join SGLang's weight-update group as `rank` (the trainer is rank 0, hosting the rendezvous); returns
    `broadcast(tensor)`, which sends a tensor from rank 0 to every other rank (on them: receives into it). The
    servers join with SGLang's init_custom_process_group (srt/utils.py: a TCP rendezvous, a PrefixStore named
    group_name, a group outside the default one); this follows the same recipe with the same torch.distributed
    private helpers, so the two meet (tools/sglang_standin.py joins with it too, over gloo)."""
    import inspect
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous
    timeout = timedelta(seconds=GROUP_TIMEOUT_S)
    store, rank, world = next(rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    # the options keyword was renamed across torch versions
    options = "backend_options" if "backend_options" in inspect.signature(_new_process_group_helper).parameters \
        else "pg_options"
    for stale in [g for g, name in _world.pg_names.items() if name == group_name]:  # an earlier engine's in this
        dist.destroy_process_group(stale)  # process (a second run in one process: tests, a notebook); names are unique
    group, _ = _new_process_group_helper(world, rank, [], Backend(backend), PrefixStore(group_name, store),
                                         group_name=group_name, timeout=timeout, **{options: None})
    _world.pg_group_ranks[group] = {i: i for i in range(world)}  # group ranks are the update group's own

    def broadcast(t: torch.Tensor):
        dist.broadcast(t, group=group, group_src=0)
    return broadcast


def _as_served(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t as the server holds it: fp32 weights in the server's dtype (bf16: half the bytes of the trainer's master
    copy); integer and lower-precision tensors as they are."""
    return t.to(dtype) if t.dtype == torch.float32 else t


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))  # the OS picks a free port
        return s.getsockname()[1]


def _address_toward(url: str) -> str:
    """This machine's IP address on the route to url's host (what the servers can reach it at)."""
    parts = urlsplit(url)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((parts.hostname, parts.port or 80))  # UDP connect sends nothing; it only picks the route
        return s.getsockname()[0]


# ----------------------------------------------------------------------------- the servers


class Server(Protocol):
    """What SGLangEngine asks of one SGLang server for generation, memory and weights by CUDA IPC, and all it asks:
    sglang_server.SGLangServer (a server's HTTP API) and `InProcessServer` (an sglang.Engine in this process)
    implement it. A control call answers in one of the shapes `_ok` reads. tp_size: the server's GPUs (its tensor
    parallel), which the FP8 sync's bf16 modules follow (weights.fp8_bf16_modules). begin_weight_update answers
    sglang_server.ABSENT where the server's SGLang predates weight-update sessions (0.5.7), which then takes
    updates without one. Connect checks (/server_info) and weights by NCCL broadcast are an HTTP server's only:
    SGLangServer's check_server, url and *_weights_update_group / update_weights_from_distributed."""
    tp_size: int

    def generate(self, **request) -> list[dict]: ...

    def release_memory_occupation(self): ...

    def resume_memory_occupation(self): ...

    def begin_weight_update(self): ...

    def end_weight_update(self): ...

    def update_weights_from_tensor(self, named_tensors, flush_cache: bool = True): ...

    def flush_cache(self): ...


class InProcessServer:
    """An sglang.Engine of this process (or a stand-in with its methods: the CPU tests') as a `Server`, its methods
    passed through. tp_size: the Engine's tensor parallel (its ServerArgs.tp_size; 1 unless given). An Engine whose
    sglang predates weight-update sessions (0.5.7) has no begin/end_weight_update: begin answers ABSENT, as
    SGLangServer's does for a 404, and no session is opened."""

    def __init__(self, engine, *, tp_size: int = 1):
        self.engine, self.tp_size = engine, tp_size
        # a third-party object's methods, which differ by sglang release (sessions: PRs 28710 / 28001)
        self.sessions = hasattr(engine, "begin_weight_update")

    def generate(self, **request) -> list[dict]:
        return self.engine.generate(**request)

    def release_memory_occupation(self):
        return self.engine.release_memory_occupation()

    def resume_memory_occupation(self):
        return self.engine.resume_memory_occupation()

    def begin_weight_update(self):
        return self.engine.begin_weight_update() if self.sessions else ABSENT

    def end_weight_update(self):
        return self.engine.end_weight_update()

    def update_weights_from_tensor(self, named_tensors, flush_cache: bool = True):
        return self.engine.update_weights_from_tensor(named_tensors=named_tensors, flush_cache=flush_cache)

    def flush_cache(self):
        return self.engine.flush_cache()


# ----------------------------------------------------------------------------- the engine


class SGLangEngine:
    """Rollouts from SGLang (CUDA only), in the same `Rollout` record as NativeEngine.

    `SGLangEngine(model_path, ...)` launches a colocated server on this machine's first tp_size
    GPUs (memory saver on) and drives it; `from_engine` wraps running ones. fp8=True serves a
    blockwise-FP8 checkpoint (`hf.save_hf(model, path, fp8=True)` writes one). Logprobs are
    SGLang's `output_token_logprobs` (the tempered distribution unless
    SGLANG_RETURN_ORIGINAL_LOGPROB is set, which would not match the trainer). `seeded`: whether
    every server honours the requests' sampling_seed (deterministic inference on; see `check_server`).
    Raises ImportError / RuntimeError without sglang or CUDA, RuntimeError at connect from a server
    that does not capture routed experts or (weights by NCCL broadcast) whose NCCL is not the trainer's,
    TimeoutError when a launched server does not serve within `launch_wait_s`.
    """
    sharded = False  # NativeEngine's flag for decoding on the sharded policy: a server holds its own weights
    # Weight-update sessions: sglang PRs 28710 and 28001 added begin_weight_update /
    # end_weight_update (Engine methods and HTTP routes); from them on (0.5.21 included) update_weights_from_*
    # fail outside a session (managers/scheduler_components/weight_updater.py); older versions (0.5.7) have
    # neither and take updates without them.

    def __init__(self, model_path: str, cfg: ModelConfig, vocab: Vocab, *, fp8: bool = False, tp_size: int = 1,
                 ep_size: int = 1, mem_fraction_static: float = 0.8, seed: int = 0,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, **server_kwargs):
        _import_sglang()  # first, so a CPU machine fails with what to install before reading any file
        from sglang.srt.entrypoints.http_server import launch_server
        from sglang.srt.server_args import ServerArgs
        from sglang.srt.utils import MultiprocessingSerializer, kill_process_tree
        with open(os.path.join(model_path, "config.json")) as f:
            hf_config = json.load(f)
        # checked here, not left to SGLang: a high-precision checkpoint would load unquantised and the FP8 sync
        # would then send e4m3 tensors with scales into weights that have none
        if fp8 and (hf_config.get("quantization_config") or {}).get("quant_method") != "fp8":
            raise ValueError(f"fp8=True needs a blockwise-FP8 checkpoint and {model_path} has no fp8 "
                             f"quantization_config; write one with hf.save_hf(model, path, fp8=True)")
        port = _free_port()
        args = sglang_server_args(model_path, fp8=fp8, tp_size=tp_size, ep_size=ep_size, seed=seed,
                                  mem_fraction_static=mem_fraction_static, host="127.0.0.1", port=port, **server_kwargs)
        # launch_server_process's steps (http_server_engine.py, 0.5.21) with a wait sized to the checkpoint in place
        # of its fixed 300 s: resolve here, since a forked child cannot initialise CUDA once this process has
        server_args = ServerArgs(**args)
        server_args.resolve_once()
        process = multiprocessing.Process(target=launch_server, args=(server_args,))
        process.start()
        LAUNCHED.append(lambda: kill_process_tree(process.pid))
        atexit.register(stop_launched_servers)  # the server and its scheduler processes end with the run
        url = f"http://127.0.0.1:{port}"
        wait_until_serving(url, process.is_alive, launch_wait_s(model_path))
        server = SGLangServer(url, serialize=lambda obj: MultiprocessingSerializer.serialize(obj, output_str=True))
        # cfg: the served model's shape (the run's), whose layer counts, top_k and dense layers decode the routes
        self._setup([server], cfg, vocab, fp8=fp8, bucket_bytes=bucket_bytes, colocated=True)

    @classmethod
    def from_engine(cls, engine: Server | list[Server], cfg: ModelConfig, vocab: Vocab, *, fp8: bool = False,
                    bucket_bytes: int = DEFAULT_BUCKET_BYTES, leader: bool = True, colocated: bool = False,
                    update_group: str | None = None, config_dtype: str | None = None) -> SGLangEngine:
        """Wrap running servers (`Server`s): an SGLangServer, an `InProcessServer` around an sglang.Engine, or a
        list of them (external servers: requests spread over them by group id).

        leader: this rank sends the weights and releases / resumes the memory (others only generate
        and take part in the gathers). colocated: sleep() and wake() release and resume the memory.
        update_group: the weight-update group's backend: weights go by its broadcast (`join_update_group`; to
        SGLangServers only: a ValueError otherwise); None: by update_weights_from_tensor (CUDA IPC). Its backend:
        "nccl" between GPUs, "gloo" from a trainer on CPU (tools/sglang_standin.py's tests; there is no NCCL to
        pair). vocab: the run's tokenizer's stop ids, its ids (SGLang samples over every row of the embedding, and
        ids past these are counted: `counters`) and its decode (each Rollout's text).
        config_dtype: the served checkpoint's config.json dtype, which a server started with --dtype auto serves in
        (sglang_server.served_dtype).
        """
        self = cls.__new__(cls)  # skips __init__: no sglang import, no CUDA check (how the CPU tests build one)
        self._setup(engine if isinstance(engine, list) else [engine], cfg, vocab, fp8=fp8, bucket_bytes=bucket_bytes,
                    leader=leader, colocated=colocated, update_group=update_group, config_dtype=config_dtype)
        return self

    def _setup(self, servers: list[Server], cfg: ModelConfig, vocab: Vocab, *, fp8: bool, bucket_bytes: int,
               leader: bool = True, colocated: bool = False, update_group: str | None = None,
               config_dtype: str | None = None):
        self.servers, self.cfg, self.fp8, self.bucket_bytes = servers, cfg, fp8, bucket_bytes
        # the rows' stop ids; the ids SGLang may sample past the tokenizer's, counted; the run's tokenizer's decode,
        # each Rollout's text (SGLang's own detokenizer is not read)
        self.eos_id, self.num_tokens, self.decode = vocab.stop_ids, vocab.num_tokens, vocab.decode
        self.ids_past_tokenizer = 0
        self.leader, self.colocated, self.update_group = leader, colocated, update_group
        if update_group is not None and not all(isinstance(s, SGLangServer) for s in servers):
            raise ValueError("weights by broadcast (update_group) go to HTTP servers (sglang_server.SGLangServer) "
                             "only; an in-process Engine takes them by update_weights_from_tensor (update_group=None)")
        # at connect, not at the first rollout: HTTP servers are asked; an in-process Engine (InProcessServer) is not
        asked = [s for s in servers if isinstance(s, SGLangServer)]
        unseeded = [s.url for s in asked if not check_server(s)]  # every server checked: check_server may raise
        if unseeded:
            warnings.warn(f"SGLang {', '.join(unseeded)} runs without --enable-deterministic-inference: it ignores "
                          f"each request's sampling_seed, so these rollouts are not reproducible", stacklevel=3)
        self.seeded = len(asked) == len(servers) and not unseeded  # every request's sampling_seed honoured
        if update_group == "nccl" and leader:  # the trainer's NCCL must be each server's
            problems = [p for p in (nccl_pairing(s.version, s.url) for s in asked) if p is not None]
            if problems:  # refused at connect: NCCL would refuse the group only at the first weight sync
                raise RuntimeError("; ".join(problems))
        # an in-process Engine or a stand-in is not asked: the weights go as bf16, as these checkpoints are published
        dtypes = {served_dtype(s.server_info(), config_dtype) for s in asked} or {torch.bfloat16}
        if len(dtypes) > 1:
            raise RuntimeError(f"the SGLang servers {', '.join(s.url for s in asked)} serve different dtypes "
                               f"{sorted(map(str, dtypes))}: one weight sync sends one")
        self.served_dtype = dtypes.pop()  # what the sync casts fp32 master weights to
        self.weight_version = 0
        self.asleep = False  # memory released (sleep) and not yet resumed
        self.stale = False  # resumed (wake) but not yet refilled by update_weights: the weights hold no values
        self._broadcast = None  # the NCCL group's broadcast, once formed

    # ------------------------------------------------------------------ generation

    def generate(self, prompts: list[list[int]], params: SamplingParams, *, n: int = 1, seed: int | None = None,
                 group_ids: list[int] | None = None) -> list[Rollout]:
        """As NativeEngine.generate (prompt-major n rollouts per prompt). Raises RuntimeError after
        sleep() until wake() and update_weights() have run."""
        if self.asleep or self.stale:
            raise RuntimeError("SGLangEngine.generate after sleep(): call wake() and then update_weights() first "
                               "(the released memory comes back without the weights)")
        if not prompts:
            return []
        groups = group_ids if group_ids is not None else list(range(len(prompts)))
        request = sglang_request(prompts, params, n=n, seed=seed, eos_id=self.eos_id, group_ids=groups)
        outs = self._generate(request, [groups[i // n] for i in range(len(prompts) * n)])
        # output i is sample i % n of prompt i // n, the order sglang_request built
        rollouts = [decode_sglang_output(out, prompts[i // n], cfg=self.cfg, weight_version=self.weight_version,
                                         group_id=groups[i // n]) for i, out in enumerate(outs)]
        if self.num_tokens is not None:  # padded embedding rows, which the tokenizer cannot decode
            self.ids_past_tokenizer += sum(i >= self.num_tokens for r in rollouts for i in r.completion_ids)
        if self.decode is not None:
            for r in rollouts:
                r.text = self.decode(r.text_ids)
        return rollouts

    def _generate(self, request: dict, row_groups: list[int]) -> list[dict]:
        """Each row's output, in row order: row r goes to server row_groups[r] % S (a group's rows together,
        so its prompt is prefilled once); the servers work in parallel."""
        S = len(self.servers)
        parts = [[r for r, g in enumerate(row_groups) if g % S == s] for s in range(S)]
        jobs = [(server, rows) for server, rows in zip(self.servers, parts) if rows]

        def run(server, rows):
            # the same request, cut to these rows; the per-row lists are the only ones
            out = server.generate(**(request | dict(input_ids=[request["input_ids"][r] for r in rows],
                                                    sampling_params=[request["sampling_params"][r] for r in rows])))
            if len(out) != len(rows):
                raise RuntimeError(f"SGLang returned {len(out)} outputs for {len(rows)} requests")
            return out
        with ThreadPoolExecutor(len(jobs)) as pool:
            results = list(pool.map(lambda job: run(*job), jobs))
        outs = [None] * len(row_groups)
        for (_, rows), out in zip(jobs, results):
            for r, o in zip(rows, out):
                outs[r] = o
        return outs

    # ------------------------------------------------------------------ memory

    @contextmanager
    def phase(self):
        """A rollout phase, as NativeEngine's: nothing to gather (the server holds its own weights); the counters
        start again."""
        self.ids_past_tokenizer = 0
        yield

    def memory(self) -> dict[str, int]:
        """Bytes this rank's process holds for the engine, as NativeEngine.memory: none (the server's
        memory belongs to the server's processes)."""
        return {}

    def counters(self) -> dict[str, int]:
        """As NativeEngine.counters: the sampled ids past the tokenizer's in this phase (padded embedding rows,
        which decode to nothing; a trained model gives them no mass). SGLang's own retractions are in its log."""
        return {"ids_past_tokenizer": self.ids_past_tokenizer} if self.num_tokens is not None else {}

    def sleep(self):
        """Release the colocated server's memory (weights, KV cache, CUDA graphs) before the trainer
        trains; every rank calls it. A no-op for external servers and when already asleep."""
        if not self.colocated or self.asleep:
            return
        barrier()  # every rank of the node has finished its rollouts
        if self.leader:
            _ok(self.servers[0].release_memory_occupation(), "release_memory_occupation")
        barrier()  # the memory is free before any rank's trainer allocates
        self.asleep = True

    def wake(self):
        """Take the colocated server's memory back after training (its weights come back empty: call
        update_weights next); every rank calls it. A no-op for external servers and when awake."""
        if not self.colocated or not self.asleep:
            return
        if torch.cuda.is_available():  # the training step's freed blocks, cached by this process's allocator, go back
            torch.cuda.empty_cache()  # to the GPU before the server takes its pool again (barrier below: every rank's)
        barrier()
        if self.leader:
            _ok(self.servers[0].resume_memory_occupation(), "resume_memory_occupation")
        barrier()
        self.asleep, self.stale = False, True

    # ------------------------------------------------------------------ weights

    def update_weights(self, named_tensors: Named, version: int):
        """Send the trainer's tensors (`policy_tensors(model)`) in HF names, bucket by bucket (FP8 when
        fp8); every rank calls it (sharded tensors are gathered). Raises RuntimeError while asleep or
        when SGLang reports a failure."""
        if self.asleep:
            raise RuntimeError("SGLangEngine.update_weights while asleep: call wake() first")
        # lazily, one tensor at a time: shards gathered whole, renamed and split into HF's per-matrix layout
        tensors = hf_tensors(((n, full_tensor(t)) for n, t in named_tensors), self.cfg)
        # in the server's dtype on the wire (FP8 below is quantised from it)
        # GLM-4.5's router (weight and selection bias) SGLang keeps in fp32 (models/glm4_moe.py, Glm4MoeGate)
        fp32 = ("e_score_correction_bias",) + ((".mlp.gate.weight",) if self.cfg.hf_model_type == "glm4_moe" else ())
        tensors = ((k, t if k.endswith(fp32) else _as_served(t, self.served_dtype)) for k, t in tensors)
        if not self.leader:
            for _ in tensors:  # take part in every gather; the leader sends
                pass
        else:  # FP8 after hf_tensors: HF's blocks, and the modules the server's tensor parallel keeps bf16
            bf16 = fp8_bf16_modules(self.cfg, self.servers[0].tp_size) if self.fp8 else ()
            self._send(quantize_fp8(tensors, hf=True, bf16=bf16) if self.fp8 else tensors)
        barrier()  # no rank generates before the weights have landed
        self.stale = False
        self.weight_version = version  # only after every bucket landed: a failed sync keeps the old version

    def _send(self, tensors: Named):
        """The leader's part: open a session on each server that has them, send the buckets, close,
        flush the prefix cache (cached prefixes were computed with the old weights)."""
        opened = []
        try:
            for server in self.servers:
                result = server.begin_weight_update()  # ABSENT where the server's SGLang predates the sessions
                if result is not ABSENT:
                    _ok(result, "begin_weight_update")
                    opened.append(server)
            for bucket in weight_buckets(tensors, self.bucket_bytes):
                bucket = [(k, t.detach().contiguous()) for k, t in bucket]
                if self.update_group is None:
                    for server in self.servers:  # flush_cache=False per bucket: flushed once, after the last
                        _ok(server.update_weights_from_tensor(named_tensors=bucket, flush_cache=False),
                            "update_weights_from_tensor")
                else:
                    self._broadcast_bucket(bucket)
        finally:
            for server in opened:  # a failed bucket still closes the session, so no server is left mid-update
                _ok(server.end_weight_update(), "end_weight_update")
        for server in self.servers:
            _ok(server.flush_cache(), "flush_cache")

    def _broadcast_bucket(self, bucket: list[tuple[str, torch.Tensor]]):
        """Every server receives the bucket over the NCCL group: each is told the names, dtypes and
        shapes (an HTTP call that returns once its ranks have received them all), while this rank
        broadcasts the tensors in that order."""
        if self._broadcast is None:
            self._broadcast = self._form_group()
        # the model runner allocates getattr(torch, dtype) of each shape and receives one broadcast from rank 0 per
        # name, in this order (update_weights_from_distributed); group_name and flush_cache as in io_struct.py
        meta = dict(names=[k for k, _ in bucket], dtypes=[str(t.dtype).removeprefix("torch.") for _, t in bucket],
                    shapes=[list(t.shape) for _, t in bucket], group_name=UPDATE_GROUP, flush_cache=False)
        with ThreadPoolExecutor(len(self.servers)) as pool:
            calls = [pool.submit(server.update_weights_from_distributed, **meta) for server in self.servers]
            for _, t in bucket:
                self._broadcast(t)
            for call in calls:
                _ok(call.result(), "update_weights_from_distributed")

    def _form_group(self):
        """Form the weight-update group once: this rank is rank 0, server i's GPUs the ranks after the
        GPUs of the servers before it. Every server joins in its own HTTP call while this rank joins."""
        tps = [server.tp_size for server in self.servers]
        offsets = [1 + before for before in accumulate([0] + tps[:-1])]
        address, port, world = _address_toward(self.servers[0].url), _free_port(), 1 + sum(tps)
        for server in self.servers:  # the group an earlier run formed: SGLang refuses a second of the same name
            server.destroy_weights_update_group(group_name=UPDATE_GROUP)
        pool = ThreadPoolExecutor(len(self.servers))
        calls = [pool.submit(server.init_weights_update_group, master_address=address, master_port=port,
                             rank_offset=offset, world_size=world, group_name=UPDATE_GROUP,
                             backend=self.update_group) for server, offset in zip(self.servers, offsets)]
        try:
            broadcast = join_update_group(address, port, world, UPDATE_GROUP, backend=self.update_group)
        except BaseException:  # raise now: the servers' calls wait for this rank, which is not coming
            pool.shutdown(wait=False, cancel_futures=True)
            raise
        for call in calls:
            _ok(call.result(), "init_weights_update_group")
        pool.shutdown()
        return broadcast


def check_colocated_install():
    """A colocated server runs in the trainer's environment, so the sglang installed there must accept its torch:
    requirements-sglang.txt's sglang 0.5.21 pins torch==2.13.0, this project's (tools/check_install.py resolves
    the two files together); another release may pin another (0.5.23: torch==2.14.1). Raises ValueError naming
    both torches, or a missing sglang, and the fix."""
    instead = ("pip install -r requirements-sglang.txt in this environment (its sglang pins this project's torch), "
               "or run SGLang servers elsewhere and set engine.sglang_urls")
    try:
        sglang, torch_pins = metadata.version("sglang"), [r for r in metadata.requires("sglang") or []
                                                          if re.match(r"torch\s*==", r)]
    except metadata.PackageNotFoundError:
        raise ValueError(f"engine.sglang_urls='' (colocated) needs sglang in this environment; {instead}") from None
    have = metadata.version("torch").split("+")[0]
    for pin in torch_pins:
        want = pin.split("==", 1)[1].split(";")[0].strip()
        if want != have:
            raise ValueError(f"engine.sglang_urls='' (colocated): sglang {sglang} needs torch=={want}, and this "
                             f"environment has torch {have}; {instead}")


def build_sglang_engine(cfg: TrainConfig, tok: Tokenizer, policy) -> SGLangEngine:
    """The SGLang rollout engine of a run (engine.name='sglang', rollout.ENGINES); every rank calls it.

    engine.sglang_urls "": colocated. Local rank 0 of each node launches a server on the node's
    LOCAL_WORLD_SIZE GPUs (tensor parallel over them, expert parallel over them when they divide
    the experts) loading the run's checkpoint folder (init_hf or init_from; with engine.fp8 a
    blockwise-FP8 copy of the policy that this writes first, hf.save_hf(fp8=True)); every rank of
    the node generates through it. engine.sglang_urls set: every rank generates through those
    servers (already serving the same model) and rank 0 pushes the weights over NCCL. tok: the
    run's tokenizer (its stop_ids end a completion). config.RELATIONS has refused a run this
    cannot serve (no checkpoint, no CUDA, async steps).
    """
    engine_cfg = cfg.engine
    rank, _ = rank_world()
    vocab = Vocab(tok.stop_ids, tok.pad_id, tok.enc.n_vocab, tok.decode)
    if engine_cfg.urls:
        backend = "nccl" if torch.device(cfg.device).type == "cuda" else "gloo"  # gloo: a CPU trainer's stand-in
        return SGLangEngine.from_engine([SGLangServer(u) for u in engine_cfg.urls], cfg.model, vocab,
                                        fp8=engine_cfg.fp8, leader=rank == 0, update_group=backend,
                                        config_dtype=checkpoint_dtype(cfg.init_hf or cfg.init_from))
    check_colocated_install()
    path = cfg.init_hf or cfg.init_from
    if engine_cfg.fp8:  # colocated SGLang serves FP8 from a blockwise-FP8 checkpoint
        path = os.path.join(cfg.out_dir, "sglang_fp8")  # on a filesystem every node sees
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))  # the server's tensor parallel, below
        save_hf(policy, path, write=rank == 0, fp8=True, bf16_modules=fp8_bf16_modules(cfg.model, local_world))
    local_rank, local_world = int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    barrier()  # a checkpoint rank 0 has just written (the FP8 one) is complete before any server loads it
    engine = None
    if not engine_cfg.sglang_mem_fraction:  # train.prepare sets it from the plan on a CUDA machine
        raise ValueError("engine.sglang_mem_fraction=0 reached the colocated launch unsized: plan.colocated_sglang "
                         "gives the fraction (train.prepare sets it)")
    if local_rank == 0:
        ep = sglang_ep(cfg.model, local_world)  # what fp8_bf16_modules assumed of this server
        engine = SGLangEngine(path, cfg.model, vocab, fp8=engine_cfg.fp8, tp_size=local_world, ep_size=ep,
                              mem_fraction_static=engine_cfg.sglang_mem_fraction, seed=cfg.seed)
    # every rank learns its node leader's URL (torchrun numbers a node's ranks consecutively); the gather also
    # waits for the leaders' servers to be up
    node_url = all_gather_list([engine.servers[0].url if engine is not None else None])[rank - local_rank]
    if engine is None:  # a non-leader rank: generates through its node's server, sends no weights
        engine = SGLangEngine.from_engine(SGLangServer(node_url), cfg.model, vocab, fp8=engine_cfg.fp8, leader=False,
                                          colocated=True)
    return engine
