"""examples/mhce_vs_ce.py, rbe_scaling.py and finetune.py at their reduced size (--quick: the same
code path as the default runs, smaller options), run as scripts in one process (RUNS), plus the
analysis helpers on synthetic numbers."""

import importlib.util
import json
import math
import os
import sys
from pathlib import Path

import pytest
from script_runs import output, run_scripts

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
ENV = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
COMPONENTS = ("error_entropy", "self_alignment", "confidence")


def load(name):
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))  # what `python examples/<name>.py` puts first on sys.path
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses and HfArgumentParser look the module up
    spec.loader.exec_module(module)
    return module


# The example runs of the tests below, as `python examples/<script>.py ARGS` would run them, one after
# the other in one process started once (tests/script_runs.py): torch, transformers and hf_mhce are
# imported once instead of once per script.  ("{out}" is the run's output folder.)
RUNS = {
    "mhce_vs_ce": ["mhce_vs_ce", "--quick", "--workers", "1", "--out", "{out}"],
    # --workers 2: hf-mhce train subprocesses; the same runs H=1, 2 as "mhce_vs_ce" (in its process)
    "mhce_vs_ce_workers_2": ["mhce_vs_ce", "--quick", "--heads", "1", "2", "--out", "{out}", "--workers", "2"],
    "rbe_scaling": ["rbe_scaling", "--quick", "--workers", "1", "--out", "{out}"],
    "finetune": ["finetune", "--quick", "--out", "{out}"],
}
USES = {"test_mhce_vs_ce_quick": ["mhce_vs_ce"],
        "test_parallel_workers_match_in_process": ["mhce_vs_ce", "mhce_vs_ce_workers_2"],
        "test_rbe_scaling_quick": ["rbe_scaling"], "test_finetune_quick_pretrains_then_finetunes": ["finetune"]}


@pytest.fixture(scope="module")
def example_runs(request, tmp_path_factory):
    """(base folder, {name: exit status}) of the RUNS that the selected tests of this module use."""
    here = Path(__file__).resolve()
    selected = {item.name for item in request.session.items if Path(item.path).resolve() == here}
    names = [n for n in RUNS if any(n in USES[t] for t in selected if t in USES)]
    base = tmp_path_factory.mktemp("examples")
    runs = {n: [str(EXAMPLES / f"{script}.py"), *(a.replace("{out}", str(base / n)) for a in args)]
            for n, (script, *args) in RUNS.items() if n in names}
    return base, run_scripts(runs, base, ENV, timeout=600, cwd=str(ROOT))


def run_script(example_runs, name):
    """(out folder, stdout) of RUNS[name], which must have succeeded."""
    base, status = example_runs
    stdout, stderr = output(base, name)
    assert status[name] == 0, (status[name], stdout[-3000:] + stderr[-3000:])
    return base / name, stdout


def table_rows(path):
    """Data rows of the first markdown table in ``path`` (cells stripped)."""
    lines = path.read_text().splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("|"))
    block = []
    for ln in lines[start:]:
        if not ln.startswith("|"):
            break
        block.append(ln)
    assert set(block[1]) <= set("|-: ")
    return [[c.strip() for c in ln.strip("|").split("|")] for ln in block[2:]]


def assert_identity(values, prefix=""):
    parts = values[f"{prefix}error_entropy"] + values[f"{prefix}self_alignment"] - values[f"{prefix}confidence"]
    assert abs(parts - values[f"{prefix}cross_entropy"]) < 1e-6


def assert_png(path):
    assert path.is_file() and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", path


def assert_card(model_dir, loss, heads=None):
    card = (model_dir / "README.md").read_text()
    assert "<!-- hf_mhce:begin" in card and "<!-- hf_mhce:end -->" in card and "## Training loss: hf_mhce" in card
    if loss == "mhce":
        assert f"mixture of {heads} softmaxes" in card and "hf_mhce.from_pretrained" in card


