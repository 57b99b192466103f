"""Hostile configuration, as a user who mistypes or a config generator gone wrong gives it: every numeric key
of every section and algorithm swept with negative, NaN, infinite and absurd values, and the absurd values that
would crash, hang or allocate later refused at the start with a message naming the key. Validation only (no run
starts), except the CLI checks at the end, which stop before any data is loaded."""

from __future__ import annotations

import math
import typing

import numpy as np
import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from fedtier.cli import main
from protocols.algorithms import ALGORITHMS
from protocols.algorithms.compose import compose
from protocols.config import ConfigError, RunConfig, parse_config
from protocols.limits import memory_refusal
from sim.datasets import load_dataset
from sim.hierarchy import run_dataset
from sim.launcher import run_simulation
from tests.conftest import small_config

BASE: dict[str, typing.Any] = {"topology": {"cells": 1, "devices_per_cell": 2}, "algorithm": {"name": "fedavg"}}
BASE_RUNTIME = RunConfig.model_fields["runtime"].default
INFINITE_MEANS_ALL = {("fedalign", "epsilon"), ("fedalign", "epsilon_later")}  # "inf = all devices"


def _kind(annotation: object) -> type | None:
    """``int`` or ``float`` for a numeric field (optional or not), else ``None``."""
    types = {annotation, *typing.get_args(annotation)}
    return int if int in types else float if float in types else None


def _section_fields() -> list[tuple[str, str, type]]:
    out = []
    for section, field in RunConfig.model_fields.items():
        model = field.annotation
        if isinstance(model, type) and issubclass(model, BaseModel):
            out += [(section, k, t) for k, f in model.model_fields.items() if (t := _kind(f.annotation)) is not None]
    return out


def _algorithm_fields() -> list[tuple[str, str, type]]:
    return [
        (name, k, t)
        for name, cls in sorted(ALGORITHMS.items())
        for k, f in cls.Params.model_fields.items()
        if (t := _kind(f.annotation)) is not None
    ]


def _names(refusal: str, section: str, key: str) -> bool:
    """The refusal names ``section.key`` (a field's own check), or the section and the key (a section's check)."""
    return f"{section}.{key}" in refusal or (f"{section}: " in refusal and key in refusal)


def _outcome(data: dict[str, typing.Any]) -> str | None:
    """``None`` when the config validates, else the refusal; anything but :class:`ConfigError` fails the test."""
    try:
        parse_config(data)  # validates [algorithm] too
    except ConfigError as exc:
        return str(exc)
    return None


def test_every_numeric_section_key_refuses_negative_nan_and_infinite_values_naming_the_key():
    fields = _section_fields()
    assert len(fields) > 60  # the sweep reaches the sections (a refactor that hid them would pass vacuously)
    for section, key, kind in fields:
        for bad in (-1, math.nan, math.inf, -math.inf) if kind is float else (-1,):
            refused = _outcome({**BASE, section: {**BASE.get(section, {}), key: bad}})
            assert refused is not None and _names(refused, section, key), (section, key, bad, refused)


def test_every_numeric_algorithm_key_refuses_negative_and_nan_and_infinity_unless_it_means_all():
    fields = _algorithm_fields()
    assert len(fields) > 40
    for name, key, kind in fields:
        bads = (-1, math.nan, math.inf) if kind is float else (-1,)
        for bad in bads:
            if bad == math.inf and (name, key) in INFINITE_MEANS_ALL:
                continue
            refused = _outcome({**BASE, "algorithm": {"name": name, key: bad}})
            assert refused is not None and key in refused, (name, key, bad, refused)
    assert _outcome({**BASE, "algorithm": {"name": "fedalign", "priority_fraction": 0.5, "epsilon": math.inf}}) is None


ABSURD = [  # (section, key, value, what the refusal says besides the key)
    ("runtime", "device_deadline", 1e12, "less than or equal to 10000000"),
    ("runtime", "cell_deadline", 1e12, "less than or equal"),
    ("runtime", "startup_wait", 1e12, "less than or equal"),
    ("runtime", "heartbeat", 1e11, "less than or equal"),
    ("runtime", "heartbeat_timeout", 1e11, "less than or equal"),
    ("runtime", "rejoin_wait", 1e11, "less than or equal"),
    ("runtime", "rejoin_poll", 1e11, "less than or equal"),
    ("runtime", "worker_stall_s", 1e11, "less than or equal"),
    ("runtime", "cohort_threads", 10**6, "less than or equal to 1024"),
    ("runtime", "cell_process_threads", 10**6, "less than or equal to 1024"),
    ("runtime", "direction_threads", 10**6, "less than or equal to 64"),
    ("runtime", "sim_workers", 10**9, "less than or equal to 4096"),
    ("runtime", "cell_processes", 10**9, "less than or equal to 4096"),
    ("runtime", "max_message_bytes", 2**40, "less than or equal to 536870912"),  # was cut to it by reassembly
    ("run", "rounds", 10**18, "less than or equal to 1000000000"),  # beyond 2**53: inexact as a float64
    ("algorithm", "edge_rounds", 10**18, "less than or equal to 1000000000"),
    ("algorithm", "local_steps", 10**18, "less than or equal to 1000000000"),
    ("algorithm", "local_epochs", 1e18, "less than or equal to 1000000000"),
    ("monitoring", "metrics_port", 70000, "less than or equal to 65535"),
    ("monitoring", "idle_heartbeat", 1e12, "less than or equal"),
    ("run", "output", "", "at least 1 character"),
    ("run", "plugins", 5, "a list of module names, not 5"),  # was a TypeError
    ("run", "plugins", "abc", "a list of module names, not 'abc'"),  # imported a, b and c
    ("model", "hidden", [0], "greater than or equal to 1"),
    ("model", "hidden", [-5, 10], "greater than or equal to 1"),
    ("model", "hidden", [1] * 101, "at most 100 items"),  # 100,000 layers took 26 s to build, in every process
    ("participation", "probs", [math.nan, 0.5], "finite number"),
    ("data", "partition", "stripes", 'data.partition = "stripes": must be'),
    ("runtime", "engine", "gpu", 'runtime.engine = "gpu": must be'),
]


