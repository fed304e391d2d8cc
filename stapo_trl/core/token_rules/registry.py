"""The token-rule registry: each rule is one self-describing spec, registered by name and applied in order.

A rule decides, for one optimizer step's completion tokens, which tokens feed the policy gradient and with what
weight. Its pure tensor function is called as ``rule(log_probs, entropies, advantages, loss_mask, **params)`` with
``[B, T]`` tensors (``advantages`` may be ``[B]``) and returns a :class:`TokenRuleResult`:

- ``keep``: a bool ``[B, T]`` mask. Dropped tokens leave the loss *and its denominator*: the loss is renormalized
  over the kept tokens (S2T). By convention a rule that drops tokens logs ``num_silenced`` and ``silenced_fraction``.
- ``weights``: a non-negative float ``[B, T]`` tensor that multiplies each token's advantage, so the token's
  policy-gradient term, without changing the denominator (STARE's token-mean "not divided by the weights").
- ``stats``: plain numbers to log, under ``<rule name>/<key>``.

A :class:`TokenRuleSpec` wraps that function with all the rest of stapo-trl needs to know about the rule (see its
attributes; docs/semantics.md, "A rule with its own switch, fields and controller", says how the rest of the package
reads them).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import torch

from ..names import rule_metric


@dataclass(frozen=True)
class TokenRuleResult:
    """What one token rule decided. Either tensor may be None: the rule then keeps every token, or weights it 1."""

    keep: torch.Tensor | None = None
    weights: torch.Tensor | None = None
    stats: dict[str, float | int] = field(default_factory=dict)


@dataclass(frozen=True)
class StepTokens:
    """One optimizer step's tokens as the token rules see them, its micro-batches' rows concatenated: log p, entropy
    (nats), the advantages before any rule weights them (``[B]`` or ``[B, T]``) and the loss mask before the rules;
    with the completion ids, the tokens the applied rules silenced and those the shadow rules would have, where
    known."""

    log_probs: torch.Tensor
    entropies: torch.Tensor
    advantages: torch.Tensor
    loss_mask: torch.Tensor
    completion_ids: torch.Tensor | None = None
    silenced: torch.Tensor | None = None
    shadow_silenced: torch.Tensor | None = None

    @property
    def positive(self) -> torch.Tensor:
        """The loss tokens of positive-advantage responses."""
        valid = self.loss_mask.bool()
        return valid & (per_token_advantages(self.advantages.detach(), valid) > 0)


TokenRule = Callable[..., TokenRuleResult]
"""``rule(log_probs, entropies, advantages, loss_mask, **params) -> TokenRuleResult``."""


@dataclass(frozen=True)
class StepContext:
    """What a rule's parameter builder may read about the optimizer step it is called for."""

    micro_batch_sizes: tuple[int, ...]
    """Completions in each of the step's micro-batches on this process, in order."""
    global_step: int
    """Optimizer steps completed before this one."""
    seed: int
    """The run's seed."""
    process_index: int = 0
    device: torch.device | str = "cpu"


class RuleController(Protocol):
    """State a rule keeps across steps (STARE's gate and weights). Training state: saved with every checkpoint."""

    def update(self, batch_entropy: float) -> None:
        """Called once per training generation with the batch's mean loss-token entropy under the generating policy."""

    def metrics(self) -> dict[str, float]:
        """Statistics to log each optimizer step, under ``<rule>/<key>``."""

    def save_to(self, directory: str) -> None: ...

    def restore_from(self, checkpoint: str) -> None: ...


@dataclass(frozen=True)
class RuleMethod:
    """A training method as a ``method:`` preset of `stapo-trl train`: its name, title, one-line summary and the config
    values it sets. A rule that is a method declares one in its spec (the preset then switches the rule on, every
    other rule off, and adds ``defaults``); `stapo_trl.methods` lists the presets without a rule."""

    name: str
    title: str
    summary: str
    defaults: Mapping[str, Any] = field(default_factory=dict)


SUM, MEAN, MEDIAN, LAST, STEPS_ABOVE_ZERO = "sum", "mean", "median", "last", "steps above zero"
SUMMARY_KINDS = (SUM, MEAN, MEDIAN, LAST, STEPS_ABOVE_ZERO)
"""How a statistic is summarised over a run from its finite logged values (a sum is a whole number)."""


