"""The LayerCollection: the registry of a model's layers and losses that
K-FAC approximates (layer 5; see layer_collection.py)."""
