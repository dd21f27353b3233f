"""The Fisher estimator and its parts: how estimation modes turn registered
losses into gradient sources (modes), the estimator with its
statistics, inverses and products parts (estimator), the placement policies (placement) and the placement strategies
by name (strategies)."""