@pytest.mark.timeout(600)  # with example_runs: every example run of this module
def test_mhce_vs_ce_quick(example_runs):
    out, stdout = run_script(example_runs, "mhce_vs_ce")
    for name in ("table.md", "results.json"):
        assert (out / name).stat().st_size > 0
    assert_png(out / "mhce_vs_ce.png")
    res = json.loads((out / "results.json").read_text())
    heads = res["config"]["heads"]
    assert heads == [1, 2, 4, 8] and res["config"]["seeds"] == [0]
    assert [r["heads"] for r in res["summary"]] == heads
    assert sorted((r["heads"], r["loss"]) for r in res["runs"]) == [(1, "ce"), (2, "mhce"), (4, "mhce"), (8, "mhce")]
    params = {r["parameters"] for r in res["runs"]}
    assert len(params) == 1  # the same model; only the loss differs
    for r in res["runs"] + res["summary"]:
        for s in ("docs", "code"):
            assert_identity(r, f"{s}_")
            # eval loss is the model's own NLL: the RBE decomposition is of that very number
            assert r[f"{s}_loss"] == pytest.approx(r[f"{s}_cross_entropy"], rel=1e-5)
            assert r[f"{s}_ppl"] == pytest.approx(math.exp(r[f"{s}_loss"]), rel=1e-9)
            assert 0 <= r[f"{s}_top1"] <= 1
    rows = table_rows(out / "table.md")
    assert [int(r[0]) for r in rows] == heads
    assert [r[1] for r in rows] == ["ce", "mhce", "mhce", "mhce"]
    for row, summ in zip(rows, res["summary"]):
        assert float(row[2]) == pytest.approx(summ["docs_ppl"], abs=0.06)
    assert res["verdict"] and all(f"H={h}" in res["verdict"] for h in heads[1:])
    assert res["verdict"] in stdout and "| H |" in stdout
    for h in heads:
        run = out / "runs" / f"h{h}_s0"
        assert (run / "model.safetensors").is_file()
        assert_card(run, "ce" if h == 1 else "mhce", h)


@pytest.mark.timeout(600)
def test_rbe_scaling_quick(example_runs):
    out, stdout = run_script(example_runs, "rbe_scaling")
    assert_png(out / "rbe_scaling.png")
    res = json.loads((out / "results.json").read_text())
    sizes = res["config"]["sizes"]
    assert len(sizes) >= 5
    rows = res["rows"]
    assert sorted(r["size"] for r in rows) == sorted(sizes)
    params = [r["parameters"] for r in rows]
    assert params == sorted(params) and len(set(params)) == len(params)
    for r in rows:
        assert 0 < r["non_embedding_parameters"] < r["parameters"]
        for s in ("docs", "code"):
            assert_identity(r, f"{s}_")
            assert r[f"{s}_loss"] == pytest.approx(r[f"{s}_cross_entropy"], rel=1e-5)
    assert len(res["fits"]) == 8  # {docs, code} x {all, non-embedding params} x {CE, EE}
    for f in res["fits"]:
        assert 0.0 <= f["r2"] <= 1.0 and math.isfinite(f["exponent"]) and f["coefficient"] > 0
    table = table_rows(out / "table.md")
    assert [r[0] for r in table] == [r["size"] for r in rows]
    assert "R^2" in (out / "table.md").read_text() and res["verdict"] in stdout
    for size in sizes:
        assert_card(out / "runs" / size, "ce")


@pytest.mark.timeout(600)
def test_parallel_workers_match_in_process(example_runs):
    """--workers 2 runs ``hf-mhce train`` subprocesses (the default runs); same numbers as in process
    (the runs H=1 and H=2 of the --workers 1 run: each run depends only on its own options and seed)."""
    parallel_out, _ = run_script(example_runs, "mhce_vs_ce_workers_2")
    in_process = json.loads((run_script(example_runs, "mhce_vs_ce")[0] / "results.json").read_text())
    parallel = json.loads((parallel_out / "results.json").read_text())
    assert in_process["config"]["workers"] == 1 and parallel["config"]["workers"] == 2
    assert in_process["config"]["options"] == parallel["config"]["options"]
    assert (parallel_out / "logs" / "h2_s0.log").is_file()
    assert [(b["heads"], b["seed"]) for b in parallel["runs"]] == [(1, 0), (2, 0)]
    reference = {(a["heads"], a["seed"]): a for a in in_process["runs"]}
    for b in parallel["runs"]:
        a = reference[b["heads"], b["seed"]]
        for key in ("docs_loss", "code_loss", "docs_error_entropy", "code_self_alignment", "train_loss"):
            assert a[key] == pytest.approx(b[key], rel=1e-6), key


