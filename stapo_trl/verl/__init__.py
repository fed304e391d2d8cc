"""STAPO's S2T mask and STARE's weights as verl 0.9.1 policy losses (docs/verl.md).

Installed with the ``verl`` extra, this package is a ``verl.plugins`` entry point: ``import verl`` imports it, which
registers the ``loss_mode`` values ``stapo``, ``stare`` and ``stare_c2`` (:mod:`.losses`). It imports only where verl is
installed. :mod:`.entropy` says how the S2T loss gets verl's per-token entropy; :mod:`.drift` checks the installed verl
still fits.
"""

from .losses import (
    LOSS_MODES,
    register_s2t_loss,
    register_stare_loss,
    s2t_policy_loss,
    stare_policy_loss,
)

__all__ = ["LOSS_MODES", "register_s2t_loss", "register_stare_loss", "s2t_policy_loss", "stare_policy_loss"]