@dataclass(frozen=True)
class RuleMetric:
    """A statistic a rule logs at every optimizer step, as ``<rule>/<statistic>``: its meaning and unit (the docs'
    metric glossary, which a test keeps equal) and ``summaries``, ``(key, kind)`` pairs: the run summary holds under
    ``key`` the ``kind`` (`SUMMARY_KINDS`) of the statistic over the run. The report reads ``silenced_fraction``,
    ``silenced_tokens``, ``candidates`` and ``threshold_median`` when a rule has them (the threshold's meaning opens
    with its symbol, ``"tau_h: ..."``, which titles its panel)."""

    statistic: str
    meaning: str
    unit: str
    summaries: tuple[tuple[str, str], ...] = ()

    def __post_init__(self):
        for key, kind in self.summaries:
            if kind not in SUMMARY_KINDS:
                raise ValueError(f"{self.statistic}: summary {key!r} is {kind!r}, not one of {SUMMARY_KINDS}.")


@dataclass(frozen=True)
class RuleSetting:
    """A row of the model card's settings table: a config field the rule reads, and what it means. With ``when``
    (``(field, value)``), the row is shown only in runs whose config has that value."""

    field: str
    meaning: str
    when: tuple[str, Any] | None = None

    def applies(self, config: Any) -> bool:
        return self.when is None or getattr(config, self.when[0], None) == self.when[1]


@dataclass(frozen=True)
class RulePresentation:
    """How the console, the report, the model card and ``train -h`` show a rule. The wordings are `str.format`
    templates over a logged step's statistics (``step``) or the run summary (``summary``, ``card``; with ``steps``);
    a template whose fields are not all finite numbers is left out. ``d`` truncates a float count and ``on/off``
    says "on" from 0.5 up."""

    step: tuple[str, ...] = ()
    """Parts of the console line of one logged step."""
    summary_label: str = ""
    summary: str = ""
    """The end-of-run summary of `stapo-trl train` (``"<summary_label>: <summary>"``) and of `stapo-trl report`."""
    card: tuple[str | tuple[str, ...], ...] = ()
    """Bullets of the model card's statistics; a tuple holds alternatives, of which the first that fills is shown."""
    settings: tuple[RuleSetting, ...] = ()
    """Rows of the model card's settings table."""
    help_title: str | None = None
    help_options: tuple[tuple[str, str], ...] = ()
    """Its group in ``stapo-trl train -h``: ``(field, one-line help)`` pairs."""


class TokenRuleSpec:
    """One token rule and everything stapo-trl needs to know about it: subclass it, set the class attributes and
    override what does not fit (:mod:`stapo_trl.core.token_rules.s2t_rule` is a complete example).

    ``name`` (metrics are ``<name>/<statistic>``), ``title``, ``switch`` (the config field that turns it on, or None
    for a rule listed in ``token_rules``), ``config_mixin`` (fields `STAPOConfig` inherits), ``order`` (rules apply in
    increasing order), ``method`` (its ``method:`` preset), ``reads_fields`` (other rules' fields it reads),
    ``needs_generation_statistics`` (its controller reads the generating policy's entropy), ``metrics`` and
    ``presentation``.
    """

    name: ClassVar[str] = ""
    title: ClassVar[str] = ""
    switch: ClassVar[str | None] = None
    config_mixin: ClassVar[type | None] = None
    order: ClassVar[int] = 1000
    method: ClassVar[RuleMethod | None] = None
    reads_fields: ClassVar[tuple[str, ...]] = ()
    needs_generation_statistics: ClassVar[bool] = False
    metrics: ClassVar[tuple[RuleMetric, ...]] = ()
    presentation: ClassVar[RulePresentation] = RulePresentation()

    # --- the rule itself
    def __call__(
        self, log_probs: torch.Tensor, entropies: torch.Tensor, advantages: torch.Tensor, loss_mask: torch.Tensor, **p
    ) -> TokenRuleResult:
        raise NotImplementedError

    def metric(self, statistic: str) -> str:
        return rule_metric(self.name, statistic)

    @property
    def display_name(self) -> str:
        return self.title or self.name

    # --- configuration
    @property
    def fields(self) -> tuple[str, ...]:
        """The config fields this rule owns (its mixin's)."""
        if self.config_mixin is None:
            return ()
        return tuple(item.name for item in dataclasses.fields(self.config_mixin))

    def is_on(self, config: Any) -> bool:
        """Whether the rule is applied in a run with ``config``."""
        if self.switch is not None:
            return bool(getattr(config, self.switch, False))
        return self.name in (getattr(config, "token_rules", None) or [])

    def validate(self, config: Any, used: bool) -> None:
        """Check this rule's fields of ``config``; ``used`` says whether the rule runs (applied or in shadow).
        Raise a ValueError that says what to change."""

    def params(self, config: Any, step: StepContext, controller: RuleController | None) -> dict[str, Any]:
        """The keyword arguments of the rule function for one optimizer step."""
        return dict((getattr(config, "token_rule_kwargs", None) or {}).get(self.name, {}))

    def make_controller(self, config: Any) -> RuleController | None:
        return None

    def probability_bound(self, config: Any) -> float | None:
        """The probability below which the rule silences positive-advantage tokens (S2T's ``tau_p``), or None."""
        return None

    def describe(self, config: Any) -> str:
        """One line for the model card, the dry-run plan and the method description."""
        return f"{self.name} (registered rule)"


