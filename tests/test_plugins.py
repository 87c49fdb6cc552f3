"""Plug-ins: code from outside pflbench registers methods (docs/examples/server_yogi.py), runs
record it with its source digest, submit-time checks refuse a missing or changed plug-in, and
every way of naming one (--plugin, PFLBENCH_PLUGINS, entry points) loads it."""

from __future__ import annotations

import hashlib
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from test_run import specs_dir  # noqa: F401  (fixture)

from pflbench import plugins
from pflbench.errors import UserError
from pflbench.extension import BUILTIN, ExtensionPoint
from pflbench.fl.server import ServerOptimizer
from pflbench.fl.server_optimizers import SERVER_OPTIMIZERS
from pflbench.methods import load_specs
from pflbench.privacy.accountants import calibrate_noise
from pflbench.privacy.accounting import sampled_gaussian
from pflbench.privacy.mechanisms import check_within_clip_bound
from pflbench.results.schema import load_record
from pflbench.runner import RunOptions, run
from pflbench.spec.models import ServerRecipe
from pflbench.spec.resolve import ran_hash, resolve

EXAMPLES = Path(__file__).parents[1] / "docs" / "examples"
YOGI = EXAMPLES / "server_yogi.py"


@pytest.fixture(autouse=True)
def clean_registries():
    """Plug-ins register into process-wide registries: each test starts and ends without them."""
    saved = [(point, dict(point), dict(point.origins)) for point in plugins.EXTENSION_POINTS]
    loaded = dict(plugins._loaded)
    yield
    for point, entries, origins in saved:
        dict.clear(point)
        dict.update(point, entries)
        point.origins = origins
    plugins._loaded.clear()
    plugins._loaded.update(loaded)


def test_a_plugin_file_registers_its_method_with_origin_version_and_digest():
    plugin = plugins.load_plugin(str(YOGI))
    assert "yogi" in SERVER_OPTIMIZERS
    assert SERVER_OPTIMIZERS.origins["yogi"] == "plug-in server_yogi"
    assert SERVER_OPTIMIZERS.origins["lamb"] == BUILTIN
    assert plugin.name == "server_yogi" and plugin.version == "1.0"
    assert plugin.registered == {"server optimizer": ["yogi"]}
    expected = hashlib.sha256(b"server_yogi.py\0" + YOGI.read_bytes() + b"\0").hexdigest()
    assert plugin.sha256 == expected
    assert plugins.load_plugin(str(YOGI)) is plugin  # loaded once
    assert SERVER_OPTIMIZERS.from_plugins() == {"yogi": "plug-in server_yogi"}


def test_the_example_yogi_step_is_the_one_computed_by_hand():
    plugins.load_plugin(str(YOGI))
    recipe = ServerRecipe(optimizer="yogi", lr=0.1, beta1=0.5, beta2=0.75, eps=0.01)
    theta = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    opt = ServerOptimizer(recipe, ["w"], [theta])
    g = torch.tensor([0.2, -0.4, 0.0], dtype=torch.float64)
    opt.step([g], 0.1)
    m = 0.5 * g
    v0 = torch.full_like(g, 0.01**2)
    v = v0 - 0.25 * torch.sign(v0 - g * g) * g * g
    expected = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64) - 0.1 * m / (v.sqrt() + 0.01)
    torch.testing.assert_close(theta, expected, rtol=0, atol=1e-15)


def test_registering_a_name_twice_or_looking_up_an_unknown_one_is_a_clear_error():
    point = ExtensionPoint("widget", [("a", 1)])
    with pytest.raises(UserError, match="widget 'a' is already registered \\(by built-in\\)"):
        point.register("a", 2)
    with pytest.raises(UserError, match="unknown widget 'b'; known: a .*--plugin"):
        point["b"]
    with pytest.raises(UserError, match="server optimizer 'lamb' is already registered"):
        SERVER_OPTIMIZERS.register("lamb", SERVER_OPTIMIZERS["adam"])