@pytest.mark.parametrize(("section", "key", "value", "says"), ABSURD, ids=[f"{s}.{k}={v!r}" for s, k, v, _ in ABSURD])
def test_an_absurd_value_is_refused_at_the_start_naming_its_key(section, key, value, says):
    refused = _outcome({**BASE, section: {**BASE.get(section, {}), key: value}})
    assert refused is not None and _names(refused, section, key) and says in refused, refused


def test_absurd_values_across_keys_are_refused_before_a_timer_or_an_array_is_made():
    # the cloud's derived deadline: 1.5 x edge_rounds x device_deadline would overflow the platform's timers
    derived = {**BASE, "algorithm": {"name": "fedavg", "edge_rounds": 10**6}, "runtime": {"device_deadline": 1e6}}
    assert "runtime.cell_deadline: unset, it is 1.5e+12 s" in str(_outcome(derived))
    explicit = {**derived, "runtime": {"device_deadline": 1e6, "cell_deadline": 1e6}}
    assert _outcome(explicit) is None  # set, it is the operator's bound
    # more cells needed for progress than the topology has: was silently "every cell"
    assert _outcome({**BASE, "runtime": {"min_cells": 5}}) == "runtime.min_cells: 5, but the topology has 1 cells"
    # DeComFL: K x P scalars a round, kept by the cloud for every round (a MemoryError at its first deadline)
    wide = parse_config({**BASE, "algorithm": {"name": "decomfl", "perturbations": 10**6}})  # K x P fits: 1e6
    with pytest.raises(ConfigError, match=r"algorithm.perturbations needs .* GiB.*a step's 1000000 directions"):
        wide.build_algorithm(wide.model_spec((784,), 10))  # 10**6 x 199,210 float32: drawn at the first step
    zo = _outcome({**BASE, "algorithm": {"name": "decomfl", "perturbations": 10**9}})
    assert zo is not None and "local_steps x perturbations = 1,000,000,000 scalars" in zo


def test_a_model_larger_than_memory_is_refused_before_torch_allocates_it():
    cfg = parse_config({**BASE, "model": {"name": "mlp", "hidden": [10**9, 10**9]}})
    with pytest.raises(ConfigError, match=r"model: mlp has 1,000,000,\d{3},\d{3},\d{3},\d{3} parameters.*GiB"):
        cfg.model_spec((784,), 10)
    cnn = parse_config({**BASE, "model": {"name": "cnn", "channels": [32, 64], "fc": 10**12}})
    with pytest.raises(ConfigError, match="model: cnn has .* more than this machine's"):
        cnn.model_spec((1, 28, 28), 10)
    assert parse_config(BASE).model_spec((784,), 10).num_params() == 784 * 200 + 200 + 200 * 200 + 200 + 2010
    assert memory_refusal(2**30, "x", memory=2**31) is None
    assert memory_refusal(2**32, "data.n", memory=2**31) == (
        "data.n needs 4.0 GiB, more than this machine's 2.0 GiB of memory"
    )


def test_a_synthetic_data_set_larger_than_memory_is_refused_before_numpy_allocates_it():
    with pytest.raises(ValueError, match=r"synthetic dataset: n = 1,000,000,000,000 .* GiB"):
        load_dataset("synthetic", n=10**12)


def _npz(path, **parts):
    x = np.random.default_rng(0).random((20, 4)).astype(np.float32)
    y = np.arange(20) % 2
    arrays = {"x_train": x, "y_train": y, "x_test": x, "y_test": y} | parts
    np.savez(path, **arrays)
    return path


BAD_NPZ = [  # (what is wrong, the parts it replaces, what the refusal says)
    ("object arrays (would unpickle)", {"x_train": np.array([None] * 20, dtype=object)}, "allow_pickle=False"),
    ("NaN features", {"x_test": np.full((20, 4), np.nan, np.float32)}, "NaN or infinite"),
    ("mismatched lengths", {"y_train": np.arange(5) % 2}, "x_train must be [N, ...] and y_train [N]"),
    ("labels out of range", {"num_classes": np.array(2), "y_test": np.arange(20) % 9}, "labels span 0..8"),
    ("a negative input_shape", {"input_shape": np.array([-2, -2])}, "input_shape (-2, -2) does not hold"),
    ("a text num_classes", {"num_classes": np.array("ten")}, "must be integers"),
]


@pytest.mark.parametrize(("wrong", "parts", "says"), BAD_NPZ, ids=[w for w, _, _ in BAD_NPZ])
def test_a_bad_npz_data_set_is_refused_naming_the_file(tmp_path, wrong, parts, says):
    path = _npz(tmp_path / "d.npz", **parts)
    with pytest.raises(ValueError, match=f"dataset npz:{path}") as refused:
        load_dataset(f"npz:{path}")
    assert says in str(refused.value)


def test_a_truncated_empty_or_missing_npz_is_refused_as_unreadable(tmp_path):
    good = _npz(tmp_path / "good.npz")
    assert load_dataset(f"npz:{good}").num_train == 20
    (tmp_path / "cut.npz").write_bytes(good.read_bytes()[:300])
    (tmp_path / "empty.npz").write_bytes(b"")
    (tmp_path / "dir.npz").mkdir()
    for name in ("cut.npz", "empty.npz", "dir.npz", "missing.npz"):
        with pytest.raises(ValueError, match=f"dataset npz:{tmp_path / name}: cannot read it"):
            load_dataset(f"npz:{tmp_path / name}")
    missing = small_config(tmp_path, data={"dataset": f"npz:{tmp_path / 'missing.npz'}"})
    with pytest.raises(ConfigError) as refused:  # what fedtier sim prints: the setting named once
        run_dataset(missing)
    assert str(refused.value).startswith(f"data.dataset: dataset npz:{tmp_path / 'missing.npz'}: cannot read it")


