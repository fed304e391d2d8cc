"""STAPO's S2T mask and STARE's weights for verl 0.9.1 (docs/verl.md): policy losses (:mod:`.losses`, a
``verl.plugins`` entry point that registers ``stapo``, ``stare`` and ``stare_c2``) and the trainer mode ``stapo_sync``
(:mod:`.pool_trainer`). Importing this package alone registers nothing; everything here needs verl.
"""
