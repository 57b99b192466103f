"""The whole run configuration (:class:`RunConfig`): its sections, and what a run derives from them (the
algorithm stack, deadlines, secure aggregation and DP settings); its TOML form and its deployment form."""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import Field, ValidationError

from .. import directions, plugins
from ..algorithms import get_algorithm
from ..algorithms.base import Algorithm, ModelSpec, TrainParams
from ..algorithms.compose import Wrapper, check_layers, compose, needs
from ..algorithms.traits import Trait
from ..limits import MAX_MESSAGE_BYTES, memory_refusal
from ..trainer import num_steps
from ..wire.payload import MAX_META_BYTES
from .errors import ConfigError, format_errors, shown
from .privacy import PrivacySection, calibrated_noise
from .runtime import RuntimeSection
from .sections import (
    AttackSection,
    BrokerSection,
    ClockSection,
    DataSection,
    ModelSection,
    MonitoringSection,
    ParticipationSection,
    RequirementsSection,
    RunSection,
    Section,
    SecuritySection,
)
from .toml_io import dump_toml
from .topology import TopologySection

MODEL_ENVELOPE_BYTES = 1024
"""What a model message holds besides its float32 parameters, at most for the zoo's models (its signed header and
tensor table: 423 to 525 bytes measured), with room for a role's metadata."""

if TYPE_CHECKING:
    import numpy as np

    from ..privacy.accountant import Accountant


