"""The model card with the run's record, evaluation results and model index (`stapo-trl train` and `eval` write it)."""
