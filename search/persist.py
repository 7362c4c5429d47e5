"""Where a study's trials are kept: the search runs on an in-memory copy and writes them in batches.

A storage write per trial (SQLite: a transaction; Optuna's journal file: a lock, a write and an
fsync per operation, about ten operations per trial) costs more than simulating hundreds of plans.
So the search runs on an in-memory study and `TrialWriter` writes its finished trials to the user's
storage once a second (and when the search ends or stops): to a journal file in one locked append
and one fsync per batch, each trial one line (a finished trial as Optuna's journal records a
`create_trial` with its template).  A SIGKILL therefore loses at most the trials finished since the
last write — about one second of search — and a torn last line is dropped when the file is read
(Optuna's reader skips it) and cut off before the next append, so it never corrupts the file.
"""

from __future__ import annotations

import os
import time
import weakref
from pathlib import Path
from typing import Any

import optuna
from optuna.storages import JournalStorage
from optuna.storages.journal import BaseJournalBackend, JournalFileBackend, JournalFileSymlinkLock

from hetsim.errors import ConfigError

FLUSH_EVERY_S = 1.0
"""How often finished trials are written to the user's storage: the most a SIGKILL can lose."""

JOURNAL_PREFIX = "journal:"

_journal_paths: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def make_storage(spec: str | None):
    """None (in memory), an Optuna RDB URL (`sqlite:///x.db`) as it is, or a journal file
    (`journal:PATH` or a path ending in `.journal`) as Optuna's JournalStorage."""
    if spec is None:
        return None
    if spec.startswith(JOURNAL_PREFIX) or spec.endswith(".journal"):
        path = Path(spec.removeprefix(JOURNAL_PREFIX))
        if not path.parent.is_dir():
            raise ConfigError(f"--storage {spec!r}: folder {str(path.parent)!r} does not exist; create it or use "
                              "another path (journal:PATH/hetsim.journal)")
        if path.exists() and not path.is_file():  # a folder, /dev/zero or a pipe: never read
            raise ConfigError(f"--storage {spec!r}: {str(path)!r} is not a regular file; give a journal file path "
                              "(journal:PATH/hetsim.journal)")
        if path.exists():
            _locked_cut(str(path))  # a writer killed mid-line: Optuna's own next append would glue onto it
        storage = JournalStorage(JournalFileBackend(str(path)))
        _journal_paths[storage] = str(path)
        return storage
    return spec


def journal_path(study: optuna.Study) -> str | None:
    """The journal file behind a study opened with `make_storage`, else None."""
    return _journal_paths.get(study._storage)


def is_in_memory(study: optuna.Study) -> bool:
    return isinstance(study._storage, optuna.storages.InMemoryStorage)


class _BatchedJournal(BaseJournalBackend):
    """A journal file written by one writer in batches: its view is the file as it was when opened
    plus what it appended itself (it never needs another writer's later trials)."""

    def __init__(self, path: str):
        self._path = path
        self._lock = JournalFileSymlinkLock(path)
        self._logs: list[dict[str, Any]] = list(JournalFileBackend(path).read_logs(0))
        self._pending: list[dict[str, Any]] = []

    def read_logs(self, log_number_from: int):
        yield from self._logs[log_number_from:]

    def append_logs(self, logs: list[dict[str, Any]]) -> None:
        self._logs.extend(logs)
        self._pending.extend(logs)

    def flush(self) -> None:
        if not self._pending:
            return
        import json

        data = "".join(json.dumps(log, separators=(",", ":")) + "\n" for log in self._pending).encode()
        while not self._lock.acquire():
            time.sleep(0.001)
        try:
            with open(self._path, "r+b") as f:
                _cut_torn_tail(f)
                f.seek(0, os.SEEK_END)
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        finally:
            self._lock.release()
        self._pending = []


def _locked_cut(path: str) -> None:
    lock = JournalFileSymlinkLock(path)
    while not lock.acquire():
        time.sleep(0.001)
    try:
        with open(path, "r+b") as f:
            _cut_torn_tail(f)
    finally:
        lock.release()


def _cut_torn_tail(f) -> None:
    """Drop a last line without its newline (a writer killed mid-write): appending after it would
    glue the next line onto it and make the whole file unreadable."""
    size = f.seek(0, os.SEEK_END)
    if size == 0:
        return
    f.seek(size - 1)
    if f.read(1) == b"\n":
        return
    pos = size
    while pos > 0:
        step = min(65536, pos)
        f.seek(pos - step)
        chunk = f.read(step)
        i = chunk.rfind(b"\n")
        if i >= 0:
            f.truncate(pos - step + i + 1)
            return
        pos -= step
    f.truncate(0)


class TrialWriter:
    """Writes finished trials to a study's own storage, in batches at most `every_s` apart."""

    def __init__(self, study: optuna.Study, every_s: float = FLUSH_EVERY_S):
        self._name = study.study_name
        self._path = journal_path(study)
        self._rdb = None if self._path else study._storage
        self._every_s = every_s
        self._pending: list[optuna.trial.FrozenTrial] = []
        self._last = time.monotonic()
        self._target: optuna.Study | None = None
        self._backend: _BatchedJournal | None = None
        self.written = 0

    def add(self, trial: optuna.trial.FrozenTrial) -> None:
        self._pending.append(trial)
        if time.monotonic() - self._last >= self._every_s:
            self.flush()

    def flush(self) -> None:
        self._last = time.monotonic()
        if not self._pending:
            return
        batch, self._pending = self._pending, []
        if self._target is None:  # one replay of the file per writer, not per batch
            if self._path:
                self._backend = _BatchedJournal(self._path)
                self._target = optuna.load_study(study_name=self._name, storage=JournalStorage(self._backend))
            else:
                self._target = optuna.load_study(study_name=self._name, storage=self._rdb)
        self._target.add_trials(batch)
        if self._backend is not None:
            self._backend.flush()
        self.written += len(batch)
