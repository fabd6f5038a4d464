import dataclasses
import glob
import importlib.util
import os

import pytest
import torch

import checkpoint
import plan
import train
from hf_checkpoint import scorer_config_folder
from hf_config import config_to_hf
from sampler import Vocab
from plan import param_counts, print_plan

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = sorted(glob.glob(os.path.join(ROOT, "configs", "*.py")))
TINY = os.path.join(ROOT, "configs", "tiny.py")


def _bench_memory():
    spec = importlib.util.spec_from_file_location("bench_memory", os.path.join(ROOT, "bench", "memory.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("path", [p if os.path.basename(p) == "tiny.py" else pytest.param(p, marks=pytest.mark.slow)
                                  for p in CONFIGS], ids=[os.path.basename(p) for p in CONFIGS])
def test_every_config_passes_the_dry_run_plan(path, capsys):  # beyond tiny's (the path), 15-60 s each on 2 cores
    result = train.main(train.parse_args([path, "dry_run=True"]))
    assert len(result["plan"]) >= 1 and all(row["total"] > 0 for row in result["plan"])
    assert "parameters:" in capsys.readouterr().out


@pytest.mark.slow  # four measured runs, about 20 s on 2 idle cores
def test_the_plan_is_within_2_percent_of_measured_trainers_and_5_of_engines_in_both_dtypes():
    """plan.py against the peaks of real runs of the same code on this CPU (bench/memory.py): live
    tensor memory (the trainer's to the byte: the plan reads torch's own tracker; the engine's within
    5%), and in fp32 the process's resident set as well, within 15%. A small shape with a dense
    block, qk-norm and activation checkpointing."""
    memory = _bench_memory()
    shape = ["model.n_layers=3", "model.first_k_dense_replace=1", "model.dense_inter_dim=384", "model.qk_norm=True",
             "activation_checkpoint=True", "microbatch_tokens=2048", "gen_batch_rows=64", "sampling.max_new_tokens=16",
             "max_prompt_tokens=128"]
    runs = [(part, [*shape, f"dtype={dtype}"]) for dtype in ("float32", "bfloat16") for part in ("trainer", "engine")]
    for (part, args), measured in zip(runs, memory.measure_many(runs)):
        planned = memory.planned(part, args)
        # the trainer's plan is torch's own tracker on the same steps; the engine's a sum of its parts (plan.py)
        bound = 0.02 if part == "trainer" else 0.05
        assert 1 - bound <= planned / measured["tensors"] <= 1 + bound, (part, args, planned, measured)
        if "dtype=float32" in args:  # bf16 matmuls on CPU keep buffers of oneDNN's own, outside any tensor
            assert 0.85 <= planned / measured["rss"] <= 1.15, (part, args, planned, measured)


@pytest.mark.slow  # about 10 s on 2 idle cores
def test_the_plan_extends_two_and_three_moe_blocks_to_the_full_depth_exactly():
    cfg = train.parse_args([TINY, "model.n_layers=7", "model.first_k_dense_replace=1",
                            "model.dense_inter_dim=256", "dtype=bfloat16", "microbatch_tokens=1024"])
    extended = plan.trainer_memory(cfg, 1, activation_checkpoint=True)
    assert extended == plan._fake_steps(cfg, 1, True, cfg.model.n_layers)


def test_the_plan_of_a_sharded_expert_parallel_run_counts_a_ranks_share():
    cfg = train.parse_args([TINY, "dtype=bfloat16", "microbatch_tokens=1024", "ep=2"])
    one, four = (plan.trainer_memory(cfg, w, activation_checkpoint=False) for w in (1, 4))
    assert four["optimizer"] < one["optimizer"] / 3  # AdamW state sharded 4 ways (experts: 2 ep x 2 efsdp)
    assert four["ep_buffers"] > 0 == one["ep_buffers"]


def test_the_engine_plan_grows_with_the_prompt_limit():
    cfg = train.parse_args([TINY])
    short, long = (plan.engine_memory(dataclasses.replace(cfg, max_prompt_tokens=n)) for n in (32, 200))
    assert long["kv_cache"] > short["kv_cache"] and long["weights"] == short["weights"]


def test_100b_param_count_equals_transformers_on_meta():
    transformers = pytest.importorskip("transformers", reason="transformers is a test-only dependency")
    cfg = train.parse_args([os.path.join(os.path.dirname(CONFIGS[0]), "100b.py"), "dry_run=True"]).model
    with torch.device("meta"):
        ref = transformers.AutoModelForCausalLM.from_config(transformers.Glm4MoeConfig(**config_to_hf(cfg)))
    counts = param_counts(cfg)
    assert counts["total"] == sum(p.numel() for p in ref.parameters())
    assert 105e9 < counts["total"] < 108e9 and 11.5e9 < counts["active"] - counts["embed_lm_head"] < 12.5e9  # "106B / 12B active"


