"""How a SpeechLM is distributed: parallelize functions (AC, compile, FSDP2/HSDP, DDP) in
torchtitan's order, kept apart from the model code."""
