"""ESPnet SpeechLM's model side, rewritten for the tests from ESPnet's own files.

``pip install espnet==202511`` (the newest release on the registry) carries ESPnet's data side,
``espnet2/speechlm/dataloader/`` (``DataIteratorFactory``, the dataset JSON readers) and
``espnet2/speechlm/model/abs_job.py``, but not the job template, the preprocessor, the
multimodal ios, the model or ``bin/``: ESPnet users run those from a git checkout. The tests use
the wheel's data side as it is (installed ``--no-deps`` beside our venv's packages by the
Makefile) and these modules for the rest. Each was written from the ESPnet file and commit its
docstring names (read with the search tool; the logic is re-expressed here, not copied), and
``tests/integration/test_espnet_format.py`` checks the batches they make against a hand-built
expectation of those files' rules, so a drift from them fails a test:

- ``ios.py``: ``DiscreteAudioIO``, ``ContinuousAudioIO``, ``HuggingFaceTextIO``
  (``model/speechlm/multimodal_io/{audio,text,abs_io}.py``);
- ``job.py``: ``SpeechLMJobTemplate``, ``SpeechLMPreprocessor``, the task templates
  (``model/speechlm/speechlm_job.py``, ``task_conf_speechlm.py``, ``utils/data.py``);
- ``model.py``: the ``ParallelLLM`` surgery of ``model/speechlm/lm/parallel.py`` (what
  ``job_template.build_model()`` returns) and ESPnet's checkpoint writer
  (``trainer/titan_trainer.py``);
- ``corpus.py``: a dataset JSON, lhotse manifests, text files and length statistics, as
  ``bin/prepare_dataset_json.py`` and ``bin/prepare_length_stats.py`` make them;
- ``train_main.py``: ``bin/train.py`` with only the trainer import changed (and gloo instead of
  DeepSpeed's NCCL start, the one thing a CPU needs).

The one liberty: ESPnet's ``DiscreteAudioIO`` loads an ESPnet codec from the HF hub; here its
codec is a local codec of ours behind the same interface (``meta_info``, ``encode``,
``decode``), so nothing is downloaded.
"""