def test_qwen3_30b_a3b_param_count_equals_transformers_on_meta():
    transformers = pytest.importorskip("transformers", reason="transformers is a test-only dependency")
    cfg = train.parse_args([os.path.join(os.path.dirname(CONFIGS[0]), "qwen3_30b_a3b.py"), "dry_run=True"]).model
    with torch.device("meta"):
        ref = transformers.AutoModelForCausalLM.from_config(transformers.Qwen3MoeConfig(**config_to_hf(cfg)))
    assert param_counts(cfg)["total"] == sum(p.numel() for p in ref.parameters())


class ChecksPassed(Exception):
    """Raised where main() starts the run: every setting and file was accepted up to there."""


@pytest.mark.parametrize("path", CONFIGS, ids=[os.path.basename(p) for p in CONFIGS])
def test_every_config_passes_the_checks_a_real_run_makes_before_training(path, tmp_path, monkeypatch):
    def stop(*args, **kwargs):
        raise ChecksPassed

    # the first work after the checks (train.prepare's files, the process group, the resume checkpoint): the run
    monkeypatch.setattr(train, "run", stop)
    # a recipe's checkpoint (1.3 TB for 100b.py) would not fit this machine's disk, which the checks rightly refuse
    monkeypatch.setattr(checkpoint, "free_bytes", lambda path: 1 << 60)
    cpu = [] if torch.cuda.is_available() else ["device=cpu"]  # a CUDA config's checks, on this machine's device
    rm = []  # what the reward-model recipe's header says the command line sets: reward.model (a run refuses none)
    if os.path.basename(path) == "qwen3_30b_a3b_rm.py":
        rm = [f"reward.model={scorer_config_folder(tmp_path / 'rm', 'Qwen3MoeForSequenceClassification', context=40960)}"]
    with pytest.raises(ChecksPassed):
        train.main(train.parse_args([path, f"out_dir={tmp_path / 'run'}", *cpu, *rm]))


def test_small_config_fits_one_80gb_gpu():
    cfg = train.parse_args([os.path.join(ROOT, "configs", "small.py"), "dry_run=True"])
    assert cfg.gpus_per_node == 1 and plan.memory_plan(cfg, 1)["total"] < 80 * plan.GB
    assert 2e8 < param_counts(cfg.model)["total"] < 1e9  # "a few hundred M"


def _100b():
    return train.parse_args([os.path.join(ROOT, "configs", "100b.py"), "dry_run=True"])


def test_one_process_engine_bytes_are_the_replicas_tensors():
    """world 1: the replica NativeEngine builds, tensor for tensor (parameters and buffers), and
    model.KVCache's allocation."""
    from model import KVCache
    from rollout import NativeEngine
    cfg = train.parse_args([TINY, "dtype=bfloat16", "gen_batch_rows=24"])
    engine = NativeEngine(cfg.model, Vocab(-1, 0), dtype=cfg.compute_dtype())
    sizes = {n: t.numel() * t.element_size() for n, t in [*engine.model.named_parameters(),
                                                          *engine.model.named_buffers()]}
    got = plan.engine_bytes(cfg, 1)
    assert got["experts"] == sum(b for n, b in sizes.items() if ".mlp.experts." in n)
    assert got["dense"] == sum(b for n, b in sizes.items() if ".mlp.experts." not in n)
    assert got["dense"] + got["experts"] == plan.engine_memory(cfg, 1)["weights"]
    cache = KVCache(cfg.model, cfg.gen_batch_rows, cfg.prompt_limit() + cfg.sampling.max_new_tokens - 1,
                    dtype=cfg.compute_dtype(), device="meta")
    assert got["kv_cache"] == cache.k.nbytes + cache.v.nbytes


def test_the_sharded_engine_holds_no_replica_only_dense_weights_and_its_experts():
    cfg = _100b()  # ep = 8, bf16
    one, four_nodes, one_node = (plan.engine_bytes(cfg, w) for w in (1, 32, 8))
    replica = plan.engine_memory(cfg, 1)["weights"]
    assert one["dense"] + one["experts"] == replica
    expert_bias = cfg.model.num_moe_layers * cfg.model.num_experts  # a buffer: fp32 on the policy, bf16 in a replica
    assert four_nodes["dense"] == one["dense"] + expert_bias * 2 and four_nodes["experts"] == one["experts"] // 8
    assert four_nodes["dense"] + four_nodes["experts"] < replica / 5
    # ep = world: the experts stay outside FSDP, the engine decodes the trainer's fp32 shards and adds none of its own
    assert one_node["experts"] == one["experts"] // 8 * 2
    assert plan.engine_memory(cfg, 8)["weights"] == one_node["dense"]


