"""Per-node message signing (``[security] keys``): keys files, ``fedtier keys``, forged messages
rejected in the sim, and a signed ``fedtier run`` bit-identical to ``fedtier sim``."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from fedtier.cli import main
from protocols import runfiles
from protocols.checkpoint import load_params
from protocols.config import ConfigError
from protocols.transport.broker import EmbeddedBroker
from protocols.transport.mqtt import MqttTransport
from protocols.transport.threadloop import ThreadLoop
from protocols.wire import topics
from protocols.wire.envelope import WireError, decode_message, verify_signature
from protocols.wire.keys import (
    KEY_BYTES,
    KeyRing,
    KeysError,
    Trust,
    dump_keys,
    generate_keys,
    load_keys,
    new_seed,
    node_subset,
    node_trust,
    public_of,
    write_keys,
)
from protocols.wire.messenger import Messenger
from protocols.wire.payload import Payload, decode_payload
from sim.emulation import Emulation
from sim.launcher import SimHierarchy, run_simulation
from tests.conftest import FullDisk, small_config


def same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


# ------------------------------------------------------------------------------------- keys files
def test_keys_file_roundtrip_subsets_and_errors(tmp_path: Path) -> None:
    topo = small_config(tmp_path).topology  # 2 cells x 3 devices
    ring = generate_keys(topo)
    assert list(ring.private) == ["cloud", "c0", "c1", "c0-d0", "c0-d1", "c0-d2", "c1-d0", "c1-d1", "c1-d2"]
    assert all(len(k) == KEY_BYTES for k in ring.private.values()) and len(set(ring.private.values())) == 9
    assert all(ring.public[n] == public_of(ring.private[n]) for n in ring.private)
    path = write_keys(tmp_path / "keys.toml", ring)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600  # secrets: owner only
    assert load_keys(path) == ring
    with pytest.raises(KeysError, match="exists"):
        write_keys(path, ring)
    # a node holds its own private key only, and its peers' public keys
    d = node_subset(ring, topo, "c0-d1")
    assert set(d.private) == {"c0-d1"} and set(d.public) == {"c0-d1", "c0", "cloud", "c0-d0", "c0-d2"}
    c = node_subset(ring, topo, "c1")
    assert set(c.private) == {"c1"} and set(c.public) == {"c1", "cloud", "c1-d0", "c1-d1", "c1-d2"}
    assert set(node_subset(ring, topo, "cloud").public) == set(ring.public)
    with pytest.raises(KeysError, match="'c0'"):  # a device file lacks its cell's public key
        node_subset(KeyRing({"c0-d1": ring.private["c0-d1"]}, {}), topo, "c0-d1")
    with pytest.raises(KeysError, match="not in the topology"):
        node_subset(ring, topo, "c9-d0")
    with pytest.raises(KeysError) as other:  # c1's bundle, run as c0: which node the file is for
        node_subset(c, topo, "c0")
    assert str(other.value) == (
        "the private key of 'c0' is missing from the keys file (it holds the private key of 'c1': another node's "
        "file (its bundle)?)"
    )
    old = tmp_path / "old.toml"  # the HMAC keys file of an older fedtier
    old.write_text('[keys]\n"cloud" = "' + "ab" * 32 + '"\n')
    with pytest.raises(ConfigError, match="older fedtier.*fedtier keys CONFIG --out"):
        load_keys(old)
    bad = tmp_path / "bad.toml"
    bad.write_text(dump_keys(KeyRing({"cloud": ring.private["cloud"]}, {"cloud": ring.public["c0"]})))
    with pytest.raises(ConfigError, match="does not match"):
        load_keys(bad)
    cfg = small_config(tmp_path, security={"keys": str(tmp_path / "missing.toml")})
    with pytest.raises(ConfigError, match="cannot read"):
        node_trust(cfg, "cloud")


def test_verified_signature_cache_is_bounded_content_keyed_and_never_serves_a_forgery() -> None:
    """A record verified once is not checked again (same key, signature and bytes); an altered record,
    a forged signature, another signer's key or another node's signature of the same bytes always
    reach the real check and fail; the cache keeps at most ``size`` entries."""
    from protocols.status import decode_status, encode_status
    from protocols.wire.keys import VerifiedSignatures

    cloud_seed, cell_seed = new_seed(), new_seed()
    public = {"cloud": public_of(cloud_seed), "c0": public_of(cell_seed)}
    cloud, device = Trust("cloud", cloud_seed, public), Trust("c0-d0", new_seed(), public)
    device.verified = cache = VerifiedSignatures(size=8)
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    real = Ed25519PublicKey.from_public_bytes(public["cloud"])
    calls = [0]

    class Counting:
        def verify(self, sig: bytes, data: bytes) -> None:
            calls[0] += 1
            real.verify(sig, data)

    device._public["cloud"] = Counting()  # type: ignore[assignment]
    topic = topics.status("r", "cloud")
    record = encode_status("online", topic=topic, trust=cloud)
    for _ in range(5):
        assert decode_status(record, topic, device) == {"state": "online"}
    assert calls[0] == 1 and len(cache) == 1
    altered = record.replace(b"online", b"offline")
    assert decode_status(altered, topic, device) is None
    forged_sig = record[:-10] + (b"A" if record[-10:-9] != b"A" else b"B") + record[-9:]
    assert decode_status(forged_sig, topic, device) is None
    by_cell = encode_status("online", topic=topic, trust=Trust("c0", cell_seed, public))  # not the cloud's key
    assert decode_status(by_cell, topic, device) is None
    assert calls[0] == 4 and len(cache) == 1, "failures are never cached"
    with pytest.raises(WireError):  # the same signature and bytes, claimed by another signer
        data = b"x"
        device.verify("c0", data, cloud.sign(data))
    for i in range(20):
        data = f"record {i}".encode()
        device.verify("cloud", data, cloud.sign(data))
    assert len(cache) == 8


def test_fedtier_keys_command_writes_full_and_per_node_files(tmp_path: Path) -> None:
    cfg_path = tmp_path / "cfg.toml"
    cfg_path.write_text(small_config(tmp_path).to_toml())
    runner = CliRunner()
    full = tmp_path / "keys.toml"
    res = runner.invoke(main, ["keys", str(cfg_path), "--out", str(full)])
    assert res.exit_code == 0, res.output
    ring = load_keys(full)
    assert len(ring.private) == len(ring.public) == 1 + 2 + 6
    for node, expected in [
        ("c0-d1", {"c0-d1", "c0", "cloud", "c0-d0", "c0-d2"}),  # its cell's devices: secure aggregation
        ("c1", {"c1", "cloud", "c1-d0", "c1-d1", "c1-d2"}),
    ]:
        out = tmp_path / f"{node}.toml"
        res = runner.invoke(main, ["keys", str(cfg_path), "--from", str(full), "--node", node, "--out", str(out)])
        assert res.exit_code == 0, res.output
        part = load_keys(out)
        assert part.private == {node: ring.private[node]}
        assert set(part.public) == expected and all(part.public[n] == ring.public[n] for n in part.public)
    res = runner.invoke(main, ["keys", str(cfg_path), "--out", str(full)])
    assert res.exit_code == 2 and "exists" in res.output  # never silently replaces deployed keys
    res = runner.invoke(main, ["keys", str(cfg_path), "--node", "c0-d1", "--out", str(tmp_path / "x.toml")])
    assert res.exit_code == 2 and "--from" in res.output


# ------------------------------------------------------------------------------ signed simulation
@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """An unsigned and a signed 2-round sim of the small config (keys generated into the run folder)."""
    tmp = tmp_path_factory.mktemp("signed")
    plain = run_simulation(small_config(tmp / "plain", run={"rounds": 2}))
    cfg = small_config(tmp / "signed", run={"rounds": 2}, security={"keys": str(tmp / "absent.toml")})
    signed = run_simulation(cfg)
    return {"plain": plain, "signed": signed, "keys": Path(signed.config.security.keys)}


def test_a_resumed_run_keeps_the_keys_it_generated(tmp_path: Path) -> None:
    """`--keys FILE` naming a missing file makes fresh keys in the run folder; `--resume` keeps them (it made
    new ones, and the nodes' records the broker had retained of the interrupted run, signed with the old
    keys, were each rejected as a bad signature, a warning per node, as if forged)."""
    cfg = small_config(tmp_path, run={"rounds": 1}, security={"keys": str(tmp_path / "absent.toml")})
    first = run_simulation(cfg)
    generated = Path(first.config.security.keys)
    before = generated.read_bytes()
    longer = cfg.model_copy(update={"run": cfg.run.model_copy(update={"rounds": 2})})
    resumed = SimHierarchy(longer, resume=True).run()
    assert Path(resumed.config.security.keys) == generated and generated.read_bytes() == before
    assert [r["round"] for r in resumed.history] == [1] and all(not r["rejected"] for r in resumed.cell_records)


def test_signed_sim_is_bit_identical_to_unsigned(runs: dict) -> None:
    plain, signed = runs["plain"], runs["signed"]
    assert runs["keys"] == (signed.output_dir / "keys.toml").resolve() and runs["keys"].exists()
    assert same(plain.params, signed.params)
    assert all(not r["rejected"] for r in signed.cell_records)
    assert all(not r["rejected"] for r in signed.history)
    # every message carries its session and an Ed25519 signature: 116 more header bytes each
    # (',"z":"<16 hex>"' and ',"g":"<86 base64url>"'), nothing else
    p, s = plain.history[-1]["cumulative_bytes"], signed.history[-1]["cumulative_bytes"]
    assert s["device_to_cell"] - p["device_to_cell"] == 116 * 2 * 2 * 6  # rounds x edge rounds x devices
    assert s["cell_to_cloud"] - p["cell_to_cloud"] == 116 * 2 * 2
    # the run's config points at the keys it used, so a rerun (or resume) verifies with the same keys
    assert str(runs["keys"]) in (signed.output_dir / runfiles.CONFIG).read_text()


FORGERIES = {
    "a key of its own": ("c0-d0", "own", "bad signature"),
    "unsigned": ("c0-d0", None, "unsigned"),
    "another device's key": ("c0-d1", "c0-d1", "published on the topic of device 'c0-d0'"),
    "the cell forging its device": ("c0-d0", "c0", "bad signature"),
}


def forge(sim: SimHierarchy, sender: str, trust: Trust | None) -> list[int]:
    """An intruder answers every task of c0-d0 first with a well-formed result (a huge delta of weight
    10), and once sends c1 a cell task for round 1 signed with the same key; returns the rounds it forged."""
    intruder = sim.hub.connect("intruder")
    run = sim.cfg.run.name
    messenger = Messenger(intruder, run, sender)
    messenger.trust = trust  # sign with it (the intruder verifies nothing)
    forged: list[int] = []

    def on_task(topic: str, data: bytes) -> None:
        header, raw = decode_message(data)
        task = decode_payload(raw).tensors  # the model the cell sent: the forgery has its shapes
        bogus = Payload({"weight": 10.0}, {k: np.full_like(v, 3.0) for k, v in task.items()})
        messenger.session = header.session
        messenger.send(
            topics.device_result(run, "c0", "c0-d0"),
            "device_result",
            bogus,
            round=header.round,
            edge_round=header.edge_round,
            cell="c0",
        )
        if not forged:
            cloud = Messenger(intruder, run, "cloud")
            cloud.trust, cloud.session = trust, header.session
            cloud.send(topics.cell_task(run, "c1"), "cell_task", Payload({}, task), round=1)
        forged.append(header.round)

    intruder.subscribe(topics.device_task(run, "c0", "c0-d0"), on_task)
    return forged


def signer(ring: KeyRing, claims: str, key: str | None) -> Trust | None:
    """A signer claiming to be ``claims`` with the private key of node ``key`` ("own": a fresh one)."""
    if key is None:
        return None
    return Trust(claims, new_seed() if key == "own" else ring.private[key], ring.public)


@pytest.mark.parametrize("how", list(FORGERIES))
def test_forged_messages_are_rejected_and_do_not_change_the_aggregate(how: str, runs: dict, tmp_path: Path) -> None:
    sender, key, reason = FORGERIES[how]
    cfg = small_config(tmp_path, run={"rounds": 2}, security={"keys": str(runs["keys"])})
    sim = SimHierarchy(cfg)
    forged = forge(sim, sender, signer(load_keys(runs["keys"]), sender, key))
    result = sim.run()
    assert forged == [0, 0, 1, 1]  # every edge round of c0-d0 had a forgery first
    assert same(result.params, runs["signed"].params)
    c0 = [x for r in result.cell_records if r["cell"] == "c0" for x in r["rejected"]]
    assert len(c0) == 4 and all(x["device"] == "c0-d0" and reason in x["reason"] for x in c0), c0
    c1 = [x for r in result.cell_records if r["cell"] == "c1" for x in r["rejected"]]
    assert len(c1) == 1 and ("unsigned" if key is None else "bad signature") in c1[0]["reason"], c1
    assert all(sorted(r["answered"]) == sorted(r["planned"]) for r in result.cell_records)


def async_sim(folder: Path, **security: str) -> SimHierarchy:
    """A 3-version asynchronous sim of the small config (``security``: its keys)."""
    algorithm = {"mode": "async", "async_buffer": 2, "edge_rounds": 1}
    return SimHierarchy(small_config(folder, run={"rounds": 3}, algorithm=algorithm, security=security))


@pytest.mark.timeout(60)  # before the fix: the cloud refused every push ("report of session None") without end
def test_a_signed_async_run_is_bit_identical_to_unsigned(runs: dict, tmp_path: Path) -> None:
    """Asynchronous cells stamp their device tasks and pushes with the cloud's session, as synchronous ones do,
    so a signed asynchronous run finishes, nothing refused, with the model of the unsigned run."""
    plain, signed = async_sim(tmp_path / "plain").run(), async_sim(tmp_path / "signed", keys=str(runs["keys"])).run()
    assert len(signed.history) == 3 and same(signed.params, plain.params)
    assert all(not r["rejected"] for r in signed.history + signed.cell_records)


def test_an_async_cell_refuses_a_result_another_device_signed(runs: dict, tmp_path: Path) -> None:
    """An asynchronous cell checks the sender as a synchronous one does: a result on c0-d0's topic signed with
    c0-d1's own key is refused, named so, and the model is the one of the same run without the intruder."""
    clean = async_sim(tmp_path / "clean", keys=str(runs["keys"])).run()
    sim = async_sim(tmp_path / "forged", keys=str(runs["keys"]))
    forged = forge(sim, "c0-d1", signer(load_keys(runs["keys"]), "c0-d1", "c0-d1"))
    result = sim.run()
    c0 = [x for r in result.cell_records if r["cell"] == "c0" for x in r["rejected"]]
    assert forged and c0 and all(x["device"] == "c0-d0" for x in c0), c0
    assert all("published on the topic of device 'c0-d0'" in x["reason"] for x in c0), c0
    assert same(result.params, clean.params)


