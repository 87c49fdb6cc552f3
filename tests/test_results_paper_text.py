"""The papers' reference rows against the papers' own text: every WER that results/paper/tables.yaml
transcribes, and every noise line (z, C, S, K, q, T, ε, Rényi order), is printed in its table.

The tables' text lies in results/paper/tables-text.txt, verbatim lines of the papers' extracted
text (seeds/00N_*.txt, which are not part of the repository): each table's caption through the
end of its body. Where the papers' text is at hand (../shared/seeds), the file must be what it
gives; `python tests/test_results_paper_text.py SEEDS_DIR` rewrites it.
"""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).parents[1]
MAP = REPO / "results" / "paper" / "tables.yaml"
TEXT = REPO / "results" / "paper" / "tables-text.txt"
SEEDS = REPO.parent / "shared" / "seeds"

CAPTION = re.compile(r"^Table \d+:")
HEADER = re.compile(r"^=== (\d{3}) (Table \d+) \((\S+) lines (\d+)-(\d+)\) ===$")
# A number as the tables print it: 1,737,650 and 62.87 (also inside \numprint{62.87}).
NUMBER = re.compile(r"(?<![\d.])(\d{1,3}(?:,\d{3})+|\d+(?:\.\d+)?)")
# ε as 002's text prints it, 1.1106\cdot 10^{6} (the mantissa 1.1 runs into a rendered "10" and
# the exponent), or as 001's, $1.1 \cdot 10^6$.
POWER = re.compile(r"(\d+(?:\.\d+)?)\s*\\cdot\s*\{?10\^\{?(-?\d+)\}?")


# Noise lines whose printed z is not σ_DP·S, as the paper prints them: Table 17's σ_DP = 0.625e-6
# lines give z = 0.0006144, 0.06144, 0.12288 = 6e-7·S (their ε follows from that z).
Z_NOT_SIGMA_TIMES_COHORT = {("002", "Table 17", 6.25e-7)}


def load_map() -> dict:
    return yaml.safe_load(MAP.read_text())


def cited_tables(paper_map: dict) -> list[tuple[str, str]]:
    """The tables the map transcribes numbers from (rows with a WER, or noise lines)."""
    return [
        (table["paper"], table["table"])
        for table in paper_map["tables"]
        if table.get("noise") or any(row.get("wer") for row in table.get("rows", []))
    ]


def table_block(lines: list[str], table: str) -> tuple[int, int]:
    """1-based first and last line of `table`: its caption, then its body up to the first blank
    line after it or the next table's caption (001's captions are followed by a blank line before
    the body; 002's tables follow each other without one)."""
    starts = [i for i, line in enumerate(lines) if line.startswith(f"{table}:")]
    if len(starts) != 1:
        raise ValueError(f"{table}: {len(starts)} captions in the text")
    end = starts[0] + 1
    while end < len(lines) and not lines[end].strip():
        end += 1
    while end < len(lines) and lines[end].strip() and not CAPTION.match(lines[end]):
        end += 1
    return starts[0] + 1, end


def extract(seeds: Path, paper_map: dict) -> str:
    out = []
    for paper, table in cited_tables(paper_map):
        (source,) = sorted(seeds.glob(f"{paper}_*.txt"))
        lines = source.read_text().splitlines()
        first, last = table_block(lines, table)
        out.append(f"=== {paper} {table} ({source.name} lines {first}-{last}) ===")
        out.extend(lines[first - 1 : last])
    return "\n".join(out) + "\n"


def read_text_file() -> dict[tuple[str, str], list[str]]:
    blocks: dict[tuple[str, str], list[str]] = {}
    current = None
    for line in TEXT.read_text().splitlines():
        if match := HEADER.match(line):
            current = blocks.setdefault((match[1], match[2]), [])
        else:
            current.append(line)
    return blocks


def numbers(line: str) -> set[float]:
    return {float(token.replace(",", "")) for token in NUMBER.findall(line)}


