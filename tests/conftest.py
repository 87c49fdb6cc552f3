"""Shared fixtures: a session-wide tiny synthetic corpus and the prepared stores of a tiny task."""

from __future__ import annotations

from pathlib import Path

import pytest

from pflbench.spec.models import DataSource, EvalSet, SyntheticData, Task


def tiny_synth_task(name: str = "synth-tiny-test") -> Task:
    """Like tasks/synth-cv-en-ls-seed.yaml, on the tiny synthetic corpora."""
    return Task(
        name=name,
        version=1,
        language="en",
        description="tiny synthetic task for tests",
        synthetic=SyntheticData(language="en", size="tiny", seed=0),
        seed_data=DataSource(corpus="librispeech", subsets=["train-clean-100"]),
        federated_data=DataSource(corpus="commonvoice", subsets=["train"], locale="en"),
        eval_sets=[
            EvalSet(name="cv-dev", corpus="commonvoice", subset="dev", locale="en", role="dev"),
            EvalSet(name="cv-test", corpus="commonvoice", subset="test", locale="en", role="test"),
            EvalSet(name="ls-dev-clean", corpus="librispeech", subset="dev-clean", role="dev"),
        ],
    )


@pytest.fixture(scope="session")
def tiny_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("pflbench-cache")


@pytest.fixture(scope="session")
def tiny_task() -> Task:
    return tiny_synth_task()


@pytest.fixture(scope="session")
def tiny_task_data(tiny_task: Task, tiny_cache_dir: Path):
    """TaskData of `tiny_task`: seed (LS-like train-clean-100), federated (CV-like train), evals."""
    from pflbench.data.prepare import prepare_task

    return prepare_task(tiny_task, cache_dir=tiny_cache_dir, progress=False)


@pytest.fixture(scope="session")
def tiny_corpus_root(tiny_task: Task, tiny_cache_dir: Path, tiny_task_data) -> Path:
    """Root with LibriSpeech/ (train-clean-100, dev-clean, test-clean) and
    cv-corpus-13.0-2023-03-09/en/ (train, dev, test, validated), size tiny, seed 0."""
    from pflbench.data.prepare import synth_root

    return synth_root(tiny_task, tiny_cache_dir)


def make_algorithm(recipe, model, names: list[str], seed: int = 0, device: str = "cpu",
                   sampling_rate: float = 1.0):  # fmt: skip
    """The client algorithm `recipe` names, for trainers built by hand (its users' state in a
    temporary folder kept alive by the algorithm)."""
    import tempfile

    from pflbench.fl.algorithms import CLIENT_ALGORITHMS, AlgorithmContext
    from pflbench.fl.user_state import UserStateStore

    folder = tempfile.TemporaryDirectory(prefix="pflbench-test-user-state-")
    named = dict(model.named_parameters())
    context = AlgorithmContext(
        names=list(names),
        params=[named[n].detach().to(device) for n in names],
        seed=seed,
        device=device,
        user_states=UserStateStore(Path(folder.name)),
        sampling_rate=sampling_rate,
    )
    algorithm = CLIENT_ALGORITHMS[recipe.algorithm](recipe, context)
    algorithm._test_folder = folder
    return algorithm


def make_mechanism(privacy, users, sigma_dp: float = 0.0, cohort: int | None = None,
                   sampling: str = "fixed", seed: int = 0, device: str = "cpu",
                   clip_bound: float | None = None):  # fmt: skip
    """The privacy mechanism `privacy` (a PrivacyRecipe or its fields) names, for aggregators
    built by hand: over `users` (ids, or how many), cohorts of `cohort` (default: everyone), so
    its denominator is min(cohort, users) for fixed sampling and qK for Poisson; `clip_bound`: a
    bound C_t the adaptation has moved to."""
    import torch

    from pflbench.privacy.mechanisms import PRIVACY_MECHANISMS, MechanismContext
    from pflbench.spec.models import Recipe

    if isinstance(users, int):
        users = [f"u{i}" for i in range(users)]
    fed = {"sampling": sampling, "cohort_size": cohort or len(users)}
    recipe = Recipe.model_validate({"privacy": privacy, "federated": fed})
    context = MechanismContext(users, sigma_dp, seed, device)
    mechanism = PRIVACY_MECHANISMS[recipe.privacy.mechanism](recipe, context)
    if clip_bound is not None:
        mechanism.load_state_dict({"clip_bound": torch.tensor(clip_bound, dtype=torch.float64)})
    return mechanism
