"""`pflbench sweep`: run a grid of (baseline × budget × seed) for one task, then plot it.

Each run is `python -m pflbench run ... --out RUN_DIR` in a subprocess (a crash in one run cannot
take the sweep down), its output kept in RUN_DIR/sweep.log. A run folder with a DONE marker is
finished and skipped on a rerun; one begun by a killed sweep is resumed (`--resume`). A grid is
given on the command line or as a sweep file
(`sweeps/*.yaml`: a task and groups of baselines × budgets × seeds, each with its own --set), and
`jobs` runs share the machine's CPUs, each with an equal share of intra-op threads.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pflbench.errors import UserError
from pflbench.methods import check_run
from pflbench.numerics import NUMERICS_VERSION
from pflbench.results.leaderboard import stale_because
from pflbench.results.plots import PlotReport, plot_results, plot_run
from pflbench.results.schema import ResultRecord, load_record, record_numerics_version
from pflbench.results.submit import what_ran
from pflbench.spec.names import safe_name
from pflbench.spec.registry import Registry, dump_yaml, format_validation_error, load_yaml
from pflbench.spec.resolve import canonical_json, resolve, set_values


@dataclass(frozen=True)
class PlannedRun:
    task: str
    baseline: str
    budget: str
    seed: int
    sets: tuple[str, ...]
    run_dir: Path
    run_args: tuple[str, ...] = ()  # passed through to every run: --device, --data-root, --specs
    threads: int | None = None  # intra-op threads (OMP_NUM_THREADS); None: cores / jobs

    @property
    def done(self) -> bool:
        return (self.run_dir / "DONE").is_file()

    @property
    def started(self) -> bool:
        """Begun by an earlier sweep and not finished: the run continues from its checkpoint."""
        return (self.run_dir / "config.json").is_file() and not self.done

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "pflbench", "run", "--task", self.task]
        cmd += ["--baseline", self.baseline, "--budget", self.budget, "--seed", str(self.seed)]
        for item in self.sets:
            cmd += ["--set", item]
        where = "--resume" if self.started else "--out"
        return cmd + [where, str(self.run_dir), *self.run_args]


@dataclass
class SweepReport:
    finished: list[PlannedRun] = field(default_factory=list)
    skipped: list[PlannedRun] = field(default_factory=list)  # already DONE
    failed: list[tuple[PlannedRun, int]] = field(default_factory=list)  # (run, exit code)
    plots: PlotReport = field(default_factory=PlotReport)


class SweepGroup(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    baselines: list[str] = Field(min_length=1)
    budgets: list[str] = Field(
        min_length=1,
        description="Each run's budget, `none` for no DP. Required: without one `pflbench run` "
        "gives a clipping baseline the task's first budget, so a file names what it means.",
    )
    seeds: list[int] = Field([0], min_length=1)
    set: list[str] = Field([], description="--set overrides for every run of the group.")


class SweepFile(BaseModel):
    """A declared grid: `pflbench sweep --file sweeps/NAME.yaml`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    task: str
    description: str = ""
    groups: list[SweepGroup] = Field(min_length=1)


def load_sweep_file(path: Path) -> SweepFile:
    try:
        return SweepFile.model_validate(load_yaml(Path(path).read_bytes()))
    except OSError as exc:
        raise UserError(f"{path}: cannot read the sweep file ({exc.strerror})") from None
    except yaml.YAMLError as exc:
        raise UserError(f"{path}: not a valid sweep file:\n{exc}") from None
    except ValidationError as exc:  # each key and what is wrong with it, as for spec files
        text = format_validation_error(str(path), exc)
        raise UserError(text.replace("invalid spec", "not a valid sweep file:")) from None