def test_without_keys_the_same_forgery_poisons_the_aggregate(runs: dict, tmp_path: Path) -> None:
    """The control: unsigned, the forged result is taken and the model changes."""
    sim = SimHierarchy(small_config(tmp_path, run={"rounds": 2}))
    forge(sim, "c0-d0", None)
    result = sim.run()
    assert not same(result.params, runs["plain"].params)


# ---------------------------------------------------------------------------- signed emulation
def test_signed_fedtier_run_is_bit_identical_to_sim(runs: dict, tmp_path: Path) -> None:
    """Over the embedded broker, agents in a worker process load their keys from the config. A
    foreign MQTT client checks that every device result on the wire carries its device's signature,
    and answers c0-d0's first task with a forged result signed with a wrong key: rejected, logged."""
    ring = load_keys(runs["keys"])
    checker = Trust("cloud", ring.private["cloud"], ring.public)
    cfg = small_config(tmp_path, run={"rounds": 2}, security={"keys": str(runs["keys"])})
    run = cfg.run.name
    verified: list[str] = []
    forged: list[str] = []
    with EmbeddedBroker() as broker:
        loop = ThreadLoop("intruder").start()
        spy = MqttTransport.from_url(broker.url, "intruder", loop)
        liar = Messenger(spy, run, "c0-d0")
        liar.trust = Trust("c0-d0", new_seed(), ring.public)

        def on_result(topic: str, data: bytes) -> None:
            header, raw = decode_message(data)
            try:
                verify_signature(header, raw, topic, checker.verify)
                verified.append(header.sender)
            except WireError:
                forged.append(header.sender)

        def on_task(topic: str, data: bytes) -> None:
            header, raw = decode_message(data)
            if (header.round, header.edge_round) == (0, 0):
                liar.session = header.session
                bogus = Payload(
                    {"weight": 1000.0}, {k: np.full_like(v, 3.0) for k, v in decode_payload(raw).tensors.items()}
                )
                liar.send(topics.device_result(run, "c0", "c0-d0"), "device_result", bogus, round=0, cell="c0")

        spy.subscribe(topics.device_results(run, "+"), on_result)
        spy.subscribe(topics.device_task(run, "c0", "c0-d0"), on_task)
        spy.connect()
        spy.wait_subscribed()
        try:
            result = Emulation(cfg, broker_url=broker.url, workers=1).run()
        finally:
            spy.close()
            loop.stop()
    assert same(result.params, runs["signed"].params)
    assert len(result.history) == 2
    assert sorted(set(verified)) == sorted(cfg.topology.all_devices()) and len(verified) == 24
    assert forged == ["c0-d0"]
    rejected = [x for r in result.cell_records for x in r["rejected"]]
    assert rejected == [{"device": "c0-d0", "kind": "signature", "reason": "bad signature: not signed by 'c0-d0'"}]


