"""The continuous audio input: the encoder registry (``encoders``), the tower in front of the LM
(``tower``: encoder, stacking adaptor) and transformers' speech encoders (``hf_encoder``)."""
