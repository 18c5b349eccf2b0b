"""Loading evaluation text for the RBE CLI: a datasets name, a saved dataset or text files,
tokenised and cut into blocks of a fixed number of tokens."""

from __future__ import annotations

import bz2
import codecs
import contextlib
import gzip
import lzma
import os

from ..patching.config import adapter_base

_FILE_TYPES = {".txt": "text", ".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}
# compressed files datasets' loaders read as they are (data.jsonl.gz), opened here with the same codec
_COMPRESSED = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}
# A name ending like this, or written as a path, is a local file even when it does not exist: never
# sent to the Hub (whose ids are "name" or "owner/name"), where it would only fail after retries.
_PATH_SUFFIXES = (*_FILE_TYPES, ".md", ".text", ".rst", ".log", ".tsv", ".arrow", ".gz", ".bz2", ".xz", ".zst", ".zip")
# datasets' name for the only split of data without splits (a single file, a saved Dataset)
_WHOLE = "train"
# A text file is one document, as a pretraining corpus's files are: its line breaks stay in the text
# and token_stream's EOS marks where the file ends (datasets' default, a row per line, made every line
# break an EOS).
_TEXT_OPTIONS = {"sample_by": "document"}
# transformers' label of a position that is no target
IGNORE_INDEX = -100


