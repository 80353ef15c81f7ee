"""A stand-in for Hugging Face `datasets`, put on the path by benchmarks/gpu_check.sh only when
the real package cannot be imported (a bare GPU image lacks pyarrow and pandas, 55 MB of wheels
that do not fit what a session carries). torchtitan imports these names at module level
(torchtitan/hf_datasets/text_datasets.py, via its llama3 model and validator); the SpeechLM never
calls them. Calling one says what is missing."""


def _missing(*args, **kwargs):
    raise ImportError(
        "the real `datasets` package is not installed (benchmarks/gpu_shims stand-in)"
    )


class Dataset:
    def __init__(self, *args, **kwargs):
        _missing()


class IterableDataset(Dataset):
    pass


load_dataset = _missing
