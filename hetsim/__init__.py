"""hetsim: plan, simulate and really run training across mismatched devices."""

from __future__ import annotations

import os as _os

__version__ = "0.1.0"

# In a source checkout the subpackages `hetsim.strategies` and `hetsim.search`
# live in the top-level folders `strategies/` and `search/` (pyproject maps them
# with package-dir).  Extending __path__ lets `python -m hetsim.search` work from
# a clean clone without installing the project first.
_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isfile(_os.path.join(_root, "search", "__init__.py")) and _os.path.isfile(
    _os.path.join(_root, "pyproject.toml")
):
    __path__.append(_root)  # type: ignore[name-defined]  # noqa: F821
