"""DeComFL: bit-exact reconstruction after any absences, exact dimension-free bytes, onnxruntime devices."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from protocols import directions as Z
from protocols.algorithms.base import DeviceContext, ModelSpec, Rejected
from protocols.algorithms.decomfl import DeComFLCell, DeComFLCloud, DeComFLDevice, DeComFLParams
from protocols.config import load_config
from protocols.models import build_model, init_params
from protocols.onnx_export import export_onnx
from protocols.torch_trainer import TorchTrainer
from protocols.trainer import LocalData
from protocols.wire import topics
from protocols.wire.envelope import decode_message
from protocols.wire.payload import Payload, decode_payload
from sim.launcher import SimHierarchy, run_simulation

REPO = Path(__file__).resolve().parents[1]
K, P = 2, 3
ONNX_DEVICES = ["c0-d1", "c1-d0", "c1-d2"]


def decomfl_config(make_config, hidden: list[int], rounds: int = 14, onnx: list[str] | None = None, **algo):
    return make_config(
        run={"rounds": rounds},
        algorithm={
            "name": "decomfl",
            "edge_rounds": 1,
            "local_steps": K,
            "perturbations": P,
            "lr": 0.02,
            "mu": 1e-3,
            "batch_size": 16,
            **algo,
        },
        model={"name": "mlp", "hidden": hidden},
        participation={"model": "uniform", "per_round": 2},  # 2 of 6 devices a round: long absences
        runtime={"device_deadline": 5.0, "eval_every": rounds, "onnx_devices": onnx or []},
    )


def run_traced(cfg):
    """Run the sim; return the hierarchy, the cloud model after every round, and the device uplinks."""
    sim = SimHierarchy(cfg, write_output=False)
    snapshots = {0: {k: v.copy() for k, v in sim.cloud.role.model.items()}}
    sim.cloud.on_round = lambda rec: snapshots.__setitem__(
        rec["round"] + 1, {k: v.copy() for k, v in sim.cloud.role.model.items()}
    )
    uplinks: list[tuple[str, bytes]] = []
    spy = sim.hub.connect("spy")
    for c in sim.cells:
        spy.subscribe(topics.device_results(cfg.run.name, c), lambda t, d: uplinks.append((t, d)))
    result = sim.run()
    return sim, result, snapshots, uplinks


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from tests.conftest import small_config

    make = lambda **s: small_config(tmp_path_factory.mktemp("decomfl"), **s)  # noqa: E731
    small = run_traced(decomfl_config(make, [16], onnx=ONNX_DEVICES))
    large = run_traced(decomfl_config(make, [64]))
    return small, large


def test_every_device_reconstructs_the_cloud_model_bit_for_bit(runs):
    for sim, result, snapshots, _ in runs:
        cloud = sim.cloud.role
        needs = [a.role.synced for a in sim.agents.values()]  # last round each took part in (0: never)
        participated = 0
        for d, agent in sim.agents.items():
            role = agent.role
            if role.model is None:
                continue  # never took part: still x_0, needs the whole history (kept, see below)
            participated += 1
            # after its last participation the device holds x_t exactly (revert by copy)...
            for k in role.model:
                assert np.array_equal(role.model[k], snapshots[role.synced][k]), (d, k)
            # ...and replaying the rounds it missed since gives the cloud's final model bit for bit
            i = role.synced - cloud.base
            role.catch_up(role.synced, np.array([*cloud.seeds[i:], 0], np.uint64)[:-1], np.stack(cloud.g[i:]))
            for k in role.model:
                assert np.array_equal(role.model[k], result.params[k]), (d, k)
        assert participated >= 5
        # history pruned to the oldest round a device still needs (never-seen devices need round 0)
        assert cloud.base == min(needs) and cloud.base + len(cloud.g) == len(result.history)


def test_onnx_devices_take_part_and_stay_exact(runs):
    sim, result, snapshots, _ = runs[0]
    for d in ONNX_DEVICES:
        agent = sim.agents[d]
        assert type(agent.trainer).__name__ == "OnnxTrainer" and agent.tasks_done > 0
        # reconstruction is pure numpy from broadcast scalars: exact on onnxruntime devices too (tolerance 0)
        for k in agent.role.model:
            assert np.array_equal(agent.role.model[k], snapshots[agent.role.synced][k])


def test_the_model_learns(make_config):
    cfg = make_config(
        run={"rounds": 40},
        algorithm={
            "name": "decomfl",
            "edge_rounds": 1,
            "local_steps": 2,
            "perturbations": 5,
            "lr": 0.1,
            "batch_size": 32,
        },
        model={"name": "mlp", "hidden": [16]},
        runtime={"eval_every": 40},
    )
    sim = SimHierarchy(cfg, write_output=False)
    spec, ds = sim.prep.spec, sim.prep.dataset
    trainer = TorchTrainer.from_spec(spec.name, spec.input_shape, spec.num_classes, **spec.build_kwargs())
    trainer.set_params(sim.algorithm.initial_params())
    loss0, acc0 = trainer.evaluate(ds.x_test, ds.y_test)
    result = sim.run()
    assert result.history[-1]["loss"] < loss0 - 0.3
    assert result.history[-1]["accuracy"] > max(0.4, acc0 + 0.25)


def test_uplink_is_kp_scalars_plus_a_fixed_header_exactly(runs):
    for sim, _, _, uplinks in runs:
        assert len(uplinks) == sum(a.tasks_done for a in sim.agents.values()) > 0
        for _topic, data in uplinks:
            header, raw = decode_message(data)
            payload = decode_payload(raw)
            meta = json.dumps(payload.meta, separators=(",", ":")).encode()
            assert list(payload.meta) == ["weight"] and list(payload.tensors) == ["g"]
            # payload: u32 meta len + meta + u16 count + (u16 name len + "g" + u8 dtype + u8 ndim + 2 x u32) + 4KP
            fixed_payload = 4 + len(meta) + 2 + (2 + 1 + 1 + 1 + 2 * 4)
            assert len(raw) == fixed_payload + 4 * K * P
            envelope = 4 + 4 + len(header.to_json())
            assert len(data) == envelope + fixed_payload + 4 * K * P


def test_bytes_per_device_do_not_depend_on_the_model_size(runs):
    (small, *_), (large, *_) = runs
    assert Z.shapes_of(small.cloud.role.model) != Z.shapes_of(large.cloud.role.model)
    for d in small.agents:
        a, b = small.agents[d], large.agents[d]
        assert (a.bytes_in, a.bytes_out, a.tasks_done) == (b.bytes_in, b.bytes_out, b.tasks_done), d
        assert a.bytes_in > 0


def test_downlink_is_this_rounds_seed_plus_exactly_the_missed_history(make_config):
    cfg = decomfl_config(make_config, [8], rounds=8)
    sim = SimHierarchy(cfg, write_output=False)
    seen: list[tuple[str, int, Payload]] = []

    def record(topic: str, data: bytes) -> None:
        header, raw = decode_message(data)
        seen.append((topic, header.round, decode_payload(raw)))

    for c in sim.cells:
        for d in sim.cfg.topology.device_ids(c):
            sim.hub.connect(f"spy.{d}").subscribe(topics.device_task(cfg.run.name, c, d), record)
    sim.run()
    last: dict[str, int] = {}
    assert len(seen) == sum(a.tasks_done for a in sim.agents.values()) > 0
    for topic, r, p in seen:
        dev = topic.split("/")[-2]
        start = last.get(dev, 0)  # the round it last took part in: it reverted to x_start
        assert p.meta == {"from": start} and set(p.tensors) == {"s", "g"}
        assert p.tensors["s"].shape == (r - start + 1,) and p.tensors["g"].shape == (r - start, K, P)
        assert [int(s) for s in p.tensors["s"]] == [Z.round_seed(cfg.run.seed, j) for j in range(start, r + 1)]
        last[dev] = r
    assert max(r for _, r, _ in seen) - min(last.values()) >= 2  # some device really missed rounds


def test_onnx_and_torch_devices_produce_the_same_scalars(tmp_path):
    spec = ModelSpec(name="cnn", input_shape=(1, 8, 8), num_classes=10, channels=(4, 8), fc=16)
    x0 = init_params(build_model(spec.name, spec.input_shape, spec.num_classes, **spec.build_kwargs()), 3)
    from edge_agent.onnx_trainer import build_onnx_trainer

    onnx = build_onnx_trainer(export_onnx(spec, x0, tmp_path / "m.onnx"))
    torch_ = TorchTrainer.from_spec(spec.name, spec.input_shape, spec.num_classes, **spec.build_kwargs())
    rng = np.random.default_rng(0)
    data = LocalData(rng.random((40, 64), dtype=np.float32), rng.integers(0, 10, 40))
    params = DeComFLParams(name="decomfl", local_steps=3, perturbations=4, lr=0.01, mu=1e-2, batch_size=16)
    ctx = DeviceContext(0, 5, 0, "c0", "c0-d0")
    seed = Z.round_seed(0, 5)
    task = Payload({"from": 5}, {"s": np.array([seed], np.uint64), "g": np.zeros((0, 3, 4), np.float32)})
    out = {}
    for name, trainer in (("onnx", onnx), ("torch", torch_)):
        dev = DeComFLDevice(params, lambda: x0)
        dev.synced = 5
        dev.model = {k: v.copy() for k, v in x0.items()}
        out[name] = dev.train(task, data, trainer, ctx).tensors["g"]
        assert all(np.array_equal(dev.model[k], x0[k]) for k in x0)  # reverted
    assert np.abs(out["torch"]).max() > 0.05
    # losses agree to ~1e-7 between backends; divided by mu=1e-2 that is ~1e-5 on each scalar
    np.testing.assert_allclose(out["onnx"], out["torch"], rtol=1e-3, atol=1e-3)
    assert all(np.array_equal(onnx.initial_params()[k], x0[k]) for k in x0)


def test_agent_side_runs_without_torch(tmp_path):
    spec = ModelSpec(name="mlp", input_shape=(64,), num_classes=10, hidden=(8,))
    x0 = init_params(build_model(spec.name, spec.input_shape, spec.num_classes, **spec.build_kwargs()), 0)
    path = export_onnx(spec, x0, tmp_path / "m.onnx")
    code = f"""
