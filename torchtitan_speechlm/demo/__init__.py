"""The demo and the builders of tiny, random-init assets (tokenizer, codec, backbone, espeak-ng
corpus) that `make demo`, the tests and the benchmarks use. Not imported by training."""
