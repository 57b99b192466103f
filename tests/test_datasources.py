"""Device data sources: npz, CSV, a folder of images by class and a user's loader; `fedtier partition`
writes them from a known dataset; a deployment fed CSV and image sources trains exactly as `fedtier sim`;
a malformed source is one clear error."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from edge_agent.datasources import DataSource, DataSourceError, load_source, write_source
from protocols import runfiles
from protocols.config import load_config
from protocols.procs import popen
from protocols.trainer import LocalData
from protocols.transport.broker import EmbeddedBroker
from sim.datasets import FMNIST_DIR, dataset_geometry, load_dataset
from sim.hierarchy import prepare
from sim.launcher import run_simulation

FEDTIER = str(Path(sys.executable).parent / "fedtier")

CONFIG = """
[run]
name = "sources"
rounds = 2
output = "{out}"
[topology]
cells = 1
devices_per_cell = 2
[algorithm]
name = "fedavg"
edge_rounds = 1
local_steps = 3
lr = 0.1
batch_size = 16
[model]
name = "mlp"
hidden = [16]
[data]
dataset = "{dataset}"
max_train = 200
max_test = 100
[runtime]
device_deadline = 60.0
heartbeat = 1.0
"""


def _config(tmp_path: Path, dataset: str = "digits") -> Path:
    path = tmp_path / "run.toml"
    path.write_text(CONFIG.format(out=tmp_path / "deployed", dataset=dataset))
    return path


def _partition_command(config: Path, out: Path, kind: str) -> list[str]:
    return [FEDTIER, "partition", str(config), "--out", str(out), "--format", kind]


def _partition(config: Path, out: Path, kind: str) -> str:
    """``fedtier partition`` in this process (no Python process to start); what it said, on one line."""
    from click.testing import CliRunner

    from fedtier.cli import main

    res = CliRunner().invoke(main, _partition_command(config, out, kind)[1:])
    assert res.exit_code == 0 and res.exception is None, res.output
    return " ".join(res.output.split())


@pytest.mark.parametrize("kind", ["npz", "csv", "images"])
def test_partition_writes_sources_that_load_back_as_the_run_splits_them(tmp_path, kind):
    config = _config(tmp_path)
    _partition(config, tmp_path / "src", kind)
    prep = prepare(load_config(config))
    suffix = {"npz": ".npz", "csv": ".csv", "images": ""}[kind]
    for device, data in prep.device_data.items():
        got = load_source(tmp_path / "src" / f"{device}{suffix}", input_shape=prep.spec.input_shape)
        if kind == "images":  # 8-bit pixels (digits are k/16), in the same order
            assert got.input_shape == (1, 8, 8)
            np.testing.assert_allclose(got.data.x, data.x, atol=0.5 / 255 + 1e-7)
            np.testing.assert_array_equal(got.data.y, data.y)
        else:
            np.testing.assert_array_equal(got.data.x, data.x)
            np.testing.assert_array_equal(got.data.y, data.y)
    assert (tmp_path / "src" / "test.npz").exists() and "c0-d1" in (tmp_path / "src" / "sources.toml").read_text()


def test_dataset_geometry_is_known_without_loading():
    for name in ("digits", "synthetic", "mnist"):
        ds = load_dataset(name)
        assert dataset_geometry(name) == (ds.input_shape, ds.num_classes)
    assert dataset_geometry("synthetic", dim=7, classes=3) == ((7,), 3)


def _csv(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "d.csv"
    p.write_text(text)
    return p


@pytest.mark.parametrize(
    "text, why",
    [
        ("a,b,label\n1,2,0\n3,4,cat\n", r"d.csv:3: label 'cat' is not an integer"),
        ("a,b,label\n1,2,0\n3,x,1\n", r"d.csv:3: a feature is not a number"),
        ("a,b,label\n1,2,0\n3,4\n", r"d.csv:3: 2 fields, the header has 3"),
        (
            "a,b,target\n1,2,0\n",
            r"no label column 'label' .*; name the label's column with fedtier agent --label-column",
        ),
        ("", "empty file"),
        ("a,b,label\n", "no samples"),
        ("a,b,label\nnan,2,0\n", "NaN"),
        ("a,b,label\n1,2,-1\n", "negative label"),
    ],
)
def test_a_malformed_csv_is_one_clear_error(tmp_path, text, why):
    with pytest.raises(DataSourceError, match=why):
        load_source(_csv(tmp_path, text))


def test_csv_label_column_by_name_and_geometry_check(tmp_path):
    p = _csv(tmp_path, "target,a,b\n1,0.5,2\n0,1.5,3\n")
    got = load_source(DataSource(str(p), label_column="target"))
    np.testing.assert_array_equal(got.data.y, [1, 0])
    np.testing.assert_array_equal(got.data.x, np.array([[0.5, 2], [1.5, 3]], np.float32))
    with pytest.raises(DataSourceError, match="2 features per sample, but the model takes 1x8x8 = 64"):
        load_source(DataSource(str(p), label_column="target"), input_shape=(1, 8, 8))


def test_sources_that_are_not_what_they_claim_are_refused(tmp_path):
    bad_npz = tmp_path / "pickled.npz"
    np.savez(bad_npz, x=np.array([object()] * 2, dtype=object), y=np.zeros(2, np.int64))
    with pytest.raises(DataSourceError, match="not a readable .npz"):  # never unpickled
        load_source(bad_npz)
    (tmp_path / "noise.npz").write_bytes(b"PK\x03\x04 not a zip")
    with pytest.raises(DataSourceError, match="not a readable .npz"):
        load_source(tmp_path / "noise.npz")
    images = tmp_path / "imgs"
    (images / "cat").mkdir(parents=True)
    with pytest.raises(DataSourceError, match="named by their integer label"):
        load_source(images)
    (images / "cat").rmdir()
    (images / "3").mkdir()
    (images / "3" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n garbage")
    with pytest.raises(DataSourceError, match="broken.png: not a readable image"):
        load_source(images, input_shape=(1, 8, 8))
    with pytest.raises(DataSourceError, match="cannot tell the kind"):
        load_source(tmp_path / "run.bin")


def test_a_source_over_its_bound_is_refused(tmp_path):
    p = tmp_path / "big.csv"
    write_source(p, LocalData(np.zeros((50, 2), np.float32), np.zeros(50, np.int64)), (2,), 2, "csv")
    with pytest.raises(DataSourceError, match="more than the bound of 10 samples"):
        load_source(p, max_samples=10)


def test_a_users_loader_reads_another_format(tmp_path, monkeypatch):
    (tmp_path / "myreader.py").write_text(
        "import numpy as np\n"
        "def read(path):\n"
        "    rows = [list(map(float, l.split())) for l in open(path)]\n"
        "    a = np.array(rows)\n"
        "    return a[:, 1:], a[:, 0].astype(int)\n"
        "def broken(path):\n"
        "    raise RuntimeError('disk on fire')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "d.txt").write_text("1 0.5 0.25\n0 1 2\n")
    got = load_source(DataSource(str(tmp_path / "d.txt"), loader="myreader:read"))
    np.testing.assert_array_equal(got.data.y, [1, 0])
    with pytest.raises(DataSourceError, match="disk on fire"):
        load_source(DataSource(str(tmp_path / "d.txt"), loader="myreader:broken"))
    with pytest.raises(DataSourceError, match="cannot load the data loader") as missing:
        load_source(DataSource(str(tmp_path / "d.txt"), loader="nomodule:read"))
    assert "no module 'nomodule' on this Python's path" in str(missing.value)  # walked: beside a bundle's config
    assert "set PYTHONPATH to its folder" in str(missing.value)
    (tmp_path / "needsdep.py").write_text("import nomodule_dep\ndef read(path):\n    pass\n")
    with pytest.raises(DataSourceError, match="No module named 'nomodule_dep'"):  # the loader's own import: as is
        load_source(DataSource(str(tmp_path / "d.txt"), loader="needsdep:read"))


def test_an_agent_given_a_bad_csv_says_so_and_exits_2(tmp_path):
    from click.testing import CliRunner

    from fedtier.cli import main

    config = _config(tmp_path)
    bad = _csv(tmp_path, "a,label\n1,dog\n")
    agent = ["agent", str(config), "--device", "c0-d0", "--data", str(bad), "--broker", "mqtt://127.0.0.1:1"]
    res = CliRunner().invoke(main, [*agent, "--insecure"])  # in this process: no Python process to start
    out = res.output
    assert res.exit_code == 2 and isinstance(res.exception, SystemExit), out
    assert "d.csv:2: label 'dog' is not an integer class id" in out.replace("\n", "") and "pickle" not in out


def test_agents_fed_csv_and_image_sources_train_as_the_simulation_does(tmp_path):
    """Fashion-MNIST pixels are 8-bit already, so the image folder is lossless: the deployment's model is
    the simulation's, byte for byte, with one device reading a CSV and the other a folder of PNGs."""
    if not FMNIST_DIR.exists():
        pytest.skip(f"Fashion-MNIST is not installed ({FMNIST_DIR}: Debian's dataset-fashion-mnist)")
    config = _config(tmp_path, "fmnist")
    for out, kind, said in (("csv", "csv", "csv"), ("img", "images", "image")):
        assert f"wrote 2 {said} sources" in (wrote := _partition(config, tmp_path / out, kind)), wrote
    sim = run_simulation(load_config(config, [f'run.output="{tmp_path / "sim"}"']))
    with EmbeddedBroker() as broker:
        common = ["--broker", broker.url, "--insecure"]
        commands = {
            "cloud": [FEDTIER, "cloud", str(config), *common, "--test-data", str(tmp_path / "csv" / "test.npz")],
            "cell": [FEDTIER, "cell", str(config), *common, "--cell", "c0"],
            "csv agent": [FEDTIER, "agent", str(config), *common, "--device", "c0-d0", "--data"],
            "image agent": [FEDTIER, "agent", str(config), *common, "--device", "c0-d1", "--data"],
        }
        commands["cloud"].append("--no-progress")
        commands["csv agent"].append(str(tmp_path / "csv" / "c0-d0.csv"))
        commands["image agent"].append(str(tmp_path / "img" / "c0-d1"))
        procs = {n: popen(c, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for n, c in commands.items()}
        try:
            outputs = {n: p.communicate(timeout=180)[0] for n, p in procs.items()}
        finally:
            for p in procs.values():
                if p.poll() is None:
                    p.kill()
    for name, p in procs.items():
        assert p.returncode == 0, f"{name} exited with {p.returncode}:\n{outputs[name]}"
    deployed = (tmp_path / "deployed" / runfiles.FINAL_MODEL).read_bytes()
    assert deployed == (sim.output_dir / runfiles.FINAL_MODEL).read_bytes()
