"""Finding the natural repeated block of a model: the unit the planner decides about.

A model's blocks sit in containers (``nn.ModuleList`` / ``nn.Sequential``), sometimes in containers of
containers (EfficientNet stages), sometimes inside stage modules that hold a chain of them (ConvNeXt, Swin,
ResNet stages: a ``Sequential``, or a ``ModuleList`` the stage runs in order), sometimes beside a stem and a
head in the same container (MobileNet).  Discovery:

1. looks at every container's *units*: its children, with plain ``nn.Sequential`` / ``nn.ModuleList``
   children opened when that shows repeated blocks below them;
2. accepts a container whose units are mostly (more than half, at least two) of one class, and takes
   those units, plus other units that are blocks in their own right (their own ``forward``), not a stem or
   head that is a bare sequence of layers;
3. prefers the finest level: when the accepted blocks each hold a chain of blocks with their own
   ``forward``, it takes those instead (a ConvNeXt stage's blocks, not the stage).  A chain is a plain
   ``nn.Sequential``, or a ``ModuleList`` of one repeated class (a stage's layers): a ``ModuleList`` of
   distinct classes is a block's sublayers (T5's attention and feed-forward), and mixture-of-experts'
   ``experts`` run side by side.  A module made only of torch's own layers (conv, norm, activation: a
   ResNet "conv layer", MobileNet's inner convolutions) is a layer, not a block.

A model with no repeated block (a ``Sequential`` stack of layers, a hand-written CNN, a U-Net) is planned as
a *chain* (:func:`chain_units`): its children in order, plain containers among them opened, so that the
planner can checkpoint runs of consecutive children of one ``nn.Sequential`` as one region
(:func:`chain_links`).

Example:
    >>> [name for name, _ in candidate_modules(remat.models.GPT())]
    ['blocks.0', 'blocks.1', 'blocks.2', 'blocks.3']
"""

from __future__ import annotations

import difflib
from collections import Counter
from collections.abc import Sequence

from torch import nn

__all__ = ["NoBlocks", "candidate_modules", "chain_links", "chain_units", "resolve_blocks"]

Named = list[tuple[str, nn.Module]]


def candidate_modules(model: nn.Module) -> Named:
    """The natural repeated blocks of ``model``, in the order of its modules.

    Example:
        >>> [name for name, _ in candidate_modules(remat.models.GPT())][:2]
        ['blocks.0', 'blocks.1']
    """
    found: Named = []
    taken: list[str] = []
    for name, module in model.named_modules():
        if any(name.startswith(prefix) for prefix in taken) or not _is_container(module):
            continue
        _, members = _repeated(_units(name, module))
        if members:
            found.extend(_finest(members))
            taken.append(f"{name}." if name else "")
    return found


def _is_container(module: nn.Module) -> bool:
    return isinstance(module, (nn.ModuleList, nn.Sequential))


def _is_plain(module: nn.Module) -> bool:
    """A container with no forward of its own: ModuleList, or a Sequential (subclass) that just chains."""
    return isinstance(module, nn.ModuleList) or (
        isinstance(module, nn.Sequential) and type(module).forward is nn.Sequential.forward
    )


def _may_be_block(module: nn.Module) -> bool:
    """Modules with children, or written by the user: a Linear or a ReLU alone is a layer, but a block may
    hold its parameters directly (or none: a chain of elementwise ops) and still be the unit to decide about."""
    return next(module.children(), None) is not None or not type(module).__module__.startswith("torch.nn.")


def _has_own_forward(module: nn.Module) -> bool:
    return not _is_plain(module) and next(module.children(), None) is not None


def _is_layer(module: nn.Module) -> bool:
    """Made only of torch's own leaf modules (conv, norm, activation): a layer, too small to be a block."""
    return all(type(c).__module__.startswith("torch.nn.") and next(c.children(), None) is None
               for c in module.children())


def _join(prefix: str, child: str) -> str:
    return f"{prefix}.{child}" if prefix else child


def _units(prefix: str, container: nn.Module) -> Named:
    """The container's children, with plain containers among them opened when that exposes blocks."""
    children = [(_join(prefix, n), c) for n, c in container.named_children()]
    opened: Named = []
    for name, child in children:
        if type(child) in (nn.Sequential, nn.ModuleList) and any(_has_own_forward(c) for c in child.children()):
            opened.extend(_units(name, child))
        else:
            opened.append((name, child))
    return opened


def _repeated(units: Named) -> tuple[type | None, Named]:
    """The class most of ``units`` share and the blocks among them; (None, []) if no class is a majority."""
    with_children = [(n, m) for n, m in units if _may_be_block(m)]
    if len(with_children) < 2:
        return None, []
    kind, count = Counter(_kind(m) for _, m in with_children).most_common(1)[0]
    if count < 2 or 2 * count <= len(units):
        return None, []
    cls = next(type(m) for _, m in with_children if _kind(m) == kind)
    return cls, [(n, m) for n, m in with_children if _kind(m) == kind or _has_own_forward(m)]


def _kind(module: nn.Module) -> object:
    """What makes two units the same block: their class, and for a plain container what it holds (a
    ``features`` and a ``head`` ``nn.Sequential`` are two different stretches of layers, not one block twice)."""
    if _is_plain(module):
        return type(module), tuple(_kind(child) for child in module.children())
    return type(module)


