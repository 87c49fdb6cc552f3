"""`pflbench privacy ...`: run through the real entry point (`pflbench.cli.main`)."""

import json
import subprocess
import sys

import pytest

from pflbench.cli import main
from pflbench.privacy.accountants import ACCOUNTANTS, compute_epsilon
from pflbench.privacy.accounting import Accountant, EpsilonResult, SampledGaussian

TABLE_1 = ["--delta", "1e-9"]


def run_cli(args, capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["pflbench", *args])
    with pytest.raises(SystemExit) as exited:
        main()
        sys.exit(0)
    out, err = capsys.readouterr()
    return exited.value.code, out, err


def test_epsilon_json_matches_the_library(capsys, monkeypatch):
    args = ["--noise-multiplier", "0.6144", "--sampling-rate", "0.00295", "--steps", "2034"]
    code, out, _ = run_cli(
        ["privacy", "epsilon", *args, *TABLE_1, "--accountant", "all", "--json"],
        capsys,
        monkeypatch,
    )
    assert code == 0
    record = json.loads(out)
    assert set(record) == set(ACCOUNTANTS) == {"rdp", "pld", "prv"}
    assert (
        record["rdp"]["epsilon"]
        == compute_epsilon(SampledGaussian(0.6144, 0.00295, 2034), 1e-9).epsilon
    )
    assert record["rdp"]["order"] == 4.0 and record["rdp"]["details"]["orders"][0] == 1.1
    assert record["pld"]["epsilon"] <= record["rdp"]["epsilon"]
    assert record["prv"]["epsilon"] <= record["rdp"]["epsilon"]


def test_epsilon_all_says_why_an_accountant_cannot_compute(capsys, monkeypatch):
    # RDP 1.1e7, PLD 5.3e5: PRV says why it does not compute one.
    args = ["--noise-multiplier", "0.01024", "--sampling-rate", "0.0295", "--steps", "2006"]
    code, out, _ = run_cli(
        ["privacy", "epsilon", *args, *TABLE_1, "--accountant", "all", "--json"],
        capsys,
        monkeypatch,
    )
    assert code == 0
    record = json.loads(out)
    assert record["pld"]["epsilon"] > 1e5
    assert record["prv"]["epsilon"] is None and "PRV accountant not run" in record["prv"]["error"]
    code, out, err = run_cli(
        ["privacy", "epsilon", *args, *TABLE_1, "--accountant", "prv"], capsys, monkeypatch
    )
    assert code == 2 and "PRV accountant not run" in err


def test_epsilon_table(capsys, monkeypatch):
    args = ["--noise-multiplier", "2.048", "--sampling-rate", "0.0295", "--steps", "2006"]
    code, out, _ = run_cli(["privacy", "epsilon", *args, *TABLE_1], capsys, monkeypatch)
    assert code == 0 and "4.445" in out and "opacus" in out


def test_noise_gives_the_papers_sigma_dp(capsys, monkeypatch):
    args = ["--epsilon", "7.2", "--population", "69506000", "--cohort", "204800", "--steps", "2034"]
    code, out, _ = run_cli(["privacy", "noise", *args, *TABLE_1, "--json"], capsys, monkeypatch)
    assert code == 0
    record = json.loads(out)
    assert record["sigma_dp"] == pytest.approx(3e-6, rel=0.01)
    assert record["achieved"]["epsilon"] <= 7.2
    code, out, _ = run_cli(["privacy", "noise", *args, *TABLE_1], capsys, monkeypatch)
    assert code == 0 and "sigma_dp" in out


