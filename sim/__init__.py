"""Simulation: datasets, partitioners, participation models, and the hierarchy launcher."""
