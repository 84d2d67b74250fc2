"""The per-op actions as an enum that stays interchangeable with its strings, and the codec names the policy
files accept (owned by the codec registry)."""

from __future__ import annotations

import json
import pickle

import pytest

from megatron_adacc.adacc.policy.ops import ACTIONS, CODECS, OPS, Action
from megatron_adacc.adacc.policy.policy import Decision, parse_decision
from megatron_adacc.codecs import CODEC_NAMES


def test_an_action_is_its_string() -> None:
    assert ACTIONS == ("keep", "compress", "recompute")
    for action in Action:
        value = action.value
        assert action == value and hash(action) == hash(value)
        assert str(action) == f"{action}" == value and type(str(action)) is str
        assert json.dumps({action: action}) == json.dumps({value: value})
        assert pickle.loads(pickle.dumps(action)) is action
    assert {"keep": 1}[Action.KEEP] == 1 and {Action.KEEP: 1}["keep"] == 1
    assert ", ".join(ACTIONS) == "keep, compress, recompute"


def test_decisions_hold_the_member_whatever_they_were_given() -> None:
    assert Decision("keep").action is Action.KEEP
    assert Decision("keep") == Decision(Action.KEEP) and hash(Decision("keep")) == hash(Decision.keep())
    assert Decision("compress", "int4_symmetric").action is Action.COMPRESS
    assert parse_decision("recompute", "softmax").action is Action.RECOMPUTE
    assert Decision.keep().label == "keep" and type(Decision.keep().label) is str
    assert Decision.compress("bitmask").label == "compress:bitmask"
    assert Decision.recompute().to_json() == {"action": "recompute"}
    assert type(Decision.recompute().to_json()["action"]) is str
    with pytest.raises(ValueError, match="unknown action 'drop'; expected one of keep, compress, recompute"):
        Decision("drop")
    with pytest.raises(ValueError, match="action 'keep' takes no codec"):
        Decision(Action.KEEP, "int4_symmetric")


def test_policy_codecs_are_the_registry_codecs_but_keep() -> None:
    assert set(CODECS) == set(CODEC_NAMES) - {"keep"}
    # the schema and messages list the layer-specific codecs first, as before the registry owned the names
    assert CODECS == ("int4_outlier", "int4_smoothed", "int4_asymmetric", "int4_symmetric", "int4_channelwise",
                      "bitmask", "stochastic")
    assert all(set(op.codecs) <= set(CODECS) for op in OPS)
