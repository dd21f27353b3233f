"""Adaptive K-FAC: the quadratic model, the learning rate and momentum it
chooses, the Levenberg-Marquardt damping rule, and the default recipe."""
