"""The whole SWEET-RL comparison as a graph of stages (stages), each calling the library the commands call.

Nothing is imported here: `python -m sweet_jax.pipeline` imports this package before the command's launcher runs.
"""
