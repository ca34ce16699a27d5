"""The byte tokenizer: a document is ``[BOS] + its UTF-8 bytes + [EOS]``.

Ids 0..255 are the bytes themselves; the specials (PAD, BOS, EOS, ...) sit above them in the
vocabulary defined once in ``spider_titan.vocab``. There is nothing to train and
nothing to download, so every shard, corpus and sample in the repo agrees on the mapping.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from spider_titan.vocab import BOS_ID, EOS_ID

__all__ = ["encode", "decode", "encode_bytes"]


def encode_bytes(data: bytes) -> np.ndarray:
    """``[BOS] + data + [EOS]`` as a uint16 array (the fast path for files and corpora)."""
    out = np.empty(len(data) + 2, dtype=np.uint16)
    out[0] = BOS_ID
    out[1:-1] = np.frombuffer(data, dtype=np.uint8)
    out[-1] = EOS_ID
    return out


def encode(text: str) -> list[int]:
    """``[BOS] + text's UTF-8 bytes + [EOS]`` as a list of ids."""
    return encode_bytes(text.encode("utf-8")).tolist()


def decode(ids: Iterable[int] | np.ndarray) -> str:
    """The text of the byte ids 0..255 in ``ids`` (specials dropped), invalid UTF-8 replaced by U+FFFD."""
    arr = np.asarray(ids if hasattr(ids, "__len__") else list(ids), dtype=np.int64).reshape(-1)
    return arr[(arr >= 0) & (arr < 256)].astype(np.uint8).tobytes().decode("utf-8", errors="replace")
