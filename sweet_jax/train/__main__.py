"""`python -m sweet_jax.train`: the command sweet_jax.commands.train."""
from sweet_jax.commands import launch

launch("train")
