"""The profiler on a small real megatron-core layer, the stored-profile reuse of ``auto``, and the policy
commands; the solved policy's predicted bytes are compared with what the runtime measures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from megatron_adacc.adacc.policy.ops import OP_NAMES
from megatron_adacc.adacc.policy.profile import LayerProfile
from megatron_adacc.testing import memory_cap

ARGV = ["--config", "tiny", "--device", "cpu", "--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "256",
        "--seq-length", "32", "--micro-batch-size", "2"]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    from megatron_adacc.adacc.integration.profiler import profile_layer
    from megatron_adacc.adacc.integration.sample import layer_sample
    from megatron_adacc.training import distributed
    from megatron_adacc.training import model as model_lib
    from megatron_adacc.training.args import parse_train_args

    torch.set_num_threads(1)
    with memory_cap(6):
        args = parse_train_args(ARGV)
        args.adacc_profile_db = str(tmp_path_factory.mktemp("db") / "p.sqlite")
        device = torch.device("cpu")
        distributed.initialize(device, args.seed)
        config = model_lib.transformer_config(args, device)
        profile = profile_layer(layer_sample(args, config, device), args, config, device=device, repeats=1)
    return args, config, profile


def test_profile_measures_every_op(env) -> None:
    _, _, profile = env
    assert [op.name for op in profile.ops] == list(OP_NAMES)
    assert profile.source == "measured" and profile.device.startswith("cpu:")
    # the layer input, the layernorm's and softmax's outputs
    assert min(profile.op(name).saved_bytes for name in ("layer_input", "input_layernorm", "softmax")) > 0
    assert all(op.forward_time_s > 0 for op in profile.ops)
    assert len(profile.segment_times_s) == 13 * 14 // 2  # every segment a..b with 1 <= a <= b <= 13
    assert all(t > 0 for t in profile.segment_times_s.values())
    outlier = profile.op("input_layernorm").codecs["int4_outlier"]
    assert 0 < outlier.compressed_bytes < profile.op("input_layernorm").saved_bytes
    assert outlier.stats["channels"] == 64 and 0 <= outlier.stats["outlier_channels"] < 64
    # the softmax output [b, heads, s, s] in asymmetric INT4: exactly the codec's own size formula
    from megatron_adacc.codecs import get_codec

    sm = profile.op("softmax")
    assert sm.saved_bytes == 2 * 4 * 32 * 32 * 4
    want = get_codec("int4_asymmetric").compressed_nbytes((2, 4, 32, 32), torch.float32)
    assert sm.codecs["int4_asymmetric"].compressed_bytes == want
    assert profile.static_bytes == 16 * profile.meta["static"]["parameters"]  # fp32 parameters, gradients, m, v
    # the runtime calibration ran: a keep-all step time and scale factors inside their clamp range
    assert profile.step_time_s and profile.step_time_s > 0
    assert 0.5 <= profile.codec_time_scale <= 20 and 0.5 <= profile.recompute_time_scale <= 20
    # the runtime's own cost (keep-all in the runtime against megatron's forward), kept through JSON
    assert 0 <= profile.runtime_overhead_s < profile.step_time_s
    assert LayerProfile.from_json(profile.to_json()).runtime_overhead_s == profile.runtime_overhead_s
    # the tiled MLP re-run's cost per further tile (default 8 tiles), kept through JSON
    assert 0 <= profile.tile_overhead_s < profile.step_time_s
    assert LayerProfile.from_json(profile.to_json()).tile_overhead_s == profile.tile_overhead_s


def test_the_sample_is_the_model_and_batch_adacc_train_builds(env) -> None:
    """The profiled layer and inputs, built with megatron-core directly, equal what ``adacc train``'s own
    model builder and sampler give from the same RNG state (so profiles did not change when the profiler
    stopped importing the training package)."""
    import copy

    from megatron_adacc.adacc.integration.sample import layer_inputs, layer_sample, one_layer_config
    from megatron_adacc.training import model as model_lib
    from megatron_adacc.training.data import BatchSampler
    from megatron_adacc.training.distributed import set_seed

    args, config, _ = env
    device = torch.device("cpu")
    with memory_cap(6):
        set_seed(11)
        ours = layer_sample(args, config, device)
        set_seed(11)
        one_args = copy.copy(args)
        one_args.num_layers = 1
        model = model_lib.build_gpt(one_args, one_layer_config(config)).to(device)
        model.train()
        batch = next(BatchSampler(args.seq_length, args.micro_batch_size, args.seed))
        theirs = layer_inputs(model, batch.tokens, batch.position_ids, batch.attention_mask, args.seq_length)
    assert torch.equal(ours.hidden, theirs.hidden) and torch.equal(ours.mask, theirs.mask)
    for (name, p), (_, q) in zip(ours.layer.named_parameters(), theirs.layer.named_parameters()):
        assert torch.equal(p, q), name


def test_predicted_layer_bytes_match_the_runtime(env) -> None:
    """Solve for a budget between the extremes, run the policy through the runtime, compare bytes."""
    from megatron_adacc.adacc.integration import install, uninstall
    from megatron_adacc.adacc.policy.solver import SolveOptions, make_problem, solve_policy
    from megatron_adacc.adacc.runtime import accounting
    from megatron_adacc.testing import build_tiny_gpt, tiny_batch

    args, _, profile = env
    probe = make_problem(profile, None, SolveOptions())
    lo = probe.min_feasible_budget(stash=True)
    hi = probe.fixed_bytes + 2 * sum(cs[0].memory_bytes for cs in probe.choices)
    policy, result = solve_policy(profile, lo + 0.4 * (hi - lo), SolveOptions())
    assert {d.action for d in policy.layers[0]} >= {"keep", "recompute"}
    with memory_cap(6):
        model = build_tiny_gpt(seq_length=32)
        install(policy, config=model.config, predict_memory=False)
        try:
            tokens, positions, mask, labels = tiny_batch(batch_size=2, seq_length=32)
            loss = model(tokens, positions, mask, labels=labels).float().mean()
            measured = {i: m.total_bytes for i, m in accounting.latest().items()}
            loss.backward()
        finally:
            uninstall()
    predicted = policy.predicted["per_layer"]
    for i in range(2):
        want = predicted[i]["activation_bytes"]
        assert measured[i] == pytest.approx(want, rel=0.05), (i, measured[i], want)


def test_auto_reuses_the_stored_profile(env, monkeypatch) -> None:
    from megatron_adacc.adacc.integration import auto

    args, config, profile = env
    calls = []
    monkeypatch.setattr("megatron_adacc.adacc.integration.profiler.profile_layer",
                        lambda *a, **k: calls.append(1) or profile)
    args.adacc_memory_budget = 10 * 2**30
    logs: list[str] = []
    p1 = auto.make_policy(args, config, log=logs.append)
    p2 = auto.make_policy(args, config, log=logs.append)
    assert calls == [1]  # profiled once, then reused from the database
    assert any("reusing profile" in m for m in logs)
    assert p1.layers == p2.layers and p1.profile["id"] == p2.profile["id"]
    assert all(d.action == "keep" for d in p1.layers[0])  # 10 GiB: nothing to save
    args.adacc_memory_budget = 1000
    from megatron_adacc.adacc.policy.strategies import InfeasibleBudgetError

    with pytest.raises(InfeasibleBudgetError, match="smallest feasible budget is"):
        auto.make_policy(args, config, log=logs.append)


def test_cli_solve_and_show(env, tmp_path, capsys) -> None:
    from megatron_adacc.policy_cli import main

    args, _, _ = env
    out = tmp_path / "pol.json"
    argv = ["solve", *ARGV, "--adacc-memory-budget", "4GiB", "--adacc-profile-db", args.adacc_profile_db, "-o",
            str(out)]
    assert main(argv) == 0
    assert main(["show", str(out)]) == 0
    text = capsys.readouterr().out
    assert "linear_qkv" in text and "quantize-all" in text and "paper MILP" in text
    # moved to a machine without the profile database: the sizes come from the file itself
    moved = json.loads(out.read_text())
    moved["profile"]["db"] = str(tmp_path / "elsewhere" / "p.sqlite")
    (tmp_path / "moved.json").write_text(json.dumps(moved))
    assert main(["show", str(tmp_path / "moved.json")]) == 0
    lines = capsys.readouterr().out.splitlines()
    qkv = next(line for line in lines if line.startswith("linear_qkv"))
    assert qkv.count("iB") == 2 and any(line.startswith("per layer") for line in lines), lines
    assert "paper MILP" not in "\n".join(lines)  # the presets' predictions do need the profile
    assert main(["solve", *ARGV, "--adacc-memory-budget", "1KiB", "--adacc-profile-db", args.adacc_profile_db,
                 "-o", str(tmp_path / "x.json")]) == 2
    assert "smallest feasible budget" in capsys.readouterr().err


def test_cli_solve_on_the_cpu_counts_the_process_memory_auto_calibrated(env, tmp_path) -> None:
    """On the CPU the budget is the training process's peak RSS: `adacc solve` counts the process memory `auto`
    calibrated for this profile and micro-batch (it counted none, and its policies peaked far over budget)."""
    from megatron_adacc.adacc.integration import auto
    from megatron_adacc.adacc.policy.io import load_policy
    from megatron_adacc.adacc.policy.profile_db import ProfileDB
    from megatron_adacc.policy_cli import main

    args, _, profile = env
    db = ProfileDB(args.adacc_profile_db)
    pid, stored = db.get(profile.device, profile.signature) or (db.put(profile), profile)
    calibrated = 321 * 2**20
    db.put_baseline(pid, auto._run_key(args), calibrated)
    out = tmp_path / "pol.json"
    assert main(["solve", *ARGV, "--adacc-memory-budget", "4GiB", "--adacc-profile-db", args.adacc_profile_db,
                 "-o", str(out)]) == 0
    predicted = load_policy(out).predicted
    assert predicted["static_bytes"] - stored.static_bytes == calibrated


def test_solve_flag_names_the_candidate_codecs() -> None:
    """``adacc solve --candidate-codecs all`` (once ``--adacc-codecs``, which read as the plural of the training
    flag ``--adacc-codec``, a codec family) reaches the solver's options."""
    from megatron_adacc.adacc.policy.solver import SolveOptions
    from megatron_adacc.policy_cli import _parse, _parser

    assert SolveOptions.from_args(_parse(_parser("solve"), ["--candidate-codecs", "all"])).codecs == "all"
    assert SolveOptions.from_args(_parse(_parser("solve"), [])).codecs == "default"


