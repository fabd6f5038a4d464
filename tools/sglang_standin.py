"""A stand-in SGLang server for CPU: the HTTP routes and JSON that sglang_engine.SGLangEngine uses, answered as
sglang 0.5.21 answers them, generating with this project's NativeEngine on a model loaded from a hub-layout
checkpoint folder. It is how the SGLang path runs end to end where SGLang cannot (no GPU):

    python tools/sglang_standin.py --checkpoint DIR --port P
    python train.py configs/hf_tiny.py init_hf=DIR engine.name=sglang engine.sglang_urls=http://127.0.0.1:P ...

What it answers, as a server started with `--skip-tokenizer-init --enable-return-routed-experts
--enable-deterministic-inference --dtype D` would (token ids in and out; D float32 by default, so the trainer's
replayed logprobs can be held to fp32's rounding):
- /generate: a batch of input_ids, one sampling_params per row (or one for all); each row's completion sampled
  from its own sampling_seed (a row does not depend on its batch, as deterministic inference promises), over every
  row of the embedding as SGLang samples (ids past the tokenizer's are possible in a random model), stopping at
  its stop_token_ids; meta_info holds output_token_logprobs [(logprob, id, None)] under the tempered softmax,
  finish_reason ({"type": "stop", "matched": id} or {"type": "length", "length": n}) and routed_experts: base64
  of int32 [prompt + completion - 1, num_hidden_layers, top_k] from routed_experts_start_len 0 (dense layers' rows
  hold 0s).
- /server_info (and /get_server_info), /health, /health_generate, /flush_cache, /release_memory_occupation,
  /resume_memory_occupation.
- The weight update over a process group: /init_weights_update_group joins the trainer's group (the recipe of
  sglang_engine.join_update_group, as SGLang's init_custom_process_group; gloo on CPU); each
  /update_weights_from_distributed receives its names, dtypes and shapes by broadcast from rank 0, in order; once
  every tensor of the model has arrived (HF names, assembled back with hf.from_hf) the engine takes them and the
  sync is counted and printed ("weight sync N: ..."), which is what a test observes. /begin_weight_update and
  /end_weight_update are absent (404), as in 0.5.21. /update_weights_from_tensor (CUDA IPC) is refused.

Not SGLang: no radix cache, no batching across requests (rows generate one at a time, under one lock), tensor
parallel size 1, no FP8. It serves tests and the CPU walk-through of docs/engines.md, never a run for real.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch
import torch.distributed.distributed_c10d as c10d

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from hf import from_hf, hf_shapes, load_hf  # noqa: E402
from rollout import NativeEngine  # noqa: E402
from sampler import SamplingParams, Vocab  # noqa: E402
from sglang_engine import join_update_group  # noqa: E402
from engines.sglang_server import SERVED_DTYPES  # noqa: E402
from weights import policy_tensors  # noqa: E402

VERSION = "0.5.21"
"""The SGLang release whose answers this stands in for (requirements-sglang.txt's)."""


class StandIn:
    """The server's state: the engine, the weight-update group and a sync in progress. One lock: one request's
    generation or weight update at a time."""

    def __init__(self, checkpoint: str, dtype: str):
        model = load_hf(checkpoint)
        self.cfg, self.checkpoint, self.dtype = model.cfg, checkpoint, dtype
        # num_tokens None: sample over every row of the embedding, as SGLang does; options None: static calls
        self.engine = NativeEngine(model.cfg, Vocab((), 0), dtype=SERVED_DTYPES[dtype])
        self.engine.update_weights(policy_tensors(model), version=0)
        self.hf_shapes = hf_shapes(model.cfg)  # what one sync must bring: every HF tensor of the model, its shape
        self.lock = threading.Lock()
        self.groups = {}  # group name -> its broadcast, which receives from rank 0 (the trainer)
        self.received: dict[str, torch.Tensor] = {}  # a sync in progress: HF name -> tensor
        self.syncs = 0
        self.released = False

    def info(self) -> dict:
        """/server_info: ServerArgs as resolved (the fields SGLangEngine reads among them) and the version."""
        return dict(model_path=self.checkpoint, dtype=self.dtype, tp_size=1, dp_size=1, pp_size=1, ep_size=1,
                    skip_tokenizer_init=True, enable_return_routed_experts=True, enable_deterministic_inference=True,
                    enable_memory_saver=False, quantization=None, version=VERSION)

    def generate(self, body: dict) -> list[dict] | dict:
        if self.released:
            raise ValueError("the server's memory is released: call /resume_memory_occupation first")
        if "input_ids" not in body:
            raise ValueError("the stand-in takes token ids (input_ids): it runs as with --skip-tokenizer-init")
        single = body["input_ids"] and isinstance(body["input_ids"][0], int)
        rows = [body["input_ids"]] if single else body["input_ids"]
        params = body.get("sampling_params") or {}
        params = params if isinstance(params, list) else [params] * len(rows)
        if len(params) != len(rows):
            raise ValueError(f"{len(params)} sampling_params for {len(rows)} input_ids")
        if body.get("return_routed_experts") and body.get("routed_experts_start_len", 0) != 0:
            raise ValueError("the stand-in returns routed experts from routed_experts_start_len=0 only")
        outs = [self.complete(row, p) for row, p in zip(rows, params)]
        return outs[0] if single else outs

    def complete(self, prompt: list[int], p: dict) -> dict:
        """One row: NativeEngine's sampling, its stream keyed by the request's sampling_seed."""
        cfg = self.cfg
        top_k = p.get("top_k", -1)
        params = SamplingParams(max_new_tokens=p.get("max_new_tokens", 128), temperature=p.get("temperature", 1.0),
                                top_p=p.get("top_p", 1.0), top_k=0 if top_k < 0 else top_k)
        with self.lock:
            self.engine.stop_ids = tuple(p.get("stop_token_ids") or ())
            r = self.engine.generate([prompt], params, n=1, seed=p.get("sampling_seed", 0), group_ids=[0])[0]
        C = len(r.completion_ids)
        # [T + C - 1, L, K] over the MoE layers -> every hidden layer, the dense first ones 0s, as SGLang's int32
        routes = torch.zeros(len(prompt) + C - 1, cfg.n_layers, cfg.top_k, dtype=torch.int32)
        routes[:, cfg.first_k_dense_replace:] = r.routes.to(torch.int32)
        reason = ({"type": "stop", "matched": r.completion_ids[-1]} if r.finish_reason == "stop"
                  else {"type": "length", "length": C})
        return {"output_ids": r.completion_ids, "meta_info": {
            "id": os.urandom(8).hex(), "finish_reason": reason, "prompt_tokens": len(prompt), "completion_tokens": C,
            "cached_tokens": 0, "weight_version": str(self.syncs),
            "output_token_logprobs": [[lp, i, None] for lp, i in zip(r.logprobs.tolist(), r.completion_ids)],
            "routed_experts": base64.b64encode(routes.numpy().tobytes()).decode("ascii")}}

    def join(self, body: dict) -> dict:
        """/init_weights_update_group: this server's one GPU is rank rank_offset of the trainer's group; a second
        group of the same name is refused, as SGLang refuses it (/destroy_weights_update_group first)."""
        if body["group_name"] in self.groups:
            raise ValueError(f"Failed to initialize custom process group: group {body['group_name']!r} exists")
        self.groups[body["group_name"]] = join_update_group(
            body["master_address"], body["master_port"], body["world_size"], body["group_name"],
            backend=body.get("backend", "nccl"), rank=body["rank_offset"])
        return {"success": True, "message": "Succeeded to initialize custom process group."}

    def leave(self, body: dict) -> dict:
        """/destroy_weights_update_group: leave the group of that name, so a restarted trainer can form it anew."""
        name = body.get("group_name", "weight_update_group")
        if self.groups.pop(name, None) is None:
            raise ValueError("The group to be destroyed does not exist.")
        # join_update_group registered the group under its name, as SGLang's init_custom_process_group does
        group = next(g for g, n in c10d._world.pg_names.items() if n == name)
        torch.distributed.destroy_process_group(group)
        return {"success": True, "message": "Succeeded to destroy custom process group."}

    def update(self, body: dict) -> dict:
        """/update_weights_from_distributed: receive each named tensor from rank 0, in order; once the whole model
        has arrived, the engine takes it."""
        if body["group_name"] not in self.groups:
            raise ValueError(f"no weight-update group {body['group_name']!r}: call /init_weights_update_group first")
        broadcast = self.groups[body["group_name"]]
        with self.lock:
            for name, dtype, shape in zip(body["names"], body["dtypes"], body["shapes"]):
                t = torch.empty(shape, dtype=getattr(torch, dtype))
                broadcast(t)  # receives rank 0's tensor into t
                self.received[name] = t
            self.take_if_whole()
        return {"success": True, "message": "Succeeded to update parameter online."}

    def take_if_whole(self):
        """Load the sync into the engine once every HF tensor of the model has arrived (a sync sends the whole
        model); raises ValueError naming a tensor the model has no place for, or one of another shape."""
        got = self.received
        if unknown := [(k, tuple(t.shape)) for k, t in got.items() if self.hf_shapes.get(k) != tuple(t.shape)]:
            self.received = {}
            raise ValueError(f"the weight sync sent {unknown[:3]}, which this model's HF tensors (name, shape) are "
                             f"not ({len(unknown)} in all)")
        if len(got) < len(self.hf_shapes):  # more buckets follow
            return
        whole = [(n, tuple(slice(0, k) for k in t.shape)) for n, t in policy_tensors(self.engine.model)]
        tensors = [(n, from_hf(n, sl, lambda key, i: got[key][i], lambda key: got[key].shape[0])) for n, sl in whole]
        self.syncs += 1
        self.engine.update_weights(tensors, version=self.syncs)
        size = sum(t.numel() * t.element_size() for t in got.values())
        dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in got.values()})
        print(f"sglang_standin: weight sync {self.syncs}: {len(got)} tensors, {size / 1e6:.1f} MB in {dtypes} over "
              f"the update group", flush=True)
        self.received = {}


