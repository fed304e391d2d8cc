"""The silenced-token dump (files, fields and bounds: docs/diagnostics.md), written by `SilencedTokenDumpCallback` with
the settings of `TokenDumpArguments`; each checkpoint holds its counts, and a run resumed from one appends to it."""

from __future__ import annotations

import json
import logging
import math
import os
import warnings
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch

from ..core.distributed import all_reduce_sum, gather_objects, rank, world_size
from ..core.token_rules import StepTokens, get_token_rule, per_token_advantages
from ..core.trl_seams import StepEventCallback
from ..file_and_metric_names import (
    SILENCED_TOKENS_FILE,
    SILENCED_TOKENS_STATS_FILE,
    TOKEN_DUMP_DROPPED,
    TOKEN_DUMP_WRITTEN,
)
from ..storage import DamagedFileError, append_text, read_json_file, read_json_lines, write_text_atomically

logger = logging.getLogger(__name__)

LOG10_P_RANGE = (-10.0, 0.0)
ENTROPY_RANGE = (0.0, 12.0)
DENSITY_BINS = (40, 48)
"""Histogram bins over log10 p (0.25 decades) and entropy (0.25 nats); values outside are clamped to the edge bins."""
DENSITY_KINDS = ("positive_advantage", "other")
"""The histograms of the stats file: the loss tokens of responses with a positive advantage, and the others."""