def load_sweep_folder(folder: Path) -> list[tuple[Path, SweepFile]]:
    """Every sweep file of the folder (*.yaml; another YAML extension is refused, not skipped)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise UserError(f"{folder}: no folder of sweep files")
    odd = sorted(p for p in folder.iterdir() if p.suffix in (".yml", ".YAML", ".YML"))
    if odd:
        raise UserError(f"{odd[0]}: a sweep file's name must end in .yaml")
    return [(path, load_sweep_file(path)) for path in sorted(folder.glob("*.yaml"))]


def _matrix_key(config: dict, where: str) -> str:
    """What a run ran, its seed aside: task (with version) and recipe (submit.what_ran), budget
    and baseline names. Two spellings of one --set override, or a reworded baseline, are one
    configuration here, as they are for `submit`."""
    ran = what_ran(config, where)
    del ran["seed"]
    names = (config.get("budget") or {}).get("name"), (config.get("baseline") or {}).get("name")
    return canonical_json([ran, *names])


def _configurations(sweep: SweepFile, registry: Registry, where: str):
    """(group, baseline, budget, resolved config, matrix key) of each configuration the sweep
    file declares, resolved with today's specs."""
    for group in sweep.groups:
        for baseline in group.baselines:
            for budget in group.budgets:
                config = resolve(registry, sweep.task, baseline, budget, 0, group.set)
                key = _matrix_key(config.model_dump(mode="json"), where)
                yield group, baseline, budget, config, key


def filed_runs(records: list[ResultRecord]) -> list[tuple[ResultRecord, str]]:
    """(record, matrix key) of each filed run at today's numerics: a seed of older numerics is
    stale work (its row is apart, pflbench.numerics), and a matrix is filed whole at today's."""
    return [
        (r, _matrix_key(r.config, f"record {r.record_id} ({r.task.name}, {r.budget}): config"))
        for r in records
        if r.kind == "run" and r.config is not None
        and record_numerics_version(r) == NUMERICS_VERSION
    ]  # fmt: skip


def replaced_records(
    found: list[tuple[Path, ResultRecord, dict]], registry: Registry
) -> list[Path]:
    """Filed runs of an older task version or of older numerics whose row (baseline, budget,
    --set overrides) is filed again at the task's current version and today's numerics, every
    one of their seeds with it: the row they stood in for is replaced, and they would only stand
    beside it, stale (`pflbench results retire-replaced`). `found`: load_result_files's."""

    def row(r: ResultRecord) -> tuple:
        return r.task.name, r.baseline, r.budget, canonical_json(set_values(r.config))

    def version(r: ResultRecord) -> int | None:
        return current_version(registry, r.task.name)

    runs = [(path, r) for path, r, _ in found if r.kind == "run" and r.config is not None]
    current: dict[tuple, set[int]] = {}
    for _, r in runs:
        if r.task.version == version(r) and record_numerics_version(r) == NUMERICS_VERSION:
            current.setdefault(row(r), set()).add(r.seed)
    older: dict[tuple, list[tuple[Path, int]]] = {}
    for path, r in runs:
        task_version = version(r)
        if task_version is None:  # a task no spec declares now
            continue
        if r.task.version < task_version or record_numerics_version(r) < NUMERICS_VERSION:
            older.setdefault(row(r), []).append((path, r.seed))
    return sorted(
        path
        for key, items in older.items()
        if {seed for _, seed in items} <= current.get(key, set())
        for path, _ in items
    )


def check_declared_seeds(
    records: list[ResultRecord], sweeps: list[tuple[Path, SweepFile]], registry: Registry
) -> None:
    """The filed results are the declared matrices, whole: every configuration a sweep file
    declares (resolved with today's specs, so at the task's current version) has exactly the
    declared seeds filed. A deleted seed or row would otherwise move what the leaderboard shows
    unseen, and a seed filed beside the declared ones (under any spelling of the configuration)
    could be a picked one. Rows of older task versions are not held to today's sweep files."""
    declared: dict[str, tuple[str, set[int], list[Path]]] = {}
    for path, sweep in sweeps:
        for group, baseline, budget, config, key in _configurations(sweep, registry, str(path)):
            sets = "".join(f" --set {item}" for item in group.set)
            name = f"{sweep.task} v{config.task.version} {baseline} @ {budget}{sets}"
            _, seeds, paths = declared.setdefault(key, (name, set(), []))
            seeds.update(group.seeds)
            if path not in paths:
                paths.append(path)
    filed: dict[str, list[int]] = {}
    for record, key in filed_runs(records):
        filed.setdefault(key, []).append(record.seed)
    problems = [
        f"{name}: seeds {sorted(filed.get(key, [])) or 'none'} filed, {sorted(seeds)} declared by "
        + ", ".join(map(str, paths))
        for key, (name, seeds, paths) in declared.items()
        if sorted(filed.get(key, [])) != sorted(seeds)
    ]
    if problems:
        raise UserError(
            "the filed results are not the declared matrix (a record deleted or added by hand, or "
            "a task version without its re-run?); run what is missing (`pflbench sweep --file "
            "...`, then `pflbench submit`) or change the sweep file:\n  " + "\n  ".join(problems)
        )


