"""Decoding a trained model: load a checkpoint or an export (``loading``), sample with a KV cache
and masks (``sampling``, ``decode``), and the generation tasks (``tasks``: TTS to a wav, ASR to
text, continuation, spoken answers). Used by the commands and by training's samples. A flatten
model as a plain causal LM for vLLM: ``vllm_export``, and ``vllm_plugin`` (our decoder's masks
as a vLLM logits processor, a standalone module vLLM's environment imports)."""
