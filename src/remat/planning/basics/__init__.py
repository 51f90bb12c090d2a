"""What every stage uses: budgets and bytes as people write them, the model's blocks, a step's
memory, the block policies a plan installs, and what a profile must leave as it found it.
"""
