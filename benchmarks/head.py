"""The output layer and loss over token chunks: peak and time against the unchunked head, and what plans reach.

Run by hand (CPU; a Hugging Face Llama built from a config, random weights, no download):

    PYTHONPATH=src python benchmarks/head.py                       # vocab 32000, 4 x 256 layers, batch 4 x 512
    PYTHONPATH=src python benchmarks/head.py --vocab 2000 --seq 128 --batch 2 --layers 2 --hidden 32   # quick
    PYTHONPATH=src python benchmarks/head.py --tables price --rounds 21   # the chunked head's price, checked

Three tables:

* **head**: the output layer and loss alone on the model's shapes (last hidden state -> loss -> backward), for
  the unchunked head (transformers' ``ForCausalLMLoss``) and ``remat.chunked_lm_loss`` at several chunk counts:
  MemTracker's peak above the weight (the hidden state included) and the median CPU seconds of forward +
  backward on one thread (``torch.set_num_threads(1)``, this thread's CPU time: steady on a shared machine).
* **step**: one training step of the model (peak above parameters, MemTracker): plain; every layer
  checkpointed (``enable``); every layer checkpointed with the chunked head (``enable(chunked_loss=n)``); and
  the lowest peak any plan reaches from one ``remat.profile``, without the chunked-head option and with it.
* **price**: the chunked head's extra time as ``remat.profile`` prices it (``prof.head.extra_time``) against
  an interleaved A/B of whole training steps (``--rounds`` rounds, each the model as it is and a copy with
  ``remat.chunk_lm_head`` back to back; the median of the rounds' differences and their interquartile range),
  for two fixed models: GPT-2 (4 layers, n_embd 128, vocab 50257, batch 4 x 256) and Llama (4 layers, hidden
  256, intermediate 688, vocab 32000, batch 2 x 256).
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


def price_row(name: str, rounds: int) -> dict[str, float]:
    """The profile's price of the chunked head and the A/B's measured extra time (and its quartiles), seconds."""
    import transformers

    from remat.planning.measure.timing import Clock

    torch.manual_seed(0)
    if name == "gpt2":
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=4, n_embd=128, n_head=4,
                                                                     vocab_size=50257, use_cache=False)).train()
        ids = torch.randint(0, 50257, (4, 256))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4, vocab_size=32000,
            use_cache=False)).train()
        ids = torch.randint(0, 32000, (2, 256))
    prof = remat.profile(model, input_ids=ids, labels=ids, fresh_timings=True)
    chunked = remat.chunk_lm_head(copy.deepcopy(model), prof.head.chunks)
    clock = Clock("cpu")

    def seconds(m: Any) -> float:
        def step() -> None:
            m.zero_grad(set_to_none=True)
            m(input_ids=ids, labels=ids).loss.backward()
        return clock.time(step)[1]

    def difference() -> float:  # the two back to back, under one load
        plain = seconds(model)
        return seconds(chunked) - plain

    difference()  # warm-up (and the chunked call's first-call probe)
    differences = sorted(difference() for _ in range(rounds))
    return {"predicted": prof.head.extra_time, "measured": statistics.median(differences),
            "low": differences[len(differences) // 4], "high": differences[3 * len(differences) // 4],
            "step": prof.step_time, "chunks": prof.head.chunks}


def print_price(args: argparse.Namespace) -> None:
    print(f"\nthe chunked head's extra time per step: predicted (remat.profile) vs measured ({args.rounds} rounds)")
    print(f"{'model':>6} {'chunks':>6} {'step ms':>8} {'predicted ms':>13} {'measured ms':>12} {'quartiles ms':>16}")
    for name in ("gpt2", "llama"):
        row = price_row(name, args.rounds)
        print(f"{name:>6} {row['chunks']:>6} {row['step'] * 1e3:>8.1f} {row['predicted'] * 1e3:>13.1f} "
              f"{row['measured'] * 1e3:>12.1f} {row['low'] * 1e3:>7.1f}..{row['high'] * 1e3:<7.1f}")


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
    parser.add_argument("--tables", default="head,step", help="which tables to print: head, step, price")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    tokens = args.batch * args.seq
    if "head" in args.tables:
        print_head(tokens, args)
    if "step" in args.tables:
        print_step(tokens, args)
    if "price" in args.tables:
        print_price(args)


if __name__ == "__main__":
    main()
