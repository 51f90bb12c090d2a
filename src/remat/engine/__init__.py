"""The engine: how a checkpointed region forgets its activations in forward and rebuilds them in backward.

Replay state (RNG, autocast), the non-reentrant frame with its two saved-tensor hooks, the reentrant
variant, and the determinism checks and debug traces that explain a mismatch.
"""
