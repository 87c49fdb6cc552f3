"""CLI: data — synthesize corpora, prepare a task's feature stores, print their statistics."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.table import Table

from pflbench.cli.common import JsonOption, PluginOption, SpecsOption, console, print_json

data_app = typer.Typer(help="Corpora, feature stores and their statistics.", no_args_is_help=True)

DataRootOption = typer.Option(
    None, "--data-root", help="Folder with the downloaded corpora (also PFLBENCH_DATA)."
)


def load_task(name: str, specs: list[Path] | None, plugins: list[str] | None = None):
    from pflbench.cli.common import load_specs

    return load_specs(specs, plugins).task(name).spec


@data_app.command("synth")
def synth(
    out: Path = typer.Option(..., "--out", help="Empty or new folder to write the corpora to."),
    lang: str = typer.Option("en", "--lang", help="en, fr or de."),
    size: str = typer.Option("small", "--size", help="tiny, small or base."),
    seed: int = typer.Option(0, "--seed", help="Seed of the texts, voices and speakers drawn."),
) -> None:
    """Write an LS-like and a CV-like synthetic corpus (espeak-ng) in the real on-disk formats."""
    from pflbench.data.synth import SIZES, synthesize
    from pflbench.data.text import EXTRA_LETTERS
    from pflbench.errors import UserError
    from pflbench.progress import make_progress

    if lang not in EXTRA_LETTERS:
        raise UserError(f"--lang: unsupported language {lang!r} (en, fr, de)")
    if size not in SIZES:
        raise UserError(f"--size: unknown size {size!r} ({', '.join(SIZES)})")
    if out.exists() and not out.is_dir():
        raise UserError(f"--out: {out} is a file, not a folder")
    if out.exists() and any(out.iterdir()):
        raise UserError(f"--out: {out} is not empty")
    with make_progress("synthesis") as progress:
        bar = progress.add_task(f"synthesizing {lang}-{size}", total=None)
        synthesize(out, lang, size, seed,
                   on_unit=lambda d, t: progress.update(bar, completed=d, total=t))  # fmt: skip
    console.print(f"wrote {out}")


@data_app.command("prepare")
def prepare(
    task: str = typer.Option(..., "--task", help="Task name."),
    data_root: Path | None = DataRootOption,
    specs: list[Path] | None = SpecsOption,
    plugins: list[str] = PluginOption,
) -> None:
    """Build the feature store of every split the task uses (resumable)."""
    from pflbench.data.prepare import prepare_task

    data = prepare_task(load_task(task, specs, plugins), data_root)
    print_stats_table(data.report)


@data_app.command("stats")
def stats(
    task: str = typer.Option(..., "--task", help="Task name."),
    data_root: Path | None = DataRootOption,
    specs: list[Path] | None = SpecsOption,
    plugins: list[str] = PluginOption,
    as_json: bool = JsonOption,
) -> None:
    """Per split: hours, users, utterances, minutes per user, skipped items by reason."""
    from pflbench.data.prepare import prepare_task

    data = prepare_task(load_task(task, specs, plugins), data_root, progress=not as_json)
    if as_json:
        print_json(data.report)
    else:
        print_stats_table(data.report)


def print_stats_table(report: dict) -> None:
    table = Table(title="Data (paper Table 2)")
    for col in ("split", "hours", "users", "utts", "min/user mean", "std", "min", "max", "skipped"):
        table.add_column(col, justify="left" if col == "split" else "right")
    for name, s in report.items():
        m = s["minutes_per_user"]
        table.add_row(
            name, f"{s['hours']:.2f}", str(s["users"]), str(s["utterances"]), f"{m['mean']:.2f}",
            f"{m['std']:.2f}", f"{m['min']:.2f}", f"{m['max']:.2f}",
            str(sum(s["skipped"].get("counts", {}).values())),
        )  # fmt: skip
    console.print(table)
    for name, s in report.items():
        for reason, n in s["skipped"].get("counts", {}).items():
            examples = ", ".join(s["skipped"]["examples"].get(reason, []))
            console.print(f"  {name}: skipped {n} × {reason} (e.g. {examples})", highlight=False)
    for name, s in report.items():
        for subset, where in s.get("read_from", {}).items():
            console.print(f"  {name}: {subset} read from {where}", highlight=False)
        groups = [f"{attribute} (" + ", ".join(f"{g} {n}" for g, n in counts.items()) + ")"
                  for attribute, counts in s.get("speaker_groups", {}).items()]  # fmt: skip
        why = s.get("speaker_groups_unavailable", "")
        line = "speakers per group: " + "; ".join(groups) if groups else f"no speaker groups: {why}"
        console.print(f"  {name}: {line}", highlight=False)


def register(app: typer.Typer) -> None:
    app.add_typer(data_app, name="data")
