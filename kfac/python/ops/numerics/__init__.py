"""Linear algebra: damped inverses, Cholesky and eigendecompositions with the
float64 retry, Kronecker products, and the blocked routines used under XLA
on CPU."""