def test_the_outlier_probe_feeds_evolution_in_the_profiles_units(env) -> None:
    """Evolution's statistics source samples every op offering int4_outlier, whatever the policy does with it
    (here two are compressed, the rest kept); updating the profile from a model and batch of the profiled shape
    keeps its runtime-attributed bytes close and its codec times raw, and records the new outlier counts."""
    from megatron_adacc.adacc.integration import install, uninstall
    from megatron_adacc.adacc.integration.evolution import PolicyEvolution
    from megatron_adacc.adacc.integration.outlier_probe import OUTLIER_OPS, OutlierProbe
    from megatron_adacc.adacc.policy import Policy
    from megatron_adacc.testing import build_tiny_gpt, tiny_batch

    _, _, profile = env
    policy = Policy.uniform({"input_layernorm": "int4_outlier", "self_attn_bda": "int4_outlier",
                             "softmax": "recompute"}, 2)
    probe = OutlierProbe(repeats=1)
    with memory_cap(6):
        model = build_tiny_gpt(seq_length=32)
        install(policy, config=model.config, predict_memory=False)
        try:
            probe.setup([model])
            probe.arm()
            tokens, positions, mask, labels = tiny_batch(batch_size=2, seq_length=32)
            model(tokens, positions, mask, labels=labels).float().mean().backward()
            measured = probe.measure(policy)
        finally:
            uninstall()
    assert set(measured) == set(OUTLIER_OPS)
    evo = PolicyEvolution(profile=profile, policy=policy, budget_bytes=1e12, source=probe, log=lambda m: None)
    updated = evo.updated_profile(measured)
    for op in OUTLIER_OPS:
        old, new = profile.op(op).codecs["int4_outlier"], updated.op(op).codecs["int4_outlier"]
        assert new.compressed_bytes == pytest.approx(old.compressed_bytes, rel=0.2), op
        assert new.stats == {"outlier_channels": measured[op].outlier_channels, "channels": old.stats["channels"]}
        if profile.op(op).saved_bytes:  # re-measured; adopted when beyond timing noise
            assert measured[op].compress_time_s > 0
            assert new.compress_time_s in (old.compress_time_s, measured[op].compress_time_s)
        else:  # nothing saved for backward: the profiled times (of its outputs, for a stash) stay
            assert (new.compress_time_s, new.decompress_time_s) == (old.compress_time_s, old.decompress_time_s)
    assert updated.codec_time_scale == profile.codec_time_scale


