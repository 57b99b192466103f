"""The run configuration: one TOML file, validated with pydantic; every error names its key.

Sections: ``[run]``, ``[topology]``, ``[algorithm]`` (``name`` plus that algorithm's parameters),
``[model]``, ``[data]``, ``[participation]``, ``[runtime]``, ``[broker]``, ``[security]``, ``[privacy]``. Unknown
keys are errors.

The modules: :mod:`.sections` (most sections), :mod:`.topology`, :mod:`.runtime` and :mod:`.privacy` (those
sections), :mod:`.run` (:class:`RunConfig`: the whole config and what a run derives from it), :mod:`.loading` (file
-> validated config, with the checks across sections), :mod:`.toml_io` (overrides and the TOML writer),
:mod:`.errors`. This package exports what the rest of the project uses.
"""

from .errors import ConfigError, UnusableFile, public_reason, shown
from .loading import check_forward_only, load_config, parse_config
from .run import RunConfig, deployment_config
from .sections import AttackSection, ClockSection, RequirementsSection, RunSection
from .toml_io import dump_toml, parse_toml
from .topology import DeviceIds, TopologySection

__all__ = [
    "AttackSection",
    "ClockSection",
    "ConfigError",
    "DeviceIds",
    "RequirementsSection",
    "RunConfig",
    "RunSection",
    "TopologySection",
    "UnusableFile",
    "check_forward_only",
    "deployment_config",
    "dump_toml",
    "load_config",
    "parse_config",
    "parse_toml",
    "public_reason",
    "shown",
]
