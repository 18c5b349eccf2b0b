"""benchmarks/targets.py: P6's verdicts read off a peers record (synthetic rows with known answers)."""

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import targets  # noqa: E402


def _row(variant, **numbers):
    return {"shape": "llama3", "N": 4096, "D": 4096, "V": 128256, "variant": variant, **numbers}


def _group():
    return [
        _row("liger", fwd_ms=7.0, fwd_bwd_ms=21.0),
        _row("cce", fwd_ms=8.0, fwd_bwd_ms=25.0),
        _row("cce_exact", note="out of memory"),
        _row("hf_mhce_ce", fwd_ms=6.5, fwd_bwd_ms=33.0, vs_floor=1.88, mem_vs_bound=1.21),
        _row("hf_mhce_ce_lean", fwd_ms=6.5, fwd_bwd_ms=40.0, vs_floor=2.28, mem_vs_bound=1.03),
        _row("hf_mhce_ce_fast", fwd_ms=6.5, fwd_bwd_ms=20.0, vs_floor=1.14, mem_vs_bound=2.9),
        _row("hf_mhce_mhce4", fwd_ms=6.9, fwd_bwd_ms=36.3, vs_floor=2.07, mem_vs_bound=1.21),  # exactly 1.10x
        _row("hf_mhce_mhce4_fast", fwd_ms=6.9, fwd_bwd_ms=23.0, vs_floor=1.31, mem_vs_bound=4.0),  # 1.15x
        _row("hf_mhce_ranks", fwd_ms=9.0, vs_floor=1.5),
        _row("slab_stats", fwd_ms=6.0, vs_floor=1.02),
        _row("slab_ranks", fwd_ms=6.1, vs_floor=1.04),
    ]


def _by(found):
    return {(v["target"], v["configuration"].split(" ")[0]): v for v in found}


def test_verdicts_per_configuration():
    found = _by(targets.verdicts(_group()))
    assert found["time", "hf_mhce_ce"]["holds"] is False and found["time", "hf_mhce_ce_fast"]["holds"] is True
    assert found["memory", "hf_mhce_ce_lean"]["holds"] is True and found["memory", "hf_mhce_ce"]["holds"] is False
    assert found["cce", "hf_mhce_ce_fast"]["value"] == pytest.approx(20 / 25) and found["cce", "hf_mhce_ce_fast"]["holds"]
    assert found["liger", "hf_mhce_ce_fast"]["holds"] and not found["liger", "hf_mhce_ce"]["holds"]
    assert found["mhce", "hf_mhce_mhce4"]["value"] == pytest.approx(1.1) and found["mhce", "hf_mhce_mhce4"]["holds"]
    assert found["mhce", "hf_mhce_mhce4_fast"]["holds"] is False  # 23 / 20 against its own workspace's CE
    assert found["ranks", "hf_mhce_ranks"]["holds"] is False  # 9 / 6.5
    assert found["ranks", "slab_ranks"]["value"] == pytest.approx(6.1 / 6.0) and found["ranks", "slab_ranks"]["holds"]
    assert ("mhce", "hf_mhce_mhce8") not in found  # a row not run is no verdict


def test_liger_must_be_strictly_faster():
    group = [_row("liger", fwd_bwd_ms=20.0), _row("hf_mhce_ce", fwd_bwd_ms=20.0, vs_floor=1.1, mem_vs_bound=1.0)]
    assert _by(targets.verdicts(group))["liger", "hf_mhce_ce"]["holds"] is False


def test_missing_numbers_are_owed_never_passed():
    group = [_row("cce", note="cut-cross-entropy not installed"),
             _row("hf_mhce_ce", fwd_ms=5.0, fwd_bwd_ms=18.0, vs_floor=1.1, mem_vs_bound=1.0),
             _row("hf_mhce_ce_fast", note="out of memory")]
    found = _by(targets.verdicts(group))
    assert found["cce", "hf_mhce_ce"]["holds"] is None and "not installed" in found["cce", "hf_mhce_ce"]["why"]
    assert found["liger", "hf_mhce_ce"]["holds"] is None and "liger not run" in found["liger", "hf_mhce_ce"]["why"]
    assert found["time", "hf_mhce_ce_fast"]["holds"] is None and "out of memory" in found["time", "hf_mhce_ce_fast"]["why"]
    summary = targets.all_at_once(targets.verdicts(group))
    assert summary["hf_mhce_ce (512 MB, default)"] == "not known (owed: cce, liger)"
    assert summary["hf_mhce_ce_fast (8192 MB)"] == "not known (owed: time, cce, liger, memory)"


