"""Per-group WER: how a row's errors fall on speaker groups (age, gender, accent), and how much
of DP's cost each group pays.

A record stores, per eval set, the pooled word errors / words of each group's speakers
(`EvalResult.groups`). A row's group WER is the mean over its seeds. The worst group is taken
among groups of at least MIN_SPEAKERS speakers (smaller ones are too noisy to rank), leaving out
"unreported". The DP gap of a group is the row's group WER minus the group WER of its no-DP
partner: the row with the same baseline and configuration except the seed and the budget.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from pflbench.results.schema import ResultRecord, record_numerics_version, record_ran_hash
from pflbench.spec.resolve import set_values

MIN_SPEAKERS = 5
UNREPORTED = "unreported"
# Common Voice's age labels (its own spelling "fourties"), youngest first: a figure's columns in
# this order read as a trend, where alphabetical order (fifties, fourties, teens, ...) does not.
AGES = ("teens", "twenties", "thirties", "fourties", "fifties", "sixties", "seventies",
        "eighties", "nineties")  # fmt: skip


def in_natural_order(names) -> list[str]:
    """Group names in the order a reader expects: ages youngest first, others alphabetically
    (after the ages, should an attribute mix both)."""
    return sorted(names, key=lambda n: (AGES.index(n), "") if n in AGES else (len(AGES), n))


@dataclass(frozen=True)
class GroupWer:
    wer: float  # mean over the row's seeds
    speakers: int


def with_group_counts(records, eval_set: str) -> list[ResultRecord]:
    """The records (seeds) whose result on `eval_set` carries group counts."""
    return [r for r in records if eval_set in r.metrics.final and r.metrics.final[eval_set].groups]


def row_group_wers(records, eval_set: str) -> dict[str, dict[str, GroupWer]]:
    """attribute -> group -> mean WER over the records (seeds) that carry groups."""
    per_seed = [r.metrics.final[eval_set].groups for r in with_group_counts(records, eval_set)]
    out: dict[str, dict[str, GroupWer]] = {}
    for attribute in sorted({a for groups in per_seed for a in groups}):
        names = sorted({g for groups in per_seed for g in groups.get(attribute, {})})
        out[attribute] = {}
        for name in names:
            found = [groups[attribute][name] for groups in per_seed if name in groups[attribute]]
            wers = [g.wer for g in found if g.wer is not None]
            if wers:
                out[attribute][name] = GroupWer(statistics.fmean(wers), found[0].speakers)
    return out


def is_ranked(name: str, group: GroupWer) -> bool:
    """A group large enough, and labelled, to be ranked against the others."""
    return name != UNREPORTED and group.speakers >= MIN_SPEAKERS


def rows_with_groups(rows, eval_set: str) -> list[tuple]:
    """(row, its group WERs) for the rows whose records carry group counts on `eval_set`."""
    found = [(row, row_group_wers(row.records, eval_set)) for row in rows]
    return [(row, groups) for row, groups in found if groups]


def dp_pairs(with_groups: list[tuple], is_dp) -> list[tuple]:
    """(row, its group WERs, its no-DP partner's group WERs) for every DP row with a partner."""
    no_dp = {
        partner_key(row.first): groups for row, groups in with_groups if not is_dp(row.first.budget)
    }
    return [
        (row, groups, no_dp[partner_key(row.first)])
        for row, groups in with_groups
        if is_dp(row.first.budget) and partner_key(row.first) in no_dp
    ]


def worst_group(groups: dict[str, dict[str, GroupWer]]) -> tuple[str, str, GroupWer] | None:
    """(attribute, group, its WER) of the highest WER among ranked groups, or None."""
    ranked = [
        (g.wer, attribute, name, g)
        for attribute, by_name in groups.items()
        for name, g in by_name.items()
        if is_ranked(name, g)
    ]
    if not ranked:
        return None
    _, attribute, name, g = max(ranked, key=lambda t: (t[0], t[1], t[2]))
    return attribute, name, g


def row_label(record: ResultRecord) -> str:
    """The baseline, with the run's --set overrides when it has any (a cohort-sweep row)."""
    overrides = set_values(record.config or {})
    if not overrides:
        return record.baseline
    return f"{record.baseline} [{', '.join(f'{k}={v}' for k, v in sorted(overrides.items()))}]"


def partner_key(record: ResultRecord) -> tuple[str, int, str]:
    """Rows that differ only in the seed and the budget share this key (the config holds the
    task's version; the numerics version is the code's, so a stale row pairs only with one as
    stale)."""
    return (
        record.baseline,
        record_numerics_version(record),
        record_ran_hash(record, ("seed", "budget")),
    )


def group_eval_set(records: list[ResultRecord]) -> str | None:
    """The first test set (by name) whose results carry groups, else the first dev set."""
    found = {
        (result.role != "test", name)
        for r in records
        for name, result in r.metrics.final.items()
        if result.groups
    }
    return min(found)[1] if found else None


def _pct(value: float) -> str:
    return f"{100 * value:.2f}"


def render_groups(rows, is_dp, cell, label) -> str:
    """Markdown: the worst-group table and, per attribute, the DP gap per group.
    rows: leaderboard Rows of one task; is_dp(budget name) -> bool; cell escapes text;
    label(row): the row's baseline cell as the leaderboard's tables show it (stale rows marked)."""
    records = [r for row in rows for r in row.records]
    eval_set = group_eval_set(records)
    if eval_set is None:
        return ""
    with_groups = rows_with_groups(rows, eval_set)
    with_groups.sort(
        key=lambda t: (is_dp(t[0].first.budget), t[0].first.budget, t[0].first.baseline)
    )
    lines = [
        f"### per-group WER on {cell(eval_set)}\n",
        "WER in % of each speaker group (the corpus's age, gender and accent labels), mean over "
        "the seeds whose records carry group counts. Worst group: the highest WER among groups "
        f"of ≥ {MIN_SPEAKERS} speakers (unreported left out).\n",
        "| baseline | budget | seeds | WER | worst group | worst-group WER | best-group WER |",
        "|---|---|---|---|---|---|---|",
    ]
    for row, groups in with_groups:
        worst = worst_group(groups)
        ranked = [
            g.wer for by_name in groups.values() for n, g in by_name.items() if is_ranked(n, g)
        ]
        wers = [r.metrics.final[eval_set].wer for r in with_group_counts(row.records, eval_set)]
        cells = [label(row), cell(row.first.budget), str(len(wers))]
        cells += [_pct(statistics.fmean(wers))]
        if worst is None:
            cells += ["–", "–", "–"]
        else:
            attribute, name, g = worst
            cells += [
                cell(f"{attribute}={name} ({g.speakers} spk)"),
                _pct(g.wer),
                _pct(min(ranked)),
            ]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    lines.append(render_dp_gaps(with_groups, is_dp, cell, label))
    return "\n".join(lines)


def render_dp_gaps(with_groups, is_dp, cell, label) -> str:
    """Per attribute: for each DP row with a no-DP partner, group WER minus the partner's."""
    pairs = dp_pairs(with_groups, is_dp)
    if not pairs:
        return ""
    parts = [
        "DP's cost per group: group WER under the budget minus the same baseline's group WER "
        "without DP (percentage points; positive = DP costs that group WER).\n"
    ]
    for attribute in sorted({a for _, groups, _ in pairs for a in groups}):
        names = sorted(
            {
                n
                for _, groups, base in pairs
                for n in groups.get(attribute, {})
                if n in base.get(attribute, {})
            }
        )
        if not names:
            continue
        speakers = {n: g.speakers for _, groups, _ in pairs for n, g in groups[attribute].items()}
        head = ["baseline", "budget", *(f"{cell(n)} ({speakers[n]} spk)" for n in names)]
        parts += [
            f"**{cell(attribute)}**\n",
            "| " + " | ".join(head) + " |",
            "|" + "---|" * len(head),
        ]
        for row, groups, base in pairs:
            cells = [label(row), cell(row.first.budget)]
            for n in names:
                a, b = groups.get(attribute, {}).get(n), base.get(attribute, {}).get(n)
                cells.append("–" if a is None or b is None else f"{100 * (a.wer - b.wer):+.2f}")
            parts.append("| " + " | ".join(cells) + " |")
        parts.append("")
    return "\n".join(parts)
