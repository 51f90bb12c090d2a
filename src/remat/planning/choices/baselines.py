"""The rules people checkpoint by, as choices of options: what a plan must never lose to.

* ``every-k`` — ``n`` of the chain's ``L`` blocks checkpointed, spread evenly (block ``floor(j * L / n)`` for
  ``j < n``), for every ``n``: ``n = L`` is checkpointing every block, ``n = 0`` none;
* ``offloaded inputs`` — every block checkpointed with its inputs in host memory, but the last, checkpointed
  plainly (``apply_activation_checkpointing(..., offload_inputs=True)``; Unsloth's "offloaded gradient
  checkpointing").

Each is a list of :class:`~remat.planning.choices.options.BlockOption` (one per block), so the solver prices it on its
own cost model (:func:`remat.planning.solve.solver.predict`) and takes it where it beats what its search found: a plan
is never worse on both memory and time than a rule it can express.

Example:
    >>> [rule.name for rule in rules(chain_options(prof))][:3]
    ['every-k 0 of 12', 'every-k 1 of 12', 'every-k 2 of 12']
"""

from __future__ import annotations

from dataclasses import dataclass

from .options import BlockOption

__all__ = ["Rule", "rules", "spread"]


@dataclass(frozen=True)
class Rule:
    """A rule's name and its choice of one option per block.

    Example:
        >>> Rule("every-k 0 of 2", (keep, keep)).checkpointed
        0
    """

    name: str
    chosen: tuple[BlockOption, ...]

    @property
    def checkpointed(self) -> int:
        """How many blocks the rule recomputes."""
        return sum(option.recomputes for option in self.chosen)


def spread(count: int, blocks: int) -> list[int]:
    """The ``count`` of ``blocks`` positions an evenly spread rule checkpoints.

    Example:
        >>> spread(9, 12)
        [0, 1, 2, 4, 5, 6, 8, 9, 10]
    """
    return [j * blocks // count for j in range(count)]


def _first(options: list[BlockOption], name: str) -> BlockOption | None:
    return next((o for o in options if o.name == name and o.span == 1), None)


def rules(options: list[list[BlockOption]]) -> list[Rule]:
    """The rules ``options`` can express, each as one option per block (see the module docstring).

    A rule that needs an option some block lacks (a block that did not run has no ``checkpoint``; on the CPU no
    block has ``checkpoint_offload``) is left out.

    Example:
        >>> [r.checkpointed for r in rules(chain_options(prof))]
        [0, 1, 2, ..., 12, 12]
    """
    blocks = len(options)
    keep = [choices[0] for choices in options]
    checkpoint = [_first(choices, "checkpoint") for choices in options]
    found = []
    for count in range(blocks + 1):
        chosen = list(keep)
        for p in spread(count, blocks):
            chosen[p] = checkpoint[p]
        if all(option is not None for option in chosen):
            found.append(Rule(f"every-k {count} of {blocks}", tuple(chosen)))
    moved = [_first(choices, "checkpoint_offload") for choices in options[:-1]]
    if blocks and all(option is not None for option in (*moved, checkpoint[-1])):
        found.append(Rule("offloaded inputs", (*moved, checkpoint[-1])))
    return found
