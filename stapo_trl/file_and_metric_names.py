"""The names of the files a run writes and of what the tools (the silenced-token dump, the saved generation states)
add to batches and metrics. Every writer and reader imports them from here, so that a name changes in one place. The
core's own names (batch keys, rule metrics) are in `stapo_trl.core.names`."""

from __future__ import annotations

METRICS_FILE = "metrics.jsonl"
"""Every logged record of `stapo-trl train` with its wall-clock seconds, one JSON object per line, written as logged."""
RUN_SUMMARY_FILE = "run_summary.json"
"""The run's record (`stapo_trl.diagnostics.run_record`), which `stapo-trl train` writes."""
TRAINING_CURVES_FILE = "training_curves.png"
HELDOUT_RESULTS_FILE = "heldout_results.jsonl"
"""The held-out greedy evaluation of `stapo-trl train`, one JSON object per problem: correct before and after."""
EVAL_SUMMARY_FILE = "summary.json"
"""The results of `stapo-trl eval`, in its output directory."""
SILENCED_TOKENS_FILE = "silenced_tokens.jsonl"
"""The silenced-token dump: sampled silenced tokens with their context, p, H and advantage."""
SILENCED_TOKENS_STATS_FILE = "silenced_tokens_stats.json"
"""The dump's counts per step and its histogram of every loss token over (log p, H)."""
RECIPE_FILE = "recipe.yaml"
"""Written into the output dir by `stapo-trl train`: the recipe as given, headed by the command line."""

REWARDS_KEY = "stapo_rewards"
"""``[B, reward functions]``: each completion's rewards, added only when generation states are saved."""
GENERATION_STATES_DIR = "generation_states"
"""Where ``generation_states_every`` saves the states `stapo-trl counterfactual` replays."""

TOKEN_DUMP_WRITTEN = "token_dump/written"
TOKEN_DUMP_DROPPED = "token_dump/dropped"
