"""Research tools built on the core: the gradient probe, saved generation states and `stapo-trl counterfactual`."""
