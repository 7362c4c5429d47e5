"""JSON round-trip for the frozen dataclasses that cross module boundaries.

`to_dict` turns a dataclass (nested dataclasses, tuples, dicts) into plain JSON
values; `from_dict` rebuilds it from the type hints.  No pickle anywhere.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


def to_dict(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.repr}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {str(k): to_dict(v) for k, v in obj.items()}
    if isinstance(obj, float) and obj != obj:  # NaN is not JSON
        return None
    return obj


def _convert(tp: Any, value: Any) -> Any:
    if value is None:
        return None
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        non_none = [a for a in args if a is not type(None)]
        for a in non_none:
            try:
                return _convert(a, value)
            except (TypeError, ValueError, KeyError):
                continue
        raise TypeError(f"cannot convert {value!r} to {tp}")
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value)
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_convert(args[0], v) for v in value)
        if args:
            return tuple(_convert(a, v) for a, v in zip(args, value))
        return tuple(value)
    if origin is list:
        return [_convert(args[0], v) for v in value] if args else list(value)
    if origin is dict:
        kt, vt = args if args else (str, Any)
        return {_convert(kt, k): _convert(vt, v) for k, v in value.items()}
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"expected a number, got {value!r}")
        return float(value)
    if tp is int and isinstance(value, bool):
        raise TypeError("bool is not int")
    if tp in (int, str, bool) and not isinstance(value, tp):
        raise TypeError(f"expected {tp.__name__}, got {value!r}")
    return value


@functools.cache
def _fields_of(cls: type) -> tuple[dict[str, Any], frozenset[str]]:
    """A dataclass's resolved field types and init field names (resolving annotations is slow, and a
    search reads back thousands of plans and predictions)."""
    return typing.get_type_hints(cls), frozenset(f.name for f in dataclasses.fields(cls) if f.init)


def from_dict(cls: type[T], data: dict[str, Any]) -> T:
    """Rebuild dataclass `cls` from `to_dict` output; unknown keys are an error."""
    if not isinstance(data, dict):
        raise TypeError(f"{cls.__name__}: expected an object, got {type(data).__name__}")
    hints, names = _fields_of(cls)
    unknown = set(data) - names
    if unknown:
        raise KeyError(f"{cls.__name__}: unknown field(s) {sorted(unknown)}")
    kwargs = {k: _convert(hints[k], v) for k, v in data.items() if k in names}
    return cls(**kwargs)


def dump_json(obj: Any, path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(to_dict(obj), indent=1, sort_keys=False) + "\n")
    tmp.replace(path)  # atomic: a killed process never leaves half a file


def dumps(obj: Any) -> str:
    return json.dumps(to_dict(obj), sort_keys=True)
