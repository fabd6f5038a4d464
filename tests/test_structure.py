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
# meets them bottom up). A new file of the project's code (top level or in FOLDERS) gets a layer here.
LAYERS = {
    # 0: what runs inside the code sandbox (`python -I`, which cannot import the project's files): below sandbox
    "sandbox_child": 0,
    # 1: leaves, importing nothing of the project's (but sandbox, which imports the child it starts)
    "rules": 1, "logprobs": 1, "ops": 1, "sandbox": 1, "scoring": 1, "scheduler": 1, "chat_template": 1,
    "metrics": 1,
    # 2: the leaves' own configs sit beside them (each imports rules; model imports logprobs and ops), and the
    # tokenizer, which tokenizes what chat_template renders
    "model": 2, "sampler": 2, "espo": 2, "filter": 2, "reward": 2, "tool_calls": 2, "tokenizer": 2,
    "run_lock": 2,
    # 3: what reads the model's shape and moves its weights
    "hf_config": 3, "weights": 3, "engines.sglang_server": 3, "engines.ep_decode": 3, "paged_kv": 3, "engines.graph_decode": 3,
    # 4: the run's configuration, composed of the sections above
    "config": 4,
    # 5: files in and out, several ranks
    "hf": 5, "data": 5, "distributed": 6,
    # 7: engines, trainer, checkpoints, the dry-run plan
    "sglang_engine": 7, "engines.batching": 7, "tool_rollout": 7, "trainer": 7, "checkpoint": 7, "plan": 7, "reward_model": 7,
    "rollout": 8,
    # 9: the RL step's parts above the engines; 10: the entry point and the RL step
    "shaping": 7, "evaluation": 9, "train": 10,
}
FOLDERS = ("engines",)  # folders of the project's Python code beside the top-level files (tests/, bench/ and tools/
# sit above everything and import what they test or measure)
MAX_ARROWS = 110  # 58 after issue 23; checkpoint -> weights (a shard's bytes) and -> metrics (atomic writes) since;
# reward_model -> reward, hf, hf_config, tokenizer and train -> reward_model (issue 27: a reward model read
# from an HF checkpoint); batching's four and rollout -> batching, ep_decode -> model (continuous batching
# and expert-parallel decode in files of their own); evaluation's four and train -> evaluation (the evals
# out of train.py); paged_kv's five (-> model; batching, rollout, config and plan
# -> paged_kv: the page pool, its default page and its least size) and batching -> graph_decode (issue 26);
# shaping's six and train -> shaping (the step's reward-model shaping out of train.py, which drops -> reward);
# reward_model -> distributed (reward.rm_shard: a reward model sharded like the policy); sglang_engine ->
# sglang_server (one server's HTTP API and connect checks out of sglang_engine.py); evaluation -> metrics (the
# run's summary and its plot out of train.py); sandbox -> sandbox_child (the sandbox's child side, run as a script,
# in a file of its own: issue 32); model -> ops and weights -> ops (issue 32: the tensor ops the model's
# modules call, out of model.py, which was over 700 lines); sglang_server -> model and sampler (what /generate
# takes and answers, beside the routes, out of sglang_engine.py, which was over 700 lines); tool_calls ->
# rules and sandbox, config -> tool_calls (issue 34: the tools section, the tools and their call parsers);
# tokenizer -> chat_template (issue 34.2: the chat template's rendering and tool-turn text out of
# tokenizer.py, which was over 700 lines); run_lock -> metrics, checkpoint -> run_lock and -> hf (the run folder's
# lock out of checkpoint.py, and the final model's save into it, out of train.py: both were over 700 lines);
# shaping -> rollout and -> weights gone (the judge's engine into rollout.py); tool_rollout -> distributed, sampler
# and tool_calls, rollout -> tool_rollout, data and evaluation -> tool_calls, evaluation -> tool_rollout (issue 34.3:
# multi-turn rollouts, the tools' schemas in the prompts, the evals with the tools off and answering at random)