def test_a_plugin_that_fails_to_import_is_named_in_the_error(tmp_path):
    broken = tmp_path / "broken_plugin.py"
    broken.write_text("raise RuntimeError('no GPU here')\n")
    with pytest.raises(UserError, match="plug-in .*broken_plugin.py: failed to load .*no GPU"):
        plugins.load_plugin(str(broken))
    with pytest.raises(UserError, match="plug-in .*missing.py: no such file"):
        plugins.load_plugin(str(tmp_path / "missing.py"))
    notes = tmp_path / "notes.txt"  # a file, but no Python: importlib has no loader for it
    notes.write_text("x = 1\n")
    with pytest.raises(UserError, match="plug-in .*notes.txt: not a .py file"):
        plugins.load_plugin(str(notes))


REGISTERS = "from pflbench.fl.server_optimizers import SERVER_OPTIMIZERS as S\n"


def test_two_plugins_of_one_name_are_refused_and_one_file_named_twice_loads_once(
    tmp_path, monkeypatch
):
    """A record names plug-ins by name: two of one name could not both be checked."""
    for folder, entry in (("p1", "a"), ("p2", "b")):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "methods.py").write_text(
            REGISTERS + f"S.register('{entry}', S['sgd'])\n"
        )
    first = plugins.load_plugin(str(tmp_path / "p1" / "methods.py"))
    monkeypatch.chdir(tmp_path)
    assert plugins.load_plugin("./p1/../p1/methods.py") is first  # the same file, spelt otherwise
    with pytest.raises(UserError, match="p2/methods.py are both named 'methods'.*rename one"):
        plugins.load_plugin(str(tmp_path / "p2" / "methods.py"))
    monkeypatch.syspath_prepend(str(tmp_path / "p2"))
    with pytest.raises(UserError, match="and methods are both named 'methods'"):
        plugins.load_plugin("methods")  # a module of that name is another plug-in


