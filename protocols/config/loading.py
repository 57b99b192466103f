"""Reading a config: TOML file -> overrides -> plugins -> sections -> the checks across sections."""

from __future__ import annotations

import math
import tomllib
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from .. import plugins
from ..algorithms import ALGORITHMS
from ..algorithms.compose import needs
from ..algorithms.traits import Trait
from ..limits import MAX_SECONDS, MAX_TEXT_BYTES, read_file
from ..plugin_loading import load_plugins
from .errors import ConfigError, format_errors
from .run import RunConfig
from .toml_io import apply_override, parse_toml


def parse_config(data: dict[str, Any]) -> RunConfig:
    """Validate a config dict; raise :class:`ConfigError` naming every bad key. Loads the installed plugins
    and ``run.plugins`` first, so the names they register validate."""
    run = data.get("run") if isinstance(data, dict) else None
    modules = run.get("plugins", []) if isinstance(run, dict) else []
    if not isinstance(modules, list) or not all(isinstance(m, str) for m in modules):
        raise ConfigError(f"run.plugins: a list of module names, not {modules!r:.60}")  # "abc": 3 imports
    if isinstance(data, dict) and "job" in data:  # was "job: unknown key": say what the file is
        raise ConfigError(
            "job: a [job] section makes this a job file, for a federation: `fedtier submit FILE --config "
            "config.toml` from the operator bundle queues it; fedtier sim, run and the nodes take a run config "
            "(without [job])"
        )
    try:
        load_plugins(modules)
    except plugins.PluginError as exc:
        raise ConfigError(str(exc)) from None
    try:
        cfg = RunConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(format_errors(exc, model=RunConfig)) from None
    train = cfg.train  # validates the algorithm section
    if cfg.privacy.secure_aggregation:
        from ..privacy.secagg import refusal

        reason = refusal(train)
        if reason is not None:
            raise ConfigError(f"privacy.secure_aggregation: {reason}")
    check_privacy(cfg)
    check_participation(cfg)
    if cfg.runtime.min_cells > cfg.topology.cells:  # was read as "every cell": say so instead
        raise ConfigError(
            f"runtime.min_cells: {cfg.runtime.min_cells}, but the topology has {cfg.topology.cells} cells"
        )
    if cfg.runtime.cell_deadline is None and cfg.cell_deadline() > MAX_SECONDS:
        raise ConfigError(
            f"runtime.cell_deadline: unset, it is {cfg.cell_deadline():.4g} s (1.5 x algorithm.edge_rounds x "
            f"runtime.device_deadline, and more), beyond {MAX_SECONDS:.0e} s; set it, or shorten those"
        )
    if cfg.runtime.onnx_devices:
        check_forward_only(cfg, "runtime.onnx_devices")
    return cfg


def check_participation(cfg: RunConfig) -> None:
    """Refuse a participation under which the run can never progress, naming its keys."""
    p = cfg.participation
    if (p.model == "bernoulli" and p.probs and not any(p.probs)) or (
        p.model == "markov" and p.p_on == 0 and not p.start_on
    ):
        raise ConfigError(  # the run would "finish" having trained nothing, exit 0
            f"participation: with model = {p.model!r} as set, no device (or cell) would ever take part"
        )
    if p.model != "always" and p.level == "device" and needs(cfg.train, Trait.ASYNC) is None:
        raise ConfigError(  # (cell_server.async_server: availability(cloud version); cloud.async_server: _notify)
            f'participation: model = {p.model!r} at level = "device" with algorithm.mode = "async": devices are '
            "drawn per cloud version, and a cell none of whose devices is drawn pushes nothing, so it is sent no "
            "newer version and its devices never work again; once every cell is so, no version comes and the run "
            'hangs. Use level = "cell" (whole cells drawn per version), or model = "always"'
        )


