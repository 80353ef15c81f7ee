"""A planned sample -> its example, and the name a log gives it.

The only place the stream reads items: a plan names samples by (source, item), and this turns
one into the ``TemplateBuilder``'s example. A corrupt item is skipped (and counted by the
collation), never fatal: one bad file must not kill a multi-day run.
"""

from __future__ import annotations

from torchtitan_speechlm.data.mixing import Source
from torchtitan_speechlm.data.pairs import PairExample, build_pair
from torchtitan_speechlm.data.planner import Draw
from torchtitan_speechlm.data.tasks import Example, TemplateBuilder, get_task
from torchtitan_speechlm.utils.upstream import logger


class Examples:
    """The examples of the sources' items, built on demand."""

    def __init__(self, sources: list[Source], builder: TemplateBuilder):
        self.sources, self.builder = sources, builder
        self._pairs = [get_task(s.task).pair_of is not None for s in sources]
        self._warned_bad: set[tuple[int, int]] = set()

    def task(self, d: Draw) -> str:
        return self.sources[d.src].task

    def sample_id(self, d: Draw) -> str:
        """``TASK:DATASET:ITEM_ID`` of a draw: what a log of a bad step names."""
        s = self.sources[d.src]
        return f"{s.task}:{s.name}:{s.data.ids[d.item]}"

    def example(self, d: Draw) -> Example | PairExample | None:
        """The draw's example (a preference task's: its pair of documents), or None (with a
        warning, once per item) if it cannot be read."""
        s = self.sources[d.src]
        try:
            if self._pairs[d.src]:  # a preference task: two documents (data/pairs.py)
                return build_pair(self.builder, s.task, s.data[d.item])
            prompt = s.data[d.prompt] if d.prompt >= 0 else None
            return self.builder.build(s.task, s.data[d.item], d.cfg_drop, prompt)
        except Exception as e:  # a corrupt item must not kill a multi-day run
            if (d.src, d.item) not in self._warned_bad:
                self._warned_bad.add((d.src, d.item))
                logger.warning(
                    f"skipping bad sample {s.name}[{d.item}] for {s.task}: {e} "
                    "(counted in data/skipped_bad)"
                )
            return None
