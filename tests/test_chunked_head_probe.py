"""chunk_lm_head accepts a model only where its own loss is the chunked one, shown by a probe.

Causal LMs whose forward computes the loss from more than the output layer applied to the last hidden state
(a logit multiplier or divisor, a dense layer and a norm before the output embedding, a router's auxiliary
loss) are refused in one line, at ``chunk_lm_head`` when their config decides it and at the first call whose
arguments do; the probe changes nothing a training loop sees (random state, buffers, gradients).
"""

import copy
import inspect

import pytest
import torch
from helpers import assert_bitwise

import remat

transformers = pytest.importorskip("transformers")
from remat.integrations.transformers import enable  # noqa: E402

VOCAB = 256
SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=VOCAB)


def mixtral(**extra):
    cfg = transformers.MixtralConfig(**SMALL, num_local_experts=4, num_experts_per_tok=2, **extra)
    return transformers.MixtralForCausalLM(cfg)


def falcon_h1():  # multiplies its logits by lm_head_multiplier
    cfg = transformers.FalconH1Config(**SMALL, lm_head_multiplier=0.5, mamba_d_ssm=32, mamba_n_heads=4,
                                      mamba_d_head=8, mamba_d_state=8, mamba_chunk_size=8)
    return transformers.FalconH1ForCausalLM(cfg)


def modernbert_decoder():  # logits = decoder(lm_head(h)): a dense layer and a norm before the output embedding
    cfg = transformers.ModernBertDecoderConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                               num_attention_heads=4, vocab_size=VOCAB, pad_token_id=0,
                                               bos_token_id=1, eos_token_id=2, sep_token_id=3, cls_token_id=1)
    return transformers.ModernBertDecoderForCausalLM(cfg)


def granite(scaling=4.0):  # divides its logits by logits_scaling
    return transformers.GraniteForCausalLM(transformers.GraniteConfig(**SMALL, logits_scaling=scaling))


def cohere():  # multiplies its logits by logit_scale
    return transformers.CohereForCausalLM(transformers.CohereConfig(**SMALL, logit_scale=0.5))


def batch(rows=2, tokens=24, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (rows, tokens), generator=gen)


def own_loss(model, **kwargs):
    ids = batch()
    torch.manual_seed(1)
    return model(input_ids=ids, labels=ids, **kwargs).loss


@pytest.mark.parametrize("build", [falcon_h1, modernbert_decoder, granite, cohere, lambda: mixtral(
    output_router_logits=True)], ids=["falcon_h1", "modernbert_decoder", "granite", "cohere", "mixtral_config"])
def test_models_whose_loss_is_not_the_chunked_one_are_refused_and_left_as_they_were(build):
    torch.manual_seed(0)
    model = build().train()
    before = own_loss(model)
    forward = model.forward
    with pytest.raises(ValueError, match="own loss .*is not the output layer's cross-entropy") as refused:
        remat.chunk_lm_head(model, chunks=1)
    assert "\n" not in str(refused.value) and "without chunk_lm_head" in str(refused.value)
    assert remat.lm_head_chunks(model) is None and model.forward == forward and "forward" not in vars(model)
    assert torch.equal(own_loss(model), before)
    with pytest.raises(ValueError, match="is not the output layer's cross-entropy"):
        enable(model, chunked_loss=2)
    assert remat.lm_head_chunks(model) is None


def test_a_call_argument_that_adds_a_router_loss_is_refused_at_call_time():
    """Mixtral's config leaves the router loss off, so the head is accepted; a call that turns it on is refused
    before computing anything, naming the argument; calls without it stay bitwise the model's own."""
    torch.manual_seed(0)
    base = mixtral().train()
    model = remat.chunk_lm_head(copy.deepcopy(base), chunks=1)
    ids = batch()
    with pytest.raises(ValueError, match="when called with output_router_logits=True") as refused:
        model(input_ids=ids, labels=ids, output_router_logits=True)
    assert "\n" not in str(refused.value)
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(own_loss(model), own_loss(base))
    assert torch.equal(own_loss(model, output_router_logits=False), own_loss(base))


def test_a_changed_config_or_a_hook_on_the_output_layer_is_probed_again():
    """What a call computes may change between calls: the config's logit divisor, a hook on the output layer
    (the chunked loss never calls the layer). Each change is a new call signature, probed on its first call."""
    torch.manual_seed(0)
    model = remat.chunk_lm_head(granite(scaling=1.0).train(), chunks=2)
    ids = batch()
    model(input_ids=ids, labels=ids).loss.backward()
    model.config.logits_scaling = 4.0
    with pytest.raises(ValueError, match="GraniteForCausalLM's own loss"):
        model(input_ids=ids, labels=ids)
    model.config.logits_scaling = 1.0
    model(input_ids=ids, labels=ids)
    handle = model.lm_head.register_forward_hook(lambda module, inputs, output: output * 2)
    with pytest.raises(ValueError, match="own loss"):
        model(input_ids=ids, labels=ids)
    handle.remove()
    model(input_ids=ids, labels=ids)


