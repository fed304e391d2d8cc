"""The boundary between stapo-trl and the internals of TRL 1.16, transformers and vLLM, in three rooms. This package
is the only place that names a private method or attribute of TRL or transformers (`tests/repository/test_trl_seams.py`
scans the rest of stapo-trl to keep it so).

- `hooks`: `HookedGRPOTrainer`, TRL's `GRPOTrainer` with the private methods stapo-trl extends turned into public
  hooks, and the small helpers that read a private name for the rest of the package.
- `patches`: every assignment to a TRL, vLLM or transformers module global, each with what it replaces and why
  (`tests/repository/test_trl_patches.py` fails on such an assignment anywhere else).
- `drift_checks`: one `Seam` per assumption the two rooms above make, with a check of the installed versions.
  ``python -m stapo_trl.trl_boundary`` prints them, which is where a port to a new TRL starts.
"""
