"""CLI: privacy epsilon | noise | report: the accountants from the command line."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import typer
from rich.table import Table

from pflbench.cli.common import JsonOption, PluginOption, SpecsOption, console, print_json
from pflbench.errors import UserError
from pflbench.privacy.accountants import (
    ACCOUNTANTS,
    calibrate_noise,
    calibrating,
    check_delta,
    compute_epsilon,
)
from pflbench.privacy.accounting import SampledGaussian, sampled_gaussian
from pflbench.privacy.statement import check_scale, epsilon_entry, privacy_statement
from pflbench.spec.models import PrivacyRecipe

privacy_app = typer.Typer(
    help="Privacy accounting: epsilon of a mechanism, noise for a target, run statements.",
    no_args_is_help=True,
)


# --accountant help: the built-in names, e.g. "rdp, pld or all" (plug-ins may add more).
ANY_OR_ALL = ", ".join(ACCOUNTANTS) + " or all"
ANY_CALIBRATING = " or ".join(calibrating())


def accountant_names(accountant: str, allow_all: bool) -> list[str]:
    """The accountants --accountant names: any registered one (or all), or, without allow_all,
    one that can calibrate noise."""
    if allow_all and accountant == "all":
        return list(ACCOUNTANTS)
    allowed = tuple(ACCOUNTANTS) if allow_all else calibrating()
    if accountant not in allowed:
        choices = ", ".join(allowed) + " or all" if allow_all else " or ".join(allowed)
        raise UserError(f"--accountant: unknown accountant {accountant!r}; choose {choices}")
    return [accountant]


def epsilon_cell(entry: dict | None) -> str:
    """One accountant's epsilon in a statement: None means no noise, "error" a skipped one."""
    if entry is None:
        return "inf (no DP)"
    if entry.get("error"):
        return "not computed (why: below)"
    return f"{entry['epsilon']:.4g}"


@privacy_app.command("epsilon")
def epsilon(
    noise_multiplier: float = typer.Option(..., "--noise-multiplier", help="z: noise std / C."),
    sampling_rate: float = typer.Option(..., "--sampling-rate", help="q: Poisson sampling rate."),
    steps: int = typer.Option(..., "--steps", help="T: number of central steps."),
    delta: float = typer.Option(..., "--delta", help="δ of (ε, δ)-DP, in (0, 1)."),
    accountant: str = typer.Option("rdp", "--accountant", help=f"{ANY_OR_ALL}."),
    json: bool = JsonOption,
) -> None:
    """Epsilon of the Poisson-subsampled Gaussian mechanism composed T times (with `all`, an
    accountant that cannot compute it says why instead)."""
    names = accountant_names(accountant, allow_all=True)
    mechanism = SampledGaussian(noise_multiplier, sampling_rate, steps)
    mechanism.check()
    check_delta(delta)
    entries = [epsilon_entry(mechanism, delta, n) for n in names]
    if len(entries) == 1 and entries[0]["epsilon"] is None:
        raise UserError(entries[0]["error"])
    if json:
        print_json({e["accountant"]: e for e in entries})
        return
    table = Table(title=f"z={noise_multiplier:g}  q={sampling_rate:g}  T={steps}  delta={delta:g}")
    for column in ("accountant", "epsilon", "RDP order", "library", "how"):
        table.add_column(column)
    for e in entries:
        if e["epsilon"] is None:
            table.add_row(e["accountant"], "not computed", "", "", e["error"])
            continue
        table.add_row(
            e["accountant"],
            f"{e['epsilon']:.4g}",
            "" if e["order"] is None else f"{e['order']:g}",
            f"{e['library']} {e['library_version']}",
            ACCOUNTANTS[e["accountant"]].summary(e["details"]),
        )
    console.print(table)