@pytest.mark.timeout(600)
def test_finetune_quick_pretrains_then_finetunes(example_runs):
    """No --model: pretrain with hf-mhce train (MHCE, 4 heads), fine-tune on stdlib code."""
    out, stdout = run_script(example_runs, "finetune")
    assert_png(out / "finetune.png")
    res = json.loads((out / "results.json").read_text())
    assert res["config"]["pretrained_here"] and res["config"]["loss"]["loss"] == "mhce"
    assert (out / "pretrained" / "config.json").is_file() and (out / "data" / "stdlib_code.jsonl").is_file()
    assert [(r["eval_set"], r["when"]) for r in res["rows"]] == [
        ("code", "before"), ("code", "after"), ("docs", "before"), ("docs", "after")]
    for r in res["rows"]:
        assert_identity(r)
        assert r["loss"] == pytest.approx(r["cross_entropy"], rel=1e-5)
    assert len(table_rows(out / "table.md")) == 4 and "| eval set |" in stdout
    model_dir = out / "model"
    for f in ("config.json", "model.safetensors", "tokenizer.json", "README.md"):
        assert (model_dir / f).is_file(), f
    assert_card(model_dir, "mhce", 4)
    assert "rbe" in os.listdir(model_dir)  # RBECallback's plots

    import hf_mhce

    reloaded = hf_mhce.from_pretrained(str(model_dir))
    assert reloaded.config.hf_mhce["loss"] == "mhce" and reloaded.config.hf_mhce["num_heads"] == 4


@pytest.mark.timeout(120)
def test_finetune_lora_ce_on_text_file(tmp_path, single_thread):
    """--model (an MHCE checkpoint) + --dataset (a text file) + --loss ce --override_saved + LoRA on lm_head."""
    import hf_mhce
    import hf_mhce.train

    # in process, one torch thread (the single_thread fixture)
    ckpt = tmp_path / "ckpt"
    hf_mhce.train.main(["--output_dir", str(ckpt), "--vocab_size", "300", "--hidden_size", "32",
                        "--num_hidden_layers", "1", "--intermediate_size", "64", "--block_size", "32",
                        "--max_train_blocks", "16", "--max_eval_blocks", "4", "--max_steps", "2",
                        "--eval_strategy", "no", "--per_device_train_batch_size", "4", "--no_rbe_plots",
                        "--sample_tokens", "2", "--num_heads", "2"])
    text = tmp_path / "corpus.txt"
    text.write_text("\n".join(f"def f{i}(x):\n    return x * {i % 7} + {i % 3}" for i in range(300)))
    finetune = load("finetune")
    out = tmp_path / "ft"
    argv = ["--quick", "--model", str(ckpt), "--dataset", str(text), "--loss", "ce", "--override_saved",
            "--lora_r", "4", "--lora_target_modules", "q_proj,v_proj,lm_head", "--out", str(out)]
    res = finetune.main(argv)
    with pytest.raises(ValueError, match="override_saved"):  # changing a recorded loss must be deliberate
        finetune.main([a for a in argv if a != "--override_saved"] + ["--output_dir", str(tmp_path / "x")])
    assert not res["config"]["pretrained_here"] and res["config"]["loss"]["loss"] == "ce"
    assert 0 < res["config"]["trainable_parameters"] < res["config"]["parameters"]
    assert [r["eval_set"] for r in res["rows"]] == ["held_out", "held_out"]  # a share of the text file
    for r in res["rows"]:
        assert_identity(r)
    model_dir = out / "model"
    assert (model_dir / "adapter_config.json").is_file()
    assert_card(model_dir, "ce")
    merged = model_dir / "merged"
    assert_card(merged, "ce")
    reloaded = hf_mhce.from_pretrained(str(merged))
    assert reloaded.config.hf_mhce["loss"] == "ce"
    assert json.loads((out / "results.json").read_text())["config"]["merged_dir"] == str(merged)


