"""Planning, as a pipeline: discovery -> measurement -> options and fronts -> solver -> ``Plan``.

Each module imports only the stages before it; :mod:`.workflow` is the front door (``profile``, ``plan``).
"""