def token_density(log_probs: torch.Tensor, entropies: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Int64 counts in ``DENSITY_BINS`` over (log10 p, H) of the tokens where ``mask`` is True: ``log_probs`` (natural
    log) and ``entropies`` (nats) are ``[B, T]``; a token with a non-finite log-prob or entropy is not counted."""
    log10_p = log_probs.detach().double() / math.log(10)
    entropy = entropies.detach().double()
    selected = mask.bool() & torch.isfinite(log10_p) & torch.isfinite(entropy)
    ranges = (LOG10_P_RANGE, ENTROPY_RANGE)
    columns = [
        ((values[selected] - low) / (high - low) * size).floor().long().clamp(0, size - 1)
        for values, (low, high), size in zip((log10_p, entropy), ranges, DENSITY_BINS, strict=True)
    ]
    flat = columns[0] * DENSITY_BINS[1] + columns[1]
    counts = torch.zeros(DENSITY_BINS, dtype=torch.int64, device=log_probs.device)
    counts.view(-1).index_add_(0, flat, torch.ones_like(flat))
    return counts


def sample_positions(silenced: torch.Tensor, limit: int, generator: torch.Generator) -> torch.Tensor:
    """Up to ``limit`` ``(row, position)`` pairs drawn uniformly without replacement from the True entries of a
    ``[B, T]`` bool tensor, in row-major order."""
    positions = silenced.nonzero()
    if positions.size(0) > limit:
        chosen = torch.randperm(positions.size(0), generator=generator)[:limit].sort().values
        positions = positions[chosen.to(positions.device)]
    return positions


def _json_lines(records: list[dict[str, Any]]) -> str:
    return "".join(json.dumps(record, ensure_ascii=False) + "\n" for record in records)


def token_records(
    tokens: StepTokens, positions: torch.Tensor, tokenizer, *, step: int, process_index: int, context_tokens: int
) -> list[dict[str, Any]]:
    """The dump records of the silenced tokens at ``positions`` (``(row, position)`` pairs): text, context from the
    completion's own tokens, p, H and advantage; ``sample_id`` ``"<step>-<process>-<row>"`` names the completion."""
    records, advantages = [], per_token_advantages(tokens.advantages, tokens.loss_mask)
    decode = partial(tokenizer.decode, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    for row, position in positions.tolist():
        length = int(tokens.loss_mask[row].nonzero().max()) + 1 if bool(tokens.loss_mask[row].any()) else position + 1
        ids = tokens.completion_ids[row].tolist()
        log_prob = float(tokens.log_probs[row, position])
        records.append(
            {
                "step": step,
                "sample_id": f"{step}-{process_index}-{row}",
                "position": position,
                "token_id": ids[position],
                "token": decode([ids[position]]),
                "context_before": decode(ids[max(0, position - context_tokens) : position]),
                "context_after": decode(ids[position + 1 : min(length, position + 1 + context_tokens)]),
                "log_prob": log_prob,
                "p": math.exp(log_prob),
                "entropy": float(tokens.entropies[row, position]),
                "advantage": float(advantages[row, position]),
            }
        )
    return records


def read_dump(directory: str | os.PathLike) -> tuple[list[dict[str, Any]] | None, dict[str, Any] | None]:
    """A run directory's dump records and its counts and density, each None when its file is absent. A last record
    cut off mid-write is left out; any other damage raises a `DamagedFileError` that names the file."""
    directory = Path(directory)
    records_path, stats_path = directory / SILENCED_TOKENS_FILE, directory / SILENCED_TOKENS_STATS_FILE
    records = stats = None
    if stats_path.is_file():
        stats = read_json_file(
            stats_path,
            "the silenced-token dump's counts and density",
            "Point the report at a checkpoint-N/ of the run, whose copy was saved with it, or delete the file to "
            "report without the dump's figures.",
        )
    if records_path.is_file():
        try:
            records = read_json_lines(records_path)
        except ValueError as error:
            raise DamagedFileError(str(error)) from None
    return records, stats


@dataclass
class TokenDumpArguments:
    """The silenced-token dump's settings (recipe keys and flags of `stapo-trl train`)."""

    dump_silenced_tokens: bool = field(
        default=False,
        metadata={
            "help": "Write a sample of each step's silenced tokens (in context, with p, H and advantage) to "
            "silenced_tokens.jsonl, at most dump_tokens_per_step (64) a step and dump_max_tokens (5000) a run, and "
            "their counts and a (log10 p, H) histogram to silenced_tokens_stats.json, for `stapo-trl report`."
        },
    )
    dump_tokens_per_step: int = field(
        default=64, metadata={"help": "Per-step cap on silenced tokens written, sampled over all ranks; rest dropped."}
    )
    dump_max_tokens: int = field(
        default=5000, metadata={"help": "Per-run cap on silenced tokens written; later ones are counted only."}
    )
    dump_context_tokens: int = field(
        default=20, metadata={"help": "Completion tokens of context decoded on each side of a silenced token."}
    )

    def __post_init__(self) -> None:
        lowest = {"dump_tokens_per_step": 1, "dump_max_tokens": 0, "dump_context_tokens": 0}
        for name, least in lowest.items():
            if isinstance(value := getattr(self, name), bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{name} must be an integer >= {least}, got {value!r}.")
        changed = [name for name in lowest if getattr(self, name) != type(self).__dataclass_fields__[name].default]
        if changed and not self.dump_silenced_tokens:
            off = "would be ignored: the token dump is off. Set dump_silenced_tokens=True."
            raise ValueError(f"{', '.join(changed)} {off}")


def warn_if_nothing_to_record(config) -> None:
    """Warn when ``config`` runs no token rule, applied or in shadow (not an error: one recipe serves every method)."""
    if not (getattr(config, "active_token_rules", None) or getattr(config, "shadow_token_rules", None)):
        warnings.warn(
            "The silenced-token dump has nothing to record in this run: no token rule is on or in shadow, so no token "
            "is silenced and no token statistics are computed, and no dump is written. `stapo-trl report` still plots "
            "the run's logged metrics.",
            UserWarning,
            stacklevel=3,
        )


class SilencedTokenDumpCallback(StepEventCallback):
    """Writes the bounded dump of a `STAPOTrainer` run at every optimizer step, logs ``token_dump/written`` and
    ``token_dump/dropped``, and keeps its counts in each checkpoint (``dump_silenced_tokens: true`` adds it). Outside a
    trainer: `start`, then `record_step` on every process at every optimizer step."""

    def __init__(self, settings: TokenDumpArguments | None = None):
        self.settings = settings or TokenDumpArguments(dump_silenced_tokens=True)
        self.stats: dict[str, Any] | None = None
        self.directory: Path | None = None

    def start(self, output_dir, tokenizer, *, seed: int = 0, probability_bound=None, is_main_process=True) -> None:
        """Write the dump of the run in ``output_dir``, decoding with ``tokenizer``; ``seed`` seeds the sampling."""
        self.directory, self.tokenizer, self.seed = Path(output_dir), tokenizer, seed
        self.probability_bound, self.is_main_process, self._opened = probability_bound, is_main_process, False
        self.records_path = self.directory / SILENCED_TOKENS_FILE
        self.stats_path = self.directory / SILENCED_TOKENS_STATS_FILE

    def _start_for(self, trainer) -> None:
        if self.directory is None:
            running = [get_token_rule(name) for name in (*trainer.token_rules, *trainer.shadow_token_rules)]
            bounds = [bound for spec in running if (bound := spec.probability_bound(trainer.args)) is not None]
            self.start(
                trainer.args.output_dir,
                getattr(trainer.processing_class, "tokenizer", trainer.processing_class),
                seed=trainer.args.seed,
                probability_bound=bounds[0] if bounds else None,
                is_main_process=trainer.accelerator.is_main_process,
            )

    def save_state(self, checkpoint_dir: str | os.PathLike) -> None:
        """Copy the counts and the density so far into a checkpoint (main process)."""
        if self.stats is not None and self.is_main_process:
            write_text_atomically(Path(checkpoint_dir) / SILENCED_TOKENS_STATS_FILE, json.dumps(self.stats) + "\n")

    def load_state(self, checkpoint_dir: str | os.PathLike) -> bool:
        """Take the counts and the density from a checkpoint (every process). False when it holds none."""
        path = Path(checkpoint_dir) / SILENCED_TOKENS_STATS_FILE
        if not path.is_file():
            return False
        self.stats = read_json_file(
            path,
            "the silenced-token dump's counts in a checkpoint",
            "Resume from another checkpoint, or delete the file to start the dump over.",
        )
        return True

    def _open(self) -> None:
        """Start the records over, or after a resume keep those of the steps the checkpoint covers."""
        self._opened, resumed = True, self.stats is not None
        if not resumed:
            self.stats = {
                "tokens_per_step": self.settings.dump_tokens_per_step,
                "max_tokens": self.settings.dump_max_tokens,
                "context_tokens": self.settings.dump_context_tokens,
                "probability_bound": self.probability_bound,
                **dict.fromkeys(("silenced", "written", "dropped"), 0),
                "steps": [],
                "density": {
                    "log10_p_range": list(LOG10_P_RANGE),
                    "entropy_range": list(ENTROPY_RANGE),
                    "bins": list(DENSITY_BINS),
                    **{name: torch.zeros(DENSITY_BINS, dtype=torch.int64).tolist() for name in DENSITY_KINDS},
                },
            }
        if not self.is_main_process:
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        kept = []
        if resumed and self.records_path.is_file():
            covered = max((entry["step"] for entry in self.stats["steps"]), default=0)
            kept = [record for record in read_json_lines(self.records_path) if record["step"] <= covered]
        write_text_atomically(self.records_path, _json_lines(kept))

    def record_step(self, step: int, tokens: StepTokens) -> dict[str, int]:
        """Count, sample and write one optimizer step's silenced tokens, and return the step's counts. Every process
        calls it (it all-reduces and gathers); every rank draws the same permutation of the global count, seeded by
        ``seed`` and ``step``, and decodes the sampled tokens in its own range."""
        loss_mask = tokens.loss_mask.bool()
        silenced = tokens.silenced.bool() & loss_mask
        positive = tokens.positive
        masks = (positive, loss_mask & ~positive)
        density = torch.stack([token_density(tokens.log_probs, tokens.entropies, mask) for mask in masks])
        counts = torch.zeros(world_size(), dtype=torch.int64, device=density.device)
        counts[rank()] = silenced.sum()
        reduced = all_reduce_sum(torch.cat([counts, density.view(-1)]))
        counts, density = reduced[: world_size()].cpu(), reduced[world_size() :].view(2, *DENSITY_BINS).cpu()
        num_silenced = int(counts.sum())
        if not self._opened:
            self._open()
        settings = self.settings
        budget = max(min(settings.dump_tokens_per_step, settings.dump_max_tokens - self.stats["written"]), 0)
        take = min(budget, num_silenced)
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        chosen = torch.randperm(num_silenced, generator=generator)[:take]
        offset = int(counts[: rank()].sum())
        mine = chosen[(chosen >= offset) & (chosen < offset + int(counts[rank()]))].sort().values - offset
        positions = silenced.nonzero().cpu()[mine]
        records = token_records(
            tokens,
            positions,
            self.tokenizer,
            step=step,
            process_index=rank(),
            context_tokens=settings.dump_context_tokens,
        )
        gathered = [record for part in gather_objects(records) for record in part]
        entry = {"step": step, "silenced": num_silenced, "written": take, "dropped": num_silenced - take}
        self.stats["steps"].append(entry)
        for key in ("silenced", "written", "dropped"):
            self.stats[key] += entry[key]
        for index, name in enumerate(DENSITY_KINDS):
            self.stats["density"][name] = (torch.tensor(self.stats["density"][name]) + density[index]).tolist()
        if self.is_main_process:
            append_text(self.records_path, _json_lines(gathered))
            write_text_atomically(self.stats_path, json.dumps(self.stats) + "\n")
        return entry

    def on_init_end(self, args, state, control, **kwargs):
        warn_if_nothing_to_record(args)

    def on_step_tokens(self, trainer, step_batches, tokens: StepTokens) -> None:
        self._start_for(trainer)
        dumped = self.record_step(trainer.state.global_step + 1, tokens)
        trainer.log_metric(TOKEN_DUMP_WRITTEN, dumped["written"])
        trainer.log_metric(TOKEN_DUMP_DROPPED, dumped["dropped"])

    def on_save_state(self, trainer, checkpoint_dir) -> None:
        self._start_for(trainer)
        self.save_state(checkpoint_dir)

    def on_load_state(self, trainer, checkpoint_dir) -> None:
        self._start_for(trainer)
        if not self.load_state(checkpoint_dir):
            message = "Resuming from %s, which holds no silenced-token dump state; %s starts over."
            logger.warning(message, checkpoint_dir, self.records_path)