CLI = """
[run]
name = "hostile"
output = "{out}"
[topology]
cells = 1
devices_per_cell = 2
[data]
dataset = "synthetic"
n = 40
"""


@pytest.mark.parametrize(
    ("override", "says"),
    [
        ("runtime.device_deadline=inf", "runtime.device_deadline"),
        ("runtime.cohort_threads=1000000", "runtime.cohort_threads"),
        ("data.n=1000000000000", "synthetic dataset: n = 1,000,000,000,000"),
        ("model.hidden=[1000000000, 1000000000]", "model: mlp has"),
        ('runtime.onnx_model="/x.onnx"', "runtime.onnx_model = '/x.onnx': fedtier sim and run export"),  # was ignored
        ("model.hidden=" + "[" * 2000 + "]" * 2000, "model.hidden"),  # was a RecursionError traceback
    ],
)
def test_fedtier_sim_refuses_hostile_overrides_with_exit_2_and_no_traceback(tmp_path, override, says):
    cfg = tmp_path / "c.toml"
    cfg.write_text(CLI.format(out=tmp_path / "out"))
    res = CliRunner().invoke(main, ["sim", str(cfg), "--set", override, "--no-progress"])
    assert res.exit_code == 2, res.output
    assert says in " ".join(res.output.split()) and "Traceback" not in res.output


def test_a_topology_beyond_the_device_bound_is_refused_and_keys_are_counted_before_they_are_made():
    refused = _outcome({"topology": {"cells": 10**6, "devices_per_cell": 10**6}})
    assert (
        refused is not None and "topology: " in refused and "1,000,000,000,000 devices; at most 100,000,000" in refused
    )
    from protocols.wire.keys import KeysError, generate_keys

    big = parse_config({"topology": {"cells": 10**4, "devices_per_cell": 10**4}}).topology  # 10**8: valid
    with pytest.raises(KeysError, match="100,010,001 nodes; keys are generated for at most 1,000,000"):
        generate_keys(big)  # at once: not a key made, not an id listed


@pytest.mark.parametrize("url", ["mqtt://h:70000", "mqtt://h:0", "http://h", "mqtt://", "mqtt://h/path"])
def test_a_broker_url_is_checked_when_the_config_is(url):
    refused = _outcome({**BASE, "broker": {"url": url}})
    assert refused is not None and "broker.url" in refused and url in refused


FLAGS = [  # a command's flags, each refused by click before the command does anything (exit 2)
    ("monitor", ["{out}", "--refresh", "nan"], "--refresh"),
    ("monitor", ["{out}", "--refresh", "-1"], "--refresh"),  # was time.sleep's ValueError traceback
    ("monitor", ["{out}", "--refresh", "1e12"], "--refresh"),  # was an OverflowError traceback
    ("monitor", ["{out}", "--once", "--drop", "-1"], "--drop"),
    ("monitor", ["{out}", "--once", "--deadline", "inf"], "--deadline"),
    ("monitor", ["{out}", "--once", "--width", "-5"], "--width"),  # was an empty frame, exit 0
    ("jobs", ["--wait", "nan"], "--wait"),
    ("provision", ["{cfg}", "--out", "{out}", "--port", "0"], "--port"),
    ("provision", ["{cfg}", "--out", "{out}", "--max-chunk", "1"], "--max-chunk"),
    ("provision", ["{cfg}", "--out", "{out}", "--max-device-samples", "nan"], "--max-device-samples"),
    ("run", ["{cfg}", "--workers", "1000000"], "--workers"),
    ("renew", ["--out", "{out}", "--days", "1000000000"], "--days"),
]


@pytest.mark.parametrize(("command", "args", "flag"), FLAGS, ids=[f"{c} {' '.join(a[-2:])}" for c, a, _ in FLAGS])
def test_a_hostile_flag_is_refused_naming_it(tmp_path, command, args, flag):
    cfg = tmp_path / "c.toml"
    cfg.write_text(CLI.format(out=tmp_path / "out"))
    words = command.split() if command != "renew" else ["provision", "renew"]
    res = CliRunner().invoke(main, [*words, *(a.format(cfg=cfg, out=tmp_path) for a in args)])
    assert res.exit_code == 2 and f"Invalid value for '{flag}'" in res.output, res.output


