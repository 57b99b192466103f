"""Cloud runtime: round orchestration, evaluation, checkpoints."""