class FunctionRuleSpec(TokenRuleSpec):
    """The spec of a plain rule function registered with :func:`register_token_rule`: listed by name in the
    config's ``token_rules``, with keyword arguments from ``token_rule_kwargs``."""

    def __init__(self, name: str, function: TokenRule):
        self.name = name
        self.function = function

    def __call__(self, log_probs, entropies, advantages, loss_mask, **params) -> TokenRuleResult:
        return self.function(log_probs, entropies, advantages, loss_mask, **params)

    def __repr__(self) -> str:
        return f"FunctionRuleSpec({self.name!r}, {self.function!r})"


TOKEN_RULES: dict[str, TokenRuleSpec] = {}
"""Every registered rule's spec, by name."""


def register_token_rule_spec(spec: TokenRuleSpec) -> TokenRuleSpec:
    """Register a rule spec under ``spec.name``. Names are unique; registering another spec under a taken name is an
    error."""
    if not spec.name:
        raise ValueError(f"{type(spec).__name__} has no name.")
    existing = TOKEN_RULES.get(spec.name)
    same_class = existing is not None and _class_path(existing) == _class_path(spec)
    if existing is not None and existing is not spec and not same_class:
        raise ValueError(f"A token rule named {spec.name!r} is already registered ({existing!r}).")
    TOKEN_RULES[spec.name] = spec
    return spec


def _class_path(spec: TokenRuleSpec) -> tuple[str, str]:
    return type(spec).__module__, type(spec).__qualname__


def register_token_rule(name: str) -> Callable[[TokenRule], TokenRule]:
    """Register a plain rule function under ``name``, as a decorator (see :class:`FunctionRuleSpec`)."""

    def register(rule: TokenRule) -> TokenRule:
        existing = TOKEN_RULES.get(name)
        if existing is not None and getattr(existing, "function", None) is not rule:
            raise ValueError(f"A token rule named {name!r} is already registered ({existing!r}).")
        TOKEN_RULES[name] = FunctionRuleSpec(name, rule)
        return rule

    return register


def get_token_rule(name: str) -> TokenRuleSpec:
    """The spec registered under ``name``; it is callable as the rule function."""
    if name not in TOKEN_RULES:
        raise KeyError(
            f"No token rule named {name!r}. Registered rules: {', '.join(sorted(TOKEN_RULES))}. Register yours with "
            "@stapo_trl.core.token_rules.register_token_rule(name) before creating the config."
        )
    return TOKEN_RULES[name]


def registered_rules() -> list[TokenRuleSpec]:
    """Every registered rule, in the order rules apply."""
    return sorted(TOKEN_RULES.values(), key=lambda spec: spec.order)


def switched_rules() -> list[TokenRuleSpec]:
    """The rules with a config switch (the built-in ones), in the order they apply."""
    return sorted((spec for spec in TOKEN_RULES.values() if spec.switch is not None), key=lambda spec: spec.order)


def active_rule_names(config: Any) -> list[str]:
    """The rules a run with ``config`` applies, in order: switched-on rules by ``order``, then ``token_rules``."""
    return [spec.name for spec in switched_rules() if spec.is_on(config)] + list(
        getattr(config, "token_rules", None) or []
    )


def shadow_rule_names(config: Any) -> list[str]:
    """The rules a run with ``config`` computes and logs without applying (``shadow_token_rules``), in apply order."""
    shadowed = set(getattr(config, "shadow_token_rules", None) or [])
    ordered = [spec.name for spec in switched_rules() if spec.name in shadowed]
    return ordered + [name for name in getattr(config, "shadow_token_rules", None) or [] if name not in ordered]


def changed_fields(config: Any, mixin: type) -> list[str]:
    """The fields of the dataclass ``mixin`` whose value in ``config`` differs from their default."""
    return [
        item.name
        for item in dataclasses.fields(mixin)
        if getattr(config, item.name)
        != (item.default_factory() if item.default_factory is not dataclasses.MISSING else item.default)
    ]


def rule_config_mixins() -> tuple[type, ...]:
    """The config mixins of the registered rules, in apply order (`STAPOConfig` inherits them all)."""
    return tuple(spec.config_mixin for spec in switched_rules() if spec.config_mixin is not None)