def test_a_run_folder_that_cannot_be_made_or_a_broker_flag_that_cannot_work_exits_2_saying_so(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text(CLI.format(out=tmp_path / "out"))
    (tmp_path / "file").write_text("")
    res = CliRunner().invoke(main, ["sim", str(cfg), "--set", f'run.output="{tmp_path}/file/run"', "--no-progress"])
    assert res.exit_code == 2 and "run.output: cannot use" in " ".join(res.output.split()), res.output
    res = CliRunner().invoke(main, ["cell", str(cfg), "--cell", "c0", "--insecure", "--broker", "mqtt://h:99999"])
    assert res.exit_code == 2 and "--broker: broker url 'mqtt://h:99999' has an invalid port" in res.output
    under_a_file = str(tmp_path / "file" / "x")  # each was a FileExistsError / NotADirectoryError traceback
    for command in (["keys", str(cfg)], ["provision", str(cfg), "--max-device-samples", "10"]):
        res = CliRunner().invoke(main, [*command, "--out", under_a_file])
        assert res.exit_code == 2 and f"--out {under_a_file}: cannot write" in " ".join(res.output.split())
    ports = ["--brokers", "per-cell", "--cell-port", "65535", "--max-device-samples", "10", "--set", "topology.cells=2"]
    res = CliRunner().invoke(main, ["provision", str(cfg), "--out", str(tmp_path / "p"), *ports])
    assert res.exit_code == 2 and "the last of 2 cell brokers would listen past port 65535" in " ".join(
        res.output.split()
    )


def test_more_local_processes_than_a_hundred_a_core_are_refused_before_one_starts(monkeypatch):
    from sim.cell_processes import split_refusals
    from sim.executors import start_workers

    monkeypatch.setattr("protocols.limits.os.cpu_count", lambda: 1)
    cfg = parse_config({"topology": {"cells": 150, "devices_per_cell": 1}, "runtime": {"cell_processes": 150}})
    algorithm = cfg.build_algorithm(cfg.model_spec((4,), 2))
    assert "this machine: 150 processes, more than 100 per core of this machine (1 cores)" in split_refusals(
        cfg, algorithm
    )
    workers = parse_config({"topology": {"cells": 150, "devices_per_cell": 1}, "runtime": {"sim_workers": 101}})
    with pytest.raises(ConfigError, match="runtime.sim_workers: 101 processes, more than 100 per core"):
        start_workers(workers, loop=None, spec=workers.model_spec((4,), 2))  # type: ignore[arg-type]
    fits = parse_config({"topology": {"cells": 150, "devices_per_cell": 1}, "runtime": {"cell_processes": 100}})
    assert split_refusals(fits, fits.build_algorithm(fits.model_spec((4,), 2))) == []


@pytest.mark.parametrize("label", ["1e400", "99999999999999999999", "nan", "2.5"])
def test_a_csv_source_label_that_is_no_class_id_is_refused_naming_its_line(tmp_path, label):
    from edge_agent.datasources import DataSourceError, load_source

    path = tmp_path / "d.csv"
    path.write_text(f"a,b,label\n1,2,1\n1,2,{label}\n")  # 1e400 and 1e20 were OverflowError tracebacks
    with pytest.raises(DataSourceError, match=f"d.csv:3: label '{label}' is not an integer class id"):
        load_source(path)


_EDGE = st.sampled_from([0, 1, 2, -1, 2**31, 10**12, 2**63 - 1, 0.0, 0.5, 1.0, 1e-300, 1e300, math.nan, math.inf])
_SCALAR = st.one_of(_EDGE, st.text(max_size=8), st.booleans(), st.sampled_from(["", "npz:", "/tmp", "c0-d0", "{x}"]))
_VALUE = st.one_of(_SCALAR, st.lists(_SCALAR, max_size=3), st.dictionaries(st.text(max_size=3), _SCALAR, max_size=2))


@settings(max_examples=150, deadline=None)  # ~1 s; HYPOTHESIS_PROFILE=explore for more (20,000 found no other)
@given(st.data())
def test_any_mix_of_hostile_values_is_a_config_error_or_a_config_that_builds(data):
    sections = {s: list(m.annotation.model_fields) for s, m in RunConfig.model_fields.items() if s != "algorithm"}
    cfg: dict[str, typing.Any] = {"topology": {"cells": 1, "devices_per_cell": 2}}
    for _ in range(data.draw(st.integers(1, 5))):
        section = data.draw(st.sampled_from(sorted(sections) + ["algorithm"]))
        if section == "algorithm":
            name = data.draw(st.sampled_from(sorted(ALGORITHMS)))
            key = data.draw(st.sampled_from([k for k in ALGORITHMS[name].Params.model_fields if k != "name"]))
            cfg.setdefault("algorithm", {"name": name})[key] = data.draw(_VALUE)
        else:
            cfg.setdefault(section, {})[data.draw(st.sampled_from(sections[section]))] = data.draw(_VALUE)
    try:  # run.plugins = 5 was a TypeError; = "abc" imported a, b and c
        built = parse_config(cfg)
        spec = built.model_spec((4,), 2)
        built.build_algorithm(spec)
        built.to_toml()
    except ConfigError:
        pass


def test_a_participation_trace_that_is_no_text_or_has_a_giant_field_is_refused_naming_the_file(tmp_path):
    from sim.participation import Trace

    binary, giant = tmp_path / "binary.csv", tmp_path / "giant.csv"
    binary.write_bytes(b"device,start,end\n\xff\xfe,1,2\n")
    giant.write_text("device,start,end\nc0-d0,0," + "9" * 200_000 + "\n")  # was csv.Error, a traceback
    for path, says in ((binary, "not UTF-8 text"), (giant, "field larger than field limit")):
        with pytest.raises(ValueError, match=f"{path}: not a readable CSV trace: .*{says}"):
            Trace(["c0-d0", "c0-d1"], path)


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("SECRET-TOKEN=hunter2\n", ":1: the first line must be the header"),  # was: got ['SECRET-TOKEN=hunter2']
        ("device,start,end\nSECRET-TOKEN,hunter2\n", ":2: expected 3 fields device,start,end, got 2"),
        ("device,start,end\nc0-d0,SECRET-TOKEN,hunter2\n", ":2: start and end must be integers"),
        ("device,start,end\nc0-d0,0,1\nSECRET-TOKEN-hunter2,0,1\n", ":3: a device not in the run's devices"),
    ],
)
def test_a_participation_trace_error_names_the_file_and_line_never_what_it_holds(tmp_path, text, says):
    """A job names the trace file each device reads (``participation.path``), and a device that cannot serve
    the job says why on the broker (its idle status's ``unfit`` reason, ``edge_agent.service``): the reason
    quoted the file's line, so a job could have a device publish the first line of any file it may read."""
    from sim.hierarchy import device_availability
    from tests.conftest import small_config

    path = tmp_path / "private.csv"
    path.write_text(text)
    cfg = small_config(tmp_path, participation={"model": "trace", "path": str(path)})
    with pytest.raises(ConfigError) as refused:
        device_availability(cfg)
    assert f"{path}{says}" in str(refused.value)
    assert "SECRET" not in str(refused.value) and "hunter2" not in str(refused.value)


