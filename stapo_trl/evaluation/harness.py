"""`evaluate`: sample, grade and score a model on the paper's benchmarks, resumably, for example
`evaluate(EvalConfig(model="runs/stapo-1.7b", benchmarks=["aime24"])).table`. transformers is imported where a
tokenizer is loaded: importing the evaluation package loads none."""

from __future__ import annotations

import importlib.util
import itertools
import json
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from ..data.benchmarks import BENCHMARKS, load_benchmark
from ..data.sources import SAMPLE
from ..file_and_metric_names import EVAL_SUMMARY_FILE
from ..storage import write_text_atomically
from .backends import (
    BackendSpec,
    DataParallelBackend,
    GenerationBackend,
    GenerationRequest,
    SamplingParameters,
    build_backend,
    require_vllm,
)
from .config import EvalConfig, EvalConfigError
from .greedy import render_prompt
from .models import ModelNotFoundError, ResolvedModel, resolve_model
from .paper_results import FULL_SIZES
from .records import SampleStore
from .results_table import markdown_table, plot_results, summary_rows
from .scoring import Grader, score_benchmark

TABLE_FILE = "results.md"
CHART_FILE = "results.png"
DEFAULT_BATCH_SIZE = {"transformers": 16, "vllm": 4096}


@dataclass
class Problem:
    benchmark: str
    problem_id: str
    answer: str
    prompt_token_ids: tuple[int, ...]


@dataclass
class EvalResult:
    summary: dict[str, Any]
    table: str
    output_dir: Path

    @property
    def files(self) -> dict[str, Path]:
        files = {"summary": self.output_dir / EVAL_SUMMARY_FILE, "table": self.output_dir / TABLE_FILE}
        if (self.output_dir / CHART_FILE).is_file():
            files["chart"] = self.output_dir / CHART_FILE
        for setting in self.summary["settings"]:
            files[f"samples ({setting['name']})"] = Path(setting["samples_file"])
        return files


def choose_backend(config: EvalConfig) -> str:
    """`config.backend`, with `auto` meaning vllm when it is installed and a GPU is visible, else transformers."""
    if config.backend != "auto":
        if config.backend == "vllm":
            require_vllm()
        return config.backend
    return "vllm" if torch.cuda.is_available() and importlib.util.find_spec("vllm") is not None else "transformers"


def load_tokenizer(model: ResolvedModel, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model.tokenizer, trust_remote_code=trust_remote_code)
    except OSError as error:
        raise ModelNotFoundError(
            f"Could not load {model.tokenizer!r}: it is not a local directory, and loading it from the Hugging Face "
            f"Hub failed ({str(error).splitlines()[0]}). Check the name, or pass a local checkpoint directory."
        ) from error


def load_problems(config: EvalConfig, tokenizer) -> dict[str, list[Problem]]:
    if config.chat_template and not getattr(tokenizer, "chat_template", None):
        raise EvalConfigError(
            "The tokenizer has no chat template. Evaluate with --no_chat_template to prompt with plain text, or "
            "use a tokenizer that has one (training formats prompts with the chat template)."
        )
    problems = {}
    prompting = {"prompt_style": config.prompt_style, "system_prompt": config.system_prompt}
    for name in config.benchmarks:
        dataset = load_benchmark(name, config.source_for(name), split=config.split_overrides.get(name), **prompting)
        if config.max_problems is not None and len(dataset) > config.max_problems:
            dataset = dataset.select(range(config.max_problems))
        rows: dict[str, Problem] = {}
        for row in dataset:
            if row["id"] in rows:
                raise EvalConfigError(f"{name}: problem id {row['id']!r} appears twice; ids must be unique to resume.")
            prompt = render_prompt(tokenizer, row["prompt"], config.chat_template)
            rows[row["id"]] = Problem(name, row["id"], row["answer"], prompt)
        problems[name] = list(rows.values())
    return problems


def _settings_fingerprint(config: EvalConfig, model: ResolvedModel, temperature: float, top_p: float) -> dict:
    """The settings that shape the samples, which a resumed run must share."""
    shaping = ("max_new_tokens", "prompt_style", "system_prompt", "chat_template", "graders", "seed")
    settings = {key: getattr(config, key) for key in shaping} | {"temperature": temperature, "top_p": top_p}
    settings |= {"model": model.reference, "weights": model.weights, "adapter": model.adapter}
    return settings | {"sources": {name: config.source_for(name) for name in config.benchmarks}}


