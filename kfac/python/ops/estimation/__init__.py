"""The Fisher estimator's parts: how estimation modes turn registered losses
into gradient sources."""
