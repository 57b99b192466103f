"""Two invariants of the codemap (docs/ARCHITECTURE.md) checked in the source, where a behavioural test can
only sample them: nothing in the product unpickles (so nothing from the network can be), and every random
draw comes from a seed, except the few that make a secret or a unique id."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import product_trees

PICKLERS = {"pickle", "_pickle", "cPickle", "marshal", "shelve", "dill", "cloudpickle", "joblib"}
MAY_UNPICKLE = {
    "sim.datasets": "decodes the MNIST file installed on this machine (mnist.pkl.gz) into the .npy cache, once",
}

# module prefix (a module split into several keeps its prefix) -> why it may draw without the run seed
MAY_DRAW_UNSEEDED = {
    "protocols.session": "a cloud session id: unique per start",
    "protocols.wire.envelope": "message ids: unique, never an input to a computation",
    "protocols.wire.keys": "Ed25519 identities: secrets",
    "protocols.privacy.secagg": "secure aggregation keys and AES-GCM nonces: secrets",
    "protocols.privacy.shamir": "Shamir share polynomials: secrets",
    "protocols.privacy.dp": "DP noise seeded from the OS in deployments (noise_seed = 'system'): a secret",
    "protocols.twin": "a node process's instance id: unique per process",
    "protocols.transport.broker": "a free port for a broker to listen on: never an input to a computation",
    "protocols.jobs": "an operator request's nonce, which the cloud's signed reply echoes: unique per request",
    "fedtier.pki": "CA and TLS keys: secrets",
    "fedtier.console": "the MQTT client id of a live watcher (monitor, fleet): unique",
    "sim.attacker": "garbage an attacker sends (tests and benchmarks): never trained on",
    "sim.lying_cell": "a lying cell's own key pairs (tests and benchmarks): secrets",
}

SEEDED_NUMPY = {"Generator", "SeedSequence", "PCG64", "PCG64DXSM", "Philox", "SFC64", "MT19937", "BitGenerator"}
TORCH_DRAWS = {"rand", "randn", "randint", "randperm", "normal", "bernoulli", "multinomial", "rand_like", "randn_like"}


def _dotted(node: ast.AST) -> str:
    """``np.random.rand`` for the expression ``np.random.rand`` ('' for anything but names and attributes)."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return f"{base}.{node.attr}" if base else ""
    return ""


def _tree(source: str | ast.AST) -> ast.AST:
    return ast.parse(source) if isinstance(source, str) else source


def unseeded_draws(source: str | ast.AST) -> list[str]:
    """The draws in ``source`` (text, or its parsed tree) that no seed decides, each as the call that makes it."""
    found = []
    for node in ast.walk(_tree(source)):
        if isinstance(node, ast.Call):
            name = _dotted(node.func)
            parts = name.split(".")
            seeded = bool(node.args) or any(k.arg in ("seed", "generator") for k in node.keywords)
            if name.startswith(("secrets.", "os.urandom", "uuid.uuid1", "uuid.uuid4")):
                found.append(name)
            elif len(parts) >= 2 and parts[-2] == "random" and parts[0] in ("np", "numpy"):
                if parts[-1] not in SEEDED_NUMPY and not (parts[-1] == "default_rng" and seeded):
                    found.append(name)
            elif parts[0] == "random" and len(parts) == 2 and not (parts[1] == "Random" and node.args):
                found.append(name)
            elif (
                parts[0] == "torch"
                and parts[-1] in TORCH_DRAWS
                and not any(k.arg == "generator" for k in node.keywords)
            ):
                found.append(name)
            elif parts[-1] in ("generate", "generate_private_key") and (
                parts[-1] == "generate_private_key" or parts[-2].endswith("PrivateKey")
            ):
                found.append(name)
    return found


def imported_picklers(source: str | ast.AST) -> list[str]:
    """The pickling modules ``source`` (text, or its parsed tree) imports."""
    found = []
    for node in ast.walk(_tree(source)):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] in PICKLERS]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in PICKLERS:
            found.append(node.module)
    return found


def product_modules() -> dict[str, ast.AST]:
    """Every product module's dotted name -> its parsed source (conftest.product_trees: parsed once a session)."""
    return {
        ".".join(Path(where).with_suffix("").parts).removesuffix(".__init__"): tree for where, tree in product_trees()
    }


def _allowed(module: str, prefixes: dict[str, str]) -> bool:
    return any(module == p or module.startswith(p) for p in prefixes)


def test_nothing_in_the_product_unpickles_except_one_local_dataset_file() -> None:
    users = {m: imported_picklers(src) for m, src in product_modules().items()}
    users = {m: found for m, found in users.items() if found}
    assert {m: f for m, f in users.items() if not _allowed(m, MAY_UNPICKLE)} == {}, "never pickle: use tensors/v1"
    assert set(users) == set(MAY_UNPICKLE), "MAY_UNPICKLE lists only modules that still need it"


def test_every_random_draw_is_seeded_except_secrets_and_unique_ids() -> None:
    draws = {m: unseeded_draws(src) for m, src in product_modules().items()}
    draws = {m: found for m, found in draws.items() if found}
    stray = {m: found for m, found in draws.items() if not _allowed(m, MAY_DRAW_UNSEEDED)}
    assert stray == {}, "draw from protocols.seeding (keyed by the run seed and the purpose), or say why it is a secret"
    unused = [p for p in MAY_DRAW_UNSEEDED if not any(_allowed(m, {p: ""}) for m in draws)]
    assert unused == [], "MAY_DRAW_UNSEEDED lists only modules that still draw"


def test_the_scanners_see_what_they_look_for() -> None:
    draws = unseeded_draws(
        "import numpy as np, random, torch\n"
        "a = np.random.rand(3); b = np.random.default_rng(); c = random.random(); d = torch.randn(3)\n"
        "e = secrets.token_hex(8); f = Ed25519PrivateKey.generate()\n"
        "ok = [np.random.default_rng(7), np.random.Generator(np.random.PCG64(1)), torch.randn(3, generator=g),\n"
        "      random.Random(5), rng(seed, 'purpose').normal(size=3), np.random.SeedSequence([1, 2])]\n"
    )
    assert draws == [
        "np.random.rand",
        "np.random.default_rng",
        "random.random",
        "torch.randn",
        "secrets.token_hex",
        "Ed25519PrivateKey.generate",
    ]
    assert imported_picklers("import pickle\nfrom cloudpickle import dumps\nimport json\n") == ["pickle", "cloudpickle"]