def powers(line: str) -> set[float]:
    found = set()
    for mantissa, exponent in POWER.findall(line):
        if mantissa.endswith("10" + exponent.lstrip("-")) and "." in mantissa[: -2 - len(exponent)]:
            mantissa = mantissa[: -2 - len(exponent.lstrip("-"))]
        found.add(float(mantissa) * 10.0 ** int(exponent))
    return found


def prints_noise_line(line: str, noise: dict) -> bool:
    """The line prints all of the noise entry's numbers (ε as a power of ten)."""
    fields = ("clip_bound", "cohort", "population", "steps", "z", "q", "order")
    if not {float(noise[k]) for k in fields if k in noise} <= numbers(line):
        return False
    epsilon = noise.get("epsilon")
    return epsilon is None or any(math.isclose(e, epsilon, rel_tol=1e-9) for e in powers(line))


def transcription_errors(paper_map: dict, blocks: dict) -> list[str]:
    """Every transcribed number that its table's text does not print."""
    errors = []
    for table in paper_map["tables"]:
        key = (table["paper"], table["table"])
        if key not in cited_tables(paper_map):
            continue
        where = f"{key[0]} {key[1]}"
        block = blocks.get(key)
        if block is None:
            errors.append(f"{where}: not in {TEXT.name}")
            continue
        printed = set().union(*(numbers(line) for line in block))
        for row in table.get("rows", []):
            for eval_set, wer in (row.get("wer") or {}).items():
                if float(wer) not in printed:
                    errors.append(f"{where}, {row['row']!r} {row['column']!r}: {eval_set} {wer}")
        for noise in table.get("noise", []):
            if not any(prints_noise_line(line, noise) for line in block):
                errors.append(f"{where}: no line prints the noise entry {noise}")
            sigma_dp = float(noise["sigma_dp"])
            if (
                "z" in noise
                and not math.isclose(sigma_dp, noise["z"] / noise["cohort"], rel_tol=1e-6)
                and (*key, sigma_dp) not in Z_NOT_SIGMA_TIMES_COHORT
            ):
                errors.append(f"{where}: σ_DP {noise['sigma_dp']} is not z/S in {noise}")
    return errors


def test_every_transcribed_number_is_printed_in_its_table():
    paper_map = load_map()
    blocks = read_text_file()
    assert transcription_errors(paper_map, blocks) == []


@pytest.mark.parametrize(
    ("table_index", "edit", "message"),
    [
        # a WER with its last two digits swapped (Table 9, LARS at cohort 8: 70.43)
        ((("002", "Table 9"), "002-t9-cv-en-scratch-server-lars-s8"), ("cv-dev", 70.34), "70.34"),
        # a noise line's population off by one digit
        ((("002", "Table 1"), None), ("population", 6950060), "6950060"),
    ],
)
def test_a_changed_number_is_caught(table_index, edit, message):
    paper_map = load_map()
    (key, row_id), (field, value) = table_index, edit
    (table,) = [t for t in paper_map["tables"] if (t["paper"], t["table"]) == key]
    if row_id is None:
        table["noise"][-1][field] = value
    else:
        (row,) = [r for r in table["rows"] if r.get("id") == row_id]
        row["wer"][field] = value
    errors = transcription_errors(paper_map, read_text_file())
    assert len(errors) == 1 and message in errors[0]


def test_epsilon_as_both_papers_print_it():
    assert powers(r"2,006 1.1106\cdot 10^{6} 1.1") == {1.1e6}
    assert powers(r"2,006 7.2101\cdot{10^{1}} 1.5") == {72.0}
    assert powers(r"2,006	$1.2 \cdot 10^8$	1.1") == {1.2e8}
    assert numbers(r"0.6144 3.0 204,800 69,506,000 \numprint{62.87}") == {
        0.6144,
        3.0,
        204800.0,
        69506000.0,
        62.87,
    }


@pytest.mark.skipif(not SEEDS.is_dir(), reason="the papers' text (../shared/seeds) is not here")
def test_the_table_text_is_the_papers():
    assert TEXT.read_text() == extract(SEEDS, load_map())


if __name__ == "__main__":
    TEXT.write_text(extract(Path(sys.argv[1]) if len(sys.argv) > 1 else SEEDS, load_map()))
    print(f"wrote {TEXT}")