def project_files() -> dict[str, str]:
    """Module name -> path of every Python file of the project's code: the top-level files and those of FOLDERS
    (as folder.name; a folder's __init__ holds only its docstring)."""
    files = {f[:-3]: os.path.join(ROOT, f) for f in os.listdir(ROOT) if f.endswith(".py")}
    for folder in FOLDERS:
        files.update({f"{folder}.{f[:-3]}": os.path.join(ROOT, folder, f) for f in os.listdir(os.path.join(ROOT, folder))
                      if f.endswith(".py") and f != "__init__.py"})
    return files


def import_graph() -> dict[str, set[str]]:
    """module -> the project's modules it imports at run time (module level or inside a function; imports under
    `if TYPE_CHECKING:` are annotations only and are left out)."""
    files = project_files()
    graph = {}
    for name, path in files.items():
        tree = ast.parse(open(path).read())
        typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                       and "TYPE_CHECKING" in ast.unparse(node.test) for n in ast.walk(node)}
        graph[name] = set()
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.Import):
                graph[name] |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                graph[name] |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}  # `from folder import x`
        graph[name] = (graph[name] & set(files)) - {name}
    return graph


def test_imports_point_down_with_no_cycle_and_fewer_than_max_arrows():
    graph = import_graph()
    assert set(graph) == set(LAYERS), f"give every file of the project's code a layer: {set(graph) ^ set(LAYERS)}"
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
    first = {s["step"]: s["predictor"] for s in checkpoints().values() if s["stage"] == "rl"}
    assert first and all(p["count"] == generated_by_step()[step] > 0 for step, p in first.items())
    run("resume=auto")  # from the checkpoint after RL step 1, to the end (3 RL steps)
    last = max((s for s in checkpoints().values() if s["stage"] == "rl"), key=lambda s: s["step"])
    assert last["step"] == 2
    # the resumed producer started from the checkpointed predictor: its count spans the steps before the resume
    assert last["predictor"]["count"] == generated_by_step()[2] > first[1]["count"]


def engine_reads(source: str) -> set[str]:
    """The attributes a file reads of a rollout engine: `<x>.engine.<attr>` (a train.Run's, the async producer's;
    cfg.engine, the config section, aside) and `engine.<attr>` (an engine passed in by name)."""
    read = set()
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Attribute):
            continue
        v = node.value
        held = isinstance(v, ast.Attribute) and v.attr == "engine" and not (isinstance(v.value, ast.Name)
                                                                             and v.value.id == "cfg")
        if held or (isinstance(v, ast.Name) and v.id == "engine"):
            read.add(node.attr)
    return read


def test_every_engine_attribute_the_rl_step_reads_is_declared_on_the_protocol_and_each_engine_has_it():
    """What train.py and evaluation.py read of a rollout engine (`run.engine`, `r.engine`, `producer.engine`, an
    `engine` argument) is rollout.Engine's, and both engines (rollout.ENGINES' classes) and the ToolEngine that wraps
    either define it: a method, or an attribute their code sets (SGLang's crash on `run.engine.preemptions`, issue 31, was an undeclared one).
    shaping.py reads none (its judge's engine is a NativeEngine it builds)."""
    import rollout
    import sglang_engine
    import tool_rollout
    declared = {n for n in vars(rollout.Engine) if not n.startswith("_")} | set(rollout.Engine.__annotations__)
    read = {name: engine_reads(open(os.path.join(ROOT, name + ".py")).read()) for name in ("train", "evaluation")}
    assert read["train"] and read["evaluation"], read  # the matcher still sees the reads
    read = set().union(*read.values())
    assert read <= declared, sorted(read - declared)
    for cls in (rollout.NativeEngine, sglang_engine.SGLangEngine, tool_rollout.ToolEngine):
        source = open(os.path.join(ROOT, cls.__module__ + ".py")).read()
        missing = [n for n in declared if not hasattr(cls, n) and f"self.{n}" not in source]
        assert not missing, (cls.__name__, missing)


