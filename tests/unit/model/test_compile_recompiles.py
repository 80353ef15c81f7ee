"""Per-layer ``torch.compile`` (``compile.enable``, distributed/parallelize.py ``apply_compile``)
compiles once: packed rows whose documents differ from step to step, at one padded [B, T], give
no recompilation after the first step (model/documents.py: the documents are grouped outside the
compiled layers and the grouped attention is never traced). Counted with dynamo's own recompile
log and graph counter; backend ``aot_eager`` (dynamo's guards are the same as inductor's, without
compiling C++)."""

import logging
import random

import pytest
import torch

from tests.helpers import build_speechlm, save_tiny_backbone

STEPS, B, T = 20, 2, 64


class Recompiles(logging.Handler):
    """The reasons dynamo gives for each recompilation (its ``recompiles`` log artifact)."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.reasons: list[str] = []

    def emit(self, record):
        self.reasons.append(record.getMessage())


def packed_positions(rng: random.Random) -> torch.Tensor:
    """[B, T] positions of rows packing 1..T documents of random lengths (positions restart at
    0 at each document)."""
    rows = []
    for _ in range(B):
        left, lengths = T, []
        while left:
            n = min(left, rng.randint(1, 40))
            lengths.append(n)
            left -= n
        rows.append(torch.cat([torch.arange(n) for n in lengths]))
    return torch.stack(rows)


@pytest.mark.parametrize(
    "family, backbone",
    [("llama", "hf"), ("qwen3", "hf"), ("llama", "native"), ("qwen3", "qwen3")],
)
def test_compiled_layers_do_not_recompile_when_documents_change(tmp_path, family, backbone):
    from torch._dynamo.utils import counters

    from torchtitan_speechlm.distributed.parallelize import apply_compile

    save_tiny_backbone(tmp_path / "bb", family=family)
    model = build_speechlm(tmp_path / "bb", backbone=backbone)
    apply_compile(model, "aot_eager")
    lay = model.args.layout
    rng = random.Random(0)
    torch._dynamo.reset()
    counters.clear()
    log = logging.getLogger("torch._dynamo.guards.__recompiles")
    handler = Recompiles()
    torch._logging.set_logs(recompiles=True)
    log.addHandler(handler)
    graphs, documents = [], set()
    try:
        for _ in range(STEPS):
            pos = packed_positions(rng)
            documents.add(int((pos == 0).sum()))
            x = torch.stack(
                [torch.randint(*lay.stream_range(k), (B, T)) for k in range(lay.num_streams)], -1
            )
            w = torch.ones(B, T, lay.num_streams)
            out = model(x, targets=x, loss_weights=w, position_ids=pos)
            out.loss_sum.backward()
            graphs.append(counters["stats"]["unique_graphs"])
    finally:
        log.removeHandler(handler)
        torch._logging.set_logs()
        torch._dynamo.reset()
    assert len(documents) > 5  # the rows really vary
    assert graphs[0] > 0  # the layers were compiled
    # one padded shape: at most one recompilation, in the first step (hf: transformers'
    # deprecate_kwarg wrapper is one code object for the decoder layer and its attention,
    # which runs as a frame of its own after the graph break), none after it
    assert len(handler.reasons) <= 1, handler.reasons
    assert graphs[1:] == [graphs[0]] * (STEPS - 1), (graphs, handler.reasons)