def split_filed(
    sweep: SweepFile, records: list[ResultRecord], registry: Registry, where: str
) -> tuple[list[SweepGroup], list[SweepGroup]]:
    """The sweep's runs split into those filed (a record of today's task version and numerics
    with that configuration and seed) and those still to run, one group per configuration: how a
    matrix filed over several sessions moves from sweeps/to-run/ into the manifest, sweeps/."""
    filed = {(key, r.seed) for r, key in filed_runs(records)}
    done: list[SweepGroup] = []
    left: list[SweepGroup] = []
    seen: set[tuple[str, int]] = set()  # a run two groups declare is one run
    for group, baseline, budget, _, key in _configurations(sweep, registry, where):
        new = [s for s in dict.fromkeys(group.seeds) if (key, s) not in seen]
        seen.update((key, s) for s in new)
        for part, keep in ((done, True), (left, False)):
            seeds = [s for s in new if ((key, s) in filed) == keep]
            if seeds:
                part.append(SweepGroup(baselines=[baseline], budgets=[budget], seeds=seeds,
                                       set=group.set))  # fmt: skip
    return done, left


def merge_groups(groups: list[SweepGroup]) -> list[SweepGroup]:
    """Groups of one (baselines, budgets, set) as one, their seeds joined in order, at the place
    of the first."""
    merged: dict[tuple, list[int]] = {}
    for g in groups:
        seeds = merged.setdefault((tuple(g.baselines), tuple(g.budgets), tuple(g.set)), [])
        seeds += [s for s in g.seeds if s not in seeds]
    return [
        SweepGroup(baselines=list(b), budgets=list(d), seeds=sorted(seeds), set=list(x))
        for (b, d, x), seeds in merged.items()
    ]


def check_to_run(
    records: list[ResultRecord],
    manifest: list[tuple[Path, SweepFile]],
    to_run: list[tuple[Path, SweepFile]],
    registry: Registry,
) -> None:
    """While a task's matrix is filed over sessions (sweeps/to-run/): no filed run is still
    declared to run (`pflbench results split-sweeps` moves it), and every filed run of the task's
    version is declared by the manifest or to-run, so no run beside the declared ones (a seed or
    configuration picked after the fact) joins the rows."""
    problems = []
    for path, sweep in to_run:
        done, _ = split_filed(sweep, records, registry, str(path))
        problems += [
            f"{sweep.task} {g.baselines[0]} @ {g.budgets[0]}{''.join(f' --set {x}' for x in g.set)}"
            f": seeds {g.seeds} are filed and still declared to run by {path} (run `pflbench "
            "results split-sweeps`)"
            for g in done
        ]
    tasks = {sweep.task for _, sweep in to_run}
    declared = {
        (key, seed)
        for path, sweep in manifest + to_run
        if sweep.task in tasks
        for group, _, _, _, key in _configurations(sweep, registry, str(path))
        for seed in group.seeds
    }
    for r, key in filed_runs(records):
        if (
            r.task.name in tasks
            and r.task.version == registry.task(r.task.name).spec.version
            and (key, r.seed) not in declared
        ):
            problems.append(
                f"record {r.record_id} ({r.task.name} v{r.task.version} {r.baseline} @ "
                f"{r.budget}, seed {r.seed}): no sweep file in sweeps/ or sweeps/to-run/ "
                "declares it"
            )
    if problems:
        raise UserError(
            "the filed results and the matrix still being filed disagree:\n  "
            + "\n  ".join(problems)
        )


