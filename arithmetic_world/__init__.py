"""The embedded arithmetic world: task, oracle, tokenizer, small models and their training."""
