"""Command line.

    hf-mhce train [options | config.json | config.yaml]   the main job (``hf-mhce train --help``)
    hf-mhce rbe MODEL --dataset DATA  the RBE decomposition of a causal LM's cross-entropy
    hf-mhce demo                      the fused ops on a random problem (no downloads)
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch

TRUST_REMOTE_CODE = "--trust-remote-code"


def _demo(args: argparse.Namespace) -> int:
    import torch.nn.functional as F

    from .losses import multi_head_cross_entropy, multi_head_logprobs

    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    n, v, d = args.tokens, args.vocab, args.hidden
    hidden = torch.randn(n, d, device=device, dtype=dtype, requires_grad=True)
    weight = (torch.randn(v, d, device=device) / math.sqrt(d)).to(dtype).requires_grad_()
    labels = torch.randint(0, v, (n,), device=device)
    if n > 1:  # about 8 ignored positions; a step of 1 (fewer than 16 tokens) left no target: NaN losses
        labels[:: max(2, n // 8)] = -100

    print(f"tokens={n} vocab={v} hidden={d} dtype={args.dtype} device={device}")
    print(f"float32 logits would take {n * v * 4 / 2**20:.1f} MiB; the fused ops never build them\n")
    print(f"{'loss':<22}{'value':>12}{'fwd+bwd s':>12}{'|dX| rel. diff':>16}")
    t0 = time.perf_counter()
    logits = (hidden @ weight.T).float()
    eager = F.cross_entropy(logits, labels)
    eager.backward()
    eager_time = time.perf_counter() - t0
    eager_grad = hidden.grad.clone()
    del logits
    print(f"{'HF eager (logits)':<22}{eager.item():>12.6f}{eager_time:>12.3f}{'-':>16}")
    for heads in args.heads:
        hidden.grad = None
        t0 = time.perf_counter()
        loss = multi_head_cross_entropy(hidden, weight, labels, heads)
        loss.backward()
        elapsed = time.perf_counter() - t0
        name = "fused CE" if heads == 1 else f"fused MHCE H={heads}"
        if heads == 1:  # MHCE is another loss: no eager gradient to compare with
            diff = ((hidden.grad.float() - eager_grad.float()).norm() / eager_grad.float().norm()).item()
            cell = f"{diff:.2e}"
        else:
            cell = "-"
        print(f"{name:<22}{loss.item():>12.6f}{elapsed:>12.3f}{cell:>16}")
    with torch.no_grad():
        logp = multi_head_logprobs(hidden[:4], weight, max(args.heads))
    print(f"\nmixture log-probs (H={max(args.heads)}) of {len(logp)} tokens sum to {logp.exp().sum(-1).tolist()}")
    return 0


def _rbe(args: argparse.Namespace) -> int:
    import json

    from .rbe.data import (DataError, block_size_refusal, hub_lookup_failed, load_texts, load_tokenizer,
                           looks_like_a_path, remote_code_option, token_blocks)
    from .patching.families import UnsupportedModelError
    from .patching.head import UnsupportedHeadError
    from .rbe.evaluate import as_row, evaluate
    from .rbe.plots import MISSING, available, plot_rank_distribution

    def trusting():  # around every load of the checkpoint: a refusal of its custom code names the flag
        return remote_code_option(TRUST_REMOTE_CODE, SystemExit)

    # the cheap checks first: a wrong argument is named before the model and the data are loaded
    # (--device, --json and --plot are checked by argparse)
    if looks_like_a_path(args.model) and not os.path.exists(os.path.expanduser(args.model)):  # not a hub id either
        raise SystemExit(f"hf-mhce rbe: no such checkpoint directory: {args.model!r} (MODEL is a checkpoint "
                         "directory or a hub id)")
    if os.path.isfile(os.path.expanduser(args.model)):  # transformers failed on it with two chained tracebacks
        raise SystemExit(f"hf-mhce rbe: {args.model!r} is a file, not a checkpoint directory (MODEL is a checkpoint "
                         "directory or a hub id)")
    if args.plot and not available():
        raise SystemExit(f"--plot: {MISSING}")
    try:
        with trusting():
            limit, limit_name = _max_positions(args.model, args.trust_remote_code)
    except OSError as err:
        said = hub_lookup_failed(args.model, err)
        if said is None:
            raise
        raise SystemExit(f"hf-mhce rbe: {said}") from err
    block_size = args.block_size if args.block_size is not None else min(256, limit or 256)
    too_long = block_size_refusal("--block-size", block_size, args.model, limit, limit_name)
    if too_long:
        raise SystemExit(too_long)
    try:
        with trusting():
            tokenizer, tokenizer_source = load_tokenizer(args.tokenizer, args.model, args.trust_remote_code)
        data = load_texts(args.dataset, args.split, args.dataset_config)
        rows = token_blocks(data, tokenizer, args.text_column, block_size)
    except DataError as err:
        raise SystemExit(str(err)) from err
    if args.max_blocks is not None:
        rows = rows[: args.max_blocks]
    if not rows:
        raise SystemExit(f"no evaluation text in {args.dataset!r}")
    low = top = 0
    for i, row in enumerate(rows):  # a saved token-id dataset's rows (integer ids, labels) before the model loads
        try:
            ids = as_row(row, i)["input_ids"]
        except (TypeError, ValueError) as err:
            raise SystemExit(f"{args.dataset!r}: {err}") from err
        if ids.numel():
            low, top = min(low, int(ids.min())), max(top, int(ids.max()))
    if low < 0:
        raise SystemExit(f"{args.dataset!r} holds token id {low}: token ids are never negative")
    longest = max(len(r["input_ids"]) for r in rows)  # token-id datasets keep their own row lengths
    if limit is not None and longest > limit:
        raise SystemExit(f"{args.dataset!r} has rows of up to {longest} token ids, more than the {limit} positions "
                         f"{args.model} takes")

    try:
        with trusting():
            model = _load_model(args.model, args.trust_remote_code)
    except (ValueError, UnsupportedModelError, UnsupportedHeadError) as err:  # the checkpoint's saved loss, its model
        raise SystemExit(f"cannot evaluate {args.model}: {err}") from err
    vocab = model.get_input_embeddings().weight.shape[0]
    if top >= vocab:
        raise SystemExit(f"the tokenizer from {tokenizer_source} gives token id {top}, but {args.model} has {vocab} "
                         "token embeddings: it is not the model's tokenizer (pass that one with --tokenizer)")
    model.to(args.device)
    report = evaluate(model, rows, batch_size=args.batch_size, device=args.device, progress=not args.no_progress)
    print(f"RBE decomposition of {args.model} on {args.dataset} ({len(rows)} blocks)")
    print(report.table())
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "dataset": args.dataset, "dataset_config": args.dataset_config,
                       "split": args.split, "text_column": args.text_column, "tokenizer": tokenizer_source,
                       "block_size": block_size, "blocks": len(rows), **report.as_dict()}, f, indent=2)
        print(f"wrote {args.json}")
    if args.plot:
        print(f"wrote {plot_rank_distribution(report.stats, args.plot, args.model)}")
    return 0


def _max_positions(model: str, trust_remote_code: bool = False) -> tuple[int | None, str | None]:
    """The longest input the model's config allows, and the config field that says so."""
    from .patching.config import adapter_base, checkpoint_config
    from .rbe.data import config_max_positions

    if adapter_base(model) is None and os.path.isdir(model) and not os.path.isfile(os.path.join(model, "config.json")):
        return None, None  # not a checkpoint: loading it says why
    return config_max_positions(checkpoint_config(model, trust_remote_code)[1])