def test_a_plugins_digest_covers_the_code_it_runs(tmp_path, monkeypatch):
    """A module's whole top-level package; a file with the helper beside it that it imports."""
    package = tmp_path / "my_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "core.py").write_text("SCALE = 1.0\n")
    (package / "methods.py").write_text(
        "from my_pkg.core import SCALE\n" + REGISTERS + "S.register('pkg-sgd', S['sgd'])\n"
    )
    (tmp_path / "helper.py").write_text("SCALE = 1.0\n")
    (tmp_path / "beside.py").write_text(
        "import helper\n" + REGISTERS + "S.register('beside-sgd', S['sgd'])\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    digests = {}
    for edit in (False, True):
        if edit:
            (package / "core.py").write_text("SCALE = 100.0\n")
            (tmp_path / "helper.py").write_text("SCALE = 100.0\n")
            for name in ("my_pkg", "my_pkg.core", "my_pkg.methods", "helper"):
                monkeypatch.delitem(sys.modules, name)
            plugins._loaded.clear()
            for point in plugins.EXTENSION_POINTS:
                for name in ("pkg-sgd", "beside-sgd"):
                    dict.pop(point, name, None)
        digests[edit] = (
            plugins.load_plugin("my_pkg.methods").sha256,
            plugins.load_plugin(str(tmp_path / "beside.py")).sha256,
        )
    assert digests[False][0] != digests[True][0]
    assert digests[False][1] != digests[True][1]


def test_a_file_plugins_helpers_import_and_are_digested_whatever_the_load_order(
    tmp_path, monkeypatch
):
    """A helper beside the file imports without PYTHONPATH (the folder goes first on sys.path,
    as for a script); one imported inside a function is in the digest; a helper two plug-ins
    share is in both digests, whichever loads first."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(sys, "modules", dict(sys.modules))
    (tmp_path / "shared.py").write_text("SCALE = 1.0\n")
    (tmp_path / "later.py").write_text("SHIFT = 0.0\n")
    (tmp_path / "nsutil").mkdir()  # a namespace package: a folder without __init__.py
    (tmp_path / "nsutil" / "core.py").write_text("STEP = 1.0\n")
    (tmp_path / "one.py").write_text(
        "from shared import SCALE\n" + REGISTERS + "S.register('one-sgd', S['sgd'])\n"
        "def shift():\n    from later import SHIFT\n    return SHIFT\n"
        "def step():\n    from nsutil.core import STEP\n    return STEP\n"
    )
    (tmp_path / "two.py").write_text(
        "import shared\n" + REGISTERS + "S.register('two-sgd', S['sgd'])\n"
    )

    def load(order, edit=None):
        plugins._loaded.clear()
        for name in ("one-sgd", "two-sgd"):
            dict.pop(SERVER_OPTIMIZERS, name, None)
        for name in ("shared", "later", "nsutil", "nsutil.core"):
            sys.modules.pop(name, None)
        if edit:
            (tmp_path / edit).write_text((tmp_path / edit).read_text() + "# edited\n")
        loaded = {n: plugins.load_plugin(str(tmp_path / f"{n}.py")).sha256 for n in order}
        return loaded["one"], loaded["two"]

    first = load(["one", "two"])
    assert load(["two", "one"]) == first
    edited = load(["two", "one"], edit="shared.py")
    assert edited == load(["one", "two"]) and edited[0] != first[0] and edited[1] != first[1]
    lazily = load(["one", "two"], edit="later.py")
    assert lazily[0] != edited[0] and lazily[1] == edited[1]  # only one.py imports later.py
    namespaced = load(["one", "two"], edit="nsutil/core.py")
    assert namespaced[0] != lazily[0] and namespaced[1] == lazily[1]


def test_a_registry_changes_only_by_register():
    with pytest.raises(UserError, match="server optimizer registry changes only by register"):
        SERVER_OPTIMIZERS["adam"] = SERVER_OPTIMIZERS["sgd"]
    with pytest.raises(UserError, match="changes only by register"):
        SERVER_OPTIMIZERS.update(adam=SERVER_OPTIMIZERS["sgd"])
    with pytest.raises(UserError, match="changes only by register"):
        del SERVER_OPTIMIZERS["adam"]
    assert SERVER_OPTIMIZERS.origins["adam"] == BUILTIN


def test_a_plugins_refusal_or_exit_names_the_plugin(tmp_path):
    clash = tmp_path / "clash.py"
    clash.write_text(REGISTERS + "S.register('adam', S['sgd'])\n")
    with pytest.raises(UserError, match="plug-in .*clash.py: server optimizer 'adam' is already"):
        plugins.load_plugin(str(clash))
    leaves = tmp_path / "leaves.py"
    leaves.write_text("import sys\nsys.exit('no GPU, bye')\n")
    with pytest.raises(UserError, match="plug-in .*leaves.py: failed to load .*no GPU, bye"):
        plugins.load_plugin(str(leaves))


def _specs_with(tmp_path: Path, specs_dir: Path, baseline: Path | None = None) -> Path:  # noqa: F811
    """The tiny test task's specs folder plus a baseline file (default: the example's)."""
    root = tmp_path / "specs"
    shutil.copytree(specs_dir, root)
    (root / "baselines").mkdir(exist_ok=True)
    shutil.copy(
        baseline or EXAMPLES / "specs" / "baselines" / "server-yogi.yaml", root / "baselines"
    )
    return root


def test_specs_naming_an_unregistered_method_fail_at_load_listing_the_known_names(
    tmp_path,
    specs_dir,  # noqa: F811
):
    root = _specs_with(tmp_path, specs_dir)
    with pytest.raises(UserError, match="server-yogi.yaml.*unknown server optimizer 'yogi'; "
                       "known: lamb, adam, lars, adagrad, sgd"):  # fmt: skip
        load_specs([root])
    plugins.load_plugin(str(YOGI))
    assert "server-yogi" in load_specs([root]).baselines


def test_a_run_with_a_plugin_records_it_and_the_check_refuses_a_missing_or_changed_one(
    tmp_path,
    specs_dir,  # noqa: F811
    tiny_cache_dir,
    tiny_task_data,
    monkeypatch,
):
    monkeypatch.setenv("PFLBENCH_CACHE", str(tiny_cache_dir))
    plugin = plugins.load_plugin(str(YOGI))
    root = _specs_with(tmp_path, specs_dir)
    config = resolve(load_specs([root]), "synth-tiny-test", "server-yogi", "none", 0,
                     ["federated.central_steps=2"])  # fmt: skip
    run_dir = run(config, out_dir=tmp_path / "run", options=RunOptions(progress=False))
    record, _ = load_record(run_dir / "record.json")
    recorded = [p.model_dump() for p in record.software.plugins]
    assert recorded == [plugin.record()]
    plugins.check_record_plugins(recorded, "record.json")  # the same code: accepted

    plugins._loaded.clear()
    with pytest.raises(UserError, match="record.json: the run used plug-in 'server_yogi'.*not "
                       "loaded; load it with --plugin .*server_yogi.py"):  # fmt: skip
        plugins.check_record_plugins(recorded, "record.json")

    changed = tmp_path / "elsewhere" / "server_yogi.py"
    changed.parent.mkdir()
    changed.write_text(YOGI.read_text().replace('"1.0"', '"1.0"  # edited'))
    dict.pop(SERVER_OPTIMIZERS, "yogi")
    plugins.load_plugin(str(changed))
    with pytest.raises(UserError, match="plug-in 'server_yogi' loaded from .* has source sha256 "
                       ".*but the run used sha256"):  # fmt: skip
        plugins.check_record_plugins(recorded, "record.json")


def test_plugins_load_from_the_environment_and_from_entry_points(tmp_path, monkeypatch):
    (tmp_path / "env_plugin.py").write_text(
        "from pflbench.fl.server_optimizers import SERVER_OPTIMIZERS\n"
        "SERVER_OPTIMIZERS.register('env-sgd', SERVER_OPTIMIZERS['sgd'])\n"
    )
    (tmp_path / "ep_plugin.py").write_text(
        "__version__ = '0.3'\n"
        "from pflbench.fl.server_optimizers import SERVER_OPTIMIZERS\n"
        "SERVER_OPTIMIZERS.register('ep-adam', SERVER_OPTIMIZERS['adam'])\n"
    )
    dist = tmp_path / "ep_plugin-0.3.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: ep-plugin\nVersion: 0.3\n")
    (dist / "entry_points.txt").write_text("[pflbench.plugins]\nep = ep_plugin\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PFLBENCH_PLUGINS", str(tmp_path / "env_plugin.py"))
    loaded = {p.name: p for p in plugins.load_plugins()}
    assert loaded["ep_plugin"].source == "entry point ep" and loaded["ep_plugin"].version == "0.3"
    assert loaded["env_plugin"].registered == {"server optimizer": ["env-sgd"]}
    assert {"env-sgd", "ep-adam"} <= set(SERVER_OPTIMIZERS)


def test_the_example_baseline_yaml_is_a_valid_baseline():
    data = yaml.safe_load((EXAMPLES / "specs" / "baselines" / "server-yogi.yaml").read_text())
    assert data["overrides"]["federated"]["server"]["optimizer"] == "yogi"


def test_the_leaderboard_marks_rows_run_with_a_plugin():
    from test_results_leaderboard import GOLDEN, render_golden

    from pflbench.results.leaderboard import load_results
    from pflbench.results.schema import PluginInfo

    records = [r for r in load_results(GOLDEN / "results") if r.kind == "run"]
    plugin = PluginInfo(name="server_yogi", version="1.0", sha256="a" * 64, source="yogi.py")
    software = records[0].software.model_copy(update={"plugins": [plugin]})
    marked = records[0].model_copy(update={"software": software})
    assert "🔌" not in render_golden(records).split("🔌 rows ran with plug-ins")[1]
    table = render_golden([marked, *records[1:]]).split("🔌 rows ran with plug-ins")[1]
    row = next(line for line in table.splitlines() if "🔌" in line)
    assert f"| {marked.baseline} " in row and "🔌 server_yogi 1.0" in row


CLIENT_PLUGIN = '''
"""A client algorithm from outside pflbench: local gradients scaled by an option."""
import torch
from pydantic import BaseModel, ConfigDict

from pflbench.fl.algorithms import CLIENT_ALGORITHMS, ClientAlgorithm

__version__ = "0.1"


class Options(BaseModel):
    model_config = ConfigDict(extra="forbid")
    scale: float


@CLIENT_ALGORITHMS.register("scaled-sgd")
class ScaledSGD(ClientAlgorithm):
    Options = Options

    @torch.no_grad()
    def correct(self, local):
        torch._foreach_mul_(local.grads, self.options.scale)
'''


def test_a_plugin_client_algorithm_runs_with_its_options_and_refuses_bad_ones(
    tmp_path,
    specs_dir,  # noqa: F811
    tiny_cache_dir,
    tiny_task_data,
    monkeypatch,
):
    monkeypatch.setenv("PFLBENCH_CACHE", str(tiny_cache_dir))
    source = tmp_path / "scaled_sgd.py"
    source.write_text(CLIENT_PLUGIN)
    baseline = {
        "name": "frozen-clients",
        "description": "Local gradients scaled by 0: no client moves.",
        "reproduces": "none (a test)",
        "overrides": {
            "privacy": {"clipping": "none"},
            "federated": {"client": {"algorithm": "scaled-sgd", "algorithm_options": {"scale": 0}}},
        },
    }
    (tmp_path / "frozen-clients.yaml").write_text(yaml.safe_dump(baseline))
    root = _specs_with(tmp_path, specs_dir, tmp_path / "frozen-clients.yaml")
    with pytest.raises(UserError, match="unknown client algorithm 'scaled-sgd'; known: fedavg"):
        load_specs([root])
    plugin = plugins.load_plugin(str(source))
    assert plugin.registered == {"client algorithm": ["scaled-sgd"]}
    registry = load_specs([root])
    bad = resolve(registry, "synth-tiny-test", "frozen-clients", "none", 0,
                  ["federated.client.algorithm_options.scale=fast"])  # fmt: skip
    with pytest.raises(
        UserError,
        match="algorithm_options of 'scaled-sgd'(.|\n)*scale: Input should be a valid number",
    ):
        run(bad, out_dir=tmp_path / "bad", options=RunOptions(progress=False))
    # A plug-in's options are a free mapping: `1e-3` (a string to YAML 1.1) is the number 0.001,
    # so every spelling of it is one configuration, in a --set value as in a spec file.
    spelled = [
        resolve(
            registry,
            "synth-tiny-test",
            "frozen-clients",
            "none",
            0,
            [f"federated.client.algorithm_options.scale={scale}"],
        )
        for scale in ("1e-3", "1.0E-3", "0.001")
    ]
    assert {c.recipe.federated.client.algorithm_options["scale"] for c in spelled} == {0.001}
    assert len({ran_hash(c.model_dump(mode="json")) for c in spelled}) == 1
    spec_file = root / "baselines" / "frozen-clients.yaml"
    as_written = spec_file.read_text()
    spec_file.write_text(as_written.replace("scale: 0", "scale: 1e-3"))  # unquoted, as one writes
    written = resolve(load_specs([root]), "synth-tiny-test", "frozen-clients", "none", 0)
    assert written.recipe.federated.client.algorithm_options == {"scale": 0.001}
    spec_file.write_text(as_written)
    config = resolve(registry, "synth-tiny-test", "frozen-clients", "none", 0,
                     ["federated.central_steps=2"])  # fmt: skip
    run_dir = run(config, out_dir=tmp_path / "run", options=RunOptions(progress=False))
    record, _ = load_record(run_dir / "record.json")
    assert [p.name for p in record.software.plugins] == ["scaled_sgd"]
    # Scaled by 0, every Δ is 0: the final model is the seed model the run started from.
    assert record.outputs.final_model == record.data.digests["seed_model"]


def _commands(command, path=()):
    """(name path, command) of every leaf command of the CLI."""
    if hasattr(command, "commands"):  # a group
        for name, sub in command.commands.items():
            yield from _commands(sub, (*path, name))
    else:
        yield path, command


def test_every_command_that_reads_specs_loads_plugins():
    """Specs may name a plug-in's methods: a command given --specs without --plugin could not
    read them (or check a record made with one)."""
    import typer.main

    from pflbench.cli import app

    reading = {
        " ".join(path): {o for p in command.params for o in p.opts}
        for path, command in _commands(typer.main.get_command(app))
        if any("--specs" in p.opts for p in command.params)
    }
    assert {"run", "results validate", "baselines show", "sweep"} <= set(reading)
    assert [name for name, options in reading.items() if "--plugin" not in options] == []


def test_a_plugin_baseline_is_shown_with_its_plugin():
    from typer.testing import CliRunner

    from pflbench.cli import app

    args = ["baselines", "show", "server-yogi", "--specs", str(EXAMPLES / "specs")]
    without = CliRunner().invoke(app, args)
    assert isinstance(without.exception, UserError)
    assert "unknown server optimizer 'yogi'" in str(without.exception)
    shown = CliRunner().invoke(app, [*args, "--plugin", str(YOGI)])
    assert shown.exit_code == 0 and "name: server-yogi" in shown.output


LEAKY_PLUGIN = '''
"""A privacy mechanism from outside pflbench: Algorithm 1, then EXCESS * C_t added to one element
of each clipped update (its norm then over C_t whatever the update: at least (EXCESS - 1) C_t)."""
from pflbench.privacy.mechanisms import PRIVACY_MECHANISMS, PrivacyMechanism

EXCESS = {excess}


class Leaky(PrivacyMechanism):
    def constrain_sensitivity(self, update, user, step):
        facts = super().constrain_sensitivity(update, user, step)
        next(iter(update.values())).view(-1)[0] += EXCESS * self.clip_bound
        return facts


PRIVACY_MECHANISMS.register("leaky", Leaky)
'''


def _mechanism_run(tmp_path, specs_dir, name: str, mechanism: str, users: int):  # noqa: F811
    """A 2-step DP run of the tiny task with a baseline whose privacy.mechanism is `mechanism`,
    every one of its `users` in each step (q = 1: no step without a client to check)."""
    baseline = {"name": name, "description": "A test.", "reproduces": "none (a test)",
                "overrides": {"privacy": {"mechanism": mechanism}}}  # fmt: skip
    (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(baseline))
    root = _specs_with(tmp_path / name, specs_dir, tmp_path / f"{name}.yaml")
    config = resolve(load_specs([root]), "synth-tiny-test", name, "eps7.2-high-pop", 0,
                     ["federated.central_steps=2", f"federated.cohort_size={users}"])  # fmt: skip
    run_dir = run(config, out_dir=tmp_path / name / "run", options=RunOptions(progress=False))
    return load_record(run_dir / "record.json")[0]


def test_a_plugin_mechanism_that_breaks_its_clip_bound_stops_the_run_before_any_claim(
    tmp_path,
    specs_dir,  # noqa: F811
    tiny_cache_dir,
    tiny_task_data,
    monkeypatch,
):
    """Its noise is calibrated to C_t, so an update over C_t makes the run's ε false, and the
    record would re-score and re-account like any other: pflbench measures a plug-in's updates
    itself, and the run stops at the first one over C_t."""
    monkeypatch.setenv("PFLBENCH_CACHE", str(tiny_cache_dir))
    (tmp_path / "leaky.py").write_text(LEAKY_PLUGIN.format(excess=3.0))
    plugins.load_plugin(str(tmp_path / "leaky.py"))
    with pytest.raises(UserError, match=r"privacy mechanism 'leaky' \(plug-in leaky\) left user "
                       r".* at step 0 with L2 norm .*over its clip bound C_t"):  # fmt: skip
        _mechanism_run(tmp_path, specs_dir, "leaky-by-3c", "leaky",
                       len(tiny_task_data.federated_train.users()))  # fmt: skip
    assert not (tmp_path / "leaky-by-3c" / "run" / "record.json").exists()


def test_a_plugin_mechanism_within_its_bound_aggregates_as_the_builtin_one(tmp_path):
    """Measured and found within C_t (EXCESS 0: Algorithm 1 itself), a plug-in's updates give the
    built-in mechanism's noised average to the last bit: the check changes nothing it passes."""
    from conftest import make_mechanism

    from pflbench.fl.aggregate import StepAggregator

    (tmp_path / "leaky.py").write_text(LEAKY_PLUGIN.format(excess=0.0))
    plugins.load_plugin(str(tmp_path / "leaky.py"))
    generator = torch.Generator().manual_seed(0)
    updates = [{"a": torch.randn(30, generator=generator), "b": torch.randn(7, generator=generator)}
               for _ in range(4)]  # fmt: skip
    averages = {}
    for name in ("leaky", "gaussian"):
        privacy = {"mechanism": name, "clip_bound": 0.01, "clipping": "global"}
        mechanism = make_mechanism(privacy, 4, sigma_dp=0.5)
        aggregator = StepAggregator(updates[0], mechanism, 0, update_bound=10.0)
        assert aggregator.check_bound == (name == "leaky")
        for i, update in enumerate(updates):
            aggregator.add({k: v.clone() for k, v in update.items()}, f"u{i}", 1.0, 1, 10)
        averages[name], _ = aggregator.finish()
    assert all(torch.equal(a, b) for a, b in zip(*averages.values(), strict=True))


