"""Signal-to-noise matched budgets: the paper's DP noise, scaled to a smaller model.

What DP noise does to training is set by the noise norm on the averaged update relative to the
clip bound C: ‖N(0, (C·σ_DP)² I_d)‖ / C ≈ σ_DP·√d. A budget fixes σ_DP = z/S_ext, so the same budget
is ~15× weaker for a 1M-parameter model than for paper-255m. A matched budget keeps the paper
budget's ε, δ, q = S/K and T — hence its noise multiplier z — and scales the extrapolated cohort
(and population, keeping q) by √(d_small/d_paper), so that σ_DP·√d is the paper's. It remains an
honest (ε, δ) statement, at a smaller extrapolated population (docs/BUDGETS.md).
"""

from __future__ import annotations

import math

from pflbench.spec.models import Budget

PAPER_PRESET = "paper-255m"  # the model the paper's budgets were run with (002 App. F)


def model_parameters(preset: str, vocab_size: int = 30) -> int:
    from pflbench.model.transformer import build_model, count_parameters

    return count_parameters(build_model(preset, vocab_size))


def noise_to_clip_ratio(sigma_dp: float, parameters: int) -> float:
    """σ_DP·√d: the expected norm of the DP noise on the averaged update, in units of C."""
    return sigma_dp * math.sqrt(parameters)


def matched_scale(paper: Budget, parameters: int, paper_parameters: int) -> dict:
    """Cohort and population of the budget matching `paper` for a model of `parameters`."""
    if not paper.dp:
        raise ValueError(f"budget {paper.name!r} has no noise to match")
    cohort = round(paper.cohort * math.sqrt(parameters / paper_parameters))
    population = round(cohort * paper.population / paper.cohort)  # keeps q = S/K
    return {
        "epsilon": paper.epsilon,
        "delta": paper.delta,
        "population": population,
        "cohort": cohort,
        "steps": paper.steps,
        "matches": paper.name,
        "matched_parameters": parameters,
    }


def match_report(budget: Budget, paper: Budget, paper_parameters: int) -> dict:
    """σ_DP·√d of a matched budget at its model size next to the paper budget's at paper-255m."""
    from pflbench.privacy.statement import budget_noise

    ours = noise_to_clip_ratio(budget_noise(budget)["sigma_dp"], budget.matched_parameters)
    theirs = noise_to_clip_ratio(budget_noise(paper)["sigma_dp"], paper_parameters)
    return {
        "matches": paper.name,
        "noise_to_clip_ratio": ours,
        "matched_parameters": budget.matched_parameters,
        "paper_noise_to_clip_ratio": theirs,
        "paper_parameters": paper_parameters,
        "relative_difference": ours / theirs - 1,
    }