@privacy_app.command("noise")
def noise(
    epsilon: float = typer.Option(..., "--epsilon", help="Target epsilon."),
    delta: float = typer.Option(..., "--delta", help="δ of (ε, δ)-DP, in (0, 1)."),
    population: int = typer.Option(..., "--population", help="K: number of users."),
    cohort: int = typer.Option(..., "--cohort", help="S = qK: expected cohort size."),
    steps: int = typer.Option(..., "--steps", help="T: number of central steps."),
    accountant: str = typer.Option("rdp", "--accountant", help=f"{ANY_CALIBRATING}."),
    json: bool = JsonOption,
) -> None:
    """Smallest noise multiplier z with epsilon <= target, and sigma_dp = z / S."""
    (name,) = accountant_names(accountant, allow_all=False)
    check_scale(cohort, population, steps)
    q = cohort / population
    z = calibrate_noise(epsilon, sampled_gaussian(q, steps), delta, name)
    achieved = compute_epsilon(SampledGaussian(z, q, steps), delta, name)
    record = {
        "accountant": name,
        "target_epsilon": epsilon,
        "delta": delta,
        "population": population,
        "cohort": cohort,
        "steps": steps,
        "sampling_rate": q,
        "noise_multiplier": z,
        "sigma_dp": z / cohort,
        "achieved": asdict(achieved),
    }
    if json:
        print_json(record)
        return
    table = Table(title=f"noise for epsilon <= {epsilon:g} at delta={delta:g} ({name})")
    table.add_column("quantity")
    table.add_column("value")
    table.add_row("sampling rate q = S/K", f"{q:.6g}")
    table.add_row("noise multiplier z", f"{z:.6g}")
    table.add_row("sigma_dp = z/S", f"{z / cohort:.6g}")
    table.add_row("achieved epsilon", f"{achieved.epsilon:.6g}")
    console.print(table)


@privacy_app.command("report")
def report(
    sigma_dp: float = typer.Option(..., "--sigma-dp", help="Noise std of the average / C."),
    cohort: int = typer.Option(..., "--cohort", help="S: (expected) cohort size simulated."),
    population: int = typer.Option(..., "--population", help="K: users simulated."),
    steps: int = typer.Option(..., "--steps", help="T: central steps simulated."),
    delta: float = typer.Option(..., "--delta", help="δ of (ε, δ)-DP, in (0, 1)."),
    budget: str | None = typer.Option(None, "--budget", help="Also at this budget's scale."),
    clip_bound: float = typer.Option(
        PrivacyRecipe().clip_bound,
        "--clip-bound",
        help="C, stated in the report (ε does not depend on it: σ_DP is relative to C).",
    ),
    sampling: str = typer.Option("poisson", "--sampling", help="poisson or fixed."),
    accountant: str = typer.Option("all", "--accountant", help=f"{ANY_OR_ALL}."),
    specs: list[Path] | None = SpecsOption,
    plugins: list[str] = PluginOption,
    json: bool = JsonOption,
) -> None:
    """Epsilon of a run at its simulated scale and, with --budget, at the budget's scale."""
    names = accountant_names(accountant, allow_all=True)
    if not 0 < delta < 1:
        raise UserError(f"--delta must be in (0, 1), got {delta}")
    budget_spec = None
    if budget is not None:
        from pflbench.cli.common import load_specs

        budget_spec = load_specs(specs, plugins).budget(budget).spec
    statement = privacy_statement(
        sigma_dp, clip_bound, cohort, population, steps, delta, sampling, budget_spec, names
    )
    if json:
        print_json(statement)
        return
    table = Table(title=f"sigma_dp={sigma_dp:g}  C={clip_bound:g}  sampling={sampling}")
    for column in ("scale", "K", "S", "T", "q", "z", "delta", *(f"eps {n}" for n in names)):
        table.add_column(column)
    scales = [("simulated", statement["simulated"]), ("extrapolated", statement["extrapolated"])]
    for label, scale in scales:
        if scale is None:
            continue
        eps = [epsilon_cell(scale["epsilon"][n]) for n in names]
        table.add_row(
            label if label == "simulated" else f"{label} ({scale['budget']})",
            str(scale["population"]),
            str(scale["cohort"]),
            str(scale["steps"]),
            f"{scale['sampling_rate']:.4g}",
            f"{scale['noise_multiplier']:.4g}",
            f"{scale['delta']:g}",
            *eps,
        )
    console.print(table)
    for label, scale in scales:
        for name in names:
            entry = (scale or {}).get("epsilon", {}).get(name) or {}
            if entry.get("error"):
                console.print(
                    f"eps {name}, {label}: not computed: {entry['error']}",
                    highlight=False,
                    markup=False,
                )
    console.print(statement["how"], highlight=False)


def register(app: typer.Typer) -> None:
    app.add_typer(privacy_app, name="privacy")
