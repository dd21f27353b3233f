"""The Fisher estimator and its parts: how estimation modes turn registered
losses into gradient sources (modes), the estimator's core (estimator), its
products (products), statistics updates (statistics), inverse updates and
op assembly (update_ops), the device placement mixins (placement) and the
estimator classes of the placement strategies (strategies)."""
