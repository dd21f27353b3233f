"""Data readers whose batch size may change every step (kfac 0.2.x's
kfac_utils.data_reader and data_reader_alt)."""
