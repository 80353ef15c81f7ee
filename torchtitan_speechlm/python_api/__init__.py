"""The Python API for people coming from ESPnet SpeechLM: ``TitanTrainer`` (trainer.py) with
ESPnet's constructor, ``run()`` / ``train()`` / ``valid()``; ``trainer_args`` mapped onto a
torchtitan TOML (args.py); data factories as prepared data (data.py) or ESPnet iterator
factories (espnet_data.py; espnet_mixing.py re-makes their batches mixed); wandb through the caller's run (wandb_run.py). torchtitan's own
Trainer does the work. See docs/python-api.md."""

from torchtitan_speechlm.python_api.data import PreparedData
from torchtitan_speechlm.python_api.espnet_data import EspnetData
from torchtitan_speechlm.python_api.espnet_mixing import mix_espnet_batches
from torchtitan_speechlm.python_api.trainer import TitanTrainer

__all__ = ["EspnetData", "PreparedData", "TitanTrainer", "mix_espnet_batches"]
