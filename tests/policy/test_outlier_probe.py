"""The outlier probe on a real tiny megatron-core GPT: its counts are what outlier-separated INT4 selects on the
op outputs of megatron's own forward, whatever the policy does with each op, and sampling leaves training
(random streams, losses) exactly as it is without evolution."""

from __future__ import annotations

import pytest
import torch

import megatron_adacc
from megatron_adacc.adacc.integration.evolution import PolicyEvolution
from megatron_adacc.adacc.integration.outlier_probe import OUTLIER_OPS, OutlierProbe
from megatron_adacc.adacc.policy import Policy
from megatron_adacc.adacc.policy.ops import TILED_OPS
from megatron_adacc.adacc.policy.profile import analytic_profile
from megatron_adacc.adacc.policy.signature import plain_signature
from megatron_adacc.codecs.reference import channel_abs_sum, select_outlier_channels
from megatron_adacc.core.extension import TrainingContext
from megatron_adacc.testing import build_tiny_gpt, tiny_batch

Z = 3.0
TILES = 4
SIG = plain_signature(hidden_size=64, num_attention_heads=4, ffn_hidden_size=256, seq_length=32, micro_batch_size=2,
                      dtype="float32", num_layers=2, megatron_core_version="0.16.1")
#: A policy whose outlier ops are kept, compressed and recomputed (the runtime's op path), and keep-all (the
#: layers then run megatron's own forward): the probe must see every op either way.
POLICIES = {
    "mixed": Policy.uniform({"input_layernorm": "int4_outlier", "linear_proj": "int4_outlier",
                             "self_attn_bda": "recompute", "activation": "recompute", "softmax": "recompute"}, 2),
    "keep": Policy.all_keep(2),
    # the MLP re-run in token tiles: the probe runs it in the same tiles and adds up their channel sums
    "tiled": Policy.uniform({"input_layernorm": "int4_outlier", **{op: f"recompute:tiles={TILES}" for op in TILED_OPS}},
                            2),
}


@pytest.fixture(autouse=True)
def _uninstall():
    yield
    megatron_adacc.uninstall()


def _model(**overrides) -> torch.nn.Module:
    model = build_tiny_gpt(seq_length=32, **overrides)
    with torch.no_grad():  # a few loud channels, so that there are outliers to count at initialisation
        for layer in model.decoder.layers:
            layer.input_layernorm.weight[[3, 40]] = 12.0
            layer.pre_mlp_layernorm.weight[7] = 9.0
    model.train()
    return model


def _op_outputs_of_megatrons_forward(model, batch) -> list[dict[str, torch.Tensor]]:
    """Per layer, the output of each outlier op as megatron's own ``TransformerLayer.forward`` computes it (eval
    mode, no dropout in the model), read by hooks on the layer's submodules."""
    layers = list(model.decoder.layers)
    seen: list[dict[str, torch.Tensor]] = [{} for _ in layers]
    handles = []

    def out(i, op):
        return lambda m, a, o: seen[i].__setitem__(op, (o[0] if isinstance(o, tuple) else o).detach())

    def inp(i, op):
        return lambda m, a: seen[i].__setitem__(op, a[0].detach())

    for i, layer in enumerate(layers):
        mlp, attn = layer.mlp, layer.self_attention
        handles += [layer.input_layernorm.register_forward_pre_hook(inp(i, "layer_input")),
                    layer.input_layernorm.register_forward_hook(out(i, "input_layernorm")),
                    attn.linear_proj.register_forward_pre_hook(inp(i, "context")),
                    attn.linear_proj.register_forward_hook(out(i, "linear_proj")),
                    layer.pre_mlp_layernorm.register_forward_pre_hook(inp(i, "self_attn_bda")),
                    layer.pre_mlp_layernorm.register_forward_hook(out(i, "pre_mlp_layernorm")),
                    mlp.linear_fc1.register_forward_hook(out(i, "linear_fc1")),
                    mlp.linear_fc2.register_forward_pre_hook(inp(i, "activation")),
                    mlp.linear_fc2.register_forward_hook(out(i, "linear_fc2")),
                    layer.register_forward_hook(out(i, "mlp_bda"))]
    tokens, positions, mask, _ = batch
    model.eval()
    try:
        with torch.no_grad():
            model(tokens, positions, mask)
    finally:
        model.train()
        for h in handles:
            h.remove()
    return seen