def working_dtype(tensor: torch.Tensor) -> torch.dtype:
    """At least float32: statistics of bf16 tensors are computed in float32."""
    return torch.promote_types(tensor.dtype, torch.float32)


def per_token_advantages(advantages: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Per-sequence ``[B]`` advantages broadcast to the ``[B, T]`` shape of ``like`` (a view); ``[B, T]`` ones as
    given. ``loss_mask & (per_token_advantages(advantages, loss_mask) > 0)`` is the positive-advantage loss tokens."""
    return advantages.unsqueeze(1).expand_as(like) if advantages.dim() == 1 else advantages


def validate_token_inputs(log_probs, entropies, advantages, loss_mask) -> None:
    """Raise a ValueError that names the tensor whose shape does not fit ``log_probs`` ``[B, T]``."""
    if log_probs.dim() != 2:
        raise ValueError(f"log_probs must be [B, T], got shape {tuple(log_probs.shape)}.")
    for name, tensor in (("entropies", entropies), ("loss_mask", loss_mask)):
        if tensor.shape != log_probs.shape:
            raise ValueError(
                f"{name} must have the shape of log_probs {tuple(log_probs.shape)}, got {tuple(tensor.shape)}."
            )
    if advantages.shape not in (log_probs.shape[:1], log_probs.shape):
        raise ValueError(
            f"advantages must be [B] or [B, T] with B, T = {tuple(log_probs.shape)}, got {tuple(advantages.shape)}."
        )


def _checked(name: str, result: TokenRuleResult, shape: torch.Size) -> TokenRuleResult:
    if not isinstance(result, TokenRuleResult):
        raise TypeError(f"Token rule {name!r} must return a TokenRuleResult, got {type(result).__name__}.")
    for what, tensor in (("keep", result.keep), ("weights", result.weights)):
        if tensor is not None and tensor.shape != shape:
            raise ValueError(f"Token rule {name!r} returned {what} of shape {tuple(tensor.shape)}, expected {shape}.")
    if result.keep is not None and result.keep.dtype != torch.bool:
        raise TypeError(f"Token rule {name!r} returned keep of dtype {result.keep.dtype}; it must be torch.bool.")
    if result.weights is not None and not (torch.isfinite(result.weights).all() and (result.weights >= 0).all()):
        raise ValueError(
            f"Token rule {name!r} returned weights that are negative or not finite. Weights multiply the advantage, "
            "and only a non-negative weight scales the clipped surrogate without changing which side of the clip "
            "applies."
        )
    return result


@dataclass(frozen=True)
class RuleCall:
    """One rule to apply in one optimizer step: its name, its keyword arguments, and whether it runs in shadow."""

    name: str
    params: Mapping[str, Any] = field(default_factory=dict)
    shadow: bool = False


@dataclass(frozen=True)
class ComposedTokenRules:
    """The outcome of several rules: the kept tokens, the product of the weights, each rule's statistics, and the
    tokens each shadow rule would have dropped."""

    keep: torch.Tensor
    weights: torch.Tensor | None
    stats: dict[str, dict[str, float | int]]
    shadow_stats: dict[str, dict[str, float | int]] = field(default_factory=dict)
    shadow_silenced: dict[str, torch.Tensor] = field(default_factory=dict)


def apply_token_rules(
    rules: Sequence[RuleCall | tuple[str, Mapping[str, Any]]],
    log_probs: torch.Tensor,
    entropies: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
) -> ComposedTokenRules:
    """Apply rules in order, each on the loss mask the applied rules before it narrowed: ``keep`` drops their tokens,
    ``weights`` is the product of their weights (None without any). A shadow rule (``RuleCall(..., shadow=True)``) is
    computed on the same mask and only reported (``shadow_stats``, ``shadow_silenced``). Under ``torch.distributed``
    call it on every rank with the same rules.
    """
    validate_token_inputs(log_probs, entropies, advantages, loss_mask)
    keep = loss_mask.bool()
    weights = None
    stats, shadow_stats, shadow_silenced = {}, {}, {}
    for call in rules:
        if not isinstance(call, RuleCall):
            call = RuleCall(*call)
        result = _checked(
            call.name, get_token_rule(call.name)(log_probs, entropies, advantages, keep, **call.params), keep.shape
        )
        if call.shadow:
            shadow_stats[call.name] = dict(result.stats)
            shadow_silenced[call.name] = torch.zeros_like(keep) if result.keep is None else keep & ~result.keep
            continue
        if result.keep is not None:
            keep = keep & result.keep
        if result.weights is not None:
            weights = result.weights if weights is None else weights * result.weights
        stats[call.name] = dict(result.stats)
    return ComposedTokenRules(keep, weights, stats, shadow_stats, shadow_silenced)
