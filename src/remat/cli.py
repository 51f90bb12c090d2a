"""The ``remat`` command."""

from __future__ import annotations

import argparse
import sys

import torch

__all__ = ["main"]

_DEMO_EPILOG = """examples:
  remat demo                      # 4 layers, d_model 128, 5 steps per mode
  remat demo --layers 8 --steps 5 # a deeper model, more steps
  remat demo --batch-size 2 --seq-len 64 --steps 2   # a quick look
"""


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def _demo(args: argparse.Namespace) -> int:
    try:
        from rich.console import Console
        from rich.progress import Progress
        from rich.table import Table
    except ImportError:
        print("remat demo needs rich: pip install 'remat[cli]'", file=sys.stderr)
        return 2

    from .demo import MODES, run_demo
    from .models import GPTConfig

    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = GPTConfig(
        vocab_size=args.vocab_size, seq_len=args.seq_len, d_model=args.d_model, n_heads=args.heads,
        n_layers=args.layers, dropout=args.dropout,
    )
    console = Console()
    if not console.is_terminal:
        console = Console(width=120)  # piped output: do not fold the table to 80 columns
    console.print(
        f"[bold]remat demo[/]: GPT with {cfg.n_layers} blocks, d_model {cfg.d_model}, {cfg.n_heads} heads, "
        f"sequence {cfg.seq_len}, batch {args.batch_size}, dropout {cfg.dropout}; "
        f"{args.steps} training steps per mode on {torch.get_num_threads()} CPU thread(s)."
    )
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("training", total=args.steps * len(MODES))
        results = run_demo(cfg, args.batch_size, args.steps, args.seed, on_step=lambda: progress.advance(task))
    base = results[0]
    table = Table(title="one training step (forward + backward)")
    for column in ("mode", "peak above params", "whole peak", "step time", "overhead",
                   "max |Δloss|", "max |Δgrad|"):
        table.add_column(column, justify="left" if column == "mode" else "right")
    for r in results:
        table.add_row(
            r.name,
            f"{_mib(r.peak_above_params)} ({r.peak_above_params / base.peak_above_params:.0%})",
            _mib(r.peak_total),
            f"{r.step_time * 1e3:,.1f} ms",
            f"{r.step_time / base.step_time - 1:+.0%}",
            f"{r.max_loss_diff(base):.3g}",
            f"{r.max_grad_diff(base):.3g}",
        )
    console.print(table)
    console.print(
        "Peaks are MemTracker's whole-step figures (parameters, gradients, activations and tensors "
        "recomputed in backward); step time is the median after the first step."
    )
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="remat", description="Activation checkpointing for PyTorch.")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser(
        "demo",
        help="train the built-in GPT with and without checkpointing and compare",
        description="Train the built-in GPT-style model on synthetic tokens (no downloads) under each "
        "checkpointing mode, from identical weights and batches, and print peak memory, step time and "
        "the largest loss/gradient difference against no checkpointing.",
        epilog=_DEMO_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    demo.add_argument("--layers", type=int, default=4, help="transformer blocks (default 4)")
    demo.add_argument("--d-model", type=int, default=128, help="model width (default 128)")
    demo.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    demo.add_argument("--seq-len", type=int, default=256, help="tokens per sequence (default 256)")
    demo.add_argument("--vocab-size", type=int, default=512, help="vocabulary size (default 512)")
    demo.add_argument("--batch-size", type=int, default=8, help="sequences per step (default 8)")
    demo.add_argument("--dropout", type=float, default=0.1, help="dropout probability (default 0.1)")
    demo.add_argument("--steps", type=int, default=5, help="training steps per mode (default 5)")
    demo.add_argument("--seed", type=int, default=0, help="seed for weights, data and dropout")
    demo.add_argument("--threads", type=int, default=0, help="torch CPU threads (default: torch's)")
    demo.set_defaults(run=_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``remat`` command.

    Example:
        >>> main(["demo", "--layers", "2", "--steps", "2", "--seq-len", "32"])
        0
    """
    args = _parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
