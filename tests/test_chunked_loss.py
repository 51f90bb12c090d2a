"""remat.chunked_lm_loss: the output layer and loss over token chunks, against the unchunked head and loss.

The reference is what a Hugging Face causal LM computes: ``lm_head`` (``F.linear``), Gemma's soft-capping,
then transformers' own ``ForCausalLMLoss`` (upcast, shift, ignore_index, mean or ``num_items_in_batch``).
One chunk: bitwise.  Several: within the tolerances the docs state (float32: 1e-5, bfloat16 and autocast:
2e-2, both relative to the largest magnitude of the compared tensor).
"""

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_bitwise
from torch import nn

import remat
from remat.planning.basics.memory import measure_step

transformers = pytest.importorskip("transformers")
from transformers.loss.loss_utils import ForCausalLMLoss  # noqa: E402

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def reference(hidden, weight, labels, bias=None, num_items_in_batch=None, softcap=None):
    logits = F.linear(hidden, weight, bias)
    if softcap is not None:
        logits = logits / softcap
        logits = torch.tanh(logits)
        logits = logits * softcap
    return ForCausalLMLoss(logits, labels, weight.shape[0], num_items_in_batch=num_items_in_batch)


def run(chunks, hidden, weight, labels, bias=None, autocast=False, **kwargs):
    """Loss and gradients (hidden, weight, bias) of one backward with an upstream gradient that is not 1."""
    leaves = [t.clone().requires_grad_() if t is not None else None for t in (hidden, weight, bias)]
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        if chunks is None:
            loss = reference(leaves[0], leaves[1], labels, leaves[2], **kwargs)
        else:
            loss = remat.chunked_lm_loss(leaves[0], leaves[1], labels, leaves[2], chunks=chunks, **kwargs)
    (loss * 1.7).backward()
    return [loss.detach()] + [t.grad if t is not None else None for t in leaves]


def case(dtype, bias=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(2, 24, 16, generator=gen).to(dtype)
    weight = (torch.randn(50, 16, generator=gen) * 0.3).to(dtype)
    labels = torch.randint(0, 50, (2, 24), generator=gen)
    labels[0, :5] = -100  # a masked prompt
    return hidden, weight, labels, (torch.randn(50, generator=gen).to(dtype) if bias else None)


def assert_close(expected, got, tolerance):
    for x, y in zip(expected, got):
        if x is None:
            assert y is None
            continue
        assert x.dtype == y.dtype and x.shape == y.shape
        scale = x.float().abs().max().clamp_min(1e-30)
        assert ((x.float() - y.float()).abs().max() / scale).item() <= tolerance


GRID = [
    pytest.param(dtype, bias, softcap, items, autocast, id=f"{str(dtype)[6:]}-bias{bias}-cap{softcap}-items"
                 f"{type(items).__name__}-autocast{autocast}")
    for dtype in (torch.float32, torch.bfloat16) for bias in (False, True) for softcap in (None, 30.0)
    for items in (None, 37, torch.tensor(37)) for autocast in (False, True)
    if not (autocast and dtype is torch.bfloat16)
]


@pytest.mark.parametrize(("dtype", "bias", "softcap", "items", "autocast"), GRID)
def test_one_chunk_is_bitwise_and_several_within_tolerance(dtype, bias, softcap, items, autocast):
    hidden, weight, labels, b = case(dtype, bias)
    kwargs = {"softcap": softcap, "num_items_in_batch": items}
    expected = run(None, hidden, weight, labels, b, autocast, **kwargs)
    assert_bitwise(expected, run(1, hidden, weight, labels, b, autocast, **kwargs))
    tolerance = TOLERANCE[torch.bfloat16 if autocast else dtype]
    for chunks in (3, 7, 48, 100):  # uneven, one token per chunk, more chunks than tokens
        assert_close(expected, run(chunks, hidden, weight, labels, b, autocast, **kwargs), tolerance)


def test_every_label_ignored_gives_nan_as_the_unchunked_mean():
    hidden, weight, labels, _ = case(torch.float32)
    labels.fill_(-100)
    assert run(None, hidden, weight, labels)[0].isnan() and run(4, hidden, weight, labels)[0].isnan()


def test_labels_already_shifted():
    hidden, weight, labels, _ = case(torch.float32)
    shifted = remat.chunked_lm_loss(hidden, weight, remat.shift_labels(labels), shift=False, chunks=1)
    assert torch.equal(shifted, remat.chunked_lm_loss(hidden, weight, labels, chunks=1))


class TiedLM(nn.Module):
    """Embedding and output layer share one weight (GPT-2's, Gemma's)."""

    def __init__(self, vocab=50, width=16):
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.mix = nn.Linear(width, width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids, labels, chunks=None):
        hidden = torch.tanh(self.mix(self.emb(ids)))
        if chunks is None:
            return reference(hidden, self.head.weight, labels)
        return remat.chunked_lm_loss(hidden, self.head.weight, labels, chunks=chunks)


def test_tied_embedding_gradient_adds_both_uses():
    torch.manual_seed(0)
    model = TiedLM()
    ids = torch.randint(0, 50, (2, 24))
    results = {}
    for chunks in (None, 1, 5):
        model.zero_grad(set_to_none=True)
        loss = model(ids, ids, chunks)
        loss.backward()
        results[chunks] = [loss.detach()] + [p.grad.clone() for p in model.parameters()]
    assert_bitwise(results[None], results[1])
    assert_close(results[None], results[5], TOLERANCE[torch.float32])


def test_composes_with_checkpoint_and_policies():
    torch.manual_seed(0)
    model = TiedLM()
    ids = torch.randint(0, 50, (2, 24))

    def grads_of(loss_fn):
        model.zero_grad(set_to_none=True)
        loss = loss_fn()
        loss.backward()
        return [loss.detach()] + [p.grad.clone() for p in model.parameters()]

    expected = grads_of(lambda: model(ids, ids, 1))
    assert_bitwise(expected, grads_of(lambda: remat.checkpoint(model, ids, ids, 1)))
    assert_bitwise(expected, grads_of(lambda: remat.checkpoint(model, ids, ids, 1,
                                                               policy=remat.policies.save_matmuls)))


def test_compiles_on_cpu():
    torch._dynamo.reset()
    hidden, weight, labels, _ = case(torch.float32)
    expected = run(3, hidden, weight, labels)
    compiled = torch.compile(lambda h, w: remat.chunked_lm_loss(h, w, labels, chunks=3), backend="aot_eager")
    leaves = [hidden.clone().requires_grad_(), weight.clone().requires_grad_()]
    loss = compiled(*leaves)
    (loss * 1.7).backward()
    assert_bitwise(expected[:3], [loss.detach(), leaves[0].grad, leaves[1].grad])
    torch._dynamo.reset()


def predicted_head_peak(tokens, features, vocab, chunks, nbytes=4):
    """Bytes above the weight while the head and loss run, the hidden state given (float32, no autocast).

    Unchunked, backward holds log_softmax's output, its gradient and the logits' gradient (3 x tokens x vocab)
    with the hidden state.  Chunked, one chunk's three, the hidden state and its gradient, and the weight's
    gradient with one chunk's share of it being added.
    """
    if chunks is None:
        return 3 * tokens * vocab * nbytes + tokens * features * nbytes
    rows = -(-tokens // chunks)
    return 3 * rows * vocab * nbytes + 2 * tokens * features * nbytes + 2 * vocab * features * nbytes


@pytest.mark.parametrize("chunks", [None, 4, 8, 16])
def test_head_peak_drops_as_predicted(chunks):
    tokens, features, vocab = 512, 32, 1000
    head = nn.Linear(features, vocab, bias=False)
    gen = torch.Generator().manual_seed(0)
    hidden, labels = torch.randn(tokens, features, generator=gen), torch.randint(0, vocab, (tokens,), generator=gen)

    def step():
        h = hidden.clone().requires_grad_()
        loss = (reference(h, head.weight, labels) if chunks is None
                else remat.chunked_lm_loss(h, head.weight, labels, chunks=chunks))
        loss.backward()

    measured = measure_step(step, head).peak_above_params
    assert abs(measured - predicted_head_peak(tokens, features, vocab, chunks)) <= 0.03 * measured
    if chunks == 8:  # the head's peak falls more than 5x
        assert measured * 5 < predicted_head_peak(tokens, features, vocab, None)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"chunks": 0}, "chunks must be a positive int"),
    ({"chunks": 2.0}, "chunks must be a positive int"),
    ({"softcap": 0.0}, "softcap must be positive"),
])
def test_bad_arguments_are_named(kwargs, message):
    hidden, weight, labels, _ = case(torch.float32)
    with pytest.raises(ValueError, match=message):
        remat.chunked_lm_loss(hidden, weight, labels, **kwargs)


