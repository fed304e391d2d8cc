"""The names the core writes and other code reads: the keys STAPO adds to TRL's batches, the metrics its token rules
log, and the file that marks a checkpoint complete.

Metrics are named ``<rule>/<statistic>`` (the token rule's registered name, then the statistic its function returns),
beside TRL's own (``reward``, ``entropy``, ...), so `rule_metric` builds any rule's metric name. Per-rule namespaces
keep each rule's statistics apart when several rules run; STAPO's batch keys, which no user reads, share the prefix
``stapo_``.

The words, used the same way in code, logs, metrics and docs:

- a *candidate* is a loss token of a positive-advantage response whose probability is below ``prob_threshold``;
- a *spurious* token is a candidate whose entropy is also below ``tau_h``: the S2T criterion (STAPO, §3), the word
  of the pure function that computes it (`spurious_token_mask`);
- a *silenced* token is one a token rule removed from the loss; the S2T rule silences exactly the spurious tokens.
  Logs, metrics, summaries and figures count silenced tokens;
- the *mask* is the mechanism (the S2T mask, ``use_s2t_mask``), never the tokens it removes.
"""

from __future__ import annotations

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
