"""remat vs torch.utils.checkpoint vs no checkpointing: see ``remat.bench`` (also ``remat bench``)."""

from remat.tools.bench import main

if __name__ == "__main__":
    main()
