"""Embeddings (sparse one-hot inputs): factors, blocks and registration."""
