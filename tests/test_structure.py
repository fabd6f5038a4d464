"""The shape of the whole: imports point down, each setting is declared once, the async producer's state is
the run's (issue 23)."""

import ast
import dataclasses
import json
import os

import torch

import config
import train
from runs import MICRO

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Who may import whom: a file imports only files on lower layers (DESIGN.md's layers, in the order a reader
# meets them bottom up). A new top-level file gets a layer here.
LAYERS = {
    # 1: leaves, importing nothing of the project's
    "rules": 1, "logprobs": 1, "sandbox": 1, "sglang_server": 1, "scoring": 1, "scheduler": 1, "tokenizer": 1, "metrics": 1,
    # 2: the leaves' own configs sit beside them (each imports rules; model imports logprobs)
    "model": 2, "sampler": 2, "espo": 2, "filter": 2, "reward": 2,
    # 3: what reads the model's shape and moves its weights
    "hf_config": 3, "weights": 3, "ep_decode": 3, "paged_kv": 3, "graph_decode": 3,
    # 4: the run's configuration, composed of the sections above
    "config": 4,
    # 5: files in and out, several ranks
    "hf": 5, "data": 5, "distributed": 6,
    # 7: engines, trainer, checkpoints, the dry-run plan
    "sglang_engine": 7, "batching": 7, "evaluation": 7, "trainer": 7, "checkpoint": 7, "plan": 7, "reward_model": 7, "rollout": 8,
    # 9: the RL step's parts above the engines; 10: the entry point and the RL step
    "shaping": 9, "train": 10,
}
MAX_ARROWS = 92  # 58 after issue 23; checkpoint -> weights (a shard's bytes) and -> metrics (atomic writes) since;
# reward_model -> reward, hf, hf_config, tokenizer and train -> reward_model (issue 27: a reward model read
# from an HF checkpoint); batching's four and rollout -> batching, ep_decode -> model (continuous batching
# and expert-parallel decode in files of their own); evaluation's four and train -> evaluation (the evals
# out of train.py); paged_kv's five (-> model; batching, rollout, config and plan
# -> paged_kv: the page pool, its default page and its least size) and batching -> graph_decode (issue 26);
# shaping's six and train -> shaping (the step's reward-model shaping out of train.py, which drops -> reward);
# reward_model -> distributed (reward.rm_shard: a reward model sharded like the policy); sglang_engine ->
# sglang_server (one server's HTTP API and connect checks out of sglang_engine.py); evaluation -> metrics (the
# run's summary and its plot out of train.py)


def import_graph() -> dict[str, set[str]]:
    """file -> the top-level files it imports at run time (module level or inside a function; imports under
    `if TYPE_CHECKING:` are annotations only and are left out)."""
    files = {f[:-3] for f in os.listdir(ROOT) if f.endswith(".py")}
    graph = {}
    for name in files:
        tree = ast.parse(open(os.path.join(ROOT, name + ".py")).read())
        typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                       and "TYPE_CHECKING" in ast.unparse(node.test) for n in ast.walk(node)}
        graph[name] = set()
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.Import):
                graph[name] |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                graph[name].add(node.module.split(".")[0])
        graph[name] = (graph[name] & files) - {name}
    return graph


def test_imports_point_down_with_no_cycle_and_fewer_than_max_arrows():
    graph = import_graph()
    assert set(graph) == set(LAYERS), f"give every top-level file a layer: {set(graph) ^ set(LAYERS)}"
    upward = [f"{a} (layer {LAYERS[a]}) -> {b} (layer {LAYERS[b]})" for a in graph for b in graph[a]
              if LAYERS[b] >= LAYERS[a]]
    assert not upward, upward  # strictly downward arrows cannot form a cycle either
    arrows = sum(len(v) for v in graph.values())
    assert arrows < MAX_ARROWS, arrows


