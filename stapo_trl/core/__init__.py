"""The core: `STAPOTrainer` (`trainer`), `STAPOConfig` (`config`), the token rules (`token_rules`: pure tensor functions
and their specs), where the per-token p and H come from (`token_stats`), and the seams with TRL (`trl_seams`). It
imports nothing else of stapo-trl; every other part of the package builds on it through TRL's own extension points.
"""
