"""``pufferfish bench``; :class:`Workload` is what ``--model PATH.py:FUNC`` returns."""

from .usermodel import Workload

__all__ = ["Workload"]
