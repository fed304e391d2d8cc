"""Evaluation: greedy accuracy on held-out problems (the quickstart's before/after measurement)."""

from .greedy import GreedyAccuracy, greedy_accuracy

__all__ = ["GreedyAccuracy", "greedy_accuracy"]
