"""The output layer and loss over token chunks: peak and time against the unchunked head, and what plans reach.

Run by hand (CPU; a Hugging Face Llama built from a config, random weights, no download):

    PYTHONPATH=src python benchmarks/head.py                       # vocab 32000, 4 x 256 layers, batch 4 x 512
    PYTHONPATH=src python benchmarks/head.py --vocab 2000 --seq 128 --batch 2 --layers 2 --hidden 32   # quick

Two tables:

* **head**: the output layer and loss alone on the model's shapes (last hidden state -> loss -> backward), for
  the unchunked head (transformers' ``ForCausalLMLoss``) and ``remat.chunked_lm_loss`` at several chunk counts:
  MemTracker's peak above the weight (the hidden state included) and the median CPU seconds of forward +
  backward on one thread (``torch.set_num_threads(1)``, this thread's CPU time: steady on a shared machine).
* **step**: one training step of the model (peak above parameters, MemTracker): plain; every layer
  checkpointed (``enable``); every layer checkpointed with the chunked head (``enable(chunked_loss=n)``); and
  the lowest peak any plan reaches from one ``remat.profile``, without the chunked-head option and with it.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F

import remat
from remat.planning.basics.memory import measure_step


def build(vocab: int, hidden: int, layers: int) -> Any:
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                                   num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                   tie_word_embeddings=False, use_cache=False)
    return transformers.LlamaForCausalLM(cfg).train()


def head_rows(tokens: int, hidden: int, vocab: int, chunk_counts: list[int], rounds: int) -> list[dict[str, Any]]:
    """Peak and time of the head and loss alone, unchunked (``chunks`` None) and per chunk count."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    gen = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(hidden, vocab, bias=False)
    states, labels = torch.randn(tokens, hidden, generator=gen), torch.randint(0, vocab, (tokens,), generator=gen)
    rows = []
    for chunks in [None, *chunk_counts]:
        def step(chunks: int | None = chunks) -> None:
            h = states.clone().requires_grad_()
            loss = (ForCausalLMLoss(F.linear(h, head.weight), labels, vocab) if chunks is None
                    else remat.chunked_lm_loss(h, head.weight, labels, chunks=chunks))
            loss.backward()
            head.weight.grad = None

        peak = measure_step(step, head).peak_above_params
        seconds = statistics.median(_thread_seconds(step) for _ in range(rounds))
        rows.append({"chunks": chunks, "peak": peak, "seconds": seconds})
    return rows


def _thread_seconds(fn: Callable[[], None]) -> float:
    start = time.thread_time()
    fn()
    return time.thread_time() - start


def step_rows(model: Any, ids: torch.Tensor, chunks: int) -> dict[str, int]:
    """Peaks above parameters of one training step under each way of running the model."""
    from remat.integrations.transformers import enable

    def peak(m: Any) -> int:
        return measure_step(lambda: m(input_ids=ids, labels=ids).loss.backward(), m).peak_above_params

    out = {"plain": peak(copy.deepcopy(model)),
           "every layer": peak(enable(copy.deepcopy(model))),
           f"every layer + head in {chunks}": peak(enable(copy.deepcopy(model), chunked_loss=chunks))}
    prof = remat.profile(model, input_ids=ids, labels=ids, repeats=1, hold_output=False)  # as peak(): .loss.backward()
    for name, profile in (("lowest plan, head as is", replace(prof, head=None)), ("lowest plan, head option", prof)):
        try:
            profile.plan("1B")
        except remat.InfeasibleBudget as refused:
            out[name] = refused.smallest - refused.param_bytes
    return out


def print_head(tokens: int, args: argparse.Namespace) -> None:
    rows = head_rows(tokens, args.hidden, args.vocab, [int(c) for c in args.chunks.split(",")], args.rounds)
    base = rows[0]
    print(f"head and loss alone: {tokens} tokens x {args.hidden} features -> vocab {args.vocab}")
    print(f"{'chunks':>10} {'peak MiB':>10} {'x unchunked':>12} {'seconds':>9} {'x time':>7}")
    for row in rows:
        name = "unchunked" if row["chunks"] is None else str(row["chunks"])
        print(f"{name:>10} {row['peak'] / 2**20:>10.1f} {row['peak'] / base['peak']:>12.3f} "
              f"{row['seconds']:>9.3f} {row['seconds'] / base['seconds']:>7.2f}")


def print_step(tokens: int, args: argparse.Namespace) -> None:
    from remat.planning.solve.head import head_chunk_count

    model = build(args.vocab, args.hidden, args.layers)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq))
    peaks = step_rows(model, ids, head_chunk_count(tokens, args.hidden))
    shape = f"Llama {args.layers} x {args.hidden}, batch {args.batch} x {args.seq}"
    print(f"\ntraining step, {shape}: peak above parameters")
    for name, value in peaks.items():
        print(f"{name:>28} {value / 2**20:>10.1f} MiB {value / peaks['plain']:>6.1%} of plain")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--chunks", default="1,4,8,16,32", help="chunk counts of the head table")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tables", default="head,step", help="which tables to print: head, step or both")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    tokens = args.batch * args.seq
    if "head" in args.tables:
        print_head(tokens, args)
    if "step" in args.tables:
        print_step(tokens, args)


if __name__ == "__main__":
    main()
