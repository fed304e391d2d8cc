"""The names other code and tools read: the files a run writes, the keys STAPO adds to TRL's batches, and the metrics
it logs. Every writer and reader imports them from here, so that a name changes in one place.

Metrics are named ``<rule>/<statistic>`` (the token rule's registered name, then the statistic its function returns),
beside TRL's own (``reward``, ``entropy``, ...), so `rule_metric` builds any rule's metric name.
"""

from __future__ import annotations

# --- files in a run's output_dir -----------------------------------------------------------------------------------
METRICS_FILE = "metrics.jsonl"
"""Every logged record of `stapo-trl train`, one JSON object per line."""
RUN_SUMMARY_FILE = "run_summary.json"
"""What `stapo-trl train` measured and wrote: held-out accuracy, timings, the files."""
TRAINING_CURVES_FILE = "training_curves.png"
EVAL_SUMMARY_FILE = "summary.json"
"""The results of `stapo-trl eval`, in its output directory."""
SILENCED_TOKENS_FILE = "silenced_tokens.jsonl"
"""The silenced-token dump: sampled silenced tokens with their context, p, H and advantage."""
SILENCED_TOKENS_STATS_FILE = "silenced_tokens_stats.json"
"""The dump's counts per step and its histogram of every loss token over (log p, H)."""
STARE_STATE_FILE = "stare_controller_state.json"
"""STARE's controller state, in each checkpoint."""
TRAINER_STATE_FILE = "trainer_state.json"
"""transformers' trainer state, the last file a checkpoint save writes."""

# --- keys STAPO adds to TRL's batch dicts (batch-first tensors, so TRL's shuffle and split carry them) --------------
BATCH_KEY_PREFIX = "stapo_"
LOG_PROBS_KEY = "stapo_log_probs"
ENTROPIES_KEY = "stapo_entropies"
TOOL_MASK_BEFORE_RULES_KEY = "stapo_tool_mask_before_rules"
NUM_ITEMS_BEFORE_RULES_KEY = "stapo_num_items_before_rules"
ADVANTAGES_BEFORE_RULES_KEY = "stapo_advantages_before_rules"
SILENCED_KEY = "stapo_silenced"
TOKEN_WEIGHTS_KEY = "stapo_token_weights"


# --- metrics ---------------------------------------------------------------------------------------------------------
def rule_metric(rule: str, statistic: str) -> str:
    """The metric under which a token rule's statistic is logged."""
    return f"{rule}/{statistic}"


S2T_MASKED_FRACTION = rule_metric("s2t", "masked_fraction")
S2T_NUM_MASKED = rule_metric("s2t", "num_masked")
S2T_NUM_CANDIDATES = rule_metric("s2t", "num_candidates")
S2T_ENTROPY_THRESHOLD = rule_metric("s2t", "entropy_threshold")
S2T_MASKED_GRAD_SQ_SHARE = rule_metric("s2t", "masked_grad_sq_share")
STARE_GATE_ON = rule_metric("stare", "gate_on")
STARE_POSITIVE_WEIGHT = rule_metric("stare", "positive_weight")
STARE_NEGATIVE_WEIGHT = rule_metric("stare", "negative_weight")
STARE_BATCH_ENTROPY = rule_metric("stare", "batch_entropy")
TOKEN_DUMP_WRITTEN = "token_dump/written"
TOKEN_DUMP_DROPPED = "token_dump/dropped"
