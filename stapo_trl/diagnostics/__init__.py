"""See what the token rules did: the silenced-token dump written during training, and `stapo-trl report`."""
