"""Synthetic tasks: multi-query associative recall and the small transformer trained on it."""
