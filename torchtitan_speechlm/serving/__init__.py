"""``torchtitan serve``: an OpenAI-compatible HTTP server over one loaded model (docs/serving.md).

``app`` (the routes on FastAPI), ``server`` (uvicorn on a bound socket: timeouts, drain),
``auth`` / ``limits`` / ``access_log`` / ``errors`` (API key, body limits, JSON access lines,
OpenAI's errors), ``formats`` (a request's response encoding) over ``audio_formats``,
``transcript_formats``, ``speed`` and ``wav``; ``batcher`` (the model worker thread, its bounded
queue and dynamic batching), ``speech`` (the batched model calls the worker runs: TTS and ASR
through generation/tasks.py), ``prompts`` / ``voices`` (speaker prompts), ``metrics``
(Prometheus), ``replicas`` (``--replicas N`` processes behind one port); ``vllm_engine``
(``--engine vllm``: the runners with the model on a vLLM server) and ``vllm_process`` (the vLLM
server ``--vllm-python`` starts; the logits processor it loads is generation/vllm_plugin/).
"""