def _finest(members: Named) -> Named:
    """Blocks one level down when every member chains blocks of its own, else the members themselves."""
    inner: Named = []
    for name, member in members:
        chained: Named = []
        for chain_name, chain in _chains(name, member):
            cls, blocks = _repeated(_units(chain_name, chain))
            if cls is None and isinstance(chain, nn.ModuleList):
                blocks = []  # distinct sublayers of one block, not a chain of blocks
            elif cls is None:
                # a chain of a single block, or of distinct ones: its blocks with a forward of their own
                blocks = [b for b in _units(chain_name, chain) if _has_own_forward(b[1]) and not _is_layer(b[1])]
            elif not _has_own_forward(blocks[0][1]) or _is_layer(blocks[0][1]):
                blocks = []  # a chain of layers (conv, norm, activation) is a layer, not a block
            chained.extend(blocks)
        if not chained:
            return members
        inner.extend(chained)
    return _finest(inner) if len(inner) > len(members) else members


def _chains(prefix: str, module: nn.Module) -> Named:
    """The plain containers directly under ``module`` (itself, if it is a ``Sequential``) that may chain blocks."""
    if isinstance(module, nn.Sequential) and _is_plain(module):
        return [(prefix, module)]
    return [(_join(prefix, n), c) for n, c in module.named_children()
            if _is_plain(c) and not (isinstance(c, nn.ModuleList) and "expert" in n)]


def chain_units(model: nn.Module) -> Named:
    """The units of a model planned as a chain: its children in the order they were defined, with plain
    containers (``nn.Sequential``, ``nn.ModuleList``) among them opened, recursively.

    A run of consecutive children of one plain ``nn.Sequential`` can become one checkpointed region
    (:func:`chain_links`); a child of a module with its own forward is decided about alone.  Empty for a
    model without children (a single layer).

    Example:
        >>> [name for name, _ in chain_units(nn.Sequential(nn.Linear(4, 4), nn.GELU()))]
        ['0', '1']
    """
    return _opened("", model)


def _opened(prefix: str, module: nn.Module) -> Named:
    units: Named = []
    for name, child in module.named_children():
        if _is_plain(child):  # an empty one does nothing (a ModuleList never runs itself)
            units.extend(_opened(_join(prefix, name), child))
        else:
            units.append((_join(prefix, name), child))
    return units


def chain_links(model: nn.Module, names: Sequence[str]) -> list[bool]:
    """Per pair of neighbouring ``names``: whether they are consecutive children of one plain
    ``nn.Sequential``, whose own forward runs them one after the other, so one region may hold both.

    Example:
        >>> chain_links(nn.Sequential(nn.Linear(4, 4), nn.GELU(), nn.Linear(4, 4)), ["0", "1", "2"])
        [True, True]
    """
    named = dict(model.named_modules())
    links = []
    for first, second in zip(names, names[1:]):
        parent, _, a = first.rpartition(".")
        other, _, b = second.rpartition(".")
        container = named.get(parent)
        ok = (parent == other and isinstance(container, nn.Sequential) and _is_plain(container))
        if ok:
            order = list(container._modules)
            ok = a in order and b in order and order.index(b) == order.index(a) + 1
        links.append(ok)
    return links


class NoBlocks(ValueError):
    """A model with nothing to decide about: no repeated blocks and no children to plan as a chain.

    ``who`` names the caller; the message tells to name the blocks with ``modules=[...]`` (the command line
    says ``--modules``).
    """

    def __init__(self, who: str, model: nn.Module) -> None:
        self.who = who
        super().__init__(f"{who}: found no blocks to plan in {type(model).__name__}: no repeated blocks and no "
                         "children to checkpoint; name the blocks with modules=[...].")


def resolve_blocks(model: nn.Module, modules: Sequence[str] | None,
                   who: str = "remat.profile") -> list[tuple[str, nn.Module]]:
    """The blocks named ``modules`` (disjoint), or by default the repeated ones (:func:`candidate_modules`),
    or where a model has none its chain of children (:func:`chain_units`); :class:`NoBlocks` where there is
    nothing to plan, a ValueError naming ``who`` where a name is missing or one block holds another.

    Example:
        >>> resolve_blocks(remat.models.GPT(), ["blocks.0", "blocks.1"])
    """
    if modules is None:
        blocks = candidate_modules(model) or chain_units(model)
        if not blocks:
            raise NoBlocks(who, model)
        return blocks
    named = dict(model.named_modules())
    missing = [m for m in modules if m not in named]
    if missing:
        parent = missing[0].rpartition(".")[0]
        siblings = [f"{parent}.{n}" if parent else n for n, _ in named[parent].named_children()] \
            if parent in named else []
        close = difflib.get_close_matches(missing[0], [name for name in named if name], n=3) or siblings[:4]
        hint = f" (it has {', '.join(close)}{' ...' if close == siblings[:4] and len(siblings) > 4 else ''})" \
            if close else ""
        raise ValueError(f"{who}: {type(model).__name__} has no module named {missing[0]!r}{hint}; name modules as "
                         "model.named_modules() does, e.g. 'model.layers.0'.")
    nested = [(a, b) for a in modules for b in modules if a != b and b.startswith(a + ".")]
    if nested:
        raise ValueError(f"{who}: {nested[0][1]} is inside {nested[0][0]}; name disjoint blocks.")
    return [(m, named[m]) for m in modules]
