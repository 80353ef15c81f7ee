"""See datasets/__init__.py: a stand-in, for torchtitan's module-level import."""

from datasets import _missing

split_dataset_by_node = _missing
