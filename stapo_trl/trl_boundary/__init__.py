"""The only place, with the core's `stapo_trl.core.trl_seams`, that names a private of TRL or transformers: `helpers`
reads or passes each private name, `patches` makes every assignment to a TRL, vLLM or transformers module global, and
`drift_checks` checks each assumption against the installed versions (``python -m stapo_trl.trl_boundary``)."""
