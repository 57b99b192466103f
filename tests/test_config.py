"""A bad config stops with a message naming the offending key; overrides and defaults behave."""

from __future__ import annotations

import pytest

from protocols.config import ConfigError, load_config, parse_config
from sim.hierarchy import prepare


def test_examples_are_valid():
    """Every example: a run config, or a job file (`[job]`) valid for the example federation."""
    from pathlib import Path

    from protocols.jobs import canonical_job, read_job_file

    federation = load_config("examples/federation.toml")
    for path in sorted(Path("examples").glob("*.toml")):
        if "\n[job]" in "\n" + path.read_text():
            canonical_job(read_job_file(path).config, federation)
        else:
            load_config(path)


@pytest.mark.parametrize(
    "data, key",
    [
        ({"run": {"rounds": -1}}, "run.rounds"),
        ({"run": {"rounds": 0}}, "run.rounds"),
        ({"run": {"colour": "red"}}, "run.colour: unknown key"),
        ({"nonsense": {}}, "nonsense: unknown key"),
        ({"job": {"id": "a"}}, "job: a [job] section makes this a job file, for a federation: `fedtier submit"),
        ({"topology": {"cells": 0}}, "topology.cells"),
        ({"algorithm": {"name": "fedavg", "lr": -0.1}}, "algorithm.lr"),
        ({"algorithm": {"name": "fedavg", "momentum_typo": 0.9}}, "algorithm.momentum_typo: unknown key"),
        ({"algorithm": {"name": "fedsgd?"}}, "algorithm.name"),
        ({"algorithm": {"name": "fedavg", "local_steps": 0, "local_epochs": 0}}, "algorithm"),
        ({"data": {"dataset": "cifar10"}}, "data.dataset"),
        ({"runtime": {"quorum": 1.5}}, "runtime.quorum"),
        ({"run": {"name": "a/b"}}, "run"),
        ({"model": {"name": "cnn4", "channels": [8, 16]}}, "model.channels: cnn4 needs 4 widths, got [8, 16]"),
        (  # walked: name = "cnn4" alone said 'got [32, 64]', widths the user never wrote
            {"model": {"name": "cnn4"}},
            "model.channels: cnn4 needs 4 widths, and the default, [32, 64], is cnn's: set them, e.g. channels = "
            "[32, 64, 128, 256]",
        ),
        ({"algorithm": {"name": "decomfl", "momentum": 1.0}}, "algorithm.momentum"),
    ],
)
def test_bad_config_names_key(data, key):
    with pytest.raises(ConfigError) as err:
        parse_config(data)
    assert key in str(err.value)


@pytest.mark.parametrize(
    "algorithm, needs",
    [
        ({"async_buffer": 3}, 'algorithm.async_buffer = 3 has no effect without mode = "async"'),
        ({"local_steps": 50, "local_epochs": 5}, "algorithm.local_epochs = 5.0 has no effect without local_steps = 0"),
        ({"amplify_eta": 3.0}, "algorithm.amplify_eta = 3.0 has no effect without amplify_period > 0"),
        (
            {"trim_beta": 0.3, "cell_aggregator": "median"},
            'without cell_aggregator or cloud_aggregator = "trimmed_mean"',
        ),
        ({"multikrum_keep": 3, "cloud_aggregator": "krum"}, '= "multikrum"'),
        (
            {"topk_fraction": 0.1, "uplink": "qsgd"},
            'algorithm.topk_fraction = 0.1 has no effect without uplink = "topk"',
        ),
        ({"signsgd_mode": "scaled"}, 'algorithm.signsgd_mode = "scaled" has no effect without uplink = "signsgd"'),
        ({"server_momentum": 0.5, "server_optimizer": "fedadam"}, 'without server_optimizer = "fedavgm"'),
        ({"server_beta2": 0.9, "server_optimizer": "fedadagrad"}, 'without server_optimizer = "fedadam" | "fedyogi"'),
        ({"name": "hist", "max_staleness": 3}, 'algorithm.max_staleness = 3 has no effect without mode = "async"'),
        ({"name": "fedalign", "priority_fraction": 0.5, "epsilon_later": 0.1}, "without epsilon_drop_round > 0"),
    ],
)
def test_a_key_that_has_no_effect_with_the_others_is_refused(algorithm, needs):
    """A key the chosen settings never read is refused, naming what it needs: a researcher who sets
    ``async_buffer`` and forgets ``mode = "async"`` ran synchronous FedAvg, told nothing."""
    with pytest.raises(ConfigError) as err:
        parse_config({"algorithm": {"name": "fedavg", **algorithm}})
    assert needs in str(err.value)
    # with what it needs (or at its default, as a run folder's full config.toml writes it) it is taken
    parse_config({"algorithm": {"name": "fedavg", "async_buffer": 5, "amplify_eta": 1.0, "trim_beta": 0.2}})
    parse_config({"algorithm": {"name": "fedavg", "mode": "async", "async_buffer": 3, "max_staleness": 3}})
    parse_config({"algorithm": {"name": "fedavg", "amplify_period": 2, "amplify_eta": 3.0, "amplify_start": 1}})
    parse_config({"algorithm": {"name": "fedavg", "cloud_aggregator": "multikrum", "multikrum_keep": 1}})


