"""CLI: `tasks`, `baselines` and `budgets` — list and show the declarative specs; `budgets match`
(a budget matched to another model size and cohort) and `specs hashes` (the golden config
hashes)."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.table import Table

from pflbench.cli.common import (
    JsonOption,
    PluginOption,
    SpecsOption,
    console,
    load_specs,
    print_json,
)
from pflbench.errors import UserError
from pflbench.spec.registry import Loaded, Registry, dump_yaml


def _registry(specs: list[Path] | None, plugins: list[str] | None = None) -> Registry:
    return load_specs(specs, plugins)


def _show(loaded: Loaded, as_json: bool, extra: dict | None = None) -> None:
    data = loaded.spec.model_dump(mode="json")
    info = {"file": str(loaded.path), "file_sha256": loaded.sha256}
    if as_json:
        print_json({**data, **(extra or {}), "_source": info})
        return
    console.print(f"[bold]{loaded.spec.name}[/]  [dim]{loaded.path}[/]")
    console.print(dump_yaml({**data, **(extra or {})}, sort_keys=False, width=100))


def source_name(source) -> str:
    """The paper's name of a data source: LS-100, LS-960, CV-en-train-90, ..."""
    from pflbench.data.adapters import CORPORA

    name = CORPORA[source.corpus].source_name(source.subsets, source.locale)
    if source.user_split:
        pct = source.user_split.percent
        name += f"-{pct if source.user_split.part == 'in' else 100 - pct:02g}"
    return name + (" (IID)" if source.iid else "")


def _task_row(loaded: Loaded) -> dict:
    t = loaded.spec
    return {
        "name": t.name,
        "v": t.version,
        "lang": t.language,
        "seed data": source_name(t.seed_data) if t.seed_data else "-",
        "federated data": source_name(t.federated_data),
        "cohort": t.recipe.federated.cohort_size,
        "steps": t.recipe.federated.central_steps,
    }


def _table(title: str, rows: list[dict]) -> None:
    table = Table(title=title)
    for i, key in enumerate(rows[0] if rows else []):
        table.add_column(key, no_wrap=i == 0)
    for row in rows:
        table.add_row(*(str(v) for v in row.values()))
    console.print(table)


def budget_privacy(budget) -> dict:
    """σ_DP and z of a budget, and ε at its extrapolated scale by every accountant (null where
    one cannot compute it)."""
    from pflbench.privacy.accountants import ACCOUNTANTS
    from pflbench.privacy.accounting import SampledGaussian
    from pflbench.privacy.statement import budget_noise, epsilon_entry

    if not budget.dp:
        return {"dp": False}
    if budget.unit == "example":
        return {
            "dp": True,
            "unit": "example",
            "calibrated_with": budget.accountant,
            "noise_multiplier": "calibrated by each run at its own number of examples N,"
            " sampling rate q = B/N and steps T (opacus' get_noise_multiplier); see its record",
        }
    noise = budget_noise(budget)
    q = budget.cohort / budget.population
    mechanism = SampledGaussian(noise["noise_multiplier"], q, budget.steps)
    eps = {name: epsilon_entry(mechanism, budget.delta, name)["epsilon"] for name in ACCOUNTANTS}
    return {
        "dp": True,
        "noise_multiplier": noise["noise_multiplier"],
        "sigma_dp": noise["sigma_dp"],
        "sampling_rate": q,
        "calibrated_with": budget.accountant,
        "epsilon_at_extrapolated_scale": eps,
    }


