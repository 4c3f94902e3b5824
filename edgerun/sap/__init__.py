"""Semantic-aware predictors: activation collection, training, runtime."""