def test_a_profile_measured_under_contention_is_named_at_every_reuse(env, monkeypatch, tmp_path, caplog) -> None:
    """Its timings are what every later solve rests on: each run that reuses it says so, with the fix."""
    import dataclasses

    from megatron_adacc.adacc.integration import auto

    args, config, profile = env
    flagged = dataclasses.replace(profile, meta={**profile.meta, "contended": "5 of 9 timings stayed spread"})
    monkeypatch.setattr("megatron_adacc.adacc.integration.profiler.profile_layer", lambda *a, **k: flagged)
    monkeypatch.setattr(args, "adacc_profile_db", str(tmp_path / "p.sqlite"))
    for _ in range(2):
        caplog.clear()
        with caplog.at_level("WARNING", logger="megatron_adacc"):
            auto.get_or_make_profile(args, config, log=lambda message: None)
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]  # at the reuse
    assert any("was measured under contention (5 of 9" in m and "--refresh" in m for m in warned)


def test_the_default_cuda_budget_leaves_room_for_what_allocated_bytes_do_not_count(monkeypatch):
    """A GPU's default budget is compared with allocated bytes; it must leave the CUDA context, other processes
    and the caching allocator's fragmentation out (the total memory would plan a run that runs out)."""
    from megatron_adacc.adacc.integration import profiler

    gib = 2**30
    monkeypatch.setattr(profiler, "resolve_device", lambda device: torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (30 * gib, 32 * gib))  # 2 GiB in use
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: gib // 2)  # 0.5 of them ours
    budget = profiler.device_memory_bytes("cuda")
    assert budget == int(profiler.CUDA_DEFAULT_FRACTION * (32 - 1.5) * gib)
    assert budget < 28 * gib


