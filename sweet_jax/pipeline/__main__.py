"""`python -m sweet_jax.pipeline`: the command sweet_jax.commands.pipeline."""
from sweet_jax.commands import launch

launch("pipeline")
