"""``torchtitan serve``: an OpenAI-compatible HTTP server over one loaded model (docs/serving.md).

``batcher`` (the model worker thread, its bounded queue and dynamic batching), ``http`` (the
routes on the standard library's ``ThreadingHTTPServer``), ``multipart`` (form uploads),
``wav`` (16-bit PCM wav bytes, whole or streamed), ``speech`` (the batched model calls the worker
runs: TTS and ASR through generation/tasks.py).
"""
