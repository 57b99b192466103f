"""The cohort engine of ``fedtier sim``: it lives in ``edge_agent/cohort.py`` (``fedtier run``'s agent
workers use it too); these names are kept for existing imports."""

from edge_agent.cohort import CohortExecutor, cohort_engine, cohorts, run_cohort

__all__ = ["CohortExecutor", "cohort_engine", "cohorts", "run_cohort"]
