"""The keys STAPO adds to TRL's batches (prefix ``stapo_``), the metrics its token rules log (``<rule>/<statistic>``,
`rule_metric`; ``shadow/<rule>/<statistic>`` in shadow) and the file that marks a checkpoint complete.

The words: a *candidate* is a loss token of a positive-advantage response with p below ``prob_threshold``; a *spurious*
token is a candidate with entropy also below ``tau_h`` (STAPO, §3; `spurious_token_mask`); a *silenced* token is one a
rule removed from the loss; the *mask* is the mechanism, never the tokens.
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
