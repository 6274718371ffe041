"""Text <-> token ids: loading a checkpoint's tokenizer and chat template (tokenizer), re-using the tokens of
a recent prompt a new one starts with (prefix_token_cache), incremental detokenization with stop strings
(detokenizer), and the server's worker-thread pool over them (pool). Imports nothing above the engine."""