def test_a_tiny_excess_over_the_clip_bound_is_refused():
    """One fp32 step over C is over C: the check allows only its own fp64 measurement error."""
    from conftest import make_mechanism

    mechanism = make_mechanism({"clip_bound": 0.01, "clipping": "global"}, 4, sigma_dp=1.0)
    above = np.nextafter(np.float32(0.01), np.float32(1))
    below = np.nextafter(np.float32(0.01), np.float32(0))
    assert check_within_clip_bound(mechanism, {"w": torch.tensor([float(below)])}, "u0", 0) <= 0.01
    with pytest.raises(UserError, match="over its clip bound"):
        check_within_clip_bound(mechanism, {"w": torch.tensor([float(above)])}, "u0", 0)


ACCOUNTANT_PLUGIN = '''"""An accountant that reports RDP's ε times {factor} (a test)."""
from dataclasses import replace

from pflbench.privacy import rdp
from pflbench.privacy.accountants import ACCOUNTANTS
from pflbench.privacy.accounting import Accountant


def epsilon(mechanism, delta):
    result = rdp.epsilon(mechanism, delta)
    return replace(result, accountant="{name}", epsilon=result.epsilon * {factor})


ACCOUNTANTS.register(
    "{name}", Accountant("{name}", "RDP times {factor}", "opacus", epsilon, rdp.summary, True)
)
'''


