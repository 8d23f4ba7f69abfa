"""Text of a generation as its tokens come: `TextStream` writes each new token's text as soon as it is whole.

A token's own decoding is not its share of the text: a byte-level BPE token may hold half of a UTF-8 character,
and a SentencePiece decoder drops the space of the first piece it decodes. So the stream decodes a short run of
ids that starts a little before the new ones, and writes what the new ones add to it (the way text-generation
servers stream). What it writes, put together, is the tokenizer's decoding of all the ids.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import TextIO

import torch


class TextStream:
    """A `generate(callback=...)` for one sequence that writes its text to `out` (stdout) as the tokens come.

    Ids in `skip` (the tokenizer's stop ids: end-of-text is not text) are not written. A text ending in U+FFFD
    (a character whose bytes have not all come) is held back until the next token completes it; `close()` writes
    what is held and a line end; leaving a `with TextStream(...)` block closes it, also after an interrupt, so a
    stopped generation keeps what it made. `lead` (the prompt) is written with the first text, or by `close()`:
    a generation that fails before its first token leaves the block having written nothing.
    """

    def __init__(self, tokenizer, out: TextIO | None = None, skip: Iterable[int] = (), lead: str = ""):
        self.tokenizer, self.out, self.skip = tokenizer, out or sys.stdout, frozenset(skip)
        self.lead = lead  # written with the first text (a prompt): a generation refused before it writes nothing
        self.wrote = False
        self.ids: list[int] = []
        self.start = 0  # the run decoded for each new token begins here: text up to `done` has been written
        self.done = 0

    def __call__(self, tokens: torch.Tensor) -> None:
        token = int(tokens.reshape(-1)[0])
        if token not in self.skip:
            self.ids.append(token)
            self._write(held_too=False)

    def _write(self, held_too: bool) -> None:
        written = self.tokenizer.decode(self.ids[self.start : self.done])
        text = self.tokenizer.decode(self.ids[self.start :])
        if len(text) > len(written) and (held_too or not text.endswith("\ufffd")):
            self._put(text[len(written) :])
            self.start, self.done = self.done, len(self.ids)

    def __enter__(self) -> TextStream:
        return self

    def __exit__(self, kind, error, trace) -> None:
        if kind is None or self.wrote:  # (an error before any text: the error alone is said)
            self.close()

    def close(self) -> None:
        self._write(held_too=True)
        self._put("\n")

    def _put(self, text: str) -> None:
        self.out.write(text if self.wrote else self.lead + text)
        self.out.flush()
        self.wrote = True
