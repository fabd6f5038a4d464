"""sglang_engine.py on CPU: the engine settings' checks (config.EngineConfig, config.RELATIONS,
rollout.ENGINES), the HTTP payloads and call order against a fake SGLang server (http.server on
127.0.0.1, answering in SGLang's documented format), and, on a CUDA machine with sglang installed,
a real end-to-end run from the config."""
import base64
import dataclasses
import json
import os
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest
import torch

import sglang_engine
from engines import sglang_server
from config import EngineConfig, TrainConfig, load_config, parse_sglang_urls
from hf_config import config_to_hf
from model import ModelConfig, Transformer, route_dtype
from weights import FP8
from rollout import ENGINES, engine_builder
from sampler import SamplingParams, Vocab
from weights import policy_tensors
from sglang_engine import InProcessServer, SGLangEngine, build_sglang_engine
from engines.sglang_server import SGLangServer

EOS = 1
TOK = SimpleNamespace(stop_ids=(EOS,), pad_id=0, enc=SimpleNamespace(n_vocab=256), decode=str)  # what build_sglang_engine
# reads of a tokenizer.Tokenizer
PARAMS = SamplingParams(max_new_tokens=4)
CKPT = tempfile.mkdtemp(prefix="ckpt")  # the run's init_hf, as far as the engine reads it: config.json's dtype
with open(os.path.join(CKPT, "config.json"), "w") as f:
    json.dump({"dtype": "bfloat16"}, f)


class FakeSGLang(ThreadingHTTPServer):
    """An SGLang server's routes (entrypoints/http_server.py) that record (route, body) in `log` and
    answer as SGLang does; /generate completes each row with [last prompt id + 1, EOS]. info: server
    arguments /server_info reports over the defaults (a server started as the colocated one is)."""

    def __init__(self, cfg, log: list, *, tp_size: int = 1, sessions: bool = True, info: dict | None = None):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.cfg, self.log, self.tp_size, self.sessions = cfg, log, tp_size, sessions
        self.info = dict(enable_return_routed_experts=True, enable_deterministic_inference=True,
                         version="0.5.21") | (info or {})
        self.url = f"http://127.0.0.1:{self.server_address[1]}"
        threading.Thread(target=self.serve_forever, daemon=True).start()

    def answer(self, route: str, body):
        if route == "/generate":
            return [self.completion(row) for row in body["input_ids"]]
        if route == "/server_info":
            return {"tp_size": self.tp_size, "dp_size": 1, "pp_size": 1} | self.info  # flat, as resolved_dict()
        if route in ("/begin_weight_update", "/end_weight_update") and not self.sessions:
            return 404  # SGLang before PR 28001
        if route == "/flush_cache":
            return "Cache flushed.\n"  # plain text, as SGLang answers
        if route in ("/release_memory_occupation", "/resume_memory_occupation"):
            return None
        return {"success": True, "message": "ok"}

    def completion(self, prompt: list[int]) -> dict:
        """One result in SGLang's documented shape: meta_info with output_token_logprobs, a finish_reason
        dict and routed_experts as base64 int32 [T + C - 1, num_hidden_layers, top_k]."""
        ids, cfg = [prompt[-1] + 1, EOS], self.cfg
        routes = torch.arange((len(prompt) + 1) * cfg.n_layers * cfg.top_k, dtype=torch.int32) % cfg.num_experts
        return {"output_ids": ids, "meta_info": {
            "output_token_logprobs": [[-0.5, ids[0], None], [-0.25, EOS, None]],
            "finish_reason": {"type": "stop", "matched": EOS},
            "routed_experts": base64.b64encode(routes.numpy().tobytes()).decode("ascii")}}


class _Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        self.reply(None)

    def do_POST(self):
        self.reply(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))

    def reply(self, body):
        route = self.path
        self.server.log.append((self.server.url, route, body))
        out = self.server.answer(route, body)
        status, text = (404, '{"detail":"Not Found"}') if out == 404 else (200, out if isinstance(out, str)
                                                                         else json.dumps(out))
        self.send_response(status)
        self.send_header("Content-Length", str(len(text.encode())))
        self.end_headers()
        self.wfile.write(text.encode())

    def log_message(self, *args):  # quiet
        pass


@pytest.fixture
def log(monkeypatch):
    """The shared record of server calls and barriers, in the order they happened."""
    calls = []
    monkeypatch.setattr(sglang_engine, "barrier", lambda: calls.append((None, "barrier", None)))
    return calls


