"""Evaluation: perplexity with the real compressed cache."""
from dmc.eval.perplexity import (
    evaluate_perplexity,
    load_token_sequences,
    model_perplexity,
    token_windows,
)

__all__ = ["evaluate_perplexity", "load_token_sequences", "model_perplexity", "token_windows"]
