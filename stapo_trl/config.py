"""`STAPOConfig`: `GRPOConfig` plus the token rules: STAPO's S2T mask (arXiv 2602.15620), STARE and your own."""

from __future__ import annotations

import dataclasses
import json
import warnings
from dataclasses import dataclass, field

from trl import GRPOConfig

from .diagnostics.token_dump_config import TokenDumpConfigMixin
from .token_rules import TOKEN_RULES
from .token_rules.stare_config import STAREConfigMixin

TOKEN_STATS_SOURCES = ("generation", "loss")
TOKEN_STATS_BACKENDS = ("auto", "model_head", "torch", "liger")
RETIRED_TOKEN_STATS_BACKENDS = {"trl": "model_head"}
"""Earlier spellings of ``token_stats_backend`` values and their current ones (``"trl"`` read as the library)."""
LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo")
"""The loss aggregations of TRL 1.16's `GRPOTrainer`."""
BUILT_IN_RULE_SWITCHES = {"s2t": "use_s2t_mask", "stare": "use_stare"}


@dataclass
class STAPOConfig(STAREConfigMixin, TokenDumpConfigMixin, GRPOConfig):
    r"""
    Configuration class for [`STAPOTrainer`]: every [`~trl.GRPOConfig`] argument, plus the S2T mask, STARE (the
    fields of [`~stapo_trl.token_rules.stare_config.STAREConfigMixin`]), your own token rules, and the silenced-token
    dump (the fields of [`~stapo_trl.diagnostics.token_dump_config.TokenDumpConfigMixin`]).

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
            How a statistics pass computes `p` and `H`: `"model_head"` (the whole model, its own LM head included,
            through TRL's fused head), `"torch"` (our chunked op), `"liger"` (Liger's fused linear cross-entropy) or
            `"auto"`. `"trl"`, the earlier name of `"model_head"`, still works with a FutureWarning.

        > Your own token rules

        token_rules (`list[str]`, *optional*, defaults to `[]`):
            Names of rules registered with `stapo_trl.token_rules.register_token_rule`, applied in this order after
            S2T and STARE.
        token_rule_kwargs (`dict` or `str`, *optional*):
            Keyword arguments per rule name, for example `{"my_rule": {"alpha": 0.5}}` (a JSON string on the command
            line).

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
            "help": "How a statistics pass computes log p and entropy without [N, V] logits. 'model_head': the whole "
            "model, its own LM head included, through TRL's fused head (supports every model TRL supports). 'torch': "
            "the backbone, then our chunked torch op on the completion positions only. 'liger': the backbone, then "
            "Liger's fused linear cross-entropy (needs `pip install 'stapo-trl[liger]'`). 'auto': 'liger' on CUDA "
            "when installed, otherwise 'torch', and 'model_head' for models the direct ops do not cover "
            "(vision-language, logit soft-capping or scaling) and under FSDP or DeepSpeed ZeRO-3. 'trl', the earlier "
            "name of 'model_head', still works with a FutureWarning.",
            "choices": list(TOKEN_STATS_BACKENDS),
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
            defaults = type(self).__dataclass_fields__
            changed = [
                name
                for name in ("prob_threshold", "entropy_quantile")
                if getattr(self, name) != defaults[name].default
            ]
            if changed:
                raise ValueError(
                    f"{', '.join(changed)} set, but use_s2t_mask=False, so they would be ignored. Set "
                    "use_s2t_mask=True (or method: stapo), or remove them."
                )
        if self.token_stats_source not in TOKEN_STATS_SOURCES:
            raise ValueError(
                f"token_stats_source must be one of {TOKEN_STATS_SOURCES}, got {self.token_stats_source!r}."
            )
        if self.token_stats_backend in RETIRED_TOKEN_STATS_BACKENDS:
            current = RETIRED_TOKEN_STATS_BACKENDS[self.token_stats_backend]
            warnings.warn(
                f"token_stats_backend={self.token_stats_backend!r} is now called {current!r}; the old name will be "
                "removed.",
                FutureWarning,
                stacklevel=3,
            )
            self.token_stats_backend = current
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
        self.validate_stare_fields()
        self._validate_token_rules()
        self.validate_dump_fields()
        if self.dump_silenced_tokens and not self.active_token_rules:
            # A warning, not an error: one recipe serves every method (`--method grpo` on the quickstart, which dumps).
            warnings.warn(
                "dump_silenced_tokens=True has nothing to record in this run: with use_s2t_mask=False, "
                "use_stare=False and no token_rules, no token is silenced and no token statistics are computed, so no "
                "dump is written. `stapo-trl report` still plots the run's logged metrics.",
                UserWarning,
                stacklevel=3,
            )

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
