"""leaderboard.md: golden output, determinism, --check, schema.json."""

from __future__ import annotations

import hashlib
import json
import random
import shutil
from pathlib import Path

import pytest
from conftest import STALE_NUMERICS
from typer.testing import CliRunner

from pflbench.cli import app
from pflbench.errors import UserError
from pflbench.numerics import NUMERICS_SCOPES, NUMERICS_VERSION
from pflbench.results.bench import synthetic_record
from pflbench.results.leaderboard import (
    VERIFICATION_FILE,
    filed_dir,
    fmt_clip_bound,
    fmt_wer,
    load_result_files,
    load_results,
    render_leaderboard,
)
from pflbench.results.schema import compute_record_id, schema_json
from pflbench.results.sweep import (
    load_sweep_file,
    read_stale_list,
    stale_entries,
    write_stale_list,
)
from pflbench.results.verify import reevaluated_ids
from pflbench.spec.models import Budget
from pflbench.spec.registry import load_registry
from pflbench.spec.resolve import config_json_hash, resolve

REPO = Path(__file__).parents[1]
GOLDEN = Path(__file__).parent / "fixtures" / "results" / "golden"
BUDGETS = {
    "fx-nodp": Budget(name="fx-nodp", dp=False),
    "fx-dp": Budget(name="fx-dp", epsilon=1.5, delta=1e-6, population=10000, cohort=100, steps=50),
}
VERSIONS = {"fx-task": 2, "fx-ls": 1}


def render_golden(records=None) -> str:
    return render_leaderboard(records or load_results(GOLDEN / "results"), VERSIONS, BUDGETS)


def test_golden_leaderboard():
    expected = (GOLDEN / "leaderboard.md").read_text(encoding="utf-8")
    assert render_golden() == expected, (
        "leaderboard rendering changed; if intended, regenerate with "
        "`python tests/test_results_leaderboard.py` and review the diff"
    )


def test_same_records_in_any_order_give_identical_bytes():
    records = load_results(GOLDEN / "results")
    shuffled = records[:]
    random.Random(1).shuffle(shuffled)
    assert render_golden(shuffled).encode() == render_golden(records).encode()


def test_seed_groups_and_ranking():
    text = render_golden()
    # three seeds of one config: mean ± sample std (n); the fixtures predate numerics versions,
    # so their rows are marked stale
    stale = "⚠ stale (numerics v1)"
    assert f"| fedavg (rule: clip) {stale} | 31.00 ± 1.00 (n=3) | 37.00 ± 2.65 (n=3) |" in text
    # two global configs that differ in cohort size are two rows, ranked by test WER
    lines = [line for line in text.splitlines() if line.startswith("| ") and "global" in line]
    assert [line.split(" | ")[8] for line in lines[:2]] == ["16", "8"]
    # LibriSpeech-like task: both test sets shown, ranked by their mean
    assert "ls-test-clean WER (test) | ls-test-other WER (test)" in text
    assert text.index(
        f"| 1 | fedavg (rule: clip) {stale} | 5.00 | 12.00 | 6.00 | 13.00"
    ) < text.index("| 2 | perlayer-dim")
    # reference rows are marked and record text cannot break the table
    assert "| 📄 central |" in text and "a \\| piped row" in text


def test_a_runs_set_overrides_name_its_row():
    """Runs of one baseline that differ only in a --set override (a tuning sweep's lrs) are
    rows a reader can tell apart: the baseline cell names the overrides."""
    records = load_results(GOLDEN / "results")
    run = next(r for r in records if r.kind == "run" and r.baseline == "perlayer-dim")
    config = json.loads(json.dumps(run.config))
    config["overrides"] = {"federated.server.lr": "0.5"}
    config["recipe"]["federated"]["server"]["lr"] = 0.5
    tuned = run.model_copy(update={"record_id": "0" * 16, "config": config})
    text = render_golden([*records, tuned])
    assert "| perlayer-dim [federated.server.lr=0.5] (rule: " in text
    assert "| perlayer-dim (rule: " in text  # the run without overrides keeps its plain name


