"""The SpeechLM TrainSpec and what assembles a run from a job config: the spec registration,
the start-up checks (preflight) and how a rank ends on a fault the user can act on.

Importing any module of this package registers the ``speechlm`` TrainSpec first (``spec``), as
torchtitan's own model packages register theirs on import: whatever reads a job config through
the trainer layer (``run.prepare_run``, ``plan.RunPlan``, the preflight checks, a benchmark)
finds the spec in torchtitan's registry."""

from torchtitan_speechlm.trainer import spec  # noqa: F401  (registers the speechlm spec)
