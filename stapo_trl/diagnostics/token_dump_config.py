"""The silenced-token dump's configuration fields, as a dataclass mixin that `STAPOConfig` combines with TRL's
`GRPOConfig`."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenDumpConfigMixin:
    """The parameters of the silenced-token dump, which `stapo-trl report` reads; each field's help metadata says
    what it does."""

    dump_silenced_tokens: bool = field(
        default=False,
        metadata={
            "help": "Write a sample of the silenced tokens of each optimizer step (text, dump_context_tokens tokens "
            "of context either side, p, H, advantage, step, sample id) to output_dir/silenced_tokens.jsonl: at most "
            "dump_tokens_per_step (64) a step, drawn uniformly, and dump_max_tokens (5000) a run. The tokens left out "
            "are counted, not written: output_dir/silenced_tokens_stats.json holds the counts silenced, written and "
            "dropped, and a (log10 p, H) histogram of every loss token. Read them with `stapo-trl report`. Off by "
            "default; nothing is computed while off."
        },
    )
    dump_tokens_per_step: int = field(
        default=64,
        metadata={
            "help": "At most this many silenced tokens per optimizer step are written, sampled uniformly over all "
            "processes; the rest are counted as dropped."
        },
    )
    dump_max_tokens: int = field(
        default=5000,
        metadata={"help": "At most this many silenced tokens are written over the run; later ones are counted only."},
    )
    dump_context_tokens: int = field(
        default=20, metadata={"help": "Completion tokens of context decoded on each side of a silenced token."}
    )

    def validate_dump_fields(self) -> None:
        """Check the dump's fields; called by the config's ``__post_init__``."""
        limits = {
            "dump_tokens_per_step": (self.dump_tokens_per_step, 1),
            "dump_max_tokens": (self.dump_max_tokens, 0),
            "dump_context_tokens": (self.dump_context_tokens, 0),
        }
        for name, (value, least) in limits.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{name} must be an integer >= {least}, got {value!r}.")
        if not self.dump_silenced_tokens:
            defaults = type(self).__dataclass_fields__
            changed = [name for name in limits if getattr(self, name) != defaults[name].default]
            if changed:
                raise ValueError(
                    f"{', '.join(changed)} would be ignored: the token dump is off. Set dump_silenced_tokens=True."
                )
