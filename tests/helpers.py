"""Small models, gradient helpers and the remat command run in this process, shared by the tests."""

import contextlib
import io
import os
import shutil
import subprocess
import sys
import warnings
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed._tools.mem_tracker import MemTracker
from torch.utils._python_dispatch import TorchDispatchMode

MM = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default}


class CountOps(TorchDispatchMode):
    """Counts the calls of the ops in ``ops`` while active (``.count``)."""

    def __init__(self, ops):
        super().__init__()
        self.ops, self.count = ops, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func in self.ops
        return func(*args, **(kwargs or {}))


class MLPBlock(nn.Module):
    def __init__(self, width: int = 16, hidden: int = 32, p: float = 0.25) -> None:
        super().__init__()
        self.up = nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, width)
        self.drop = nn.Dropout(p)

    def forward(self, x):
        return x + self.drop(self.down(torch.nn.functional.gelu(self.up(x))))


class MLPStack(nn.Module):
    def __init__(self, depth: int = 4, width: int = 16, hidden: int = 32, p: float = 0.25) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(MLPBlock(width, hidden, p) for _ in range(depth))

    def forward(self, x, wrap=None):
        for block in self.blocks:
            x = wrap(block, x) if wrap is not None else block(x)
        return x


def gpt_case(cfg, batch: int, device="cpu"):
    """remat's GPT of ``cfg`` seeded with 0, a synthetic batch of ``batch`` sequences, and the token cross-entropy of
    its logits on that batch: (model, tokens, targets, loss_fn)."""
    from remat.models import GPT, synthetic_batch

    torch.manual_seed(0)
    model = GPT(cfg).to(device)
    tokens, targets = synthetic_batch(cfg, batch, device=device)

    def loss_fn(logits):
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())

    return model, tokens, targets, loss_fn


def grads(loss_fn, params, seed=0):
    """Loss and gradients of loss_fn() w.r.t. params, with a fixed RNG seed."""
    torch.manual_seed(seed)
    loss = loss_fn()
    return loss.detach(), torch.autograd.grad(loss, params)


def assert_bitwise(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        if x is None or y is None:
            assert x is None and y is None
            continue
        assert x.dtype == y.dtype and x.shape == y.shape
        assert torch.equal(x, y), f"max abs diff {(x - y).abs().max().item()}"


def backward_grads(loss_fn, params, seed=0, **backward_kwargs):
    """Like grads() but through .backward(), which the reentrant variant needs."""
    for p in params:
        p.grad = None
    torch.manual_seed(seed)
    loss = loss_fn()
    loss.backward(**backward_kwargs)
    out = tuple(p.grad for p in params)
    for p in params:
        p.grad = None
    return loss.detach(), out


def held_after_forward(module, block, shape):
    """Bytes alive after ``module``'s forward besides ``block``'s parameters, its input and its output (MemTracker).

    The input (shape ``shape``, requiring grad) is made under the tracker so it is counted, then taken out.
    """
    tracker = MemTracker()
    tracker.track_external(block)
    with tracker:
        torch.manual_seed(1)
        x = torch.randn(shape, requires_grad=True)
        y = module(x)
        snapshot = max(tracker.get_tracker_snapshot("current").values(), key=lambda s: s["Total"])
    params = sum(p.untyped_storage().nbytes() for p in block.parameters())
    held = snapshot["Total"] - params - x.untyped_storage().nbytes() - y.untyped_storage().nbytes()
    # MemTracker's gradient hooks hold the graph (and its checkpoint frames) until a backward runs through them.
    torch.autograd.backward(y.sum(), inputs=[x])
    return held


def run_two_ranks(worker: str, *args: str) -> subprocess.CompletedProcess:
    """Run ``tests/<worker>`` under torchrun as two CPU processes (one thread each); returns the finished run."""
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or shutil.which("torchrun")
    command = [torchrun] if torchrun else [sys.executable, "-m", "torch.distributed.run"]
    script = os.path.join(os.path.dirname(__file__), worker)
    return subprocess.run(
        [*command, "--standalone", "--nproc_per_node", "2", script, *args],
        capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


def leave_process_group() -> None:
    """End a torchrun worker: destroy the process group, flush, and exit without finalizing the interpreter.

    Gloo's worker threads may still be dropping the last collective's tensors when the main thread returns;
    if the interpreter is finalizing by then, their GIL acquire aborts the process ("terminate called without
    an active exception", pytorch/pytorch#179291). Skipping finalization leaves them nothing to race with.
    """
    import torch.distributed as dist

    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@dataclass
class Finished:
    """What a command left: its exit status and what it printed."""

    returncode: int
    stdout: str
    stderr: str


# The warning filters a fresh interpreter starts with: a warning the command lets through reaches its stderr as
# it would a user's terminal, whatever filters the test run has set.
_INTERPRETER_FILTERS = [("default", DeprecationWarning, "__main__"), ("ignore", DeprecationWarning, None),
                        ("ignore", PendingDeprecationWarning, None), ("ignore", ImportWarning, None),
                        ("ignore", ResourceWarning, None)]


def _to_stderr(message, category, filename, lineno, file=None, line=None):
    sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))