@pytest.mark.parametrize("flags", [["--swiglu"], ["--normalization", "RMSNorm"], ["--position-embedding-type", "rope"],
                                   ["--group-query-attention", "--num-query-groups", "2"],
                                   ["--attention-backend", "flash", "--attention-dropout", "0"],
                                   ["--vocab-size", "1000"], ["--untie-embeddings-and-output-weights"]])
def test_a_profile_is_not_reused_for_a_model_with_another_layer(env, monkeypatch, flags) -> None:
    """Same widths, other ops or other saved tensors, or another vocabulary or output layer (other logits and
    static memory): `adacc train`'s flags for them profile anew."""
    from megatron_adacc.adacc.integration import auto
    from megatron_adacc.training import model as model_lib
    from megatron_adacc.training.args import parse_train_args

    args, config, profile = env
    calls = []
    monkeypatch.setattr("megatron_adacc.adacc.integration.profiler.profile_layer",
                        lambda *a, **k: calls.append(1) or profile)
    auto.get_or_make_profile(args, config, log=lambda m: None)
    assert calls == [1] or calls == []  # the module's model: stored by an earlier test or now
    calls.clear()
    auto.get_or_make_profile(args, config, log=lambda m: None)
    assert calls == []  # the same model reuses
    other = parse_train_args(ARGV + flags)
    other.adacc_profile_db = args.adacc_profile_db
    auto.get_or_make_profile(other, model_lib.transformer_config(other, torch.device("cpu")), log=lambda m: None)
    assert calls == [1]


