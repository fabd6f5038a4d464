"""One SGLang server over its HTTP API: what /generate takes and answers (`sglang_request`, and
`decode_sglang_output` with the routed experts it brings, checked where they enter: `decode_routed_experts`,
`check_routes`), the endpoints as sglang.Engine's methods (`SGLangServer`, so sglang_engine's SGLangEngine drives an
in-process Engine and a server alike), and what is checked or waited for when connecting to one: routed-expert
capture and deterministic inference (`check_server`), the NCCL the weight broadcast pairs with
(`nccl_pairing`), and a launched server's wait (`launch_wait_s`, `wait_until_serving`). Needs no sglang package,
and none has met a real server: tested on CPU against a stand-in. Every endpoint, body and answer is checked against
the sglang 0.5.21 wheel's code (python/sglang/srt/; requirements-sglang.txt pins it):

- entrypoints/http_server.py: /server_info answers ServerArgs.resolved_dict() flat (tp_size, pp_size, dp_size,
  enable_return_routed_experts, enable_deterministic_inference; dtype as given, "auto" unresolved) plus "version"
  (/get_server_info is its deprecated alias); /flush_cache answers text, 400 while requests run;
  /release_memory_occupation and /resume_memory_occupation answer nothing; /begin_weight_update,
  /end_weight_update, /update_weights_from_tensor, /init_weights_update_group and /update_weights_from_distributed
  answer {"success", "message"}, 400 on failure; /health_generate is 503 until a one-token generation returns.
- managers/scheduler_components/weight_updater.py: update_weights_from_tensor and _distributed fail outside a
  begin/end_weight_update session (a 404 for /begin_weight_update is taken as a release before sessions, as 0.5.7
  was); managers/io_struct.py gives the bodies' fields; tp_worker.py takes one serialized copy per TP rank.
"""

from __future__ import annotations

import base64
import ctypes
import json
import os
import time
import urllib.error
import urllib.request

import torch

from model import ModelConfig, route_dtype
from sampler import Rollout, SamplingParams, row_keys

HTTP_TIMEOUT_S = 3600.0
"""Seconds one HTTP call may take: a /generate call holds a whole batch of long completions."""
FLUSH_RETRIES = 10
"""Tries of /flush_cache, a second apart: SGLang refuses to flush while requests are still running."""
LAUNCH_LOAD_BYTES_PER_S = 1e9
"""Checkpoint bytes a launching server is assumed to load per second (1 GB/s): slow on purpose, as from a shared
filesystem every node reads at once, so the launch wait errs long rather than killing a server still loading."""
LAUNCH_FIXED_S = 600.0
"""Seconds a launch takes besides loading the weights: processes, NCCL, CUDA-graph capture over every batch size
(minutes for a large MoE at TP 8), the first /health_generate."""
HEALTH_POLL_S = 2.0
"""Seconds between /health_generate probes of a launching server (launch_server_process's interval)."""
HEALTH_CALL_TIMEOUT_S = 60.0
"""Seconds one /health_generate probe may take: SGLang answers 503 after its own 20 s (SGLANG_HEALTH_CHECK_TIMEOUT)."""
ABSENT = object()  # what an HTTP call answers for a route this server's SGLang version lacks (404)


SGLANG_SEED_BITS = 31
"""Per-request sampling_seed kept a non-negative int32, a range every SGLang version takes."""


# ----------------------------------------------------------------------------- what /generate takes and answers

