"""Schedules: hyperparameters and batch sizes as functions of the step."""
