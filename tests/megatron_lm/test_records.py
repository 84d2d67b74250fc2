"""The e2e tier's per-iteration records (``testing.records``): the iteration a record names is the step Megatron
ran, whether Megatron's loop passes it by name or a feature's wrapper in between passes it on by position."""

import functools
import types

from megatron_adacc.testing import records


def _training() -> types.ModuleType:
    training = types.ModuleType("training")

    def train_step(forward_step_func, data_iterator, model, optimizer, opt_param_scheduler, config,
                   forward_backward_func, iteration=None, pg_collection=None):
        return {"lm loss": 5.0 - iteration}, 0, False, 1, 0.5, 0.25, 0, 0

    training.train_step = train_step
    return training


def test_the_iteration_is_read_by_name_or_by_position(tmp_path):
    training = _training()
    stock = training.train_step

    @functools.wraps(stock)
    def feature_wrapper(*args, **kwargs):  # what megatron_lm.session does: Megatron's arguments, bound, positionally
        return stock(*args[:7], kwargs.pop("iteration"), **kwargs) if "iteration" in kwargs else stock(*args, **kwargs)

    training.train_step = feature_wrapper
    records.record_iterations(training, str(tmp_path / "run"))
    records.record_iterations(training, str(tmp_path / "run"))  # once per module
    head = (None,) * 7
    training.train_step(*head, iteration=5)
    training.train_step(*head, 6)
    rows = records.read_records(tmp_path / "run", 0)
    assert [(r["iteration"], r["loss"], r["grad_norm"]) for r in rows] == [(6, 0.0, 0.25), (7, -1.0, 0.25)]