def register(app: typer.Typer) -> None:
    tasks = typer.Typer(help="List and show benchmark tasks (tasks/*.yaml).", no_args_is_help=True)
    baselines = typer.Typer(help="List and show reference baselines.", no_args_is_help=True)
    budgets = typer.Typer(help="List and show privacy budgets (tasks/budgets.yaml).")
    budgets.no_args_is_help = True
    app.add_typer(tasks, name="tasks")
    app.add_typer(baselines, name="baselines")
    app.add_typer(budgets, name="budgets")
    spec_tools = typer.Typer(help="Checks over all specs.", no_args_is_help=True)
    app.add_typer(spec_tools, name="specs")

    @spec_tools.command("hashes")
    def specs_hashes(
        write: Path | None = typer.Option(
            None,
            "--write",
            help="Write the hashes to this JSON file (the golden file the tests compare with:"
            " tests/fixtures/task_config_hashes.json).",
        ),
        specs: list[Path] | None = SpecsOption,
        plugins: list[str] = PluginOption,
    ) -> None:
        """The config hash of every task x baseline (budget none, seed 0). A change that alters
        one changes the identity of every run of it: regenerate the golden file only when that
        is intended (a new task or baseline, a recipe change that should re-key runs)."""
        import json

        from pflbench.spec.resolve import spec_config_hashes

        hashes = spec_config_hashes(_registry(specs, plugins))
        if write is None:
            print_json(hashes)
            return
        write.write_text(json.dumps(hashes, indent=2) + "\n", encoding="utf-8")
        console.print(f"wrote {len(hashes)} config hashes to {write}")

    @tasks.command("list")
    def tasks_list(
        specs: list[Path] | None = SpecsOption,
        plugins: list[str] = PluginOption,
        as_json: bool = JsonOption,
    ) -> None:
        """All tasks: data, seed, recipe headline."""
        rows = [_task_row(t) for _, t in sorted(_registry(specs, plugins).tasks.items())]
        print_json(rows) if as_json else _table("tasks", rows)

    @tasks.command("show")
    def tasks_show(
        name: str = typer.Argument(..., help="The task's name (`pflbench tasks list`)."),
        specs: list[Path] | None = SpecsOption,
        plugins: list[str] = PluginOption,
        as_json: bool = JsonOption,
    ) -> None:
        """One task, fully resolved with defaults."""
        _show(_registry(specs, plugins).task(name), as_json)

    @baselines.command("list")
    def baselines_list(
        specs: list[Path] | None = SpecsOption,
        plugins: list[str] = PluginOption,
        as_json: bool = JsonOption,
    ) -> None:
        """All reference baselines and what they reproduce."""
        rows = [
            {"name": b.spec.name, "reproduces": b.spec.reproduces, "overrides": b.spec.overrides}
            for _, b in sorted(_registry(specs, plugins).baselines.items())
        ]
        print_json(rows) if as_json else _table("baselines", rows)

    @baselines.command("show")
    def baselines_show(
        name: str = typer.Argument(..., help="The baseline's name (`pflbench baselines list`)."),
        specs: list[Path] | None = SpecsOption,
        plugins: list[str] = PluginOption,
        as_json: bool = JsonOption,
    ) -> None:
        """One baseline."""
        _show(_registry(specs, plugins).baseline(name), as_json)

    @budgets.command("list")
    def budgets_list(
        specs: list[Path] | None = SpecsOption,
        plugins: list[str] = PluginOption,
        as_json: bool = JsonOption,
    ) -> None:
        """All privacy budgets."""
        keys = ("name", "dp", "unit", "epsilon", "delta", "population", "cohort", "steps")
        rows = [
            {k: getattr(b.spec, k) for k in keys}
            for _, b in sorted(_registry(specs, plugins).budgets.items())
        ]
        print_json(rows) if as_json else _table("budgets", rows)

    @budgets.command("show")
    def budgets_show(
        name: str = typer.Argument(..., help="The budget's name (`pflbench budgets list`)."),
        specs: list[Path] | None = SpecsOption,
        plugins: list[str] = PluginOption,
        as_json: bool = JsonOption,
    ) -> None:
        """One budget with its σ_DP, noise multiplier z and ε by every accountant; a matched
        budget also with its noise-to-clip ratio σ_DP·√d next to the paper budget's."""
        from pflbench.privacy.matching import PAPER_PRESET, match_report, model_parameters

        registry = _registry(specs, plugins)
        loaded = registry.budget(name)
        extra = {"privacy": budget_privacy(loaded.spec)}
        if loaded.spec.matches is not None:
            paper = registry.budget(loaded.spec.matches).spec
            extra["matching"] = match_report(loaded.spec, paper, model_parameters(PAPER_PRESET))
        _show(loaded, as_json, extra=extra)

    @budgets.command("match")
    def budgets_match(
        name: str = typer.Argument(..., help="The paper budget to match, e.g. eps7.2-high-pop."),
        preset: str = typer.Option(..., "--preset", help="Model preset to match it for."),
        cohort: int = typer.Option(
            None, "--cohort", help="Also match for runs of this cohort (the paper's: 1,024)."
        ),
        vocab_size: int = typer.Option(30, "--vocab-size", help="Output tokens incl. blank."),
        specs: list[Path] | None = SpecsOption,
        plugins: list[str] = PluginOption,
        as_json: bool = JsonOption,
    ) -> None:
        """The budget with `name`'s ε, δ, q and T whose σ_DP·√d for `preset` equals `name`'s
        for paper-255m (with --cohort: whose σ_DP·√(d·S) for runs of that cohort equals the
        paper's at S = 1,024); see docs/BUDGETS.md. Paste it into a budgets.yaml."""
        from pflbench.privacy.matching import PAPER_PRESET, matched_scale, model_parameters

        paper = _registry(specs, plugins).budget(name).spec
        if paper.unit == "example":
            raise UserError(f"budget {name!r} is example-level: only user-level budgets match")
        parameters = model_parameters(preset, vocab_size)
        entry = matched_scale(paper, parameters, model_parameters(PAPER_PRESET), cohort)
        suffix = f"-cohort{cohort}" if cohort else ""
        entry = {"name": f"{name}-{preset}{suffix}-matched", **entry}
        print_json(entry) if as_json else console.print(dump_yaml([entry], sort_keys=False))
