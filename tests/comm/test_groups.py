"""Reusable groups from parameter names and shapes."""

from __future__ import annotations

import pytest
import torch

from megatron_adacc.comm.base import ParamSlot
from megatron_adacc.comm.groups import build_groups, split_layer_name

F = torch.float32


def _gpt_slots(layers=(0, 1, 2, 3), batch_of=lambda i: 0):
    slots = [ParamSlot("embedding.word_embeddings.weight", (256, 64), F, 0),
             ParamSlot("embedding.position_embeddings.weight", (32, 64), F, 0)]
    for i in layers:
        slots += [ParamSlot(f"decoder.layers.{i}.mlp.linear_fc1.weight", (256, 64), F, batch_of(i)),
                  ParamSlot(f"decoder.layers.{i}.input_layernorm.weight", (64,), F, batch_of(i))]
    slots.append(ParamSlot("decoder.final_layernorm.weight", (64,), F, 0))
    return slots


def test_split_layer_name():
    name = "decoder.layers.12.mlp.linear_fc1.weight"
    assert split_layer_name(name) == ("decoder.layers.*.mlp.linear_fc1.weight", 12)
    assert split_layer_name("transformer.h.3.attn.c_attn.weight") == ("transformer.h.*.attn.c_attn.weight", 3)
    assert split_layer_name("0.weight") == ("*.weight", 0)
    assert split_layer_name("embedding.word_embeddings.weight") == ("embedding.word_embeddings.weight", None)
    assert split_layer_name("layer1.weight") == ("layer1.weight", None)


def test_groups_of_two_adjacent_layers_and_specific_layers():
    plan = build_groups(_gpt_slots(), group_size=2)
    members = sorted(g.members for g in plan.groups)
    assert members == sorted([
        ("decoder.layers.0.mlp.linear_fc1.weight", "decoder.layers.1.mlp.linear_fc1.weight"),
        ("decoder.layers.2.mlp.linear_fc1.weight", "decoder.layers.3.mlp.linear_fc1.weight"),
        ("decoder.layers.0.input_layernorm.weight", "decoder.layers.1.input_layernorm.weight"),
        ("decoder.layers.2.input_layernorm.weight", "decoder.layers.3.input_layernorm.weight"),
    ])
    assert sorted(plan.specific) == ["decoder.final_layernorm.weight", "embedding.position_embeddings.weight",
                                     "embedding.word_embeddings.weight"]
    assert plan.alone == []
    # The word embedding has fc1's shape but a different name pattern: not grouped with it.
    assert {g.key for g in plan.groups} >= {"decoder.layers.[0-1].mlp.linear_fc1.weight"}


def test_leftover_and_gaps_stay_alone():
    plan = build_groups(_gpt_slots(layers=(0, 1, 2, 4)), group_size=3)
    fc1 = [g.members for g in plan.groups if "fc1" in g.key]
    assert fc1 == [tuple(f"decoder.layers.{i}.mlp.linear_fc1.weight" for i in (0, 1, 2))]
    assert "decoder.layers.4.mlp.linear_fc1.weight" in plan.alone  # layer 3 missing: 4 is not adjacent


def test_groups_never_span_batches():
    plan = build_groups(_gpt_slots(batch_of=lambda i: 0 if i < 3 else 1), group_size=4)
    fc1 = sorted(g.members for g in plan.groups if "fc1" in g.key)
    assert fc1 == [tuple(f"decoder.layers.{i}.mlp.linear_fc1.weight" for i in (0, 1, 2))]
    assert "decoder.layers.3.mlp.linear_fc1.weight" in plan.alone


def test_all_slots_decides_specific():
    slots = _gpt_slots()
    part = [s for s in slots if "layers.0." in s.name]
    plan = build_groups(part, group_size=2, all_slots=slots)
    assert plan.specific == []  # layer 0's tensors have partners elsewhere in the model
    assert len(plan.alone) == 2


def test_group_size_must_be_positive():
    with pytest.raises(ValueError, match="group size"):
        build_groups(_gpt_slots(), group_size=0)
