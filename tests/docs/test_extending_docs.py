"""docs/extending.md's recipes run as written (its python blocks, in order, in a fresh
process), and what they register works: the codec loads and encodes, the pattern and the task
build examples whose length the index budget predicts, the source reads its file, and a SpeechLM
over the backbone trains a step."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CHECKS = """
import os, tempfile
import numpy as np, soundfile as sf, torch
from torchtitan_speechlm.codecs import CODECS
from torchtitan_speechlm.data.tasks import LossWeights, TemplateBuilder
from torchtitan_speechlm.model.args import SpeechLMModelArgs
from torchtitan_speechlm.model.model import SpeechLM
from torchtitan_speechlm.model.patterns import get_pattern
from torchtitan_speechlm.model.vocab import VocabLayout
from torchtitan_speechlm.prepare.sources import read_source

# codec
wav = np.sin(np.arange(1600) / 5.0).astype(np.float32)
assert isinstance(codec, SignCodec) and "sign_codec" in CODECS
codes = codec.encode([wav])[0]
assert codes.shape == (10, 2) and codes.max() < 4 and len(codec.decode(codes)) == 1600

# pattern + task
lay = VocabLayout(text_size=40, num_streams=2, codebook_size=4)
builder = TemplateBuilder(lay, "stride2", LossWeights(1.0, 1.0, (0.5, 0.5)))
class Item:
    id, text_tokens, audio_codes = "x", np.array([3, 4, 5]), codes
for task in ("tts", "spoken_answer"):
    ex = builder.build(task, Item)
    assert len(ex.frames) == builder.length(task, 3, 10), task
assert (get_pattern("stride2").deinterleave(get_pattern("stride2").interleave(codes, [0, 0]))
        == codes).all()
ex = builder.build("spoken_answer", Item, cfg_drop=True)
assert len(ex.frames) == builder.length("spoken_answer", 3, 10, cfg_drop=True)

# source
d = tempfile.mkdtemp()
sf.write(os.path.join(d, "a.wav"), wav, 16000)
with open(os.path.join(d, "c.csv"), "w") as f:
    f.write("u1,a.wav,0.0,0.05,hello there\\n")
items = read_source("csv_corpus", os.path.join(d, "c.csv")).items
assert [(i.id, i.text, i.ref.end) for i in items] == [("u1", "hello there", 0.05)]

# backbone
args = SpeechLMModelArgs(backbone="conv", vocab=lay.to_dict(), pattern="stride2",
                         backbone_config={"vocab_size": 40, "hidden_size": 16,
                                          "num_hidden_layers": 2}, load_weights=False)
with torch.device("meta"):
    model = SpeechLM(args)
model.to_empty(device="cpu")
model.init_weights()
frames = torch.from_numpy(builder.build("spoken_answer", Item).frames)[None]
weights = torch.from_numpy(builder.build("spoken_answer", Item).weights)[None]
out = model(frames[:, :-1], targets=frames[:, 1:], loss_weights=weights[:, 1:])
out.loss_sum.backward()
grads = [p.grad for p in model.backbone.layers.parameters()]
assert all(g is not None and torch.isfinite(g).all() for g in grads)
print("recipes ok")
"""


def test_every_recipe_runs_as_written(tmp_path):
    text = (ROOT / "docs" / "extending.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert len(blocks) == 6  # import + codec, pattern, task, source, backbone
    script = tmp_path / "recipes.py"
    script.write_text("\n\n".join(blocks) + CHECKS)
    r = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert r.returncode == 0 and "recipes ok" in r.stdout, r.stderr[-3000:]