def _load_model(path: str, trust_remote_code: bool = False):
    """hf_mhce.from_pretrained, refusing a checkpoint whose LM head is not in it (a sequence classifier,
    a bare LlamaModel): transformers would initialise the head at random and the report describe noise."""
    from .patching import from_pretrained

    if os.path.isfile(os.path.join(path, "adapter_config.json")) or (
            os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json"))):
        # a PEFT adapter (its base has the head), or a directory it explains
        return from_pretrained(path, trust_remote_code=trust_remote_code)
    model, info = from_pretrained(path, output_loading_info=True, trust_remote_code=trust_remote_code)
    head = model.get_output_embeddings()
    names = {n for n, p in model.named_parameters(remove_duplicate=False) if head is not None and p is head.weight}
    # a tied head (GPT-2's lm_head) is not missing when the embedding it shares is in the checkpoint
    missing = sorted(names & set(info.get("missing_keys", ())))
    if head is None or missing:
        saved_as = ", ".join(getattr(model.config, "architectures", None) or ["?"])
        raise SystemExit(f"{path} has no language-model head (saved as {saved_as}; {', '.join(missing) or 'no head'} "
                         "not in the checkpoint), so transformers would evaluate a randomly initialised one: "
                         "hf-mhce rbe needs a causal LM checkpoint (...ForCausalLM, ...LMHeadModel)")
    return model


def _whole_number(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None


def positive_int(text: str) -> int:
    """argparse type of counts and sizes: 0 or less is refused at once, with the option's name (a
    --max-blocks -1 evaluated all blocks but one, a --batch-size 0 failed in the DataLoader)."""
    value = _whole_number(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value}: must be a positive whole number")
    return value


def torch_device(text: str) -> str:
    """argparse type of --device: a device torch parses and this machine has, refused by name before
    anything loads ("bogus", or "cuda" on a CPU-only torch, failed after the model was loaded)."""
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a torch device (cpu, cuda, cuda:1, mps, ...)") from None
    if device.type == "cpu":
        return text
    if device.type == "mps":
        count = int(torch.backends.mps.is_available())
    else:  # torch.cuda, torch.xpu, ...
        backend = getattr(torch, device.type, None)
        count = backend.device_count() if hasattr(backend, "device_count") and backend.is_available() else 0
    if (device.index or 0) >= count:
        found = f"{count} {device.type} device(s)" if count else f"no {device.type} device"
        raise argparse.ArgumentTypeError(f"{text!r} is not available here ({found} with torch {torch.__version__})")
    return text


def output_file(text: str) -> str:
    """argparse type of an output file (--json, --plot): its directory must exist and be writable; checked
    before anything loads (a missing directory failed after the whole evaluation)."""
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is a directory, not a file")
    parent = os.path.dirname(text) or "."
    if not os.path.isdir(parent):
        raise argparse.ArgumentTypeError(f"{text!r}: no such directory {parent!r} (create it first)")
    if not os.access(parent, os.W_OK):
        raise argparse.ArgumentTypeError(f"{text!r}: the directory {parent!r} is not writable")
    return text


def _block_size(text: str) -> int:
    value = _whole_number(text)
    if value < 2:
        raise argparse.ArgumentTypeError(f"{value}: a block needs at least 2 tokens (an input and its target)")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-mhce", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # the usage lines as written
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("train", help="the main job: train with CE/MHCE + RBE evaluation (see hf-mhce train --help)")
    demo = sub.add_parser("demo", help="run the fused CE / MHCE ops on a random problem")
    demo.add_argument("--tokens", type=positive_int, default=2048)
    demo.add_argument("--vocab", type=positive_int, default=32000)
    demo.add_argument("--hidden", type=positive_int, default=256)
    demo.add_argument("--heads", type=positive_int, nargs="+", default=[1, 4])
    demo.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32")
    demo.add_argument("--device", type=torch_device, default="cuda" if torch.cuda.is_available() else "cpu")
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(func=_demo)

    rbe = sub.add_parser("rbe", help="RBE decomposition of a causal LM's cross-entropy on a dataset")
    rbe.add_argument("model", help="checkpoint directory or hub id (loaded with hf_mhce.from_pretrained)")
    rbe.add_argument("--dataset", required=True,
                     help="a datasets name, a saved dataset directory, a folder of data files, or a file: "
                          ".txt/.json/.jsonl/.csv/.parquet read by type, any other text file as plain text, each but "
                          ".parquet also as .gz/.bz2/.xz "
                          "(a text file is one document: EOS between files, never between its lines)")
    rbe.add_argument("--dataset-config", default=None, help="configuration name of a datasets dataset")
    rbe.add_argument("--split", default=None,
                     help="split of a dataset with splits (default: test); a single file or saved Dataset has none "
                          "and is evaluated whole")
    rbe.add_argument("--text-column", default="text", help="column holding the text (default: text)")
    rbe.add_argument("--tokenizer", default=None, help="defaults to the model's")
    rbe.add_argument("--block-size", type=_block_size, default=None,
                     help="tokens per evaluated block, at least 2 and at most the model's positions "
                          "(default: 256, or the model's positions if fewer)")
    rbe.add_argument("--batch-size", type=positive_int, default=8, help="blocks per forward (default: 8)")
    rbe.add_argument("--max-blocks", type=positive_int, default=None, help="evaluate at most this many blocks")
    rbe.add_argument("--device", type=torch_device, default="cuda" if torch.cuda.is_available() else "cpu",
                     help="device of the model (default: cuda where available, else cpu)")
    rbe.add_argument("--json", type=output_file, default=None,
                     help="write the report as JSON to this file (its directory must exist): the metrics with the model, "
                          "dataset, split, text column, tokenizer, block size and number of blocks evaluated")
    rbe.add_argument("--plot", type=output_file, default=None,
                     help="write the rank distribution (log-log PNG) to this file (its directory must exist)")
    rbe.add_argument("--no-progress", action="store_true")
    rbe.add_argument(TRUST_REMOTE_CODE, action="store_true",
                     help="run the custom modeling code a checkpoint carries (auto_map in its config.json: the model, "
                          "config or tokenizer class): set it only for checkpoints you trust and whose code you have "
                          "read, as it executes that code on this machine")
    rbe.set_defaults(func=_rbe)
    return parser


def main(argv: list[str] | None = None) -> int:
    from .losses.dispatch import check_environment
    from .ops.budget import SettingError

    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        if not {"-h", "--help"} & set(argv):  # help is printed whatever the environment
            check_environment()  # a bad HF_MHCE_* value: one line naming it, before any work
    except SettingError as err:
        print(f"hf-mhce: error: {err}", file=sys.stderr)
        return 2
    if argv and argv[0] == "train":  # HfArgumentParser owns every option of the main job
        from .train import cli as train_cli

        return train_cli(argv[1:])
    if argv and argv[0] == "rbe":  # train's spelling (--block_size) too: rbe's option names use "-"
        argv = [_dashed(a) for a in argv]
    parser = build_parser()
    args = parser.parse_args(argv)
    bad = [h for h in getattr(args, "heads", ()) if args.hidden % h]
    if bad:  # a usage error, as every other bad option
        parser.error(f"--heads {bad}: every head count must divide --hidden {args.hidden}")
    try:
        return args.func(args)
    except SystemExit as err:  # a refusal of the checkpoint or the data: as a usage error, like hf-mhce train's
        if not isinstance(err.code, str):
            raise
        prog = f"{parser.prog} {args.command}"
        print(f"{prog}: error: {err.code.removeprefix(prog + ': ')}", file=sys.stderr)
        raise SystemExit(2) from None


def _dashed(arg: str) -> str:
    if not arg.startswith("--"):
        return arg
    name, eq, value = arg.partition("=")
    return name.replace("_", "-") + eq + value


if __name__ == "__main__":
    sys.exit(main())