@pytest.mark.timeout(90)  # before 6a60655: the cloud refused every push ("report of session None") without end
def test_a_signed_async_fedtier_run_finishes_with_every_result_signed(runs: dict, tmp_path: Path) -> None:
    """A signed asynchronous (FedBuff) ``fedtier run`` over MQTT: the async cells stamp their tasks and pushes
    with the cloud's session, so the cloud takes every push and makes every version; a foreign client sees
    each device result on the wire signed by its device; nothing is refused anywhere, and the final model (the
    last version, which the run folder holds) learned."""
    ring = load_keys(runs["keys"])
    checker = Trust("cloud", ring.private["cloud"], ring.public)
    algorithm = {"mode": "async", "async_buffer": 2, "edge_rounds": 1, "local_steps": 30}
    cfg = small_config(tmp_path, run={"rounds": 4}, algorithm=algorithm, security={"keys": str(runs["keys"])})
    verified: list[str] = []
    with EmbeddedBroker() as broker:
        loop = ThreadLoop("spy").start()
        spy = MqttTransport.from_url(broker.url, "spy", loop)

        def on_result(topic: str, data: bytes) -> None:
            header, raw = decode_message(data)
            verify_signature(header, raw, topic, checker.verify)  # raises (and the spy logs it) on a forgery
            verified.append(header.sender)

        spy.subscribe(topics.device_results(cfg.run.name, "+"), on_result)
        spy.connect()
        spy.wait_subscribed()
        try:
            result = Emulation(cfg, broker_url=broker.url, workers=1).run()
        finally:
            spy.close()
            loop.stop()
    assert [r["round"] for r in result.history] == [0, 1, 2, 3]
    rejected = [x for r in result.history + result.cell_records for x in r["rejected"]]
    assert not rejected, rejected
    assert set(verified) == set(cfg.topology.all_devices())
    assert same(load_params(result.output_dir / runfiles.FINAL_MODEL), result.params)
    assert result.history[-1]["accuracy"] > 0.3  # 10 digit classes: chance is 0.1 (the sim's 4th version: 0.55)