def remat_cli(*args: str, cwd=None) -> Finished:
    """Run ``remat ARGS`` in this process, in the folder ``cwd`` if given; the modules it imported from that
    folder are forgotten after, as another test's folder holds modules of the same names."""
    from remat.tools.cli import main

    out, err = io.StringIO(), io.StringIO()
    here = os.getcwd()
    folder = os.path.abspath(cwd) if cwd is not None else None
    os.chdir(folder or here)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), warnings.catch_warnings():
            warnings.resetwarnings()
            for action, category, module in reversed(_INTERPRETER_FILTERS):
                warnings.filterwarnings(action, category=category, module=module or "")
            warnings.showwarning = _to_stderr
            try:
                code = main(list(args))
            except SystemExit as stop:  # argparse: --help, and its argument errors
                code = stop.code
    finally:
        os.chdir(here)
        for name, module in list(sys.modules.items()):
            if folder and str(getattr(module, "__file__", None) or "").startswith(folder + os.sep):
                del sys.modules[name]
    return Finished(code, out.getvalue(), err.getvalue())


def split_decoder_layers(model, mesh):
    """A transformers decoder split by tensor parallel as torchtitan splits its Llama: each layer's q / k / v / gate /
    up projections column-wise, o / down row-wise, over ``mesh``."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    for layer in model.model.layers:
        parallelize_module(layer.self_attn, mesh, {"q_proj": ColwiseParallel(), "k_proj": ColwiseParallel(),
                                                   "v_proj": ColwiseParallel(), "o_proj": RowwiseParallel()})
        parallelize_module(layer.mlp, mesh, {"gate_proj": ColwiseParallel(), "up_proj": ColwiseParallel(),
                                             "down_proj": RowwiseParallel()})
    return model


def train_counting(model, batches, loss_of, ops):
    """SGD over ``batches``: per step the loss, this rank's gradients (a DTensor's local shard), the step's peak
    (``remat.measure_step``) and how many calls of ``ops`` its backward ran (a dispatch mode outside a checkpoint's
    own sees only the ops the checkpoint does not serve from what it kept)."""
    import remat

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, grads_, peaks, counts = [], [], [], []
    for step, batch in enumerate(batches):
        torch.manual_seed(step)  # dropout draws alike in every run

        def run(batch=batch):
            opt.zero_grad()
            loss = loss_of(model, batch)
            with CountOps(ops) as counter:
                loss.backward()
            counts.append(counter.count)
            losses.append(loss.detach())
            grads_.append([getattr(p.grad, "_local_tensor", p.grad).clone() for p in model.parameters()])
            opt.step()

        peaks.append(remat.measure_step(run, model, opt).peak_total)
    return losses, grads_, peaks, counts