class RunConfig(Section):
    run: RunSection = RunSection()
    topology: TopologySection = TopologySection()
    algorithm: dict[str, Any] = Field(default_factory=lambda: {"name": "fedavg"})
    model: ModelSection = ModelSection()
    data: DataSection = DataSection()
    participation: ParticipationSection = ParticipationSection()
    runtime: RuntimeSection = RuntimeSection()
    clock: ClockSection = ClockSection()
    attack: AttackSection = AttackSection()
    broker: BrokerSection = BrokerSection()
    security: SecuritySection = SecuritySection()
    monitoring: MonitoringSection = MonitoringSection()
    privacy: PrivacySection = PrivacySection()
    requirements: RequirementsSection = RequirementsSection()

    @property
    def train(self) -> TrainParams:
        """The validated algorithm parameters."""
        return validate_algorithm(self.algorithm)

    def output_dir(self) -> Path:
        return Path(self.run.output.format(name=self.run.name))

    def cell_deadline(self) -> float:
        if self.runtime.cell_deadline is not None:
            return self.runtime.cell_deadline
        rejoin = self.runtime.rejoin_wait if self.participation.model != "always" else 0.0
        unmasking = self.secagg_deadline() if self.privacy.secure_aggregation else 0.0
        return self.train.edge_rounds * (self.runtime.device_deadline + unmasking) * 1.5 + 10 + rejoin

    def secagg_deadline(self) -> float:
        """Seconds each extra phase of secure aggregation waits (``privacy.secagg_deadline``)."""
        return self.privacy.secagg_deadline or self.runtime.device_deadline / 4

    def to_toml(self, exclude: tuple[str, ...] = ()) -> str:
        """The config as TOML (written to each run's output folder), without the ``exclude`` sections."""
        data = self.model_dump(mode="json", exclude_none=True, exclude=set(exclude))
        if "algorithm" not in exclude:
            data["algorithm"] = self.train.model_dump(mode="json")
        return dump_toml(data)

    def model_spec(self, input_shape: tuple[int, ...], num_classes: int) -> ModelSpec:
        """The zoo model of this run for data of ``input_shape`` and ``num_classes``."""
        m = self.model
        side = {"cnn": 4, "cnn4": 16}.get(m.name)  # pools 2 or 4 times
        if side and (len(input_shape) not in (2, 3) or min(input_shape[-2:]) < side):
            raise ConfigError(
                f"model.name: {m.name} pools {side.bit_length() - 1} times and needs images of at least "
                f"{side}x{side}; {self.data.dataset} has {'x'.join(map(str, input_shape))}"
            )
        spec = ModelSpec(
            name=m.name,
            input_shape=tuple(input_shape),
            num_classes=num_classes,
            hidden=m.hidden,
            channels=m.channels,
            fc=m.fc,
            init_std=m.init_std,
        )
        if m.name not in plugins.MODELS:  # the zoo's are counted without building them (a plugin's is built)
            n = spec.num_params()
            why = memory_refusal(2 * 4 * n, f"model: {m.name} has {n:,} parameters, which with their gradients")
            if why is not None:
                raise ConfigError(why + " (make model.hidden, model.channels or model.fc smaller)")
        return spec

    def secagg_settings(self) -> Any:
        """The ``SecAggSettings`` of ``[privacy]`` when secure aggregation is on, else ``None``."""
        if not self.privacy.secure_aggregation:
            return None
        from ..privacy.secagg import SecAggSettings

        p = self.privacy
        return SecAggSettings(
            seed=self.run.seed,
            threshold=p.secagg_threshold,
            neighbours=p.secagg_neighbours,
            bound=p.secagg_bound,
            min_survivors=self.dp_noise_shares() or 0,
        )

    def dp_noise_shares(self) -> int | None:
        """Cell DP under secure aggregation: the survivors m among whom the cell's noise is split (each
        device adds variance (z clip)^2 / m; no sum of fewer than m is unmasked); otherwise None."""
        p = self.privacy
        if p.dp != "cell" or not p.secure_aggregation:
            return None
        if p.dp_min_survivors:
            return p.dp_min_survivors
        n, f = self.topology.devices_per_cell, self.participation_fraction()
        if f is None:
            raise ConfigError(
                f"privacy.dp_min_survivors: set it for participation.model = {self.participation.model!r} "
                "(the survivors a cell's sum must have; fedtier cannot tell from a trace)"
            )
        # what the participation model lets survive: the expected participants less two standard deviations of
        # a random draw, of whom 70% (secure aggregation's 30% dropout after sharing)
        spread = 2 * math.sqrt(n * f * (1 - f))  # a cell's share of a seeded draw varies (binomial-like)
        return max(1, math.floor(0.7 * (n * f - spread) + 1e-9))

    def max_message_bytes(self, spec: ModelSpec) -> int:
        """``runtime.max_message_bytes``, or its default from the model's size."""
        return self.runtime.max_message_bytes or 8 * 4 * spec.num_params() + 4 * 1024 * 1024

    def x0_origin(self) -> dict[str, Any]:
        """What fixes the run's initial parameters x_0 besides its model spec: the seed they are drawn with
        (``model.init_seed``, else ``run.seed``) and the sha256 of the model the run starts from (``run.init_model``,
        ``[job] init_from``; ``"unknown"`` for a file without its digest)."""
        seed = self.model.init_seed if self.model.init_seed is not None else self.run.seed
        start = self.run.init_model_sha256 or ("unknown" if self.run.init_model else None)
        return {"init_seed": seed, "init_model_sha256": start}

    def build_algorithm(self, spec: ModelSpec) -> Algorithm:
        """The algorithm stack of this run, ready to build its roles (``protocols.algorithms.compose``)."""
        wrappers: list[Wrapper] = []
        digest = self.run.init_model_sha256
        if digest is not None and not self.run.init_model:
            raise ConfigError(
                f"the run starts from the model with sha256 {digest[:16]}...: this node has no run.init_model"
            )
        if self.run.init_model:
            wrappers.append(functools.partial(_start_from, self.run.init_model, digest))
        if self.privacy.dp != "off":
            wrappers.append(self._private)
        for why in (self.cohort_refusal(), self.message_refusal(spec)):
            if why is not None:
                raise ConfigError(why)
        topo = self.topology
        directions.set_draw_threads(self.runtime.direction_threads)  # process-wide, as the draws' cache is
        init_seed = self.x0_origin()["init_seed"]
        try:
            algorithm = compose(
                self.train,
                spec,
                seed=self.run.seed,
                init_seed=init_seed,
                cells={c: topo.devices(c) for c in topo.cell_ids()},
                rounds=self.run.rounds,
                wrappers=wrappers,
            )
        except ConfigError:
            raise
        except ValueError as exc:  # the parameters do not fit the topology (the message names the key)
            raise ConfigError(str(exc)) from None
        if (why := self.growing_message_refusal(algorithm)) is not None:
            raise ConfigError(why)
        return algorithm

    def growing_message_refusal(self, algorithm: Algorithm) -> str | None:
        """Why the largest message that grows with the run (``Algorithm.largest_message``: DeComFL's task carrying
        the whole log) would not fit ``runtime.max_message_bytes`` or the codec's metadata bound, naming both figures
        and the fix; else ``None``. The node it was sent to refused it, said so in its own log, and the round went
        on without it (a device never caught up; a cell never answered, and the job stalled)."""
        largest = algorithm.largest_message()
        if largest is None:
            return None
        size, meta, what = largest
        if meta > MAX_META_BYTES:
            return (
                f"{what}: its metadata would be {meta:,} bytes, more than the {MAX_META_BYTES:,} a message may carry: "
                "spread the devices over more cells (topology)"
            )
        bound, need = self.max_message_bytes(algorithm.model), size + MODEL_ENVELOPE_BYTES
        if need <= bound:
            return None
        key = f"runtime.max_message_bytes = {bound:,}" + ("" if self.runtime.max_message_bytes else " (its default)")
        fix = f"raise it to at least {need:,}, or" if need <= MAX_MESSAGE_BYTES else f"(at most {MAX_MESSAGE_BYTES:,})"
        return f"{key} cannot hold {what} (~{need:,} bytes): {fix} set fewer run.rounds"

    def message_refusal(self, spec: ModelSpec) -> str | None:
        """Why ``runtime.max_message_bytes`` cannot hold one of the run's model messages, else ``None``. Tasks
        carry the model, or HIST's a cell's submodel, as float32, 4 bytes a value, in an envelope of a few hundred
        bytes (``Algorithm.model_message_params``; DeComFL's carry seeds and scalars); a node refused the larger
        message, so each round failed and the job ended "no cell answered"."""
        bound = self.runtime.max_message_bytes
        values = get_algorithm(self.train.name).model_message_params(spec, len(self.topology.cell_ids()))
        if bound is None or not values or bound >= 4 * values + MODEL_ENVELOPE_BYTES:
            return None
        n, name, need = spec.num_params(), self.train.name, 4 * values + MODEL_ENVELOPE_BYTES
        what = f"model {spec.name} of {n:,} parameters" + (f", {values:,} in {name}'s task" if values != n else "")
        return (
            f"runtime.max_message_bytes = {bound:,} is smaller than one model message (~{need:,} bytes for {what}, "
            f"which {name}'s tasks carry): raise it or leave it unset (8 x the model's size + 4 MiB)"
        )

    def cohort_refusal(self, memory: int | None = None, samples: int | None = None) -> str | None:
        """Why a cohort's minibatches would not fit ``memory`` (default: this machine's), else ``None``. The cohort
        engine draws every step's minibatch of each device of a cohort at once (``cohort_device``: the index
        batches; ``cohort_batches.minibatches``: their indices and masks, ``[D, S, B]``): about
        ``cohort_size x steps x (20 x batch_size + 128)`` bytes a call (measured: 384 bytes a step of 32 for
        the index batches alone), for devices that train by SGD. The steps are ``local_steps``, or with
        ``local_epochs`` those of the device with the most ``samples`` (``trainer.num_steps``: epochs x
        ceil(samples / batch_size)), checked once the data is partitioned (``sim.hierarchy.prepare``; None: not
        known yet, epochs unchecked)."""
        t, rt = self.train, self.runtime
        if rt.engine != "cohort" or needs(t, Trait.FORWARD_ONLY) is None or not (t.local_steps or samples):
            return None
        cohort = min(rt.cohort_size, len(self.topology.devices()))
        steps = num_steps(samples or 0, t.batch_size, t.local_steps, t.local_epochs)
        need = cohort * steps * (20 * t.batch_size + 128)
        key = (
            "algorithm.local_steps"
            if t.local_steps
            else f"algorithm.local_epochs: {t.local_epochs:,.10g} epochs of a device's {samples:,} samples, that is"
        )
        what = (
            f"{key}: {steps:,} minibatches of {t.batch_size} samples drawn at once for each "
            f'of a cohort\'s {cohort} devices (runtime.engine = "cohort", runtime.cohort_size)'
        )
        return memory_refusal(need, what, memory)

    def _private(self, algorithm: Algorithm) -> Algorithm:
        """``algorithm`` wrapped for this run's differential privacy."""
        from ..privacy.dp import DpSettings, PrivateAlgorithm

        pv, accountant = self.privacy, self.dp_accountant()
        assert pv.dp != "off"  # build_algorithm wraps only then
        dp = DpSettings(
            pv.dp,
            pv.clip,
            accountant.noise_multiplier,
            self.run.seed if pv.noise_seed is None else pv.noise_seed,
            self.dp_noise_shares(),
        )
        return PrivateAlgorithm(algorithm, dp, accountant, pv.epsilon_budget)

    def participation_fraction(self) -> float | None:
        """The fraction of a cell's devices that take part in a round on average, from the participation
        model (``None``: a trace, unknown here). Cell-level participation keeps whole cells: 1."""
        p, n = self.participation, self.topology.cells * self.topology.devices_per_cell
        if p.model == "always" or p.level == "cell":
            return 1.0
        if p.model in ("uniform", "permutation") and p.per_round:
            return min(1.0, p.per_round / n)
        if p.model == "bernoulli":
            return float(p.prob if p.prob is not None else sum(p.probs or [1.0]) / len(p.probs or [1.0]))
        if p.model == "cyclic" and p.groups:
            return min(1.0, p.per_round / n if p.per_round else (p.active or 1) / p.groups)
        if p.model == "markov" and p.p_on is not None and p.p_off is not None and p.p_on + p.p_off > 0:
            return p.p_on / (p.p_on + p.p_off)
        return None if p.model == "trace" else 1.0

    def dp_accountant(self) -> Accountant:
        """The accountant of this run's ``[privacy]`` (dp must be on); ``target_epsilon`` calibrated to z."""
        from ..privacy.accountant import Accountant

        pv = self.privacy
        if pv.dp == "off":
            raise ConfigError("privacy.dp is off: there is nothing to account")
        e = self.train.edge_rounds
        if pv.noise_multiplier is not None:
            z = pv.noise_multiplier
        else:
            assert pv.target_epsilon is not None  # the section's validator requires one of the two
            z = calibrated_noise(pv.target_epsilon, self.run.rounds, pv.dp, 1.0, e, pv.delta)
        # participation comes from run.seed or availability and is named in records: q = 1, replace-one
        return Accountant(
            pv.dp,
            z,
            1.0,
            e,
            pv.delta,
            known_participation=True,
            cell_sees_updates=pv.dp == "cell" and not pv.secure_aggregation,
        )