def test_labels_of_another_shape_are_refused():
    hidden, weight, labels, _ = case(torch.float32)
    with pytest.raises(ValueError, match="must match hidden"):
        remat.chunked_lm_loss(hidden, weight, labels[:, :-1])


def test_demo_gpt_trains_through_it_and_its_step_peak_falls():
    """The demo GPT, every block checkpointed, its loss through the chunked head: ``GPT.loss``'s value, bitwise
    gradients with one chunk, and a step peak (the head's backward, 3 x tokens x vocab float32 bytes) three
    times lower with eight chunks, where the parameters' gradients then peak instead."""
    from remat.models import GPT, GPTConfig, synthetic_batch

    torch.manual_seed(0)
    cfg = GPTConfig(n_layers=2, d_model=32, n_heads=2, vocab_size=2000, dropout=0.0)
    model = GPT(cfg)
    tokens, targets = synthetic_batch(cfg, batch_size=2)

    def loss_of(chunks):
        x = model.drop(model.tok_emb(tokens) + model.pos_emb(torch.arange(tokens.shape[1])))
        for block in model.blocks:
            x = remat.checkpoint(block, x)
        if chunks is None:
            return F.cross_entropy(model.head(model.ln_f(x)).flatten(0, 1), targets.flatten())
        return remat.chunked_lm_loss(model.ln_f(x), model.head.weight, targets, chunks=chunks, shift=False)

    def grads_of(chunks):
        model.zero_grad(set_to_none=True)
        loss = loss_of(chunks)
        loss.backward()
        return [loss.detach()] + [p.grad.clone() for p in model.parameters()]

    assert torch.equal(loss_of(1), model.loss(tokens, targets))
    assert_bitwise(grads_of(None), grads_of(1))
    peaks = {}
    for chunks in (None, 8):
        model.zero_grad(set_to_none=True)
        peaks[chunks] = measure_step(lambda c=chunks: loss_of(c).backward(), model).peak_above_params
    assert peaks[8] * 3 < peaks[None]
