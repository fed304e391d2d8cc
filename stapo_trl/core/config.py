"""`STAPOConfig`: `GRPOConfig` plus the token rules' fields (each rule's config mixin) and where their per-token
statistics come from.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

from trl import GRPOConfig

from .token_rules import TOKEN_RULES, active_rule_names, rule_config_mixins, switched_rules
from .token_rules.registry import changed_fields
from .token_stats.backends import TOKEN_STATS_BACKENDS, backend_unavailable
from .token_stats.statistics import TOKEN_STATS_SOURCES


def optimizer_steps_per_generation(config) -> int:
    """How many optimizer steps each generation feeds (at least 1): ``steps_per_generation * num_iterations``
    micro-batches, ``gradient_accumulation_steps`` per optimizer step."""
    steps = config.steps_per_generation * config.num_iterations // config.gradient_accumulation_steps
    return max(steps, 1)


LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo")
"""The loss aggregations of TRL 1.16's `GRPOTrainer`."""


@dataclass
class STAPOConfig(*rule_config_mixins(), GRPOConfig):
    r"""Configuration class for [`STAPOTrainer`]: every [`~trl.GRPOConfig`] argument, plus each registered token rule's
    fields (S2T: `use_s2t_mask`, `prob_threshold`, `entropy_quantile`; STARE: `use_stare`, `stare_*`), your own rules,
    and where their statistics come from. Paper defaults where TRL's differ: `epsilon_high=0.28`, `beta=0.0`,
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
            "help": "How a statistics pass computes log p and entropy without [N, V] logits. 'trl_fused_head': the "
            "whole model, its own LM head included, through TRL's fused head (supports every model TRL supports). "
            "'torch': the backbone, then stapo-trl's blocked torch op on the completion positions only. 'liger': the "
            "backbone, then Liger's fused linear cross-entropy (needs `pip install -e '.[liger]'` in the stapo-trl "
            "clone). 'auto': 'liger' on CUDA when installed, otherwise 'torch', and 'trl_fused_head' for models the "
            "other two do not cover (vision-language, logit soft-capping or scaling) and under FSDP or DeepSpeed "
            "ZeRO-3.",
            "choices": list(TOKEN_STATS_BACKENDS),
        },
    )

    token_rules: list[str] = field(
        default_factory=list,
        metadata={
            "help": "Names of your own token rules, registered with stapo_trl.core.token_rules.register_token_rule, "
            "applied in this order after S2T (use_s2t_mask) and STARE (use_stare)."
        },
    )
    token_rule_kwargs: dict | str | None = field(
        default=None,
        metadata={
            "help": 'Keyword arguments for your token rules, by rule name, e.g. \'{"my_rule": {"alpha": 0.5}}\' (a JSON '
            "string on the command line)."
        },
    )

    shadow_token_rules: list[str] = field(
        default_factory=list,
        metadata={
            "help": "Rules to compute and log at every optimizer step without applying them, under "
            "shadow/<rule>/...: for example GRPO (use_s2t_mask false) with [s2t] logs what S2T would silence."
        },
    )

    def __post_init__(self):
        self._validate_numbers()
        self._resolve_checkpointing_default()
        super().__post_init__()

        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {self.loss_type!r}. STAPO uses 'dapo'.")
        self._validate_sampling_and_steps()
        for name, allowed in {
            "token_stats_source": TOKEN_STATS_SOURCES,
            "token_stats_backend": TOKEN_STATS_BACKENDS,
        }.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}.")
        problem = backend_unavailable(self.token_stats_backend)
        if problem is not None:
            raise ValueError(
                f"token_stats_backend={self.token_stats_backend!r}: {problem}. Or set token_stats_backend='auto'."
            )
        self._validate_token_rules()
        self._validate_rule_fields()
        steps, accumulation = self.steps_per_generation, self.gradient_accumulation_steps
        rules = self.active_token_rules + self.shadow_token_rules
        if rules and steps % accumulation != 0:
            raise ValueError(
                f"With token rules on ({', '.join(rules)}), steps_per_generation ({steps}) must be a multiple of "
                f"gradient_accumulation_steps ({accumulation}): the rules run once per optimizer step over all of its "
                "micro-batches (the S2T entropy pool is every token of the step), so all of a step's micro-batches "
                "must come from one generation batch. Raise steps_per_generation (or generation_batch_size), or lower "
                "gradient_accumulation_steps."
            )

    @property
    def active_token_rules(self) -> list[str]:
        """The rules the trainer applies, in order: the switched-on built-in rules, then `token_rules`."""
        return active_rule_names(self)

    def _validate_numbers(self) -> None:
        """Numbers TRL accepts but fails on later: a string in a numeric field (from a dict or YAML read without
        TrlParser), in a comparison deep inside TRL, transformers or torch; a count below 1 (TRL accepts 0 for
        several), for example in torch's sampler at the first step."""
        for item in dataclasses.fields(self):
            annotation = item.type if isinstance(item.type, str) else getattr(item.type, "__name__", str(item.type))
            kinds = {kind.strip() for kind in annotation.split("|")}
            value = getattr(self, item.name)
            if isinstance(value, str) and kinds & {"int", "float"} and kinds <= {"int", "float", "None"}:
                raise ValueError(
                    f"{item.name} must be a number, got the string {value!r}. (YAML 1.1 reads 1e-6 as a string: "
                    "write 1.0e-6, or load recipes with TrlParser or `stapo-trl train`.)"
                )
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

    def _resolve_checkpointing_default(self) -> None:
        """Carry TRL's default ``gradient_checkpointing=True`` over to ``activation_checkpointing``, the name
        transformers 5.24 uses, when that is unset. transformers resolves the old name into the new one the same way,
        but warns that the old name is deprecated even when nobody wrote it (it is TRL's default). A
        ``gradient_checkpointing`` value other than TRL's default was written by the user and still warns."""
        names = type(self).__dataclass_fields__
        if "activation_checkpointing" not in names or self.activation_checkpointing is not None:
            return
        if self.gradient_checkpointing == names["gradient_checkpointing"].default:
            self.activation_checkpointing = self.gradient_checkpointing

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

    def _validate_token_rules(self) -> None:
        for name in ("token_rules", "shadow_token_rules"):
            if isinstance(getattr(self, name), str):
                setattr(self, name, [getattr(self, name)])
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
        switches = {spec.name: spec.switch for spec in switched_rules()}
        for name in self.token_rules:
            if name in switches:
                raise ValueError(
                    f"token_rules lists {name!r}, a built-in rule: switch it on with {switches[name]}=True instead "
                    "(it then runs before your rules)."
                )
        for field_name in ("token_rules", "shadow_token_rules"):
            listed = getattr(self, field_name)
            for name in listed:
                if name not in TOKEN_RULES:
                    raise ValueError(
                        f"{field_name} lists {name!r}, which is not registered. Registered rules: "
                        f"{', '.join(sorted(TOKEN_RULES))}. Import the module that registers it (with "
                        "@stapo_trl.core.token_rules.register_token_rule) before creating the config."
                    )
            duplicates = sorted({name for name in listed if listed.count(name) > 1})
            if duplicates:
                raise ValueError(f"{field_name} lists {', '.join(duplicates)} more than once.")
        both = [name for name in self.shadow_token_rules if name in self.active_token_rules]
        if both:
            raise ValueError(
                f"shadow_token_rules lists {', '.join(both)}, which this run also applies. A rule runs either applied "
                "or in shadow (computed and logged only): remove it from one of the two."
            )
        stray = sorted(set(self.token_rule_kwargs) - set(self.token_rules) - set(self.shadow_token_rules))
        if stray:
            raise ValueError(
                f"token_rule_kwargs has arguments for {', '.join(stray)}, which neither token_rules nor "
                f"shadow_token_rules lists ({self.token_rules}); they would be ignored."
            )

    def _validate_rule_fields(self) -> None:
        """Each built-in rule's own checks, and no rule setting that no running rule reads."""
        used = set(self.active_token_rules) | set(self.shadow_token_rules)
        specs = switched_rules()
        read = {name for spec in specs if spec.name in used for name in (*spec.fields, *spec.reads_fields)}
        for spec in specs:
            spec.validate(self, spec.name in used)
            changed = changed_fields(self, spec.config_mixin) if spec.config_mixin else []
            changed = [name for name in changed if name != spec.switch and name not in read]
            if changed:
                method = f" (or method: {spec.method.name})" if spec.method is not None else ""
                raise ValueError(
                    f"{', '.join(changed)} set, but {spec.switch}=False, so they would be ignored. Set "
                    f"{spec.switch}=True{method}, or remove them."
                )
