"""The Fisher estimator and its parts: how estimation modes turn registered
losses into gradient sources (modes), the estimator (estimator), its
statistics part (statistics), inverses part (inverses) and products part
(products), the placement policies (placement) and the placement strategies
by name (strategies)."""
