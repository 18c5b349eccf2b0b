"""Sizes and devices the RBE code needs, read without touching parameter data.

Outside a module's call its parameters may not hold their data: DeepSpeed ZeRO-3 leaves an empty
placeholder (the full shape in ``ds_shape``), FSDP2 a DTensor shard (whose ``shape`` is the full one),
accelerate's offloading (``device_map`` "cpu"/"disk") a meta tensor.  And a collective must get
tensors on a device its backend serves: NCCL takes CUDA tensors only.
"""

from __future__ import annotations

import torch

from ..patching.sharding import full_shape

# backends that take CPU tensors (a "cpu:gloo,cuda:nccl" pair names the CPU's explicitly)
_CPU_BACKENDS = ("gloo", "mpi", "ccl", "ucc")


def head_vocab_size(model) -> int:
    """Rows of the output embedding: the vocabulary the ranks of the fused sweep run over."""
    head = model.get_output_embeddings()
    weight = getattr(head, "weight", None) if head is not None else None
    full = full_shape(weight) if isinstance(weight, torch.Tensor) else ()  # ZeRO-3's, DTensor's, meta's too
    if len(full) == 2 and full[0] > 0 and full[1] > 0:
        return full[0]
    rows = getattr(head, "out_features", None)  # nn.Linear, PEFT's LoRA layers: an empty FSDP1 view
    if isinstance(rows, int) and rows > 0:
        return rows
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    vocab = getattr(text, "vocab_size", None)
    if isinstance(vocab, int) and vocab > 0:
        return vocab
    raise ValueError(f"cannot tell the vocabulary size of {type(model).__name__}: its output embedding has no "
                     "weight of known shape and its config no vocab_size")


def input_device(model) -> torch.device:
    """Where the model's inputs go: where its input embedding runs (accelerate's hook moves an offloaded
    module's weight to its execution device for the call), else where its weights are."""
    try:
        embed = model.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        embed = None
    hook = getattr(embed, "_hf_hook", None)
    for h in getattr(hook, "hooks", [hook]):  # a SequentialHook holds several
        device = getattr(h, "execution_device", None)
        if device is not None:
            return torch.device(device)
    weights = [embed.weight] if isinstance(getattr(embed, "weight", None), torch.Tensor) else []
    for p in [*weights, *model.parameters()]:
        if not p.is_meta:
            return p.device
    return torch.device("cpu")


def collective_device(group=None) -> torch.device:
    """The device a tensor must be on for a collective of ``group`` (an initialised process group): the
    CPU when the backend takes CPU tensors, else this process's accelerator (NCCL: its current CUDA device)."""
    import torch.distributed as dist

    backend = str(dist.get_backend(group)).lower()
    for part in backend.split(","):
        device, _, name = part.strip().rpartition(":")
        if device == "cpu" or (not device and name in _CPU_BACKENDS):
            return torch.device("cpu")
    if "nccl" in backend:
        return torch.device("cuda", torch.cuda.current_device())
    accelerator = torch.accelerator.current_accelerator() if hasattr(torch, "accelerator") else None
    if accelerator is None:
        return torch.device("cpu")
    return torch.device(accelerator.type, torch.accelerator.current_device_index())