def _count(x: torch.Tensor) -> int:
    return int(select_outlier_channels(channel_abs_sum(x.reshape(-1, x.shape[-1])), Z).numel())


@pytest.mark.parametrize("name", list(POLICIES))
def test_the_probe_counts_every_outlier_op_as_the_codec_selects_them(name) -> None:
    model = _model(hidden_dropout=0.0, attention_dropout=0.0)  # the training forward is the reference's
    marker = model.decoder.layers[0].input_layernorm.eval()  # a module in its own mode stays in it
    batch = tiny_batch(batch_size=2, seq_length=32)
    tokens, positions, mask, labels = batch
    megatron_adacc.install(model.config, POLICIES[name], predict_memory=False)
    probe = OutlierProbe(Z, repeats=1)
    probe.setup([model])
    probe.arm()
    model(tokens, positions, mask, labels=labels).float().mean().backward()
    samples = probe.measure(POLICIES[name])
    assert all(m.training for m in model.modules() if m is not marker) and not marker.training
    marker.train()

    reference = _op_outputs_of_megatrons_forward(model, batch)
    assert set(samples) == set(OUTLIER_OPS)  # kept, compressed and recomputed ops alike
    for op in OUTLIER_OPS:
        counts = [_count(layer[op]) for layer in reference]
        assert samples[op].outlier_channels == pytest.approx(sum(counts) / len(counts), abs=1e-12), op
        assert samples[op].channels == reference[0][op].shape[-1]
        assert samples[op].shapes == (tuple(reference[0][op].shape),)
        if name == "tiled" and op in TILED_OPS:  # its outputs existed a slice at a time: not re-timed
            assert samples[op].compress_time_s is None and samples[op].decompress_time_s is None
        else:
            assert samples[op].compress_time_s > 0 and samples[op].decompress_time_s > 0
    assert samples["input_layernorm"].outlier_channels >= 2 and samples["pre_mlp_layernorm"].outlier_channels >= 1
    # the capture is gone: a later measure without a new arm() samples nothing, and no hook is left behind
    assert probe.measure(POLICIES[name]) == {}
    assert not model.decoder._forward_pre_hooks and not model.decoder.layers[0].input_layernorm._forward_pre_hooks


def _probe_after_a_step(model: torch.nn.Module, policy: str = "mixed") -> OutlierProbe:
    """A probe armed before one training forward and backward of ``model`` under ``POLICIES[policy]``."""
    tokens, positions, mask, labels = tiny_batch(batch_size=2, seq_length=32)
    megatron_adacc.install(model.config, POLICIES[policy], predict_memory=False)
    probe = OutlierProbe(Z, repeats=1)
    probe.setup([model])
    probe.arm()
    model(tokens, positions, mask, labels=labels).float().mean().backward()
    return probe


