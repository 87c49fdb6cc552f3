"""The papers' reference rows (results/paper/tables.yaml → results/paper/*.json): every table's
configurations accounted for, the records what the map gives, and a broken map refused."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pflbench.cli import app
from pflbench.errors import UserError
from pflbench.privacy.statement import budget_noise
from pflbench.results.leaderboard import load_results
from pflbench.results.paper import (
    TABLES_FILE,
    build_reference_records,
    load_paper_map,
    sync_paper_records,
)
from pflbench.results.schema import compute_record_id
from pflbench.spec.registry import dump_yaml, load_registry, load_yaml

REPO = Path(__file__).parents[1]
MAP = REPO / "results" / "paper" / TABLES_FILE

# The configurations each table prints, counted from the papers (seeds/00N_*.txt) by hand: a
# WER cell group (dev and test, or the four LibriSpeech sets) of one model is one configuration.
# T = 0 columns (the starting model), ε-only lines and derived columns are not configurations.
TABLE_ROWS = {
    ("001", "Table 1"): 0,  # speaker statistics
    # 002 Table 1's grid, earlier version: seed; σ 30, 20, 10 (uniform, dim; no global number);
    # 3, 1 (global, uniform, dim); no DP at C = 0.01 and 1.0 (global, per-layer); central
    ("001", "Table 2"): 18,
    ("002", "Table 1"): 19,  # seed; σ 30, 20 (uniform, dim); 10, 3, 1 (global, uniform, dim);
    # no DP at C = 0.01 and 1.0 (global, per-layer); central (caption)
    ("002", "Table 2"): 0,  # speaker statistics
    ("002", "Table 3"): 18,  # 3 seed/data blocks x (seed, 8, 16, 32, 64, central)
    ("002", "Table 4"): 40,  # 5 blocks x (seed, 8, ..., 256, central)
    ("002", "Table 5"): 18,  # 3 blocks x (seed, 8, 8-IID, 16, 16-IID, central)
    ("002", "Table 6"): 12,  # 2 blocks x (seed, 16, 16-IID, 32, 32-IID, central)
    ("002", "Table 7"): 4,
    ("002", "Table 8"): 9,
    ("002", "Table 9"): 26,
    ("002", "Table 10"): 42,  # 6 blocks x (seed, 8, ..., 128, central)
    ("002", "Table 11"): 12,
    ("002", "Table 12"): 24,
    ("002", "Table 13"): 20,
    ("002", "Table 14"): 18,  # 9 rows x (T = 2k, T = 4k)
    ("002", "Table 15"): 10,  # 5 seeds x (T = 0, T = 2k)
    ("002", "Table 16"): 32,  # 2 blocks x (seed, 13 cohort columns, central, central 3x batch)
    ("002", "Table 17"): 31,
    ("002", "Table 18"): 14,  # 2 languages x (seed, σ 1e-5 dim, σ 3e-6 x 2, no DP x 2, central)
    ("002", "Table 19"): 8,
    ("002", "Table 20"): 10,
    ("002", "Table 21"): 18,  # 6 model rows x (σ 0 global, σ 1e-5 global, σ 1e-5 uniform)
    ("002", "Table 22"): 0,  # compute
    ("003", "Table 1"): 0,  # extrapolation factors
    ("003", "Table 2"): 6,
    ("003", "Table 3"): 12,
    ("003", "Table 4"): 8,
    ("003", "Table 5"): 10,
    ("003", "Table 6"): 9,
    ("004", "Table 1"): 2,
    ("004", "Table 2"): 4,
    ("004", "Table 3"): 4,
    ("004", "Table 4"): 2,
    ("004", "Table 5"): 3,
}


@pytest.fixture(scope="module")
def registry():
    return load_registry()


def test_every_configuration_of_every_table_is_accounted_for(registry):
    """Each table's configurations = its reference records + its rows printed again elsewhere
    (cited by the other record's `also`) + its rows not mapped (with a reason), and that adds up
    to the hand count above: no configuration of a paper is dropped silently."""
    pmap = load_paper_map(MAP)
    assert {(t.paper, t.table) for t in pmap.tables} == set(TABLE_ROWS)
    records = [r for r in load_results(REPO / "results") if r.kind == "reference"]
    primary = Counter((r.provenance.paper, r.provenance.table) for r in records)
    cited = Counter((c.paper, c.table) for r in records for c in r.provenance.also)
    for table in pmap.tables:
        key = (table.paper, table.table)
        assert table.entries == TABLE_ROWS[key], key
        not_mapped = table.entries if table.not_mapped else 0
        not_mapped += sum(1 for e in table.rows if e.not_mapped)
        assert all(e.not_mapped.strip() for e in table.rows if e.not_mapped is not None)
        assert primary[key] + cited[key] + not_mapped == TABLE_ROWS[key], key
    # the headline tables are there in full
    assert primary[("002", "Table 1")] == 17 and primary[("002", "Table 4")] == 39
    tasks = {r.task.name for r in records}
    assert {"cv-fr90-cv10-seed", "cv-de90-cv10-seed", "ls960-scratch"} <= tasks


def test_repository_records_are_what_the_map_gives(registry):
    sync = sync_paper_records(REPO / "results", registry, write=False)
    assert sync.differing == [] and sync.extra == [], (
        "results/paper/ is out of date: run `pflbench results paper`"
    )


def test_reference_rows_carry_their_source_and_claims():
    records = {p.stem: r for p, r, _ in _files()}
    dim3 = records["002-t1-perlayer-dim-eps7.2-high-pop"]
    assert (dim3.provenance.table, dim3.provenance.column) == (
        "Table 1",
        "per-layer clipping: (dim)",
    )
    assert dim3.metrics.final["cv-test"].wer == pytest.approx(0.204)
    assert dim3.privacy.extrapolated.epsilon["rdp"].epsilon == 7.2
    assert dim3.privacy.simulated.epsilon["rdp"].epsilon == 1.2e8
    assert ("002", "Table 17") in {(c.paper, c.table) for c in dim3.provenance.also}
    french = records["002-t18-cv-fr90-cv10-seed-perlayer-dim-eps7.2-high-pop"]
    assert french.privacy.extrapolated.population == 46_282_500  # the paper's own extrapolation
    assert french.privacy.extrapolated.epsilon["rdp"].epsilon == 5.5
    cohort8 = records["002-t4-cv-en-ls100-seed-fedavg-s8"]
    assert cohort8.provenance.overrides["federated.cohort_size"] == "8"
    assert cohort8.privacy.simulated.cohort == 8 and cohort8.privacy.clip_bound is None
    grid = records["002-t17-perlayer-uniform-paper-sigma5e-6"]
    assert grid.budget == "paper-sigma5e-6" and grid.privacy.sigma_dp == 5e-6


def test_rows_under_a_registry_budget_have_its_noise(registry):
    """A paper row filed under eps7.2-high-pop / eps4.5-low-pop has the σ_DP those budgets
    calibrate to (within 2%): rows under one budget are comparable."""
    sigma = {
        name: budget_noise(registry.budgets[name].spec)["sigma_dp"]
        for name in ("eps7.2-high-pop", "eps4.5-low-pop")
    }
    checked = 0
    for _, record, _ in _files():
        if record.budget in sigma:
            assert record.privacy.sigma_dp == pytest.approx(sigma[record.budget], rel=0.02)
            checked += 1
    assert checked == 18  # Tables 1, 18, 20 and 21


def _files():
    from pflbench.results.leaderboard import load_result_files

    return [f for f in load_result_files(REPO / "results") if f[1].kind == "reference"]


# ----------------------------------------------------------------------------------------------
# A broken map is refused with the table and row named


def _edited_map(tmp_path, edit) -> Path:
    data = load_yaml(MAP.read_bytes())
    edit({(t["paper"], t["table"]): t for t in data["tables"]})
    path = tmp_path / TABLES_FILE
    path.write_text(dump_yaml(data), encoding="utf-8")
    return path


def _build(path, registry):
    return build_reference_records(load_paper_map(path), registry, str(path))


def test_a_dropped_row_is_refused(tmp_path, registry):
    path = _edited_map(tmp_path, lambda t: t[("002", "Table 4")]["rows"].pop(3))
    with pytest.raises(
        UserError, match="002 Table 4: 39 rows transcribed, but the table prints 40"
    ):
        load_paper_map(path)


def test_a_same_as_with_other_numbers_is_refused(tmp_path, registry):
    def edit(tables):
        row = next(r for r in tables[("002", "Table 17")]["rows"] if "same_as" in r)
        row["wer"]["cv-test"] += 0.3

    with pytest.raises(UserError, match="002 Table 17.*differs from .* by more than 0.05"):
        _build(_edited_map(tmp_path, edit), registry)


def test_overrides_that_do_not_resolve_are_refused(tmp_path, registry):
    def edit(tables):
        row = next(r for r in tables[("002", "Table 4")]["rows"] if r.get("set"))
        row["set"]["federated.cohort_sise"] = "8"

    with pytest.raises(UserError, match="002 Table 4.*does not resolve"):
        _build(_edited_map(tmp_path, edit), registry)


def test_a_dp_row_needs_its_noise_line(tmp_path, registry):
    def edit(tables):
        tables[("002", "Table 18")]["noise"] = tables[("002", "Table 18")]["noise"][1:]

    with pytest.raises(UserError, match="002 Table 18 has no noise line for σ_DP = 1e-05"):
        _build(_edited_map(tmp_path, edit), registry)


def test_cli_writes_and_checks_the_records(tmp_path):
    root = tmp_path / "results"
    shutil.copytree(REPO / "results" / "paper", root / "paper")
    runner = CliRunner()
    assert (
        runner.invoke(app, ["results", "paper", "--check", "--results", str(root)]).exit_code == 0
    )
    victim = root / "paper" / "002-t4-cv-en-ls100-seed-fedavg-s8.json"
    victim.unlink()
    result = runner.invoke(app, ["results", "paper", "--check", "--results", str(root)])
    assert result.exit_code == 1 and "missing or out of date" in result.output
    result = runner.invoke(app, ["results", "paper", "--results", str(root)])
    assert result.exit_code == 0 and victim.is_file()
    assert "002 Table 4: 39 reference rows, 0 printed again" in result.output
    (root / "paper" / "mine.json").write_text(victim.read_text())
    result = runner.invoke(app, ["results", "paper", "--check", "--results", str(root)])
    assert isinstance(result.exception, UserError) and "mine.json" in str(result.exception)


def test_validate_refuses_a_reference_row_edited_away_from_the_map(tmp_path):
    """`results validate` (CI) holds results/paper/ to tables.yaml: a reference row whose WER was
    edited, with its record id recomputed, is refused by name."""
    root = tmp_path / "results"
    shutil.copytree(REPO / "results" / "paper", root / "paper")
    validate = ["results", "validate", "--results", str(root)]  # no sweeps/ beside it
    assert CliRunner().invoke(app, validate).exit_code == 0
    victim = root / "paper" / "002-t1-global-none.json"
    record = json.loads(victim.read_text())
    test_set = next(iter(record["metrics"]["final"]))
    record["metrics"]["final"][test_set]["wer"] -= 0.02
    record["record_id"] = compute_record_id(record)
    victim.write_text(json.dumps(record))
    refused = CliRunner().invoke(app, validate)
    assert isinstance(refused.exception, UserError), refused.output
    assert f"{victim}: not the reference record results/paper/tables.yaml gives" in str(
        refused.exception
    )
