"""Text front end (no model, no torch): normalize (scripts -> spans -> rules/wetext -> numbers,
units), split into sentences with their token ids, tokenize, speakers; dryrun for ``normalize``."""
