"""A fitted codec's folder: its arrays in a safetensors file, then ``config.json``.

The k-means, mel and WORLD codecs are fitted the same way (``codecs/residual_kmeans.py``) and
saved the same way. The config records a hash of the arrays (``weights_sha256``), so a codec's
identity changes with its codebooks, and it is written last: its presence means the folder
is complete.
"""

from __future__ import annotations

import hashlib
import os

import numpy as np
import torch

from torchtitan_speechlm.utils.fileio import write_json_atomic


def save_fitted(out_dir: str, weights: str, arrays: dict[str, np.ndarray], config: dict) -> str:
    """Write ``arrays`` to ``out_dir/weights`` and ``config`` (plus ``weights_sha256``) to
    ``out_dir/config.json``, in that order; return ``out_dir``."""
    from safetensors.torch import save_file

    tensors = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in arrays.items()}
    digest = hashlib.sha256()
    for name in sorted(tensors):
        digest.update(tensors[name].numpy().tobytes())
    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, weights))
    config = dict(config, weights_sha256=digest.hexdigest()[:16])
    write_json_atomic(os.path.join(out_dir, "config.json"), config)  # last: the folder is complete
    return out_dir