def test_seeds_of_older_numerics_are_a_stale_row_of_their_own():
    """A configuration's seeds run by code of older numerics (pflbench.numerics) never join a
    mean with current ones: they form a row of their own, marked stale."""
    records = load_results(GOLDEN / "results")
    seeds = sorted(
        (r for r in records if r.baseline == "fedavg" and r.task.name == "fx-task"),
        key=lambda r: r.seed,
    )
    assert len(seeds) == 3
    current = [
        r.model_copy(
            update={
                "software": r.software.model_copy(update={"numerics_version": NUMERICS_VERSION})
            }
        )  # fmt: skip
        for r in seeds[:1]
    ]
    others = [r for r in records if r not in seeds]
    text = render_golden([*others, *current, *seeds[1:]])
    rows = [line for line in text.splitlines() if "| fedavg (rule: clip)" in line]
    assert any("| fedavg (rule: clip) | 30.00 |" in row for row in rows)  # the current seed
    assert any("⚠ stale (numerics v1) | " in row and "(n=2)" in row for row in rows)
    assert not any("(n=3)" in row for row in rows)


def test_fmt_wer():
    assert fmt_wer([0.2, 0.3]) == "25.00 ± 7.07 (n=2)"
    assert fmt_wer([0.123]) == "12.30"
    assert fmt_wer([]) == "–"