def test_a_keys_file_rewritten_stays_private_and_whole_when_the_disk_fills(tmp_path: Path, monkeypatch) -> None:
    """Rotating a node's identity or rewriting a federation's keys (``overwrite``) truncated the keys file in place
    and wrote it with no fsync: a full disk (or a crash) then left an empty file, every private key in it lost (a
    federation's keys.toml holds the cloud's signing key), and a file made readable by others stayed so. Now the old
    file stays whole until the new one is durable, and the new one is the owner's only."""
    ring = generate_keys(small_config(tmp_path).topology)
    path = write_keys(tmp_path / "keys" / "keys.toml", ring)
    before = path.read_bytes()
    fdopen = os.fdopen

    monkeypatch.setattr(os, "fdopen", lambda fd, *a, **k: FullDisk(fdopen(fd, *a, **k)))
    with pytest.raises(OSError):
        write_keys(path, ring, comment="rotated", overwrite=True)
    monkeypatch.undo()
    assert path.read_bytes() == before and load_keys(path).private == ring.private
    assert [p.name for p in path.parent.iterdir()] == ["keys.toml"]  # no temporary file left
    os.chmod(path, 0o644)  # e.g. copied with the wrong mode
    write_keys(path, ring, comment="rotated", overwrite=True)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and load_keys(path).private == ring.private


def test_a_run_that_generates_its_keys_says_where(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """``fedtier sim|run --keys FILE`` where FILE does not exist generates the run's keys in its run folder: it says
    so, with the path (``fedtier monitor --keys`` needs it; the operator looked for FILE), once, not on resume."""
    from protocols.wire.keys import with_run_keys

    cfg = small_config(tmp_path, security={"keys": str(tmp_path / "mine.toml")})
    out = tmp_path / "run"
    out.mkdir()
    with caplog.at_level("WARNING", logger="fedtier.wire"):
        keyed = with_run_keys(cfg, out)
        with_run_keys(cfg, out, resume=True)
    assert keyed.security.keys == str((out / "keys.toml").resolve()) and (out / "keys.toml").exists()
    said = [r.getMessage() for r in caplog.records]
    assert said == [
        f"security.keys: {tmp_path / 'mine.toml'} does not exist: this run's keys are generated in "
        f"{(out / 'keys.toml').resolve()} (fedtier monitor --keys)"
    ]
