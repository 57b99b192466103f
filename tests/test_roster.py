"""The signed roster: members, keys and bounds signed by the cloud; forged, altered, rolled back or
oversized rosters are refused."""

from __future__ import annotations

import json

import pytest

from protocols.roster import Roster, RosterError, roster_topic, sign_roster, verify_roster
from protocols.wire.keys import PublicKeys, Trust, new_seed, public_of

CELLS = {"c0": ["c0-d0", "c0-d1", "c0-d2"], "c1": ["c1-d0"]}  # cells of different sizes


@pytest.fixture()
def ring() -> dict[str, bytes]:
    nodes = ["cloud", "intruder", *CELLS, *(d for devs in CELLS.values() for d in devs)]
    return {n: new_seed() for n in nodes}


def _trust(ring: dict[str, bytes], node: str) -> Trust:
    return Trust(node, ring[node], {n: public_of(s) for n, s in ring.items()})


def _roster(ring: dict[str, bytes]) -> Roster:
    public = {n: public_of(s) for n, s in ring.items()}
    return Roster.from_topology("fed1", CELLS, public, {"c0-d0": 100, "c0-d1": 50, "c0-d2": 10, "c1-d0": 7})


def test_a_signed_roster_round_trips_and_answers_keys_and_bounds(ring):
    roster = _roster(ring)
    data = sign_roster(roster, _trust(ring, "cloud").sign)
    back = verify_roster(data, PublicKeys({"cloud": public_of(ring["cloud"])}).verify, federation="fed1")
    assert back == roster
    assert back.members("c0") == ["c0-d0", "c0-d1", "c0-d2"] and back.members("c1") == ["c1-d0"]
    assert back.device_key("c0-d1") == public_of(ring["c0-d1"]) and back.device_key("c1") == public_of(ring["c1"])
    assert back.device_bound("c0", "c0-d0") == 100 and back.device_bound("c1", "c0-d0") is None
    assert back.cell_bound("c0") == 160 and back.cell_bound("c1") == 7 and back.cell_bound("nope") == 0
    assert back.cell_of("c1-d0") == "c1" and roster_topic("fed1") == "fedtier/fed1/roster"


def test_a_roster_signed_by_anyone_but_the_cloud_is_refused(ring):
    roster = _roster(ring)
    verify = _trust(ring, "cloud").verify
    for forger in ("c0", "c0-d0", "intruder"):  # a cell or device with a valid identity cannot sign one
        with pytest.raises(RosterError, match="refused"):
            verify_roster(sign_roster(roster, _trust(ring, forger).sign), verify)


def test_an_altered_roster_is_refused(ring):
    data = sign_roster(_roster(ring), _trust(ring, "cloud").sign)
    doc = json.loads(data)
    # a cell swaps a device's key for one it holds (the key-substitution attack on secure aggregation)
    doc["cells"]["c0"]["devices"]["c0-d1"][0] = public_of(ring["intruder"]).hex()
    with pytest.raises(RosterError, match="refused"):
        verify_roster(json.dumps(doc).encode(), _trust(ring, "cloud").verify)
    doc = json.loads(data)
    doc["cells"]["c0"]["devices"]["c0-d1"][1] = 1e12  # an inflated bound
    with pytest.raises(RosterError, match="refused"):
        verify_roster(json.dumps(doc).encode(), _trust(ring, "cloud").verify)
    del doc["sig"]
    with pytest.raises(RosterError, match="unsigned"):
        verify_roster(json.dumps(doc).encode(), _trust(ring, "cloud").verify)


