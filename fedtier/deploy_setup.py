"""What every deployment command (``fedtier cloud|cell|agent``) does before it runs its node: refuse an
unsigned deployment, check the keys file, read the broker options and the model's geometry; fail with an
exit status."""

from __future__ import annotations

from typing import NoReturn

from .console import console


def require_signed(cfg, insecure: bool) -> None:
    """Refuse (exit 2, saying why) to run an unsigned deployment node unless ``--insecure``; warn when it is."""
    if cfg.security.keys is not None:
        return
    if not insecure:
        fail_with(
            ValueError(
                "unsigned deployment refused: the config has no [security] keys, so nothing this node sends "
                "or receives is signed and any client the broker admits could forge the cloud's, a cell's or "
                "a device's messages. Give --keys FILE (fedtier keys; fedtier provision writes one per "
                "bundle), or --insecure to run unsigned anyway (a test bed only)"
            ),
            2,
        )
    import logging

    logging.getLogger("fedtier").warning("--insecure: running unsigned; any broker client can forge messages")


def check_keys(cfg, node: str) -> None:
    """With [security] keys: fail now (exit 2) if the file lacks what ``node`` needs."""
    from protocols.wire.keys import node_trust

    node_trust(cfg, node)


def broker_options(cfg, broker_url, auth):
    """The broker to connect to: the config's ``[broker]``, ``--broker`` and the credential flags over it."""
    from edge_agent.runner import BrokerOptions

    return BrokerOptions.from_config(cfg, broker_url, **auth)


def spec_and_data(cfg, source=None):
    """``(model spec, data of source or None)``: the model's geometry from the data source when it records
    it, else from the config's dataset name (known without loading the dataset)."""
    from sim.datasets import dataset_geometry

    shape, classes = dataset_geometry(cfg.data.dataset, **cfg.data.loader_params())
    data = None
    if source is not None:
        from edge_agent.runner import load_device_data

        data, own_shape, own_classes = load_device_data(source, input_shape=shape)
        shape, classes = own_shape or shape, own_classes or classes
    return cfg.model_spec(shape, classes), data


def fail_with(exc: Exception, code: int) -> NoReturn:
    """Print ``exc`` as the error and exit with ``code``."""
    console.print(f"[bold red]error:[/] {exc}")
    raise SystemExit(code)
