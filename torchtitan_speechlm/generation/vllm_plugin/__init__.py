"""What vLLM runs of ours beside a flatten model (generation/vllm_export.py copies it into the
exported folder; ``torchtitan serve --engine vllm`` uses it): ``speechlm_vllm_mask.py``, a module
that imports only the standard library, torch and vLLM, so that vLLM's own environment imports
it with its folder on ``PYTHONPATH`` (``--logits-processors speechlm_vllm_mask:FlattenAudioMask``;
docs/serving.md). Nothing of this package is imported there."""