def routes(log, url=None) -> list[str]:
    return [r for u, r, _ in log if url is None or u in (url, None)]


def fp8_servable(cfg: ModelConfig, **widths) -> ModelConfig:
    """cfg widened where SGLang's blockwise FP8 needs whole 128-blocks on one GPU (weights.fp8_bf16_modules): the
    experts always (else it refuses the model), q|k|v by default (64-wide heads: q 256, k and v 128 each)."""
    return dataclasses.replace(cfg, **(dict(head_dim=64, moe_inter_dim=128) | widths))


def sglang_cfg(model, **engine) -> TrainConfig:
    """A run's settings with engine.name='sglang' (`engine`: the section's other fields); the policy is `model`."""
    return TrainConfig(engine=EngineConfig(name="sglang", **engine), init_hf=CKPT, device="cuda", model=model)


# ----------------------------------------------------------------------------- the config


@pytest.fixture
def run_folder(tmp_path):
    """An earlier run's output folder, as far as load_config reads it (init_from): its config.json."""
    (tmp_path / "config.json").write_text(json.dumps(config_to_hf(ModelConfig())))
    return str(tmp_path)


def sglang_args(run_folder) -> list[str]:
    """Command-line settings SGLang can run. dry_run: a CUDA config's checks on this machine, whatever its
    devices (RELATIONS skip only the device's availability for a dry run)."""
    return [f"init_from={run_folder}", "engine.name=sglang", "device=cuda", "dry_run=True"]


def check_engine(args: list[str]) -> TrainConfig:
    """What a run checks of its engine settings before any work: load_config (each field's rule, then
    RELATIONS), then train.prepare's look-up of engine.name in rollout.ENGINES."""
    cfg = load_config(None, args)
    engine_builder(cfg.engine.name)
    return cfg


@pytest.mark.parametrize("change, field", [
    (["engine.name=vllm"], r"engine\.name='vllm': need one of 'native', 'sglang'"),
    (["init_from="], "init_hf"),
    (["device=cpu"], r"device='cpu': engine\.name='sglang' with colocated servers .* needs device='cuda'"),
    (["engine.sglang_urls=localhost:30000"], r"engine\.sglang_urls="),  # no scheme
    (["engine.sglang_urls=http://10.0.0.2:30000/generate"], r"engine\.sglang_urls="),  # a route, not a base URL
    (["engine.sglang_urls=http://a:1,,http://b:2"], r"engine\.sglang_urls="),  # an empty entry
    (["engine.sglang_urls=http://a:1,http://a:1/"], r"engine\.sglang_urls="),  # one server twice
    (["engine.sglang_urls=http://a:port"], r"engine\.sglang_urls="),
    (["engine.name=native", "engine.sglang_urls=http://a:1"], r"engine\.sglang_urls="),  # set but never read
    (["engine.sglang_mem_fraction=1.5"], r"engine\.sglang_mem_fraction="),
    (["max_staleness=1"], r"max_staleness=1: engine\.name='sglang' runs synchronous steps"),
])
def test_a_config_sglang_cannot_run_is_a_value_error_naming_the_field(run_folder, change, field):
    with pytest.raises(ValueError, match=field):
        check_engine(sglang_args(run_folder) + change)


def test_a_config_sglang_can_run_passes_and_native_needs_nothing(run_folder):
    cfg = check_engine(sglang_args(run_folder) + ["engine.sglang_urls= http://10.0.0.2:30000, https://h:1 "])
    assert cfg.engine.urls == ["http://10.0.0.2:30000", "https://h:1"]
    assert check_engine(sglang_args(run_folder)).engine.urls == []  # colocated
    # a CPU trainer reaches external servers (tools/sglang_standin.py), its weight sync over gloo
    assert check_engine(sglang_args(run_folder) + ["device=cpu", "engine.sglang_urls=http://h:1"]).device == "cpu"
    assert check_engine([]).engine.name == "native"  # the defaults
    assert engine_builder("sglang") is build_sglang_engine and set(ENGINES) == {"native", "sglang"}


def test_the_engine_section_checks_its_own_fields_when_built():
    with pytest.raises(ValueError, match="sglang_urls="):
        EngineConfig(name="sglang", sglang_urls="http://a:1,http://a:1")
    with pytest.raises(ValueError, match="sglang_urls="):
        EngineConfig(sglang_urls="http://a:1")  # name='native' never reads it
    with pytest.raises(ValueError, match="sglang_mem_fraction="):
        EngineConfig(name="sglang", sglang_mem_fraction=1.0)  # 0 = from the plan (plan.colocated_sglang)
    assert parse_sglang_urls("http://a:1/, https://b:2") == ["http://a:1", "https://b:2"] and parse_sglang_urls(" ") == []