OPTIMIZERS = {"sgd": lambda params: torch.optim.SGD(params, lr=1e-2, momentum=0.9),
              "adamw-foreach": lambda params: torch.optim.AdamW(params, lr=1e-2, foreach=True),
              "adamw-fused": lambda params: torch.optim.AdamW(params, lr=1e-2, fused=True)}


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_probes_leave_a_training_loop_bitwise_the_model_own(optimizer):
    """GPT-2 with dropout, called with an attention mask (a signature the install probe did not see, probed on
    the first step) and without one on the last step (another signature, probed there): every step's loss and
    gradients are bitwise the unchunked model's, with an optimizer step between them."""
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                  bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    base = transformers.GPT2LMHeadModel(cfg).train()

    def train(model):
        torch.manual_seed(3)
        opt = OPTIMIZERS[optimizer](model.parameters())
        out = []
        for step in range(3):
            ids = batch(seed=step)
            mask = torch.ones_like(ids)
            mask[0, :3] = 0
            masked = {"attention_mask": mask} if step < 2 else {}
            loss = model(input_ids=ids, labels=ids, **masked).loss
            loss.backward()
            out.append([loss.detach().clone()] + [p.grad.clone() for p in model.parameters()])
            opt.step()
            opt.zero_grad()
        return out

    expected = train(copy.deepcopy(base))
    for step_a, step_b in zip(expected, train(remat.chunk_lm_head(copy.deepcopy(base), chunks=1))):
        assert_bitwise(step_a, step_b)


def test_planner_leaves_out_the_chunked_head_where_the_call_changes_the_loss():
    torch.manual_seed(0)
    model = mixtral().train()
    ids = batch()
    prof = remat.profile(model, input_ids=ids, labels=ids, output_router_logits=True)
    assert prof.head is None
    prof = remat.profile(model, input_ids=ids, labels=ids)
    assert prof.head is not None


def test_the_probe_is_not_taken_for_a_planned_model_first_forward():
    """A plan applied first watches the model's first forward for the profiled shapes; chunking its head
    afterwards probes on a 1 x 16 batch, which must neither warn nor use up that check."""
    import warnings

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL)).train()
    ids = batch()
    plan = remat.profile(model, input_ids=ids, labels=ids, ops=False).plan(0.9)
    plan.head_chunks = 0
    plan.apply(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", remat.InputShapeWarning)
        remat.chunk_lm_head(model, chunks=2)
        model(input_ids=ids, labels=ids)
    with pytest.warns(remat.InputShapeWarning, match="runs on input_ids 1x24"):
        remat.unchunk_lm_head(plan.remove(model))
        plan.apply(model)
        model(input_ids=ids[:1], labels=ids[:1])


def test_a_compiled_model_is_probed_as_an_eager_one():
    """The proof runs eagerly (dynamo breaks the graph at it): a compiled call that adds the router's loss is
    refused as the eager one is."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = remat.chunk_lm_head(mixtral().train(), chunks=2)
    compiled = torch.compile(model, backend="aot_eager")
    ids = batch()
    with pytest.raises(ValueError, match="when called with output_router_logits=True"):
        compiled(input_ids=ids, labels=ids, output_router_logits=True)
    torch._dynamo.reset()


def test_a_loss_function_replaced_after_a_proven_call_is_probed_again():
    torch.manual_seed(0)
    model = remat.chunk_lm_head(transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL)).train(), chunks=2)
    ids = batch()
    model(input_ids=ids, labels=ids)
    own = model.loss_function
    model.loss_function = lambda *args, **kwargs: own(*args, **kwargs) * 2  # e.g. an auxiliary term
    with pytest.raises(ValueError, match="own loss"):
        model(input_ids=ids, labels=ids)


def test_a_pickled_chunked_model_stays_chunked():
    import pickle

    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL)).train()
    model = pickle.loads(pickle.dumps(remat.chunk_lm_head(copy.deepcopy(base), chunks=1)))
    ids = batch()
    out = model(input_ids=ids, labels=ids)
    assert out.logits is None and remat.lm_head_chunks(model) == 1
    assert torch.equal(out.loss, base(input_ids=ids, labels=ids).loss)
    assert "input_ids" in inspect.signature(model.forward).parameters  # what the Trainer's column filter reads


def test_a_multimodal_call_is_probed_whole():
    """Llava with the batch's one image in its second row: cutting the call to the first row would leave an
    image with no image tokens; the probe runs the whole call, and the chunked loss is the model's own."""
    vision = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                           num_attention_heads=2, image_size=16, patch_size=8, projection_dim=32)
    text = transformers.LlamaConfig(num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                                    num_key_value_heads=2, vocab_size=101)
    cfg = transformers.LlavaConfig(vision_config=vision, text_config=text, image_token_index=100,
                                   vision_feature_layer=-1, vision_feature_select_strategy="full")
    torch.manual_seed(0)
    base = transformers.LlavaForConditionalGeneration(cfg).train()
    ids = torch.randint(0, 99, (2, 24), generator=torch.Generator().manual_seed(0))
    ids[1, 2:7] = 100  # (16 / 8)^2 patches and the class token
    pixels = torch.randn(1, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    model = remat.chunk_lm_head(copy.deepcopy(base), chunks=1)
    torch.manual_seed(2)
    loss = model(input_ids=ids, pixel_values=pixels, labels=ids).loss
    torch.manual_seed(2)
    assert torch.equal(loss, base(input_ids=ids, pixel_values=pixels, labels=ids).loss)


def test_a_forward_of_the_instance_own_is_put_back():
    """A wrapper's forward on the instance (accelerate puts one there) survives the probe a profile runs, and
    unchunk_lm_head gives it back."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL)).train()
    calls = []
    own = model.forward

    def wrapped(*args, **kwargs):
        calls.append(1)
        return own(*args, **kwargs)

    model.forward = wrapped
    ids = batch()
    from remat.api.chunkedhead import lm_head_refusal

    assert lm_head_refusal(model, input_ids=ids, labels=ids) == ""
    assert model.forward is wrapped
    remat.unchunk_lm_head(remat.chunk_lm_head(model, chunks=2))
    assert model.forward is wrapped
    model(input_ids=ids, labels=ids)
    assert calls == [1]
