"""benchmarks/family_survey.py: a patched, an MoE, a refused and an unknown type, in its worker process."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "family_survey.py"


def test_survey_records_each_outcome(tmp_path):
    cmd = [sys.executable, str(SCRIPT), "--types", "gpt2", "mixtral", "bert", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=str(ROOT))
    assert proc.returncode == 0, proc.stderr[-3000:]
    (record,) = tmp_path.glob("family-survey-*.json")
    results = json.loads(record.read_text())["results"]
    assert results["gpt2"]["status"] == "patched"
    assert results["mixtral"] == {"status": "patched", "detail": results["mixtral"]["detail"]}
    assert "(MoE, router loss)" in results["mixtral"]["detail"]
    assert results["bert"]["status"] == "refused" and "the probe: with labels, its logits differ" in results["bert"]["detail"]
    assert "MISMATCH: 0 | patched: 2 | refused: 1" in record.with_suffix(".md").read_text()


def test_unknown_type_is_named():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--types", "llama", "not_a_model", "--out", "/nonexistent"],
                          capture_output=True, text=True, timeout=120, cwd=str(ROOT))
    assert proc.returncode == 2 and "not_a_model" in proc.stderr
