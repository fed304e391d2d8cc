"""The names other code and tools read: the files a run writes, the keys STAPO adds to TRL's batches, and the metrics
it logs. Every writer and reader imports them from here, so that a name changes in one place.

Metrics are named ``<rule>/<statistic>`` (the token rule's registered name, then the statistic its function returns),
beside TRL's own (``reward``, ``entropy``, ...), so `rule_metric` builds any rule's metric name. Per-rule namespaces,
rather than one ``stapo/`` prefix, keep each rule's statistics apart when several rules run and say which rule a
number comes from; STAPO's batch keys, which no user reads, share the one prefix ``stapo_``.

The words, used the same way in code, logs, metrics and docs:

- a *candidate* is a loss token of a positive-advantage response whose probability is below ``prob_threshold``;
- a *spurious* token is a candidate whose entropy is also below ``tau_h``: the S2T criterion (STAPO, §3), the word
  of the pure function that computes it (`spurious_token_mask`);
- a *silenced* token is one a token rule removed from the loss; the S2T rule silences exactly the spurious tokens.
  Logs, metrics, summaries and figures count silenced tokens;
- the *mask* is the mechanism (the S2T mask, ``use_s2t_mask``), never the tokens it removes.
"""

from __future__ import annotations

# --- files in a run's output_dir -----------------------------------------------------------------------------------
METRICS_FILE = "metrics.jsonl"
"""Every logged record of `stapo-trl train`, one JSON object per line with its wall-clock seconds, written as it is
logged: the live copy of ``trainer_state.json``'s log history (the record of the run), on disk while the run trains and
after a kill between checkpoints."""
RUN_SUMMARY_FILE = "run_summary.json"
"""The run's record (`stapo_trl.run_record`), which `stapo-trl train` writes."""
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
TRAINER_STATE_FILE = "trainer_state.json"
"""transformers' trainer state, the last file a checkpoint save writes."""

# --- keys STAPO adds to TRL's batch dicts (batch-first tensors, so TRL's shuffle and split carry them) --------------
LOG_PROBS_KEY = "stapo_log_probs"
ENTROPIES_KEY = "stapo_entropies"
TOOL_MASK_BEFORE_RULES_KEY = "stapo_tool_mask_before_rules"
NUM_ITEMS_BEFORE_RULES_KEY = "stapo_num_items_before_rules"
ADVANTAGES_BEFORE_RULES_KEY = "stapo_advantages_before_rules"
SILENCED_KEY = "stapo_silenced"
TOKEN_WEIGHTS_KEY = "stapo_token_weights"
SHADOW_SILENCED_KEY = "stapo_shadow_silenced"
"""Loss tokens that the rules run in shadow would have silenced (not applied)."""
REWARDS_KEY = "stapo_rewards"
"""``[B, reward functions]``: each completion's rewards, added only when generation states are saved."""
GENERATION_STATES_DIR = "generation_states"
"""Where ``generation_states_every`` saves the states `stapo-trl counterfactual` replays."""


# --- metrics ---------------------------------------------------------------------------------------------------------
def rule_metric(rule: str, statistic: str) -> str:
    """The metric under which a token rule's statistic is logged: ``<rule>/<statistic>``."""
    return f"{rule}/{statistic}"


SHADOW_PREFIX = "shadow"


def shadow_metric(rule: str, statistic: str) -> str:
    """The metric of a statistic of a rule run in shadow (computed and logged, not applied):
    ``shadow/<rule>/<statistic>``."""
    return f"{SHADOW_PREFIX}/{rule_metric(rule, statistic)}"


TOKEN_STATS_MEAN_ENTROPY = "token_stats/mean_entropy"
"""Mean entropy over every loss token before the rules, under the policy the statistics came from. TRL's own
``entropy`` averages over the tokens its loss keeps, which excludes the silenced ones."""
TOKEN_DUMP_WRITTEN = "token_dump/written"
TOKEN_DUMP_DROPPED = "token_dump/dropped"