@pytest.mark.parametrize(
    "data, needs",
    [
        ({"alpha": 0.1}, "alpha = 0.1 has no effect with partition = 'iid': it applies to 'dirichlet'"),
        ({"partition": "dirichlet", "shards_per_device": 3}, "it applies to 'shards' | 'cell_shards'"),
        (
            {"partition": "dirichlet", "alpha_cells": 0.1},
            "alpha_cells = 0.1 has no effect with partition = 'dirichlet'",
        ),
    ],
)
def test_a_partition_key_another_partition_never_reads_is_refused(data, needs):
    """``alpha = 0.1`` under the default iid partition split the data iid: the researcher thought it non-iid."""
    with pytest.raises(ConfigError) as err:
        parse_config({"data": data})
    assert needs in str(err.value)
    parse_config({"data": {"partition": "dirichlet", "alpha": 0.1, "shards_per_device": 2}})  # 2: the default


@pytest.mark.parametrize(
    "model, needs",
    [
        ({"name": "cnn", "hidden": [64]}, "model.hidden = [64] has no effect with name = 'cnn': it shapes 'mlp'"),
        ({"name": "logreg", "fc": 10}, "model.fc = 10 has no effect with name = 'logreg': it shapes 'cnn'"),
        ({"channels": [8, 8]}, "model.channels = [8, 8] has no effect with name = 'mlp': it shapes 'cnn' | 'cnn4'"),
    ],
)
def test_a_model_key_another_model_reads_is_refused(model, needs):
    """``hidden = [64]`` with ``name = "cnn"`` trained the default CNN: the user thought its width was set."""
    with pytest.raises(ConfigError) as err:
        parse_config({"model": model})
    assert needs in str(err.value)
    # at their defaults (a run folder's full config.toml writes every key) they are taken
    parse_config({"model": {"name": "cnn", "hidden": [200, 200], "channels": [8, 8], "fc": 0}})
    parse_config({"model": {"name": "logreg", "channels": [32, 64], "fc": 512}})


def test_a_participation_parameter_of_another_model_is_refused_also_with_always(make_config):
    """``prob = 0.5`` with the default ``always`` ran every device every round, told nothing (the model that would
    have refused it is never built for ``always``)."""
    with pytest.raises(ConfigError, match=r"participation model 'always' has no parameter\(s\) \['prob'\]"):
        prepare(make_config(participation={"prob": 0.5}))
    with pytest.raises(ConfigError, match=r"'uniform' has no parameter\(s\) \['p_on'\]"):
        prepare(make_config(participation={"model": "uniform", "per_round": 2, "p_on": 0.5}))


@pytest.mark.parametrize(
    "section, needs",
    [
        (
            {"privacy": {"noise_multiplier": 2.0, "clip": 0.5}},
            'noise_multiplier = 2.0 has no effect without dp = "local"',
        ),
        ({"privacy": {"epsilon_budget": 3.0}}, "epsilon_budget = 3.0 has no effect without dp"),
        ({"privacy": {"secagg_threshold": 0.6}}, "secagg_threshold = 0.6 has no effect without secure_aggregation"),
        (
            {"privacy": {"dp": "cell", "noise_multiplier": 1.0, "dp_min_survivors": 3}},
            'dp_min_survivors = 3 has no effect without dp = "cell" with secure_aggregation = true',
        ),
        ({"attack": {"fraction": 0.2}}, 'fraction and factor have no effect with kind = "none"'),
    ],
)
def test_a_privacy_or_attack_key_that_has_no_effect_is_refused(section, needs):
    """``noise_multiplier`` and ``clip`` without ``dp`` ran with no privacy at all, told nothing; an attack
    ``fraction`` without its ``kind`` measured robustness against no attacker."""
    with pytest.raises(ConfigError) as err:
        parse_config(section)
    assert needs in str(err.value)


def test_an_attack_fraction_that_rounds_down_to_no_attacker_is_refused(make_config):
    from sim.attack import byzantine_devices

    cfg = make_config(attack={"kind": "scale", "fraction": 0.3})  # 0.3 x 3 devices per cell: no attacker
    with pytest.raises(ConfigError, match=r"attack.fraction = 0.3 of 3 devices per cell .* fraction >= 0.333"):
        byzantine_devices(cfg)
    assert len(byzantine_devices(make_config(attack={"kind": "scale", "fraction": 0.34}))) == 2  # one per cell


def test_more_devices_than_samples_is_a_clear_error(make_config):
    cfg = make_config(topology={"cells": 2, "devices_per_cell": 50}, data={"max_train": 60})
    with pytest.raises(ConfigError, match="topology.*100 devices.*60 training samples"):
        prepare(cfg)


