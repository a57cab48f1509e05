"""Tool calls in a model's text: its dialects, where one starts, how it is parsed."""
