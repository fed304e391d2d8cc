"""STAPO's S2T mask and STARE's weights as verl 0.9.1 policy losses (docs/verl.md).

Installed with the ``verl`` extra, :mod:`.losses` is a ``verl.plugins`` entry point: ``import verl`` imports it, which
registers the ``loss_mode`` values ``stapo``, ``stare`` and ``stare_c2``. Importing this package alone registers
nothing. :mod:`.entropy` says how the S2T loss gets verl's per-token entropy, :mod:`.actor_batch` lays tensors out as
verl's actor does, and :mod:`.drift` checks that the installed verl still fits. Everything here needs verl.
"""