def _initial_model(
    path: str, digest: str | None, seeded: Callable[[], dict[str, np.ndarray]]
) -> Callable[[], dict[str, np.ndarray]]:
    """``initial_params`` returning the model in ``path`` (a copy each call), checked now against ``digest``
    (its sha256, when given) and the names, shapes and dtypes of the seeded initial model; :class:`ConfigError`
    says what differs."""
    import numpy as np

    from ..checkpoint import load_params

    try:
        loaded = load_params(path, digest)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"run.init_model: cannot use {path}: {exc}") from None
    expected = seeded()
    if set(loaded) != set(expected):
        raise ConfigError(
            f"run.init_model: {path} has parameters {sorted(loaded)[:4]}..., the model has {sorted(expected)[:4]}..."
        )
    for name, value in expected.items():
        if loaded[name].shape != value.shape or loaded[name].dtype != value.dtype:
            raise ConfigError(
                f"run.init_model: {name} is {loaded[name].dtype}{list(loaded[name].shape)} in {path}, "
                f"the model's is {value.dtype}{list(value.shape)}"
            )
    return lambda: {name: np.array(value, copy=True) for name, value in loaded.items()}


def _start_from(path: str, digest: str | None, algorithm: Algorithm) -> Algorithm:
    """``algorithm`` starting from the model in ``path`` (``run.init_model``, whose sha256 is ``digest`` when
    given) instead of its seeded one."""
    algorithm.initial_params = _initial_model(path, digest, algorithm.initial_params)  # type: ignore[method-assign]  # the run's starting model
    return algorithm


