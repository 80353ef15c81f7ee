"""Scoring a model on held-out data (``torchtitan eval``): which judges score TTS
(``judge_setup``), the text sets (``text_scores``: ASR, dialogue), the TTS sets with the
independent judges (``tts_scores``, summed up by ``tts_summary``; the report's wavs:
``item_wavs``), the shared error rates (``rates``) and progress clock (``phase_clock``), the
original recordings of prepared items (``recordings``), the table (``results_table``) and the
listening page (``report``)."""
