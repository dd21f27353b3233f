"""The bases every layer family builds on: factors, blocks, registration,
damping functions and the curvature options."""
