"""What ``torchtitan serve --engine vllm`` hands vLLM: ``speechlm_vllm_mask.py``, a module that
imports only the standard library, torch and vLLM, so that vLLM's own environment imports it
with this folder on its ``PYTHONPATH`` (``--logits-processors speechlm_vllm_mask:FlattenAudioMask``;
docs/serving.md). Nothing of this package is imported there."""
