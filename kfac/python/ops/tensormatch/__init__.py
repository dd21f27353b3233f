"""Graph search: automatic layer registration by pattern matching the graph
(graph_search.register_layers, LayerCollection.auto_register_layers)."""
