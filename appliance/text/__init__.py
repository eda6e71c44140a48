"""Text front end: normalize, split into sentences, tokenize, speakers (no model, no torch)."""
