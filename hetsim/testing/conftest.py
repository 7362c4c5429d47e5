"""Pytest set-up of the contract suite when it runs from the installed package (`--pyargs hetsim.testing`)."""

from __future__ import annotations


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "slow: launches real multi-process runs")
