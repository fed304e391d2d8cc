"""The boundary between stapo-trl and the internals of TRL 1.16, transformers and vLLM. With the core's
`stapo_trl.core.trl_seams`, it is the only place that names a private of TRL or transformers
(`tests/repository/test_trl_seams.py` scans the rest of the package to keep it so).

- `helpers`: small functions that each read or pass one private name for the rest of the package.
- `patches`: every assignment to a TRL, vLLM or transformers module global (`tests/repository/test_trl_patches.py`
  fails on one anywhere else).
- `drift_checks`: one `Seam` per assumption made here or in the core's seams, with checks of the installed versions;
  ``python -m stapo_trl.trl_boundary`` prints them.
"""
