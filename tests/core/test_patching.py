"""core.patching: the one way megatron-adacc patches Megatron or torch."""

from __future__ import annotations

import functools
import types

import pytest

from megatron_adacc.core import patching
from megatron_adacc.core.errors import AdaccError, PatchTargetMissing


def _module():
    module = types.ModuleType("megatron.fake")

    def f(x):
        """Doubles."""
        return 2 * x

    module.f = f
    return module


def _add_one(original):
    def wrapper(x):
        return original(x) + 1

    return wrapper


def test_patch_wraps_once_and_keeps_the_original():
    module = _module()
    original = module.f
    installed = patching.patch(module, "f", _add_one)
    assert module.f is installed and module.f(2) == 5
    assert module.f.__wrapped__ is original and patching.is_patched(module.f)
    assert module.f.__doc__ == "Doubles."  # functools.update_wrapper when the wrapper sets none
    assert patching.patch(module, "f", _add_one) is installed and module.f(2) == 5  # idempotent


def test_unpatch_restores_and_reports_whether_it_did():
    module = _module()
    original = module.f
    patching.patch(module, "f", _add_one)
    assert patching.unpatch(module, "f") is True and module.f is original
    assert patching.unpatch(module, "f") is False


def test_static_and_class_methods_stay_what_they_were():
    class Owner:
        @staticmethod
        def s(x):
            return x

        @classmethod
        def c(cls, x):
            return (cls.__name__, x)

    patching.patch(Owner, "s", _add_one)
    patching.patch(Owner, "c", lambda original: functools.wraps(original)(lambda cls, x: original(cls, x * 10)))
    assert Owner.s(1) == 2 and Owner().s(1) == 2
    assert Owner.c(1) == ("Owner", 10)
    assert patching.unpatch(Owner, "s") and patching.unpatch(Owner, "c")
    assert Owner.s(1) == 1 and Owner.c(1) == ("Owner", 1)


def test_an_instance_patch_is_undone_by_deleting_it():
    class Layer:
        def forward(self, x):
            return x

    layer = Layer()
    patching.patch(layer, "forward", _add_one)
    assert layer.forward(1) == 2 and Layer().forward(1) == 1
    assert patching.unpatch(layer, "forward") and "forward" not in vars(layer) and layer.forward(1) == 1


def test_a_missing_target_names_it_and_the_version():
    module = _module()
    with pytest.raises(PatchTargetMissing, match=r"megatron\.fake\.g does not exist in megatron-core") as err:
        patching.patch(module, "g", _add_one, why="needed for X")
    assert "needed for X" in str(err.value) and isinstance(err.value, AdaccError)