def deployment_config(cfg: RunConfig) -> tuple[RunConfig, str | None]:
    """``cfg`` as a deployment runs it (``fedtier provision``, ``fedtier cloud|cell|agent``): DP noise drawn
    from the OS by each noising party (``privacy.noise_seed = "system"``), since every node's bundle holds
    ``run.seed``; unless the operator set an integer ``noise_seed``, which is kept, with the warning returned
    (who can then remove the noise). ``fedtier sim`` and ``run`` keep their reproducible seeds."""
    pv = cfg.privacy
    if pv.dp == "off" or pv.noise_seed == "system":
        return cfg, None
    if pv.noise_seed is None:
        return cfg.model_copy(update={"privacy": pv.model_copy(update={"noise_seed": "system"})}), None
    return cfg, (
        f"privacy.noise_seed = {pv.noise_seed}: the DP noise is reproducible, so anyone holding this config "
        f"(the operator, and every node whose bundle carries it) can regenerate the noise and subtract it; "
        f'epsilon then holds only against parties without the config (leave noise_seed out, or "system", '
        f"for noise drawn from the OS)"
    )


def validate_algorithm(section: dict[str, Any]) -> TrainParams:
    """The ``[algorithm]`` table validated against the named algorithm's ``Params`` and its layers."""
    name = section.get("name")
    if name is None:  # (--set algorithm.lr=0.05 on a config without [algorithm] makes one of lr alone)
        raise ConfigError(
            'algorithm.name: required once [algorithm] (or --set algorithm.KEY) sets a key (e.g. name = "fedavg", '
            "which a config without [algorithm] runs)"
        )
    if not isinstance(name, str):
        raise ConfigError(f'algorithm.name = {shown(name)}: must be an algorithm\'s name (e.g. "fedavg")')
    try:
        cls = get_algorithm(name)
    except ValueError as exc:
        raise ConfigError(f"algorithm.name: {exc}") from None
    try:
        params = cls.Params.model_validate(section)
    except ValidationError as exc:
        raise ConfigError(format_errors(exc, "algorithm", cls.Params)) from None
    refused = check_layers(params)
    if refused is not None:
        raise ConfigError(f"algorithm: {refused}")
    idle = [
        f"algorithm.{key} = {json.dumps(value)} has no effect without {needs}"
        for key, (value, needs) in params.idle_settings().items()
    ]
    if idle:
        raise ConfigError("; ".join(idle) + " (remove it, or set what it needs)")
    return params
