"""Serving benchmark (`pdserve bench`), measuring any OpenAI-compatible server like vLLM's.

- ``metrics``: metric definitions and math (TTFT, ITL, TPOT, E2EL, throughput, goodput)
- ``client``: one streamed, timed request (SSE decoding, request bodies)
- ``arrivals``: Poisson/gamma arrival schedules and trace offsets
- ``datasets``: random, shared-prefix, mixed and JSONL-trace workloads of exact token lengths
- ``word_tokenizer``: the ``builtin`` tokenizer and the tokenizer loader the datasets use
- ``serve``: the load generator (warm-up, arrivals, concurrency limit, progress bar)
- ``report``: results table, result JSON and its validator
- ``plot`` / ``sweep``: PNG charts and concurrency/rate sweeps
- ``machine`` / ``floors``: the machine's measured matmul and copy rates, and a run's hardware
  floors computed from them
- ``suite``: the serving suite behind ``make bench`` (bench/serving_suite.py)
"""
