"""Signal-to-noise matched budgets: the paper's DP noise, scaled to a smaller model and cohort.

What DP noise does to training is set by the noise norm on the averaged update relative to the
clip bound C: ‖N(0, (C·σ_DP)² I_d)‖ / C ≈ σ_DP·√d. A budget fixes σ_DP = z/S_ext, so the same budget
is ~15× weaker for a 1M-parameter model than for paper-255m. A matched budget keeps the paper
budget's ε, δ, q = S/K and T — hence its noise multiplier z — and scales the extrapolated cohort
(and population, keeping q) by √(d_small/d_paper), so that σ_DP·√d is the paper's.

The averaged update also carries client-sampling noise of norm ≈ C/√S_run (S_run clipped updates
of norm C averaged). At the paper's S_run = 1,024 the DP noise dominates it; at a CPU task's 16 it
is 5× the matched DP noise. A cohort-matched budget also keeps that ratio, σ_DP·√(d·S_run), by a
further factor √(S_run/1024). Both stay honest (ε, δ) statements, at smaller extrapolated
populations (docs/BUDGETS.md).
"""

from __future__ import annotations

import math

from pflbench.errors import UserError
from pflbench.spec.models import Budget

PAPER_PRESET = "paper-255m"  # the model the paper's budgets were run with (002 App. F)
PAPER_RUN_COHORT = 1024  # the cohort of the paper's FL + DP runs (002 Table 1)


def model_parameters(preset: str, vocab_size: int = 30) -> int:
    """Built on the meta device: shapes only (paper-255m's 1 GB of weights is neither allocated
    nor initialized, and no random number is drawn)."""
    import torch

    from pflbench.model.transformer import build_model, count_parameters

    with torch.device("meta"):
        return count_parameters(build_model(preset, vocab_size))


def noise_to_clip_ratio(sigma_dp: float, parameters: int) -> float:
    """σ_DP·√d: the expected norm of the DP noise on the averaged update, in units of C."""
    return sigma_dp * math.sqrt(parameters)


def noise_to_sampling_ratio(sigma_dp: float, parameters: int, run_cohort: int) -> float:
    """σ_DP·√(d·S): the DP noise norm over the client-sampling noise norm C/√S of an average of
    S clipped updates of norm C."""
    return noise_to_clip_ratio(sigma_dp, parameters) * math.sqrt(run_cohort)


def matched_scale(
    paper: Budget, parameters: int, paper_parameters: int, run_cohort: int | None = None
) -> dict:
    """Budget fields matching `paper` for a model of `parameters` (and, given `run_cohort`, for
    runs of that cohort against the paper's 1,024)."""
    if not paper.dp:
        raise UserError(f"budget {paper.name!r} is not a DP budget: it has no noise to match")
    factor = math.sqrt(parameters / paper_parameters)
    if run_cohort is not None:
        factor *= math.sqrt(run_cohort / PAPER_RUN_COHORT)
    cohort = round(paper.cohort * factor)
    population = round(cohort * paper.population / paper.cohort)  # keeps q = S/K
    fields = {
        "epsilon": paper.epsilon,
        "delta": paper.delta,
        "population": population,
        "cohort": cohort,
        "steps": paper.steps,
        "matches": paper.name,
        "matched_parameters": parameters,
    }
    if run_cohort is not None:
        fields["matched_cohort"] = run_cohort
    return fields


def match_report(budget: Budget, paper: Budget, paper_parameters: int) -> dict:
    """The matched ratio of `budget` at its model size (and run cohort) next to the paper
    budget's at paper-255m and cohort 1,024."""
    from pflbench.privacy.statement import budget_noise

    sigma, paper_sigma = budget_noise(budget)["sigma_dp"], budget_noise(paper)["sigma_dp"]
    report = {
        "matches": paper.name,
        "matched_parameters": budget.matched_parameters,
        "paper_parameters": paper_parameters,
        "noise_to_clip_ratio": noise_to_clip_ratio(sigma, budget.matched_parameters),
        "paper_noise_to_clip_ratio": noise_to_clip_ratio(paper_sigma, paper_parameters),
    }
    ours, theirs = report["noise_to_clip_ratio"], report["paper_noise_to_clip_ratio"]
    if budget.matched_cohort is not None:
        report["matched_cohort"] = budget.matched_cohort
        report["paper_run_cohort"] = PAPER_RUN_COHORT
        ours = report["noise_to_sampling_ratio"] = noise_to_sampling_ratio(
            sigma, budget.matched_parameters, budget.matched_cohort
        )
        theirs = report["paper_noise_to_sampling_ratio"] = noise_to_sampling_ratio(
            paper_sigma, paper_parameters, PAPER_RUN_COHORT
        )
    report["relative_difference"] = ours / theirs - 1
    return report
