"""examples/toy_language.py at its reduced size (--quick): the same code path as the full run."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "toy_language.py"


@pytest.mark.timeout(120)
def test_toy_language_quick(tmp_path):
    out = tmp_path / "toy"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=110,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for name in ("table.md", "results.json", "toy_language.png"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    assert (out / "toy_language.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    res = json.loads((out / "results.json").read_text())
    heads = res["config"]["heads"]
    assert len(heads) >= 2
    rows = res["summary"]
    assert [r["heads"] for r in rows] == heads  # one row per H
    for r in rows:
        assert 0 < r["pc12"] <= 100
        assert r["published_pc12"] is None or 0 < r["published_pc12"] <= 100
        # The model learned the language: close to the best achievable loss (the conditional
        # entropy, ~2.49 nats), far below a uniform guess (log 40 ~ 3.69), and for every token the
        # class receiving most predicted mass is the right one (same-topic verb after a noun,
        # same-topic noun after a verb).
        assert r["eval_ce"] < math.log(40) - 1.0
        assert r["gap"] < 0.15
        assert r["class_acc"] == 1.0
        assert 0 < r["tight_2d"] < 1 and 0 < r["tight_full"] < 1  # classes are clustered at all
    assert res["optimal_loss"] == pytest.approx(2.491, abs=1e-3)

    # The markdown table: one data row per H, the percentages inside (0, 100].
    lines = [ln for ln in (out / "table.md").read_text().splitlines() if ln.startswith("|")]
    assert lines[0].startswith("| H |") and set(lines[1]) <= set("|-: ")
    body = lines[2:]
    assert len(body) == len(heads)
    for ln, h in zip(body, heads):
        cells = [c.strip() for c in ln.strip("|").split("|")]
        assert int(cells[0]) == h
        assert 0 < float(cells[1].split("±")[0]) <= 100
    assert str(heads[0]) in proc.stdout and "PC1+PC2" in proc.stdout


def test_corpus_matches_the_exact_bigram_law():
    """The generated stream follows the transition matrix the evaluation assumes."""
    import torch

    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import toy_language as tl
    finally:
        sys.path.remove(str(SCRIPT.parent))
    corpus = tl.generate_corpus(200_000, torch.Generator().manual_seed(0))
    assert corpus.min() >= 0 and corpus.max() < 40
    counts = torch.zeros(40, 40, dtype=torch.float64)
    counts.index_put_((corpus[:-1], corpus[1:]), torch.ones(len(corpus) - 1, dtype=torch.float64), accumulate=True)
    pi, T = tl.true_bigram()
    assert torch.allclose(T.sum(1), torch.ones(40, dtype=torch.float64))
    emp = counts / counts.sum(1, keepdim=True)
    assert (emp[T == 0] == 0).all()  # nouns and verbs alternate; nouns keep the sentence topic
    assert torch.allclose(emp, T, atol=0.02)
    assert torch.allclose(counts.sum(1) / counts.sum(), pi, atol=0.003)
