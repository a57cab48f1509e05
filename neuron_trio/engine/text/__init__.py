"""Text: the tokenizer, chat templates, tool calls, stop strings, each sequence's text pipeline,
and the grammars that constrain what may be written."""
