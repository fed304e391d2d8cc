"""`STAPOConfig`: `GRPOConfig` plus the S2T spurious-token mask of STAPO (arXiv 2602.15620)."""

from __future__ import annotations

from dataclasses import dataclass, field

from trl import GRPOConfig

TOKEN_STATS_SOURCES = ("generation", "loss")
TOKEN_STATS_BACKENDS = ("auto", "trl", "torch", "liger")
LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo")
"""The loss aggregations of TRL 1.16's `GRPOTrainer`."""


@dataclass
class STAPOConfig(GRPOConfig):
    r"""
    Configuration class for [`STAPOTrainer`]: every [`~trl.GRPOConfig`] argument, plus the S2T mask.

    Parameters:
        > Parameters of the S2T (silencing spurious tokens) mask

        use_s2t_mask (`bool`, *optional*, defaults to `True`):
            Silence spurious tokens and renormalize the loss over the kept ones. With `False`, training is exactly
            GRPO.
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
            "help": "Loss aggregation, as in `GRPOConfig.loss_type`. STAPO uses 'dapo': token-level, normalized by "
            "the number of kept tokens in the global accumulated batch.",
            "choices": list(LOSS_TYPES),
        },
    )

    use_s2t_mask: bool = field(
        default=True,
        metadata={
            "help": "Silence spurious tokens (S2T) and renormalize the loss over the kept tokens. With `False`, "
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

    def __post_init__(self):
        if self.use_liger_kernel:
            raise ValueError(
                "STAPOConfig does not accept use_liger_kernel=True. In TRL 1.16 that flag is deprecated, only patches "
                "the norm, RoPE and MLP layers with Triton kernels (it fails on CPU at the first forward), and does "
                "not give STAPO its fused log-prob/entropy. For Liger's fused linear cross-entropy with entropy "
                "output, set use_liger_kernel=False and token_stats_backend='liger' (or 'auto', which picks Liger on "
                "CUDA when it is installed). For Hub layer kernels use model_init_kwargs={'use_kernels': True}."
            )
        super().__post_init__()

        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {self.loss_type!r}. STAPO uses 'dapo'.")

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
        if not self.use_s2t_mask:
            return
        if self.top_entropy_quantile < 1.0:
            raise ValueError(
                f"use_s2t_mask=True conflicts with top_entropy_quantile={self.top_entropy_quantile}: both select "
                "tokens by entropy, in opposite directions (20-Entropy keeps only the highest-entropy tokens without "
                "renormalizing; S2T silences the lowest-entropy low-probability positive tokens). Run one method: "
                "set top_entropy_quantile=1.0 for STAPO, or use_s2t_mask=False for 20-Entropy."
            )
        steps, accumulation = self.steps_per_generation, self.gradient_accumulation_steps
        if steps % accumulation != 0:
            raise ValueError(
                f"With use_s2t_mask=True, steps_per_generation ({steps}) must be a multiple of "
                f"gradient_accumulation_steps ({accumulation}): the S2T entropy pool is every token of an optimizer "
                "step, so all of a step's micro-batches must come from one generation batch. Raise "
                "steps_per_generation (or generation_batch_size), or lower gradient_accumulation_steps."
            )
