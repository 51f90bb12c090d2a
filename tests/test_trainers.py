"""The trainers users run, on tiny random-weight models on the CPU: Hugging Face Trainer, Lightning, accelerate.

Each run takes a few optimizer steps with and without remat from the same seed; equal losses and bitwise equal
final parameters mean remat's gradients were those of the reference at every step.
"""

import importlib

import pytest
import torch
from helpers import assert_bitwise

import remat
from remat.models import GPT, Block, GPTConfig, synthetic_batch

CHECKPOINT_MODULE = importlib.import_module("remat.api.checkpoint")


@pytest.fixture
def remat_regions(monkeypatch):
    """Counts regions run by remat's eager engine (proof that remat, not torch, checkpointed)."""
    count = [0]
    engine = CHECKPOINT_MODULE.run_nonreentrant

    def counting(*args, **kwargs):
        count[0] += 1
        return engine(*args, **kwargs)

    monkeypatch.setattr(CHECKPOINT_MODULE, "run_nonreentrant", counting)
    return count


# ---- Hugging Face Trainer ------------------------------------------------------------------------------

def _hf_run(tmp_path, name, prepare, activation_checkpointing, steps=3):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=96, n_embd=32, n_layer=2, n_head=2, n_positions=32,
                                  resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)
    transformers.set_seed(0)
    model = prepare(transformers.GPT2LMHeadModel(cfg))
    tokens = torch.randint(0, 96, (8, 32), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": row, "labels": row} for row in tokens]
    # transformers 5 renamed gradient_checkpointing to activation_checkpointing (the old names are deprecated)
    switch = "activation" if "activation_checkpointing" in transformers.TrainingArguments.__dataclass_fields__ \
        else "gradient"
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / name), max_steps=steps, per_device_train_batch_size=4, learning_rate=1e-3,
        logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, seed=0, data_seed=0,
        disable_tqdm=True, dataloader_num_workers=0, **{
            f"{switch}_checkpointing": activation_checkpointing,
            f"{switch}_checkpointing_kwargs": {"use_reentrant": False} if activation_checkpointing else None,
        },
    )
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return model, losses


def test_hf_trainer_with_remat_matches_pytorch_gradient_checkpointing(tmp_path, remat_regions):
    from remat.integrations.transformers import enable

    plain, plain_losses = _hf_run(tmp_path, "plain", lambda m: m, activation_checkpointing=False)
    torch_gc, torch_losses = _hf_run(tmp_path, "torch", lambda m: m, activation_checkpointing=True)
    assert remat_regions[0] == 0
    # what users write: enable remat, then let the Trainer switch checkpointing on as usual
    ours, remat_losses = _hf_run(tmp_path, "remat", enable, activation_checkpointing=True)
    assert remat_regions[0] == 3 * 2  # three steps, two layers: the Trainer's switch kept remat's function
    assert len(remat_losses) == 3 and remat_losses == torch_losses == plain_losses
    assert_bitwise(list(ours.parameters()), list(torch_gc.parameters()))
    assert_bitwise(list(ours.parameters()), list(plain.parameters()))


def test_hf_trainer_with_a_remat_policy_and_no_trainer_switch(tmp_path, remat_regions):
    from remat.integrations.transformers import enable

    plain, plain_losses = _hf_run(tmp_path, "plain", lambda m: m, activation_checkpointing=False, steps=2)
    ours, losses = _hf_run(tmp_path, "remat", lambda m: enable(m, policy=remat.policies.save_matmuls),
                           activation_checkpointing=False, steps=2)
    assert remat_regions[0] == 2 * 2 and losses == plain_losses
    assert_bitwise(list(ours.parameters()), list(plain.parameters()))


# ---- Lightning ------------------------------------------------------------------------------------------

CFG = GPTConfig(d_model=32, n_heads=2, n_layers=2, seq_len=16, vocab_size=64, dropout=0.1)


def _lightning_module(use_remat):
    lightning = pytest.importorskip("lightning")

    class TinyGPT(lightning.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = GPT(CFG)

        def configure_model(self):
            # Lightning calls this in every fit/validate/test; apply_activation_checkpointing never wraps twice
            if use_remat:
                remat.apply_activation_checkpointing(self.model, check_fn=lambda m: isinstance(m, Block))

        def training_step(self, batch, batch_index):
            tokens, targets = batch
            loss = self.model.loss(tokens, targets)
            self.losses.append(loss.detach())
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    lightning.seed_everything(0, verbose=False)
    module = TinyGPT()
    module.losses = []
    return module


def _lightning_fit(module, tmp_path):
    import lightning

    tokens, targets = synthetic_batch(CFG, 12, torch.Generator().manual_seed(1))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens, targets), batch_size=4)
    trainer = lightning.Trainer(
        accelerator="cpu", devices=1, max_steps=3, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path, deterministic=True,
    )
    lightning.seed_everything(0, verbose=False)
    trainer.fit(module, loader)


def test_lightning_configure_model_with_remat_trains_like_plain(tmp_path, remat_regions):
    plain, ours = _lightning_module(use_remat=False), _lightning_module(use_remat=True)
    _lightning_fit(plain, tmp_path / "plain")
    _lightning_fit(ours, tmp_path / "remat")
    assert [type(b).__name__ for b in ours.model.blocks] == ["CheckpointWrapper", "CheckpointWrapper"]
    assert remat_regions[0] == 3 * 2
    assert_bitwise(ours.losses, plain.losses)
    assert_bitwise(list(ours.parameters()), list(plain.parameters()))
    assert list(ours.state_dict()) == list(plain.state_dict())
    _lightning_fit(ours, tmp_path / "again")  # configure_model runs again: still one wrapper per block
    assert isinstance(ours.model.blocks[0]._checkpoint_wrapped_module, Block)


# ---- accelerate -----------------------------------------------------------------------------------------

def _accelerate_run(use_remat):
    accelerate = pytest.importorskip("accelerate")
    torch.manual_seed(0)
    model = GPT(CFG)
    if use_remat:
        remat.apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Block))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens, targets = synthetic_batch(CFG, 12, torch.Generator().manual_seed(1))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens, targets), batch_size=4)
    accelerator = accelerate.Accelerator(cpu=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    torch.manual_seed(3)
    losses = []
    for tokens, targets in loader:
        loss = model.loss(tokens, targets)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    return accelerator, model, losses


def test_accelerate_prepare_keeps_remat_and_trains_like_plain(remat_regions):
    _, plain, plain_losses = _accelerate_run(use_remat=False)
    accelerator, ours, losses = _accelerate_run(use_remat=True)
    assert remat_regions[0] == 3 * 2
    assert isinstance(accelerator.unwrap_model(ours).blocks[0], remat.CheckpointWrapper)
    assert_bitwise(losses, plain_losses)
    assert_bitwise(list(ours.parameters()), list(plain.parameters()))
    assert list(accelerator.get_state_dict(ours)) == list(accelerator.get_state_dict(plain))
