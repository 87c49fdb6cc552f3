"""CLI: `seed` (train or reuse a task's seed model) and `eval` (WER/CER of a checkpoint)."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.table import Table

from pflbench.cli.common import (
    DeviceOption,
    JsonOption,
    NprocOption,
    SpecsOption,
    check_device,
    console,
    extra_spec_dirs,
    print_json,
    processes,
    relaunch_under_torchrun,
)
from pflbench.errors import UserError

DataRootOption = typer.Option(
    None, "--data-root", help="Folder holding the corpora (also PFLBENCH_DATA)."
)
CacheOption = typer.Option(None, "--cache-dir", help="Feature and seed-model cache.")


def results_table(title: str, results: dict[str, dict]) -> Table:
    table = Table(title=title)
    for col in (
        "eval set",
        "utts",
        "speakers",
        "WER %",
        "CER %",
        "spk WER % mean ± std",
        "median",
        "p90",
    ):
        table.add_column(col, justify="left" if col == "eval set" else "right")

    def pct(x: float | None) -> str:
        return "–" if x is None else f"{100 * x:.1f}"

    for name, r in results.items():
        row = [name, str(r["num_utterances"]), str(r["num_speakers"]), pct(r["wer"]), pct(r["cer"])]
        row += [f"{pct(r['speaker_wer_mean'])} ± {pct(r['speaker_wer_std'])}"]
        table.add_row(*row, pct(r["speaker_wer_p50"]), pct(r["speaker_wer_p90"]))
    return table


def register(app: typer.Typer) -> None:
    @app.command("seed")
    def seed(
        task: str = typer.Option(..., "--task", help="Task name (see `pflbench tasks`)."),
        device: str = DeviceOption,
        sets: list[str] = typer.Option(None, "--set", help="Recipe override key.path=value."),
        seed: int = typer.Option(0, "--seed", help="Run seed."),
        specs: list[Path] = SpecsOption,
        data_root: Path = DataRootOption,
        cache_dir: Path = CacheOption,
        as_json: bool = JsonOption,
        nproc: int = NprocOption,
    ) -> None:
        """Train the task's seed model on its central data (or reuse the cached one), then print
        its WER/CER on the task's eval sets. With --nproc N (or under torchrun) the N processes
        share every batch; rank 0 prepares the data, writes the checkpoints and evaluates."""
        from pflbench.spec.registry import load_registry
        from pflbench.spec.resolve import resolve

        device = check_device(device, processes=processes(nproc))
        cfg = resolve(load_registry(extra_spec_dirs(specs)), task, "fedavg", "none", seed, sets)
        if cfg.task.seed_data is None:
            console.print(f"task {task!r} has no seed model: it trains from scratch")
            return
        relaunch_under_torchrun(nproc)

        from pflbench.central import seed_model, set_cpu_threads
        from pflbench.data.prepare import cache_dir_default, prepare_task
        from pflbench.evaluate import evaluate_sets
        from pflbench.fl.distributed import barrier, init_from_env, shutdown

        set_cpu_threads()
        ctx = init_from_env(device)
        cache = cache_dir or cache_dir_default()
        show = not as_json and ctx.is_main
        data = None
        for turn in ("main", "others"):  # rank 0 builds the feature caches, the others read them
            if (turn == "main") == ctx.is_main:
                data = prepare_task(cfg.task, data_root=data_root, cache_dir=cache, progress=show)
            barrier(ctx)
        model, path = seed_model(
            cfg.task,
            cfg.recipe,
            data,
            seed=seed,
            device=device,
            cache_dir=cache,
            progress=show,
            ctx=ctx,
        )
        shutdown()
        if not ctx.is_main:
            return
        results = evaluate_sets(model, data.eval_sets, data.tokenizer, device=device)
        if as_json:
            print_json({"task": task, "checkpoint": str(path), "eval": results})
            return
        console.print(f"seed checkpoint: {path}")
        console.print(results_table(f"seed model of {task}", results))

    @app.command("eval")
    def eval_checkpoint(
        task: str = typer.Option(..., "--task", help="Task whose eval sets to score."),
        checkpoint: Path = typer.Option(..., "--checkpoint", help="A .safetensors checkpoint."),
        device: str = DeviceOption,
        specs: list[Path] = SpecsOption,
        data_root: Path = DataRootOption,
        cache_dir: Path = CacheOption,
        as_json: bool = JsonOption,
    ) -> None:
        """WER and CER per eval set (pooled) and the per-speaker WER distribution."""
        from pflbench.central import set_cpu_threads
        from pflbench.checkpoint import load_model
        from pflbench.data.prepare import prepare_task
        from pflbench.evaluate import evaluate_sets
        from pflbench.spec.registry import load_registry

        device = check_device(device)
        spec = load_registry(extra_spec_dirs(specs)).task(task).spec
        set_cpu_threads()
        model, meta = load_model(checkpoint, device)
        data = prepare_task(spec, data_root=data_root, cache_dir=cache_dir, progress=not as_json)
        vocab = meta.get("vocab")
        if model.vocab_size != data.tokenizer.size or (vocab and vocab != data.tokenizer.vocab):
            raise UserError(
                f"checkpoint {checkpoint}: its vocabulary ({model.vocab_size} tokens) is not the "
                f"token set of task {task!r} ({data.tokenizer.size} tokens, {spec.language})"
            )
        results = evaluate_sets(model, data.eval_sets, data.tokenizer, device=device)
        if as_json:
            print_json({"task": task, "checkpoint": str(checkpoint), "eval": results})
            return
        console.print(results_table(f"{checkpoint} on {task}", results))
