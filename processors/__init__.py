"""Judging: proposals in offset order, their verdicts, and the worker services around them."""