def write_sweep_file(path: Path, sweep: SweepFile, header: str) -> None:
    """`sweep` as YAML under a comment `header` (what wrote it and why)."""
    comment = "".join(f"# {line}\n" for line in header.splitlines())
    body = dump_yaml(
        sweep.model_dump(mode="json"), sort_keys=False, width=100, default_flow_style=None
    )
    Path(path).write_text(comment + body, encoding="utf-8")


def check_sweep(sweep: SweepFile, registry: Registry) -> None:
    """Resolve each group's configs and check them as `pflbench run` does, before any run
    starts: a run that cannot start fails the sweep now, not when its turn comes hours later.
    The seed changes nothing that is checked, so each group's first stands for all."""
    for group in sweep.groups:
        for baseline in group.baselines:
            for budget in group.budgets:
                try:
                    config = resolve(
                        registry, sweep.task, baseline, budget, group.seeds[0], group.set
                    )
                    check_run(config)
                except UserError as exc:
                    sets = "".join(f" --set {item}" for item in group.set)
                    raise UserError(f"sweep run {baseline} at {budget}{sets}: {exc}") from None


def plan_sweep_file(sweep: SweepFile, out_root: Path, run_args: tuple[str, ...] = ()):
    """Every group's grid, in file order (so the first groups finish first), without repeats."""
    plan: dict[Path, PlannedRun] = {}
    for group in sweep.groups:
        grid = plan_sweep(
            sweep.task, group.baselines, group.budgets, group.seeds, group.set, out_root, run_args
        )
        plan.update({run.run_dir: run for run in grid if run.run_dir not in plan})
    return list(plan.values())


def plan_sweep(
    task: str,
    baselines: list[str],
    budgets: list[str],
    seeds: list[int],
    sets: list[str],
    out_root: Path,
    run_args: tuple[str, ...] = (),
) -> list[PlannedRun]:
    """The grid in a fixed order; --set overrides give the folder a short hash suffix."""
    safe_name(task, "task")
    suffix = "__" + hashlib.sha256("\n".join(sets).encode()).hexdigest()[:8] if sets else ""
    return [
        PlannedRun(
            task,
            safe_name(baseline, "baseline"),
            safe_name(budget, "budget"),
            seed,
            tuple(sets),
            Path(out_root) / task / f"{baseline}__{budget}__seed{seed}{suffix}",
            run_args,
        )
        for baseline in baselines
        for budget in budgets
        for seed in seeds
    ]


def run_sweep(
    plan: list[PlannedRun],
    plot_dir: Path,
    jobs: int = 1,
    on_done=lambda run, code: None,
    budgets: dict | None = None,
    declared: dict | None = None,
) -> SweepReport:
    """Run the unfinished runs, `jobs` at a time; `on_done(run, exit_code)` after each; then
    plot (budgets, declared: as plots.plot_results takes them)."""
    report = run_planned(plan, jobs, on_done)
    report.plots = plot_sweep(plan, plot_dir, budgets, declared)
    return report


