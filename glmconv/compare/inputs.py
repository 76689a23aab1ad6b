"""Parity inputs: a packed batch of token ids (random from a seed, or read from a file of ids).

There is no tokenizer in the fixtures, so a prompt file holds token ids: plain text with one sequence per
non-blank line (ids separated by whitespace), or JSON (`[ids...]`, `[[ids...], ...]`, or one list per line).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from glmconv.errors import GlmconvError
from glmconv.io.jsonfile import parse_json, read_capped
from glmconv.text import decimal, show

if TYPE_CHECKING:
    import torch


MAX_PROMPT_BYTES = 64 << 20  # token ids for a parity run: far more than any GPU holds
MAX_TOKENS = 1 << 24  # one packed batch; beyond this the activations alone exceed any accelerator


@dataclass(frozen=True)
class Batch:
    """Packed sequences: `ids` [T] int64 and `cu_seqlens` [N+1] int64 (0, end of seq 0, ..., T)."""

    ids: torch.Tensor
    cu_seqlens: torch.Tensor
    source: str  # "random" or the prompt file's path

    @property
    def tokens(self) -> int:
        return int(self.ids.numel())

    @property
    def sequences(self) -> int:
        return int(self.cu_seqlens.numel()) - 1

    def to(self, device: str | torch.device) -> Batch:
        return Batch(self.ids.to(device), self.cu_seqlens.to(device), self.source)


def random_batch(vocab: int, tokens: int, sequences: int = 1, seed: int = 0) -> Batch:
    """`tokens` uniform ids from `seed`, split into `sequences` packed sequences of near-equal length."""
    import torch

    if tokens < 1 or sequences < 1:
        raise GlmconvError(f"--tokens {tokens} and --sequences {sequences} must be positive")
    if tokens > MAX_TOKENS:
        raise GlmconvError(f"--tokens {show(tokens)}: more than the {MAX_TOKENS:,} tokens a parity run takes")
    if sequences > tokens:
        raise GlmconvError(f"--sequences {sequences} exceeds --tokens {tokens}: every sequence needs a token")
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (tokens,), generator=g, dtype=torch.int64)
    lengths = [tokens // sequences + (1 if i < tokens % sequences else 0) for i in range(sequences)]
    return Batch(ids, _cu_seqlens(lengths), "random")


MAX_ID_DIGITS = 18  # a word longer than this is no token id of any vocabulary


def load_prompt_file(path: str | Path, vocab: int) -> Batch:
    """Read a file of token ids (see the module docstring); every id must lie in [0, vocab)."""
    import torch

    p = Path(path)
    try:
        text = read_capped(p, str(p), error=GlmconvError, max_bytes=MAX_PROMPT_BYTES).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise GlmconvError(f"{p}: cannot read the prompt file (not UTF-8: byte {exc.start})") from None
    seqs = _parse_json(text, p) if text.lstrip().startswith("[") else _parse_text(text, p)
    if not seqs:
        raise GlmconvError(f"{p}: holds no token ids")
    for i, seq in enumerate(seqs):
        bad = [t for t in seq if not 0 <= t < vocab]
        if bad:
            raise GlmconvError(f"{p}: sequence {i} has token id {show(bad[0])} outside the vocabulary [0, {vocab})")
    ids = torch.tensor([t for seq in seqs for t in seq], dtype=torch.int64)
    return Batch(ids, _cu_seqlens([len(s) for s in seqs]), str(p))


def _parse_text(text: str, p: Path) -> list[list[int]]:
    seqs = []
    for n, line in enumerate(text.splitlines(), 1):
        words = line.split()
        if not words:
            continue
        long = next((w for w in words if len(w) > MAX_ID_DIGITS), None)
        if long is not None:  # no vocabulary is that large; int() would refuse 4,300 digits and more
            raise GlmconvError(f"{p}:{n}: token id {show(long)} is outside any vocabulary")
        ids = [decimal(w) for w in words]
        bad = next((w for w, i in zip(words, ids) if i is None), None)
        if bad is not None:
            raise GlmconvError(f"{p}:{n}: {show(bad, quote=True)} is not a token id (ASCII digits 0-9 only)")
        seqs.append([i for i in ids if i is not None])
    return seqs


def _parse_json(text: str, p: Path) -> list[list[int]]:
    try:
        docs: list[Any] = [parse_json(text, str(p), error=GlmconvError)]
    except GlmconvError:  # not one document: one list per line (JSON Lines), each read the same way
        docs = [parse_json(line, f"{p}:{n}", error=GlmconvError) for n, line in enumerate(text.splitlines(), 1)
                if line.strip()]
    seqs: list[list[int]] = []
    for doc in docs:
        nested = isinstance(doc, list) and bool(doc) and all(isinstance(s, list) for s in doc)
        for seq in doc if nested else [doc]:
            if not isinstance(seq, list) or not seq or not all(_is_id(t) for t in seq):
                raise GlmconvError(f"{p}: expected a non-empty JSON list of integer ids, or a list of such lists")
            seqs.append([int(t) for t in seq])
    return seqs


def _is_id(t: Any) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)


def _cu_seqlens(lengths: list[int]) -> torch.Tensor:
    import torch

    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int64)
