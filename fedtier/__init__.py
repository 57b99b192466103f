"""fedtier: federated learning for device -> cell -> cloud hierarchies."""

__version__ = "0.1.0"
