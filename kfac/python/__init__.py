"""Contrib-style layout: kfac.python.ops holds the core."""