def _unfit_reason(tmp_path, job_section: str, caplog, dataset: str = "digits") -> str:
    """The reason a long-lived agent (``edge_agent.service.AgentService``, in memory) publishes in its signed idle
    status for a job, signed by the cloud, whose config holds ``job_section``; its own log is in ``caplog``."""
    from edge_agent.service import AgentService
    from fedtier.deploy_setup import spec_and_data
    from protocols.jobs import CurrentJob, canonical_job, config_hash
    from protocols.transport.memory import MemoryHub
    from protocols.wire import topics
    from protocols.wire.keys import node_trust, with_run_keys
    from protocols.wire.signed import open_record, seal_record
    from sim.hierarchy import device_availability
    from tests.conftest import small_config

    base = small_config(tmp_path, topology={"cells": 1, "devices_per_cell": 2}, security={"keys": "keys.toml"})
    bundle, device = with_run_keys(base, tmp_path), "c0-d0"
    text = f'[run]\nrounds = 1\n[model]\nname = "mlp"\nhidden = [4]\n[data]\ndataset = "{dataset}"\n{job_section}'
    canon = canonical_job(text, bundle)[1]
    current = CurrentJob("probe", canon, config_hash(canon))
    hub, statuses = MemoryHub(), []
    status_topic = topics.device_status(bundle.run.name, "c0", device)
    hub.connect("spy").subscribe(status_topic, lambda t, d: statuses.append(open_record(d, t, device, None)))
    job_topic = topics.current_job(bundle.run.name)
    cloud = node_trust(bundle, "cloud")
    hub.connect("cloud").publish(job_topic, seal_record(current.record(), job_topic, cloud.sign), retain=True)

    def build(job_cfg: RunConfig, session: str) -> typing.Any:  # the files a device's build reads (fedtier.serve)
        spec_and_data(job_cfg, None)
        device_availability(job_cfg)
        raise AssertionError("the job's file was usable")

    def watch() -> typing.Any:
        return hub.connect(topics.device_node(device))

    trust = node_trust(bundle, device)
    service = AgentService(bundle, [device], hub.loop, watch, build, trust)
    hub.loop.call_later(30.0, service.stop)  # (virtual time)
    with caplog.at_level("ERROR", logger="fedtier.jobs"):
        service.serve()
    [reason] = {s["unfit"]["reason"] for s in statuses if "unfit" in s}
    return reason


def test_what_a_device_says_of_a_file_a_job_names_is_the_same_whether_it_exists_or_not(tmp_path, caplog):
    """A job (signed by the operator, who is not the devices' owner) names files each device reads: a participation
    trace, an npz dataset. A device that cannot serve the job publishes why in its idle status, and that reason said
    'trace file ... not found' for a missing path but ':1: the first line must be the header' for any file that
    exists (a directory: 'not found'), so a job could probe which paths exist on every device. Now the reason that
    leaves the device names only the setting, the same for a missing path, a directory, a file that is no trace and
    one this user may not read; the device's own log keeps why."""
    secret = tmp_path / "secret.txt"
    secret.write_text("SECRET-TOKEN=hunter2\n")
    forbidden = tmp_path / "forbidden.csv"
    forbidden.write_text("SECRET,0,1\n")
    forbidden.chmod(0)  # (root reads it all the same: then it is a file that is no trace)
    paths = [tmp_path / "missing.csv", tmp_path, secret, forbidden]
    said = {
        _unfit_reason(tmp_path / f"trace{i}", f'[participation]\nmodel = "trace"\npath = "{path}"\n', caplog)
        for i, path in enumerate(paths)
    }
    assert said == {"participation.path: the file it names is not usable on this device (its log says why)"}
    logged = caplog.text
    assert "trace file" in logged and "not found" in logged and f"{secret}:1: the first line must be" in logged
    said = {_unfit_reason(tmp_path / f"npz{i}", "", caplog, f"npz:{path}") for i, path in enumerate(paths)}
    assert said == {"data.dataset: the file it names is not usable on this device (its log says why)"}
    assert "SECRET" not in "".join(said) and "hunter2" not in caplog.text


def test_an_onnx_model_a_job_names_that_cannot_be_loaded_is_refused_naming_only_its_setting(tmp_path):
    """A job's ``runtime.onnx_model`` is the file an onnx device loads: onnxruntime's errors (NoSuchFile,
    InvalidProtobuf) are no ``ValueError``, so a long-lived agent did not take them for a job it cannot serve and
    stopped with a traceback; and they told a missing path from an existing one. Now both are an ``UnusableFile``
    whose public reason names only the setting."""
    pytest.importorskip("onnxruntime")
    from edge_agent.backends import make_trainer
    from protocols.config import UnusableFile, public_reason
    from tests.conftest import small_config

    cfg = small_config(tmp_path)
    spec = cfg.model_spec((64,), 10)
    secret = tmp_path / "secret.onnx"
    secret.write_text("SECRET-TOKEN=hunter2\n")
    said = set()
    for path in (tmp_path / "missing.onnx", secret):
        job_cfg = cfg.model_copy(update={"runtime": cfg.runtime.model_copy(update={"onnx_model": str(path)})})
        with pytest.raises(UnusableFile, match=f"runtime.onnx_model: {path}: cannot load it") as refused:
            make_trainer("onnx", spec, job_cfg)
        said.add(public_reason(refused.value))
    assert said == {"runtime.onnx_model: the file it names is not usable on this device (its log says why)"}


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ('x = 1\n[run]\nname = "a"\n', "x: a key outside the config's [sections]"),  # was an AttributeError
        ("[run]\nname = 1979-05-27T07:32:00Z\n", "a config holds no datetime values"),  # was a TypeError
        ("[job]\nid = 5\n", "job id 5 must be a string"),
        ("[job]\npriority = 1\n", "[job] may hold only id and init_from"),
        ("[algorithm]\nx = " + "[" * 2000 + "]" * 2000, "nested deeper than 32 levels"),  # was a RecursionError
        ("[algorithm]\nx = " + "{a = " * 2000 + "1" + "}" * 2000, "nested deeper than 32 levels"),  # (the parser's)
        ("[" + ".".join(["a"] * 2000) + "]\nx = 1\n", "nested deeper than 32 levels"),  # (writing it back out)
    ],
)
def test_a_hostile_job_file_is_refused_naming_it(tmp_path, text, says):
    from protocols.jobs import JobError, read_job_file

    path = tmp_path / "job.toml"
    path.write_text(text)
    with pytest.raises(JobError) as refused:
        read_job_file(path)
    assert says in str(refused.value)
    with pytest.raises(JobError, match=f"job file {tmp_path}: cannot read it"):
        read_job_file(tmp_path)  # a folder: was an IsADirectoryError traceback


