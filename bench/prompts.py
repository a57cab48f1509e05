"""The chat prompts the throughput benchmarks send (bench_batching, bench_http): eight, so that
a batch of 8 holds distinct ones."""

PROMPTS = [
    "Write a short story about a lighthouse keeper.",
    "Explain how a bicycle stays upright.",
    "List some facts about the moon.",
    "Describe the water cycle.",
    "What makes a good cup of tea?",
    "Tell me about the history of Paris.",
    "How do bees make honey?",
    "Why is the sky blue?",
]
