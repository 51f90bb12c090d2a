"""The drop-in entry points: ``checkpoint``, ``checkpoint_sequential`` and the module wrappers."""
