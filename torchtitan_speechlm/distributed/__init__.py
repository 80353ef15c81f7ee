"""How a SpeechLM is distributed: the parallelize function (tensor parallelism, activation
checkpointing, compile, FSDP2/HSDP or DDP, torchtitan's order), kept apart from the model code."""
