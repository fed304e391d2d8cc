"""The names of the files a run writes and of what the tools (the silenced-token dump, the saved generation states)
add to batches and metrics, imported by every writer and reader. The core's own names are in `stapo_trl.core.names`."""

from __future__ import annotations

METRICS_FILE = "metrics.jsonl"  # every record `stapo-trl train` logs, with its wall-clock seconds, one per line
RUN_SUMMARY_FILE = "run_summary.json"  # the run's record (`stapo_trl.diagnostics.run_record`)
TRAINING_CURVES_FILE = "training_curves.png"
HELDOUT_RESULTS_FILE = "heldout_results.jsonl"  # held-out greedy evaluation: each problem correct before/after
EVAL_SUMMARY_FILE = "summary.json"  # the results of `stapo-trl eval`, in its output directory
SILENCED_TOKENS_FILE = "silenced_tokens.jsonl"  # the dump: sampled silenced tokens with context, p, H and advantage
SILENCED_TOKENS_STATS_FILE = "silenced_tokens_stats.json"  # dump counts per step; loss tokens over (log p, H)
RECIPE_FILE = "recipe.yaml"  # written by `stapo-trl train`: the recipe as given, headed by the command line

REWARDS_KEY = "stapo_rewards"  # [B, reward funcs] rewards, added when generation states are saved
GENERATION_STATES_DIR = "generation_states"  # saved by generation_states_every, for `stapo-trl counterfactual`

TOKEN_DUMP_WRITTEN = "token_dump/written"
TOKEN_DUMP_DROPPED = "token_dump/dropped"