def test_a_plugin_accountant_that_under_reports_epsilon_is_refused_before_any_run(
    tmp_path,
    specs_dir,  # noqa: F811
    tiny_cache_dir,
    monkeypatch,
):
    """A budget may name a plug-in accountant: it calibrates the run's noise, its ε is the
    record's claim, and submit re-accounts the claim with the same code, so an accountant that
    under-reports would be filed as meeting its budget. Its ε must not lie below PRV's proven
    lower bound; an honest one (RDP's ε again) calibrates as RDP does."""
    monkeypatch.setenv("PFLBENCH_CACHE", str(tiny_cache_dir))
    for name, factor in (("rdp-again", 1.0), ("rdp-halved", 0.5)):
        (tmp_path / f"{name}.py").write_text(ACCOUNTANT_PLUGIN.format(name=name, factor=factor))
        plugins.load_plugin(str(tmp_path / f"{name}.py"))
    family = sampled_gaussian(0.01, 100)
    assert calibrate_noise(2.0, family, 1e-6, "rdp-again") == calibrate_noise(
        2.0, family, 1e-6, "rdp"
    )
    refusal = (r"accountant 'rdp-halved' \(plug-in rdp-halved\) gives ε = .* below .*, a proven"
               r" lower bound .* under-reports ε")  # fmt: skip
    with pytest.raises(UserError, match=refusal):
        calibrate_noise(2.0, family, 1e-6, "rdp-halved")

    root = tmp_path / "specs"
    shutil.copytree(specs_dir, root)
    budget = {"name": "eps7.2-halved", "description": "eps7.2-high-pop by rdp-halved (a test).",
              "epsilon": 7.2, "delta": 1e-9, "population": 69506000, "cohort": 204800,
              "steps": 2034, "accountant": "rdp-halved"}  # fmt: skip
    (root / "tasks" / "budgets.yaml").write_text(yaml.safe_dump({"budgets": [budget]}))
    with pytest.raises(UserError, match=refusal):
        config = resolve(load_specs([root]), "synth-tiny-test", "perlayer-dim", "eps7.2-halved",
                         0, ["federated.central_steps=1"])  # fmt: skip
        run(config, out_dir=tmp_path / "run", options=RunOptions(progress=False))
    assert not (tmp_path / "run" / "record.json").exists()