def test_the_calibration_takes_paired_differences_of_alternating_runs() -> None:
    """The host slows down while the variants are timed (a shared machine does, for seconds at a time): runs in
    alternating rounds, differenced within a round, still give each variant's own cost. The slow-down is a
    step of 30 ms (three times the differences sought) from the fourth round on."""
    import itertools

    from megatron_adacc.adacc.integration.profiler import alternating_rounds

    cost = {"stock": 0.010, "keep": 0.012, "quant": 0.020}
    calls = itertools.count()
    clock = {"now": 0.0}
    names = list(cost)

    def run(name: str) -> None:
        slow = 0.030 if next(calls) >= len(names) * 4 else 0.0  # the warm-up and three rounds are fast
        clock["now"] += cost[name] + slow

    rounds = alternating_rounds(run, names, 7, lambda: None, clock=lambda: clock["now"])
    assert len(rounds) == 7 and all(set(r) == set(names) for r in rounds)
    for a, b in (("keep", "stock"), ("quant", "keep")):
        diffs = sorted(r[a] - r[b] for r in rounds)
        assert diffs[3] == pytest.approx(cost[a] - cost[b], abs=1e-12)
    # timed one variant after the other, the slow-down would all have gone to the last ones
    assert max(r["quant"] for r in rounds) == pytest.approx(0.050)


#: What ``auto``'s planning loads that a CPU training process must not hold (:mod:`~.integration.planning`).
PLANNER_MODULES = ("pulp", "highspy", "sqlite3", "megatron_adacc.adacc.policy.profile_db",
                   "megatron_adacc.adacc.policy.cost_model", "megatron_adacc.adacc.policy.solver",
                   "megatron_adacc.adacc.policy.strategies")


