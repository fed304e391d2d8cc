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

import warnings

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


S2T_SILENCED_FRACTION = rule_metric("s2t", "silenced_fraction")
S2T_NUM_SILENCED = rule_metric("s2t", "num_silenced")
S2T_NUM_CANDIDATES = rule_metric("s2t", "num_candidates")
S2T_ENTROPY_THRESHOLD = rule_metric("s2t", "entropy_threshold")
S2T_SILENCED_GRAD_SQ_SHARE = rule_metric("s2t", "silenced_grad_sq_share")
STARE_GATE_ON = rule_metric("stare", "gate_on")
STARE_POSITIVE_WEIGHT = rule_metric("stare", "positive_weight")
STARE_NEGATIVE_WEIGHT = rule_metric("stare", "negative_weight")
STARE_BATCH_ENTROPY = rule_metric("stare", "batch_entropy")
TOKEN_DUMP_WRITTEN = "token_dump/written"
TOKEN_DUMP_DROPPED = "token_dump/dropped"


# --- deprecation shim: metric names of earlier versions ------------------------------------------------------------------------
RETIRED_METRICS = {
    rule_metric("s2t", "masked_fraction"): S2T_SILENCED_FRACTION,
    rule_metric("s2t", "num_masked"): S2T_NUM_SILENCED,
    rule_metric("s2t", "masked_grad_sq_share"): S2T_SILENCED_GRAD_SQ_SHARE,
}
"""Metric names that runs trained before the one vocabulary logged, and their current names."""

RETIRED_SPURIOUS_MASK_STATS = {"masked_grad_sq_share": "spurious_grad_sq_share"}
"""Keys of `spurious_token_mask`'s statistics that earlier versions returned, and their current names."""


class StatsWithRetiredKeys(dict):
    """A statistics dict that still answers to retired key names, with a FutureWarning, so that code written against
    an earlier version of a pure function's statistics keeps running. Only item access and ``get`` answer: the
    retired names are not among the keys, ``in`` and iteration see the current names only."""

    def __init__(self, stats: dict, retired: dict[str, str]):
        super().__init__(stats)
        self._retired = retired

    def _current_name(self, key) -> str | None:
        current = self._retired.get(key)
        if current is not None:
            warnings.warn(
                f"the statistic {key!r} is now called {current!r}; the old name will be removed in a later version.",
                FutureWarning,
                stacklevel=3,
            )
        return current

    def __missing__(self, key):
        current = self._current_name(key)
        if current is None:
            raise KeyError(key)
        return self[current]

    def get(self, key, default=None):
        if key in self:
            return super().get(key)
        current = self._current_name(key)
        return super().get(current, default) if current is not None else default


def with_current_metric_names(records: list[dict], source: object = "this log") -> list[dict]:
    """``records`` with retired metric names renamed to the current ones, so that runs logged before the rename still
    read. Warns once (FutureWarning) when it renamed anything; records that already use the current names pass as
    they are."""
    renamed = []
    found = False
    for record in records:
        if any(old in record for old in RETIRED_METRICS):
            found = True
            record = {RETIRED_METRICS.get(key, key): value for key, value in record.items()}
        renamed.append(record)
    if found:
        warnings.warn(
            f"{source} uses retired metric names ({', '.join(RETIRED_METRICS)}); they are read as "
            f"{', '.join(RETIRED_METRICS.values())}. Runs trained with this version of stapo-trl log the new names.",
            FutureWarning,
            stacklevel=2,
        )
    return renamed
