"""Offline preparation (`torchtitan prepare`): read a source, tokenize, encode audio with a codec,
write the sharded on-disk format (``torchtitan_speechlm.data.format``). Training never
imports this package."""
