"""The reinforcement-learning loop over the environments: episodes (rollouts and collection), the critic's ranking
of candidate replies into DPO pairs, the diagnostics and probes of a run, and the results tables."""
