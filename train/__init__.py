"""Training the built-in demo model (issue 5): corpus, tokenizer, training loop."""
