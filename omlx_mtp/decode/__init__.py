"""The speculative decoding loop: target capture, drafting, acceptance, cache commit."""
