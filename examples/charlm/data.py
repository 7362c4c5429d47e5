"""The example's corpus: the bytes of text files that ship with every Python (the standard
library's own modules), cut into (tokens, next tokens) windows for the built-in `gpt` workload.

Each byte is one token (0..255), well inside the `gpt` preset's vocabulary; a window holds the
preset's `seq_len` tokens and its target is the same window shifted by one byte.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import torch
from torch.utils.data import Dataset

SEQ_LEN = 64
"""Tokens per sample: the `gpt` (tiny) preset's sequence length."""
FILES = ("textwrap.py", "string.py", "bisect.py", "heapq.py", "colorsys.py", "shlex.py", "fnmatch.py",
         "keyword.py", "glob.py", "queue.py")
"""Standard library modules read, in this order (all present in CPython 3.8 and later)."""
MAX_BYTES = 200_000
"""Enough text for a few hundred steps without repeating a window."""


def corpus_bytes(max_bytes: int = MAX_BYTES) -> bytes:
    """The corpus: the FILES that exist under this Python's stdlib folder, concatenated."""
    root = Path(sysconfig.get_paths()["stdlib"])
    parts = [(root / name).read_bytes() for name in FILES if (root / name).is_file()]
    if not parts:
        raise FileNotFoundError(f"none of {', '.join(FILES)} under {root}")
    return b"\n".join(parts)[:max_bytes]


class CharWindows(Dataset):
    """Non-overlapping windows of `seq_len` bytes: sample i is (text[i*L : i*L+L], text[i*L+1 : i*L+L+1])."""

    def __init__(self, data: bytes, seq_len: int = SEQ_LEN):
        self.tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
        self.seq_len = seq_len

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.seq_len

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(i)
        start = i * self.seq_len
        window = self.tokens[start:start + self.seq_len + 1]
        return window[:-1], window[1:]


def train_set() -> CharWindows:
    """What `--data examples.charlm.data:train_set` loads."""
    return CharWindows(corpus_bytes())