def test_fedtier_run_refuses_more_agent_processes_than_a_hundred_a_core_before_one_starts(tmp_path, monkeypatch):
    from sim.emulation import Emulation

    monkeypatch.setattr("protocols.limits.os.cpu_count", lambda: 1)
    out = str(tmp_path / "{name}")
    cfg = parse_config({"run": {"output": out}, "topology": {"cells": 101, "devices_per_cell": 1}})
    with pytest.raises(ConfigError, match="agent workers and per-cell brokers: 101 processes, more than 100 per core"):
        Emulation(cfg, process_per_agent=True)  # one process per device
    assert Emulation(cfg, workers=2).workers == 2


def test_a_device_or_a_fifo_given_as_a_file_is_refused_before_a_byte_is_read(tmp_path):
    """/dev/zero as the config was a MemoryError traceback after filling memory; a FIFO blocked for ever."""
    import os

    from edge_agent.datasources import DataSourceError, load_source
    from protocols.config import load_config
    from protocols.jobs import JobError, read_job_file
    from protocols.limits import read_file
    from protocols.wire.keys import KeysError, load_keys

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for path in ("/dev/zero", fifo):
        with pytest.raises(ConfigError, match=f"config file {path}: cannot read it: {path} is not a regular file"):
            load_config(path)
        with pytest.raises(JobError, match="is not a regular file"):
            read_job_file(path)
        with pytest.raises(KeysError, match="is not a regular file"):
            load_keys(path)
    big = tmp_path / "big.toml"
    big.write_bytes(b"#" * 2048)
    with pytest.raises(ValueError, match="big.toml is 2,048 bytes, more than the 1,024 it may have"):
        read_file(big, limit=1024)
    for name in ("zero.csv", "zero.npz"):
        (tmp_path / name).symlink_to("/dev/zero")
        with pytest.raises(DataSourceError, match=f"{name}: not a regular file"):
            load_source(tmp_path / name)
    res = CliRunner().invoke(main, ["sim", "/dev/zero"])
    assert res.exit_code == 2 and "/dev/zero is not a regular file" in " ".join(res.output.split())


WAITING = [  # an operator command with a wait flag, and that flag: it gives up connecting within it
    (["jobs"], "--wait"),
    (["cancel", "j1"], "--wait"),
    (["submit", "{job}"], "--wait"),
    (["fleet", "--broker", "{url}", "--run", "fed"], "--wait"),
    (["monitor", "--broker", "{url}", "--run", "fed", "--once"], "--wait"),
]


@pytest.mark.parametrize(("words", "flag"), WAITING, ids=[w[0] for w, _ in WAITING])
def test_an_operator_command_gives_up_connecting_within_its_wait(tmp_path, words, flag):
    """No broker listening: each exits 1 naming the broker's address within its --wait 0.3 s (each waited paho's
    connect timeout, 10 s, whatever its wait)."""
    import time

    from tests.conftest import free_port_run

    port = free_port_run(1)  # nothing listens there
    (tmp_path / "op.toml").write_text(f'[run]\nname = "fed"\n[broker]\nurl = "mqtt://127.0.0.1:{port}"\n')
    (tmp_path / "job.toml").write_text('[algorithm]\nname = "fedavg"\n')  # a job as the federation is
    args = [w.format(job=tmp_path / "job.toml", url=f"mqtt://127.0.0.1:{port}") for w in words]
    config = ["--config", str(tmp_path / "op.toml")] if words[0] in ("jobs", "cancel", "submit") else []
    start = time.monotonic()
    res = CliRunner().invoke(main, [*args, *config, flag, "0.3"])
    took = time.monotonic() - start
    said = " ".join(res.output.split())
    assert res.exit_code == 1 and f"cannot connect to MQTT broker at 127.0.0.1:{port}" in said, res.output
    assert "(0.3 s)" in said and took < 3.0, (took, said)


def test_async_mode_with_devices_drawn_per_version_is_refused_as_a_run_that_would_hang():
    """Async cells draw their devices per cloud version, and a version goes only to the cells that pushed: a cell with
    none drawn never works again. 3 cells of 2, uniform per_round = 2, async: the sim stalled at version 5 of 12
    (c1 never worked; bernoulli 0.3 over one cell stalled at once), a RuntimeError; fedtier run would hang."""
    drawn = {"model": "uniform", "per_round": 2}
    refused = _outcome({**BASE, "algorithm": {"name": "fedavg", "mode": "async"}, "participation": drawn})
    assert refused is not None and "participation: model = 'uniform' at level = \"device\"" in refused, refused
    assert 'algorithm.mode = "async"' in refused and "the run hangs" in refused
    bernoulli = {"algorithm": {"name": "fedavg", "mode": "async"}, "participation": {"model": "bernoulli", "prob": 0.5}}
    assert "participation: model = 'bernoulli'" in str(_outcome({**BASE, **bernoulli}))
    cells = {"topology": {"cells": 3, "devices_per_cell": 2}, "participation": {**drawn, "level": "cell"}}
    assert _outcome({**cells, "algorithm": {"name": "fedavg", "mode": "async"}}) is None  # cells drawn: sent versions
    assert _outcome({**BASE, "participation": drawn}) is None  # rounds close by deadline: a draw of none passes


