"""Request bookkeeping above the model runner: stop conditions, detokenization, output assembly."""
