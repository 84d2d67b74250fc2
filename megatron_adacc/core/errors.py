"""One base class for every refusal megatron-adacc makes.

A refusal is something the user can fix: a wrong policy file, an impossible budget, a flag combination that
cannot work. Its message is one line (or a short list) naming the problem and the fix. Library code only
raises; the command-line front ends (``adacc ...`` and the Megatron-LM patch) decide how to exit, so the same
error is an exception for a Python caller and one clear line, with no traceback, for a user.

Subclasses keep the builtin base they had (``ValueError``, ``ImportError`` ...) so ``except ValueError`` in
callers written before this class existed still catches them.
"""

from __future__ import annotations


class AdaccError(Exception):
    """A problem with the user's input or setup that megatron-adacc can explain, and the fix for it."""


class IntegrationError(AdaccError, ValueError):
    """A megatron-adacc flag cannot work with the rest of the command line."""


class FeatureUnavailable(AdaccError, ImportError):
    """A flag asks for a feature whose module this installation of megatron-adacc cannot import."""


class PatchTargetMissing(AdaccError, RuntimeError):
    """A function megatron-adacc wraps does not exist in the installed Megatron (or torch)."""


class InputNotFound(AdaccError, FileNotFoundError):
    """A file the command line names (a policy, a config, a checkpoint) is not there."""