def test_fp8_rollouts_need_sglang_or_one_process(run_folder, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")  # as torchrun sets it
    with pytest.raises(ValueError, match=r"engine\.fp8=True: the sharded native engine"):
        check_engine(["engine.fp8=true"])
    check_engine(sglang_args(run_folder) + ["engine.fp8=true"])  # SGLang serves FP8 on any number of ranks
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert check_engine(["engine.fp8=true"]).engine.fp8  # the native engine's own FP8 copy, in one process


# ----------------------------------------------------------------------------- external servers


def test_external_servers_get_the_documented_generate_payload_round_robin_by_group(tiny_cfg, log):
    a, b = FakeSGLang(tiny_cfg, log), FakeSGLang(tiny_cfg, log)
    engine = build_sglang_engine(sglang_cfg(tiny_cfg, sglang_urls=f"{a.url},{b.url}"), TOK, Transformer(tiny_cfg))
    out = engine.generate([[5, 6], [7], [9, 10, 11]], PARAMS, n=2, seed=3, group_ids=[4, 5, 6])
    sent = {u: body for u, r, body in log if r == "/generate"}
    assert sent[a.url]["input_ids"] == [[5, 6], [5, 6], [9, 10, 11], [9, 10, 11]]  # groups 4 and 6: 4 % 2 == 0
    assert sent[b.url]["input_ids"] == [[7], [7]]
    assert set(sent[a.url]) == {"input_ids", "sampling_params", "return_logprob", "logprob_start_len",
                                "return_routed_experts", "routed_experts_start_len"}
    assert sent[a.url]["return_routed_experts"] and sent[a.url]["routed_experts_start_len"] == 0
    # each row keeps the seed the whole batch would give it: split over servers, sampled as in one call
    seeds = [p["sampling_seed"] for p in sent[a.url]["sampling_params"] + sent[b.url]["sampling_params"]]
    whole = sglang_server.sglang_request([[5, 6], [9, 10, 11], [7]], PARAMS, n=2, seed=3, eos_id=EOS,
                                         group_ids=[4, 6, 5])
    assert seeds == [p["sampling_seed"] for p in whole["sampling_params"]]
    assert [r.group_id for r in out] == [4, 4, 5, 5, 6, 6]  # back in the caller's order
    assert [r.completion_ids for r in out][::2] == [[7, EOS], [8, EOS], [12, EOS]]
    r = out[4]
    assert r.routes.shape == (3 + 2 - 1, tiny_cfg.num_moe_layers, tiny_cfg.top_k) and r.finish_reason == "stop"
    assert r.routes.dtype == route_dtype(tiny_cfg.num_experts)  # 8 experts: uint8, a quarter of SGLang's int32
    torch.testing.assert_close(r.logprobs, torch.tensor([-0.5, -0.25]))


def test_external_sync_forms_the_nccl_group_once_and_broadcasts_every_bucket_in_order(tiny_cfg, log, monkeypatch):
    a, b = FakeSGLang(tiny_cfg, log, tp_size=2), FakeSGLang(tiny_cfg, log, sessions=False)
    joined, sent = [], []
    monkeypatch.setattr(sglang_engine, "join_update_group",
                        lambda *group, backend: joined.append((*group, backend)) or
                        (lambda t: sent.append((t.dtype, tuple(t.shape)))))
    model = Transformer(tiny_cfg)
    engine = build_sglang_engine(sglang_cfg(tiny_cfg, sglang_urls=f"{a.url},{b.url}"), TOK, model)
    engine.bucket_bytes = 16 << 10
    for version in (1, 2):
        engine.update_weights(policy_tensors(model), version=version)
    assert engine.weight_version == 2 and len(joined) == 1
    inits = {u: body for u, r, body in log if r == "/init_weights_update_group"}  # sent concurrently
    # rank 0 is this trainer rank; server a's 2 GPUs are ranks 1-2, server b's one GPU rank 3
    assert [(inits[u]["rank_offset"], inits[u]["world_size"], inits[u]["backend"]) for u in (a.url, b.url)] == [
        (1, 4, "nccl"), (3, 4, "nccl")]
    assert joined[0][2:] == (4, inits[a.url]["group_name"], "nccl") and inits[b.url]["master_port"] == joined[0][1]
    buckets = [body for u, r, body in log if r == "/update_weights_from_distributed" and u == a.url]
    assert len(buckets) > 2 and not any(g["flush_cache"] for g in buckets)
    # what the servers expect, in order, is what was broadcast, and it is the whole model in HF names
    expected = [(getattr(torch, d), tuple(s)) for g in buckets for d, s in zip(g["dtypes"], g["shapes"])]
    assert sent == expected
    names = [n for g in buckets for n in g["names"]]
    assert names[:len(names) // 2] == names[len(names) // 2:]  # two syncs, the same tensors
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in names and "lm_head.weight" in names
    # server a has sessions: begin, buckets, end, flush; server b (older SGLang) takes buckets without them
    a_sync = [r for r in routes(log, a.url) if r not in ("/server_info", "/init_weights_update_group")]
    assert a_sync[0] == "/begin_weight_update" and a_sync[-3:] == ["/end_weight_update", "/flush_cache", "barrier"]
    assert a_sync.count("/begin_weight_update") == a_sync.count("/end_weight_update") == 2
    assert "/end_weight_update" not in routes(log, b.url) and routes(log, b.url)[-2:] == ["/flush_cache", "barrier"]


def test_a_server_without_routed_expert_capture_is_refused_at_connect_naming_it_and_the_flag(tiny_cfg, log):
    good, bad = FakeSGLang(tiny_cfg, log), FakeSGLang(tiny_cfg, log, info=dict(enable_return_routed_experts=False))
    with pytest.raises(RuntimeError, match=f"SGLang {bad.url} .*start it with --enable-return-routed-experts"):
        build_sglang_engine(sglang_cfg(tiny_cfg, sglang_urls=f"{good.url},{bad.url}"), TOK, Transformer(tiny_cfg))
    assert "/generate" not in routes(log)  # refused before any rollout


def test_a_server_without_deterministic_inference_is_warned_of_and_the_engine_is_not_seeded(tiny_cfg, log):
    seeded = FakeSGLang(tiny_cfg, log)
    unseeded = FakeSGLang(tiny_cfg, log, info=dict(enable_deterministic_inference=False))
    with pytest.warns(UserWarning, match=f"SGLang {unseeded.url} runs without --enable-deterministic-inference: "
                                         f"it ignores each request's sampling_seed"):
        engine = SGLangEngine.from_engine([SGLangServer(seeded.url), SGLangServer(unseeded.url)], tiny_cfg,
                                          Vocab(EOS))
    assert engine.seeded is False
    assert SGLangEngine.from_engine(SGLangServer(seeded.url), tiny_cfg, Vocab(EOS)).seeded is True


def test_the_colocated_server_is_started_with_what_connect_checks(tiny_cfg, log):
    args = sglang_engine.sglang_server_args("/ckpt", fp8=False)  # what the colocated launch passes to ServerArgs
    server = FakeSGLang(tiny_cfg, log, info=dict(enable_return_routed_experts=args["enable_return_routed_experts"],
                                                 enable_deterministic_inference=args["enable_deterministic_inference"]))
    assert sglang_server.check_server(SGLangServer(server.url)) is True


def test_the_launch_wait_grows_with_the_checkpoints_bytes(tmp_path):
    (tmp_path / "config.json").write_bytes(b"x" * 10**6)  # not weights: not counted
    empty = sglang_server.launch_wait_s(str(tmp_path))
    assert empty == sglang_server.LAUNCH_FIXED_S
    (tmp_path / "model-00001-of-00002.safetensors").write_bytes(b"x" * 3 * 10**6)
    (tmp_path / "model-00002-of-00002.safetensors").write_bytes(b"x" * 10**6)
    assert sglang_server.launch_wait_s(str(tmp_path)) == pytest.approx(
        empty + 4 * 10**6 / sglang_server.LAUNCH_LOAD_BYTES_PER_S)
    # the case: 213 GB at the stated 1 GB/s is well past SGLang's fixed 300 s
    assert sglang_server.LAUNCH_FIXED_S + 213e9 / sglang_server.LAUNCH_LOAD_BYTES_PER_S > 300


def test_the_launch_wait_returns_once_the_server_serves_and_fails_when_it_died_or_ran_out(tiny_cfg, log):
    server = FakeSGLang(tiny_cfg, log)
    sglang_server.wait_until_serving(server.url, alive=lambda: True, wait_s=10)
    assert routes(log) == ["/health_generate"]
    with pytest.raises(RuntimeError, match="exited while starting"):
        sglang_server.wait_until_serving("http://127.0.0.1:9", alive=lambda: False, wait_s=10)
    with pytest.raises(TimeoutError, match="did not serve within 0 s"):
        sglang_server.wait_until_serving("http://127.0.0.1:9", alive=lambda: True, wait_s=0)


def test_fp8_sync_sends_e4m3_weights_with_inverse_scales_and_a_high_precision_router(tiny_cfg, log, monkeypatch):
    cfg = fp8_servable(tiny_cfg)
    server = FakeSGLang(cfg, log)
    monkeypatch.setattr(sglang_engine, "join_update_group", lambda *group, backend: lambda t: None)
    model = Transformer(cfg)
    engine = build_sglang_engine(sglang_cfg(cfg, sglang_urls=server.url, fp8=True), TOK, model)
    engine.update_weights(policy_tensors(model), version=1)
    buckets = [g for _, r, g in log if r == "/update_weights_from_distributed"]
    dtypes = {n: d for g in buckets for n, d in zip(g["names"], g["dtypes"])}
    assert dtypes["model.layers.0.self_attn.q_proj.weight"] == str(FP8).removeprefix("torch.") == "float8_e4m3fn"
    assert dtypes["model.layers.0.self_attn.q_proj.weight_scale_inv"] == "float32"
    assert dtypes["model.layers.0.mlp.gate.weight"] == "bfloat16"  # the router is never FP8: bf16, as SGLang serves it


@pytest.mark.parametrize("bad, span", [(259, r"\[0, 259\]"), (8, r"\[0, 8\]"), (-2, r"\[-2, 7\]")])
def test_routed_experts_with_an_id_out_of_range_are_refused_before_the_cast(tiny_cfg, bad, span):
    # 8 experts travel as uint8: unchecked, 259 would wrap around to expert 3, a valid-looking id
    routes = torch.arange(3 * tiny_cfg.n_layers * tiny_cfg.top_k, dtype=torch.int32) % tiny_cfg.num_experts
    payload = base64.b64encode(routes.numpy().tobytes()).decode("ascii")
    assert torch.equal(sglang_server.decode_routed_experts(payload, 3, tiny_cfg).long(),
                       routes.view(3, tiny_cfg.n_layers, tiny_cfg.top_k).long())
    routes[:2] = torch.tensor([7, bad])  # the first token's first layer: only `bad` is wrong (distinct, no -1)
    payload = base64.b64encode(routes.numpy().tobytes()).decode("ascii")
    with pytest.raises(ValueError, match=f"routed_experts ids span {span}; valid ids are -1"):
        sglang_server.decode_routed_experts(payload, 3, tiny_cfg)


def test_an_error_answer_names_the_server_the_route_and_sglangs_message(tiny_cfg, log):
    server = FakeSGLang(tiny_cfg, log, sessions=False)
    with pytest.raises(RuntimeError, match=f"{server.url}/end_weight_update answered 404"):
        SGLangServer(server.url).end_weight_update()
    with pytest.raises(RuntimeError, match="unreachable"):
        SGLangServer("http://127.0.0.1:9", timeout_s=5).generate(input_ids=[[1]])


# ----------------------------------------------------------------------------- colocated


def test_colocated_memory_is_released_before_training_and_resumed_before_rollouts(tiny_cfg, log):
    server = FakeSGLang(tiny_cfg, log, tp_size=2)
    packed = []
    client = SGLangServer(server.url, serialize=lambda bucket: packed.append(bucket) or f"ipc-{len(packed)}")
    engine = SGLangEngine.from_engine(client, tiny_cfg, Vocab(EOS, decode=lambda ids: ",".join(map(str, ids))),
                                      colocated=True, bucket_bytes=16 << 10)
    out = engine.generate([[5, 6]], PARAMS, n=1, seed=0)[0]
    assert out.text == ",".join(map(str, out.text_ids))  # the run's tokenizer's decode, not the server's text
    engine.wake()  # awake already: nothing to resume
    engine.sleep()  # the trainer trains
    engine.sleep()  # asleep already: nothing more to release
    with pytest.raises(RuntimeError, match="wake"):
        engine.generate([[5, 6]], PARAMS)
    with pytest.raises(RuntimeError, match="wake"):
        engine.update_weights(policy_tensors(Transformer(tiny_cfg)), version=1)
    engine.wake()
    with pytest.raises(RuntimeError, match="update_weights"):  # resumed memory holds no weights yet
        engine.generate([[5, 6]], PARAMS)
    engine.update_weights(policy_tensors(Transformer(tiny_cfg)), version=1)
    assert engine.generate([[5, 6]], PARAMS)[0].weight_version == 1
    calls = [r for r in routes(log) if r != "/server_info"]
    n = calls.count("/update_weights_from_tensor")
    assert n > 1 and calls == (["/generate", "barrier", "/release_memory_occupation", "barrier",
                                "barrier", "/resume_memory_occupation", "barrier", "/begin_weight_update"]
                               + ["/update_weights_from_tensor"] * n
                               + ["/end_weight_update", "/flush_cache", "barrier", "/generate"])
    bodies = [body for _, r, body in log if r == "/update_weights_from_tensor"]
    # one serialized copy of the bucket per TP rank, the cache flushed once at the end
    assert bodies[0] == {"serialized_named_tensors": ["ipc-1", "ipc-2"], "load_format": None, "flush_cache": False}
    assert len(packed) == 2 * n and packed[0][0][0] == "model.embed_tokens.weight"


@pytest.mark.parametrize("fp8", [False, True], ids=["checkpoint", "fp8-copy"])
def test_colocated_servers_load_the_checkpoint_or_the_fp8_copy_of_the_policy_written_first(tiny_cfg, log, tmp_path,
                                                                                           monkeypatch, fp8):
    launched = []

    class Launched:  # stands in for SGLangEngine(path, ...), the server a node's local rank 0 launches
        def __init__(self, path, model_cfg, vocab, **kw):
            launched.append((path, vocab, kw, routes(log), sorted(os.listdir(path)) if os.path.isdir(path) else None))
            self.servers = [SimpleNamespace(url="http://127.0.0.1:1")]

    monkeypatch.setattr(sglang_engine, "SGLangEngine", Launched)
    monkeypatch.setattr(sglang_engine, "check_colocated_install", lambda: None)  # as if sglang accepted this torch
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # two GPUs on this node: TP 2, and EP 2 (it divides 8 experts)
    model_cfg = fp8_servable(tiny_cfg, head_dim=tiny_cfg.head_dim)  # 8-wide heads: q split over 2 GPUs is 16 wide
    cfg = dataclasses.replace(sglang_cfg(model_cfg, fp8=fp8, sglang_mem_fraction=0.5), out_dir=str(tmp_path / "out"))
    policy = Transformer(model_cfg)
    engine = build_sglang_engine(cfg, TOK, policy)
    assert isinstance(engine, Launched) and len(launched) == 1
    path, vocab, kw, before, files = launched[0]
    assert vocab == Vocab(TOK.stop_ids, TOK.pad_id, TOK.enc.n_vocab, TOK.decode)
    assert kw == dict(fp8=fp8, tp_size=2, ep_size=2, mem_fraction_static=0.5, seed=cfg.seed)
    assert before == ["barrier"]  # what rank 0 wrote is complete before any server loads it
    if not fp8:
        assert path == CKPT  # init_hf as it is: nothing written
        assert not (tmp_path / "out").exists()
        return
    assert path == os.path.join(cfg.out_dir, "sglang_fp8") and "config.json" in files  # written by the build
    config = json.loads((tmp_path / "out" / "sglang_fp8" / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "fp8"
    from safetensors.torch import load_file
    saved = load_file(tmp_path / "out" / "sglang_fp8" / "model.safetensors")
    # the tiny model's attention split over the 2 GPUs is no whole 128-block: kept bf16 and listed so; the
    # experts, split by expert, blockwise FP8
    assert "model.layers.0.self_attn.q_proj" in config["quantization_config"]["ignored_layers"]
    assert saved["model.layers.0.self_attn.q_proj.weight"].dtype == torch.bfloat16
    assert saved["model.layers.0.mlp.experts.0.gate_proj.weight"].dtype == FP8
    assert "model.layers.0.mlp.experts.0.gate_proj.weight_scale_inv" in saved
    ours = dict(sglang_engine.hf_tensors(policy_tensors(policy), model_cfg))  # and the rest is this policy's
    assert torch.equal(saved["model.embed_tokens.weight"], ours["model.embed_tokens.weight"].to(torch.bfloat16))


def test_a_non_leader_rank_takes_part_in_the_gathers_and_generates_but_sends_nothing(tiny_cfg, log):
    server = FakeSGLang(tiny_cfg, log)
    engine = SGLangEngine.from_engine(SGLangServer(server.url), tiny_cfg, Vocab(EOS), leader=False, colocated=True)
    drawn = []
    tensors = ((n, drawn.append(n) or t) for n, t in policy_tensors(Transformer(tiny_cfg)))
    engine.sleep()
    engine.wake()
    engine.update_weights(tensors, version=3)
    with engine.phase():  # NativeEngine's rollout phase: nothing to gather here
        assert engine.memory() == {} and not engine.sharded
    assert len(drawn) == len(list(policy_tensors(Transformer(tiny_cfg))))  # every gather taken part in
    assert engine.generate([[5]], PARAMS)[0].weight_version == 3
    assert routes(log) == ["/server_info", "barrier", "barrier", "barrier", "barrier", "barrier", "/generate"]


def test_in_process_engine_sync_brackets_buckets_with_sessions_and_flushes_once(tiny_cfg):
    calls = []
    engine = SimpleNamespace(  # sglang.Engine's methods, as the offline API names them
        begin_weight_update=lambda: calls.append("begin") or (True, ""),
        end_weight_update=lambda: calls.append("end") or (True, ""),
        update_weights_from_tensor=lambda named_tensors, flush_cache: calls.append(flush_cache) or (True, "ok"),
        flush_cache=lambda: calls.append("flush"))
    SGLangEngine.from_engine(InProcessServer(engine), tiny_cfg, Vocab(EOS), bucket_bytes=16 << 10).update_weights(
        policy_tensors(Transformer(tiny_cfg)), version=1)
    assert calls[0] == "begin" and calls[-2:] == ["end", "flush"] and set(calls[1:-2]) == {False}


def test_the_update_group_recipe_forms_a_group_and_broadcasts(tiny_cfg):
    # gloo and one rank: the rendezvous, the prefixed store and the private helper work on this torch
    broadcast = sglang_engine.join_update_group("127.0.0.1", sglang_engine._free_port(), 1, "test", backend="gloo")
    t = torch.arange(6.0)
    broadcast(t)
    assert torch.equal(t, torch.arange(6.0))


# ----------------------------------------------------------------------------- a real engine (GPU)


@pytest.mark.cuda
@pytest.mark.sglang
def test_sglang_from_the_config_generates_sleeps_syncs_and_matches_the_trainer(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (SGLang runs on CUDA only)")
    pytest.importorskip("sglang", reason="needs sglang (GPU machines: pip install -r requirements-sglang.txt)")
    from config import load_config
    from espo import mismatch_metrics
    from hf import load_hf
    from hf_checkpoint import build_checkpoint
    from logprobs import token_logprobs
    from tokenizer import load_hf_tokenizer
    path = build_checkpoint(str(tmp_path), num_ranks=1000)
    cfg = load_config(None, [f"init_hf={path}", "engine.name=sglang", "device=cuda", "engine.sglang_mem_fraction=0.3",
                             "sampling.max_new_tokens=8", "max_prompt_tokens=0"])
    tok = load_hf_tokenizer(path)
    model = load_hf(path).cuda()  # the policy: colocated without engine.fp8, the server loads init_hf itself
    engine = build_sglang_engine(cfg, tok, model)
    prompts = [tok.encode("1 + 2 ="), tok.encode("Hello")]
    assert len(engine.generate(prompts, cfg.sampling, n=2, seed=0)) == 4
    with torch.no_grad():
        model.lm_head.weight.mul_(2.0)  # weights the server has never loaded: only a sync makes them match
    engine.sleep()
    engine.wake()
    engine.update_weights(policy_tensors(model), version=1)
    infer, trainer = [], []
    for r in engine.generate(prompts, cfg.sampling, n=2, seed=0):
        assert r.weight_version == 1
        seq = torch.tensor(r.prompt_ids + r.completion_ids, device="cuda")
        assert r.routes.shape == (len(seq) - 1, cfg.model.num_moe_layers, cfg.model.top_k)
        with torch.no_grad():
            logits = model(seq[None, :-1], routed_experts=r.routes[None].cuda().int())[0]  # (1, T + C - 1, V)
        trainer.append(token_logprobs(logits, seq[None, 1:])[0, len(r.prompt_ids) - 1:].cpu())
        infer.append(r.logprobs)
    assert mismatch_metrics(infer, trainer)["mismatch/max_abs_logp"] < 0.1


@pytest.mark.parametrize("release, ours, refused", [
    ("0.5.21", (2, 29, 7), None),  # requirements-sglang.txt's release: torch 2.13.0's NCCL, the trainer's
    ("0.5.23", (2, 29, 7), r"sglang 0\.5\.23 with NCCL 2\.30\.7 and this trainer NCCL 2\.29\.7: NCCL refuses a "
                           r"communicator of two versions.*requirements-sglang\.txt.*nvidia-nccl-cu13==2\.30\.7"),
    ("0.5.21", (2, 29, 8), r"sglang 0\.5\.21 with NCCL 2\.29\.7 and this trainer NCCL 2\.29\.8"),  # patch counts too
    ("0.9.0", (2, 29, 7), r"sglang 0\.9\.0, whose NCCL is not known here.*exactly this trainer's NCCL 2\.29\.7"),
])
def test_a_server_whose_nccl_is_not_exactly_the_trainers_is_refused_at_connect_naming_both(tiny_cfg, log, monkeypatch,
                                                                                           release, ours, refused):
    """The weight broadcast puts the trainer and every server GPU in one NCCL communicator, which NCCL forms only
    between equal versions (major, minor and patch): a server of another NCCL, or of a release whose NCCL is not
    known, is refused when connecting, before any rollout, not at the first weight sync."""
    monkeypatch.setattr(sglang_server, "trainer_nccl", lambda: ours)  # this process's NCCL, as a GPU would report it
    server = FakeSGLang(tiny_cfg, log, info=dict(version=release))
    run = sglang_cfg(tiny_cfg, sglang_urls=server.url)
    if refused is None:
        build_sglang_engine(run, TOK, Transformer(tiny_cfg))
        return
    with pytest.raises(RuntimeError, match=f"SGLang {server.url} runs {refused}"):
        build_sglang_engine(run, TOK, Transformer(tiny_cfg))
    assert routes(log) == ["/server_info"]  # nothing generated, no group formed


def test_without_cuda_the_weight_update_group_has_no_nccl_to_compare(tiny_cfg, log, monkeypatch):
    monkeypatch.setattr(sglang_server.torch.cuda, "is_available", lambda: False)
    assert sglang_server.trainer_nccl() is None and sglang_server.nccl_pairing("0.9.0", "http://s:1") is None


def test_a_colocated_server_pairs_no_nccl_with_the_trainer(tiny_cfg, log, monkeypatch):
    """Colocated, weights go by CUDA IPC (no NCCL group), so connect asks nothing of NCCL, whatever the release."""
    monkeypatch.setattr(sglang_server, "trainer_nccl", lambda: (2, 29, 7))
    server = FakeSGLang(tiny_cfg, log, info=dict(version="0.9.0"))
    SGLangEngine.from_engine(SGLangServer(server.url), tiny_cfg, Vocab(EOS), colocated=True)


@pytest.mark.parametrize("served, config_dtype, want", [
    ("auto", "bfloat16", torch.bfloat16), ("auto", "float32", torch.float16), ("auto", None, torch.float16),
    ("bfloat16", "float32", torch.bfloat16), ("float32", "bfloat16", torch.float32), ("half", None, torch.float16)])
def test_the_served_dtype_is_the_servers_dtype_and_auto_resolves_as_sglang_does(served, config_dtype, want):
    """sglang 0.5.21's configs/model_config.py: --dtype auto serves the checkpoint's dtype, a float32 one in float16."""
    assert sglang_server.served_dtype({"dtype": served}, config_dtype) == want
    with pytest.raises(RuntimeError, match=r"dtype='int8'.* one of 'bfloat16'"):
        sglang_server.served_dtype({"dtype": "int8"}, None)


@pytest.mark.parametrize("family", ["qwen3_moe", "glm4_moe"])
def test_the_sync_sends_the_servers_dtype_and_glms_router_in_fp32(tiny_cfg, log, monkeypatch, family):
    cfg = dataclasses.replace(tiny_cfg, hf_model_type=family, router="sigmoid" if family == "glm4_moe" else "softmax")
    server = FakeSGLang(cfg, log, info=dict(dtype="float16"))
    monkeypatch.setattr(sglang_engine, "join_update_group", lambda *group, backend: lambda t: None)
    model = Transformer(cfg)
    engine = build_sglang_engine(sglang_cfg(cfg, sglang_urls=server.url), TOK, model)
    engine.update_weights(policy_tensors(model), version=1)
    dtypes = {n: d for _, r, g in log if r == "/update_weights_from_distributed" for n, d in zip(g["names"], g["dtypes"])}
    router = {n for n in dtypes if n.endswith((".mlp.gate.weight", "e_score_correction_bias"))}
    assert router and {dtypes[n] for n in router} == {"float32" if family == "glm4_moe" else "float16"}
    assert {d for n, d in dtypes.items() if n not in router} == {"float16"}