def test_revocation_makes_a_new_version_and_an_old_one_cannot_be_replayed(ring):
    sign, verify = _trust(ring, "cloud").sign, _trust(ring, "cloud").verify
    v1 = _roster(ring)
    v2 = v1.without("c0-d1")
    assert v2.version == v1.version + 1 and "c0-d1" in v2.revoked
    assert not v2.is_member("c0-d1") and v2.device_key("c0-d1") is None and v2.cell_bound("c0") == 110
    with pytest.raises(RosterError, match="never reused"):
        v2.with_device("c0", "c0-d1", public_of(ring["c0-d1"]), 10)
    old = sign_roster(v1, sign)
    with pytest.raises(RosterError, match="older"):
        verify_roster(old, verify, min_version=v2.version)
    v3 = v2.with_device("c1", "c1-d9", public_of(ring["intruder"]), 20)  # enrolled later, another cell size
    assert verify_roster(sign_roster(v3, sign), verify, min_version=v2.version).members("c1") == ["c1-d0", "c1-d9"]
    v4 = v3.without("c1")  # revoking a cell revokes its devices
    assert {"c1", "c1-d0", "c1-d9"} <= v4.revoked and "c1" not in v4.cells


@pytest.mark.parametrize(
    "mutate, why",
    [
        (lambda d: d["cells"]["c0"]["devices"].__setitem__("c0-d0", ["00" * 5, 1.0]), "bytes"),
        (lambda d: d["cells"]["c0"]["devices"].__setitem__("c0-d0", ["00" * 32, -1.0]), "positive"),
        (lambda d: d["cells"]["c0"]["devices"].__setitem__("../x", ["00" * 32, 1.0]), "node id"),
        (lambda d: d["cells"]["c1"]["devices"].__setitem__("c0-d0", ["00" * 32, 1.0]), "twice"),
        (lambda d: d.__setitem__("revoked", ["c0-d0"]), "revoked"),
        (lambda d: d.__setitem__("revoked_in", {"c0-d0": "c0"}), "not revoked"),
        (lambda d: d.update(revoked=["x"], revoked_in={"x": "../c"}), "node id"),
        (lambda d: d.update(revoked=["x"], revoked_in=["c0"]), "revoked_in"),
        (lambda d: d.__setitem__("cells", []), "malformed"),
        (lambda d: d.__setitem__("format", "x"), "format"),
    ],
)
def test_malformed_rosters_are_refused_with_the_reason(ring, mutate, why):
    doc = _roster(ring).to_dict()
    mutate(doc)
    sign = _trust(ring, "cloud").sign
    from protocols.roster import _canonical

    data = json.dumps({**doc, "sig": sign(_canonical(doc)).hex()}).encode()  # validly signed, still refused
    with pytest.raises(RosterError, match=why):
        verify_roster(data, _trust(ring, "cloud").verify)


def test_size_is_checked_before_parsing(ring):
    with pytest.raises(RosterError, match="exceeds"):
        verify_roster(b"{" * 2000, _trust(ring, "cloud").verify, max_bytes=1000)
    with pytest.raises(RosterError, match="not JSON"):
        verify_roster(b"[" * 100000, _trust(ring, "cloud").verify)
    with pytest.raises(RosterError, match="federation"):
        verify_roster(
            sign_roster(_roster(ring), _trust(ring, "cloud").sign), _trust(ring, "cloud").verify, federation="other"
        )


def test_a_node_holding_a_newer_roster_keeps_it_when_an_older_one_is_replayed_on_the_topic(ring):
    """The roster topic is retained and the operator's login may write it: replaying the signed roster that still
    lists a revoked device (a rollback) or one a cell signed changes nothing at a node that holds the newer one
    (``protocols.job_watch.JobWatch``, as cells use it): its roster and its callbacks stay."""
    from protocols.job_watch import JobWatch

    sign = _trust(ring, "cloud").sign
    v1 = _roster(ring)
    v2 = v1.without("c0-d1")
    watch = JobWatch(None, "fed1", _trust(ring, "c0"))
    seen: list[int] = []
    watch.on_roster = lambda r: seen.append(r.version)
    topic = roster_topic("fed1")
    watch._on_roster(topic, sign_roster(v2, sign))
    watch._on_roster(topic, sign_roster(v1, sign))  # the rollback
    watch._on_roster(topic, sign_roster(v1.without("c0-d2").without("c0-d0"), _trust(ring, "c0").sign))
    assert seen == [v2.version] and watch.roster == v2 and not watch.roster.is_member("c0-d1")