import sys
sys.modules["torch"] = None  # any torch import now fails
import numpy as np
from edge_agent.onnx_trainer import build_onnx_trainer
from edge_agent.agent import DeviceAgent
from protocols.algorithms.decomfl import DeComFLDevice, DeComFLParams
from protocols.algorithms.base import DeviceContext
from protocols.trainer import LocalData
from protocols.wire.payload import Payload
from protocols import directions as Z
t = build_onnx_trainer({str(path)!r})
dev = DeComFLDevice(DeComFLParams(name="decomfl", perturbations=3), lambda: 1 / 0)
r = np.random.default_rng(0)
data = LocalData(r.random((20, 64), dtype=np.float32), r.integers(0, 10, 20))
g = np.ones((2, 1, 3), np.float32)
task = Payload({{"from": 0}}, {{"s": np.array([Z.round_seed(0, i) for i in range(3)], np.uint64), "g": g}})
out = dev.train(task, data, t, DeviceContext(0, 2, 0, "c0", "c0-d0")).tensors["g"]
assert out.shape == (1, 3) and np.isfinite(out).all() and dev.synced == 2
print("ok", "torch" in sys.modules and sys.modules["torch"] is None)
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok True"


def _params() -> DeComFLParams:
    return DeComFLParams(name="decomfl", local_steps=K, perturbations=P)


@pytest.mark.parametrize(
    "bad, match",
    [
        (Payload({"weight": 4}, {"g": np.zeros((K, P + 1), np.float32)}), "expected"),
        (Payload({"weight": 4}, {"g": np.zeros((K, P), np.float64)}), "expected"),
        (Payload({"weight": 4}, {"g": np.full((K, P), np.nan, np.float32)}), "non-finite"),
        (Payload({"weight": 4}, {}), "expected"),
        (Payload({"weight": 0}, {"g": np.zeros((K, P), np.float32)}), "weight"),
        (Payload({"weight": True}, {"g": np.zeros((K, P), np.float32)}), "weight"),
    ],
)
def test_bad_device_results_are_rejected_and_do_not_touch_the_sum(bad, match):
    cloud = DeComFLCloud(_params(), 0, {"w": np.zeros(3, np.float32)})
    cell = DeComFLCell(_params(), "c0", ["d1", "d2"])
    cell.begin(0, cloud.plan(0, ["c0"])["c0"])
    with pytest.raises(Rejected, match=match):
        cell.check("d1", bad)
    good = Payload({"weight": 4}, {"g": np.ones((K, P), np.float32)})
    cell.check("d2", good)
    cell.aggregate(0, {"d2": good})
    report = cell.report()
    assert report.meta == {"weight": 1.0, "answered": ["d2"], "need": 0}
    cloud.check("c0", report)
    for bad_report in (
        Payload({**report.meta, "need": -1}, report.tensors),
        Payload({**report.meta, "answered": "d2"}, report.tensors),
        Payload({**report.meta, "weight": 2.0}, report.tensors),  # uniform: 1 per device
        Payload({**report.meta, "answered": ["d2", "d2"]}, report.tensors),
        Payload(report.meta, {"g": report.tensors["g"].astype(np.float32)}),
    ):
        with pytest.raises(Rejected):
            cloud.check("c0", bad_report)


def test_cell_weights_need_and_cloud_pruning():
    params = _params().model_copy(update={"weighting": "samples"})
    cloud = DeComFLCloud(params, 0, {"w": np.zeros(3, np.float32)})
    cells = {c: DeComFLCell(params, c, [f"{c}-a", f"{c}-b"]) for c in ("c0", "c1")}
    g = {n: np.full((K, P), float(n), np.float32) for n in range(1, 5)}
    for r, answers in enumerate([{"c0": ["c0-a", "c0-b"], "c1": ["c1-a"]}, {"c0": ["c0-a"], "c1": ["c1-a", "c1-b"]}]):
        tasks = cloud.plan(r, list(cells))
        reports = {}
        for c, cell in cells.items():
            cell.begin(r, tasks[c])
            plan = cell.plan(0, answers[c])
            assert set(plan) == set(answers[c])
            res = {d: Payload({"weight": 10 * (i + 1)}, {"g": g[i + 1]}) for i, d in enumerate(answers[c])}
            cell.aggregate(0, res)
            reports[c] = cell.report()
        cloud.aggregate(r, reports)
    # round 0: (10*1 + 20*2 + 10*1) / 40; round 1: (10*1 + 10*1 + 20*2) / 40
    np.testing.assert_array_equal(cloud.g[0], np.float32(60 / 40))
    np.testing.assert_array_equal(cloud.g[1], np.float32(60 / 40))
    # c0-b last took part in round 0: the history from round 0 is still needed; then it answers in round 2
    assert cloud.base == 0 and reports["c0"].meta["need"] == 0 and reports["c1"].meta["need"] == 1
    tasks = cloud.plan(2, list(cells))
    assert tasks["c0"].meta["from"] == 0 and tasks["c1"].meta["from"] == 1
    cells["c0"].begin(2, tasks["c0"])
    plan = cells["c0"].plan(0, ["c0-a", "c0-b"])
    assert plan["c0-a"].meta == {"from": 1} and plan["c0-b"].meta == {"from": 0}
    assert plan["c0-b"].tensors["g"].shape == (2, K, P) and plan["c0-a"].tensors["g"].shape == (1, K, P)
    cells["c0"].aggregate(0, {d: Payload({"weight": 1}, {"g": g[1]}) for d in plan})
    cells["c1"].begin(2, tasks["c1"])
    cells["c1"].aggregate(0, {})
    cloud.aggregate(2, {"c0": cells["c0"].report(), "c1": cells["c1"].report()})
    assert cloud.base == 1 and len(cloud.g) == 2  # round 0 no longer needed by anyone


