"""Self-speculation, engine-agnostic: the round of Algorithm 1 over the `Engine` protocol
(`round`), the truncation rule (`controller`) and the drafters (`drafters`)."""
