"""remat.chunk_lm_head and enable(chunked_loss=...): Hugging Face causal LMs trained with the chunked loss.

Tiny configs, random weights, no download.  Each model trains several AdamW steps; with one chunk every loss
and gradient is bitwise the model's own, with several within float32 tolerance; layer checkpointing through
remat composes; the step's peak falls by the logits' bytes.
"""

import copy

import pytest
import torch
from helpers import assert_bitwise

import remat
from remat.planning.basics.memory import measure_step

transformers = pytest.importorskip("transformers")
from remat.integrations.transformers import enable  # noqa: E402

VOCAB = 300


def llama(tie=False):
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tie)
    return transformers.LlamaForCausalLM(cfg)


def gpt2():  # tied embedding, dropout
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                  bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg)


def gemma2():  # tied embedding, final_logit_softcapping
    cfg = transformers.Gemma2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    assert cfg.final_logit_softcapping
    return transformers.Gemma2ForCausalLM(cfg)


MODELS = {"llama": llama, "llama-tied": lambda: llama(tie=True), "gpt2": gpt2, "gemma2": gemma2}


def batch(seed=0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (2, 16), generator=gen)
    labels = ids.clone()
    labels[:, :3] = -100  # a masked prompt
    return ids, labels


def train(model, steps=3, **call):
    """Loss and gradients of every step, an AdamW step between."""
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids, labels = batch()
    out = []
    for step in range(steps):
        torch.manual_seed(step)  # dropout draws the same masks in every variant
        loss = model(input_ids=ids, labels=labels, **call).loss
        loss.backward()
        out.append([loss.detach()] + [p.grad.clone() for p in model.parameters()])
        opt.step()
        opt.zero_grad(set_to_none=True)
    return out


def assert_close(expected, got, tolerance=1e-5):
    for x, y in zip(expected, got):
        scale = x.abs().max().clamp_min(1e-30)
        assert ((x - y).abs().max() / scale).item() <= tolerance


@pytest.mark.parametrize("name", MODELS)
def test_trains_as_the_model_own_loss(name):
    torch.manual_seed(0)
    base = MODELS[name]()
    expected = train(copy.deepcopy(base))
    for step_a, step_b in zip(expected, train(remat.chunk_lm_head(copy.deepcopy(base), chunks=1))):
        assert_bitwise(step_a, step_b)
    for step_a, step_b in zip(expected, train(remat.chunk_lm_head(copy.deepcopy(base), chunks=3))):
        assert_close(step_a, step_b)


def test_num_items_in_batch_as_gradient_accumulation_passes_it():
    torch.manual_seed(0)
    base = llama()
    items = torch.tensor(20)
    expected = train(copy.deepcopy(base), num_items_in_batch=items)
    for step_a, step_b in zip(expected, train(remat.chunk_lm_head(copy.deepcopy(base), 1), num_items_in_batch=items)):
        assert_bitwise(step_a, step_b)


def test_composes_with_layer_checkpointing_and_policies():
    torch.manual_seed(0)
    base = llama()
    expected = train(copy.deepcopy(base))
    checkpointed = enable(copy.deepcopy(base), policy=remat.policies.save_matmuls, chunked_loss=1)
    for step_a, step_b in zip(expected, train(checkpointed)):
        assert_bitwise(step_a, step_b)
    assert remat.lm_head_chunks(checkpointed) == 1


def test_eval_and_no_labels_run_the_model_own_forward():
    torch.manual_seed(0)
    model = remat.chunk_lm_head(llama(), chunks=4)
    ids, labels = batch()
    model.train()
    assert model(input_ids=ids, labels=labels).logits is None
    assert model(input_ids=ids).logits.shape == (2, 16, VOCAB)
    model.eval()
    out = model(input_ids=ids, labels=labels)
    assert out.logits.shape == (2, 16, VOCAB) and out.loss is not None
    remat.unchunk_lm_head(model).train()
    assert remat.lm_head_chunks(model) is None and model(input_ids=ids, labels=labels).logits is not None


def test_forward_keeps_the_signature_the_trainer_reads_columns_by():
    """The Hugging Face Trainer keeps the dataset columns ``model.forward``'s signature names: ``*args, **kwargs``
    would drop input_ids and labels ("You must specify exactly one of input_ids or inputs_embeds")."""
    import inspect

    model = llama()
    own = inspect.signature(model.forward)
    remat.chunk_lm_head(model, chunks=4)
    assert inspect.signature(model.forward) == own
    remat.unchunk_lm_head(model)
    assert inspect.signature(model.forward) == own


def test_model_without_a_head_is_refused():
    with pytest.raises(ValueError, match="remat.chunked_lm_loss"):
        remat.chunk_lm_head(torch.nn.Linear(4, 4))
    with pytest.raises(ValueError, match="chunks must be a positive int"):
        remat.chunk_lm_head(llama(), chunks=0)


def test_step_peak_falls_by_the_logits():
    """Every layer checkpointed, a Llama step's peak is mostly its head; eight chunks remove most of it.

    Unchunked, backward holds log_softmax's output, its gradient and the logits' gradient (3 x tokens x vocab
    float32 bytes) before the head weight's gradient exists; chunked, a chunk's share of them with the weight's
    gradient and the chunk's part of it being added.
    """
    torch.manual_seed(0)
    vocab, tokens = 4000, 2 * 128
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    base = transformers.LlamaForCausalLM(cfg).train()
    ids = torch.randint(0, vocab, (2, 128))
    peaks = {}
    for chunks in (None, 8):
        model = enable(copy.deepcopy(base), chunked_loss=chunks)
        step = lambda model=model: model(input_ids=ids, labels=ids).loss.backward()  # noqa: E731
        peaks[chunks] = measure_step(step, model).peak_above_params
    logits = 3 * tokens * vocab * 4
    predicted_drop = logits - logits // 8 - 2 * vocab * 32 * 4  # the weight's gradient and a chunk's share
    assert abs((peaks[None] - peaks[8]) - predicted_drop) <= 0.03 * peaks[None]
    assert peaks[8] * 4 < peaks[None]


def test_compiles_with_aot_eager():
    """Dynamo breaks the graph at the base model's hook and at the backward's autograd.grad; the step is right."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    base = llama()
    expected = train(copy.deepcopy(base), steps=1)[0]
    model = remat.chunk_lm_head(copy.deepcopy(base), chunks=3).train()
    ids, labels = batch()
    loss = torch.compile(model, backend="aot_eager")(input_ids=ids, labels=labels).loss
    loss.backward()
    assert_close(expected, [loss.detach()] + [p.grad for p in model.parameters()])
    torch._dynamo.reset()
