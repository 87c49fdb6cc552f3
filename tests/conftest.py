"""Shared fixtures: a session-wide tiny synthetic corpus and the prepared stores of a tiny task.

pyproject's addopts run the suite on pytest-xdist workers (`-n auto`, `-n 0` for one process):
the workers share the session's cache, and each takes its share of the cores' threads."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import torch

from pflbench.numerics import NUMERICS_CHANGES, NUMERICS_SCOPES
from pflbench.spec.models import DataSource, EvalSet, SyntheticData, Task

# A numerics version whose runs, with DP or without, are stale now: one before the latest change
# that touches every run (NUMERICS_SCOPES: later ones touch only some).
STALE_NUMERICS = max(v for v in NUMERICS_CHANGES if v not in NUMERICS_SCOPES) - 1


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


def pytest_configure(config: pytest.Config) -> None:
    """An xdist worker takes its share of the cores' intra-op threads, as a `pflbench sweep --jobs`
    run does (N workers with all the threads each would oversubscribe the cores); the runs and
    the processes the tests start read it from OMP_NUM_THREADS."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers:
        threads = max(1, len(os.sched_getaffinity(0)) // int(workers))
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """On xdist workers the tests marked slow go first, so that the workers end together on
    short tests instead of one finishing a long test alone."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable


@pytest.fixture(scope="session")
def tiny_cache_dir(tmp_path_factory: pytest.TempPathFactory, worker_id: str) -> Path:
    """The session's cache. xdist's workers share one, beside their own temp folders: the first
    to take prepare_task's lock builds the corpora and stores, the others then reuse them."""
    if worker_id == "master":
        return tmp_path_factory.mktemp("pflbench-cache")
    shared = tmp_path_factory.getbasetemp().parent / "pflbench-cache"
    shared.mkdir(exist_ok=True)
    return shared


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


def free_port() -> int:
    """A free TCP port for a process group's rendezvous (processes spawned by a test)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def largest_users(store, n: int) -> list[tuple[str, list]]:
    """(user, utterances) of the `n` users of `store` with the most utterances."""
    users = sorted(store.users(), key=lambda u: (-store.user_num_utterances(u), u))[:n]
    return [(u, store.load_user(u)) for u in users]
