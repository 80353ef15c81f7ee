"""Training-time data: the prepared-dataset reader, task templates, the global step stream and
torchtitan's data loader. Never imports ``torchtitan_speechlm.prepare`` (tested): the two sides
share only ``torchtitan_speechlm.data.format``."""
