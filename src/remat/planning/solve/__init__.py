"""The plan: the solver that picks one option per block under a budget, the ``Plan`` it returns,
the runners-up and rules beside it, the chunked output layer as an option, one plan per rank.
"""
