"""Sampling from a policy: the sampler interface (base), the in-process JAX sampler (generate), the engine-backed
policy backends (policy_backend) and the OpenAI-compatible server over a sampler (server)."""
