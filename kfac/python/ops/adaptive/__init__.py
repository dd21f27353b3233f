"""Adaptive K-FAC: the quadratic model and the learning rate and momentum
it chooses, the Levenberg-Marquardt damping rule and its controller, the
readable records, and the default recipe."""