# Where a top-level file may probe an object for an attribute (`hasattr(x, "name")`, `getattr(x, name, default)`),
# and why: only where x is no object of the project's (STYLE.md rule 20: a function names the type of what it reads,
# a Protocol's members or a class's fields, and reads them without a default). Key: (file, the probe as
# ast.unparse writes it).
PROBES_ALLOWED = {
    ("checkpoint.py", "getattr(e, 'failures', {})"):
        "any exception a save raised: torch.distributed.checkpoint's CheckpointException carries .failures, an "
        "OSError or RuntimeError does not (third-party exceptions)",
    ("distributed.py", "getattr(block, '_checkpoint_wrapped_module', block)"):
        "a block wrapped by torch's CheckpointWrapper (activation checkpointing) or not: torch's wrapper, third-party",
    ("hf_config.py", "getattr(want, '__name__', want)"):
        "an expected JSON type (a Python type such as int) or a literal value, named in an error message",
    ("metrics.py", "hasattr(self.backend, 'add_scalar')"):
        "the logger backend: a tensorboard SummaryWriter or a wandb run, third-party objects told apart by their API",
    ("model.py", "hasattr(type(w), 'to_local')"):
        "torch's DTensor (an expert-parallel shard) or a plain tensor, asked of the class: dynamo answers hasattr on "
        "a DTensor instance False",
    ("plan.py", "getattr(k, 'name', k)"):
        "torch's memory tracker snapshot keys: an enum member (its .name) or a str, third-party",
    ("sandbox_child.py", "getattr(builtins, reply['raised'], None)"):
        "a builtin exception named in the sandbox's reply (a module's names; an unknown name is no builtin)",
    ("scoring.py", "getattr(_thread_limit, 'deadline', None)"):
        "a threading.local: unset on a thread that has entered no time limit",
    ("sglang_engine.py", "hasattr(engine, 'begin_weight_update')"):
        "an sglang.Engine (InProcessServer's): a release before weight-update sessions (0.5.7) lacks the method",
    ("sglang_engine.py", "hasattr(result, 'success')"):
        "an SGLang control call's answer, whose shape differs by release (a tuple, a dict, an object with .success)",
    ("sglang_engine.py", "getattr(result, 'message', '')"):
        "the same answer object: a message only where SGLang gives one",
    ("trainer.py", "hasattr(norm, 'full_tensor')"):
        "clip_grad_norm_'s total norm: torch's DTensor under FSDP, a plain tensor in one process",
    ("weights.py", "hasattr(t, 'full_tensor')"): "torch's DTensor (a shard) or a plain tensor",
    ("weights.py", "hasattr(t, 'to_local')"): "torch's DTensor (a shard) or a plain tensor",
}


def attribute_probes() -> set[tuple[str, str]]:
    """(file, probe) of every `hasattr(...)` and every `getattr(...)` with a default in the project's code (the
    top-level files and FOLDERS')."""
    found = set()
    for path in sorted(project_files().values()):
        name = os.path.relpath(path, ROOT)
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and (
                    node.func.id == "hasattr" or (node.func.id == "getattr" and len(node.args) == 3)):
                found.add((name, ast.unparse(node)))
    return found


def test_no_function_probes_an_object_of_the_project_for_an_attribute():
    """No file of the project's code asks hasattr(x, "name") or getattr(x, "name", default) of an object of the project's: what
    it reads of one is named by its type (rollout.Engine, reward.RewardModel's `sharded` and PairwiseJudge's
    `counts`, sglang_engine.Server, batching.EngineParts, hf.load_hf's offsets). PROBES_ALLOWED says why each
    remaining probe is of something else (torch's DTensor, an SGLang answer, a thread-local), and holds no stale
    entry."""
    found, allowed = attribute_probes(), set(PROBES_ALLOWED)
    assert found <= allowed, f"a probe not allowed (name the type, or say why here): {sorted(found - allowed)}"
    assert allowed <= found, f"allowed probes no file makes any more: {sorted(allowed - found)}"