def test_device_skips_applied_rounds_and_refuses_a_history_it_cannot_replay():
    params = _params()
    x0 = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(2, np.float32)}
    seeds = [Z.round_seed(0, r) for r in range(4)]
    hist = np.random.default_rng(1).standard_normal((4, K, P)).astype(np.float32)
    full = {k: v.copy() for k, v in x0.items()}
    for r in range(4):
        Z.apply_round(full, seeds[r], hist[r], params.lr)
    dev = DeComFLDevice(params, lambda: x0)
    dev.model = {k: v.copy() for k, v in x0.items()}
    dev.catch_up(0, np.array(seeds[:2], np.uint64), hist[:2])
    assert dev.synced == 2
    dev.catch_up(1, np.array(seeds[1:4], np.uint64), hist[1:4])  # round 1 already applied: skipped
    assert dev.synced == 4 and all(np.array_equal(dev.model[k], full[k]) for k in x0)
    late = DeComFLDevice(params, lambda: x0)
    late.model = {k: v.copy() for k, v in x0.items()}
    with pytest.raises(ValueError, match="synced to round 0"):
        late.catch_up(2, np.array(seeds[2:], np.uint64), hist[2:])


def test_cloud_state_round_trip(runs):
    sim, *_ = runs[0]
    cloud = sim.cloud.role
    again = DeComFLCloud(cloud.p, cloud.seed, sim.algorithm.initial_params())
    state = cloud.state()
    assert not any(k.startswith(("log:", "history:")) for k in state.tensors)  # the log goes beside the checkpoint
    again.load_state(Payload(state.meta, {**state.tensors, **cloud.log_tail(0)}))
    r = cloud.base + len(cloud.g)
    a, b = cloud.plan(r, ["c0", "c1"]), again.plan(r, ["c0", "c1"])
    for c in a:
        assert a[c].meta == b[c].meta
        assert all(np.array_equal(a[c].tensors[k], b[c].tensors[k]) for k in a[c].tensors)
    assert all(np.array_equal(again.model[k], cloud.model[k]) for k in cloud.model)


def test_direction_scheme_is_fixed():
    shapes = {"a.weight": (3, 4), "a.bias": (3,)}
    z1, z2 = Z.direction(7, 1, 2, shapes), Z.direction(7, 1, 2, shapes)
    assert all(z1[k].dtype == np.float32 and np.array_equal(z1[k], z2[k]) for k in shapes)
    # one generator walks the parameters in model order
    flat = np.random.Generator(
        np.random.PCG64(__import__("protocols.seeding", fromlist=["x"]).seed_sequence(7, 1, 2, "zo-direction"))
    ).standard_normal(15, dtype=np.float32)
    assert np.array_equal(np.concatenate([z1["a.weight"].ravel(), z1["a.bias"]]), flat)
    r = Z.direction(7, 1, 2, shapes, "rademacher")
    assert set(np.unique(np.concatenate([v.ravel() for v in r.values()]))) <= {-1.0, 1.0}
    assert not np.array_equal(Z.direction(7, 1, 3, shapes)["a.bias"], z1["a.bias"])
    assert Z.fingerprint() == Z.fingerprint() and len(Z.fingerprint()) == 16


def test_example_config_runs_and_export_cli(tmp_path):
    cfg = load_config(
        REPO / "examples" / "decomfl.toml",
        [
            'data.dataset="digits"',
            "data.max_train=0",
            "run.rounds=3",
            "runtime.eval_every=3",
            f'run.output="{tmp_path / "run"}"',
            'runtime.onnx_devices=["c0-d0"]',
        ],
    )
    result = run_simulation(cfg)
    assert len(result.history) == 3 and result.final_accuracy is not None
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    took_part = {d for r in result.cell_records for d in r["planned"]}  # the others were never built
    assert set(summary["device_traffic"]) == took_part and len(took_part) < len(cfg.topology.all_devices())
    assert all(t["tasks"] > 0 for t in summary["device_traffic"].values())
    assert (tmp_path / "run" / "model.onnx").exists()
    from fedtier.cli import main

    out = tmp_path / "m.onnx"
    res = CliRunner().invoke(
        main, ["export", str(REPO / "examples" / "decomfl.toml"), "--set", 'data.dataset="digits"', "--out", str(out)]
    )
    assert res.exit_code == 0, res.output
    from edge_agent.onnx_trainer import build_onnx_trainer

    assert list(build_onnx_trainer(out).get_params()) == ["fc1.weight", "fc1.bias", "out.weight", "out.bias"]
    # an algorithm whose devices take gradients: no agent could train the file (it was written, "start agents with
    # --backend onnx", and each such agent then refused the job)
    res = CliRunner().invoke(main, ["export", str(REPO / "examples" / "quickstart.toml"), "--out", str(out) + "2"])
    assert res.exit_code == 2 and "fedtier export: forward-only (onnxruntime) devices need" in res.output, res.output
    assert not Path(str(out) + "2").exists()


def test_emulation_over_mqtt_with_an_onnx_device_is_bit_identical_to_sim(make_config, tmp_path):
    """``fedtier run``'s hierarchy (real broker, agent processes; c0-d1 on onnxruntime) == ``fedtier sim``."""
    from protocols.transport.broker import EmbeddedBroker
    from sim.emulation import Emulation

    def cfg(out: Path):
        c = decomfl_config(make_config, [8], rounds=4, onnx=["c0-d1"])
        return c.model_copy(update={"run": c.run.model_copy(update={"output": str(out)})})

    sim = run_simulation(cfg(tmp_path / "sim"))
    with EmbeddedBroker() as broker:
        emu = Emulation(cfg(tmp_path / "emu"), broker_url=broker.url).run()
    assert "c0-d1" in emu.device_traffic, "c0-d1's agent worker reported nothing (its log above says why)"
    devices = [[r["metrics"]["devices"] for r in run.history] for run in (emu, sim)]  # answers a round: run, sim
    assert all(np.array_equal(emu.params[k], sim.params[k]) for k in sim.params), devices
    assert emu.device_traffic["c0-d1"]["tasks"] == sim.device_traffic["c0-d1"]["tasks"] > 0
    assert (tmp_path / "emu" / "model.onnx").exists()


@pytest.mark.parametrize("momentum", [0.0, 0.5])
def test_resume_rebuilds_the_recreated_devices_replicas_from_the_clouds_log(make_config, tmp_path, momentum):
    """`fedtier sim --resume` recreates every device at x_0 (and a zero momentum buffer): the resumed
    cloud sends the history from round 0, kept in its log although its window was pruned, each device
    replays it, and the run ends with the uninterrupted run's model bit for bit."""

    def cfg(rounds: int, out: str):
        return make_config(
            run={"rounds": rounds, "output": str(tmp_path / out)},
            algorithm={
                "name": "decomfl",
                "edge_rounds": 1,
                "local_steps": 2,
                "perturbations": 2,
                "lr": 0.02,
                "momentum": momentum,
            },
        )

    straight = run_simulation(cfg(5, "straight"))
    first = run_simulation(cfg(3, "resumed"))
    assert first.history[-1]["metrics"]["history_rounds"] < 3  # the window no longer starts at round 0
    resumed = run_simulation(cfg(5, "resumed"), resume=True)
    assert [r["round"] for r in resumed.history] == [3, 4]
    assert all(r["metrics"]["devices"] == 6 for r in resumed.history)  # every device answered
    assert all(straight.params[k].tobytes() == resumed.params[k].tobytes() for k in straight.params)


