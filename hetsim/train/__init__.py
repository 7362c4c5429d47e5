"""Train your own model with a found plan: `python -m hetsim.train` and the `prepare` API."""

from __future__ import annotations

from hetsim.train.api import Prepared, prepare

__all__ = ["Prepared", "prepare"]