def test_overrides_are_parsed_as_toml(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[run]\nrounds = 3\n[algorithm]\nname = "fedavg"\n')
    cfg = load_config(path, ["run.rounds=7", "algorithm.lr=0.5", "model.hidden=[16, 8]", "run.name=abc"])
    assert cfg.run.rounds == 7 and cfg.train.lr == 0.5 and cfg.model.hidden == (16, 8) and cfg.run.name == "abc"
    with pytest.raises(ConfigError, match="run.rounds"):
        load_config(path, ["run.rounds=-2"])
    with pytest.raises(ConfigError, match="expected key.path=value"):
        load_config(path, ["run.rounds"])
    with pytest.raises(ConfigError, match=r"override 'run=5': run is a section: set one of its keys \(run.KEY=...\)"):
        load_config(path, ["run=5", "run.name=abc"])  # (was: "override 'run.name=abc': run is not a section")


def test_missing_and_invalid_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "none.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[run\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)


def test_written_config_reloads_identically(tmp_path, make_config):
    cfg = make_config()
    path = tmp_path / "again.toml"
    path.write_text(cfg.to_toml())
    again = load_config(path)
    assert again.train == cfg.train
    assert again.model_dump(exclude={"algorithm"}) == cfg.model_dump(exclude={"algorithm"})


def test_the_annotated_config_of_the_docs_is_a_valid_config():
    """The annotated config of docs/how-to/configure.md names every section a user may set: keep it true."""
    import re
    import tomllib
    from pathlib import Path

    page = (Path(__file__).resolve().parent.parent / "docs" / "how-to" / "configure.md").read_text()
    block = re.search(r"```toml\n(.*?)```", page, re.S).group(1)
    data = tomllib.loads(block)
    cfg = parse_config(data)
    from protocols.config import RunConfig

    assert set(data) == set(RunConfig.model_fields)  # every section is documented
    assert cfg.run.name == "quickstart"


def test_cell_of_a_device_id_is_parsed_and_unknown_ids_are_refused():
    from edge_agent.node import cell_of
    from protocols.config import TopologySection

    topo = TopologySection(cells=12, devices_per_cell=30)
    assert all(topo.cell_of(d) == c for c in topo.cell_ids() for d in topo.device_ids(c))
    for bad in ("c12-d0", "c0-d30", "c01-d1", "c1-d01", "c1-d-1", "c+1-d1", "d1", "c1-d", "-d1", "c1-d١", "x1-d1"):
        assert topo.cell_of(bad) is None, bad
    cfg = parse_config({"topology": {"cells": 2, "devices_per_cell": 3}})
    assert cell_of(cfg, "c1-d2") == "c1"
    with pytest.raises(ValueError, match="not in the topology"):
        cell_of(cfg, "c2-d0")


def test_synthetic_dataset_is_sized_from_the_config():
    cfg = parse_config(
        {"topology": {"cells": 3, "devices_per_cell": 400}, "data": {"dataset": "synthetic", "n": 12000, "n_test": 300}}
    )
    prep = prepare(cfg)
    assert (prep.dataset.num_train, prep.dataset.num_test) == (12000, 300)
    assert sum(len(prep.device_data[d]) for d in cfg.topology.all_devices()) == 12000
    with pytest.raises(ConfigError, match="data: .*synthetic dataset only"):
        parse_config({"data": {"dataset": "mnist", "n": 100}})


def test_performance_settings_a_command_does_not_use_are_warned_of_not_refused(make_config, caplog) -> None:
    """runtime.cohort_size with the per-device engine, runtime.sim_workers under fedtier run: accepted and
    silently without effect (a researcher tuned them and measured nothing). They change speed, never results:
    the run goes on, with a warning that names the setting and why."""
    from protocols.execution import idle_settings
    from sim.launcher import run_simulation

    cfg = make_config(run={"rounds": 1}, runtime={"cohort_size": 8, "cohort_threads": 2})
    with caplog.at_level("WARNING", logger="fedtier.sim"):
        result = run_simulation(cfg, write_output=False)
    assert len(result.history) == 1
    assert 'runtime.cohort_size = 8 has no effect with engine = "device"' in caplog.text
    assert 'runtime.cohort_threads = 2 has no effect with engine = "device"' in caplog.text
    cohort = make_config(runtime={"engine": "cohort", "cohort_size": 8, "sim_workers": 2})
    assert idle_settings(cohort, "sim") == []
    run = idle_settings(cohort, "run")
    assert len(run) == 1 and run[0].startswith("runtime.sim_workers = 2 has no effect under fedtier run")
    backend = make_config(runtime={"sim_backend": "ray"})
    assert idle_settings(backend, "sim") == [
        "runtime.sim_backend = 'ray' has no effect without runtime.sim_workers (the devices train in this process)"
    ]
    assert idle_settings(make_config(), "run") == idle_settings(make_config(), "sim") == []
    sums = make_config(runtime={"engine": "cohort", "cell_sums": "host"})  # fedtier run's cells have no engine
    assert idle_settings(sums, "sim") == []
    assert idle_settings(sums, "run") == [
        "runtime.cell_sums = 'host' has no effect under fedtier run (its cells have no engine: they sum on the host)"
    ]
