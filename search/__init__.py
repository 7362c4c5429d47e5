"""The Optuna search over every registered strategy, and the CLI (`python -m hetsim.search`)."""
