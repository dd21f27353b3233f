"""The loss functions: predictive distributions and their curvature."""
