"""Supervised fine-tuning (`method.type = "supervised"`): OpenAI's chat JSONL rendered exactly as
rollouts are, a cross-entropy step on the assistant tokens, in the shared training lifecycle."""