def test_every_setting_is_declared_in_exactly_one_config_class():
    classes = [config.TrainConfig, *config.SECTIONS.values()]
    declared = {}
    for cls in classes:
        for f in dataclasses.fields(cls):
            if not (cls is config.TrainConfig and f.name in config.SECTIONS):  # a section is no setting
                declared.setdefault(f.name, []).append(cls.__name__)
    # one name, two settings: experts per token (HF's num_experts_per_tok) and the sampler's top-k (SGLang's)
    homonyms = {"top_k": ["ModelConfig", "SamplingParams"]}
    twice = {name: owners for name, owners in declared.items() if len(owners) > 1 and homonyms.get(name) != owners}
    assert not twice, twice
    # every class checks each of its fields with exactly one rule, and a moved key is no field any more
    for cls in classes:
        assert set(cls.RULES) == {f.name for f in dataclasses.fields(cls)}, cls.__name__
    assert not set(config.MOVED) & {f.name for f in dataclasses.fields(config.TrainConfig)}


def test_an_async_checkpoint_holds_the_predictor_the_producer_used_and_resume_restores_it(tmp_path):
    """The producer's length predictor and stage-1 RNG are the run's own objects: a checkpoint of the async
    loop saves what the producer learned (every rollout generated so far), and a resumed run's producer
    goes on from it."""
    def run(*over):
        path = tmp_path / "cfg.py"
        path.write_text(MICRO + f"out_dir = {str(tmp_path / 'run')!r}\n")
        train.main(train.parse_args([str(path), "sft_lr=1e-3", "max_staleness=1", "ckpt_every=1", "ckpt_keep=20",
                                     *over]))

    def checkpoints():
        return {d.name: torch.load(d / "trainer_state.pt", weights_only=False)
                for d in sorted((tmp_path / "run" / "ckpt").iterdir())}

    def generated_by_step():  # rollouts generated up to and including each RL step, from metrics.jsonl
        rl = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
        rl = [r for r in rl if r["stage"] == "rl"]
        return {r["step"]: sum(x["filter/rollouts_generated"] for x in rl if x["step"] <= r["step"]) for r in rl}

    run("rl_steps=2")
    first = {s["step"]: s["predictor"] for s in checkpoints().values() if s["phase"] == "rl"}
    assert first and all(p["count"] == generated_by_step()[step] > 0 for step, p in first.items())
    run("resume=auto")  # from the checkpoint after RL step 1, to the end (3 RL steps)
    last = max((s for s in checkpoints().values() if s["phase"] == "rl"), key=lambda s: s["step"])
    assert last["step"] == 2
    # the resumed producer started from the checkpointed predictor: its count spans the steps before the resume
    assert last["predictor"]["count"] == generated_by_step()[2] > first[1]["count"]


def test_every_engine_attribute_the_rl_step_reads_is_declared_on_the_protocol_and_each_engine_has_it():
    """What train.py, evaluation.py and shaping.py read of `run.engine` is rollout.Engine's, and both engines
    (rollout.ENGINES' classes) define it: a method, or an attribute their code sets (SGLang's crash on
    `run.engine.preemptions`, issue 31, was an undeclared one)."""
    import rollout
    import sglang_engine
    declared = {n for n in vars(rollout.Engine) if not n.startswith("_")} | set(rollout.Engine.__annotations__)
    read = set()
    for name in ("train", "evaluation", "shaping"):
        for node in ast.walk(ast.parse(open(os.path.join(ROOT, name + ".py")).read())):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) and node.value.attr == "engine" \
                    and isinstance(node.value.value, ast.Name) and node.value.value.id == "run":
                read.add(node.attr)
    assert read and read <= declared, sorted(read - declared)
    for cls in (rollout.NativeEngine, sglang_engine.SGLangEngine):
        source = open(os.path.join(ROOT, cls.__module__ + ".py")).read()
        missing = [n for n in declared if not hasattr(cls, n) and f"self.{n}" not in source]
        assert not missing, (cls.__name__, missing)
