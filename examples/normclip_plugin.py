"""Registers the example algorithm of examples/normclip.py when imported: a ``[run] plugins`` module.

    PYTHONPATH=. fedtier sim examples/quickstart.toml --set 'run.plugins=["examples.normclip_plugin"]' \\
        --set algorithm.name=normclip

(An installed package would declare a ``fedtier.algorithms`` entry point instead; see protocols/plugins.py.)
"""

from examples.normclip import NormClip
from protocols.algorithms import register

register(NormClip)
