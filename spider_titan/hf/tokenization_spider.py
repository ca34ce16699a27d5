"""``SpiderByteTokenizer``: UTF-8 bytes as ids 0..255, and spider_titan's specials (vocab.py).

Any string round-trips: ``encode`` gives its UTF-8 bytes, ``decode`` joins bytes back (invalid
UTF-8 from a sampled byte sequence becomes U+FFFD). A token is the byte as one latin-1 character,
so the tokenizer's string machinery sees one character per byte.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizer

from spider_titan.vocab import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE

SPECIALS = {"<pad>": PAD_ID, "<s>": BOS_ID, "</s>": EOS_ID}


class SpiderByteTokenizer(PreTrainedTokenizer):
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, **kwargs):
        kwargs.setdefault("pad_token", "<pad>")
        kwargs.setdefault("bos_token", "<s>")
        kwargs.setdefault("eos_token", "</s>")
        kwargs.setdefault("add_bos_token", False)
        super().__init__(**kwargs)

    @property
    def vocab_size(self) -> int:
        return VOCAB_SIZE

    def get_vocab(self) -> dict[str, int]:
        vocab = {bytes([b]).decode("latin-1"): b for b in range(256)}
        vocab.update(SPECIALS)
        return vocab

    def _tokenize(self, text: str, **kwargs) -> list[str]:
        return list(text.encode("utf-8").decode("latin-1"))

    def _convert_token_to_id(self, token: str) -> int:
        if token in SPECIALS:
            return SPECIALS[token]
        return token.encode("latin-1")[0] if len(token) == 1 else self.unk_token_id or PAD_ID

    def _convert_id_to_token(self, index: int) -> str:
        if index < 256:
            return bytes([index]).decode("latin-1")
        return next((name for name, i in SPECIALS.items() if i == index), "")

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        raw = "".join(t for t in tokens if t not in SPECIALS)
        return raw.encode("latin-1").decode("utf-8", errors="replace")

    def save_vocabulary(self, save_directory: str, filename_prefix: str | None = None) -> tuple[str, ...]:
        return ()  # the vocabulary is fixed: nothing to save
