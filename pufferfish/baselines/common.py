"""Helpers the pruning baselines share: which module is the output layer."""

from __future__ import annotations

from torch import nn

__all__ = ["output_layer_name"]


def output_layer_name(model: nn.Module) -> str:
    """The qualified name of the model's output layer: its last ``nn.Linear`` in registration order.

    Both baselines leave the classifier alone (Frankle & Carbin prune it at a lower rate; network
    slimming cannot remove a class), and for the paper's models the last Linear *is* the classifier
    (``fc`` of ResNet-18, ``classifier.fc3`` of VGG-19-BN, also the last entry of their preset
    ``keep`` lists).
    """
    names = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    if not names:
        raise ValueError(f"{type(model).__name__} has no nn.Linear output layer to exclude")
    return names[-1]

