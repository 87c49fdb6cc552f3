"""CLI: submit, leaderboard, compare, validity, results (export, validate, rescore, reproduce,
paper, schema), plot, sweep."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import typer

from pflbench.cli.common import (
    JsonOption,
    PluginOption,
    SpecsOption,
    check_device,
    console,
    err_console,
    print_json,
)
from pflbench.errors import UserError

ResultsOption = typer.Option(Path("results"), "--results", help="The results folder.")
DataRootOption = typer.Option(
    None,
    "--data-root",
    help="Folder with the real corpora, for the eval sets' references (also PFLBENCH_DATA); "
    "synth-* tasks synthesize theirs into the cache.",
)
SweepsOption = typer.Option(
    None,
    "--sweeps",
    help="The declared matrices (sweeps/*.yaml) whose filed results must be whole, and the "
    "stale records' pins (stale-records.txt); default: sweeps/ beside the results folder.",
)
LEADERBOARD_FILE = Path("leaderboard.md")
FIGURES_DIR = Path("docs/figures")
# Re-scoring and the population check read no features; another CPU computes other ones.
AUDIO_ONLY_NOTE = "matched the run's data by the audio digest only: this CPU's features differ"


def _registry(specs: list[Path] | None, plugins: list[str] | None = None):
    from pflbench.cli.common import load_specs

    return load_specs(specs, plugins)


def _sweeps_folder(results: Path, sweeps: Path | None) -> Path:
    """--sweeps, else sweeps/ beside the results folder: the filed matrices' manifest."""
    return sweeps or Path(results).parent / "sweeps"


def _check_declared(records, results: Path, sweeps: Path | None, registry) -> None:
    """The declared matrices are filed whole (results.sweep.check_declared_seeds): those of
    --sweeps, or of sweeps/ beside the results folder where there is one; a matrix still
    being filed (its to-run/) agrees with what is filed (results.sweep.check_to_run); and the
    stale records are the ones the folder pins (results.sweep.check_stale_pinned)."""
    from pflbench.results.sweep import (
        check_declared_seeds,
        check_stale_pinned,
        check_to_run,
        load_sweep_folder,
    )

    folder = _sweeps_folder(results, sweeps)
    if sweeps is not None or folder.is_dir():
        manifest = load_sweep_folder(folder)
        if (folder / "to-run").is_dir():  # first: its refusal says what to run to fix it
            check_to_run(records, manifest, load_sweep_folder(folder / "to-run"), registry)
        check_declared_seeds(records, manifest, registry)
        check_stale_pinned(records, folder, registry)


MANIFEST_HEADER = """The filed part of this task's declared matrix: `pflbench leaderboard` and
`results validate` hold results/ to it. `pflbench results split-sweeps` moved each group here
from sweeps/to-run/{name} once its runs were filed (docs/RESULTS.md)."""
TO_RUN_HEADER = """What is declared of this task's matrix and not yet filed (docs/RESULTS.md):
    pflbench sweep --file sweeps/to-run/{name} --jobs 2
then `pflbench submit` the runs and `pflbench results split-sweeps`, which moves them into
sweeps/{name} and rewrites this file."""


def _pending_notes(records, results: Path, sweeps: Path | None, registry) -> dict[str, str]:
    """Per task, a note of the runs that the sweep files in `to-run/` (beside the filed matrix's)
    declare and that are not filed yet: a task's new version files its matrix over several
    sessions, and a reader must see that its table is partial (docs/RESULTS.md)."""
    from pflbench.numerics import NUMERICS_VERSION
    from pflbench.results.sweep import filed_runs, load_sweep_folder, split_filed

    folder = _sweeps_folder(results, sweeps) / "to-run"
    if not folder.is_dir():
        return {}
    left: dict[str, int] = {}
    for path, sweep in load_sweep_folder(folder):
        _, groups = split_filed(sweep, records, registry, str(path))
        left[sweep.task] = left.get(sweep.task, 0) + sum(len(g.seeds) for g in groups)
    notes, runs = {}, [r for r, _ in filed_runs(records)]
    for task, count in left.items():
        version = registry.task(task).spec.version
        filed = sum(r.task.name == task and r.task.version == version for r in runs)
        notes[task] = (
            f"**Task v{version}'s matrix is being filed**: {filed} of its runs are filed at "
            f"today's numerics (v{NUMERICS_VERSION}), {count} more are declared in "
            "`sweeps/to-run/` and still to run (`pflbench sweep --file sweeps/to-run/FILE --jobs "
            "2`). Until they are, rows of an older task version or run by code of older numerics "
            "stand in, marked stale, and comparisons that need the missing rows are missing "
            "below."
        )
    return notes


def _split(text: str, what: str) -> list[str]:
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items:
        raise UserError(f"--{what}: expected a comma-separated list, got {text!r}")
    return items


def _print_plots(report) -> None:
    for path in report.written:
        console.print(f"wrote {path}", highlight=False)
    for path in report.removed:
        console.print(f"removed {path}", highlight=False)
    for why in report.skipped:
        console.print(f"[yellow]skipped[/] {why}", highlight=False)