def _pending_requests(problems: dict, config: EvalConfig, store: SampleStore, chunk: int) -> list[list[tuple]]:
    """The missing samples as chunks of (Problem, GenerationRequest) pairs, at most `chunk` samples per chunk."""
    missing = [
        (problem, index)
        for name, rows in problems.items()
        for problem in rows
        for index in range(config.samples_for(name))
        if (name, problem.problem_id, index) not in store
    ]
    chunks = []
    for start in range(0, len(missing), chunk):
        part = []
        for problem, group in itertools.groupby(missing[start : start + chunk], key=lambda item: item[0]):
            key = f"{problem.benchmark}/{problem.problem_id}"
            part.append((problem, GenerationRequest(key, problem.prompt_token_ids, tuple(i for _, i in group))))
        chunks.append(part)
    return chunks


def _generate_and_grade(generator: GenerationBackend, part: list, sampling, grader: Grader, backend_name: str) -> list:
    """Generate one chunk of samples and grade them: the records to append to the results file."""
    generations = generator.generate([request for _, request in part], sampling)
    records = []
    for (problem, request), outputs in zip(part, generations, strict=True):
        if len(outputs) != len(request.sample_indices):
            raise RuntimeError(
                f"The {backend_name} backend returned {len(outputs)} samples for {request.key}, "
                f"expected {len(request.sample_indices)}."
            )
        grades = grader.grade([output.text for output in outputs], [problem.answer] * len(outputs))
        for index, output, grade in zip(request.sample_indices, outputs, grades, strict=True):
            record = {"benchmark": problem.benchmark, "problem_id": problem.problem_id, "sample": index}
            record |= {"answer": problem.answer, "completion": output.text, "num_tokens": output.num_tokens}
            record |= {"finish_reason": output.finish_reason, "grades": grade.scores, "extracted": grade.extracted}
            records.append(record | {"correct": grade.correct, "backend": backend_name})
    return records


def _score_setting(config: EvalConfig, store: SampleStore, problems: dict) -> dict[str, Any]:
    """The summary's ``benchmarks`` (each one's score) and ``average`` (their mean avg@k) of one setting."""
    scores = {}
    for name in config.benchmarks:
        wanted, k = {problem.problem_id for problem in problems[name]}, config.samples_for(name)
        records = [
            record for record in store.for_benchmark(name) if record["problem_id"] in wanted and record["sample"] < k
        ]
        if not records:
            continue
        score = score_benchmark(name, records, graders=config.graders, expected_samples=len(wanted) * k)
        # Partial: fewer problems than the benchmark has (shipped samples, a subset, or max_problems).
        score.partial = len(problems[name]) < FULL_SIZES[name]
        scores[name] = score.to_dict()
    average = sum(score["avg_at_k"] for score in scores.values()) / len(scores) if scores else None
    return {"benchmarks": scores, "average": average}


