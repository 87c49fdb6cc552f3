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


def largest_users(store, n: int) -> list[tuple[str, list]]:
    """(user, utterances) of the `n` users of `store` with the most utterances."""
    users = sorted(store.users(), key=lambda u: (-store.user_num_utterances(u), u))[:n]
    return [(u, store.load_user(u)) for u in users]