def check_forward_only(cfg: RunConfig, what: str) -> None:
    """Refuse forward-only devices (onnxruntime: ``what`` asks for them) under an algorithm whose devices take
    gradients: every task of theirs would fail (e.g. "OnnxTrainer cannot run SGD"), round after round."""
    why = needs(cfg.train, Trait.FORWARD_ONLY)
    if why is not None:
        have = ", ".join(name for name, c in sorted(ALGORITHMS.items()) if Trait.FORWARD_ONLY in c.traits)
        raise ConfigError(
            f"{what}: forward-only (onnxruntime) devices need an algorithm whose devices only run forward passes "
            f"({have or 'none'}), not {cfg.train.name!r}: {why}"
        )


def load_config(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Read a TOML config and apply ``key.path=value`` overrides (values parsed as TOML)."""
    path = Path(path)
    try:
        data = parse_toml(read_file(path, MAX_TEXT_BYTES).decode("utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    except (OSError, ValueError) as exc:  # a folder, /dev/zero, a FIFO, 1 GB, no permission
        raise ConfigError(f"config file {path}: cannot read it: {exc}") from None
    for item in overrides:
        apply_override(data, item)
    try:
        return parse_config(data)
    except ConfigError as exc:  # which file (and flags) the keys it names are in
        exc.args = (f"{path}{''.join(f' --set {o}' for o in overrides)}: {exc}",)
        raise


def check_privacy(cfg: RunConfig) -> None:
    """Refuse ``[privacy]`` settings the run cannot honour, naming the key; with ``on_budget = "refuse"``,
    a run whose ``run.rounds`` would spend more than ``epsilon_budget``."""
    pv, train = cfg.privacy, cfg.train
    if pv.dp == "off":
        return
    for trait in (Trait.CELL_SUM, Trait.CLOUD_SUM):  # the accountant's mechanism: a clipped, noised sum
        why = needs(train, trait)
        if why is not None:
            raise ConfigError(
                "privacy.dp: differential privacy needs cells and a cloud that sum dense model deltas (the "
                f"accountant's mechanism is a clipped, noised sum), not {train.name!r} as configured: {why}"
            )
    shares = cfg.dp_noise_shares()
    if pv.secure_aggregation:
        # each coordinate a device sends is at most clip plus its noise; secure aggregation clips it to
        # +-secagg_bound before quantising: the bound must leave the noise whole (6 standard deviations),
        # or the sum carries less noise than epsilon assumes
        z = cfg.dp_accountant().noise_multiplier
        std = z * pv.clip / (math.sqrt(shares) if shares else 1.0)
        need = pv.clip + 6 * std
        if pv.secagg_bound < need:
            raise ConfigError(
                f"privacy.secagg_bound: {pv.secagg_bound:g} would cut the updates DP clipped to L2 norm {pv.clip:g} "
                f"or their noise (std {std:.4g} per value): quantisation would remove noise that epsilon counts "
                f"on; set secagg_bound >= clip + 6 x std = {need:.4g}"
            )
    if shares is not None and shares > cfg.topology.devices_per_cell:
        raise ConfigError(
            f"privacy.dp_min_survivors: {shares} survivors can never be reached in cells of "
            f"{cfg.topology.devices_per_cell} devices"
        )
    if pv.epsilon_budget is not None and pv.on_budget == "refuse":
        acc = cfg.dp_accountant()
        spent = acc.epsilon(cfg.run.rounds)
        if spent > pv.epsilon_budget:
            fit = acc.max_rounds(pv.epsilon_budget, cfg.run.rounds)
            what = (
                f'{fit} rounds fit (set run.rounds = {fit}, more noise, or privacy.on_budget = "stop")'
                if fit
                else "not one round fits (more noise: a larger noise_multiplier or a smaller target_epsilon)"
            )
            raise ConfigError(
                f"privacy.epsilon_budget: {cfg.run.rounds} rounds would spend epsilon {spent:.4g} > "
                f"{pv.epsilon_budget:g} (delta {pv.delta:g}); {what}"
            )