def test_on_the_cpu_the_training_process_never_loads_the_planner(tmp_path) -> None:
    """On the CPU the budget is the training process's peak RSS. PuLP with HiGHS held 5.2 MiB of it on
    llama-tiny (a tenth of its activations; a GPU run holds them in host memory, outside its budget), sqlite3, the
    profile database and the cost model 2.4 more, and every re-solve of evolution grew it. So ``auto`` plans in a
    forked child and evolution re-solves in one: a run that profiled, solved, tracked and re-solved ends with
    none of them imported, under a budget that keeps it from keeping everything."""
    code = textwrap.dedent(f"""
        import json, sys
        from megatron_adacc.training.args import parse_train_args
        from megatron_adacc.training.loop import train
        summary = train(parse_train_args(["--adacc-policy", "auto", "--adacc-memory-budget", "430MiB",
                                          "--adacc-process-baseline", "360MiB", "--train-iters", "2",
                                          "--no-progress"]))
        evolution = summary["extensions"]["adacc_evolution"]
        print(json.dumps([sorted(m for m in {PLANNER_MODULES!r} if m in sys.modules),
                          evolution["tracking_iterations"], [t[2] is not None for t in evolution["tracks"]],
                          summary["extensions"]["adacc"]["decisions"]]))
    """)
    env = {**os.environ, "ADACC_PROFILE_DB": str(tmp_path / "profile.sqlite")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    loaded, tracked, resolved, decisions = json.loads(out.stdout.strip().splitlines()[-1])
    assert loaded == [] and tracked == [1, 2] and resolved == [True, True]
    assert set(decisions) != {"keep"}, decisions  # the budget made it solve the MILP, in the child


def test_a_solve_in_a_forked_child_answers_as_in_process_and_refuses_the_same() -> None:
    """In a fresh interpreter, the forked solves first: this one may have run HiGHS already, whose thread pool a
    forked child lacks (planning.isolated_solves never forks such a process)."""
    code = textwrap.dedent("""
        import sys
        from megatron_adacc.adacc.policy.profile import analytic_profile
        from megatron_adacc.adacc.policy.signature import plain_signature
        from megatron_adacc.adacc.policy.solver import SolveOptions, make_problem, solve_policy
        from megatron_adacc.adacc.policy.strategies import InfeasibleBudgetError
        from megatron_adacc.compat.process import forked

        profile = analytic_profile(plain_signature(hidden_size=64, num_attention_heads=4, ffn_hidden_size=256,
                                                   seq_length=32, micro_batch_size=2, dtype="float32",
                                                   num_layers=2, megatron_core_version="0.16.1"))
        low = make_problem(profile, None, SolveOptions()).min_feasible_budget(stash=True, heterogeneous=True)

        def refusal(solve):
            try:
                solve()
            except InfeasibleBudgetError as exc:
                return exc
            raise AssertionError("not refused")

        there, _ = forked(lambda: solve_policy(profile, low * 1.05, SolveOptions(headroom=0.0)))
        refused_there = refusal(lambda: forked(lambda: solve_policy(profile, low / 2, SolveOptions())))
        assert "pulp" not in sys.modules  # the solves loaded it in their children only
        here, _ = solve_policy(profile, low * 1.05, SolveOptions(headroom=0.0))
        refused_here = refusal(lambda: solve_policy(profile, low / 2, SolveOptions()))
        assert there.layers == here.layers and there.predicted == here.predicted
        assert str(refused_there) == str(refused_here)
        assert refused_there.min_feasible_bytes == refused_here.min_feasible_bytes
        try:
            forked(lambda: 1 / 0)
        except ZeroDivisionError:
            print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def test_a_process_that_loaded_pulp_solves_in_process() -> None:
    import pulp  # noqa: F401 - loaded, as in a session that solved before

    from megatron_adacc.adacc.integration.planning import isolated_solves

    assert not isolated_solves(torch.device("cpu"))


def test_backward_bytes_do_not_depend_on_how_the_process_started(tmp_path) -> None:
    """A profile's backward bytes are measured as resident size, under the allocator setting the budget is
    measured with. A process started without it (`adacc profile`, the bench's profiling child) once measured
    llama-tiny's backwards 1.5x as large in sum (RMSNorm's and SwiGLU's 1.9-2.1x) as one started with it, and
    every backward stage of the runs it planned was over-predicted by that much."""
    from megatron_adacc.adacc.policy.profile_db import ProfileDB

    def grad_bytes(name: str, malloc_set: bool) -> dict[str, int]:
        env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
        env.update({"MALLOC_MMAP_THRESHOLD_": "65536"} if malloc_set else {})
        db = str(tmp_path / f"{name}.sqlite")
        subprocess.run([sys.executable, "-m", "megatron_adacc.cli", "profile", "--config", "llama-tiny",
                        "--num-layers", "1", "--repeats", "1", "--adacc-profile-db", db],
                       env=env, check=True, capture_output=True, timeout=600)
        return {op.name: op.grad_bytes for op in ProfileDB(db).get_by_id(1).ops}

    started_set, set_later = grad_bytes("set", True), grad_bytes("unset", False)
    assert abs(sum(set_later.values()) - sum(started_set.values())) <= 0.1 * sum(started_set.values())
    for op, nbytes in started_set.items():  # a single measurement each: RSS pages, a few percent of noise
        assert abs(set_later[op] - nbytes) <= 0.25 * nbytes, (op, set_later[op], nbytes)
