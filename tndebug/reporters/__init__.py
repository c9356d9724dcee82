"""Reporters format a Report and stream metrics; they never decide anything.

console.py (rich), markdown.py, tensorboard.py (the only TensorBoard import), plots.py (PNGs).
"""
