"""Automatic choices for Pufferfish: when to switch, which ranks, which layers stay full-rank.

Pufferfish trains a full-rank model for a hand-picked number of warm-up epochs, then factorizes
every layer at one hand-picked rank ratio (1/4) except a hand-picked set of layers. Cuttlefish
(Wang et al., MLSys 2023) removes all three choices, and Khodak et al. (ICLR 2021) replace weight
decay on the factors by Frobenius decay. This module holds the pure pieces; the training loop
wires them together. One module per concern:

1. **When to switch** — :class:`StableRankTracker` (:mod:`.stable_rank`) measures every
   factorizable layer's stable rank ``‖W‖²_F / ‖W‖²₂`` a few times per epoch;
   :class:`SwitchDetector` (:mod:`.detector`) says "switch now" once all of them have stopped
   moving. Stable ranks drop fast early in training and then plateau; once they plateau the
   layer's "effective rank" is known, and more full-rank epochs only cost time.
2. **Which rank** — :func:`choose_ranks` (:mod:`.ranks`): Cuttlefish's scaled stable rank (or an
   energy threshold on the spectrum), per layer, never above the largest rank that still saves
   parameters. The result is ``factorize(model, overrides=ranks)``.
3. **Which layers stay full-rank** — :func:`profile_keep` (:mod:`.keep`, measuring with
   :mod:`.timing`): time each layer dense and low-rank on the shapes it really sees; keep the
   ones where factorizing saves neither time nor parameters (small early convs, tiny heads). The
   result is ``factorize(model, keep=names)``.
4. **Which kernel** — :func:`time_kernels` (:mod:`.kernels`): a low-rank layer with several
   implementations of ``forward`` (``LowRankLSTM``'s fused and loop kernels) runs the fastest
   on the run's shapes.
5. **Regularization** — :func:`frobenius_decay` (:mod:`.frobenius`) adds
   ``coeff/2 · Σ‖U V‖²_F`` over the factor pairs; exclude :func:`frobenius_decay_params` from
   the optimizer's plain weight decay.

Typical use::

    tracker, detector = StableRankTracker(model), SwitchDetector(max_epochs=epochs // 2)
    switched = False
    for epoch in range(epochs):
        train_one_epoch(model)
        if not switched and detector.update(epoch, tracker.observe(epoch)):
            ranks = choose_ranks(tracker)
            keep, timings = profile_keep(model, batch, ranks)
            report = factorize(model, overrides=ranks, keep=keep)
            switched = True
"""

from .detector import SwitchDetector
from .frobenius import frobenius_decay, frobenius_decay_params
from .keep import profile_keep
from .kernels import time_kernels
from .ranks import budget_params, choose_ranks, saving_cap
from .stable_rank import StableRankTracker, layer_matrix, layer_stable_rank, stable_rank

__all__ = [
    "StableRankTracker",
    "SwitchDetector",
    "budget_params",
    "choose_ranks",
    "frobenius_decay",
    "frobenius_decay_params",
    "layer_matrix",
    "layer_stable_rank",
    "profile_keep",
    "saving_cap",
    "stable_rank",
    "time_kernels",
]
