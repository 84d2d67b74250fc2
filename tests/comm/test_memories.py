"""Memories against hand-computed cases, and their measured bytes against their formulas."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_adacc.comm.base import ParamSlot
from megatron_adacc.comm.memories import (
    ResidualMemory,
    ResiReduce2D,
    ResiReduceA,
    ResiReduceD,
    ResiReduceW,
    RowColumnSelection,
    RowSelection,
    build_memory,
    significance_weights,
)

F = torch.float32


def _pair():
    return [ParamSlot("layers.0.w", (2,), F, 0), ParamSlot("layers.1.w", (2,), F, 0)]


def test_residual_memory_compensates_and_updates():
    m = ResidualMemory()
    m.register([ParamSlot("x", (3,), F, 0)])
    g = torch.tensor([1.0, 2.0, 3.0])
    m.compensate(g, "x")
    assert g.tolist() == [1.0, 2.0, 3.0]  # zero residual at start
    m.update(torch.tensor([0.5, 0.0, -1.0]), "x")
    g = torch.tensor([1.0, 1.0, 1.0])
    m.compensate(g, "x")
    assert g.tolist() == [1.5, 1.0, 0.0]


def test_resireduce_a_stores_the_group_average():
    m = ResiReduceA(group_size=2)
    m.register(_pair())
    m.update(torch.tensor([1.0, 2.0]), "layers.0.w")
    m.update(torch.tensor([3.0, 4.0]), "layers.1.w")
    m.flush()
    for name in ("layers.0.w", "layers.1.w"):
        g = torch.zeros(2)
        m.compensate(g, name)
        assert g.tolist() == [2.0, 3.0]
    assert m.residual_bytes() == 2 * 4


def test_significance_weights_hand_case():
    # r1 = (1, -1): ||.||_1 / 2 = 1, ||.||_2 / sqrt 2 = 1 -> w = 1; r2 = (2, 2): 2 and 2 -> w = 2.
    # The weights stay on the residuals' device (0-d tensors): nothing is read on the host.
    w = significance_weights([torch.tensor([1.0, -1.0]), torch.tensor([2.0, 2.0])])
    assert all(isinstance(v, torch.Tensor) and v.dim() == 0 for v in w)
    assert [float(v) for v in w] == pytest.approx([1.0, 2.0], rel=1e-6)
    # phi = 1 keeps only the L1 term: r = (3, 0, 0, 4) -> 7 / 4.
    assert [float(v) for v in significance_weights([torch.tensor([3.0, 0.0, 0.0, 4.0])], phi=1.0)] == [1.75]
    # phi = 0 keeps only the L2 term: 5 / 2.
    assert [float(v) for v in significance_weights([torch.tensor([3.0, 0.0, 0.0, 4.0])], phi=0.0)] == [2.5]


def test_resireduce_w_stores_the_weighted_average():
    m = ResiReduceW(group_size=2)
    m.register(_pair())
    m.update(torch.tensor([1.0, -1.0]), "layers.0.w")
    m.update(torch.tensor([2.0, 2.0]), "layers.1.w")
    m.flush()
    g = torch.zeros(2)
    m.compensate(g, "layers.1.w")
    assert torch.allclose(g, torch.tensor([5.0 / 3.0, 1.0]))  # (1*(1,-1) + 2*(2,2)) / 3


def test_resireduce_w_all_zero_residuals_give_zero_not_nan():
    m = ResiReduceW(group_size=2)
    m.register(_pair())
    m.update(torch.zeros(2), "layers.0.w")
    m.update(torch.zeros(2), "layers.1.w")
    m.flush()
    g = torch.ones(2)
    m.compensate(g, "layers.0.w")
    assert g.tolist() == [1.0, 1.0]


def test_group_reduced_in_parts_is_an_error():
    m = ResiReduceA(group_size=2)
    m.register(_pair())
    m.update(torch.ones(2), "layers.0.w")
    with pytest.raises(RuntimeError, match="reduced in parts"):
        m.flush()


def test_row_selection_keeps_top_l1_rows():
    r = torch.tensor([[1.0, 0.0, 0.0], [2.0, -2.0, 2.0], [1.0, 1.0, -1.0], [5.0, 5.0, 0.0]])  # L1 1, 6, 3, 10
    scheme = RowSelection(ratio=0.5)
    store = scheme.allocate(4, 3, F, torch.device("cpu"))
    scheme.update(r, store)
    assert store["rows"].tolist() == [1, 3]
    assert torch.equal(store["values"], r[[1, 3]])
    g = torch.zeros(4, 3)
    scheme.compensate(g, store)
    expected = torch.zeros(4, 3)
    expected[[1, 3]] = r[[1, 3]]
    assert torch.equal(g, expected)
    assert scheme.formula_bytes(4, 3, F) == 2 * 3 * 4 + 2 * 8


def test_row_column_selection_paper_figure_7c():
    # 8 x 6 residual, ratio 0.5 per dimension: 4 rows, 3 columns, 12 of 48 elements (25%), as in Fig. 7c.
    a = torch.tensor([1.0, 9.0, 2.0, 8.0, 7.0, 3.0, 6.0, 4.0])  # rows 1, 3, 4, 6 have the largest L1
    b = torch.tensor([1.0, 6.0, 2.0, 3.0, 5.0, 4.0])  # columns 1, 4, 5
    r = torch.outer(a, b) * torch.tensor([1.0, -1.0] * 3)  # signs do not change L1 norms
    scheme = RowColumnSelection(ratio=0.5)
    store = scheme.allocate(8, 6, F, torch.device("cpu"))
    scheme.update(r, store)
    assert store["rows"].tolist() == [1, 3, 4, 6]
    assert store["cols"].tolist() == [1, 4, 5]
    assert store["values"].numel() == 12
    g = torch.zeros(8, 6)
    scheme.compensate(g, store)
    mask = torch.zeros(8, 6, dtype=torch.bool)
    mask[torch.tensor([1, 3, 4, 6]).unsqueeze(1), torch.tensor([1, 4, 5])] = True
    assert torch.equal(g[mask], r[mask]) and torch.equal(g[~mask], torch.zeros(36))
    assert scheme.formula_bytes(8, 6, F) == 12 * 4 + 7 * 8


def test_intra_schemes_only_touch_specific_2d_layers():
    slots = [ParamSlot("layers.0.w", (4, 3), F, 0), ParamSlot("layers.1.w", (4, 3), F, 0),
             ParamSlot("emb.weight", (4, 3), F, 0)]
    m = ResiReduceD(ratio=0.25)  # one row of the specific layer; the layers keep full residuals
    m.register(slots)
    for s in slots:
        m.update(torch.arange(12.0).view(4, 3), s.name)
    m.flush()
    g = torch.zeros(4, 3)
    m.compensate(g, "layers.1.w")
    assert torch.equal(g, torch.arange(12.0).view(4, 3))
    g = torch.zeros(4, 3)
    m.compensate(g, "emb.weight")
    assert g[3].tolist() == [9.0, 10.0, 11.0] and g[:3].abs().sum() == 0


def _model_slots():
    slots = [ParamSlot(f"layers.{i}.w", (4, 3), F, 0) for i in range(4)]
    slots += [ParamSlot("emb.weight", (8, 6), F, 0), ParamSlot("norm.weight", (6,), F, 0)]
    return slots


# Hand-computed formulas for _model_slots (4 bytes per element, group size 2, ratio 0.5):
# layers 4 x 12 el., emb 48 el., norm 6 el.; d keeps 4 of 8 emb rows (+4 int64 indices);
# 2d keeps 4 x 3 emb elements (+7 int64 indices); a / w keep 2 group residuals of 12 el.
EXPECTED = {
    "none": 0,
    "residual": (48 + 48 + 6) * 4,
    "a": (24 + 48 + 6) * 4,
    "w": (24 + 48 + 6) * 4,
    "d": (48 + 6) * 4 + (4 * 6 * 4 + 4 * 8),
    "2d": (48 + 6) * 4 + (4 * 3 * 4 + 7 * 8),
    "w+2d": (24 + 6) * 4 + (4 * 3 * 4 + 7 * 8),
}


@pytest.mark.parametrize("scheme", sorted(EXPECTED))
def test_measured_memory_equals_formula(scheme):
    m = build_memory(scheme, group_size=2, ratio=0.5)
    m.register(_model_slots())
    assert m.formula_bytes() == EXPECTED[scheme]
    assert m.residual_bytes() == EXPECTED[scheme]
    # Updating does not grow the memory.
    for s in _model_slots():
        m.update(torch.randn(s.shape), s.name)
    m.flush()
    assert m.residual_bytes() == EXPECTED[scheme]


def test_state_dict_roundtrip_and_mismatch_error():
    a = build_memory("w+2d", group_size=2)
    a.register(_model_slots())
    for s in _model_slots():
        a.update(torch.randn(s.shape), s.name)
    a.flush()
    b = build_memory("w+2d", group_size=2)
    b.register(_model_slots())
    b.load_state_dict(a.state_dict())
    for key, t in a.stored_tensors().items():
        assert torch.equal(t, b.stored_tensors()[key])
    c = build_memory("residual")
    c.register(_model_slots())
    with pytest.raises(ValueError, match="does not match"):
        c.load_state_dict(a.state_dict())


def test_bad_arguments():
    with pytest.raises(ValueError, match="phi"):
        build_memory("w", phi=1.5)
    with pytest.raises(ValueError, match="ratio"):
        build_memory("2d", ratio=0.0)
    with pytest.raises(ValueError, match="unknown residual scheme"):
        build_memory("z")
    assert math.isclose(ResiReduce2D(0.5).intra.ratio, 0.5)