def run_planned(plan: list[PlannedRun], jobs: int = 1, on_done=lambda run, code: None):
    """Run the unfinished runs, `jobs` at a time; `on_done(run, exit_code)` after each."""
    report = SweepReport(skipped=[run for run in plan if run.done])
    queue = [run for run in plan if not run.done]
    env = dict(os.environ)
    if jobs > 1 and "OMP_NUM_THREADS" not in env:
        # Each run would otherwise use every core: oversubscribed kernels run several x slower.
        env["OMP_NUM_THREADS"] = str(max(1, len(os.sched_getaffinity(0)) // jobs))
    running: list[tuple[PlannedRun, subprocess.Popen]] = []
    while queue or running:
        while queue and len(running) < jobs:
            run = queue.pop(0)
            run.run_dir.mkdir(parents=True, exist_ok=True)
            run_env = env if run.threads is None else {**env, "OMP_NUM_THREADS": str(run.threads)}
            with open(run.run_dir / "sweep.log", "ab") as log:
                proc = subprocess.Popen(
                    run.command(), stdout=log, stderr=subprocess.STDOUT, env=run_env
                )
            running.append((run, proc))
        finished = next((item for item in running if item[1].poll() is not None), None)
        if finished is None:
            time.sleep(0.5)
            continue
        running.remove(finished)
        run, code = finished[0], finished[1].returncode
        if code == 0 and run.done:
            report.finished.append(run)
        else:
            report.failed.append((run, code))
        on_done(run, code)
    return report


def plot_sweep(
    plan: list[PlannedRun],
    plot_dir: Path,
    budgets: dict | None = None,
    declared: dict | None = None,
) -> PlotReport:
    """Result figures over the grid's finished records, and each finished run's own figures."""
    finished = [run for run in plan if run.done]
    records = [load_record(run.run_dir / "record.json")[0] for run in finished]
    report = plot_results(records, plot_dir, None, budgets, declared) if records else PlotReport()
    for run in finished:
        plot_run(run.run_dir, plot_dir / "runs", report)
    return report


# Stale records (an older task version, or older numerics) are outside every other check: their
# configs no longer resolve, no sweep file declares them, and `reproduce` does not re-run them.
# So they are frozen: this list names each by path and id (a hash of its content).
STALE_LIST = "stale-records.txt"
STALE_HEADER = """\
# Filed runs of an older task version or older numerics (the leaderboard's stale rows). No check
# resolves their configs again or re-runs them, so each is pinned here by task/budget/record id,
# the id being a hash of its content: `pflbench leaderboard` and `results validate` refuse a stale
# record not listed here and a listed one that is gone. Editing, adding or deleting one is a
# change to this file, in the open. Written by `pflbench results pin-stale`.
"""


def stale_entries(records: list[ResultRecord], registry: Registry) -> list[str]:
    """'task/budget/record_id' of each filed run whose row is stale (leaderboard.stale_because)."""
    return sorted(
        stale_entry(r)
        for r in records
        if r.kind == "run" and stale_because(r, current_version(registry, r.task.name)) is not None
    )


def stale_entry(record: ResultRecord) -> str:
    return f"{record.task.name}/{record.budget}/{record.record_id}"


def current_version(registry: Registry, task: str) -> int | None:
    """The task's version in the registry; None for a task it does not hold."""
    loaded = registry.tasks.get(task)
    return loaded.spec.version if loaded is not None else None


def read_stale_list(folder: Path) -> list[str]:
    path = folder / STALE_LIST
    if not path.is_file():
        return []
    lines = (line.strip() for line in path.read_text(encoding="utf-8").splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def write_stale_list(folder: Path, entries: list[str]) -> Path:
    path = folder / STALE_LIST
    path.write_text(STALE_HEADER + "".join(f"{e}\n" for e in sorted(entries)), encoding="utf-8")
    return path


def check_stale_pinned(records: list[ResultRecord], folder: Path, registry: Registry) -> None:
    """Every stale record is listed in the folder's STALE_LIST, and every listed one is filed."""
    found, listed = set(stale_entries(records, registry)), set(read_stale_list(folder))
    filed = {stale_entry(r) for r in records if r.kind == "run"}
    problems = [f"{e}: stale, not pinned" for e in sorted(found - listed)]
    problems += [
        f"{e}: pinned, but current with the specs loaded (its task from --specs or a plug-in"
        " not loaded here?)"
        if e in filed
        else f"{e}: pinned, not filed"
        for e in sorted(listed - found)
    ]
    if problems:
        raise UserError(
            f"the stale records are not the ones {folder / STALE_LIST} pins (a record of an older"
            " task version or numerics edited, added or deleted by hand?); restore them, or"
            " re-pin after review with `pflbench results pin-stale`:\n  "
            + "\n  ".join(problems[:20])
            + (f"\n  ... {len(problems) - 20} more" if len(problems) > 20 else "")
        )
