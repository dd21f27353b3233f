"""Convolutions: patch extraction, KFC factors, blocks and registration."""
