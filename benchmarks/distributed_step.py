"""Memory and time of one distributed training step, patched vs unpatched (issue P5).

    python benchmarks/distributed_step.py                       # 2 CPU processes (gloo), DDP and FSDP2
    python benchmarks/distributed_step.py --vocab 32000 --seq 256 --wraps ddp

Every configuration runs in its own pair of fresh processes (torch.multiprocessing, gloo): a Llama
with a large vocabulary (default V=128256, the Llama-3 tokenizer's, hidden 256, 2 layers) is built
with the same seed, wrapped (DDP, or FSDP2 with layers as units and the head in the root unit),
optionally patched (hf_mhce CE, or MHCE with 4 heads), and trained for --steps steps of --batch rows x
--seq tokens per process (forward, backward, AdamW step).  After one warm-up step, the peak resident
set size (VmHWM, reset through /proc/self/clear_refs) above the RSS before the step is the step's
extra memory; the time is the median step.  Reported per process (the maximum over the two).
Writes benchmarks/results/distributed_step_cpu-<date>.json and .md (non-default options added to the
name: records.py's rule).  CPU only (gloo); the GPU
variant (NCCL, bf16) is owed to the device runs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import tempfile
import time

import torch
import torch.multiprocessing as mp
from proc_memory import reset_peak, status_bytes
from records import Record, add_out_options, positive_int


def _worker(rank: int, world: int, port: int, cfg: dict, out: str) -> None:
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    import hf_mhce

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(cfg["threads"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=cfg["vocab"], hidden_size=cfg["hidden"], num_hidden_layers=cfg["layers"],
                                         intermediate_size=cfg["hidden"] * 8 // 3 // 32 * 32, num_attention_heads=4,
                                         num_key_value_heads=4, max_position_embeddings=cfg["seq"]))
    if cfg["mode"] == "ce":
        hf_mhce.apply_patch(model, loss="ce")
    elif cfg["mode"] == "mhce":
        hf_mhce.apply_patch(model, loss="mhce", num_heads=4)
    if cfg["wrap"] == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(1 + rank)
    ids = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"]), generator=g)

    def step():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        return loss.item()

    step()  # warm-up: gradients, optimizer state, thread pools
    baseline = reset_peak()
    times, losses = [], []
    for _ in range(cfg["steps"]):
        dist.barrier()
        t0 = time.perf_counter()
        losses.append(step())
        times.append(time.perf_counter() - t0)
    row = {"rank": rank, "baseline_mb": baseline / 2**20, "extra_mb": (status_bytes("VmHWM") - baseline) / 2**20,
           "step_seconds": statistics.median(times), "loss": losses[-1]}
    rows = [None] * world
    dist.all_gather_object(rows, row)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(rows, f)
    dist.barrier()
    # Leave without tearing down: freeing the DDP reducer after the step sometimes deadlocks inside
    # ProcessGroupGloo's destructor (torch 2.13: a gloo worker thread waits for the GIL to free a tensor).
    os._exit(0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_config(cfg: dict, world: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        mp.spawn(_worker, args=(world, _free_port(), cfg, out), nprocs=world, join=True)
        with open(out) as f:
            rows = json.load(f)
    return {**{k: cfg[k] for k in ("wrap", "mode")}, "extra_mb": max(r["extra_mb"] for r in rows),
            "baseline_mb": max(r["baseline_mb"] for r in rows), "step_seconds": max(r["step_seconds"] for r in rows),
            "loss": rows[0]["loss"], "per_rank": rows}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for name, default, what in (("vocab", 128256, None), ("hidden", 256, None), ("layers", 2, None), ("seq", 512, None),
                                ("batch", 2, "rows per process"), ("steps", 3, None),
                                ("threads", 1, "torch threads per process"), ("world", 2, "processes")):
        p.add_argument(f"--{name}", type=positive_int, default=default, help=what)
    p.add_argument("--wraps", nargs="+", default=["ddp", "fsdp2"], choices=["ddp", "fsdp2"])
    p.add_argument("--modes", nargs="+", default=["unpatched", "ce", "mhce"], choices=["unpatched", "ce", "mhce"])
    add_out_options(p)
    args = p.parse_args(argv)
    if args.hidden % 8:
        p.error(f"--hidden ({args.hidden}) must be a multiple of 8: 4 attention heads of even size (RoPE)")
    today = datetime.date.today().isoformat()
    record = Record(p, args, f"distributed_step_cpu-{today}")
    shape = {k: getattr(args, k) for k in ("vocab", "hidden", "layers", "seq", "batch", "steps", "threads")}
    rows = []
    for wrap in args.wraps:
        for mode in args.modes:
            rows.append(run_config({**shape, "wrap": wrap, "mode": mode}, args.world))
            print(f"{wrap:6s} {mode:9s} extra {rows[-1]['extra_mb']:8.1f} MB  step {rows[-1]['step_seconds']:.2f} s  "
                  f"loss {rows[-1]['loss']:.4f}", flush=True)
    tokens = args.batch * args.seq
    logits_mb = tokens * args.vocab * 4 / 2**20
    result = {"date": today, "device": f"CPU, {os.cpu_count()} cores, gloo", "torch": torch.__version__,
              "world": args.world, **shape, "fp32_logits_mb_per_process": logits_mb, "rows": rows}
    lines = [f"# One distributed training step, patched vs unpatched ({today})", "",
             f"{args.world} CPU processes (gloo), {args.threads} torch thread(s) each, torch {torch.__version__}; "
             f"Llama V={args.vocab}, hidden {args.hidden}, {args.layers} layers; {args.batch} x {args.seq} tokens per "
             f"process (fp32 logits would be {logits_mb:.0f} MB per process); forward + backward + AdamW step.  "
             "Extra = peak RSS during the step above the RSS before it (max over processes); time = median of "
             f"{args.steps} steps (max over processes).", "",
             "| wrap | loss | extra memory MB | vs unpatched | step s | vs unpatched | loss value |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        base = next((b for b in rows if b["wrap"] == r["wrap"] and b["mode"] == "unpatched"), None)
        mem = f"{r['extra_mb'] / base['extra_mb']:.2f}x" if base else "-"
        tim = f"{r['step_seconds'] / base['step_seconds']:.2f}x" if base else "-"
        lines.append(f"| {r['wrap']} | {r['mode']} | {r['extra_mb']:.0f} | {mem} | {r['step_seconds']:.2f} | {tim} | "
                     f"{r['loss']:.4f} |")
    record.write(result, "\n".join(lines))
    return result


if __name__ == "__main__":
    main()