def test_the_probe_runs_a_tiled_mlp_in_the_tiles_training_runs_it_in() -> None:
    """MKL keeps a buffer for every shape of matrix product it ran until the process ends: a probe running the
    whole MLP where training runs it in tiles left megabytes allocated at every later step's peak
    (outlier_probe's module doc). The probe's products have training's shapes."""
    model = _model(hidden_dropout=0.0, attention_dropout=0.0)
    rows: dict[str, list[int]] = {"training": [], "probe": []}
    phase = ["training"]
    for layer in model.decoder.layers:
        for module in (layer.mlp.linear_fc1, layer.mlp.linear_fc2):
            module.register_forward_pre_hook(lambda m, a: rows[phase[0]].append(a[0].shape[0]))
    probe = _probe_after_a_step(model, "tiled")
    phase[0] = "probe"
    samples = probe.measure(POLICIES["tiled"])
    assert set(rows["training"]) == {32 // TILES} and len(rows["probe"]) == 2 * 2 * TILES
    assert set(rows["probe"]) == {32 // TILES}
    assert samples["linear_fc1"].shapes == ((32, 2, model.config.ffn_hidden_size),)


def test_the_probe_samples_without_dropout() -> None:
    """Dropout leaves the channel absolute sums unchanged in expectation; the probe reads that expectation, and
    with dropout its no-grad forward held two hidden-state tensors per layer more until it returned
    (outlier_probe._without_dropout)."""
    model = _model()  # with dropout
    modes: list[bool] = []
    for layer in model.decoder.layers:  # the flag megatron's bias-dropout-adds read
        layer.pre_mlp_layernorm.register_forward_hook(lambda m, a, o, layer=layer: modes.append(layer.training))
    probe = _probe_after_a_step(model)
    assert modes == [True, True]
    modes.clear()
    assert probe.measure(POLICIES["mixed"])
    assert modes == [False, False]
    assert all(m.training for m in model.modules())


def test_sampling_leaves_the_random_streams_where_they_were() -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    probe = _probe_after_a_step(_model())  # with dropout
    cpu, tracker = torch.get_rng_state(), get_cuda_rng_tracker().get_states()
    assert probe.measure(POLICIES["mixed"])
    assert torch.equal(torch.get_rng_state(), cpu)
    after = get_cuda_rng_tracker().get_states()
    assert after.keys() == tracker.keys() and all(torch.equal(after[k], tracker[k]) for k in tracker)


def _train(evolution: bool, steps: int = 4) -> tuple[list[float], PolicyEvolution | None]:
    model = _model()  # with dropout: the probe must not move its random streams
    policy = Policy.all_keep(2)
    megatron_adacc.install(model.config, policy, predict_memory=False)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    evo = None
    if evolution:
        # a roomy budget: keep-all is the best policy, so evolution samples but never switches
        evo = PolicyEvolution(profile=analytic_profile(SIG), policy=policy, budget_bytes=1e12, cap=1,
                              log=lambda m: None)
        evo.setup(TrainingContext(args=None, config=model.config, model=[model], ddp_model=[model], optimizer=None))
    losses = []
    for it in range(1, steps + 1):
        if evo is not None:
            evo.on_step_begin(it)
        tokens, positions, mask, labels = tiny_batch(batch_size=2, seq_length=32, seed=it)
        optimizer.zero_grad()
        loss = model(tokens, positions, mask, labels=labels).float().mean()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if evo is not None:
            evo.on_step_end(it, losses[-1])
    megatron_adacc.uninstall()
    return losses, evo


def test_training_with_the_probe_is_bit_identical_to_training_without_evolution() -> None:
    with_probe, evo = _train(evolution=True)
    without, _ = _train(evolution=False)
    assert with_probe == without
    assert evo is not None and evo.switches == []
    series = evo.report()["outlier_channels"]
    assert series["iterations"] == [1, 2, 3, 4] and set(series["ops"]) == set(OUTLIER_OPS)
    assert all(v is not None for values in series["ops"].values() for v in values)


def test_ranks_merge_their_samples_into_one_so_they_switch_together():
    """Pipeline stages sample different layers and data-parallel ranks different data: the merged sample is the
    mean over every layer sampled anywhere (weighted by layers), with codec times averaged over the ranks that
    timed them, and it is the same whatever rank computes it."""
    import torch

    from megatron_adacc.adacc.integration.outlier_probe import OpSample, agreed, merged

    shape = ((2, 4, 16),)
    a = {"linear_fc1": OpSample(2.0, 16, shape, torch.float32, 1e-3, 2e-3, layers=3),
         "context": OpSample(1.0, 16, shape, torch.float32, layers=3)}
    b = {"linear_fc1": OpSample(6.0, 16, shape, torch.float32, 3e-3, None, layers=1)}
    both = merged([a, b])
    assert both["linear_fc1"].outlier_channels == (2.0 * 3 + 6.0) / 4 and both["linear_fc1"].layers == 4
    assert both["linear_fc1"].compress_time_s == 2e-3 and both["linear_fc1"].decompress_time_s == 2e-3
    assert both["context"] == merged([a])["context"]
    assert agreed(a) == a  # one process: nothing to merge
