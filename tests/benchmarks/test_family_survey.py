"""benchmarks/family_survey.py: a patched, an MoE, an overridden, a refused and an unknown type, in its worker process;
the per-type config overrides."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "family_survey.py"
if str(SCRIPT.parent) not in sys.path:
    sys.path.insert(0, str(SCRIPT.parent))  # the scripts import records as a top-level module

import family_survey  # noqa: E402


def test_survey_records_each_outcome(tmp_path):
    cmd = [sys.executable, str(SCRIPT), "--types", "gpt2", "mixtral", "gptj", "bert", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=str(ROOT))
    assert proc.returncode == 0, proc.stderr[-3000:]
    (record,) = tmp_path.glob("family-survey-*.json")
    results = json.loads(record.read_text())["results"]
    assert results["gpt2"]["status"] == "patched"
    assert results["mixtral"] == {"status": "patched", "detail": results["mixtral"]["detail"]}
    assert "(MoE, router loss)" in results["mixtral"]["detail"]
    assert results["gptj"]["status"] == "patched"  # runs only with its override (rotary_dim within head_dim)
    assert results["bert"]["status"] == "refused" and "the probe: with labels, its logits differ" in results["bert"]["detail"]
    assert "MISMATCH: 0 | patched: 3 | refused: 1" in record.with_suffix(".md").read_text()


def test_unknown_type_is_named():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--types", "llama", "not_a_model", "--out", "/nonexistent"],
                          capture_output=True, text=True, timeout=120, cwd=str(ROOT))
    assert proc.returncode == 2 and "not_a_model" in proc.stderr


def test_overrides_reach_sub_configs_and_unset_removes_a_size():
    from packaging.version import Version
    from transformers import CONFIG_MAPPING, __version__

    # no misspelt type: every one is known to transformers 5.24, which the table was written against (an older
    # release, such as the floor 5.17, lacks the newer families: bailing_hybrid, dots3_note, flint, lfm3)
    unknown = (set(family_survey.OVERRIDES) | set(family_survey.WHY_NOT)) - set(CONFIG_MAPPING)
    assert not unknown or Version(__version__).release < (5, 24), unknown  # a 5.24 pre-release is checked too
    composite = family_survey.config_for("qwen3_5")  # its text_config gets SIZES and qwen3_5_text's overrides
    assert composite.text_config.hidden_size == 32
    assert composite.text_config.layer_types == ["linear_attention", "full_attention"]
    assert composite.vision_config.hidden_size == 32
    assert family_survey.config_for("falcon").head_dim == 8  # derived: head_dim=UNSET, as falcon's is read-only
