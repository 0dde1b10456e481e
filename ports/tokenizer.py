"""The model's tokenizer, for computing the server's block keys from a prompt."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

__all__ = ["Tokenizer", "TokenizerError"]


class TokenizerError(Exception):
    """The tokenizer could not be loaded (the message names the path) or could not encode."""


class Tokenizer(Protocol):
    """Text to token ids as the model server computes them for a completions prompt
    (special tokens such as BOS included). CPU-bound; thread-safe; raises
    ``TokenizerError`` on text it cannot encode."""

    def encode(self, text: str) -> Sequence[int]: ...