def test_a_device_that_lost_its_replica_resyncs_from_the_clouds_log(make_config, tmp_path):
    """c0-d0 restarts after round 1 (a fresh role at x_0, as a restarted agent): round 2 it answers
    ``resync`` (it cannot replay from round 1), the cloud's window grows back to round 0, and from round
    3 it replays the whole history and trains: its replica is the cloud's model bit for bit again."""
    cfg = make_config(
        run={"rounds": 5, "output": str(tmp_path / "run")},
        algorithm={
            "name": "decomfl",
            "edge_rounds": 1,
            "local_steps": 2,
            "perturbations": 2,
            "lr": 0.02,
            "momentum": 0.5,
        },
    )
    sim = SimHierarchy(cfg)
    snaps = _snapshots_with_momentum(sim)
    take = sim.cloud.on_round

    def restart_after_round_1(record):
        take(record)
        if record["round"] == 1:
            sim.agents["c0-d0"].role = sim.algorithm.device("c0-d0")

    sim.cloud.on_round = restart_after_round_1
    result = sim.run()
    devices = [r["metrics"]["devices"] for r in result.history]
    assert devices == [6, 6, 5, 6, 6]  # round 2: c0-d0 resynced instead of training
    assert [r["metrics"]["history_rounds"] for r in result.history] == [1, 1, 3, 1, 1]
    role = sim.agents["c0-d0"].role
    model, buf = snaps[role.synced]
    assert role.synced == 4 and all(np.array_equal(role.model[k], model[k]) for k in model)
    assert all(np.array_equal(role.buf[k], buf[k]) for k in buf)


def _snapshots_with_momentum(sim):
    """Record the cloud's (model, momentum buffer) after every round of ``sim``."""
    copy = lambda role: ({k: v.copy() for k, v in role.model.items()}, {k: v.copy() for k, v in role.buf.items()})  # noqa: E731
    snaps = {0: copy(sim.cloud.role)}
    sim.cloud.on_round = lambda rec: snaps.__setitem__(rec["round"] + 1, copy(sim.cloud.role))
    return snaps


def test_momentum_rejoining_device_equals_the_always_online_device_bit_for_bit():
    params = DeComFLParams(
        name="decomfl", local_steps=2, perturbations=3, lr=0.02, mu=1e-3, batch_size=16, momentum=0.5
    )
    spec = ModelSpec(name="mlp", input_shape=(64,), num_classes=10, hidden=(8,))
    x0 = init_params(build_model(spec.name, spec.input_shape, spec.num_classes, **spec.build_kwargs()), 0)
    trainer = TorchTrainer.from_spec(spec.name, spec.input_shape, spec.num_classes, **spec.build_kwargs())
    rng = np.random.default_rng(0)
    data = {d: LocalData(rng.random((48, 64), dtype=np.float32), rng.integers(0, 10, 48)) for d in ("on", "back")}
    cloud = DeComFLCloud(params, 0, x0)
    cell = DeComFLCell(params, "c0", ["on", "back"])
    devices = {d: DeComFLDevice(params, lambda: x0) for d in data}
    for r in range(6):
        cell.begin(r, cloud.plan(r, ["c0"])["c0"])
        answering = ["on", "back"] if r in (0, 5) else ["on"]  # "back" misses rounds 1-4
        tasks = cell.plan(0, answering)
        before = (P_copy(cloud.model), P_copy(cloud.buf))  # x_r and its buffer
        results = {d: devices[d].train(tasks[d], data[d], trainer, DeviceContext(0, r, 0, "c0", d)) for d in answering}
        for d in answering:  # after training every device holds x_r and its buffer (reverted), exactly
            assert all(np.array_equal(devices[d].model[k], before[0][k]) for k in x0), (r, d)
            assert all(np.array_equal(devices[d].buf[k], before[1][k]) for k in x0), (r, d)
        cell.aggregate(0, results)
        cloud.aggregate(r, {"c0": cell.report()})
    on, back = devices["on"], devices["back"]
    assert tasks["back"].meta["from"] == 0 and tasks["on"].meta["from"] == 4  # rounds 0-4 replayed by "back"
    assert back.synced == on.synced == 5
    for k in x0:  # the rejoined device equals the always-online one, buffer included
        assert np.array_equal(back.model[k], on.model[k]) and np.array_equal(back.buf[k], on.buf[k]), k
    assert max(float(np.abs(v).max()) for v in on.buf.values()) > 0  # the buffer is really in play
    plain = DeComFLCloud(params.model_copy(update={"momentum": 0.0}), 0, x0)
    assert plain.buf is None


def P_copy(params):
    return {k: v.copy() for k, v in params.items()}


@pytest.mark.parametrize("engine", ["device", "cohort"])
def test_momentum_replay_is_exact_in_both_engines(make_config, engine):
    cfg = decomfl_config(make_config, [16], rounds=8, momentum=0.5)
    cfg = cfg.model_copy(update={"runtime": cfg.runtime.model_copy(update={"engine": engine})})
    sim = SimHierarchy(cfg, write_output=False)
    snaps = _snapshots_with_momentum(sim)
    assert (type(sim.executor).__name__ == "CohortExecutor") == (engine == "cohort")
    result = sim.run()
    cloud, seen = sim.cloud.role, 0
    for d, agent in sim.agents.items():
        role = agent.role
        if role.model is None:
            continue
        seen += 1
        model, buf = snaps[role.synced]
        assert all(np.array_equal(role.model[k], model[k]) and np.array_equal(role.buf[k], buf[k]) for k in model), d
        i = role.synced - cloud.base
        role.catch_up(role.synced, np.array(cloud.seeds[i:], np.uint64), np.stack(cloud.g[i:]))
        assert all(np.array_equal(role.model[k], result.params[k]) for k in model), d
        assert all(np.array_equal(role.buf[k], cloud.buf[k]) for k in model), d
    assert seen >= 4
    # the checkpoint carries the buffer
    again = DeComFLCloud(cloud.p, cloud.seed, sim.algorithm.initial_params())
    state = cloud.state()
    assert not any(k.startswith(("log:", "history:")) for k in state.tensors)  # the log goes beside the checkpoint
    again.load_state(Payload(state.meta, {**state.tensors, **cloud.log_tail(0)}))
    assert all(np.array_equal(again.buf[k], cloud.buf[k]) for k in cloud.buf)


def test_directions_are_drawn_once_per_process_and_stay_bounded(monkeypatch):
    """A direction is drawn once and shared read-only (every device of a round needs the same ones);
    the shared copies equal a fresh draw, and the cache drops the oldest beyond its byte bound."""
    shapes = {"w": (3, 4), "b": (4,)}
    fresh = Z.views(Z._draw_flat(77, 1, 2, shapes, "gaussian"), shapes)
    first, again = Z.direction(77, 1, 2, shapes), Z.direction(77, 1, 2, shapes)
    for k in shapes:
        assert np.array_equal(first[k], fresh[k]) and again[k] is first[k]
        assert not first[k].flags.writeable
        with pytest.raises(ValueError):
            first[k] += 1.0
    monkeypatch.setattr(Z, "CACHE_BYTES", 2 * 16 * 4)  # two directions of 16 floats
    for p in range(5):
        Z.direction(78, 0, p, shapes)
    assert Z._cached_bytes <= Z.CACHE_BYTES and len(Z._cache) <= 2
    assert np.array_equal(
        Z.direction(78, 0, 0, shapes)["w"], Z.views(Z._draw_flat(78, 0, 0, shapes, "gaussian"), shapes)["w"]
    )


