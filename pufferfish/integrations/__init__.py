"""Pufferfish in third-party trainers: one callback each, the same switch underneath.

- :mod:`pufferfish.integrations.hf`: ``PufferfishCallback`` for the Hugging Face ``Trainer``;
- :mod:`pufferfish.integrations.lightning`: ``PufferfishCallback`` for Lightning's ``Trainer``.

Importing this package imports neither library; each submodule imports its own when imported.
What both callbacks share (the in-place switch, the checkpointed state, the rebuild of the
factorized structure on resume) is in :mod:`pufferfish.integrations.core`.
"""