def test_buffers_cohorts_and_logs_larger_than_memory_are_refused_by_the_node_that_would_hold_them(tmp_path):
    """What a key sizes that a node holds at once: a cell's async buffer (K decoded results), the cloud's waiting
    pushes, DeComFL's cloud log (rounds x 4KP bytes, kept, sent, read back), a cohort's minibatch indices
    (cohort_size x local_steps x batch). Each was accepted and ran until a MemoryError (the async buffer at its K-th
    result). The cell's and the cloud's are checked by their node (a device builds the algorithm too, holding none)."""
    from protocols.algorithms.decomfl import LOG_ROUND_BYTES
    from protocols.algorithms.fedavg import FedAvgParams
    from protocols.algorithms.staleness import buffers_refusal

    def tiers(**sections: typing.Any) -> tuple[str | None, str | None]:
        cfg = parse_config({**BASE, **sections})
        spec, topo = cfg.model_spec((784,), 10), cfg.topology  # 199,210 parameters: 797 KB of float32
        # composed as build_algorithm does, without its check of the largest message (a DeComFL log this long would
        # not fit one: tests/test_decomfl_messages.py)
        cells = {c: topo.devices(c) for c in topo.cell_ids()}
        algorithm = compose(cfg.train, spec, seed=0, init_seed=0, cells=cells, rounds=cfg.run.rounds)
        return algorithm.tier_refusal("cell"), algorithm.tier_refusal("cloud")

    cell, cloud = tiers(algorithm={"name": "fedavg", "mode": "async", "async_buffer": 10**7})
    assert cloud is None and "algorithm.async_buffer: 10,000,000 results a cell holds decoded" in str(cell)
    cell, cloud = tiers(algorithm={"name": "fedavg", "mode": "async", "async_cloud_buffer": 10**7})
    assert cell is None and "algorithm.async_cloud_buffer: 10,000,000 pushes" in str(cloud)
    assert tiers(algorithm={"name": "fedavg", "mode": "async", "async_buffer": 1000}) == (None, None)
    params = FedAvgParams(name="fedavg", mode="async", async_buffer=1000)
    assert buffers_refusal(params, 199_210, "cell", memory=2**30) is None  # 797 MB
    refused = buffers_refusal(params, 400_000, "cell", memory=2**30)
    assert "needs 1.5 GiB, more than this machine's 1.0 GiB" in str(refused)
    wide = {"name": "decomfl", "local_steps": 10**5, "perturbations": 100}  # K x P = 1e7, the most: 40 MB a round
    cell, log = tiers(run={"rounds": 10**6}, algorithm=wide)
    assert cell is None and f"run.rounds: 1,000,000 rounds of the cloud's log ({LOG_ROUND_BYTES + 4 * 10**7:,}" in str(
        log
    )
    assert tiers(run={"rounds": 10**6}, algorithm={"name": "decomfl"}) == (None, None)  # K x P = 5: 213 MB
    cohort = parse_config(
        {**BASE, "algorithm": {"name": "fedavg", "local_steps": 10**8}, "runtime": {"engine": "cohort"}}
    )
    with pytest.raises(ConfigError, match="algorithm.local_steps: 100,000,000 minibatches of 32 samples"):
        cohort.build_algorithm(cohort.model_spec((784,), 10))
    assert cohort.model_copy(update={"runtime": BASE_RUNTIME}).cohort_refusal() is None  # device engine: streamed
    cfg = tmp_path / "c.toml"
    cfg.write_text(CLI.format(out=tmp_path / "out"))
    for sets, says in (
        (
            ['algorithm.name="fedavg"', 'algorithm.mode="async"', "algorithm.async_buffer=10000000"],
            "algorithm.async_buffer: 10,000,000",
        ),
        (
            [
                "run.rounds=1000000",
                'algorithm.name="decomfl"',
                "algorithm.local_steps=100000",
                "algorithm.perturbations=100",
            ],
            "cannot hold decomfl's largest task: cell c0's in round 1,000,000 (the last), with the whole log (999,999 "
            "rounds x "
            "40,000,008 bytes",  # (refused before the cloud's memory is: the log would not fit one message)
        ),
    ):
        res = CliRunner().invoke(main, ["sim", str(cfg), *(w for x in sets for w in ("--set", x)), "--no-progress"])
        assert res.exit_code == 2 and says in " ".join(res.output.split()) and "Traceback" not in res.output, res.output


