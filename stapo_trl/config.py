"""`STAPOConfig`: `GRPOConfig` plus the token rules: STAPO's S2T mask (arXiv 2602.15620), STARE and your own."""

from __future__ import annotations

import dataclasses
import json
import warnings
from dataclasses import dataclass, field

from trl import GRPOConfig

from .token_rules import GATE_MODES, STARE_VARIANTS, TOKEN_RULES

TOKEN_STATS_SOURCES = ("generation", "loss")
TOKEN_STATS_BACKENDS = ("auto", "trl", "torch", "liger")
LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo")
"""The loss aggregations of TRL 1.16's `GRPOTrainer`."""
STARE_SELECTION_POOLS = ("micro_batch", "optimizer_step")
BUILT_IN_RULE_SWITCHES = {"s2t": "use_s2t_mask", "stare": "use_stare"}


@dataclass
class STAPOConfig(GRPOConfig):
    r"""
    Configuration class for [`STAPOTrainer`]: every [`~trl.GRPOConfig`] argument, plus the S2T mask.

    Parameters:
        > Parameters of the S2T (silencing spurious tokens) mask

        use_s2t_mask (`bool`, *optional*, defaults to `True`):
            Silence spurious tokens and renormalize the loss over the kept ones (under `dr_grpo` and `luspo`, whose
            denominators count no tokens, silenced tokens only leave the numerator). With `False`, training is
            exactly GRPO.
        prob_threshold (`float`, *optional*, defaults to `0.002`):
            `tau_p`: a token of a positive-advantage response is a candidate when its probability is below this.
        entropy_quantile (`float`, *optional*, defaults to `0.8`):
            `q`: candidates whose entropy is below the `q`-quantile of the candidates' entropies (pooled over the
            whole optimizer step, across processes) are silenced. The paper's "tau_h = 80%".
        token_stats_source (`str`, *optional*, defaults to `"generation"`):
            Which policy supplies `p` and `H`: `"generation"` (the policy that generated the batch; exact when every
            generation feeds one optimizer step) or `"loss"` (the policy being optimized in each step, as in the
            paper).
        token_stats_backend (`str`, *optional*, defaults to `"auto"`):
            How a statistics pass computes `p` and `H`: `"trl"` (the model's TRL fused LM head), `"torch"` (our
            chunked op), `"liger"` (Liger's fused linear cross-entropy) or `"auto"`.

        > Parameters of STARE (surprisal-guided token-level advantage reweighting, arXiv 2606.19236)

        use_stare (`bool`, *optional*, defaults to `False`):
            Multiply the advantage of the highest-surprisal tokens of each advantage sign while the target-entropy
            gate is on.
        stare_variant (`str`, *optional*, defaults to `"O1"`):
            `"O1"` weights the positive-advantage selection by `W`; `"C2"` also weights the negative one by `M`.
        stare_top_surprisal_share (`float`, *optional*, defaults to `0.1`):
            `P`: the share of each advantage-sign subset that is selected, by highest surprisal `-log p`.
        stare_positive_weight (`float`, *optional*, defaults to `1.1`):
            `W` (the paper uses 1.05 for 14B and 32B models).
        stare_negative_weight (`float`, *optional*, defaults to `0.9`):
            `M`, C2 only (0.95 for 14B and 32B).
        stare_target_entropy (`float`, *optional*, defaults to `0.3`):
            The gate is on while the batch's mean token entropy (nats) under the pre-update policy is below this.
        stare_gate (`str`, *optional*, defaults to `"entropy"`):
            `"entropy"` (closed loop), `"on"` (always on: the no-gate ablation) or `"off"` (never: exactly GRPO).
        stare_adaptive (`bool`, *optional*, defaults to `False`):
            Move `W` and `M` by `stare_alpha` toward more reweighting while the entropy is below target, and back
            while above, within `[1, stare_max_positive_weight]` and `[stare_min_negative_weight, 1]`.
        stare_alpha (`float`, *optional*, defaults to `0.01`):
            The adaptive step.
        stare_max_positive_weight (`float`, *optional*, defaults to `1.5`):
            The adaptive upper clamp of `W`.
        stare_min_negative_weight (`float`, *optional*, defaults to `0.5`):
            The adaptive lower clamp of `M`.
        stare_selection_pool (`str`, *optional*, defaults to `"micro_batch"`):
            Where the top-surprisal share is taken: `"micro_batch"` (each micro-batch of each process alone, as the
            reference code does) or `"optimizer_step"` (all micro-batches of the step, across all processes).

        > Your own token rules

        token_rules (`list[str]`, *optional*, defaults to `[]`):
            Names of rules registered with `stapo_trl.token_rules.register_token_rule`, applied in this order after
            S2T and STARE.
        token_rule_kwargs (`dict` or `str`, *optional*):
            Keyword arguments per rule name, for example `{"my_rule": {"alpha": 0.5}}` (a JSON string on the command
            line).

        > The silenced-token dump (read by `stapo-trl report`)

        dump_silenced_tokens (`bool`, *optional*, defaults to `False`):
            Write each optimizer step's silenced tokens with their context, `p`, `H` and advantage to
            `output_dir/silenced_tokens.jsonl`, and counts plus a (log10 p, H) histogram of all loss tokens to
            `output_dir/silenced_tokens_stats.json`.
        dump_tokens_per_step (`int`, *optional*, defaults to `64`):
            Per-step cap; the step's silenced tokens are sampled uniformly and the rest counted as dropped.
        dump_max_tokens (`int`, *optional*, defaults to `5000`):
            Cap over the run.
        dump_context_tokens (`int`, *optional*, defaults to `20`):
            Tokens of context on each side of a silenced token.

    Defaults that follow the paper where TRL's differ, or could drift: `epsilon_high=0.28`, `beta=0.0`,
    `loss_type="dapo"`.
    """

    epsilon_high: float | None = field(
        default=0.28,
        metadata={
            "help": "Upper-bound epsilon for clipping. STAPO and DAPO use 0.28 (clip-higher); set it to `None` to use "
            "`epsilon` on both sides as GRPO does."
        },
    )
    beta: float = field(
        default=0.0,
        metadata={"help": "KL coefficient. STAPO trains without a KL term (0.0), as the paper does."},
    )
    loss_type: str = field(
        default="dapo",
        metadata={
            "help": "Loss aggregation, as in `GRPOConfig.loss_type`. STAPO uses 'dapo': token-level, divided by the "
            "loss tokens of the optimizer step over all processes, with S2T the kept ones. That count is exact when "
            "each generation feeds one optimizer step (steps_per_generation == gradient_accumulation_steps); "
            "otherwise it is TRL's average per step over the generation, minus the step's silenced tokens.",
            "choices": list(LOSS_TYPES),
        },
    )

    use_s2t_mask: bool = field(
        default=True,
        metadata={
            "help": "Silence spurious tokens (S2T) and renormalize the loss over the kept tokens (under dr_grpo and "
            "luspo, whose denominators count no tokens, silenced tokens only leave the numerator). With `False`, "
            "training is exactly GRPO."
        },
    )
    prob_threshold: float = field(
        default=0.002,
        metadata={
            "help": "tau_p, in (0, 1]: a token of a positive-advantage response is a spurious-token candidate when its "
            "probability under the policy is strictly below this value. The paper uses 0.002."
        },
    )
    entropy_quantile: float = field(
        default=0.8,
        metadata={
            "help": "q, in [0, 1]: tau_h is the q-quantile of the candidates' entropies over the whole optimizer step "
            "(all micro-batches and processes); candidates strictly below tau_h are silenced. The paper's "
            "'tau_h = 80 percent' is 0.8 (the later revision uses 0.75)."
        },
    )
    token_stats_source: str = field(
        default="generation",
        metadata={
            "help": "Which policy supplies the per-token probability and entropy. 'generation': the policy that "
            "generated the batch, reusing TRL's old-log-prob pass when it runs (vLLM importance sampling, "
            "num_iterations > 1), otherwise one extra no-grad pass per generation; exact when each generation feeds "
            "exactly one optimizer step. 'loss': the policy being optimized in each optimizer step, as the paper "
            "does; costs one no-grad pass per optimizer step, except right after generation where the generation-"
            "time statistics are reused.",
            "choices": list(TOKEN_STATS_SOURCES),
        },
    )
    token_stats_backend: str = field(
        default="auto",
        metadata={
            "help": "How a statistics pass computes log p and entropy without [N, V] logits. 'trl': the model's own "
            "TRL fused LM head (supports every model TRL supports). 'torch': the backbone, then our chunked torch op "
            "on the completion positions only. 'liger': the backbone, then Liger's fused linear cross-entropy "
            "(needs `pip install 'stapo-trl[liger]'`). 'auto': 'liger' on CUDA when installed, otherwise 'torch', "
            "and 'trl' for models the direct ops do not cover (vision-language, logit soft-capping or scaling) and "
            "under FSDP or DeepSpeed ZeRO-3.",
            "choices": list(TOKEN_STATS_BACKENDS),
        },
    )

    use_stare: bool = field(
        default=False,
        metadata={
            "help": "STARE: multiply the advantage of the highest-surprisal tokens of each advantage sign (W for "
            "positive, M for negative with variant C2) while the batch entropy is below stare_target_entropy."
        },
    )
    stare_variant: str = field(
        default="O1",
        metadata={
            "help": "'O1': weight only the positive-advantage selection by W. 'C2': also weight the negative-"
            "advantage selection by M.",
            "choices": list(STARE_VARIANTS),
        },
    )
    stare_top_surprisal_share: float = field(
        default=0.1,
        metadata={
            "help": "P, in (0, 1]: ceil(P * n) of the n positive-advantage tokens (and, for C2, of the negative ones) "
            "with the highest surprisal -log p are selected; ties at the boundary are all selected."
        },
    )
    stare_positive_weight: float = field(
        default=1.1,
        metadata={
            "help": "W > 0: the advantage multiplier of the positive selection. The paper uses 1.05 at 14B/32B."
        },
    )
    stare_negative_weight: float = field(
        default=0.9,
        metadata={"help": "M > 0: the advantage multiplier of the negative selection (variant C2 only)."},
    )
    stare_target_entropy: float = field(
        default=0.3,
        metadata={
            "help": "H_target in nats: the reweighting is on while the mean token entropy of the generation batch, "
            "under the policy that generated it, is strictly below this."
        },
    )
    stare_gate: str = field(
        default="entropy",
        metadata={
            "help": "'entropy': the closed-loop gate. 'on': always reweight (the no-gate ablation). 'off': never "
            "reweight, which trains exactly as GRPO (a check).",
            "choices": list(GATE_MODES),
        },
    )
    stare_adaptive: bool = field(
        default=False,
        metadata={
            "help": "Adaptive schedule: at each generation, W += alpha * sign(H_target - H) clipped to "
            "[1, stare_max_positive_weight], and M -= alpha * sign(H_target - H) clipped to "
            "[stare_min_negative_weight, 1]."
        },
    )
    stare_alpha: float = field(default=0.01, metadata={"help": "The adaptive schedule's step (stare_adaptive only)."})
    stare_max_positive_weight: float = field(
        default=1.5, metadata={"help": "Upper clamp of W under the adaptive schedule (stare_adaptive only)."}
    )
    stare_min_negative_weight: float = field(
        default=0.5, metadata={"help": "Lower clamp of M under the adaptive schedule (stare_adaptive only)."}
    )
    stare_selection_pool: str = field(
        default="micro_batch",
        metadata={
            "help": "Where the top-surprisal share is taken. 'micro_batch': in each micro-batch of each process "
            "separately, as the reference verl code does (the selection then depends on per_device_train_batch_size "
            "and the number of processes). 'optimizer_step': over every micro-batch of the optimizer step and every "
            "process, like the S2T pool, so the selection does not depend on how the batch is split.",
            "choices": list(STARE_SELECTION_POOLS),
        },
    )
    token_rules: list[str] = field(
        default_factory=list,
        metadata={
            "help": "Names of your own token rules, registered with stapo_trl.token_rules.register_token_rule, "
            "applied in this order after S2T (use_s2t_mask) and STARE (use_stare)."
        },
    )
    token_rule_kwargs: dict | str | None = field(
        default=None,
        metadata={
            "help": 'Keyword arguments for your token rules, by rule name, e.g. \'{"my_rule": {"alpha": 0.5}}\'.'
        },
    )

    dump_silenced_tokens: bool = field(
        default=False,
        metadata={
            "help": "Write the silenced tokens of every optimizer step (text, about dump_context_tokens tokens of "
            "context either side, p, H, advantage, step, sample id) to output_dir/silenced_tokens.jsonl, and counts "
            "plus a (log10 p, H) histogram of all loss tokens to output_dir/silenced_tokens_stats.json. Read them "
            "with `stapo-trl report`. Off by default; nothing is computed while off."
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
        default=20,
        metadata={"help": "Completion tokens of context decoded on each side of a silenced token."},
    )

    def __post_init__(self):
        self._validate_number_types()
        self._validate_sizes()
        super().__post_init__()

        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {self.loss_type!r}. STAPO uses 'dapo'.")
        self._validate_sampling_and_steps()

        if not 0.0 < self.prob_threshold <= 1.0:
            raise ValueError(
                f"prob_threshold must be in (0, 1], got {self.prob_threshold}. It is an absolute probability: the "
                "paper uses 0.002."
            )
        if not 0.0 <= self.entropy_quantile <= 1.0:
            raise ValueError(
                f"entropy_quantile must be in [0, 1], got {self.entropy_quantile}. It is a fraction, not a percent: "
                "the paper's 'tau_h = 80%' is entropy_quantile=0.8."
            )
        if not self.use_s2t_mask:
            changed = self._changed_from_default(("prob_threshold", "entropy_quantile"))
            if changed:
                raise ValueError(
                    f"{', '.join(changed)} set, but use_s2t_mask=False, so they would be ignored. Set "
                    "use_s2t_mask=True (or method: stapo), or remove them."
                )
        if self.token_stats_source not in TOKEN_STATS_SOURCES:
            raise ValueError(
                f"token_stats_source must be one of {TOKEN_STATS_SOURCES}, got {self.token_stats_source!r}."
            )
        if self.token_stats_backend not in TOKEN_STATS_BACKENDS:
            raise ValueError(
                f"token_stats_backend must be one of {TOKEN_STATS_BACKENDS}, got {self.token_stats_backend!r}."
            )
        if self.token_stats_backend == "liger":
            from .fused_stats import LIGER_INSTALL_HINT, is_liger_available

            if not is_liger_available():
                raise ValueError(
                    f"token_stats_backend='liger' needs liger-kernel>=0.8.5, which is not installed: "
                    f"{LIGER_INSTALL_HINT}. Or set token_stats_backend='auto'."
                )
        if isinstance(self.stare_variant, str):
            self.stare_variant = self.stare_variant.upper()
        self._validate_stare()
        self._validate_token_rules()
        self._validate_dump()

        if self.use_s2t_mask and self.top_entropy_quantile < 1.0:
            raise ValueError(
                f"use_s2t_mask=True conflicts with top_entropy_quantile={self.top_entropy_quantile}: both select "
                "tokens by entropy, in opposite directions (20-Entropy keeps only the highest-entropy tokens without "
                "renormalizing; S2T silences the lowest-entropy low-probability positive tokens). Run one method: "
                "set top_entropy_quantile=1.0 for STAPO, or use_s2t_mask=False for 20-Entropy."
            )
        if self.use_stare and self.top_entropy_quantile < 1.0:
            raise ValueError(
                f"use_stare=True conflicts with top_entropy_quantile={self.top_entropy_quantile}: STARE takes its "
                "top-surprisal share over every loss token, but 20-Entropy then drops the low-entropy "
                f"{1 - self.top_entropy_quantile:.0%} of them inside TRL's loss, so the share and the weights would "
                "refer to tokens that get no gradient. Run one method: top_entropy_quantile=1.0 for STARE, or "
                "use_stare=False for 20-Entropy."
            )
        steps, accumulation = self.steps_per_generation, self.gradient_accumulation_steps
        if self.active_token_rules and steps % accumulation != 0:
            raise ValueError(
                f"With token rules on ({', '.join(self.active_token_rules)}), steps_per_generation ({steps}) must be a "
                f"multiple of gradient_accumulation_steps ({accumulation}): the rules run once per optimizer step "
                "over all of its micro-batches (the S2T entropy pool is every token of the step), so all of a step's "
                "micro-batches must come from one generation batch. Raise steps_per_generation (or "
                "generation_batch_size), or lower gradient_accumulation_steps."
            )

    @property
    def active_token_rules(self) -> list[str]:
        """The rules the trainer applies, in order: S2T, STARE, then `token_rules`."""
        built_in = [name for name, switch in BUILT_IN_RULE_SWITCHES.items() if getattr(self, switch)]
        return built_in + list(self.token_rules)

    def _changed_from_default(self, names) -> list[str]:
        """Those of ``names`` whose value differs from the field's default (for "would be ignored" checks)."""
        fields = type(self).__dataclass_fields__
        return [name for name in names if getattr(self, name) != fields[name].default]

    def _validate_sizes(self) -> None:
        """Counts that must be positive. TRL accepts 0 for several of them and fails later, for example in torch's
        sampler at the first step."""
        for name in (
            "per_device_train_batch_size",
            "gradient_accumulation_steps",
            "num_iterations",
            "steps_per_generation",
            "generation_batch_size",
        ):
            value = getattr(self, name)
            if value is not None and isinstance(value, int) and value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}.")

    def _validate_number_types(self) -> None:
        """A string in a numeric field (from a dict or YAML read without TrlParser) would fail later, in a comparison
        deep inside TRL, transformers or torch."""
        for item in dataclasses.fields(self):
            annotation = item.type if isinstance(item.type, str) else getattr(item.type, "__name__", str(item.type))
            kinds = {kind.strip() for kind in annotation.split("|")}
            value = getattr(self, item.name)
            if isinstance(value, str) and kinds & {"int", "float"} and kinds <= {"int", "float", "None"}:
                raise ValueError(
                    f"{item.name} must be a number, got the string {value!r}. (YAML 1.1 reads 1e-6 as a string: "
                    "write 1.0e-6, or load recipes with TrlParser or `stapo-trl train`.)"
                )

    def _validate_sampling_and_steps(self) -> None:
        """Values TRL accepts here but that fail later inside transformers or torch, or train silently wrong."""
        if not self.temperature > 0:
            raise ValueError(
                f"temperature must be > 0, got {self.temperature}: GRPO samples its completions and divides the "
                "logits by it. For near-greedy rollouts use a small value such as 0.1."
            )
        if self.max_completion_length is not None and self.max_completion_length < 1:
            raise ValueError(f"max_completion_length must be at least 1 token, got {self.max_completion_length}.")
        if self.learning_rate < 0:
            raise ValueError(
                f"learning_rate must be >= 0, got {self.learning_rate}: a negative rate ascends the loss."
            )
        for name in ("epsilon", "epsilon_high"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(
                    f"{name} must be >= 0, got {value}: the ratio is clipped to [1 - epsilon, 1 + epsilon_high]. "
                    "STAPO uses epsilon=0.2 and epsilon_high=0.28."
                )

    def _validate_dump(self) -> None:
        limits = {
            "dump_tokens_per_step": (self.dump_tokens_per_step, 1),
            "dump_max_tokens": (self.dump_max_tokens, 0),
            "dump_context_tokens": (self.dump_context_tokens, 0),
        }
        for name, (value, least) in limits.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{name} must be an integer >= {least}, got {value!r}.")
        if not self.dump_silenced_tokens:
            changed = self._changed_from_default(limits)
            if changed:
                raise ValueError(
                    f"{', '.join(changed)} would be ignored: the token dump is off. Set dump_silenced_tokens=True."
                )
        elif not self.active_token_rules:
            # A warning, not an error: one recipe serves every method (`--method grpo` on the quickstart, which dumps).
            warnings.warn(
                "dump_silenced_tokens=True has nothing to record in this run: with use_s2t_mask=False, "
                "use_stare=False and no token_rules, no token is silenced and no token statistics are computed, so no "
                "dump is written. `stapo-trl report` still plots the run's logged metrics.",
                UserWarning,
                stacklevel=2,
            )

    def _validate_stare(self) -> None:
        if self.stare_variant not in STARE_VARIANTS:
            raise ValueError(f"stare_variant must be one of {STARE_VARIANTS}, got {self.stare_variant!r}.")
        if self.stare_gate not in GATE_MODES:
            raise ValueError(f"stare_gate must be one of {GATE_MODES}, got {self.stare_gate!r}.")
        if self.stare_selection_pool not in STARE_SELECTION_POOLS:
            raise ValueError(
                f"stare_selection_pool must be one of {STARE_SELECTION_POOLS}, got {self.stare_selection_pool!r}."
            )
        if not 0.0 < self.stare_top_surprisal_share <= 1.0:
            raise ValueError(
                f"stare_top_surprisal_share must be in (0, 1], got {self.stare_top_surprisal_share}. It is a "
                "fraction: the paper's P = 10% is 0.1."
            )
        if self.stare_positive_weight <= 0 or self.stare_negative_weight <= 0:
            raise ValueError(
                f"stare_positive_weight ({self.stare_positive_weight}) and stare_negative_weight "
                f"({self.stare_negative_weight}) must be positive: they multiply advantages, and a weight of 0 or "
                "below would drop or flip a token's update."
            )
        if self.stare_target_entropy < 0:
            raise ValueError(
                f"stare_target_entropy is an entropy in nats and must be >= 0, got {self.stare_target_entropy}."
            )
        if self.stare_alpha < 0:
            raise ValueError(f"stare_alpha must be >= 0, got {self.stare_alpha}.")
        if self.stare_max_positive_weight < 1.0 or not 0.0 < self.stare_min_negative_weight <= 1.0:
            raise ValueError(
                f"The adaptive clamps must satisfy stare_max_positive_weight >= 1 and 0 < stare_min_negative_weight "
                f"<= 1, got {self.stare_max_positive_weight} and {self.stare_min_negative_weight}."
            )
        changed = self._changed_from_default(
            name for name in type(self).__dataclass_fields__ if name.startswith("stare_")
        )
        if not self.use_stare:
            if changed:
                raise ValueError(
                    f"{', '.join(changed)} set, but use_stare=False, so they would be ignored. Set use_stare=True "
                    "(or method: stare), or remove them."
                )
            return
        unused = []
        if self.stare_variant == "O1" and "stare_negative_weight" in changed:
            unused.append("stare_negative_weight applies only to stare_variant='C2'")
        if not self.stare_adaptive:
            unused += [
                f"{name} applies only with stare_adaptive=True"
                for name in ("stare_alpha", "stare_max_positive_weight", "stare_min_negative_weight")
                if name in changed
            ]
        if unused:
            raise ValueError(f"These STARE settings would be ignored: {'; '.join(unused)}.")
        if self.stare_adaptive:
            if not 1.0 <= self.stare_positive_weight <= self.stare_max_positive_weight:
                raise ValueError(
                    f"With stare_adaptive=True, stare_positive_weight ({self.stare_positive_weight}) must start inside "
                    f"its clamp [1, stare_max_positive_weight={self.stare_max_positive_weight}]."
                )
            if self.stare_variant == "C2" and not self.stare_min_negative_weight <= self.stare_negative_weight <= 1.0:
                raise ValueError(
                    f"With stare_adaptive=True, stare_negative_weight ({self.stare_negative_weight}) must start inside "
                    f"its clamp [stare_min_negative_weight={self.stare_min_negative_weight}, 1]."
                )

    def _validate_token_rules(self) -> None:
        if isinstance(self.token_rules, str):
            self.token_rules = [self.token_rules]
        if isinstance(self.token_rule_kwargs, str):
            try:
                self.token_rule_kwargs = json.loads(self.token_rule_kwargs)
            except json.JSONDecodeError as error:
                raise ValueError(
                    f"token_rule_kwargs is not valid JSON ({error}): {self.token_rule_kwargs!r}"
                ) from None
        if self.token_rule_kwargs is None:
            self.token_rule_kwargs = {}
        if not isinstance(self.token_rule_kwargs, dict) or not all(
            isinstance(value, dict) for value in self.token_rule_kwargs.values()
        ):
            raise ValueError(
                "token_rule_kwargs must map rule names to keyword dicts, e.g. {'my_rule': {'alpha': 0.5}}; got "
                f"{self.token_rule_kwargs!r}."
            )
        for name in self.token_rules:
            if name in BUILT_IN_RULE_SWITCHES:
                raise ValueError(
                    f"token_rules lists {name!r}, a built-in rule: switch it on with "
                    f"{BUILT_IN_RULE_SWITCHES[name]}=True instead (it then runs before your rules)."
                )
            if name not in TOKEN_RULES:
                raise ValueError(
                    f"token_rules lists {name!r}, which is not registered. Registered rules: "
                    f"{', '.join(sorted(TOKEN_RULES))}. Import the module that registers it (with "
                    "@stapo_trl.token_rules.register_token_rule) before creating the config."
                )
        duplicates = sorted({name for name in self.token_rules if self.token_rules.count(name) > 1})
        if duplicates:
            raise ValueError(f"token_rules lists {', '.join(duplicates)} more than once.")
        stray = sorted(set(self.token_rule_kwargs) - set(self.token_rules))
        if stray:
            raise ValueError(
                f"token_rule_kwargs has arguments for {', '.join(stray)}, which token_rules does not list "
                f"({self.token_rules}); they would be ignored."
            )