def test_report_with_a_budget(capsys, monkeypatch):
    args = ["--sigma-dp", "3e-6", "--cohort", "1024", "--population", "34753", "--steps", "2006"]
    budget = ["--budget", "eps7.2-high-pop"]
    code, out, _ = run_cli(
        ["privacy", "report", *args, *TABLE_1, *budget, "--json"], capsys, monkeypatch
    )
    assert code == 0
    statement = json.loads(out)
    assert statement["extrapolated"]["epsilon"]["rdp"]["epsilon"] == pytest.approx(7.2, rel=0.05)
    assert statement["simulated"]["epsilon"]["rdp"]["epsilon"] > 1e7
    code, out, _ = run_cli(["privacy", "report", *args, *TABLE_1, *budget], capsys, monkeypatch)
    assert code == 0 and "extrapolated" in out and "7.22" in out
    # An accountant that was not run says why under the table, not only in --json.
    assert "eps prv, simulated: not computed: PRV accountant not run" in " ".join(out.split())


EPSILON = ["privacy", "epsilon", "--steps", "100", "--delta", "1e-5"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([*EPSILON, "--noise-multiplier", "0", "--sampling-rate", "0.1"], "noise multiplier"),
        ([*EPSILON, "--noise-multiplier", "-1", "--sampling-rate", "0.1"], "noise multiplier"),
        ([*EPSILON, "--noise-multiplier", "1", "--sampling-rate", "1.5"], "sampling rate"),
        ([*EPSILON, "--noise-multiplier", "1", "--sampling-rate", "0"], "sampling rate"),
        ([*EPSILON[:-1], "1", "--noise-multiplier", "1", "--sampling-rate", "0.1"], "delta"),
        (
            [*EPSILON, "--noise-multiplier", "1", "--sampling-rate", "0.1", "--accountant", "x"],
            "unknown accountant 'x'; choose rdp, pld, prv or all",
        ),
        (
            ["privacy", "noise", "--epsilon", "1", "--delta", "1e-5", "--population", "100"]
            + ["--cohort", "10", "--steps", "10", "--accountant", "prv"],
            "unknown accountant 'prv'; choose rdp or pld",
        ),
        (
            ["privacy", "noise", "--epsilon", "1", "--delta", "1e-5", "--population", "10"]
            + ["--cohort", "20", "--steps", "10"],
            "cohort",
        ),
        (
            ["privacy", "report", "--sigma-dp", "1e-5", "--cohort", "10", "--population", "100"]
            + ["--steps", "10", "--delta", "1e-5", "--budget", "no-such-budget"],
            "unknown budget",
        ),
    ],
)
def test_bad_input_exits_2_with_a_clear_message(args, message, capsys, monkeypatch):
    code, _, err = run_cli(args, capsys, monkeypatch)
    assert code == 2
    assert message in err and "Traceback" not in err


def test_installed_command_exit_code():
    args = ["--noise-multiplier", "-1", "--sampling-rate", "0.1", "--steps", "10", "--delta", "0.1"]
    proc = subprocess.run(
        [sys.executable, "-m", "pflbench", "privacy", "epsilon", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "noise multiplier must be finite and > 0" in proc.stderr


def test_the_registry_drives_the_cli(capsys, monkeypatch):
    """A registered accountant is a choice of `privacy epsilon` and part of `all`."""

    def epsilon(mechanism, delta):
        z, q, steps = mechanism.noise_multiplier, mechanism.sampling_rate, mechanism.steps
        return EpsilonResult("flat", "none", "0", 1.5, delta, z, q, steps, None, {"how": "flat"})

    flat = Accountant("flat", "flat (test)", "none", epsilon, lambda d: d["how"], False)
    ACCOUNTANTS.register("flat", flat)
    try:
        args = ["--noise-multiplier", "1", "--sampling-rate", "0.01", "--steps", "10", *TABLE_1]
        code, out, _ = run_cli(
            ["privacy", "epsilon", *args, "--accountant", "flat"], capsys, monkeypatch
        )
        assert code == 0 and "flat" in out and "1.5" in out
        code, out, _ = run_cli(
            ["privacy", "epsilon", *args, "--accountant", "all", "--json"], capsys, monkeypatch
        )
        assert code == 0 and set(json.loads(out)) == {"rdp", "pld", "prv", "flat"}
    finally:  # the registry refuses assignment and removal (pflbench.extension): undo it as a dict
        dict.pop(ACCOUNTANTS, "flat")
        ACCOUNTANTS.origins.pop("flat")
