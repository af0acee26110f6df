"""The serving suite behind ``make bench`` (issue 15): one run, the machine's rates, pdserve in
both modes (and vLLM beside it), the main and mixed workloads, floors, a table and plots.

- ``workloads``: the two workloads, full and ``--quick`` sizes, and the seed of every run
- ``servers``: start a server (pdserve or the vLLM peer) on free loopback ports, wait, stop by pid
- ``mixed``: short requests beside a paced stream of long prompts (two clients at once)
- ``vllm_peer``: the peer script (serve, its own bench client, its HF copy of the weights)
- ``runner``: the orchestration and the results directory
- ``records``: one run's headline numbers and floors, read from its result file
- ``table``: the markdown tables for docs/benchmarks.md
"""
