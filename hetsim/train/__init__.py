"""Train your own model with a found plan: `python -m hetsim.train` and the `prepare` API."""