def make_handler(standin: StandIn):
    """The request handler: routes as SGLang's entrypoints/http_server.py names them, answers as it answers."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            self.route(None)

        def do_POST(self):
            n = int(self.headers.get("Content-Length") or 0)
            self.route(json.loads(self.rfile.read(n)) if n else {})

        def route(self, body):
            path = self.path.split("?")[0]
            handlers = {
                "/generate": lambda: standin.generate(body),
                "/server_info": standin.info, "/get_server_info": standin.info,
                "/health": lambda: "", "/health_generate": lambda: "",
                "/flush_cache": lambda: "Cache flushed.\n",
                "/release_memory_occupation": lambda: setattr(standin, "released", True),
                "/resume_memory_occupation": lambda: setattr(standin, "released", False),
                "/init_weights_update_group": lambda: standin.join(body),
                "/destroy_weights_update_group": lambda: standin.leave(body),
                "/update_weights_from_distributed": lambda: standin.update(body),
            }
            if path == "/update_weights_from_tensor":
                return self.answer(400, {"error": {"message": "the stand-in takes weights over the update group "
                                                              "(/update_weights_from_distributed) only"}})
            if path not in handlers:
                return self.answer(404, {"detail": "Not Found"})
            try:
                out = handlers[path]()
            except (ValueError, KeyError, RuntimeError) as e:
                return self.answer(400, {"error": {"message": f"{type(e).__name__}: {e}"}})
            self.answer(200, out)

        def answer(self, status: int, out):
            text = out if isinstance(out, str) else json.dumps(out)
            self.send_response(status)
            self.send_header("Content-Type", "text/plain" if isinstance(out, str) else "application/json")
            self.send_header("Content-Length", str(len(text.encode())))
            self.end_headers()
            self.wfile.write(text.encode())

        def log_message(self, *args):  # quiet: the weight syncs are what it prints
            pass

    return Handler


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoint", required=True, help="a hub-layout checkpoint folder (config.json, safetensors)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=30000, help="0: a free port (the printed URL says which)")
    ap.add_argument("--dtype", default="float32", choices=sorted(SERVED_DTYPES),
                    help="the dtype it serves in and reports (SGLang's --dtype)")
    args = ap.parse_args()
    torch.manual_seed(0)
    server = ThreadingHTTPServer((args.host, args.port), make_handler(StandIn(args.checkpoint, args.dtype)))
    print(f"sglang_standin: serving {args.checkpoint} at http://{args.host}:{server.server_address[1]}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
