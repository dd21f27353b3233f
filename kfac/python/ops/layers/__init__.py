"""Curvature blocks by layer family: each subpackage holds the family's
factors (statistics), blocks (preconditioning) and registration, over the
shared bases of layers/base."""
