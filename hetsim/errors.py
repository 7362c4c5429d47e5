"""One exception hierarchy.  Every message names the value, the limit and what to do."""

from __future__ import annotations


class HetsimError(Exception):
    """Base of every error hetsim raises on purpose."""


class ConfigError(HetsimError):
    """Bad user input (option, file, spec).  The CLI prints it and exits with code 2."""


class ClusterSpecError(ConfigError):
    """A --cluster value or cluster file that cannot be used."""


class UnknownNameError(ConfigError):
    """A name (model, strategy, catalog key...) that is not registered."""

    def __init__(self, what: str, name: str, known: list[str] | tuple[str, ...], hint: str = ""):
        self.what, self.name, self.known = what, name, list(known)
        msg = f"unknown {what} {shown(name)}; known: {', '.join(sorted(self.known))}"
        if hint:
            msg += f". {hint}"
        super().__init__(msg)


class ProfileError(HetsimError):
    """A recorded profile that cannot be used."""


class ProfileCorruptError(ProfileError):
    """A profile file that is not valid JSON or misses fields."""


class ProfileMismatchError(ProfileError):
    """A profile whose fingerprint no longer matches this machine or workload."""


class InfeasiblePlanError(HetsimError):
    """A plan that cannot run (memory, batch split, device count)."""




class EmulatedOutOfMemoryError(HetsimError):
    """An emulated device went over its memory cap (raised by the accounting)."""


def shown(value: object, limit: int = 80) -> str:
    """`repr(value)` for an error message, cut to `limit` characters with the full length said: a
    100,000-character --cluster spec is named, not echoed."""
    text = repr(value)
    if len(text) <= limit:
        return text
    return f"{text[: limit - 4]}...{text[-1]} ({len(str(value)):,} characters)"