def test_a_steps_directions_are_drawn_as_one_block_the_engine_reads_without_a_copy(monkeypatch):
    """A step whose P directions are all new is drawn as the rows of one read-only block: ``stacked`` hands it out
    whole and the cohort engine's probes read it in place (no 4Pn-byte stack a round), the same bits as the
    directions drawn one by one; directions that were not drawn together are stacked (a copy), the same values."""
    import torch

    from protocols.cohort_kernels import probe_operands

    _fresh_caches(monkeypatch)
    shapes = {"w": (3, 4), "b": (4,)}
    zs = Z.direction_vectors(93, 0, 5, shapes)
    block = Z.stacked(zs)
    assert block.shape == (5, 16) and not block.flags.writeable and all(z.base is block for z in zs)
    for p, z in enumerate(zs):
        assert z.tobytes() == Z._draw_flat(93, 0, p, shapes, "gaussian").tobytes()
    z, mu = probe_operands(zs, [1e-3] * 3, 16, torch.device("cpu"))
    assert np.shares_memory(z.numpy(), block) and np.array_equal(z.numpy(), np.stack(zs)) and mu.shape == (1,)
    apart = [Z.direction_vector(94, 0, 0, shapes), *Z.direction_vectors(94, 0, 3, shapes)[1:]]
    assert not np.shares_memory(Z.stacked(apart), apart[0]) and np.array_equal(Z.stacked(apart), np.stack(apart))


