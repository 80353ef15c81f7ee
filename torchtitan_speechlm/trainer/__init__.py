"""The SpeechLM TrainSpec and what assembles a run from a job config: the spec registration,
the start-up checks (preflight) and how a rank ends on a fault the user can act on."""
