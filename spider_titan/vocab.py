"""The byte vocabulary every model, data reader and tool shares (docs/model.md, "Vocabulary").

Ids 0..255 are raw bytes, then the specials; ids 259..271 are reserved and never produced by the
byte tokenizer. Labels equal to PAD become ``IGNORE_INDEX`` and are left out of the loss.
"""

VOCAB_SIZE = 272
PAD_ID = 256
BOS_ID = 257
EOS_ID = 258
IGNORE_INDEX = -100
