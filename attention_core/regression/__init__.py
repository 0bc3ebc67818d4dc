"""Chapter 1's task: one-dimensional regression data for Nadaraya-Watson and its trained kernel.

- :mod:`~attention_core.regression.data`: the target function, noisy training samples, a test grid.
"""
