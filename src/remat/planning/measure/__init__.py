"""Measurement: the device clock and the times kept per machine, each block's op graph, the
prices of rerunning it, the step's timeline of live bytes and its copies to host memory.
"""