@pytest.mark.parametrize("momentum", [0.0, 0.5])
def test_a_step_is_one_shared_update_vector_and_the_layout_does_not_change_a_bit(momentum):
    """The scheme: u = sum_p c_p z_p in float32 (p ascending), computed once per process for a round's global
    step; a step applied to packed parameters (one vector) equals the same step applied tensor by tensor."""
    shapes = {"w": (3, 5), "b": (5,), "v": (2, 2, 2)}
    seed, lr = Z.round_seed(4, 9), 0.05
    g = np.random.default_rng(2).standard_normal((2, 4)).astype(np.float32)
    c = np.array([np.float32(v / 4) for v in g[0]], np.float32)
    c[1] = 0  # a zero coefficient is skipped
    manual = np.zeros(28, np.float32)
    for p in range(4):
        if c[p]:
            manual += c[p] * Z.direction_vector(seed, 0, p, shapes)
    u = Z.update(seed, 0, c, shapes)
    assert np.array_equal(u, manual) and Z.update(seed, 0, c, shapes) is u  # drawn and summed once, shared
    own = Z.update(seed, 0, c, shapes, share=False)
    assert own is not u and np.array_equal(own, u)
    x0 = {k: np.random.default_rng(3).standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    flat, plain = Z.packed(x0), P_copy(x0)
    assert isinstance(flat, Z.Packed) and np.shares_memory(flat["b"], flat.flat)
    zeros = {k: np.zeros_like(v) for k, v in x0.items()}
    bufs = (Z.packed(zeros), P_copy(zeros)) if momentum else (None, None)
    for model, buf in ((flat, bufs[0]), (plain, bufs[1])):
        for r in range(3):
            Z.apply_round(model, Z.round_seed(4, r), g, lr, buf=buf, momentum=momentum)
    for k in shapes:
        assert np.array_equal(flat[k], plain[k]), k
        if momentum:
            assert np.array_equal(bufs[0][k], bufs[1][k]), k
    assert not all(np.array_equal(flat[k], x0[k]) for k in shapes)
    # a plain step: c_p = lr / P * g_p in float64, rounded once to float32; x -= u
    g3, x = np.array([0.7, -1.3, 2.9], np.float32), Z.packed(x0)
    Z.apply_step(x, seed, 1, g3, 0.03)
    u3 = np.zeros(28, np.float32)
    for p in range(3):
        u3 += np.float32(0.03 / 3 * float(g3[p])) * Z.direction_vector(seed, 1, p, shapes)
    assert np.array_equal(x.flat, Z.packed(x0).flat - u3)


def test_the_cohort_engine_builds_a_devices_probes_bit_for_bit_and_its_losses_match():
    """The cohort engine builds the P + 1 probes of every device on its device (one upload of the directions):
    the same bits as the numpy probes a device builds, and the same losses as the per-device trainer's."""
    import torch

    from protocols.cohort_device import Request
    from protocols.cohort_kernels import perturbed_stack
    from protocols.cohort_trainer import CohortEngine

    spec = ModelSpec(name="cnn", input_shape=(1, 8, 8), num_classes=10, channels=(4, 8), fc=16)
    x0s = [
        init_params(build_model(spec.name, spec.input_shape, spec.num_classes, **spec.build_kwargs()), s)
        for s in (1, 2)
    ]
    mus = (1e-2, 3e-2)
    shapes = Z.shapes_of(x0s[0])
    zs = tuple(Z.direction_vector(Z.round_seed(0, 3), 0, p, shapes) for p in range(3))
    base = {k: torch.from_numpy(np.stack([x[k] for x in x0s])) for k in shapes}
    probes = perturbed_stack(base, torch.from_numpy(np.stack(zs)), torch.tensor(mus, dtype=torch.float32))
    one = perturbed_stack(base, torch.from_numpy(np.stack(zs)), torch.tensor(mus[:1], dtype=torch.float32))
    for i, (x0, mu) in enumerate(zip(x0s, mus)):
        expected = [x0] + [Z.perturbed(x0, Z.views(z, shapes), mu) for z in zs]
        for j, e in enumerate(expected):
            assert all(np.array_equal(probes[k][i * 4 + j].numpy(), e[k]) for k in shapes), (i, j)
        for j, e in enumerate([x0] + [Z.perturbed(x0, Z.views(z, shapes), mus[0]) for z in zs]):  # one mu for all
            assert all(np.array_equal(one[k][i * 4 + j].numpy(), e[k]) for k in shapes), (i, j)
    rng = np.random.default_rng(0)
    batches = [(rng.random((16, 64), dtype=np.float32), rng.integers(0, 10, 16)) for _ in x0s]
    reqs = [Request("probe", spec, x0, xb, yb, directions=zs, mu=mu) for x0, mu, (xb, yb) in zip(x0s, mus, batches)]
    CohortEngine("cpu").run(reqs)
    trainer = TorchTrainer.from_spec(spec.name, spec.input_shape, spec.num_classes, **spec.build_kwargs())
    for r in reqs:
        device = trainer.perturbed_losses(r.params, zs, r.mu, r.x, r.y)
        assert len(r.result) == 4 and np.ptp(device) > 1e-4  # the probes' losses differ: a mix-up would show
        np.testing.assert_allclose(r.result, device, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", ["cnn", "mlp"])
def test_devices_at_one_point_share_their_probes_with_the_same_bits(monkeypatch, name):
    """Devices at one point (DeComFL's replicas at x_r: equal parameters and mu) share their P + 1 probes, each run
    once over all their samples (uneven batches, padded): the losses of building every device's probes, bit for bit;
    a device elsewhere, or with another mu, has its own."""
    import protocols.cohort_device as CD
    import protocols.cohort_trainer as CT
    from protocols.cohort_device import Request
    from protocols.cohort_trainer import CohortEngine

    spec = ModelSpec(name=name, input_shape=(1, 8, 8), num_classes=10, channels=(4, 8), fc=16, hidden=(12,))
    x0 = init_params(build_model(spec.name, spec.input_shape, spec.num_classes, **spec.build_kwargs()), 1)
    zs = tuple(Z.direction_vector(Z.round_seed(0, 3), 0, p, Z.shapes_of(x0)) for p in range(3))
    rng = np.random.default_rng(0)
    batches = [(rng.random((n, 64), dtype=np.float32), rng.integers(0, 10, n)) for n in (16, 16, 9)]

    def losses(params: list, mus: tuple, apart: bool = False) -> tuple[bool, list]:
        """(whether at one point, the losses), ``apart``: built device by device even at one point."""
        reqs = [Request("probe", spec, p, x, y, directions=zs, mu=mu) for p, mu, (x, y) in zip(params, mus, batches)]
        monkeypatch.setattr(CT, "one_point", (lambda reqs: False) if apart else CD.one_point)
        CohortEngine("cpu").run(reqs)
        return CD.one_point(reqs), [r.result for r in reqs]

    replicas = [Z.packed(x0) for _ in batches]  # three replicas, the same bits
    one, together = losses(replicas, (1e-2,) * 3)
    assert one and together == losses(replicas, (1e-2,) * 3, apart=True)[1] and np.ptp(together[0]) > 1e-4
    moved = [replicas[0], replicas[1], Z.packed({k: v + 1e-3 for k, v in x0.items()})]
    for params, mus in ((moved, (1e-2,) * 3), (replicas, (1e-2, 1e-2, 2e-2))):  # one elsewhere: each its own probes
        one, each = losses(params, mus)
        assert not one and each[:2] == together[:2] and each[2] != together[2]


@pytest.mark.parametrize("momentum", [0.0, 0.5])
def test_replicas_of_a_process_share_their_replays_bit_for_bit(monkeypatch, momentum):
    """A device catching up copies the newest state of its chain that a replica of the process reached and
    replays only the rounds after it: the same bits as replaying every round, while a replica whose history
    differs (a cell that lies to one device) or that starts elsewhere never gets another's state."""
    params = DeComFLParams(name="decomfl", local_steps=2, perturbations=3, lr=0.01, momentum=momentum)
    x0 = {"w": np.arange(6, dtype=np.float32).reshape(2, 3) / 7, "b": np.ones(2, np.float32)}
    seeds = np.array([Z.round_seed(5, r) for r in range(6)], np.uint64)
    hist = np.random.default_rng(4).standard_normal((6, 2, 3)).astype(np.float32)
    plain = Z.packed(x0)
    plain_buf = Z.packed({k: np.zeros_like(v) for k, v in x0.items()}) if momentum else None
    for r in range(6):
        Z.apply_round(plain, int(seeds[r]), hist[r], params.lr, "gaussian", plain_buf, momentum)

    applied = []
    real = Z.apply_round
    monkeypatch.setattr(Z, "apply_round", lambda *a, **k: (applied.append(a[1]), real(*a, **k))[1])
    monkeypatch.setattr(Z, "_states", type(Z._states)())
    monkeypatch.setattr(Z, "_state_bytes", 0)
    a, b, liar = (DeComFLDevice(params, lambda: x0) for _ in range(3))
    for dev in (a, b, liar):
        dev._init(None)  # type: ignore[arg-type]  # x_0 from the spec (no exported model)
    a.catch_up(0, seeds[:4], hist[:4])
    assert len(applied) == 4
    zeros = Z.packed({k: np.zeros_like(v) for k, v in x0.items()}) if momentum else None
    chain = Z.trajectory_key(Z.packed(x0), zeros, params.lr, momentum)
    for r in range(4):  # the keys of a replay are next_key's, round after round
        chain = Z.next_key(chain, int(seeds[r]), hist[r])  # type: ignore[arg-type]
    assert a.key == chain
    b.catch_up(0, seeds[:6], hist[:6])  # rounds 0-3 copied from a's state, 4-5 replayed
    assert len(applied) == 6 and applied[-2:] == [int(seeds[4]), int(seeds[5])]
    a.catch_up(4, seeds[4:6], hist[4:6])  # all copied
    assert len(applied) == 6
    for dev in (a, b):
        assert np.array_equal(dev.model.flat, plain.flat) and dev.synced == 6  # type: ignore[union-attr]
        if momentum:
            assert np.array_equal(dev.buf.flat, plain_buf.flat)  # type: ignore[union-attr]
    lie = hist.copy()
    lie[2, 0, 0] += 1
    liar.catch_up(0, seeds[:6], lie[:6])  # another chain from round 2: replayed, never copied
    assert len(applied) == 6 + 6 and not np.array_equal(liar.model.flat, plain.flat)  # type: ignore[union-attr]
    d = DeComFLDevice(params, lambda: x0)  # a state reached before is shared (read-only), not copied
    d._init(None)  # type: ignore[arg-type]
    d.catch_up(0, seeds[:6], hist[:6])
    assert np.shares_memory(d.model.flat, a.model.flat) and not d.model["w"].flags.writeable  # type: ignore[union-attr]
    a.catch_up(6, np.array([Z.round_seed(5, 6)], np.uint64), hist[:1])  # goes on in a copy of its own
    assert not np.shares_memory(d.model.flat, a.model.flat) and np.array_equal(d.model.flat, plain.flat)  # type: ignore[union-attr]
    probe = type("Probe", (), {"perturbed_losses": lambda self, x, zs, mu, xb, yb: [0.0] + [0.5] * len(zs)})()
    data = LocalData(np.zeros((4, 3), np.float32), np.zeros(4, np.int64))
    g = d.local_update(d.model, 1, data, probe, DeviceContext(0, 5, 0, "c0", "c0-d0"), d.buf)  # type: ignore[arg-type]
    assert g.shape == (2, 3) and np.array_equal(d.model.flat, plain.flat)  # (its K = 2 steps moved a copy)  # type: ignore[union-attr]
    monkeypatch.setattr(Z, "STATE_CACHE_BYTES", 1)  # a state that does not fit is neither hashed nor kept
    monkeypatch.setattr(Z, "_states", type(Z._states)())
    c = DeComFLDevice(params, lambda: x0)
    c._init(None)  # type: ignore[arg-type]
    c.catch_up(0, seeds[:6], hist[:6])
    assert c.key is None and not Z._states and np.array_equal(c.model.flat, plain.flat)  # type: ignore[union-attr]


def test_a_device_that_is_rows_of_the_data_set_probes_its_batches_without_copying_its_samples_out():
    """A sim device's samples are rows of the data set (``DatasetRows``): DeComFL's steps gather each minibatch from
    the data set (``LocalData.batch``), the same samples as from the device's own copy, which is never made (it was
    kept from the device's first round: 1.9 MB of MNIST a device of the paper preset)."""
    from protocols.trainer import DatasetRows

    g = np.random.default_rng(3)
    x_all, y_all = g.normal(size=(50, 3)).astype(np.float32), g.integers(0, 4, 50)
    rows = g.permutation(50)[:20]
    params = DeComFLParams(name="decomfl", local_steps=3, perturbations=2, lr=0.01, batch_size=4)
    x0 = {"w": np.ones((2, 3), np.float32)}
    seen: list[bytes] = []

    def losses(self, x, zs, mu, xb, yb):  # the batch's bytes are what the probes saw
        seen.append(xb.tobytes() + yb.tobytes())
        return [float(xb.sum() + yb.sum())] + [float(xb.sum() + p) for p in range(len(zs))]

    probe = type("Probe", (), {"perturbed_losses": losses})()
    ctx = DeviceContext(0, 5, 0, "c0", "c0-d0")
    data = DatasetRows(x_all, y_all, rows)
    gathered = DeComFLDevice(params, lambda: x0).local_update(Z.packed(x0), 9, data, probe, ctx)  # type: ignore[arg-type]
    own = DeComFLDevice(params, lambda: x0).local_update(
        Z.packed(x0), 9, LocalData(x_all[rows], y_all[rows]), probe, ctx
    )  # type: ignore[arg-type]
    assert np.array_equal(gathered, own) and seen[:3] == seen[3:] and len(set(seen)) == 3
    assert "x" not in vars(data) and "y" not in vars(data)  # its samples never copied out


def test_a_round_replayed_ahead_is_the_state_a_device_reaches_and_the_next_device_takes_it(monkeypatch):
    """protocols.replay_ahead (a cell's task comes): the window's rounds after the newest state the process keeps
    are replayed in a thread of their own and kept; a device catching up meanwhile waits for that state and takes it
    (no round applied on its thread), the bits of replaying every round. Without drawing ahead, nothing starts."""
    import threading

    from protocols.replay_ahead import replay_ahead

    _fresh_caches(monkeypatch)
    monkeypatch.setattr(Z, "_newest", None)
    monkeypatch.setattr(Z, "_replaying", {})
    params = DeComFLParams(name="decomfl", local_steps=2, perturbations=3, lr=0.01, momentum=0.5)
    x0 = {"w": np.arange(6, dtype=np.float32).reshape(2, 3) / 7, "b": np.ones(2, np.float32)}
    seeds = np.array([Z.round_seed(5, r) for r in range(6)], np.uint64)
    hist = np.random.default_rng(4).standard_normal((5, 2, 3)).astype(np.float32)
    plain, plain_buf = Z.packed(x0), Z.packed({k: np.zeros_like(v) for k, v in x0.items()})
    for r in range(5):
        Z.apply_round(plain, int(seeds[r]), hist[r], params.lr, "gaussian", plain_buf, params.momentum)
    go, applied, real = threading.Event(), [], Z.apply_round

    def apply_round(*a, **k):
        if threading.current_thread() is not threading.main_thread():
            assert go.wait(30), "the device never waited for the round replayed ahead"
        applied.append((threading.current_thread() is threading.main_thread(), int(a[1])))
        return real(*a, **k)

    monkeypatch.setattr(Z, "apply_round", apply_round)
    a, b = DeComFLDevice(params, lambda: x0), DeComFLDevice(params, lambda: x0)
    for dev in (a, b):
        dev._init(None)  # type: ignore[arg-type]  # x_0 from the spec (no exported model)
    a.catch_up(0, seeds[:4], hist[:4])  # x_4 reached and kept: the newest state
    assert not replay_ahead(seeds, hist)  # (drawing ahead off: fedtier sim with one draw thread)
    Z.set_prefetch(True)
    try:
        assert replay_ahead(seeds, hist)  # round 4, from x_4, in the thread ahead (held until b waits for it)
        assert not replay_ahead(seeds, hist)  # (started once)
        ((target, running),) = Z._replaying.items()
        waited = type("Waited", (), {"exception": lambda self: (go.set(), running.exception())[1]})()
        Z._replaying[target] = waited  # (b's wait lets the thread ahead go on)
        b.catch_up(0, seeds, hist)
    finally:
        Z.set_prefetch(False)
    assert go.is_set() and applied == [(True, int(seeds[r])) for r in range(4)] + [(False, int(seeds[4]))]
    assert np.array_equal(b.model.flat, plain.flat) and np.array_equal(b.buf.flat, plain_buf.flat)  # type: ignore[union-attr]
    assert not b.model.flat.flags.writeable and b.key == target and not Z._replaying  # type: ignore[union-attr]


def test_replicas_whose_rounds_have_other_shapes_never_share_a_replay(monkeypatch):
    """Two replicas of a process from the same x_0 and settings but K x P of 2 x 3 and 3 x 2 (two jobs of one
    long-lived agent): the same scalars' bytes are other rounds (other directions), so neither gets the other's
    state; each ends where replaying its own rounds gives."""
    monkeypatch.setattr(Z, "_states", type(Z._states)())
    monkeypatch.setattr(Z, "_state_bytes", 0)
    x0 = {"w": np.arange(6, dtype=np.float32).reshape(2, 3) / 7, "b": np.ones(2, np.float32)}
    seeds = np.array([Z.round_seed(5, r) for r in range(3)], np.uint64)
    flat = np.random.default_rng(4).standard_normal((2, 6)).astype(np.float32)
    for k, p in ((2, 3), (3, 2)):
        params = DeComFLParams(name="decomfl", local_steps=k, perturbations=p, lr=0.01, momentum=0.5)
        hist = flat.reshape(2, k, p)
        plain, plain_buf = Z.packed(x0), Z.packed({n: np.zeros_like(v) for n, v in x0.items()})
        for r in range(2):
            Z.apply_round(plain, int(seeds[r]), hist[r], params.lr, "gaussian", plain_buf, params.momentum)
        dev = DeComFLDevice(params, lambda: x0)
        dev._init(None)  # type: ignore[arg-type]
        dev.catch_up(0, seeds, hist)
        assert np.array_equal(dev.model.flat, plain.flat), (k, p)  # type: ignore[union-attr]
        assert np.array_equal(dev.buf.flat, plain_buf.flat), (k, p)  # type: ignore[union-attr]


def test_a_tasks_window_is_a_slice_of_the_log_grown_a_round_at_a_time():
    """The cloud's log as one array grown a row a round (``decomfl_wire.LogRows``): each round's window has the values
    and shape of the window stacked anew (it was stacked every round: ~90 rounds copied in the paper preset), a
    window handed out keeps its rounds as the log grows past its capacity, and a log read back (other arrays) is
    stacked anew."""
    from protocols.algorithms.decomfl_wire import LogRows, stack_rounds

    rows, log, handed = LogRows(K, P), [], []
    assert rows.of(log).shape == (0, K, P)
    for r in range(150):  # (past its first capacity, 64 rows: grown twice)
        log.append(np.full((K, P), r, np.float32) + np.arange(P, dtype=np.float32) / 10)
        window = rows.of(log)
        assert window.dtype == np.float32 and window.tobytes() == stack_rounds(log, K, P).tobytes()
        assert rows.of(log) is not None and not window.flags.writeable
        handed.append(window[max(0, r - 5) :])
    for r, window in enumerate(handed):  # each as it was handed out
        assert window.tobytes() == stack_rounds(log[max(0, r - 5) : r + 1], K, P).tobytes()
    read_back = [x.copy() * 2 for x in log]  # the same length, other arrays (a resumed cloud's log)
    assert rows.of(read_back).tobytes() == stack_rounds(read_back, K, P).tobytes()
    read_back.append(np.zeros((K, P), np.float32))
    assert rows.of(read_back).tobytes() == stack_rounds(read_back, K, P).tobytes()


def _fresh_caches(monkeypatch):
    """Empty the process's direction, update and replay caches (so the next run draws every direction)."""
    from collections import OrderedDict

    for name in ("_cache", "_updates", "_states"):
        monkeypatch.setattr(Z, name, OrderedDict())
    for name in ("_cached_bytes", "_update_bytes", "_state_bytes"):
        monkeypatch.setattr(Z, name, 0)


def test_a_step_drawn_ahead_is_drawn_once_and_its_askers_wait_for_it(monkeypatch):
    """directions.prefetch: a round's steps drawn ahead in a thread of their own; one who asks for a step meanwhile
    waits for that draw (each direction drawn once, in the thread ahead) and gets the bits and the block that
    drawing it then would give."""
    import threading

    shapes = {"w": (30, 40), "b": (40,)}
    draw, go = Z._draw_flat, threading.Event()
    drawn: list[tuple[str, int, int]] = []

    def counted(seed, k, p, *rest):
        if threading.current_thread() is threading.main_thread():
            go.set()  # (only where the asker draws the step itself: no one waits for the thread ahead)
        go.wait(30)  # the thread ahead draws once someone asked for the step
        drawn.append((threading.current_thread().name, k, p))
        return draw(seed, k, p, *rest)

    class Asked(dict):
        def get(self, *a):
            go.set()
            return super().get(*a)

    _fresh_caches(monkeypatch)
    monkeypatch.setattr(Z, "_draw_flat", counted)
    monkeypatch.setattr(Z, "_pending", Asked())
    Z.set_prefetch(True)
    try:
        Z.prefetch(95, 2, 3, shapes)  # K = 2 steps of P = 3, both drawn ahead
        first = Z.direction_vectors(95, 0, 3, shapes)  # asked while step 0 is being drawn: waits for it
        second = Z.direction_vectors(95, 1, 3, shapes)
    finally:
        Z.set_prefetch(False)
    assert sorted(drawn) == [("zo-ahead_0", k, p) for k in range(2) for p in range(3)], drawn  # once each, ahead
    for k, zs in enumerate((first, second)):
        assert [z.tobytes() for z in zs] == [draw(95, k, p, shapes, "gaussian").tobytes() for p in range(3)]
        assert Z.stacked(zs).base is None and not Z.stacked(zs).flags.writeable  # the step's one block, shared
        assert all(z is Z.direction_vector(95, k, p, shapes) for p, z in enumerate(zs))  # kept: the same arrays
    Z.prefetch(95, 2, 3, shapes)  # off: nothing drawn
    assert len(drawn) == 6


def test_a_cell_that_reported_draws_the_next_rounds_directions_once_its_process_waits(monkeypatch):
    """A cell whose devices draw in its process (``fedtier sim``'s cell processes, drawing ahead) starts drawing the
    next round's directions once it reported and its process waits (``CellRole.idle``: after its answer), from the
    seed the cloud will pick: they are drawn while the cloud closes the round, not once the next task came (in a cell
    process they waited on the round's path, ~1-14 ms a round), nor among the handlers that send the report (whose
    GIL the thread ahead took: ~7 % of the cell's turn). Once a round; its last round's, nothing; the next task
    finds them drawn, the bits drawing them then gives."""
    import threading

    x0 = {"w": np.zeros((30, 40), np.float32), "b": np.zeros(40, np.float32)}
    shapes = Z.shapes_of(x0)
    drawn: list[tuple[str, int]] = []
    draw = Z._draw_flat

    def counted(seed, *rest):
        drawn.append((threading.current_thread().name, seed))
        return draw(seed, *rest)

    def settled() -> set[int]:  # the seeds drawn since the last call, once every draw ahead is done
        for step in list(Z._pending.values()):
            step.result(30)
        seeds = {s for _, s in drawn}
        assert all(name.startswith("zo-ahead") for name, _ in drawn), drawn  # not by whoever asked
        drawn.clear()
        return seeds

    _fresh_caches(monkeypatch)
    monkeypatch.setattr(Z, "_draw_flat", counted)
    monkeypatch.setattr(Z, "_pending", {})
    cloud = DeComFLCloud(_params(), 7, x0)
    cell = DeComFLCell(_params(), "c0", ["d1"], shapes, ahead=(7, 3))
    Z.set_prefetch(True)
    try:
        for r in range(3):
            task = cloud.plan(r, ["c0"])["c0"]
            assert int(task.tensors["s"][-1]) == Z.round_seed(7, r)
            cell.begin(r, task)
            assert settled() == ({Z.round_seed(7, 0)} if r == 0 else set())  # later: drawn as the cell reported
            cell.aggregate(0, {"d1": Payload({"weight": 4}, {"g": np.ones((K, P), np.float32)})})
            cloud.aggregate(r, {"c0": cell.report()})  # (the cloud steps along the round's directions: drawn)
            assert settled() == set()  # not while its process still sends the report
            cell.idle()
            cell.idle()
            assert settled() == ({Z.round_seed(7, r + 1)} if r < 2 else set()), r  # once; the last round: nothing
            if r == 1:
                zs = Z.direction_vectors(Z.round_seed(7, 2), 1, P, shapes)  # a device's step of round 2
                assert not drawn
                bits = [draw(Z.round_seed(7, 2), 1, p, shapes, "gaussian").tobytes() for p in range(P)]
                assert [z.tobytes() for z in zs] == bits
    finally:
        Z.set_prefetch(False)


def test_a_cloud_whose_process_says_it_waits_draws_its_rounds_directions_then(monkeypatch):
    """A cloud whose process calls ``idle`` as it waits for its cell processes (``fedtier sim`` with them) draws the
    round's directions then, not among the handlers that send the round's tasks (whose GIL the thread ahead took);
    the one-process cloud draws them as it plans, as before (``SimHierarchy`` with cell processes sets the hook:
    tests/test_cell_processes.py)."""
    x0 = {"w": np.zeros((30, 40), np.float32)}
    drawn: list[int] = []
    draw = Z._draw_flat
    monkeypatch.setattr(Z, "_draw_flat", lambda s, *rest: (drawn.append(s), draw(s, *rest))[1])
    _fresh_caches(monkeypatch)
    monkeypatch.setattr(Z, "_pending", {})
    Z.set_prefetch(True)
    try:
        for calls in (True, False):
            drawn.clear()
            cloud = DeComFLCloud(_params(), 11 if calls else 12, x0)
            cloud.idle_calls = calls
            cloud.plan(0, ["c0"])
            for step in list(Z._pending.values()):
                step.result(30)
            assert set(drawn) == (set() if calls else {Z.round_seed(12, 0)})
            cloud.idle()
            cloud.idle()
            for step in list(Z._pending.values()):
                step.result(30)
            assert len(drawn) == K * P and set(drawn) == {Z.round_seed(11 if calls else 12, 0)}  # once
    finally:
        Z.set_prefetch(False)


def test_a_draw_ahead_that_cannot_start_fails_no_one_and_leaves_no_one_waiting(monkeypatch):
    """A draw ahead whose thread cannot take it (its executor shut down, as once the interpreter exits: submit raises)
    raised into the cloud's plan or the cell's task, and left its step pending for ever: whoever asked for that step
    then waited on a draw that never ran. It is drawn when asked instead, the same bits."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    shapes = {"w": (3, 4)}
    _fresh_caches(monkeypatch)
    stopped = ThreadPoolExecutor(1)
    stopped.shutdown()
    monkeypatch.setattr(Z, "_ahead", stopped)
    monkeypatch.setattr(Z, "_pending", {})
    Z.prefetch(97, 1, 2, shapes)
    got: list[list[np.ndarray]] = []
    asker = threading.Thread(target=lambda: got.append(Z.direction_vectors(97, 0, 2, shapes)), daemon=True)
    asker.start()
    asker.join(30)
    assert got, "the asker waits for a draw that never runs"
    assert [z.tobytes() for z in got[0]] == [Z._draw_flat(97, 0, p, shapes, "gaussian").tobytes() for p in range(2)]


def test_directions_drawn_in_threads_are_the_same_bits_and_so_is_the_model(monkeypatch, make_config):
    """runtime.direction_threads = 4: a step's P directions are drawn in pool threads, byte-identical to one
    thread's draws, and a short DeComFL run, whose cloud and cells then draw a round's directions ahead
    (``directions.prefetch``), ends on the same model bytes as with 1 thread (nothing drawn ahead)."""
    import threading

    shapes = {"w": (30, 40), "b": (40,)}
    drawers: set[str] = set()
    draw = Z._draw_flat
    monkeypatch.setattr(Z, "_draw_flat", lambda *a: (drawers.add(threading.current_thread().name), draw(*a))[1])
    try:
        _fresh_caches(monkeypatch)
        Z.set_draw_threads(4)
        many = Z.direction_vectors(91, 0, 6, shapes)
        assert any(name.startswith("zo-draw") for name in drawers)  # drawn in the pool, not one by one
        for p, z in enumerate(many):
            assert z.tobytes() == Z._draw_flat(91, 0, p, shapes, "gaussian").tobytes()
        c = np.array([0.5, 0.0, -1.25, 2.0, 0.125], np.float32)
        _fresh_caches(monkeypatch)
        drawers.clear()
        u4 = Z.update(92, 1, c, shapes, share=False)  # (a cloud of its own: the update draws them)
        assert any(name.startswith("zo-draw") for name in drawers)
        _fresh_caches(monkeypatch)
        Z.set_draw_threads(1)
        assert Z.update(92, 1, c, shapes, share=False).tobytes() == u4.tobytes()
        finals = {}
        for threads in (4, 1):
            _fresh_caches(monkeypatch)
            drawers.clear()
            cfg = decomfl_config(make_config, [16], rounds=4, perturbations=5)
            cfg = cfg.model_copy(update={"runtime": cfg.runtime.model_copy(update={"direction_threads": threads})})
            finals[threads] = run_simulation(cfg, write_output=False).params
            assert any(n.startswith("zo-draw") for n in drawers) == (threads > 1)
            assert any(n.startswith("zo-ahead") for n in drawers) == (threads > 1)  # the cloud and cells draw ahead
        assert finals[1].keys() == finals[4].keys()
        assert all(finals[1][k].tobytes() == finals[4][k].tobytes() for k in finals[1])
    finally:
        Z.set_draw_threads(1)
