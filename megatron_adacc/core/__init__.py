"""What every feature and both hosts share, and nothing feature-specific: the extension protocol, the feature
registry's types, the error base, the patching helper and the saved-tensor base. Imports no other package of
megatron-adacc."""