def test_a_cohort_that_fits_by_local_steps_but_not_by_its_epochs_is_refused_with_the_sizes(make_config) -> None:
    """The cohort engine's memory check counted ``local_steps`` only: with ``local_steps = 0`` and ``local_epochs``
    it passed whatever the epochs, and each device of the cohort failed with a MemoryError drawing its minibatches
    (1e6 epochs of 240 samples: 15,000,000 batches of 16 a device, 37.6 GiB for 6). It now counts the steps a device
    runs, epochs x ceil(samples / batch_size) for the device with the most samples, once the data is partitioned."""
    steps = make_config(algorithm={"local_steps": 15, "edge_rounds": 1}, runtime={"engine": "cohort"})
    epochs = make_config(
        algorithm={"local_steps": 0, "local_epochs": 1e6, "edge_rounds": 1}, runtime={"engine": "cohort"}
    )
    assert steps.cohort_refusal(memory=2**32) is None and epochs.cohort_refusal(memory=2**32) is None  # no data yet
    assert epochs.cohort_refusal(memory=2**32, samples=16) is None  # 1e6 steps x 6 x 448 bytes: 2.5 GiB
    refused = epochs.cohort_refusal(memory=2**32, samples=240)  # the 6 devices of digits' 1,437, iid
    assert refused == (
        "algorithm.local_epochs: 1,000,000 epochs of a device's 240 samples, that is: 15,000,000 minibatches of 16 "
        'samples drawn at once for each of a cohort\'s 6 devices (runtime.engine = "cohort", runtime.cohort_size) '
        "needs 37.6 GiB, more than this machine's 4.0 GiB of memory"
    ), refused
    huge = make_config(
        algorithm={"local_steps": 0, "local_epochs": 1e9, "edge_rounds": 1}, runtime={"engine": "cohort"}
    )
    with pytest.raises(ConfigError, match=r"local_epochs: 1,000,000,000 epochs of a device's 240 samples, that is: "):
        run_simulation(huge)  # refused before a round (it needs ~37,500 GiB)


def test_a_markov_participation_keeps_a_few_states_not_one_per_round_and_draws_the_same_chain():
    """Markov kept every round's state: devices x rounds bytes (5,000 devices over 1,000 rounds: 5 MB; 1e6 over
    10,000: 10 GB). Now its last 8: the same masks, in any order of asking."""
    import tracemalloc

    from protocols.seeding import rng
    from sim.participation import Markov

    devices = [f"d{i}" for i in range(5_000)]
    state, chain = None, []  # the chain as the model defines it, every state kept
    for r in range(40):
        u = rng(3, r, "participation", "markov").random(len(devices))
        state = u < 0.4 if state is None else np.where(state, u >= 0.3, u < 0.2)
        chain.append(state)
    model = Markov(devices, 0.3, 0.2, start_on_prob=0.4, seed=3)
    for r in (5, 3, 20, 19, 21, 0, 39, 12, 12, 38, 2):
        assert np.array_equal(model.mask(r), chain[r]), r
    tracemalloc.start()
    model.mask(1_000)
    held = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    assert held < 1 << 19, held  # was 5 MB: 1,000 states of 5,000 devices


def test_decomfl_tasks_to_cells_that_need_the_whole_log_share_one_stack_of_it():
    """After a resume that recreated the devices every cell needs the log from round 0: each cell's task stacked its
    own copy (cells x the log); now one stack a window start, shared."""
    from protocols.algorithms.decomfl import DeComFLCloud, DeComFLParams

    params = DeComFLParams(name="decomfl", local_steps=2, perturbations=3)
    cloud = DeComFLCloud(params, 0, {"w": np.zeros((4, 3), np.float32)})
    cells = [f"c{i}" for i in range(20)]
    for r in range(5):
        cloud.plan(r, cells)
        cloud.aggregate(r, {})
    cloud.forget_devices()
    tasks = cloud.plan(5, cells)
    stacks = {id(t.tensors["g"]) for t in tasks.values()}
    assert len(stacks) == 1 and tasks["c0"].tensors["g"].shape == (5, 2, 3), stacks


def test_a_message_bound_smaller_than_the_model_is_refused_at_the_start_naming_both_figures(tmp_path):
    """``runtime.max_message_bytes`` below one model message made every node refuse the tasks (its log: "payload of
    180938 bytes exceeds the limit of 180900"), and the run ended "job failed: no cell answered in rounds 0-1". It is
    refused when the algorithm is built (every node, and fedtier sim/run before they start), for each algorithm whose
    tasks carry the model; DeComFL's carry seeds and scalars, whatever the model."""
    n = 199_210  # the MLP of BASE on 784 inputs: 796,840 bytes of float32, ~797,864 with the envelope
    need = 4 * n + 1024
    needs = {"fedalign": {"priority_fraction": 0.5}}
    for name in set(ALGORITHMS) - {"hist"}:
        for bound, refused in ((need - 1, name != "decomfl"), (need, False)):
            algorithm = {"name": name, **needs.get(name, {})}
            cfg = parse_config({**BASE, "algorithm": algorithm, "runtime": {"max_message_bytes": bound}})
            if not refused:
                cfg.build_algorithm(cfg.model_spec((784,), 10))
                continue
            with pytest.raises(ConfigError) as why:
                cfg.build_algorithm(cfg.model_spec((784,), 10))
            assert (
                f"runtime.max_message_bytes = {need - 1:,} is smaller than one model message (~{need:,} bytes for "
                f"model mlp of {n:,} parameters, which {name}'s tasks carry)" in str(why.value)
            ), why.value
    # HIST sends each of 2 cells its submodel: 784-300-10 split into 150 units, with their 150 indices
    hist = {"algorithm": {"name": "hist"}, "topology": {"cells": 2, "devices_per_cell": 1}, "model": {"hidden": [300]}}
    sub = 784 * 150 + 150 + 150 * 10 + 10 + 150
    for bound, refused in ((4 * sub + 1023, True), (4 * sub + 1024, False)):
        cfg = parse_config({**BASE, **hist, "runtime": {"max_message_bytes": bound}})
        if refused:
            with pytest.raises(ConfigError, match=f"~{4 * sub + 1024:,} bytes for model mlp of 238,510 parameters, "):
                cfg.build_algorithm(cfg.model_spec((784,), 10))
        else:
            cfg.build_algorithm(cfg.model_spec((784,), 10))
    cfg = tmp_path / "c.toml"
    cfg.write_text(CLI.format(out=tmp_path / "out"))
    res = CliRunner().invoke(main, ["sim", str(cfg), "--set", "runtime.max_message_bytes=4096", "--no-progress"])
    said = " ".join(res.output.split())
    assert res.exit_code == 2 and "runtime.max_message_bytes = 4,096 is smaller than one model message" in said, said
