"""The training example runs end to end (few steps): both curves agree, the SVG is written."""
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def test_train_gpt_smoke(tmp_path):
    svg = tmp_path / "curves.svg"
    out = subprocess.run(
        [sys.executable, os.path.join(HERE, "..", "examples", "train_gpt.py"), "--steps", "12", "--vocab", "1024",
         "--dim", "32", "--layers", "1", "--context", "16", "--batch", "4", "--svg", str(svg)],
        capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "largest |difference|" in out.stdout and "loss-step peak extra memory" in out.stdout
    text = svg.read_text()
    assert text.startswith("<svg") and text.count("<polyline") == 3
