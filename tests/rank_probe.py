"""A reward function that records which process scored the completions, for tests that must see every process of a
launch train. It adds nothing to the reward."""

import os


def record_rank(completions, **kwargs):
    """Append this process's ``RANK`` (``none`` outside a distributed launch) to the file named by
    ``RANK_PROBE_FILE``; reward 0 for every completion."""
    with open(os.environ["RANK_PROBE_FILE"], "a") as ranks:
        ranks.write(os.environ.get("RANK", "none") + "\n")
    return [0.0] * len(completions)
