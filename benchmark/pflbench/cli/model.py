"""CLI: `seed` (train or reuse a task's seed model), `eval` (WER/CER of a checkpoint) and `verify`
(re-evaluate a finished run's final model)."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.table import Table

from pflbench.cli.common import (
    DeviceOption,
    JsonOption,
    NprocOption,
    PluginOption,
    SpecsOption,
    check_device,
    console,
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


def shipped_lines(check: dict, shipped_now: bool) -> list[str]:
    """What `pflbench seed` says of its model against the shipped one (compare_with_shipped)."""
    digest, shipped = check["digest"], check["shipped"]
    lines = [f"its weights' digest: {digest}"]
    if shipped_now:
        before = check.get("shipped_digest")
        replaced = f", replacing {before}" if before and before != digest else ""
        return [*lines, f"shipped as {shipped}{replaced}: runs start from it (commit it)"]
    if check["matches"] is None:
        return [
            *lines,
            f"no seed model is shipped for this task and recipe (it would be {shipped}): runs "
            "train and cache their own, as this one; `pflbench seed --ship` ships it",
        ]
    if check["matches"]:
        shipped_ok = f"matches the seed model shipped with the task ({shipped})"
        return [*lines, f"{shipped_ok}, which runs start from"]
    same = {True: "same", False: "different", None: "unknown"}
    lines += [
        f"DIFFERS from the seed model shipped with the task ({shipped}: "
        f"{check['shipped_digest']}), which runs start from",
        f"seed data: {same[check['same_seed_data_digest']]} digest, "
        f"{same[check['same_seed_data_audio_digest']]} audio digest; where the trainings "
        "differ (shipped / here):",
    ]
    differ = check["numerics_differ"].items()
    lines += [f"  {key}: {there} / {here}" for key, (there, here) in differ]
    return lines


def register(app: typer.Typer) -> None:
    @app.command("seed")
    def seed(
        task: str = typer.Option(..., "--task", help="Task name (see `pflbench tasks list`)."),
        device: str = DeviceOption,
        sets: list[str] = typer.Option(
            None,
            "--set",
            metavar="KEY.PATH=VALUE",
            help="Recipe override key.path=value (repeatable).",
        ),
        seed: int = typer.Option(0, "--seed", help="Run seed."),
        specs: list[Path] = SpecsOption,
        data_root: Path = DataRootOption,
        cache_dir: Path = CacheOption,
        ship: bool = typer.Option(
            False,
            "--ship",
            help="Ship the trained seed model with the task (tasks/seed-models/, replacing one "
            "shipped before): runs then start from it on every machine.",
        ),
        plugins: list[str] = PluginOption,
        as_json: bool = JsonOption,
        nproc: int = NprocOption,
    ) -> None:
        """Train the task's seed model on this machine (or reuse the one cached), print its
        WER/CER on the task's eval sets, and say whether its weights are those of the seed model
        shipped with the task, which runs start from. With --nproc N (or under torchrun) the N
        processes share every batch; rank 0 prepares the data, writes the checkpoints and
        evaluates."""
        from pflbench.cli.common import load_specs
        from pflbench.spec.resolve import resolve

        device = check_device(device, processes=processes(nproc))
        cfg = resolve(load_specs(specs, plugins), task, "fedavg", "none", seed, sets)
        if cfg.task.seed_data is None:
            console.print(f"task {task!r} has no seed model: it trains from scratch")
            return
        relaunch_under_torchrun(nproc)

        from pflbench.central import (
            compare_with_shipped,
            seed_model,
            set_cpu_threads,
            ship_seed_model,
            shipped_seed_dir,
            shipped_seed_path,
        )
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
        shipped = shipped_seed_path(
            cfg.task, cfg.recipe, seed, data.tokenizer.vocab, shipped_seed_dir()
        )
        check = compare_with_shipped(path, shipped)
        if ship:
            ship_seed_model(path, shipped)
        results = evaluate_sets(model, data.eval_sets, data.tokenizer, device=device)
        if as_json:
            print_json({"task": task, "checkpoint": str(path), "shipped": check, "eval": results})
            return
        console.print(f"seed checkpoint: {path}", highlight=False)
        for line in shipped_lines(check, shipped_now=ship):
            console.print(line, highlight=False)
        console.print(results_table(f"seed model of {task}", results))

    @app.command("eval")
    def eval_checkpoint(
        task: str = typer.Option(..., "--task", help="Task whose eval sets to score."),
        checkpoint: Path = typer.Option(..., "--checkpoint", help="A .safetensors checkpoint."),
        device: str = DeviceOption,
        specs: list[Path] = SpecsOption,
        plugins: list[str] = PluginOption,
        data_root: Path = DataRootOption,
        cache_dir: Path = CacheOption,
        as_json: bool = JsonOption,
    ) -> None:
        """WER and CER per eval set (pooled) and the per-speaker WER distribution."""
        from pflbench.central import set_cpu_threads
        from pflbench.checkpoint import load_model
        from pflbench.cli.common import load_specs
        from pflbench.data.prepare import prepare_task
        from pflbench.evaluate import evaluate_sets

        device = check_device(device)
        spec = load_specs(specs, plugins).task(task).spec
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

    @app.command("verify")
    def verify(
        run_dir: Path = typer.Argument(..., help="A finished run folder (with DONE)."),
        device: str = DeviceOption,
        data_root: Path = DataRootOption,
        cache_dir: Path = CacheOption,
        as_json: bool = JsonOption,
    ) -> None:
        """Re-evaluate a finished run's final checkpoint and compare with its record.

        The checkpoint must be the one the record names (digest of its tensors). On
        the run's setup (same torch version, device and device name; a CPU re-evaluation uses
        the record's thread count) every figure and every hypothesis must be identical; on
        another setup, per eval set, the number of utterances must be equal and pooled WER and
        CER within 0.01 (1 point, absolute). Exit 2 on any difference; on success writes
        RUN_DIR/verification.json, which `pflbench submit` files with the record."""
        from pflbench.results.rescore import DataOptions
        from pflbench.results.verify import TOLERANCE, VERIFICATION_FILE, verify_run

        device = check_device(device)
        data = DataOptions(data_root=data_root, cache_dir=cache_dir, progress=not as_json)
        stamp = verify_run(run_dir, device, data)
        if as_json:
            print_json(stamp.model_dump(mode="json"))
            return
        how = (
            "identical to the record (same setup: every figure and hypothesis)"
            if stamp.exact
            else f"within {TOLERANCE} of the record's WER/CER (another setup)"
        )
        console.print(f"verified {stamp.record_id}: the final checkpoint re-evaluated is {how}")
        for name, figures in sorted(stamp.eval.items()):
            cer = "–" if figures.cer is None else f"{100 * figures.cer:.2f}"
            console.print(f"  {name}: WER {100 * figures.wer:.2f} %, CER {cer} %", highlight=False)
        console.print(f"wrote {run_dir / VERIFICATION_FILE}", highlight=False)