def test_all_at_once_names_what_misses():
    summary = targets.all_at_once(targets.verdicts(_group()))
    assert summary["hf_mhce_ce (512 MB, default)"] == "no (misses time, cce, liger, memory)"
    assert summary["hf_mhce_ce_lean (64 MB)"] == "no (misses time, cce, liger)"
    assert summary["hf_mhce_ce_fast (8192 MB)"] == "no (misses memory)"
    group = [_row("liger", fwd_bwd_ms=21.0), _row("cce", fwd_bwd_ms=25.0),
             _row("hf_mhce_ce", fwd_bwd_ms=19.0, vs_floor=1.1, mem_vs_bound=1.04)]
    assert targets.all_at_once(targets.verdicts(group)) == {"hf_mhce_ce (512 MB, default)": "yes"}


def test_markdown_and_command_line(tmp_path, capsys):
    rows = _group() + [{**r, "N": 16384} for r in _group()]
    text = targets.markdown(rows)
    assert text.count("### llama3, N=") == 2 and "| time | hf_mhce_ce_fast (8192 MB) | 1.14x | <= 1.15 | yes |" in text
    assert "owed" not in text  # cce_exact's note is no verdict: the targets name CCE's default
    path = tmp_path / "peers.json"
    path.write_text(json.dumps(rows))
    assert targets.main([str(path)]) == 0
    assert "every CE target at once, hf_mhce_ce_fast (8192 MB): no (misses memory)" in capsys.readouterr().out
    path.write_text(json.dumps({"not": "rows"}))
    assert targets.main([str(path)]) == 2 and "not a peers record" in capsys.readouterr().err
    assert targets.main([]) == 2


def test_a_margin_inside_the_spread_is_within_noise():
    """"No slower than CCE" rested on one median of ~5 runs: a margin smaller than the two rows' spreads
    (interquartile range over the median, added) is shown as within noise, and counts as neither."""
    group = [_row("cce", fwd_bwd_ms=25.0, fwd_bwd_spread=0.02), _row("liger", fwd_bwd_ms=30.0, fwd_bwd_spread=0.02),
             _row("hf_mhce_ce", fwd_bwd_ms=25.5, fwd_bwd_spread=0.03, vs_floor=1.1, mem_vs_bound=1.0)]
    found = _by(targets.verdicts(group))
    cce, liger = found["cce", "hf_mhce_ce"], found["liger", "hf_mhce_ce"]
    assert cce["holds"] is False and cce["within_noise"] and cce["spread"] == pytest.approx(0.05), cce
    assert liger["holds"] is True and not liger["within_noise"], liger  # 15 % margin against 5 % spread
    assert found["time", "hf_mhce_ce"]["within_noise"] is False  # 4.3 % margin against its own 3 %
    assert targets.all_at_once(targets.verdicts(group)) == {"hf_mhce_ce (512 MB, default)": "not known (within noise: cce)"}
    text = targets.markdown(group)
    assert ("| cce | hf_mhce_ce (512 MB, default) | 1.02x cce | <= 1.0 | within noise (**no**; margin 2.0% < spread 5.0%) |"
            in text)
    group[1]["fwd_bwd_ms"] = 20.0  # a clear miss beside it
    assert targets.all_at_once(targets.verdicts(group)) == {
        "hf_mhce_ce (512 MB, default)": "no (misses liger; within noise: cce)"}
    for r in group:  # rows without spreads (records before 2026-11-25): plain verdicts
        r.pop("fwd_bwd_spread")
    assert "within_noise" not in _by(targets.verdicts(group))["cce", "hf_mhce_ce"]


def test_memory_shows_both_bounds():
    """The verdict reads peak extra / (dX + dW); the issue says the bound (X, W, dX, dW): the table shows
    that ratio too, recorded or, for older rows, from their peak and bound."""
    group = [_row("hf_mhce_ce", fwd_bwd_ms=20.0, vs_floor=1.1, mem_vs_bound=1.2, mem_vs_full_bound=0.55),
             _row("hf_mhce_ce_lean", fwd_bwd_ms=30.0, vs_floor=1.6, mem_vs_bound=1.03, peak_extra_mb=1030.0,
                  floor_lower_bound_mb=2000.0)]
    found = _by(targets.verdicts(group))
    assert found["memory", "hf_mhce_ce"]["full_bound"] == 0.55 and found["memory", "hf_mhce_ce_lean"]["full_bound"] == 0.515
    text = targets.markdown(group)
    assert "| memory | hf_mhce_ce (512 MB, default) | 1.20x (0.55x X+W+dX+dW) | <= 1.05 | **no** |" in text, text
    assert "the verdict reads the peak above the inputs against dX + dW" in text


@pytest.mark.parametrize("record", sorted((BENCH / "results").glob("*-2026-11-24-peers-*.json")), ids=lambda p: p.stem)
def test_records_of_the_first_gpu_run_still_render(record, capsys):
    """Rows without the keys added since (spreads, grad-mode loss error, both bounds) read as not recorded."""
    assert targets.main([str(record)]) == 0
    text = capsys.readouterr().out
    assert "### llama3, N=16384" in text or "### gpt2, N=16384" in text
    assert "within noise" not in text and "X+W+dX+dW)" in text