def sglang_request(prompts: list[list[int]], params: SamplingParams, *, n: int, seed: int | None, eos_id,
                   group_ids: list[int] | None = None) -> dict:
    """The body of /generate (and the keywords of `sglang.Engine.generate`) for n samples of each
    prompt, prompt-major.

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


def check_routes(routed_experts: torch.Tensor, num_experts: int):
    """The values of integer expert ids [..., K] that enter from outside this project (SGLang's routed_experts),
    checked once where they enter, not in every forward (model.check_route_layout, the dtype and shape, is
    that one; this syncs with the host): each id in [0, E) or a whole row of -1 (padding), the K ids of a
    row distinct. Raises ValueError naming what is wrong."""
    if routed_experts.numel() == 0:
        return
    lo, hi = int(routed_experts.min()), int(routed_experts.max())
    if lo < -1 or hi >= num_experts:
        raise ValueError(f"routed_experts ids span [{lo}, {hi}]; valid ids are -1 (padding) and [0, {num_experts})")
    # a padding row is all -1: a partly padded row would mix replayed ids with the router's own
    pad = routed_experts < 0
    if bool((pad.any(-1) & ~pad.all(-1)).any()):
        raise ValueError("routed_experts has a row mixing -1 and expert ids; a padding row must be all -1")
    # sorted along K, a repeated expert shows as two equal neighbours (-1 pairs of padding rows aside)
    ids = routed_experts.sort(dim=-1).values
    if bool(((ids[..., 1:] == ids[..., :-1]) & (ids[..., 1:] >= 0)).any()):
        raise ValueError("routed_experts repeats an expert within a token's top-k; ids in a row must be distinct")


def decode_routed_experts(payload, num_tokens: int, cfg: ModelConfig) -> torch.Tensor:
    """SGLang's meta_info["routed_experts"] -> [num_tokens, L, K] expert ids over the MoE layers only,
    in Rollout.routes' dtype (`route_dtype`: the smallest integer dtype that holds the expert ids).

    SGLang sends base64 of int32 [num_tokens, num_hidden_layers, top_k] (logical expert
    ids); the first `first_k_dense_replace` layers are dense (GLM-4.5) and their rows are
    dropped. num_tokens is T + C - 1 when the request set routed_experts_start_len=0.
    Raises ValueError when the size does not match or an id is not a valid one (check_routes: ids that
    enter from outside are checked here, once, not in every replayed forward).
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
    # (num_tokens, n_layers, K) -> (num_tokens, L, K): the dense layers come first
    routes = flat.view(num_tokens, cfg.n_layers, cfg.top_k)[:, cfg.first_k_dense_replace:]
    check_routes(routes, cfg.num_experts)  # before the cast: an id past route_dtype's range would wrap around
    return routes.to(route_dtype(cfg.num_experts), copy=True)  # copy=True owns the memory


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
        raise ValueError(f"output_ids {list(out['output_ids'])[:8]}... disagree with output_token_logprobs' ids "
                         f"{ids[:8]}...")
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


# ----------------------------------------------------------------------------- one server

class SGLangServer:
    """`sglang.Engine`'s methods over one server's HTTP API (routes and bodies as in SGLang's
    entrypoints/http_server.py), so SGLangEngine drives an in-process Engine and a server alike.
    Raises RuntimeError on an error status or an unreachable server, naming the URL, the route
    and SGLang's message. serialize: how /update_weights_from_tensor packs a bucket (SGLang's
    MultiprocessingSerializer: CUDA IPC handles, for a colocated server on the same GPUs)."""

    def __init__(self, url: str, *, serialize=None, timeout_s: float = HTTP_TIMEOUT_S):
        self.url, self.serialize, self.timeout_s = url.rstrip("/"), serialize, timeout_s
        self._info = None
        self.version = None  # the server's SGLang version, once check_server has asked

    def call(self, route: str, payload: dict | None = None, *, optional: bool = False):
        """POST payload (GET when None) to route; the decoded answer. optional: a 404 (a route this
        SGLang version lacks) answers ABSENT instead of raising."""
        data = None if payload is None else json.dumps(payload).encode()
        req = urllib.request.Request(self.url + route, data=data, method="GET" if payload is None else "POST",
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                body = resp.read().decode()
        except urllib.error.HTTPError as e:
            if optional and e.code == 404:
                return ABSENT
            message = e.read().decode(errors="replace")  # SGLang's error answer: {"error": {"message": ...}} or text
            raise RuntimeError(f"SGLang {self.url}{route} answered {e.code}: {message}") from None
        except urllib.error.URLError as e:
            raise RuntimeError(f"SGLang server {self.url} is unreachable ({route}): {e.reason}") from None
        try:
            return json.loads(body) if body else None
        except json.JSONDecodeError:  # /flush_cache answers plain text
            return body

    def generate(self, **request) -> list[dict]:
        out = self.call("/generate", request)
        return out if isinstance(out, list) else [out]  # a batch answers a list, one request a dict

    def server_info(self) -> dict:
        """The server's arguments and state (/server_info; /get_server_info before SGLang renamed it)."""
        if self._info is None:
            info = self.call("/server_info", optional=True)
            self._info = self.call("/get_server_info") if info is ABSENT else info
        return self._info

    @property
    def tp_size(self) -> int:
        """GPUs of the server, each a rank of the weight-update group (rank_offset + tp_rank, as the model
        runner's init_weights_update_group numbers them)."""
        info = self.server_info()
        if info.get("pp_size", 1) != 1 or info.get("dp_size", 1) != 1:  # their ranks would collide in the group
            raise RuntimeError(f"SGLang {self.url} runs pp_size={info.get('pp_size')} dp_size={info.get('dp_size')}; "
                               f"the weight sync joins servers with tensor parallelism only (pp_size = dp_size = 1)")
        return int(info["tp_size"])

    def flush_cache(self):
        for _ in range(FLUSH_RETRIES - 1):
            try:
                return self.call("/flush_cache", {})
            except RuntimeError:
                time.sleep(1.0)  # requests still running: SGLang flushes only an idle server
        return self.call("/flush_cache", {})

    def release_memory_occupation(self):
        return self.call("/release_memory_occupation", {})  # no tags: all of srt/constants.py's (weights, KV, graphs)

    def resume_memory_occupation(self):
        return self.call("/resume_memory_occupation", {})

    def begin_weight_update(self):
        return self.call("/begin_weight_update", {}, optional=True)  # ABSENT before SGLang PR 28001

    def end_weight_update(self):
        return self.call("/end_weight_update", {})

    def update_weights_from_tensor(self, named_tensors, flush_cache: bool = True):
        # one serialized copy per TP rank, as SGLang's HttpServerEngineAdapter sends them (each rank opens its own)
        return self.call("/update_weights_from_tensor", dict(
            serialized_named_tensors=[self.serialize(named_tensors) for _ in range(self.tp_size)], load_format=None,
            flush_cache=flush_cache))

    def init_weights_update_group(self, **group):
        return self.call("/init_weights_update_group", group)

    def destroy_weights_update_group(self, **group):
        """Leave the group of this name an earlier trainer formed (a server outlives the run that connected to
        it, and joins one group per name); a server that holds none answers 400, and one whose SGLang lacks the
        route 404: both are fine here, init_weights_update_group's answer is what counts."""
        try:
            return self.call("/destroy_weights_update_group", group, optional=True)
        except RuntimeError as e:
            return e

    def update_weights_from_distributed(self, **bucket):
        return self.call("/update_weights_from_distributed", bucket)


SERVER_NCCL = {"0.5.21": (2, 29, 7), "0.5.23": (2, 30, 7)}
"""The NCCL of each SGLang release's own environment, read from the wheels' METADATA (tools/wheel_requires.json;
tests/test_install.py ties these to it): sglang 0.5.21 pins torch 2.13.0, whose Linux wheel pins nvidia-nccl-cu13
2.29.7, as the trainer's torch does (requirements.txt); sglang 0.5.23 pins torch 2.14.1 and so 2.30.7."""


def trainer_nccl() -> tuple[int, int, int] | None:
    """The NCCL this process's weight broadcast runs, (major, minor, patch): the loaded library's ncclGetVersion,
    the number NCCL's init compares (torch.cuda.nccl.version() is the one torch was built against, blind to a
    reinstalled nvidia-nccl-cu13); torch's where the library cannot be opened. None without CUDA: there the
    weight-update group is gloo's, with no NCCL to pair."""
    if not torch.cuda.is_available():
        return None
    code = ctypes.c_int()
    try:  # by soname: the copy libtorch_cuda loaded at import
        ctypes.CDLL("libnccl.so.2").ncclGetVersion(ctypes.byref(code))
    except (OSError, AttributeError):
        return tuple(torch.cuda.nccl.version()[:3])
    return code.value // 10000, code.value // 100 % 100, code.value % 100  # NCCL_VERSION_CODE since NCCL 2.9


def nccl_pairing(server_version: str | None, url: str) -> str | None:
    """Why the weight broadcast's NCCL communicator cannot form, or None. It holds this process and the server's
    GPUs, and NCCL refuses a communicator whose members run different versions (src/init.cc, initTransportsRank:
    "Mismatched NCCL version detected", major, minor and patch compared exactly), which would show only at the
    first weight sync, after a whole rollout phase. The server's NCCL is its release's (SERVER_NCCL); a release
    missing there is refused too, as nothing at connect proves it pairs. None without CUDA here (`trainer_nccl`)."""
    ours = trainer_nccl()
    if ours is None:
        return None
    theirs = SERVER_NCCL.get(server_version or "")
    if theirs == ours:
        return None
    fix = "run the servers with the sglang of requirements-sglang.txt (its torch pins the trainer's NCCL)"
    if theirs is None:
        return (f"SGLang {url} runs sglang {server_version}, whose NCCL is not known here (SERVER_NCCL holds "
                f"{', '.join(SERVER_NCCL)}), and the weight broadcast needs exactly this trainer's NCCL "
                f"{_dotted(ours)}: {fix}, or add that release to SERVER_NCCL from its torch's pin of nvidia-nccl-cu13 "
                f"(tools/check_install.py reads the wheels)")
    return (f"SGLang {url} runs sglang {server_version} with NCCL {_dotted(theirs)} and this trainer NCCL "
            f"{_dotted(ours)}: NCCL refuses a communicator of two versions, so the weight broadcast cannot form; "
            f"{fix}, or install the server's NCCL here (pip install nvidia-nccl-cu13=={_dotted(theirs)})")


def _dotted(version: tuple[int, ...]) -> str:
    return ".".join(map(str, version))


SERVED_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "half": torch.float16,
                 "float32": torch.float32, "float": torch.float32}
"""SGLang's --dtype values (besides "auto") and the dtype a server then holds its weights in."""


def checkpoint_dtype(path: str) -> str | None:
    """A checkpoint folder's config.json dtype ("torch_dtype" before transformers 5), what --dtype auto starts from."""
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    return config.get("dtype") or config.get("torch_dtype")


def served_dtype(info: dict, config_dtype: str | None) -> torch.dtype:
    """The dtype a server holds its weights in, from its /server_info ("dtype": its --dtype, as given), so a weight
    sync sends what the server keeps. "auto" resolves as sglang 0.5.21 resolves it (configs/model_config.py,
    _get_and_verify_dtype): the checkpoint's config_dtype (none: float32), and a float32 checkpoint served in
    float16. Raises RuntimeError naming a dtype this project cannot send."""
    name = info.get("dtype", "auto")
    if name == "auto":
        name = {"float32": "float16", None: "float16"}.get(config_dtype, config_dtype)
    if name not in SERVED_DTYPES:
        raise RuntimeError(f"SGLang serves dtype={info.get('dtype')!r} (checkpoint dtype {config_dtype!r}); the weight "
                           f"sync sends one of {', '.join(map(repr, SERVED_DTYPES))}")
    return SERVED_DTYPES[name]


def check_server(server: SGLangServer) -> bool:
    """Whether the server honours a request's sampling_seed (deterministic inference on); raises RuntimeError,
    naming its URL and the flag to start it with, when it does not capture routed experts, without which no
    rollout can be replayed. Reads /server_info: sglang 0.5.21 answers ServerArgs.resolved_dict(), its
    arguments flat and as resolved (rl_on_policy_target turns deterministic inference on, for one:
    arg_groups/attention_hook.py, handle_deterministic_inference)."""
    info = server.server_info()
    server.version = info.get("version")  # sglang's __version__, which /server_info adds (entrypoints/http_server.py)
    if not info.get("enable_return_routed_experts"):  # absent before SGLang had the switch (PR 12162): no routes either
        raise RuntimeError(f"SGLang {server.url} reports enable_return_routed_experts="
                           f"{info.get('enable_return_routed_experts')}: it returns no routed experts, which router "
                           f"replay needs; start it with --enable-return-routed-experts")
    return bool(info.get("enable_deterministic_inference"))


def launch_wait_s(model_path: str) -> float:
    """Seconds to wait for a server launched on model_path to serve: its *.safetensors bytes at
    LAUNCH_LOAD_BYTES_PER_S, plus LAUNCH_FIXED_S. SGLang's launch_server_process waits a fixed 300 s (a constant
    in entrypoints/http_server_engine.py, 0.5.21: no argument, no environment variable), short of what 213 GB
    at TP 8 and CUDA-graph capture can take."""
    num_bytes = sum(e.stat().st_size for e in os.scandir(model_path) if e.name.endswith(".safetensors"))
    return LAUNCH_FIXED_S + num_bytes / LAUNCH_LOAD_BYTES_PER_S


def wait_until_serving(url: str, alive, wait_s: float):
    """Return once the server at url answers /health_generate (a one-token generation: 200 once it serves),
    probing every HEALTH_POLL_S as launch_server_process does. alive(): whether its process still runs.
    Raises RuntimeError when the process has exited, TimeoutError after wait_s seconds."""
    probe = SGLangServer(url, timeout_s=HEALTH_CALL_TIMEOUT_S)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            probe.call("/health_generate")
            return
        except (RuntimeError, OSError):  # not listening yet (RuntimeError), 503 while starting, a probe timed out
            pass
        if not alive():
            raise RuntimeError(f"the SGLang server at {url} exited while starting (its log is above)")
        time.sleep(HEALTH_POLL_S)
    raise TimeoutError(f"the SGLang server at {url} did not serve within {wait_s:.0f} s (launch_wait_s: the "
                       f"checkpoint at {LAUNCH_LOAD_BYTES_PER_S / 1e9:g} GB/s + {LAUNCH_FIXED_S:.0f} s)")