@pytest.mark.timeout(180)
def test_finetune_a_gpt2_checkpoint_then_its_adapter(tmp_path, single_thread):
    """Audit of finetune.py: on GPT-2 (no loss_type) the reported loss was (T - 1) / T of the cross-entropy;
    --lora_r without --lora_target_modules failed on None.split; --max_eval_blocks 0 ("all") found no block;
    --output_dir=PATH was ignored; "ppl" was exp of the smoothed objective; an adapter given as --model was
    loaded frozen (backward failed) and its saved label smoothing reset to 0; --resume_from_checkpoint was
    ignored."""
    import torch
    from checkpoints import gpt2_checkpoint
    from safetensors.torch import load_file

    lines = [f"def f{i}(x):\n    return x * {i % 7} + {i % 3}" for i in range(300)]
    text = tmp_path / "corpus.txt"
    text.write_text("\n".join(lines))
    ckpt = gpt2_checkpoint(tmp_path / "gpt2", lines)
    finetune = load("finetune")
    common = ["--quick", "--dataset", str(text), "--no_merge_lora"]
    full = finetune.main([*common, "--model", ckpt, "--loss", "ce", "--max_eval_blocks", "0", "--out",
                          str(tmp_path / "full"), f"--output_dir={tmp_path / 'full_model'}"])
    assert (tmp_path / "full_model" / "model.safetensors").is_file()
    for r in full["rows"]:
        assert r["loss"] == pytest.approx(r["cross_entropy"], rel=1e-5) and r["num_tokens"] > 8 * 31
    lora = finetune.main([*common, "--model", ckpt, "--loss", "ce", "--lora_r", "4", "--label_smoothing", "0.1",
                          "--out", str(tmp_path / "lora")])
    adapter = tmp_path / "lora" / "model"
    assert json.loads((adapter / "adapter_config.json").read_text())["target_modules"] == ["c_attn"]
    for r in lora["rows"]:
        assert r["ppl"] == pytest.approx(math.exp(r["cross_entropy"]), rel=1e-6)
        assert abs(r["loss"] - r["cross_entropy"]) > 1e-3  # eval_loss: the smoothed objective
    again = finetune.main([*common, "--model", str(adapter), "--out", str(tmp_path / "again"),
                           "--save_strategy", "steps", "--save_steps", "3"])
    assert again["config"]["loss"]["label_smoothing"] == 0.1
    before, after = (load_file(d / "adapter_model.safetensors") for d in (adapter, tmp_path / "again" / "model"))
    assert before.keys() == after.keys() and any(not torch.equal(before[k], after[k]) for k in before)
    # --resume_from_checkpoint was ignored: a new adapter on the base trained from step 0; resumed from that
    # run's step 3, it ends where that run ended
    finetune.main([*common, "--model", ckpt, "--lora_r", "4", "--label_smoothing", "0.1", "--out",
                   str(tmp_path / "resumed"), "--resume_from_checkpoint", str(tmp_path / "again" / "model" / "checkpoint-3")])
    resumed = load_file(tmp_path / "resumed" / "model" / "adapter_model.safetensors")
    for name, value in after.items():
        torch.testing.assert_close(resumed[name], value, rtol=1e-5, atol=1e-7, msg=name)


def test_finetune_pretrains_on_the_device_it_finetunes_on(monkeypatch, tmp_path):
    """README: `accelerate launch --config_file examples/accelerate/cpu_multi_process.yaml examples/finetune.py
    --use_cpu --quick`.  Without --model the pretraining run did not get --use_cpu: each process pretrained
    into the same folder and the fine-tuning ran as two single-process jobs (world_size 1)."""
    import hf_mhce.train

    finetune = load("finetune")
    seen = []
    monkeypatch.setattr(hf_mhce.train, "main", lambda argv: seen.append(argv) or {})
    for flag in ([], ["--use_cpu"]):
        example, model_args, data_args, loss_args, _, training_args = finetune.parse(["--quick", "--out", str(tmp_path),
                                                                                       *flag])
        finetune.pretrain(example, model_args, data_args, loss_args, training_args)
        assert ("--use_cpu" in seen[-1]) == bool(flag)