def test_an_accountant_registered_outside_a_plugin_is_checked_too():
    """Code that registers an accountant without the plug-in loader (a script, a library) is no
    built-in either: its ε is checked the same way."""
    from pflbench.privacy.accountants import compute_epsilon
    from pflbench.privacy.accounting import SampledGaussian

    exec(ACCOUNTANT_PLUGIN.format(name="halved-here", factor=0.5), {})  # as a script would
    with pytest.raises(UserError, match=r"'halved-here' \(registered outside a plug-in\) gives"):
        compute_epsilon(SampledGaussian(1.0, 0.01, 100), 1e-6, "halved-here")


def test_a_mechanism_registered_outside_a_plugin_is_measured_too():
    """A mechanism class pflbench does not ship (a script's or a library's, registered without
    the plug-in loader) has its updates measured under DP, as a plug-in's are."""
    from conftest import make_mechanism

    from pflbench.privacy.mechanisms import (
        PRIVACY_MECHANISMS,
        PrivacyMechanism,
        checks_plugin_bound,
    )

    class Doubling(PrivacyMechanism):
        def constrain_sensitivity(self, update, user, step):
            facts = super().constrain_sensitivity(update, user, step)
            for tensor in update.values():
                tensor.mul_(2.0)
            return facts

    PRIVACY_MECHANISMS.register("doubling-here", Doubling)
    privacy = {"mechanism": "doubling-here", "clip_bound": 0.01, "clipping": "global"}
    mechanism = make_mechanism(privacy, 4, sigma_dp=0.5)
    shipped = make_mechanism({**privacy, "mechanism": "gaussian"}, 4, sigma_dp=0.5)
    assert checks_plugin_bound(mechanism) and not checks_plugin_bound(shipped)
    update = {"w": torch.ones(10)}
    mechanism.constrain_sensitivity(update, "u0", 0)
    with pytest.raises(UserError, match=r"'doubling-here' \(registered outside a plug-in\) left"):
        check_within_clip_bound(mechanism, update, "u0", 0)


def test_a_plugin_registering_the_wrong_kind_of_entry_is_refused_naming_it(tmp_path):
    """A mechanism that is not a PrivacyMechanism subclass, or a bare function as a server
    optimizer, is refused when registered (naming the plug-in), not where a run first uses it."""
    plugin = tmp_path / "wrongtype.py"
    plugin.write_text(
        "from pflbench.privacy.mechanisms import PRIVACY_MECHANISMS\n"
        "class PlainMech:\n    pass\n"
        "PRIVACY_MECHANISMS.register('plainmech', PlainMech)\n"
    )
    with pytest.raises(
        UserError, match=r"'plainmech' \(plug-in wrongtype\) must be a subclass of PrivacyMechanism"
    ):
        plugins.load_plugin(str(plugin))
    plugin.write_text(
        "from pflbench.fl.server_optimizers import SERVER_OPTIMIZERS\n"
        "SERVER_OPTIMIZERS.register('bareopt', lambda *a: None)\n"
    )
    with pytest.raises(UserError, match=r"'bareopt' \(plug-in wrongtype\) must be a ServerRule"):
        plugins.load_plugin(str(plugin))
