"""Train your own model with a found plan: `python -m hetsim.search.train` and the `prepare` API."""

from __future__ import annotations

from hetsim.search.train.api import Prepared, prepare

__all__ = ["Prepared", "prepare"]