def test_the_engine_weights_count_in_a_training_step_only_in_one_process(monkeypatch):
    """One process keeps its replica through training; several gather the engine's weights for the rollout
    phase only."""
    trainer = {"params": 10 * plan.GB, "optimizer": 20 * plan.GB, "gathered": 0, "activations": 0,
               "total": 100 * plan.GB}
    monkeypatch.setattr(plan, "trainer_memory", lambda *args, **kwargs: trainer)
    cfg = train.parse_args([TINY, "dtype=bfloat16", "ep=2"])
    for world in (1, 4):
        p, engine = plan.memory_plan(cfg, world), plan.engine_memory(cfg, world)
        assert p["rollout peak"] == 30 * plan.GB + engine["total"]
        assert p["train step"] == 100 * plan.GB + (engine["weights"] if world == 1 else 0)
        peak = max(p["train step"], p["rollout peak"])
        assert p["total"] == peak + p["margins"] == plan.with_margins(cfg, world, peak)


def test_the_plan_adds_the_cuda_context_nccl_per_communicator_and_a_fragmentation_reserve():
    cfg = train.parse_args([TINY, "dtype=bfloat16", "ep=2"])
    assert [plan.nccl_communicators(cfg, w) for w in (1, 2, 4)] == [0, 3, 4]  # ep=2: efsdp splits from 4 ranks
    peak = 100 * plan.GB
    assert plan.with_margins(cfg, 1, peak) == pytest.approx(peak + 0.05 * peak + 1.0 * plan.GB, abs=1)
    assert plan.with_margins(cfg, 4, peak) == pytest.approx(peak + 0.05 * peak + (1.0 + 4 * 0.5) * plan.GB, abs=1)


@pytest.mark.slow
def test_the_100b_plan_at_4_nodes_fits_an_h200_and_prints_its_total(capsys):  # about 20 s on 2 cores
    cfg = _100b()
    rows = print_plan(cfg, nodes=(4,))
    line = next(line for line in capsys.readouterr().out.splitlines() if line.split()[:3] == ["4", "32", "8"])
    p = plan.memory_plan(cfg, 32)
    engine = plan.engine_memory(dataclasses.replace(cfg, dtype="bfloat16"), 32)
    assert p["total"] == plan.with_margins(cfg, 32, max(p["trainer peak"], p["params"] + p["adam"] + engine["total"]))
    assert line.split()[-3] == f"{p['total'] / plan.GB:.1f}" and rows[0]["total"] == p["total"] / plan.GB
    assert rows[0]["fits"] == ["H200 141GB"] and "H200 141GB" in line


def _colocated(path, *overrides):
    cfg = train.parse_args([path, "dry_run=True", *overrides])
    cfg.engine = dataclasses.replace(cfg.engine, name="sglang")  # its CUDA relation is the run's, not the plan's
    return cfg


def test_colocated_sglang_takes_the_largest_fraction_that_leaves_room_for_adamw_margins_and_graphs():
    cfg, h200 = _colocated(os.path.join(ROOT, "configs", "100b.py")), int(plan.GPU_MEMORY_GIB["H200 141GB"] * plan.GB)
    share = plan.colocated_sglang(cfg, 32, h200)
    params = 4 * param_counts(cfg.model)["total"] / 32
    # SGLang's pool fills the GPU to the fraction, counting the trainer's parameters; AdamW comes after it started
    beside = 2 * params + plan.SGLANG_OUTSIDE_POOL_GIB * plan.GB + plan.with_margins(cfg, 32, 3 * params) - 3 * params
    assert share["fraction"] * h200 + beside <= h200 < (share["fraction"] + 0.01) * h200 + beside
    assert share["kv_pool"] == share["fraction"] * h200 - params - share["weights"]
    assert share["weights"] == 2 * param_counts(cfg.model)["total"] / 8  # bf16, tensor parallel over a node's 8 GPUs
    assert share["rows"] == share["node_rows"] == 8 * cfg.gen_batch_rows  # the pool holds the node's whole batch


