"""Scale-and-shift parameters (normalisation layers): factors, blocks and
registration."""
