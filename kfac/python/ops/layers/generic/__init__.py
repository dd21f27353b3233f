"""Any variable, with full or diagonal curvature: factors and blocks."""
