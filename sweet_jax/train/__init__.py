"""Training: the loop (trainer), the pure loss and step functions (losses, steps), the optimiser, checkpoints,
metrics, the run directory (rundir: records and provenance; loading: models and tokenizers of a run or an HF
directory; export), the data passes and the ahead-of-time plan for a TPU slice.

Nothing is imported here: `python -m sweet_jax.train` imports this package before the command's launcher runs.
"""
