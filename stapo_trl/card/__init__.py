"""The model card with the run's record, evaluation results and model index, which `stapo-trl train` and
`stapo-trl eval` write (the card the trainer itself writes cites STAPO and names its thresholds)."""
