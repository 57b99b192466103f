"""What every deployment command (``fedtier cloud|cell|agent``) shares before it runs its node: the
``--broker`` and ``--insecure`` flags; refuse an unsigned deployment, check the keys file, read the broker
options and the model's geometry; fail with an exit status."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, overload

import click

from protocols.config import RunConfig

from .console import load_deployment_or_exit, print_error

if TYPE_CHECKING:
    from edge_agent.broker import BrokerOptions
    from edge_agent.datasources import DataSource
    from protocols.algorithms.base import ModelSpec
    from protocols.trainer import LocalData


Auth = dict[str, Any]
"""The broker credential flags (``auth_options``) as the commands get them."""

BROKER = click.option(
    "--broker", "broker_url", metavar="mqtt://HOST:PORT", help="The broker (default: the config's [broker] url)."
)


INSECURE = click.option(
    "--insecure",
    is_flag=True,
    help="Run without [security] keys: nothing signed, so anyone the broker lets publish can forge the "
    "cloud's, a cell's or a device's messages (a test bed only).",
)


def require_signed(cfg: RunConfig, insecure: bool) -> None:
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


def require_serve(cfg: RunConfig, serve: bool, command: str) -> None:
    """Refuse (exit 2) to run one job's node from a federation's bundle (``security.membership = "roster"``, which
    ``fedtier provision --federation`` writes into every bundle) without ``--serve``: the bundle holds no training
    config, so the node would run the defaults' job (the mnist model) and take the serving node's broker session."""
    if serve or cfg.security.membership != "roster":
        return
    fail_with(
        ValueError(
            f"this config is a federation's bundle (security.membership = 'roster'): its {command} serves the jobs "
            f"the operator submits, each with its own config; start it with --serve (`fedtier {command} config.toml "
            "--serve ...`)"
        ),
        2,
    )


def node_config(path: str, overrides: tuple[str, ...], insecure: bool, serve: bool, command: str) -> RunConfig:
    """``fedtier cloud|cell|agent``'s config (``command``: which), refused unless signed (:func:`require_signed`)
    and, from a federation's bundle, unless ``--serve`` (:func:`require_serve`)."""
    cfg = load_deployment_or_exit(path, overrides)
    require_serve(cfg, serve, command)
    require_signed(cfg, insecure)
    if serve:  # a job's settings given to a long-lived node (`--set algorithm.lr=...`) were ignored without a word
        from .bundles import ignored_by_federation

        if ignored := ignored_by_federation(cfg, own=("runtime.onnx_model",)):
            print_error(
                f"{', '.join(ignored)} (its config or --set): ignored, a node started with --serve runs each job with "
                "the job's own settings (set them in the job file that `fedtier submit` sends)",
                "warning",
                "bold yellow",
            )
    return cfg


def check_keys(cfg: RunConfig, node: str) -> None:
    """With [security] keys: fail now (exit 2) if the file lacks what ``node`` needs."""
    from protocols.wire.keys import node_trust

    node_trust(cfg, node)


def broker_options(cfg: RunConfig, broker_url: str | None, auth: Mapping[str, Any]) -> BrokerOptions:
    """The broker to connect to: the config's ``[broker]``, ``--broker`` and the credential flags over it; its
    client certificate checked first (:func:`check_certificate`)."""
    from edge_agent.broker import BrokerOptions
    from protocols.config import ConfigError
    from protocols.transport.broker import parse_broker_url

    if broker_url is not None:
        try:
            parse_broker_url(broker_url)
        except ValueError as exc:
            raise ConfigError(f"--broker: {exc}") from None
    opts = BrokerOptions.from_config(cfg, broker_url, **auth)
    check_certificate(opts.certfile, opts.keyfile, opts.ca_certs, opts.username)
    return opts


def check_certificate(certfile: str | None, keyfile: str | None, ca_certs: str | None, username: str | None) -> None:
    """Raise ``ConfigError`` saying why a client certificate cannot work: unreadable, not its key's, expired or
    not yet valid, not signed by the CA file's CA (another provisioning's), or issued to another login than
    ``username`` (a broker that takes the certificate's name as the login would log this node in as that
    other node). A long-lived node would otherwise retry a broker that refuses it for ever."""
    from protocols.config import ConfigError
    from protocols.transport.tls_reload import check_material

    if not certfile or not keyfile:
        return
    try:
        check_material(certfile, keyfile, ca_certs)
    except ValueError as exc:
        raise ConfigError(f"broker client certificate: {exc}") from None
    if username:
        from cryptography import x509

        cert = x509.load_pem_x509_certificate(Path(certfile).read_bytes())
        names = [str(a.value) for a in cert.subject.get_attributes_for_oid(x509.NameOID.COMMON_NAME)]
        if names and username not in names:
            raise ConfigError(
                f"broker client certificate: {certfile} is issued to {names[0]!r}, but this node logs in as "
                f"{username!r}: copy this node's own bundle (client.crt, client.key)"
            )


@overload
def spec_and_data(cfg: RunConfig, source: None = None) -> tuple[ModelSpec, None]: ...
@overload
def spec_and_data(cfg: RunConfig, source: str | Path | DataSource) -> tuple[ModelSpec, LocalData]: ...


def spec_and_data(cfg: RunConfig, source: str | Path | DataSource | None = None) -> tuple[ModelSpec, LocalData | None]:
    """``(model spec, data of source or None)``: the model's geometry from the config's dataset name (known
    without loading the dataset), in the layout the data source records if it records one. Raises
    ``DataSourceError`` (a ``ConfigError``) for data another model would need: other features per sample,
    other classes, or a label the model has no output for (every node must build the job's one model)."""
    import math

    from edge_agent.datasources import DataSourceError
    from sim.datasets import dataset_geometry

    shape, classes = dataset_geometry(cfg.data.dataset, **cfg.data.loader_params())
    data: LocalData | None = None
    if source is not None:
        from edge_agent.runner import load_device_data

        data, own_shape, own_classes = load_device_data(source, input_shape=shape)
        where, wanted = getattr(source, "path", source), f"{cfg.data.dataset}: {'x'.join(map(str, shape))}"
        if own_shape is not None and math.prod(own_shape) != math.prod(shape):
            raise DataSourceError(
                f"{where}: samples of {'x'.join(map(str, own_shape))}, but the job's model takes {wanted}"
            )
        if own_classes is not None and own_classes != classes:
            raise DataSourceError(
                f"{where}: {own_classes} classes, but the job's model ({cfg.data.dataset}) has {classes}"
            )
        shape = own_shape or shape
        if len(data.y) and int(data.y.max()) >= classes:  # the model's last layer has no output for it
            raise DataSourceError(f"{where}: label {int(data.y.max())}, but the model has {classes} classes")
    return cfg.model_spec(shape, classes), data


def fail_with(exc: Exception, code: int) -> NoReturn:
    """Print ``exc`` as the error and exit with ``code``."""
    print_error(exc)
    raise SystemExit(code)