def test_rows_with_per_speaker_counts_show_a_bootstrap_ci():
    records = [r for r in load_results(GOLDEN / "results") if r.baseline == "fedavg"]
    records = [r for r in records if r.task.name == "fx-task"]
    with_counts = []
    for record in records:
        final = {}
        for name, result in record.metrics.final.items():
            # 20 speakers of 50 words each, errors summing to the record's own WER
            errors = round(result.wer * 1000)
            speakers = {f"s{k}": (errors // 20 + (k < errors % 20), 50) for k in range(20)}
            final[name] = result.model_copy(update={"speakers": speakers})
        metrics = record.metrics.model_copy(update={"final": final})
        with_counts.append(record.model_copy(update={"metrics": metrics}))
    text = render_golden(with_counts)
    row = next(line for line in text.splitlines() if line.startswith("| 1 | fedavg"))
    cells = row.split(" | ")
    mean, interval = cells[2].split(" (n=3) ")
    low, high = map(float, interval.strip("[]").split(", "))
    assert low < float(mean.split(" ± ")[0]) < high
    plain = render_golden(records)  # records without counts: no CI
    first = next(line for line in plain.splitlines() if line.startswith("| 1 | fedavg"))
    assert "[" not in first


def copy_golden(tmp_path: Path) -> Path:
    root = tmp_path / "results"
    shutil.copytree(GOLDEN / "results", root)
    return root


def test_record_filed_in_the_wrong_place_is_refused(tmp_path):
    root = copy_golden(tmp_path)
    source = next((root / "fx-task" / "fx-dp").glob("*.json"))
    (root / "fx-task" / "fx-nodp" / source.name).write_bytes(source.read_bytes())
    with pytest.raises(UserError, match="belongs at results/fx-task/fx-dp/"):
        load_results(root)


def test_the_checked_column_says_how_far_each_rows_wer_was_recomputed(tmp_path):
    """Every filed run record is "re-scored" (CI re-scores it from its hypotheses); one filed with
    a verification stamp is "re-evaluated"."""
    root = copy_golden(tmp_path)
    files = load_result_files(root)
    fedavg = sorted(
        (path, r) for path, r, _ in files if r.task.name == "fx-task" and r.baseline == "fedavg"
    )
    assert len(fedavg) == 3  # one row of three seeds
    records = [r for _, r, _ in files]
    # A stamp beside a filed record: the file is the record's, not a record of its own.
    stamp_dir = filed_dir(fedavg[0][0])
    stamp_dir.mkdir()
    (stamp_dir / VERIFICATION_FILE).write_text("{}")
    assert [r for _, r, _ in load_result_files(root)] == records
    # A file of the stamp's name is not a stamp: "re-evaluated" needs one that names the record
    # (test_results_verify files a real one).
    with pytest.raises(UserError, match="verification.json"):
        reevaluated_ids(load_result_files(root))
    reevaluated = {fedavg[0][1].record_id}
    text = render_leaderboard(records, VERSIONS, BUDGETS, reevaluated=reevaluated)
    checked = {  # record ids -> checked, per ranked row
        line.split(" | ")[-4]: line.split(" | ")[-1].rstrip(" |")
        for line in text.splitlines()
        if line.startswith("| ") and line.split(" | ")[0][2:].isdigit()
    }
    row = ", ".join(sorted(r.record_id for _, r in fedavg))
    assert checked.pop(row) == "1 re-evaluated, 2 re-scored"
    central = next(r.record_id for r in records if r.kind == "reference")
    assert checked.pop(central) == "–"
    assert len(checked) >= 5 and set(checked.values()) == {"re-scored"}
    # A file in a folder without its record is not a filed record's: it is refused.
    stray = root / "fx-task" / "fx-dp" / ("0" * 16) / VERIFICATION_FILE
    stray.parent.mkdir()
    stray.write_text("{}")
    with pytest.raises(UserError, match="in the folder of record 0{16}, but .* is not filed"):
        load_result_files(root)


def test_cli_check_exits_nonzero_when_stale(tmp_path, monkeypatch):
    root = copy_golden(tmp_path)
    out = tmp_path / "leaderboard.md"
    runner = CliRunner()
    figures = tmp_path / "figures"
    args = ["--results", str(root), "--output", str(out), "--figures", str(figures)]
    assert runner.invoke(app, ["leaderboard", "--check", *args]).exit_code == 1  # missing
    assert runner.invoke(app, ["leaderboard", *args]).exit_code == 0
    assert runner.invoke(app, ["leaderboard", "--check", *args]).exit_code == 1  # no figures
    assert (
        runner.invoke(app, ["plot", "--results", str(root), "--out", str(figures)]).exit_code == 0
    )
    assert runner.invoke(app, ["leaderboard", "--check", *args]).exit_code == 0
    first = out.read_bytes()
    assert runner.invoke(app, ["leaderboard", *args]).exit_code == 0
    assert out.read_bytes() == first  # regeneration is byte-identical
    # a new record makes the file stale
    record = json.loads(next((root / "fx-ls" / "fx-nodp").glob("*.json")).read_text())
    record_file = root / "paper" / "extra.json"
    record.update(kind="reference", config=None, config_hash=None, seed=None)
    record["provenance"] = {"paper": "p", "table": "t", "row": "r", "note": ""}
    from pflbench.results.schema import compute_record_id

    record["record_id"] = compute_record_id(record)
    record_file.write_text(json.dumps(record))
    assert runner.invoke(app, ["leaderboard", "--check", *args]).exit_code == 1


FX_SPECS = Path(__file__).parent / "fixtures" / "results" / "specs"


def _file_run(root: Path, config: dict) -> Path:
    """A run record of `config` (made-up WERs) filed where `submit` files it."""
    record = synthetic_record(config, {"cv-dev": 0.3, "cv-test": 0.4}, "2026-03-01T00:00:00+00:00")
    model = hashlib.sha256(record["config_hash"].encode()).hexdigest()  # one model per seed
    record["outputs"] = {"final_model": model, "hypotheses": {}}
    record["record_id"] = compute_record_id(record)
    path = root / record["task"]["name"] / record["budget"] / f"{record['record_id']}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record))
    return path


def test_a_declared_matrix_must_be_filed_whole(tmp_path):
    """A sweep file beside results/ declares configurations and their seeds: a deleted seed or
    row, or a seed filed beside the declared ones under any spelling of the configuration, stops
    `leaderboard` and `results validate`; rows of an older task version are not held to it."""
    registry = load_registry([FX_SPECS])
    root, sweeps = tmp_path / "results", tmp_path / "sweeps"
    sweeps.mkdir()
    groups = [
        {"baselines": ["fedavg"], "budgets": ["fx-nodp"], "seeds": [0, 1, 2]},
        {"baselines": ["fedavg"], "budgets": ["fx-nodp"], "set": ["federated.cohort_size=4"]},
    ]
    (sweeps / "fx.yaml").write_text(json.dumps({"task": "fx-task", "groups": groups}))
    files = {
        (seed, sets): _file_run(
            root,
            resolve(registry, "fx-task", "fedavg", "fx-nodp", seed, list(sets)).model_dump(
                mode="json"
            ),
        )
        for seed, sets in [(0, ()), (1, ()), (2, ()), (0, ("federated.cohort_size=4",))]
    }

    def refusal() -> str:
        """'' where `leaderboard` accepts the matrix; else its refusal, which `results validate`
        repeats (the made-up records would fail validate's other checks)."""
        args = ["--results", str(root), "--specs", str(FX_SPECS)]
        board = CliRunner().invoke(app, ["leaderboard", "--output", str(tmp_path / "lb.md"), *args])
        if board.exit_code == 0:
            return ""
        validate = CliRunner().invoke(app, ["results", "validate", *args])
        for result in (board, validate):
            assert isinstance(result.exception, UserError), result.output
            assert "not the declared matrix" in str(result.exception), result.exception
        assert str(validate.exception) == str(board.exception)
        return str(board.exception)

    assert refusal() == ""  # the matrix as filed
    # The same configuration under another spelling of its override, with a picked seed.
    picked = resolve(registry, "fx-task", "fedavg", "fx-nodp", 7, ["federated.cohort_size=+4"])
    extra = _file_run(root, picked.model_dump(mode="json"))
    assert "fedavg @ fx-nodp --set federated.cohort_size=4: seeds [0, 7] filed, [0] declared" in (
        refusal()
    )
    extra_text = extra.read_text()
    extra.unlink()
    # A seed run by code of older numerics is stale work: it does not fill its place.
    seed_1 = files[(1, ())].read_text()
    stale = json.loads(seed_1)
    stale["software"]["numerics_version"] = STALE_NUMERICS
    stale["record_id"] = compute_record_id(stale)
    files[(1, ())].unlink()
    stale_file = files[(1, ())].with_name(f"{stale['record_id']}.json")
    stale_file.write_text(json.dumps(stale))
    assert "fx-task v2 fedavg @ fx-nodp: seeds [0, 2] filed, [0, 1, 2] declared by" in refusal()
    stale_file.unlink()  # a deleted seed
    assert "fx-task v2 fedavg @ fx-nodp: seeds [0, 2] filed, [0, 1, 2] declared by" in refusal()
    # An older task version's row (seeds 0 and 1) does not stand in for today's, nor is it held
    # to today's sweep file.
    for seed in (0, 1):
        old = resolve(registry, "fx-task", "fedavg", "fx-nodp", seed, []).model_dump(mode="json")
        old["task"]["version"] = 1
        _file_run(root, old)
    assert "seeds [0, 2] filed, [0, 1, 2] declared" in refusal()
    for sets in [(), ("federated.cohort_size=4",)]:
        for seed in (0, 2):
            files.pop((seed, sets), Path("/nonexistent")).unlink(missing_ok=True)
    text = refusal()  # only the old version's rows are left
    assert "fedavg @ fx-nodp: seeds none filed" in text and "cohort_size=4: seeds none" in text
    # A config pflbench cannot read is named, not a traceback.
    broken = json.loads(extra_text)
    broken["config"]["recipe"]["federated"]["cohort_size"] = "many"
    broken["config_hash"] = config_json_hash(broken["config"])
    broken["record_id"] = compute_record_id(broken)
    broken_file = extra.with_name(f"{broken['record_id']}.json")
    broken_file.write_text(json.dumps(broken))
    for command in (["leaderboard"], ["results", "validate"]):
        result = CliRunner().invoke(
            app, [*command, "--results", str(root), "--specs", str(FX_SPECS)]
        )
        message = str(result.exception)
        assert f"record {broken['record_id']} (fx-task, fx-nodp): config: invalid spec" in message
        assert "cohort_size: Input should be a valid integer" in message
    broken_file.unlink()
    # The check cannot be switched off by a misnamed file or folder.
    (sweeps / "more.yml").write_text("task: fx-task\n")
    result = CliRunner().invoke(
        app, ["leaderboard", "--results", str(root), "--specs", str(FX_SPECS)]
    )
    assert "more.yml: a sweep file's name must end in .yaml" in str(result.exception)
    args = ["leaderboard", "--results", str(root), "--sweeps", str(tmp_path / "sweep")]
    result = CliRunner().invoke(app, args)
    assert "sweep: no folder of sweep files" in str(result.exception)


def test_a_matrix_still_being_filed_is_announced_under_its_task(tmp_path):
    """Sweep files in sweeps/to-run/ declare runs of the task's version that are not filed yet:
    the leaderboard says under the task's title how many are filed and how many are still to run
    (a bumped task files its matrix over several sessions), and says nothing without them."""
    registry = load_registry([FX_SPECS])
    root, to_run = tmp_path / "results", tmp_path / "sweeps" / "to-run"
    to_run.mkdir(parents=True)
    current = resolve(registry, "fx-task", "fedavg", "fx-nodp", 0, []).model_dump(mode="json")
    _file_run(root, current)
    older = resolve(registry, "fx-task", "fedavg", "fx-nodp", 1, []).model_dump(mode="json")
    older["task"]["version"] -= 1  # a stale row: not one of this version's filed runs
    stale = _file_run(root, older)
    write_stale_list(to_run.parent, [stale.relative_to(root).with_suffix("").as_posix()])
    groups = [
        {"baselines": ["fedavg"], "budgets": ["fx-nodp"], "seeds": [1, 2]},
        {"baselines": ["fedavg"], "budgets": ["fx-nodp"], "set": ["federated.cohort_size=4"]},
    ]
    (to_run / "fx.yaml").write_text(json.dumps({"task": "fx-task", "groups": groups}))
    filed = [{"baselines": ["fedavg"], "budgets": ["fx-nodp"], "seeds": [0]}]
    (to_run.parent / "fx.yaml").write_text(json.dumps({"task": "fx-task", "groups": filed}))
    board = tmp_path / "lb.md"
    args = ["leaderboard", "--results", str(root), "--specs", str(FX_SPECS), "--output", str(board)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    version = registry.task("fx-task").spec.version
    title = f"## fx-task (v{version})\n\n**Task v{version}'s matrix is being filed**: 1 of its runs"
    assert title in board.read_text()
    assert (
        f"at today's numerics (v{NUMERICS_VERSION}), 3 more are declared in `sweeps/to-run/`"
        in (board.read_text())
    )
    (to_run / "fx.yaml").unlink()
    assert CliRunner().invoke(app, args).exit_code == 0
    assert "being filed" not in board.read_text()


def test_stale_records_are_pinned_by_id(tmp_path):
    """Records of an older task version or numerics are outside the sweep manifest and never
    re-run: the leaderboard holds them to sweeps/stale-records.txt, so one edited (its id
    recomputed), added or deleted by hand is refused until re-pinned in the open."""
    root, sweeps = tmp_path / "results", tmp_path / "sweeps"
    shutil.copytree(GOLDEN / "results", root)
    sweeps.mkdir()
    args = ["--results", str(root), "--specs", str(FX_SPECS), "--sweeps", str(sweeps)]
    board = ["leaderboard", "--output", str(tmp_path / "lb.md"), *args]
    stale = stale_entries(load_results(root), load_registry([FX_SPECS]))
    assert stale  # the golden results hold runs of older numerics
    refused = str(CliRunner().invoke(app, board).exception)
    assert f"{stale[0]}: stale, not pinned" in refused, refused
    pinned = CliRunner().invoke(app, ["results", "pin-stale", *args])
    said = " ".join(pinned.output.split())
    assert f"{len(stale)} stale records pinned ({len(stale)} added, 0 removed)" in said
    assert read_stale_list(sweeps) == stale
    assert CliRunner().invoke(app, board).exit_code == 0
    # A stale record edited (the cohort in its config), its hashes recomputed: another id.
    path = root / f"{stale[0]}.json"
    record = json.loads(path.read_text())
    record["config"]["recipe"]["federated"]["cohort_size"] *= 4
    record["config_hash"] = config_json_hash(record["config"])
    record["record_id"] = compute_record_id(record)
    path.unlink()
    edited = f"{stale[0].rsplit('/', 1)[0]}/{record['record_id']}"
    (root / f"{edited}.json").write_text(json.dumps(record))
    refused = str(CliRunner().invoke(app, board).exception)
    assert f"{edited}: stale, not pinned" in refused and f"{stale[0]}: pinned, not filed" in refused
    refused_too = CliRunner().invoke(app, ["results", "validate", *args]).exception
    assert isinstance(refused_too, UserError) and str(refused_too) == refused
    # A current record pinned as stale (pinned with other specs): named as such, not as gone.
    config = resolve(load_registry([FX_SPECS]), "fx-task", "fedavg", "fx-nodp", 0, [])
    current = _file_run(root, config.model_dump(mode="json"))
    current = current.relative_to(root).with_suffix("").as_posix()
    CliRunner().invoke(app, ["results", "pin-stale", *args])
    assert current not in read_stale_list(sweeps)
    write_stale_list(sweeps, [*read_stale_list(sweeps), current])
    refused = str(CliRunner().invoke(app, board).exception)
    assert f"{current}: pinned, but current with the specs loaded" in refused, refused
    # pin-stale writes only into an existing folder (a new sweeps/ switches on the matrix checks)
    missing = [*args[:-1], str(tmp_path / "no-such-sweeps")]
    refused = CliRunner().invoke(app, ["results", "pin-stale", *missing]).exception
    assert isinstance(refused, UserError) and "no such folder of sweep files" in str(refused)


def test_split_sweeps_moves_what_is_filed_into_the_manifest(tmp_path):
    """`pflbench results split-sweeps`: the filed (configuration, seed) pairs of sweeps/to-run/
    move into the manifest of the same name, which the leaderboard then holds the results to;
    what is left stays to run; a file with nothing filed is left as written, one with nothing
    left goes."""
    registry = load_registry([FX_SPECS])
    root, sweeps = tmp_path / "results", tmp_path / "sweeps"
    (sweeps / "to-run").mkdir(parents=True)
    groups = [
        {"baselines": ["fedavg"], "budgets": ["fx-nodp"], "seeds": [0, 1, 2]},
        {"baselines": ["fedavg"], "budgets": ["fx-nodp"], "set": ["federated.cohort_size=4"]},
    ]
    to_run = sweeps / "to-run" / "fx.yaml"
    declared = json.dumps({"task": "fx-task", "groups": groups})
    to_run.write_text(f"# the matrix, commented\n{declared}")
    args = ["--results", str(root), "--specs", str(FX_SPECS), "--sweeps", str(sweeps)]

    def split() -> str:
        result = CliRunner().invoke(app, ["results", "split-sweeps", *args])
        assert result.exit_code == 0, result.output
        return result.output

    def file(seed: int, sets: list[str]) -> None:
        config = resolve(registry, "fx-task", "fedavg", "fx-nodp", seed, sets)
        _file_run(root, config.model_dump(mode="json"))

    board = ["leaderboard", "--output", str(tmp_path / "lb.md"), *args]
    file(7, [])  # a seed no sweep file declares, filed while the matrix is being filed
    refused = str(CliRunner().invoke(app, board).exception)
    assert "seed 7): no sweep file in sweeps/ or sweeps/to-run/ declares it" in refused, refused
    for path in root.rglob("*.json"):
        path.unlink()
    file(0, [])
    older = resolve(registry, "fx-task", "fedavg", "fx-nodp", 1, []).model_dump(mode="json")
    older["task"]["version"] -= 1  # another version's run does not file this one's seed 1
    older_file = _file_run(root, older)
    older_file.with_suffix("").mkdir()  # where submit keeps a filed run's hypotheses
    pinned = CliRunner().invoke(app, ["results", "pin-stale", *args])
    assert "1 stale records pinned (1 added, 0 removed)" in " ".join(pinned.output.split())
    assert "nothing of it is filed yet" not in split()
    retire = ["results", "retire-replaced", "--results", str(root), "--specs", str(FX_SPECS)]
    # The older version's seed 1 stands in: its row's seed 1 is not filed at this version yet.
    assert "0 replaced runs removed" in CliRunner().invoke(app, retire).output
    manifest = load_sweep_file(sweeps / "fx.yaml")
    assert [(g.seeds, g.set) for g in manifest.groups] == [([0], [])]
    left = load_sweep_file(to_run)
    assert [(g.seeds, g.set) for g in left.groups] == [([1, 2], []), ([0], groups[1]["set"])]
    assert CliRunner().invoke(app, board).exit_code == 0  # the manifest is filed whole
    text = to_run.read_text()
    assert "nothing of it is filed yet" in split() and to_run.read_text() == text
    for seed, sets in [(1, []), (2, []), (0, ["federated.cohort_size=4"])]:
        file(seed, sets)
    # Filed but not moved yet: the leaderboard and validate refuse until split-sweeps runs.
    for command in (board, ["results", "validate", *args]):
        refused = str(CliRunner().invoke(app, command).exception)
        assert "seeds [1, 2] are filed and still declared to run by" in refused, refused
    moved = split()
    assert "3 filed runs moved" in moved and not to_run.exists()
    # Now it is: the older version's record leaves, with its folder; the current ones stay.
    assert f"would remove {older_file}" in CliRunner().invoke(app, [*retire, "--dry-run"]).output
    assert older_file.exists()
    assert "1 replaced runs removed" in CliRunner().invoke(app, retire).output
    assert not older_file.exists() and not older_file.with_suffix("").exists()
    assert read_stale_list(sweeps) == []  # it left the pin list with its record
    assert len(list(root.rglob("*.json"))) == 4
    assert "every declared run is filed; removed" in moved and not to_run.parent.exists()
    manifest = load_sweep_file(sweeps / "fx.yaml")
    filed = [(g.seeds, g.set) for g in manifest.groups]  # a configuration's seeds in one group
    assert filed == [([0, 1, 2], []), ([0], ["federated.cohort_size=4"])]
    assert CliRunner().invoke(app, board).exit_code == 0


# ----------------------------------------------------------------------------------------------
# The repository's own results/


def test_repository_leaderboard_is_current():
    result = CliRunner().invoke(
        app,
        [
            "leaderboard",
            "--check",
            "--results",
            str(REPO / "results"),
            "--output",
            str(REPO / "leaderboard.md"),
        ],
    )
    assert result.exit_code == 0, "leaderboard.md is stale: run `pflbench leaderboard`"


def test_schema_json_is_current():
    assert (REPO / "results" / "schema.json").read_text(encoding="utf-8") == schema_json(), (
        "results/schema.json is out of date: run `pflbench results schema`"
    )


if __name__ == "__main__":  # regenerate the golden file after an intended change
    (GOLDEN / "leaderboard.md").write_text(render_golden(), encoding="utf-8")


def test_an_adaptive_row_shows_its_clip_bound_as_the_initial_one():
    """Adaptive clipping moves C each step: its C column says the number is C_0."""
    records = [r for r in load_results(REPO / "results") if r.kind == "run"]
    adaptive = next(r for r in records if r.baseline == "adaptive-global")
    fixed = next(r for r in records if r.baseline == "global")
    assert fmt_clip_bound(adaptive) == "0.01 (C₀, adaptive)"
    assert fmt_clip_bound(fixed) == "0.01"


def test_a_reworded_baseline_or_budget_does_not_split_a_row(tmp_path):
    """Submit and reproduce compare what ran, not a spec's words: two seeds of one configuration
    filed before and after a baseline's description was reworded are one row; a recipe change
    is another row."""
    from pflbench.results.leaderboard import group_rows

    row = next(r for r in group_rows(load_results(GOLDEN / "results")) if len(r.records) > 1)
    first, second = row.records[:2]
    config = json.loads(json.dumps(second.config))
    config["baseline"]["description"] = "reworded"
    config["budget"]["description"] = "reworded too"
    reworded = second.model_copy(update={"config": config})
    assert len(group_rows([first, reworded])) == 1
    config = json.loads(json.dumps(second.config))
    config["recipe"]["privacy"]["clip_bound"] = 0.5
    assert len(group_rows([first, second.model_copy(update={"config": config})])) == 2
    # A seed filed twice, once reworded, is refused as one run filed twice (not two seeds).
    root = tmp_path / "results"
    for record in (second, reworded.model_copy(update={"created": "2026-05-01T00:00:00+00:00"})):
        raw = record.model_dump(mode="json", exclude_none=True)
        raw["config_hash"] = config_json_hash(raw["config"])
        raw["record_id"] = compute_record_id(raw)
        path = root / record.task.name / record.budget / f"{raw['record_id']}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(raw))
    with pytest.raises(UserError, match=r"the same config \(seed included\)"):
        load_result_files(root)


def test_two_spellings_of_one_set_value_are_one_row_named_one_way():
    """`--set federated.server.lr=1e-3` and `=0.001` resolve to one recipe: one row, one label
    (the recipe's value), and a different value is another row."""
    from pflbench.results.groups import row_label
    from pflbench.results.leaderboard import group_rows

    row = next(r for r in group_rows(load_results(GOLDEN / "results")) if len(r.records) > 1)

    def spelled(record, typed: str, lr: float):
        config = json.loads(json.dumps(record.config))
        config["overrides"] = {"federated.server.lr": typed}
        config["recipe"]["federated"]["server"]["lr"] = lr
        return record.model_copy(update={"config": config})

    first, second = spelled(row.records[0], "1e-3", 1e-3), spelled(row.records[1], ".001", 1e-3)
    assert len(group_rows([first, second])) == 1
    assert row_label(first) == row_label(second) == f"{first.baseline} [federated.server.lr=0.001]"
    assert len(group_rows([first, spelled(row.records[1], "0.002", 2e-3)])) == 2
    # A --set that restates the default is the plain configuration: one row, named plain
    # whichever record id is smaller.
    plain = row.records[1]
    default = plain.config["recipe"]["federated"]["server"]["lr"]
    restated = spelled(row.records[0], repr(default), default)
    for restated_id in ("0" * 16, "f" * 16):
        (merged,) = group_rows([plain, restated.model_copy(update={"record_id": restated_id})])
        assert row_label(merged.first) == plain.baseline and len(merged.records) == 2


def test_a_numerics_change_of_some_runs_leaves_the_others_current():
    """v4 changed the numbers of runs with DP noise only: a v3 run without it has today's
    numbers (current: its row stands with today's runs), one with it is stale; a run older than
    the last change to every run is stale either way."""
    from pflbench.numerics import current_numerics
    from pflbench.results.schema import record_numerics_version

    records = load_results(REPO / "results")
    record = next(r for r in records if r.kind == "run" and r.privacy and not r.privacy.dp)
    assert NUMERICS_SCOPES[4] == "dp" and NUMERICS_VERSION >= 4
    assert current_numerics(3, dp=False) == NUMERICS_VERSION
    assert current_numerics(3, dp=True) == 3
    assert current_numerics(STALE_NUMERICS, dp=False) == STALE_NUMERICS
    for version, dp, unit, expected in [
        (3, False, "user", NUMERICS_VERSION),
        (3, True, "user", 3),
        (3, True, "pseudo-user", 3),
        (3, True, "example", 3),  # example-level DP-SGD: its sum is exact now too
        (STALE_NUMERICS, False, "user", STALE_NUMERICS),
    ]:
        edited = record.model_copy(deep=True)
        edited.software.numerics_version = version
        edited.privacy.dp, edited.privacy.unit = dp, unit
        assert record_numerics_version(edited) == expected, (version, dp, unit)


def test_retire_replaced_removes_a_run_of_older_numerics_once_its_row_is_filed_again(tmp_path):
    """A row run by code whose numerics changed since stands in, stale, until today's code has
    filed every one of its seeds; then it leaves (and the pin list with it)."""
    from pflbench.results.sweep import replaced_records

    registry = load_registry([FX_SPECS])
    root = tmp_path / "results"

    def file(seed: int, numerics: int | None) -> Path:
        config = resolve(registry, "fx-task", "fedavg", "fx-nodp", seed, []).model_dump(mode="json")
        path = _file_run(root, config)
        if numerics is not None:  # run by older code
            record = json.loads(path.read_text())
            record["software"]["numerics_version"] = numerics
            record["record_id"] = compute_record_id(record)
            path.unlink()
            path = path.with_name(f"{record['record_id']}.json")
            path.write_text(json.dumps(record))
        return path

    older = [file(seed, STALE_NUMERICS) for seed in (0, 1)]
    current = file(0, None)  # beside its stale run: filed once per numerics
    assert replaced_records(load_result_files(root), registry) == []  # seed 1 not filed again
    file(1, None)
    assert replaced_records(load_result_files(root), registry) == sorted(older)
    twice = json.loads(current.read_text())
    twice["created"] = "2026-03-02T00:00:00+00:00"
    twice["record_id"] = compute_record_id(twice)
    current.with_name(f"{twice['record_id']}.json").write_text(json.dumps(twice))
    with pytest.raises(UserError, match="same config .seed included. as .*a run is filed once"):
        load_result_files(root)
