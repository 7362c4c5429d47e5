"""The strategy registry.

Built-in families live one module each in this package and register themselves
with `@register`; third-party strategies come in through the entry-point group
`hetsim.strategies` (each entry point names a module or a Strategy class).
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any

from hetsim.errors import ConfigError, UnknownNameError
from hetsim.serial import from_dict

from .base import Executor, Plan, SearchContext, Strategy, WorkerContext

__all__ = [
    "Executor",
    "Plan",
    "SearchContext",
    "Strategy",
    "WorkerContext",
    "get",
    "names",
    "plan_from_dict",
    "register",
]

_REGISTRY: dict[str, Strategy] = {}
_loaded = False
ENTRY_POINT_GROUP = "hetsim.strategies"
NOT_FAMILIES = frozenset({"base", "helpers", "rank"})
"""Modules of this package that define no family: the contract, the shared helpers, the per-rank entry point."""


def register(cls: type[Strategy]) -> type[Strategy]:
    """Class decorator: `@register class DDP(Strategy): name = "ddp"`."""
    name = getattr(cls, "name", None)
    if not name:
        raise TypeError(f"{cls.__name__} has no `name`")
    if name in _REGISTRY and type(_REGISTRY[name]) is not cls:
        raise ValueError(f"strategy {name!r} is registered twice ({type(_REGISTRY[name]).__name__}, {cls.__name__})")
    _REGISTRY[name] = cls()
    return cls


def _load() -> None:
    global _loaded
    if _loaded:
        return
    _loaded = True
    for mod in pkgutil.iter_modules(__path__):
        if not mod.name.startswith("_") and mod.name not in NOT_FAMILIES:
            importlib.import_module(f"{__name__}.{mod.name}")
    from importlib.metadata import entry_points

    for ep in entry_points(group=ENTRY_POINT_GROUP):
        obj = ep.load()
        if isinstance(obj, type) and issubclass(obj, Strategy) and obj.name not in _REGISTRY:
            register(obj)


def names() -> list[str]:
    _load()
    return sorted(_REGISTRY)


def get(name: str) -> Strategy:
    _load()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise UnknownNameError("strategy", name, list(_REGISTRY)) from None


def plan_from_dict(data: dict[str, Any]) -> Plan:
    if not isinstance(data, dict) or "strategy" not in data:
        raise ConfigError(f"a plan must be an object with a 'strategy' field, got {data!r}")
    strat = get(data["strategy"])
    return from_dict(strat.plan_type, data)
