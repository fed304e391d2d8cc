"""The core: `STAPOTrainer` (`trainer`), `STAPOConfig` (`config`), the token rules (`token_rules`), where the per-token
p and H come from (`token_stats`) and the seams with TRL (`trl_seams`). It imports nothing else of stapo-trl; the rest
of the package builds on it (docs/architecture.md).
"""