def test_mhce_vs_ce_needs_a_multi_head_run(capsys):
    """--heads 1 alone trained, then failed in verdict() on max() of an empty sequence."""
    with pytest.raises(SystemExit):
        load("mhce_vs_ce").parse_args(["--quick", "--heads", "1"])
    assert "at least one H > 1" in capsys.readouterr().err


def test_mhce_vs_ce_aggregate_and_verdict_with_seeds():
    mvc = load("mhce_vs_ce")

    def fake(h, seed, docs, code):
        row = {"heads": h, "seed": seed, "loss": "ce" if h == 1 else "mhce", "parameters": 10, "train_loss": 1.0,
               "wall_seconds": 10.0 * h, "curve": []}
        for s, ce in (("docs", docs), ("code", code)):
            row.update({f"{s}_loss": ce, f"{s}_ppl": math.exp(ce), f"{s}_cross_entropy": ce, f"{s}_error_entropy": ce - 0.5,
                        f"{s}_self_alignment": 0.6, f"{s}_confidence": 0.1, f"{s}_top1": 0.2})
        return row

    rows = [fake(1, 0, 5.00, 6.00), fake(1, 1, 5.02, 6.02), fake(4, 0, 4.80, 6.01), fake(4, 1, 4.82, 6.03)]
    summary = mvc.aggregate(rows, [1, 4])
    assert summary[0]["docs_loss"] == pytest.approx(5.01) and summary[0]["docs_loss_std"] == pytest.approx(0.0141, abs=1e-4)
    assert summary[1]["docs_ppl"] == pytest.approx(math.exp(4.81))
    text = mvc.verdict(summary, 2)
    assert "MHCE beats CE at H = 4" in text  # docs: 0.2 nats better, far beyond the seed spread
    assert "H = 4 is within twice the seed-to-seed standard error" in text  # code: 0.01 nats
    assert "2 seeds per H" in text


def test_power_law_fit_recovers_exponent():
    scaling = load("rbe_scaling")
    n = [1e5, 3e5, 1e6, 3e6, 1e7]
    fit = scaling.power_law(n, [7.0 * x ** -0.08 for x in n])
    assert fit["exponent"] == pytest.approx(-0.08) and fit["coefficient"] == pytest.approx(7.0)
    assert fit["r2"] == pytest.approx(1.0)
    noisy = scaling.power_law(n, [5.0, 4.0, 4.6, 3.9, 4.2])
    assert 0.0 <= noisy["r2"] < 1.0
    assert scaling.model_options("192x4", 32) == {"hidden_size": 192, "num_hidden_layers": 4,
                                                  "num_attention_heads": 6, "intermediate_size": 512}


@pytest.mark.parametrize("argv,bad", [(["--quick", "--heads", "1", "3"], "[3]"),  # hidden 32
                                      (["--heads", "1", "5"], "[5]"),  # hidden 192
                                      (["--quick", "--heads", "1", "6", "--hidden_size", "36"], None),
                                      (["--quick", "--heads", "1", "8", "--hidden_size=36"], "[8]")])
def test_mhce_vs_ce_refuses_heads_that_do_not_divide_the_hidden_size(argv, bad, capsys):
    """Before any run starts (it used to fail as a training job with a traceback)."""
    mvc = load("mhce_vs_ce")
    if bad is None:
        args, extra = mvc.parse_args(argv)
        assert args.heads == [1, 6] and extra == ["--hidden_size", "36"]
        return
    with pytest.raises(SystemExit):
        mvc.parse_args(argv)
    assert f"--heads {bad}: every H must be a positive divisor of the hidden size" in capsys.readouterr().err
