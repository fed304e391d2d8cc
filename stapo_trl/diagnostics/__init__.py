"""See what the token rules did: the silenced-token dump written during training, and `stapo-trl report`."""

from .token_dump import SilencedTokenDump, StepTokens, sample_positions, token_density, token_records

__all__ = ["SilencedTokenDump", "StepTokens", "sample_positions", "token_density", "token_records"]