def _figure_specs(registry) -> tuple[dict, dict]:
    """(budget name -> Budget, task -> its declared budgets): what the figures need of specs."""
    budgets = {name: loaded.spec for name, loaded in registry.budgets.items()}
    declared = {name: loaded.spec.budgets for name, loaded in registry.tasks.items()}
    return budgets, declared


def _fail_on_stale_figures(figures, folder: Path) -> None:
    from pflbench.results.figures import stale_figures

    problems = stale_figures(figures, folder)
    if problems:
        err_console.print(
            f"{len(problems)} figures in {folder} are missing or stale (run `pflbench plot`):\n  "
            + "\n  ".join(problems),
            highlight=False,
        )
        raise typer.Exit(1)


def _validity_reports(records, registry, task: str, tables: list[str] | None = None):
    from pflbench.results.validity import validity_reports

    spec = registry.tasks[task].spec if task in registry.tasks else None
    return validity_reports(
        records,
        task,
        {name: loaded.spec for name, loaded in registry.budgets.items()},
        task_budgets=spec.budgets if spec is not None else None,
        task_version=spec.version if spec is not None else None,
        tables=tables,
    )


def _validity_sections(records, registry) -> dict[str, str]:
    """The validity report of each embedded task with records, for its leaderboard section."""
    from pflbench.results.validity import VALIDITY_TABLES, render_validity

    tasks = {r.task.name for r in records}
    return {
        task: render_validity(_validity_reports(records, registry, task))
        for task in VALIDITY_TABLES
        if task in tasks
    }


