"""`kfac.keras.optimizers.Kfac`, K-FAC as a Keras optimizer, by concern."""