def test_colocated_sglang_that_cannot_fit_is_refused_naming_what_to_change():
    cfg, h200 = _colocated(os.path.join(ROOT, "configs", "100b.py")), int(plan.GPU_MEMORY_GIB["H200 141GB"] * plan.GB)
    with pytest.raises(ValueError, match=r"engine.sglang_mem_fraction=0.9 leaves .* set at most 0\.7"):
        plan.colocated_sglang(_colocated(os.path.join(ROOT, "configs", "100b.py"), "engine.sglang_mem_fraction=0.9"),
                              32, h200)
    with pytest.raises(ValueError, match="cannot fit on 8 GPUs .* less than one row .* more nodes, engine.fp8"):
        plan.colocated_sglang(cfg, 8, h200)  # one node: the trainer's fp32 parameters alone fill the pool
    with pytest.raises(ValueError, match="cannot fit on 8 GPUs of 79.1 GiB: the trainer's fp32 parameters and AdamW"):
        plan.colocated_sglang(cfg, 8, int(plan.GPU_MEMORY_GIB["H100 80GB"] * plan.GB))


def test_a_continuous_engines_kv_cache_and_generate_peak_are_sized_by_its_slots(capsys):
    """engine.slots: the KV cache is a pool of pages, `slots` rows at full length (and one prompt's pages) whatever
    gen_batch_rows says, or engine.kv_tokens' worth, as the engine allocates it; a call of many more rows peaks
    where plan.continuous_peak says (live tensors, bench/memory.py's tracker: the pool beside a round's prefill,
    the call's rows of outputs), and the dry run says which bound it used."""
    from rollout import NativeEngine
    memory = _bench_memory()
    cfg = train.parse_args([TINY, "model.n_layers=3", "model.first_k_dense_replace=1",
                            "model.dense_inter_dim=384", "model.qk_norm=True", "gen_batch_rows=64",
                            "sampling.max_new_tokens=16", "max_prompt_tokens=128", "group_size=8", "engine.slots=4"])
    static = dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, slots=0))
    column = 2 * cfg.model.n_layers * cfg.model.n_kv_heads * cfg.model.head_dim * 4  # k and v of a column, fp32
    # 4 rows of 143 columns in 9 pages each, the prompt's 8 and the scratch page, not 64 rows of 143
    assert plan.engine_bytes(cfg, 1)["kv_cache"] == (4 * 9 + 8 + 1) * 16 * column
    assert plan.engine_bytes(static, 1)["kv_cache"] == 64 * 143 * column
    sized = dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, kv_tokens=400))
    assert plan.engine_bytes(sized, 1)["kv_cache"] == (400 // 16 + 1) * 16 * column
    engine = NativeEngine(cfg.model, Vocab(-1, 0), options=cfg.engine)  # no stop token: every row runs to the limit
    prompts = torch.randint(cfg.model.vocab_size, (4, cfg.prompt_limit()), generator=torch.Generator().manual_seed(0))
    engine.generate(prompts.tolist(), cfg.sampling, n=8, seed=0)  # warm-up, as bench/memory.py's
    with memory.LiveTensors() as live:
        memory._reset_peaks(live)
        base = live.now
        engine.generate(prompts.tolist(), cfg.sampling, n=8, seed=0)  # 32 rows through 4 slots
    assert engine.kv_bytes == plan.engine_bytes(cfg, 1)["kv_cache"]
    assert 0.98 <= plan.continuous_peak(cfg, 1, 32, 8) / (live.peak - base) <= 1.05
    print_plan(dataclasses.replace(cfg, gpus_per_node=1), nodes=(1,))
    assert "the engine generating 4 rows per GPU at once (engine.slots" in capsys.readouterr().out


def test_a_reward_model_or_judge_adds_its_whole_weights_to_every_gpus_plan(monkeypatch, tmp_path, capsys):
    """reward.model=<classifier folder>: each GPU's plan grows by the reward model's weights, bf16 on CUDA (its
    parameters, the routers' expert_bias buffers and the score head's D), whatever the world size, as long as
    the training step sets the peak; judge:<folder> by its engine replica's (router gates fp32). The dry run
    reads the folder's config.json and prints the line."""
    from reward import RewardConfig
    from reward_model import scorer_model_config
    trainer = {"params": 10 * plan.GB, "optimizer": 20 * plan.GB, "gathered": 0, "activations": 0,
               "total": 100 * plan.GB}
    monkeypatch.setattr(plan, "trainer_memory", lambda *args, **kwargs: trainer)
    rm_path = scorer_config_folder(tmp_path / "rm", "Qwen3MoeForSequenceClassification")
    judge_path = scorer_config_folder(tmp_path / "judge", "Qwen3MoeForCausalLM")
    for world in (1, 8):
        cfg = train.parse_args([TINY, "dtype=bfloat16", "dry_run=True", "device=cuda", "group_size=4",
                                f"reward.model={rm_path}", "reward.rm_batch_size=2"])
        rm = scorer_model_config(cfg.reward)
        assert rm.tie_embeddings and rm.dim == 64
        base, with_rm = plan.memory_plan(cfg, world), plan.memory_plan(cfg, world, rm)
        weights = (param_counts(rm)["total"] + rm.num_moe_layers * rm.num_experts + rm.dim) * 2
        assert with_rm["scorer weights"] == weights and 0 < with_rm["scorer peak"] < 70 * plan.GB
        peak = max(base["train step"], base["rollout peak"])
        assert with_rm["total"] == plan.with_margins(cfg, world, peak + weights)
        # reward.rm_shard: 1/world of the weights between steps (whole in one process)
        sharded = dataclasses.replace(cfg, reward=dataclasses.replace(cfg.reward, rm_shard=True))
        assert plan.memory_plan(sharded, world, rm)["scorer weights"] == -(-weights // world)
        judge_cfg = dataclasses.replace(cfg, reward=RewardConfig(model=f"judge:{judge_path}", judge_max_new_tokens=64))
        judge = scorer_model_config(judge_cfg.reward)
        gates = judge.num_moe_layers * judge.num_experts * judge.dim  # fp32 in any dtype
        weights = (param_counts(judge)["total"] - gates + judge.num_moe_layers * judge.num_experts) * 2 + gates * 4
        with_judge = plan.memory_plan(judge_cfg, world, judge)
        assert with_judge["scorer weights"] == weights and with_judge["scorer peak"] > 0
        assert with_judge["total"] == plan.with_margins(cfg, world, peak + weights)
    capsys.readouterr()
    rows = train.main(train.parse_args([TINY, "dry_run=True", f"reward.model={rm_path}",
                                        f"out_dir={tmp_path / 'out'}"]))["plan"]
    out = capsys.readouterr().out
    assert f"reward.model={rm_path}: " in out and "whole on every GPU" in out and rows[0]["total"] > 0
    with pytest.raises(ValueError, match=r"reward\.model=.*dense or unsupported"):
        scorer_model_config(RewardConfig(model=scorer_config_folder(tmp_path / "dense", "Qwen3ForSequenceClassification")))


def test_the_dry_run_counts_the_decode_steps_before_the_first_optimizer_step():
    """configs/100b.py on 4 nodes (32 ranks, 48 slots, 8192 new tokens): the eval before RL (500 prompts: 16 a rank,
    4 samples, then greedy) and RL step 0's probes (4 prompts a rank x 4) and the rest of its groups (x 12), each
    slot decoding its rows one after another; eval_before_rl=False drops the eval's."""
    cfg = _100b()
    first = plan.first_update(cfg, 32)
    assert [(rows, steps) for _, rows, steps in first["passes"]] == [(64, 2 * 8192), (16, 8192), (16, 8192), (48, 8192)]
    assert first["decode_steps"] == 5 * 8192 and first["tokens"] == 144 * 8192
    assert plan.first_update(dataclasses.replace(cfg, eval_before_rl=False), 32)["decode_steps"] == 2 * 8192
    # static calls (slots 0) of whole groups in gen_batch_rows=16 rows: the probes' 4 prompts in one call, the
    # rest's 12-row groups one a call (4 calls)
    static = dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, slots=0), eval_before_rl=False)
    assert [steps for _, _, steps in plan.first_update(static, 32)["passes"]] == [8192, 4 * 8192]


def test_the_gpu_smoke_recipe_takes_optimizer_steps_and_its_dry_run_says_how_many(capsys):
    cfg = train.parse_args([os.path.join(ROOT, "configs", "smoke_gpu.py"), "dry_run=True"])
    assert plan.optimizer_steps(cfg)[0] == cfg.rl_steps * cfg.num_minibatches > 0  # RL-ZVP trains on all-wrong groups
    drop = dataclasses.replace(cfg, filter=dataclasses.replace(cfg.filter, zero_variance="drop"))
    assert "likely 0" in plan.optimizer_steps(dataclasses.replace(drop, sft_steps=0))[1]  # what it said before RL-ZVP
    # an SFT warm-up starts the policy off random weights: the tiny demo took all its 700 optimizer steps
    assert "likely 0" not in plan.optimizer_steps(dataclasses.replace(drop, sft_steps=350))[1]
    print_plan(cfg, nodes=(1,))
    out = capsys.readouterr().out
    assert f"optimizer steps: {cfg.rl_steps * cfg.num_minibatches} = rl_steps" in out
    assert "before the first RL update" in out and " on H100, " in out