def register(app: typer.Typer) -> None:
    @app.command("submit")
    def submit(
        run_dirs: list[Path] = typer.Argument(
            ..., help="Finished run folder(s) (with DONE), e.g. a sweep's runs/<task>/*/."
        ),
        results: Path = ResultsOption,
        stale: bool = typer.Option(
            False, "--stale", help="Accept a run of an older task version; it is shown as stale."
        ),
        data_root: Path = DataRootOption,
        specs: list[Path] = SpecsOption,
        plugins: list[str] = PluginOption,
        as_json: bool = JsonOption,
    ) -> None:
        """Validate finished runs' records and file them under results/<task>/<budget>/.

        ε is recomputed by the accountants, and every WER/CER figure is re-scored from the run's
        stored hypotheses against the eval sets' own references. A run that used plug-ins is
        filed only with the same plug-ins loaded (--plugin, same source sha256). With several
        runs, each is checked on its own (in one process, so shared accountant results are
        computed once): a refused run is reported and the others are still filed; the exit code
        is 2 when any was refused. A run whose record is filed already is reported and skipped."""
        from pflbench.results.leaderboard import stale_because
        from pflbench.results.rescore import DataOptions
        from pflbench.results.submit import AlreadyFiled
        from pflbench.results.submit import submit as submit_run
        from pflbench.results.sweep import current_version

        data = DataOptions(data_root=data_root, progress=not as_json)
        registry = _registry(specs, plugins)
        accepted, refused, filed = [], [], []
        for run_dir in run_dirs:
            try:
                one = submit_run(run_dir, results, registry, stale_ok=stale, data=data)
            except AlreadyFiled as exc:
                filed.append((run_dir, str(exc)))
                if not as_json:
                    console.print(str(exc), highlight=False)
                continue
            except UserError as exc:
                if len(run_dirs) == 1:
                    raise
                refused.append((run_dir, str(exc)))
                err_console.print(f"refused {run_dir}: {exc}", highlight=False)
                continue
            accepted.append(one)
            if not as_json:
                note = ""
                if one.stale:  # as the leaderboard marks it: "v5" or "numerics v2"
                    version = current_version(registry, one.record.task.name)
                    note = f" [yellow](stale: {stale_because(one.record, version)})[/]"
                if one.audio_only:
                    note += f" ({AUDIO_ONLY_NOTE}: {', '.join(one.audio_only)})"
                checked = "re-evaluated" if one.reevaluated else "re-scored"
                console.print(
                    f"accepted {one.record.record_id} ({checked}) → {one.path}{note}",
                    highlight=False,
                )
        if as_json:
            rows = [
                {
                    "record_id": a.record.record_id,
                    "path": str(a.path),
                    "stale": a.stale,
                    "reevaluated": a.reevaluated,
                    "audio_only": a.audio_only,
                }
                for a in accepted
            ] + [{"run_dir": str(d), "refused": why} for d, why in refused]
            rows += [{"run_dir": str(d), "already_filed": why} for d, why in filed]
            print_json(rows[0] if len(run_dirs) == 1 else rows)
        else:
            if filed and len(run_dirs) > 1:
                console.print(f"{len(filed)} of {len(run_dirs)} runs were filed already")
            if any(a.stale for a in accepted):
                console.print(
                    "stale records filed: review them, then `pflbench results pin-stale` pins"
                    " them in sweeps/stale-records.txt (the leaderboard refuses them until then)"
                )
            if accepted:
                console.print(
                    "run `pflbench plot` and `pflbench leaderboard` to update leaderboard.md"
                )
        if refused:
            raise UserError(f"{len(refused)} of {len(run_dirs)} runs refused (reasons above)")

    @app.command("leaderboard")
    def leaderboard(
        results: Path = ResultsOption,
        output: Path = typer.Option(LEADERBOARD_FILE, "--output", help="The file to write."),
        figures: Path = typer.Option(
            FIGURES_DIR, "--figures", help="The figures folder (`pflbench plot --out`)."
        ),
        check: bool = typer.Option(
            False,
            "--check",
            help="Write nothing; exit 1 when the file or a figure it embeds is not up to date.",
        ),
        specs: list[Path] = SpecsOption,
        plugins: list[str] = PluginOption,
        sweeps: Path = SweepsOption,
    ) -> None:
        """Regenerate leaderboard.md from results/ (byte-identical for the same records); it
        embeds the figures `pflbench plot` writes."""
        from pflbench.results.figures import all_result_figures, figure_links, stale_figures
        from pflbench.results.leaderboard import (
            leaderboard_is_current,
            load_result_files,
            render_leaderboard,
        )
        from pflbench.results.verify import reevaluated_ids

        registry = _registry(specs, plugins)
        files = load_result_files(results)
        records = [record for _, record, _ in files]
        _check_declared(records, results, sweeps, registry)
        budgets, declared = _figure_specs(registry)
        drawn, _ = all_result_figures(records, budgets, declared)
        links = figure_links(drawn, Path(os.path.relpath(figures, output.parent)).as_posix())
        validity = _validity_sections(records, registry)
        text = render_leaderboard(
            records,
            {name: loaded.spec.version for name, loaded in registry.tasks.items()},
            budgets,
            {t: "\n".join(filter(None, (links.get(t), validity.get(t)))) for t in links | validity},
            reevaluated_ids(files),
            _pending_notes(records, results, sweeps, registry),
        )
        if check:
            if not leaderboard_is_current(output, text):
                err_console.print(
                    f"{output} is stale: run `pflbench leaderboard` and commit the result",
                    highlight=False,
                )
                raise typer.Exit(1)
            _fail_on_stale_figures(drawn, figures)
            console.print(f"{output} and its figures are up to date", highlight=False)
            return
        output.write_text(text, encoding="utf-8")
        console.print(f"wrote {output}", highlight=False)
        if stale_figures(drawn, figures):
            console.print(f"[yellow]figures in {figures} are stale:[/] run `pflbench plot`")

    @app.command("compare")
    def compare(
        side_a: str = typer.Argument(..., help="Row A's runs, comma-separated (see above)."),
        side_b: str = typer.Argument(..., help="Row B's runs, comma-separated."),
        results: Path = ResultsOption,
        eval_set: list[str] = typer.Option(
            None,
            "--eval-set",
            metavar="NAME",
            help="Compare on this eval set (repeatable); default: all shared.",
        ),
        replicates: int = typer.Option(2000, "--replicates", min=100, help="Bootstrap draws."),
        seed: int = typer.Option(0, "--seed", help="Seed of the bootstrap."),
        as_json: bool = JsonOption,
    ) -> None:
        """Paired comparison of two rows (one or more seeds each): WER(A) - WER(B) per eval set
        with a 95% bootstrap CI that resamples speakers (paired) and seeds. A side is run
        directories, record files or record ids, comma-separated."""
        from pflbench.results.leaderboard import Row, fmt_baseline
        from pflbench.results.schema import record_numerics_version
        from pflbench.results.stats import compare_records, load_side, unchecked_seed_models

        a = load_side(_split(side_a, "side A"), results)
        b = load_side(_split(side_b, "side B"), results)
        found = compare_records(a, b, eval_set or None, replicates=replicates, seed=seed)
        unchecked = unchecked_seed_models([*a, *b])
        if unchecked:
            err_console.print(
                f"note: {', '.join(unchecked)} name no seed model (recorded before records "
                "held its digest): whether all runs started from the same one is unchecked",
                highlight=False,
            )

        def label(side: list) -> str:  # the leaderboard's name of the row, and its seeds
            r = side[0]
            seeds = f"{len(side)} seed{'s' if len(side) != 1 else ''}"
            name = fmt_baseline(Row(tuple(side)), None)
            return f"{name} / {r.budget}, {r.task.name} v{r.task.version} ({seeds})"

        tasks = {(r.task.name, r.task.version) for r in (a[0], b[0])}
        if len(tasks) > 1:
            err_console.print(
                f"note: A ran {a[0].task.name} v{a[0].task.version}, B {b[0].task.name} "
                f"v{b[0].task.version}: the rows differ in the task's recipe too, not only in the "
                "method",
                highlight=False,
            )
        numerics = [record_numerics_version(side[0]) for side in (a, b)]
        if numerics[0] != numerics[1]:
            err_console.print(
                f"note: A ran code of numerics v{numerics[0]}, B v{numerics[1]}: part of the "
                "difference may be the code's (pflbench.numerics)",
                highlight=False,
            )
        if {r.record_id for r in a} == {r.record_id for r in b}:
            err_console.print("note: A and B are the same records", highlight=False)
        # With one seed a side's interval is the speaker bootstrap alone (results/stats.py).
        noise = (
            "seed and speaker-sampling noise"
            if min(len(a), len(b)) > 1
            else "speaker-sampling noise (seed noise unmeasured: a side has 1 seed)"
        )
        if as_json:
            print_json(
                [
                    {
                        "eval_set": c.eval_set,
                        "a": {"row": label(a), "records": [r.record_id for r in a]},
                        "b": {"row": label(b), "records": [r.record_id for r in b]},
                        "wer_a": c.wer_a,
                        "wer_b": c.wer_b,
                        "difference": c.difference.estimate,
                        "ci95": [c.difference.low, c.difference.high],
                        "speakers": c.difference.num_speakers,
                        "seeds": [len(a), len(b)],
                        "beyond_noise": c.beyond_noise,
                        "noise": noise,
                    }
                    for c in found
                ]
            )
            return
        console.print(f"A = {label(a)}\nB = {label(b)}", highlight=False, markup=False)
        for c in found:
            d = c.difference
            verdict = f"{'beyond' if c.beyond_noise else 'within'} {noise}"
            console.print(
                f"{c.eval_set}: WER A {100 * c.wer_a:.2f}%  B {100 * c.wer_b:.2f}%  "
                f"A-B {100 * d.estimate:+.2f} [95% CI {100 * d.low:+.2f}, {100 * d.high:+.2f}] "
                f"over {d.num_speakers} speakers: {verdict}",
                highlight=False,
            )

    @app.command("validity")
    def validity(
        task: str = typer.Option(..., "--task", help="The embedded task."),
        table: list[str] = typer.Option(
            None,
            "--table",
            metavar="TABLE",
            help='Only this paper table, e.g. "002 Table 9" (repeatable).',
        ),
        results: Path = ResultsOption,
        specs: list[Path] = SpecsOption,
        plugins: list[str] = PluginOption,
        as_json: bool = JsonOption,
    ) -> None:
        """Kendall τ between the embedded task's ranking of configurations and each paper table
        whose configurations it runs, with every pair's agreement (also in leaderboard.md)."""
        from pflbench.results.leaderboard import load_results
        from pflbench.results.validity import VALIDITY_TABLES, render_validity

        known = [spec.name for spec in VALIDITY_TABLES.get(task, ())]
        if not known:
            raise UserError(
                f"--task {task!r}: no paper tables to validate it against (embedded tasks: "
                f"{', '.join(VALIDITY_TABLES)})"
            )
        unknown = [name for name in table or [] if name not in known]
        if unknown:
            raise UserError(f"--table {unknown[0]!r}: not one of {', '.join(known)}")
        reports = _validity_reports(
            load_results(results), _registry(specs, plugins), task, table or None
        )
        if not as_json:
            typer.echo(render_validity(reports), nl=False)
            return

        def interval(p):
            i = p.embedded_interval
            return None if i is None else [i.low, i.high]

        print_json(
            [
                {
                    "task": task,
                    "paper": r.spec.paper,
                    "table": r.spec.table,
                    "against": r.spec.against,
                    "question": r.spec.question,
                    "kendall_tau_b": r.tau,
                    "configurations": [
                        {
                            "baseline": c[0],
                            "budget": c[1],
                            "cohort": c[2],
                            "embedded_budget": r.embedded_budget[c],
                            "paper_wer": r.paper_wer[c],
                            "embedded_wer": r.embedded_wer[c],
                            "seeds": len(r.embedded_runs[c]),
                            "tuned_on_dev": [
                                {"set": dict(t.values), "dev_wer": t.dev_wer, "seeds": len(t.runs)}
                                for t in r.tuning.get(c, [])
                            ],
                        }
                        for c in r.common
                    ],
                    "pairs": [
                        {
                            "a": list(p.first),
                            "b": list(p.second),
                            "agreement": p.agreement,
                            "paper_difference": p.paper_difference,
                            "embedded_difference": p.embedded_difference,
                            "embedded_ci95": interval(p),
                        }
                        for p in r.pairs
                    ],
                }
                for r in reports
            ]
        )

    group = typer.Typer(help="Work with the records in results/.", no_args_is_help=True)
    app.add_typer(group, name="results")

    @group.command("export")
    def export(
        parquet: Path = typer.Option(..., "--parquet", help="The Parquet file to write."),
        results: Path = ResultsOption,
    ) -> None:
        """One row per record, flat columns (pyarrow), for pandas users."""
        from pflbench.results.export import export_parquet
        from pflbench.results.leaderboard import load_results

        rows = export_parquet(load_results(results), parquet)
        console.print(f"wrote {rows} rows to {parquet}", highlight=False)

    @group.command("validate")
    def validate(
        results: Path = ResultsOption,
        specs: list[Path] = SpecsOption,
        plugins: list[str] = PluginOption,
        sweeps: Path = SweepsOption,
    ) -> None:
        """Re-check every record in results/ (CI runs this): schema, ids and config hashes; each
        run's config is the one its task, baseline, budget and --set overrides resolve to (current
        task versions); every ε claim re-accounted and the privacy statement, field for field,
        the one pflbench writes; no config filed twice; every declared matrix (sweeps/) filed
        whole, each row with exactly its declared seeds, and one still being filed
        (sweeps/to-run/) with no run beside it; the papers' reference rows are what
        results/paper/tables.yaml gives. `results rescore` re-scores the WERs."""
        from pflbench.results.leaderboard import load_result_files
        from pflbench.results.paper import PAPER_DIR, check_paper_records
        from pflbench.results.submit import validate_record

        registry = _registry(specs, plugins)
        found = load_result_files(results)
        _check_declared([record for _, record, _ in found], results, sweeps, registry)
        if (results / PAPER_DIR).is_dir():
            check_paper_records(results, registry)
        stale = 0
        for path, record, raw in found:
            if record.kind == "run":
                stale += validate_record(record, raw, registry, str(path), stale_ok=True)
        console.print(f"{len(found)} records valid ({stale} stale)", highlight=False)

    @group.command("split-sweeps")
    def split_sweeps(
        results: Path = ResultsOption,
        specs: list[Path] = SpecsOption,
        plugins: list[str] = PluginOption,
        sweeps: Path = SweepsOption,
    ) -> None:
        """Move what is filed of the sweep files in sweeps/to-run/ (declared, not yet run) into
        the manifest of the same name in sweeps/, one group per configuration: a task's new
        version files its matrix over several sessions (docs/RESULTS.md). A to-run file with
        nothing left is removed, and the folder once it is empty. Then `pflbench leaderboard` holds
        results/ to the manifest."""
        from pflbench.results.leaderboard import load_results
        from pflbench.results.sweep import (
            SweepFile,
            load_sweep_file,
            load_sweep_folder,
            merge_groups,
            split_filed,
            write_sweep_file,
        )

        registry = _registry(specs, plugins)
        records = load_results(results)
        folder = _sweeps_folder(results, sweeps)
        to_run = folder / "to-run"
        if not to_run.is_dir():
            raise UserError(f"{to_run}: no folder of sweep files still to run")
        for path, sweep in load_sweep_folder(to_run):
            done, left = split_filed(sweep, records, registry, str(path))
            if not done:  # left as written, its comments with it
                console.print(f"{path}: nothing of it is filed yet", highlight=False)
                continue
            manifest = folder / path.name
            groups = list(load_sweep_file(manifest).groups) if manifest.is_file() else []
            filed = SweepFile(task=sweep.task, description=sweep.description,
                              groups=merge_groups(groups + done))  # fmt: skip
            write_sweep_file(manifest, filed, MANIFEST_HEADER.format(name=path.name))
            if left:
                rest = SweepFile(task=sweep.task, description=sweep.description, groups=left)
                write_sweep_file(path, rest, TO_RUN_HEADER.format(name=path.name))
            else:
                path.unlink()
            moved, to_go = sum(len(g.seeds) for g in done), sum(len(g.seeds) for g in left)
            console.print(
                f"{path}: {moved} filed runs moved to {manifest}; {to_go} left", highlight=False
            )
        if not any(to_run.iterdir()):  # every declared run is filed
            to_run.rmdir()
            console.print(f"{to_run}: every declared run is filed; removed", highlight=False)

    @group.command("retire-replaced")
    def retire_replaced(
        results: Path = ResultsOption,
        specs: list[Path] = SpecsOption,
        plugins: list[str] = PluginOption,
        sweeps: Path = SweepsOption,
        dry_run: bool = typer.Option(False, "--dry-run", help="List them; remove nothing."),
    ) -> None:
        """Remove filed runs of an older task version or older numerics whose rows are filed
        again at the current version and today's numerics with all their seeds: a new version's
        matrix, filed over sessions, replaces the old one row by row (docs/RESULTS.md). Git
        history keeps them, and they leave sweeps/stale-records.txt."""
        from pflbench.results.leaderboard import filed_dir, load_result_files
        from pflbench.results.sweep import (
            STALE_LIST,
            read_stale_list,
            replaced_records,
            stale_entry,
            write_stale_list,
        )

        found = load_result_files(results)
        paths = replaced_records(found, _registry(specs, plugins))
        for path in paths:
            if not dry_run:
                path.unlink()
                shutil.rmtree(filed_dir(path), ignore_errors=True)
            console.print(f"{'would remove' if dry_run else 'removed'} {path}", highlight=False)
        folder = _sweeps_folder(results, sweeps)
        if paths and not dry_run and (folder / STALE_LIST).is_file():
            # The removed records leave the pin list; nothing else in it changes.
            gone = {stale_entry(r) for p, r, _ in found if p in paths}
            write_stale_list(folder, [e for e in read_stale_list(folder) if e not in gone])
        console.print(f"{len(paths)} replaced runs {'found' if dry_run else 'removed'}")

    @group.command("pin-stale")
    def pin_stale(
        results: Path = ResultsOption,
        specs: list[Path] = SpecsOption,
        plugins: list[str] = PluginOption,
        sweeps: Path = SweepsOption,
    ) -> None:
        """Write sweeps/stale-records.txt: every filed run of an older task version or numerics,
        by task/budget/record id. `leaderboard` and `results validate` hold the stale records to
        it, since no other check covers them: run it after a task version bump, a
        NUMERICS_VERSION bump (every filed run turns stale) or `submit --stale`, and review its
        diff."""
        from pflbench.results.leaderboard import load_results
        from pflbench.results.sweep import read_stale_list, stale_entries, write_stale_list

        folder = _sweeps_folder(results, sweeps)
        if not folder.is_dir():  # a new sweeps/ would also switch on the declared-matrix checks
            raise UserError(f"{folder}: no such folder of sweep files (--sweeps)")
        before = set(read_stale_list(folder))
        entries = stale_entries(load_results(results), _registry(specs, plugins))
        path = write_stale_list(folder, entries)
        added, removed = len(set(entries) - before), len(before - set(entries))
        console.print(
            f"{path}: {len(entries)} stale records pinned ({added} added, {removed} removed)",
            highlight=False,
        )

    @group.command("rescore")
    def rescore(
        paths: list[Path] = typer.Argument(
            None, help="Filed records (results/<task>/<budget>/<id>.json); default: all."
        ),
        results: Path = ResultsOption,
        data_root: Path = DataRootOption,
    ) -> None:
        """Re-score filed records from their hypotheses and check their stamps (CI runs this).

        Every WER/CER figure is computed again from the filed hypotheses against the eval sets'
        own references."""
        from pflbench.results.leaderboard import check_filed_where_it_belongs, load_result_files
        from pflbench.results.rescore import DataOptions
        from pflbench.results.schema import load_record
        from pflbench.results.verify import recheck_filed

        if paths:
            root = results.resolve()
            files = []
            for path in paths:
                record, raw = load_record(path)
                if root not in path.resolve().parents:
                    raise UserError(f"{path}: not a record filed under {results}")
                check_filed_where_it_belongs(record, path.resolve().relative_to(root), path)
                files.append((path, record, raw))
        else:
            files = load_result_files(results)
        report = recheck_filed(files, DataOptions(data_root=data_root, progress=True))
        console.print(
            f"{len(report.rescored)} records re-scored, {report.references} reference rows",
            highlight=False,
        )
        if report.audio_only:
            console.print(
                f"{len(report.audio_only)} of them {AUDIO_ONLY_NOTE} (docs/RESULTS.md, "
                "'Another CPU vendor')",
                highlight=False,
            )

    @group.command("reproduce")
    def reproduce(
        record_ids: list[str] = typer.Argument(
            None, help="Filed records' ids (the file names under results/); or give --sample."
        ),
        sample: int = typer.Option(
            0, "--sample", min=0, help="Re-run this many filed records, picked by --sample-key."
        ),
        sample_key: str = typer.Option(
            "", "--sample-key", help="Picks the sample (CI: the commit): same key, same records."
        ),
        max_wall_seconds: float = typer.Option(
            None, "--max-wall-seconds", help="Sample among records whose run took at most this."
        ),
        jobs: int = typer.Option(1, "--jobs", min=1, help="Re-runs at once."),
        out: Path = typer.Option(
            Path("runs/reproduce"), "--out", help="Where the re-runs go, one folder per record."
        ),
        results: Path = ResultsOption,
        data_root: Path = DataRootOption,
        specs: list[Path] = SpecsOption,
        plugin: list[str] = PluginOption,
    ) -> None:
        """Run filed records again from their configs and compare (CI re-runs a sample): on the
        run's own setup (torch build, CPU kernels, threads) the final model, hypotheses, metrics,
        privacy statement and cohorts must be the record's bit for bit; on another setup the
        data, statement and cohorts exactly and each pooled WER within 3 points."""
        import torch

        from pflbench.results.leaderboard import load_result_files
        from pflbench.results.reproduce import (
            compare_rerun,
            load_rerun,
            rerun_plan,
            sample_records,
            why_not_rerunnable,
        )
        from pflbench.results.sweep import run_planned

        if bool(record_ids) == bool(sample):
            raise UserError("give record ids or --sample N, not both and not neither")
        filed = {path.stem: (path, record) for path, record, _ in load_result_files(results)}
        cuda = torch.cuda.is_available()
        tasks = _registry(specs, plugin).tasks
        versions = {name: loaded.spec.version for name, loaded in tasks.items()}

        def why_not(record) -> str | None:
            return why_not_rerunnable(record, cuda, versions.get(record.task.name))

        if record_ids:
            unknown = [rid for rid in record_ids if rid not in filed]
            if unknown:
                raise UserError(f"{', '.join(unknown)}: no record with this id in {results}")
            chosen = [filed[rid] for rid in record_ids]
            for path, record in chosen:
                why = why_not(record)
                if why is not None:
                    raise UserError(f"{path}: cannot be re-run here: {why}")
        else:
            candidates = [item for item in filed.values() if why_not(item[1]) is None]
            chosen = sample_records(candidates, sample, sample_key, max_wall_seconds)
            if not chosen:
                raise UserError(
                    f"no record in {results} to re-run: of {len(filed)}, {len(candidates)} can be"
                    " re-run here (not a paper's row, a stale row or a CUDA run without a GPU),"
                    f" and none of them ran within --max-wall-seconds {max_wall_seconds}"
                )
        passthrough = [arg for path in specs or [] for arg in ("--specs", str(path))]
        passthrough += [arg for name in plugin or [] for arg in ("--plugin", name)]
        if data_root is not None:
            passthrough += ["--data-root", str(data_root)]
        plans = []
        for path, record in chosen:
            plan = rerun_plan(record, path, out, tuple(passthrough))
            if plan.run_dir.exists():
                raise UserError(f"{plan.run_dir}: exists (an earlier re-run?); remove it first")
            plans.append((path, record, plan))
        console.print(f"re-running {len(plans)} records, {jobs} at a time, into {out}")
        by_dir = {plan.run_dir: (path, record) for path, record, plan in plans}
        failures = []

        def on_done(run, code: int) -> None:
            path, record = by_dir[run.run_dir]
            row = f"{path.stem} ({record.baseline} · {record.budget} · seed {record.seed})"
            if code != 0 or not run.done:
                failures.append(f"{row}: the re-run failed (exit {code}; {run.run_dir}/sweep.log)")
                err_console.print(f"[red]FAILED[/] {failures[-1]}", highlight=False)
                return
            try:
                comparison = compare_rerun(record, load_rerun(run), str(path))
            except UserError as error:
                failures.append(str(error))
                err_console.print(f"[red]DOES NOT REPRODUCE[/] {error}", highlight=False)
                return
            wers = ", ".join(
                f"{name} {a:.2%}→{b:.2%}" for name, (a, b) in sorted(comparison.wer.items())
            )
            how = (
                "bit for bit"
                if comparison.exact
                else "within tolerance on another setup ("
                + "; ".join(comparison.setup_differences)
                + ")"
            )
            console.print(f"[green]reproduced[/] {row} {how}: {wers}", highlight=False)

        run_planned([plan for _, _, plan in plans], jobs, on_done)
        if failures:
            raise UserError(f"{len(failures)} of {len(plans)} records did not reproduce")
        console.print(f"{len(plans)} records reproduced", highlight=False)

    @group.command("paper")
    def paper(
        results: Path = ResultsOption,
        check: bool = typer.Option(
            False, "--check", help="Write nothing; exit 1 when a record is missing or differs."
        ),
        specs: list[Path] = SpecsOption,
        plugins: list[str] = PluginOption,
    ) -> None:
        """Write results/paper/<id>.json, the papers' reference rows, from results/paper/tables.yaml
        (every table's configurations: reference rows, repeats of another table's, and the ones
        no pflbench task runs, with why)."""
        from pflbench.results.paper import sync_paper_records

        sync = sync_paper_records(results, _registry(specs, plugins), write=not check)
        for name, counts in sync.built.counts.items():
            console.print(
                f"{name}: {counts['reference']} reference rows, {counts['same as']} printed again"
                f" from another table, {counts['not mapped']} not mapped",
                highlight=False,
            )
        for path in sync.written:
            console.print(f"wrote {path}", highlight=False)
        if sync.extra:
            raise UserError(
                "not from tables.yaml (add them there or delete them): "
                + ", ".join(str(p) for p in sync.extra)
            )
        if check and sync.differing:
            err_console.print(
                f"{len(sync.differing)} reference records missing or out of date (e.g. "
                f"{sync.differing[0]}): run `pflbench results paper`",
                highlight=False,
            )
            raise typer.Exit(1)
        console.print(f"{len(sync.built.records)} reference records current", highlight=False)

    @group.command("schema")
    def schema(
        output: Path = typer.Option(
            Path("results/schema.json"), "--output", help="Where to write the JSON Schema."
        ),
    ) -> None:
        """Write the JSON Schema of result records (results/schema.json) for submitters."""
        from pflbench.results.schema import schema_json

        output.write_text(schema_json(), encoding="utf-8")
        console.print(f"wrote {output}", highlight=False)

    @app.command("plot")
    def plot(
        task: str = typer.Option(None, "--task", help="Only this task (default: every task)."),
        results: Path = ResultsOption,
        run: list[Path] = typer.Option(
            None,
            "--run",
            metavar="RUN_DIR",
            help="A run folder: also plot its layer norms and training curves.",
        ),
        out: Path = typer.Option(
            FIGURES_DIR, "--out", help="Where the figures go (leaderboard.md embeds docs/figures)."
        ),
        check: bool = typer.Option(
            False, "--check", help="Draw nothing; exit 1 when a figure is missing or stale."
        ),
        specs: list[Path] = SpecsOption,
        plugins: list[str] = PluginOption,
    ) -> None:
        """Result figures (PNG, one question each, with a manifest of their data digests) from
        results/, and figures of run logs (under OUT/runs)."""
        from pflbench.results.figures import all_result_figures
        from pflbench.results.leaderboard import load_results
        from pflbench.results.plots import plot_results, plot_run

        records = load_results(results)
        if task is not None and task not in {r.task.name for r in records}:
            raise UserError(f"--task {task!r}: no records of this task in {results}")
        budgets, declared = _figure_specs(_registry(specs, plugins))
        if check:
            if task is not None or run:
                raise UserError("--check checks every result figure: give no --task or --run")
            figures, _ = all_result_figures(records, budgets, declared)
            _fail_on_stale_figures(figures, out)
            console.print(f"{len(figures)} figures in {out} are up to date", highlight=False)
            return
        report = plot_results(records, out, task, budgets, declared)
        for run_dir in run or []:
            plot_run(run_dir, out / "runs", report)
        _print_plots(report)

    @app.command("sweep")
    def sweep(
        task: str = typer.Option(None, "--task", help="The task (or give --file)."),
        baselines: str = typer.Option(None, "--baselines", help="Comma-separated baselines."),
        budgets: str = typer.Option(
            None,
            "--budgets",
            help="Comma-separated budgets (default: each baseline's, as `pflbench run` picks it).",
        ),
        seeds: str = typer.Option("0", "--seeds", help="Comma-separated seeds."),
        sets: list[str] = typer.Option(
            None,
            "--set",
            metavar="KEY.PATH=VALUE",
            help="key.path=value for every run (repeatable).",
        ),
        file: Path = typer.Option(
            None, "--file", help="A sweep file (sweeps/*.yaml): task and groups of runs."
        ),
        jobs: int = typer.Option(
            1, "--jobs", min=1, help="Runs at once (each gets cores/jobs intra-op threads)."
        ),
        out: Path = typer.Option(
            Path("runs"),
            "--out",
            help="Runs go to OUT/<task>/<baseline>__<budget>__seed<N>[__<hash8 of the --sets>]/.",
        ),
        dry_run: bool = typer.Option(
            False, "--dry-run", help="Check and list the runs; run nothing."
        ),
        device: str = typer.Option("cpu", "--device", help="cpu, cuda or cuda:N, for every run."),
        data_root: Path = typer.Option(None, "--data-root", help="Real corpora folder."),
        specs: list[Path] = SpecsOption,
        plugins: list[str] = PluginOption,
    ) -> None:
        """Run a grid of baselines × budgets × seeds (finished runs are skipped), then plot.
        Every run's config is resolved and checked first, as `pflbench run` checks it."""
        from pflbench.results.sweep import (
            SweepFile,
            SweepGroup,
            check_sweep,
            load_sweep_file,
            plan_sweep_file,
            run_sweep,
        )
        from pflbench.spec.resolve import default_budget

        if (file is None) == (task is None or baselines is None):
            raise UserError("give either --file, or --task and --baselines")
        check_device(device)
        registry = _registry(specs, plugins)
        if file is not None:
            grid = load_sweep_file(file)
        else:
            try:
                seed_list = [int(s) for s in _split(seeds, "seeds")]
            except ValueError:
                raise UserError(f"--seeds {seeds!r}: expected integers, e.g. 0,1,2") from None
            names = _split(baselines, "baselines")
            # Without --budgets each baseline takes the budget `pflbench run` would give it.
            grid_of = (
                {  # baselines -> budgets
                    tuple(names): _split(budgets, "budgets")
                }
                if budgets is not None
                else {(name,): [default_budget(registry, task, name, sets or [])] for name in names}
            )
            groups = [
                SweepGroup(baselines=list(b), budgets=g, seeds=seed_list, set=sets or [])
                for b, g in grid_of.items()
            ]
            grid = SweepFile(task=task, groups=groups)
        check_sweep(grid, registry)
        run_args = ["--device", device, "--no-progress"]
        run_args += ["--data-root", str(data_root)] if data_root else []
        for folder in specs or []:
            run_args += ["--specs", str(folder)]
        for plugin in plugins or []:
            run_args += ["--plugin", plugin]
        plan = plan_sweep_file(grid, out, tuple(run_args))
        if dry_run:
            for run in plan:
                state = "done" if run.done else "to run"
                typer.echo(f"{state:7} {run.run_dir}  ({' '.join(run.command()[2:])})")
            return

        def on_done(run, code: int) -> None:
            state = "done" if code == 0 and run.done else f"FAILED (exit {code}, see sweep.log)"
            console.print(f"{state}: {run.run_dir}", highlight=False)

        todo = sum(not run.done for run in plan)
        console.print(f"{len(plan)} runs, {todo} to run, {jobs} at a time", highlight=False)
        budgets, declared = _figure_specs(registry)
        report = run_sweep(plan, out / grid.task / "plots", jobs, on_done, budgets, declared)
        console.print(
            f"{len(report.finished)} finished, {len(report.skipped)} already done, "
            f"{len(report.failed)} failed",
            highlight=False,
        )
        _print_plots(report.plots)
        for run, code in report.failed:
            err_console.print(f"failed (exit {code}): {run.run_dir}", highlight=False)
        if report.failed:
            raise typer.Exit(1)
