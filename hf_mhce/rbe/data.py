"""Loading evaluation text for the RBE CLI: a datasets name, a saved dataset or text files,
tokenised and cut into blocks of a fixed number of tokens."""

from __future__ import annotations

import os

_FILE_TYPES = {".txt": "text", ".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}


def load_texts(path_or_name: str, split: str = "test", config: str | None = None):
    """A datasets.Dataset from a saved dataset directory, data files, or a hub/local dataset name."""
    import datasets

    if os.path.isdir(path_or_name) and os.path.exists(os.path.join(path_or_name, "dataset_info.json")):
        ds = datasets.load_from_disk(path_or_name)
        return ds[split] if isinstance(ds, datasets.DatasetDict) else ds
    if os.path.isdir(path_or_name) and not _has_data_files(path_or_name):
        raise ValueError(f"{path_or_name!r} is a directory but neither a saved dataset (datasets' save_to_disk) nor "
                         f"a folder of data files ({', '.join(sorted(_FILE_TYPES))})")
    ext = os.path.splitext(path_or_name)[1].lower()
    if os.path.isfile(path_or_name) and ext in _FILE_TYPES:
        return datasets.load_dataset(_FILE_TYPES[ext], data_files=path_or_name, split="train")
    ds = datasets.load_dataset(path_or_name, config)
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise ValueError(f"dataset {path_or_name!r} has splits {list(ds)}, not {split!r} (use --split)")
        return ds[split]
    return ds


def _has_data_files(directory: str) -> bool:
    known = (*_FILE_TYPES, ".arrow", ".py")  # what datasets' folder loader (or a loading script) reads
    return any(os.path.splitext(f)[1].lower() in known for _, _, files in os.walk(directory) for f in files)


def token_blocks(dataset, tokenizer, text_column: str = "text", block_size: int = 256) -> list[dict]:
    """Rows of ``block_size`` token ids (the last one shorter): the texts concatenated, EOS-separated."""
    if "input_ids" in dataset.column_names:
        return [{"input_ids": list(ids)} for ids in dataset["input_ids"] if len(ids) > 1]
    if text_column not in dataset.column_names:
        raise ValueError(f"no column {text_column!r} in the dataset (columns: {dataset.column_names}); use --text-column")
    stream: list[int] = []
    eos = tokenizer.eos_token_id
    for text in dataset[text_column]:
        if text:
            stream.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
            if eos is not None:
                stream.append(eos)
    blocks = [stream[i:i + block_size] for i in range(0, len(stream), block_size)]
    return [{"input_ids": b} for b in blocks if len(b) > 1]
