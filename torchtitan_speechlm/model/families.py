"""The built-in backbone families (``hf``, ``native``, ``qwen3``) and audio encoders, registered
by importing their modules.

Imported by the modules that look a family up (``model/args.py``: the backbone;
``model/audio/tower.py``: the audio encoder), not by the ``model`` package itself: a light
module of it (the vocabulary layout, the interleave patterns, the codec identity) then loads no
backbone, and with them neither torchtitan nor a transformers model. `torchtitan prepare`
reads those three and nothing else of the model (about 1.5 s of its start on 2 cores).
"""

from torchtitan_speechlm.model.audio import hf_encoder  # noqa: F401
from torchtitan_speechlm.model.backbones import hf, native, qwen3  # noqa: F401