def evaluate(config: EvalConfig, *, backend: GenerationBackend | None = None) -> EvalResult:
    """Evaluate `config.model`, resuming from samples already in `config.output_dir`, with `backend` (anything with
    `generate(requests, sampling)`) or one built from the config. The summary and the Markdown table it returns are
    also written to summary.json and results.md."""
    started = time.perf_counter()
    model = resolve_model(config.model, adapter=config.adapter, base_model=config.base_model, label=config.label)
    model = replace(model, method=config.method or model.method, size=config.model_size or model.size)
    output_dir = Path(config.output_dir or Path("evals") / model.label)
    backend_name = backend.name if backend is not None else choose_backend(config)
    tokenizer = load_tokenizer(model, config.trust_remote_code)
    problems = load_problems(config, tokenizer)
    grader = Grader(config.graders)
    chunk = config.batch_size or DEFAULT_BATCH_SIZE.get(backend_name.split()[0], 16)
    chunk *= max(1, config.data_parallel_size)
    expected = sum(len(rows) * config.samples_for(name) for name, rows in problems.items())
    compared = [load_summary(other) for other in config.compare]
    owned_backend, settings_summary = None, []
    try:
        for name, temperature, top_p in config.sampling_settings():
            fingerprint = _settings_fingerprint(config, model, temperature, top_p)
            store = SampleStore(output_dir / f"samples.{name}.jsonl", fingerprint, overwrite=config.overwrite)
            chunks = _pending_requests(problems, config, store, chunk)
            pending = sum(len(request.sample_indices) for part in chunks for _, request in part)
            if pending:
                if backend is None:
                    backend = owned_backend = _build_backend(config, model, backend_name)
                sampling = SamplingParameters(temperature, top_p, config.max_new_tokens, config.seed)
                bar = {"desc": f"{model.label} [{name}]", "unit": "sample", "disable": not config.show_progress}
                with tqdm(total=expected, initial=expected - pending, dynamic_ncols=True, **bar) as progress:
                    progress.set_postfix_str(_problems_done(problems, config, store))
                    for part in chunks:
                        records = _generate_and_grade(backend, part, sampling, grader, backend_name)
                        store.append(records)
                        progress.update(len(records))
                        progress.set_postfix_str(f"{part[-1][0].benchmark}, {_problems_done(problems, config, store)}")
            label = f"T={float(temperature)}, top-p={float(top_p)}"  # as the paper writes its settings
            setting = {"name": name, "label": label, "temperature": temperature, "top_p": top_p}
            setting |= _score_setting(config, store, problems)
            settings_summary.append(setting | {"samples_file": str(store.path), "samples_generated_this_run": pending})
    finally:
        if owned_backend is not None:
            owned_backend.close()

    model_keys = ("label", "reference", "weights", "adapter", "method", "size")
    summary = {"model": {key: getattr(model, key) for key in model_keys}, "settings": settings_summary}
    summary |= {"datasets": {name: _dataset_record(config, name) for name in config.benchmarks}}
    summary |= {key: getattr(config, key) for key in ("max_new_tokens", "prompt_style", "graders")}
    summary |= {"backend": backend_name, "seed": config.seed}
    summary["seconds_this_run"] = round(time.perf_counter() - started, 1)
    unique_rows = {}  # the first row of each (source, model, setting)
    for item in (summary, *compared):
        for row in summary_rows(item, with_paper=config.paper_comparison):
            unique_rows.setdefault((row.source, row.model, row.setting), row)
    rows = list(unique_rows.values())
    table = markdown_table(rows)
    output_dir.mkdir(parents=True, exist_ok=True)
    write_text_atomically(output_dir / EVAL_SUMMARY_FILE, json.dumps(summary, indent=2) + "\n")
    write_text_atomically(output_dir / TABLE_FILE, table)
    if any(row.values for row in rows):
        plot_results(rows, output_dir / CHART_FILE, title="avg@k by benchmark")
    return EvalResult(summary=summary, table=table, output_dir=output_dir)


def _dataset_record(config: EvalConfig, name: str) -> dict[str, Any]:
    """A benchmark's source and split, and whether the source is on the Hub (the card's ``model-index`` needs that)."""
    spec = BENCHMARKS[name]
    source = config.source_for(name)
    on_hub = source is None or (source != SAMPLE and not Path(source).expanduser().exists())
    return {"source": source or spec.hub_id, "split": config.split_overrides.get(name) or spec.split, "hub": on_hub}


def _problems_done(problems: dict[str, list[Problem]], config: EvalConfig, store: SampleStore) -> str:
    """``problems 3/30``: how many problems have all their samples."""
    done = sum(
        all((name, problem.problem_id, i) in store for i in range(config.samples_for(name)))
        for name, rows in problems.items()
        for problem in rows
    )
    return f"problems {done}/{sum(len(rows) for rows in problems.values())}"


def _build_backend(config: EvalConfig, model: ResolvedModel, backend_name: str) -> GenerationBackend:
    same = ("dtype", "trust_remote_code", "device", "tensor_parallel_size", "gpu_memory_utilization", "max_model_len")
    batch_size = config.batch_size or DEFAULT_BATCH_SIZE["transformers"]
    options = {name: getattr(config, name) for name in same}
    spec = BackendSpec(backend_name, model.weights, model.tokenizer, model.adapter, batch_size=batch_size, **options)
    if config.data_parallel_size > 1:
        devices = config.tensor_parallel_size if backend_name == "vllm" else None
        return DataParallelBackend(spec, config.data_parallel_size, devices_per_rank=devices)
    return build_backend(spec)


def load_summary(path: str | Path) -> dict[str, Any]:
    """An evaluation summary, from an eval output directory or its summary.json."""
    path = Path(path).expanduser()
    if path.is_dir():
        path = path / EVAL_SUMMARY_FILE
    if not path.is_file():
        raise FileNotFoundError(f"No evaluation summary at {path}; pass an eval output directory or its summary.json.")
    return json.loads(path.read_text())
