"""The remat command runs end to end."""

import subprocess
import sys

from remat.demo import run_demo
from remat.models import GPTConfig


def test_demo_modes_agree_bitwise_and_checkpointing_saves_memory():
    results = run_demo(GPTConfig(n_layers=3, d_model=32, n_heads=2, seq_len=32, vocab_size=64), 4, steps=2)
    plain, full = results
    assert full.max_loss_diff(plain) == 0.0
    assert full.max_grad_diff(plain) == 0.0
    assert full.peak_above_params < plain.peak_above_params


def test_remat_demo_command_prints_the_table():
    out = subprocess.run(
        [sys.executable, "-m", "remat", "demo", "--layers", "2", "--steps", "2", "--seq-len", "32",
         "--d-model", "32", "--heads", "2"],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr
    for header in ("peak above params", "whole peak", "step time", "max |Δgrad|", "every block"):
        assert header in out.stdout


def test_help_documents_the_options():
    out = subprocess.run([sys.executable, "-m", "remat", "demo", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "--layers" in out.stdout and "examples:" in out.stdout
