"""User partitions: seeded "p% of users" splits and IID reassignment (PAPER.md, Sec. 4.2)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import replace

import numpy as np

from pflbench.data.corpora import Entry


def users_digest(users: Iterable[str]) -> str:
    """sha256 of the sorted, de-duplicated user list."""
    return hashlib.sha256("\n".join(sorted(set(users))).encode()).hexdigest()


def _rank_key(seed: int, user: str) -> str:
    return hashlib.sha256(f"{seed}:{user}".encode()).hexdigest()


def users_in_split(users: Iterable[str], percent: float, seed: int) -> set[str]:
    """The `percent`% of users (rounded) with the smallest seeded hash: the same on every machine
    whatever the row order; its complement is the `out` part."""
    ranked = sorted(set(users), key=lambda u: _rank_key(seed, u))
    return set(ranked[: round(len(ranked) * percent / 100)])


def apply_user_split(entries: list[Entry], percent: float, part: str, seed: int) -> list[Entry]:
    chosen = users_in_split((e.user_id for e in entries), percent, seed)
    keep_in = part == "in"
    return [e for e in entries if (e.user_id in chosen) == keep_in]


def iid_reassign(entries: list[Entry], seed: int) -> list[Entry]:
    """Each utterance gets a user id drawn uniformly from the set of user ids (order independent:
    utterances are ordered by id before drawing)."""
    users = sorted({e.user_id for e in entries})
    ordered = sorted(entries, key=lambda e: e.utt_id)
    draws = np.random.default_rng([seed, 7]).integers(len(users), size=len(ordered))
    return [replace(e, user_id=users[i]) for e, i in zip(ordered, draws, strict=True)]
