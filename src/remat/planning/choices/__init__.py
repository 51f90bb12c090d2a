"""Options and fronts: what each block (or run of blocks) may become in a plan, and the rules
people checkpoint by, as choices of those options.
"""