def config_max_positions(config) -> tuple[int | None, str | None]:
    """The longest input a model ``config`` allows, and its field that says so ((None, None): none)."""
    for name in ("max_position_embeddings", "n_positions", "n_ctx", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value, name
    return None, None


def block_size_refusal(option: str, block_size: int, model: str, limit: int | None, limit_name: str | None) -> str | None:
    """Why blocks of ``block_size`` tokens are too long for ``model`` (None: they fit); a longer input
    fails inside the model's position embedding (an IndexError mid-run)."""
    if limit is None or block_size <= limit:
        return None
    return (f"{option} {block_size} is more than the {limit} positions {model} takes ({limit_name} in its config): "
            f"pass {option} {limit} or less")


class DataError(ValueError):
    """Evaluation data that cannot be used; the message names the data and what to do."""


class RemoteCodeRefused(ValueError):
    """A checkpoint whose model (config, tokenizer) is custom code, loaded without the option to run it."""


def refuses_remote_code(err: BaseException) -> bool:
    """transformers' refusal to run a checkpoint's custom code (its message asks for trust_remote_code=True)."""
    return isinstance(err, ValueError) and "trust_remote_code=True" in str(err)


@contextlib.contextmanager
def remote_code_option(option: str, error: type[BaseException] = RemoteCodeRefused):
    """Loads of a checkpoint for a command line: transformers' refusal of its custom code names the Python
    argument trust_remote_code=True, which a command-line user cannot pass; raised again as ``error``
    naming ``option``, the command's flag for it."""
    try:
        yield
    except ValueError as err:
        if not refuses_remote_code(err):
            raise
        what = str(err).split(" You can inspect")[0].strip()  # "The repository X contains custom code ..."
        raise error(f"{what} Pass {option} to run it (only for code you trust: it runs on this machine)") from None


def load_texts(path_or_name: str, split: str | None = None, config: str | None = None, split_option: str = "--split"):
    """A datasets.Dataset from a saved dataset directory, a data file, a folder of data files, or a
    hub/local dataset name.

    A file ending in .txt/.json/.jsonl/.csv/.parquet is read by datasets' loader for that type, any
    other UTF-8 text file as plain text, each but parquet also when gzip/bzip2/xz-compressed (data.jsonl.gz); a
    plain text file is one row (a document), as is each file of a folder of .txt files.  A folder
    mixing types (.txt and .jsonl, say) is refused: datasets would read one type and drop the others.
    ``split`` (default "test") picks a split of a dataset with splits; a single file or a saved Dataset
    has none and is read whole, so a split other than "train" (datasets' name for it) is refused rather
    than ignored.  ``split_option``: the caller's name for ``split`` in messages.
    """
    import datasets

    path = os.path.expanduser(path_or_name)
    options = {}
    if os.path.isdir(path):
        if any(os.path.exists(os.path.join(path, f)) for f in ("dataset_info.json", "dataset_dict.json")):
            try:
                ds = datasets.load_from_disk(path)
            except IndexError:  # datasets reads no data file of a Dataset saved without rows
                raise DataError(f"no rows in the saved dataset {path_or_name!r}") from None
            if isinstance(ds, datasets.DatasetDict):
                return _pick_split(ds, split, path_or_name, split_option)
            _check_whole(path_or_name, split, "a saved Dataset", split_option)
            return ds
        kinds = _data_file_kinds(path)
        if not kinds:
            raise DataError(f"{path_or_name!r} is a directory but neither a saved dataset (datasets' save_to_disk) nor "
                            f"a folder of data files ({', '.join(sorted(_FILE_TYPES))})")
        if len(kinds) > 1:
            found = ", ".join(f"{kind} ({'/'.join(sorted(exts))})" for kind, exts in sorted(kinds.items()))
            raise DataError(f"{path_or_name!r} mixes data files of different types: {found}; datasets would read one "
                            "type and drop the others: put each type in its own folder, or convert them to one type")
        if set(kinds) == {"text"}:
            options = _TEXT_OPTIONS
    elif os.path.isfile(path):
        return _load_file(path_or_name, path, split, split_option)
    elif looks_like_a_path(path_or_name):
        raise DataError(f"no such file or directory: {path_or_name!r}")
    try:
        ds = datasets.load_dataset(path, config, **options)
    except datasets.exceptions.DatasetGenerationError as err:  # a bad row in one of a folder's files, say
        raise DataError(f"could not read {path_or_name!r}: {err.__cause__ or err}") from err
    except (FileNotFoundError, ConnectionError, ValueError) as err:
        if os.path.isdir(path):  # e.g. files in subfolders of different types, read as splits of different formats
            raise DataError(f"datasets could not read the folder {path_or_name!r} as a dataset: {err}") from err
        if isinstance(err, ValueError):
            raise
        raise DataError(f"{path_or_name!r} is no local file or directory, and loading it as a dataset name "
                        f"failed: {err}") from err
    return _pick_split(ds, split, path_or_name, split_option) if isinstance(ds, datasets.DatasetDict) else ds


def _load_file(name: str, path: str, split: str | None, split_option: str):
    import datasets

    _check_whole(name, split, "a single file", split_option)
    try:
        if not _has_text(path):
            raise DataError(f"no text in {name!r}: the file is empty or holds only whitespace")
        kind = _FILE_TYPES.get(_extension(path))
        if kind is None:
            if not _is_utf8_text(path):
                raise DataError(f"{name!r} is neither a text file nor one of the data files datasets reads "
                                f"({', '.join(sorted(_FILE_TYPES))}; all but .parquet also {'/'.join(_COMPRESSED)}-"
                                "compressed): convert it to one of them")
            kind = "text"
    except (OSError, EOFError, lzma.LZMAError) as err:  # a corrupt or truncated compressed file, say
        compressed = os.path.splitext(path.lower())[1] in _COMPRESSED
        raise DataError(f"could not {'decompress' if compressed else 'read'} {name!r}: {err}") from None
    try:
        return datasets.load_dataset(kind, data_files=path, split=_WHOLE, **(_TEXT_OPTIONS if kind == "text" else {}))
    except datasets.exceptions.DatasetGenerationError as err:  # the cause names the parse error
        raise DataError(f"could not read {name!r} as {kind}: {err.__cause__ or err}") from err
    except ValueError as err:  # datasets' 'Instruction "train" corresponds to no data!' (a header, or [])
        if "corresponds to no data" not in str(err):
            raise
        raise DataError(f"no rows in {name!r}: datasets read it as {kind} and found none") from None


def _pick_split(ds, split: str | None, name: str, split_option: str):
    split = split or "test"
    if split not in ds:
        raise DataError(f"dataset {name!r} has splits {list(ds)}, not {split!r} (use {split_option})")
    return ds[split]


def _check_whole(name: str, split: str | None, what: str, split_option: str) -> None:
    if split not in (None, _WHOLE):
        raise DataError(f"{name!r} is {what}, which has no splits and is read whole: leave out {split_option} "
                        f"(got {split!r})")


def _extension(path: str) -> str:
    """The extension of the data inside: ".jsonl" for data.jsonl.gz (a compressed parquet, which pyarrow cannot
    read, keeps its whole ".parquet.gz", a type of no loader)."""
    stem, ext = os.path.splitext(path.lower())
    if ext not in _COMPRESSED:
        return ext
    inner = os.path.splitext(stem)[1]
    return inner + ext if inner == ".parquet" else inner


def _open(path: str):
    return _COMPRESSED.get(os.path.splitext(path.lower())[1], open)(path, "rb")


def _has_text(path: str) -> bool:
    with _open(path) as f:
        while chunk := f.read(1 << 16):
            if chunk.strip():
                return True
    return False


def _is_utf8_text(path: str) -> bool:
    with _open(path) as f:
        head = f.read(1 << 16)
    try:  # incremental: a character cut at the end of the sample is not an error
        codecs.getincrementaldecoder("utf-8")().decode(head, final=False)
    except UnicodeDecodeError:
        return False
    return b"\0" not in head


# what a directory holding a tokenizer has at least one of (fast, sentencepiece, BPE/WordPiece vocabularies)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                    "spiece.model", "sentencepiece.bpe.model", "tekken.json")


def has_tokenizer_files(directory: str) -> bool:
    return any(os.path.isfile(os.path.join(directory, f)) for f in _TOKENIZER_FILES)


def looks_like_a_path(name: str) -> bool:
    """A name written as a local path (never a Hub id, which is "name" or "owner/name")."""
    return (os.path.isabs(name) or name.startswith((".", "~")) or "\\" in name or name.count("/") > 1
            or name.lower().endswith(_PATH_SUFFIXES))


def hub_lookup_failed(name: str, err: BaseException) -> str | None:
    """What to say when ``name`` is no local path and loading it as a Hub id failed: a mistyped local path
    such as ``outputs/hf-mhce-trian`` reads as "owner/name", and transformers' answer (an internet-connection
    OSError after retries) would not name it.  None where ``name`` exists locally (that error is the real one)."""
    if os.path.exists(os.path.expanduser(name)):
        return None
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    parent = name.split("/", 1)[0] if "/" in name else None
    hint = (f"; {parent!r} is a local directory, so this is likely a mistyped path: "
            f"no {name!r} exists there" if parent and os.path.isdir(os.path.expanduser(parent)) else "")
    return f"{name!r} is no local directory, and loading it as a Hub id failed ({first}){hint}"


def _data_file_kinds(directory: str) -> dict[str, set[str]]:
    """datasets' loader for each type of data file under ``directory`` -> the extensions found."""
    known = {**_FILE_TYPES, ".arrow": "arrow"}  # what datasets' folder loader reads (datasets 4 runs no scripts)
    kinds: dict[str, set[str]] = {}
    for _, _, files in os.walk(directory):
        for f in files:
            ext = _extension(f)
            if ext in known:
                kinds.setdefault(known[ext], set()).add(ext)
    return kinds


def token_blocks(dataset, tokenizer, text_column: str = "text", block_size: int = 256,
                 column_option: str = "--text-column") -> list[dict]:
    """Rows of ``block_size`` token ids (the last one shorter): the texts of ``text_column`` concatenated
    by token_stream.  ``column_option``: the caller's name for ``text_column`` in messages.

    A dataset that has an ``input_ids`` column is used as it is, a row per example; its
    ``attention_mask`` goes with a row only where it masks something (padding), as evaluate's
    collator then leaves those positions out of the targets of a row without labels; its ``labels``
    (unshifted, -100 where no target, e.g. a masked prompt or padding) replace the ones evaluate would
    make from ``input_ids``, and are used as given.
    """
    if block_size < 2:
        raise DataError(f"block size {block_size}: a block needs at least 2 tokens (an input and its target)")
    if "input_ids" in dataset.column_names:
        return _id_rows(dataset)
    stream = token_stream(column_texts(dataset, text_column, column_option), tokenizer)
    blocks = [stream[i:i + block_size] for i in range(0, len(stream), block_size)]
    return [{"input_ids": b} for b in blocks if len(b) > 1]


def _id_rows(dataset) -> list[dict]:
    columns = dataset.column_names
    if "position_ids" in columns:  # rows padded per batch cannot keep them: packed sequences would read as one
        raise DataError("the dataset has a position_ids column (sequences packed in a row?), which hf-mhce rbe cannot "
                        "keep: save the sequences as separate rows of input_ids")
    masks = dataset["attention_mask"] if "attention_mask" in columns else None
    labels = dataset["labels"] if "labels" in columns else None
    rows = []
    for i, ids in enumerate(dataset["input_ids"]):
        row = {"input_ids": list(ids)}
        if masks is not None and 0 in masks[i]:
            check_aligned(i, "attention_mask", masks[i], ids)
            row["attention_mask"] = list(masks[i])
        if labels is not None:
            check_aligned(i, "labels", labels[i], ids)
            row["labels"] = list(labels[i])
            targets = sum(label != IGNORE_INDEX for label in row["labels"][1:])  # the first label predicts nothing
        else:
            targets = (sum(row["attention_mask"]) if "attention_mask" in row else len(row["input_ids"])) - 1
        if targets > 0:  # a single token, or labels all ignored, is no target
            rows.append(row)
    return rows


def check_aligned(index: int | str, name: str, values, input_ids) -> None:
    """Row ``index``'s ``labels`` or ``attention_mask`` has one entry per input id, else a DataError naming
    the row and both lengths (shared by hf-mhce rbe's token-id datasets and hf_mhce.rbe.evaluate)."""
    if len(values) != len(input_ids):
        what = f"unshifted, {IGNORE_INDEX} where no target" if name == "labels" else "1 for a token, 0 for padding"
        raise DataError(f"row {index} has {len(values)} {name} for {len(input_ids)} input_ids: {name} must align "
                        f"with input_ids, one per token id ({what})")


def column_texts(dataset, column: str, option: str) -> list[str]:
    """The texts of ``column``, blank ones (empty, None, whitespace only) left out.  A column that holds
    no strings (chat messages, numbers, token lists) is refused naming its type; ``option``: the
    caller's flag for the column."""
    if column not in dataset.column_names:
        raise DataError(f"no column {column!r} in the dataset (columns: {dataset.column_names}); use {option}")
    feature = dataset.features[column]
    if getattr(feature, "dtype", None) not in ("string", "large_string"):
        inner = getattr(feature, "feature", None)
        chat = isinstance(inner, dict) and "content" in inner
        raise DataError(f"column {column!r} holds {feature}, not text (a string per row): pass a column of strings "
                        f"with {option}" + ("; render chat messages to a string column first (e.g. with the "
                                            "tokenizer's apply_chat_template(..., tokenize=False))" if chat else ""))
    try:  # datasets' json reader keeps bytes that are not UTF-8; reading the column decodes them
        texts = list(dataset[column])  # a lazy column in datasets 4: decoded as it is read
    except UnicodeDecodeError as err:
        raise DataError(f"column {column!r} is not UTF-8 text ({err}): convert the file to UTF-8") from None
    return [text for text in texts if text and not text.isspace()]


def bos_prefix(tokenizer) -> list[int]:
    """[BOS] where the tokenizer starts what it encodes with it (Llama's), else [] (GPT-2's adds nothing):
    a document, or a prompt, then starts as the model sees text at inference."""
    bos = tokenizer.bos_token_id
    if bos is None:
        return []
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    ids = tokenizer("a")["input_ids"]
    return [bos] if ids[:1] == [bos] and ids[1:len(plain) + 1] == plain else []


def token_stream(texts, tokenizer) -> list[int]:
    """The token ids of the non-empty ``texts`` (documents), concatenated, each preceded by BOS where the
    tokenizer adds one (bos_prefix) and followed by its EOS where it has one (a tokenizer without EOS,
    e.g. a WordLevel one, has None there: no separator then).  Shared by both command lines (``hf-mhce
    rbe``, ``hf-mhce train``).  A stream of special tokens only is refused: the tokenizer is not the
    text's."""
    stream: list[int] = []
    first = bos_prefix(tokenizer)
    last = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    for text in texts:
        if text:
            stream += first + tokenizer(text, add_special_tokens=False)["input_ids"] + last
    special = set(tokenizer.all_special_ids)
    if stream and all(t in special for t in stream):  # e.g. all <unk>, or nothing but the EOS separators
        raise DataError(f"the tokenizer ({type(tokenizer).__name__}, {len(tokenizer)} tokens) turns the text into "
                        f"special tokens only ({len(stream)} of them): it is not this text's (or the model's) "
                        "tokenizer; pass the model's with --tokenizer")
    return stream


def load_tokenizer(tokenizer: str | None, model: str, trust_remote_code: bool = False):
    """(tokenizer, where from): --tokenizer, else the model's, else a PEFT adapter's base model's.  A
    directory without tokenizer files is refused: AutoTokenizer would build an empty tokenizer from the
    model's config (GPT-2), or fail asking for sentencepiece (Llama).  ``--tokenizer`` in messages is the
    option of both command lines; a refusal of custom code is left to the caller's remote_code_option."""
    from transformers import AutoTokenizer

    source, where = tokenizer or model, tokenizer or model
    if tokenizer is None and os.path.isdir(model) and not has_tokenizer_files(model) and adapter_base(model):
        # an adapter saved without the tokenizer: its base model's is the one
        source = adapter_base(model)
        where = f"{model} nor in its base model {source}"
    if os.path.isdir(source) and not has_tokenizer_files(source):
        raise DataError(f"no tokenizer in {where}: pass --tokenizer (a directory or hub id with the model's "
                        "tokenizer)")
    try:
        # False, not None: None makes transformers prompt on a terminal (and wait 15 s) for custom code
        loaded = AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as err:
        if refuses_remote_code(err):
            raise
        hint = "check --tokenizer" if tokenizer else "pass the model's tokenizer with --tokenizer"
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise DataError(f"could not load a tokenizer from {source} ({first}): {hint}") from err
    if len(loaded) < 2:
        raise DataError(f"the tokenizer loaded from {source} has {len(loaded)} token(s), no vocabulary: pass the "
                        "model's tokenizer with --tokenizer")
    return loaded, source
