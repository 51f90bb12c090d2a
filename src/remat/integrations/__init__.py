"""Integrations with other libraries, imported on demand (``import remat`` needs only torch)."""
