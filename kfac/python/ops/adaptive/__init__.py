"""Adaptive K-FAC: the quadratic model and the learning rate and momentum
it chooses, the damping controller (quadratic_model), the
Levenberg-Marquardt damping rule's math (damping_rule), and the default
recipe."""
